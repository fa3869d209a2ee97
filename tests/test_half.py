"""float16 → float32 conversion (``common.half``): bit for bit NumPy's cast."""

import numpy as np
import pytest

from aligner_jax.common import half


def test_every_half_converts_as_numpy_casts_it():
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    out = np.full(halves.shape, 7.0, np.float32)
    half.to_float32(halves, out)
    expected = halves.astype(np.float32)
    # bitwise: signed zeros, subnormals, infinities and NaN payloads included
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
    assert np.signbit(out[0x8000]) and out[0x8000] == 0.0
    assert out[0x0001] == np.float32(2.0**-24) and out[0x7C00] == np.inf


def test_matrices_and_strided_inputs():
    rng = np.random.default_rng(0)
    vectors = (rng.normal(size=(37, 16)) * 1e-3).astype(np.float16)  # subnormals among them
    out = np.empty((37, 16), np.float32)
    np.testing.assert_array_equal(half.to_float32(vectors, out), vectors.astype(np.float32))
    strided = vectors[:, ::2]  # not contiguous: NumPy's cast, same values
    out = np.empty(strided.shape, np.float32)
    np.testing.assert_array_equal(half.to_float32(strided, out), strided.astype(np.float32))


def test_shapes_must_match():
    with pytest.raises(ValueError, match=r"shapes \(3,\) and \(4,\) differ"):
        half.to_float32(np.zeros(3, np.float16), np.zeros(4, np.float32))
