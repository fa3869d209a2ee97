"""Stage 4's compiled pass (``retrieval.residual_max``) equals the NumPy passes it replaces:
the residual scores from the packed levels (``ResidualCodec.residual_scores``), then each
document's maxima with the u^d of the selected row (``gather_max``)."""

import subprocess
import sys

import numpy as np
import pytest

from aligner_jax.indexing.codec import ResidualCodec
from aligner_jax.retrieval import centroid_search as cs
from aligner_jax.retrieval import gather_max, residual_max


def _case(seed: int, bits: int, n: int, ties: bool = False):
    rng = np.random.default_rng(seed)
    dim, centroids = 13, 7  # an odd width: the codec pads it to its planes
    lengths = rng.integers(0, 7, 30)  # documents of no rows included, odd and even lengths
    lengths[:3] = (0, 1, 2)
    rows = int(lengths.sum())
    codec = ResidualCodec.fit(0.1 * rng.standard_normal((300, dim)).astype(np.float32), bits)
    residuals = 0.1 * rng.standard_normal((rows, dim)).astype(np.float32)
    if ties:  # rows repeated within a document: the same scores, u^d must pick the largest
        residuals[1::2] = residuals[::2][: len(residuals[1::2])]
    packed = codec.encode(residuals)
    codes = rng.integers(0, centroids, rows)
    if ties:
        codes[1::2] = codes[::2][: len(codes[1::2])]
    queries = rng.standard_normal((n, dim)).astype(np.float32)
    s_t = rng.standard_normal((centroids, n)).astype(np.float32)
    u_d = rng.random(rows).astype(np.float32)
    return codec, queries, s_t, codes, packed, lengths, u_d


def _numpy_passes(codec, queries, s_t, codes, packed, lengths, u_d):
    add = codec.residual_scores(queries, packed, token_major=True)
    return cs.segment_max(np.take(s_t, codes, axis=0) + add, lengths, at_max=u_d)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 3, 4, 9])  # query tokens: the four-wide tile and its tail
def test_compiled_pass_equals_residual_scores_then_segment_max(bits, n):
    codec, queries, s_t, codes, packed, lengths, u_d = _case(bits + n, bits, n)
    want_best, want_sel = _numpy_passes(codec, queries, s_t, codes, packed, lengths, u_d)
    best, sel = residual_max.residual_segment_max(
        codec, queries, s_t, codes, packed, lengths, at_max=u_d
    )
    assert best.shape == sel.shape == (len(lengths), n)
    empty = lengths == 0
    assert np.isneginf(best[empty]).all() and np.isneginf(sel[empty]).all()
    assert np.isfinite(best[~empty]).all()
    np.testing.assert_allclose(best[~empty], want_best[~empty], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(sel, want_sel)
    alone = residual_max.residual_segment_max(codec, queries, s_t, codes, packed, lengths)
    np.testing.assert_array_equal(alone, best)  # without u^d: the maxima alone


def test_ties_select_the_largest_salience_among_the_rows_at_the_maximum():
    codec, queries, s_t, codes, packed, lengths, u_d = _case(7, 4, 5, ties=True)
    _, want_sel = _numpy_passes(codec, queries, s_t, codes, packed, lengths, u_d)
    _, sel = residual_max.residual_segment_max(
        codec, queries, s_t, codes, packed, lengths, at_max=u_d
    )
    np.testing.assert_array_equal(sel, want_sel)
    # the case exists: a selected u^d that is not the first row's at the maximum
    first = cs.segment_max(
        np.take(s_t, codes, axis=0) + codec.residual_scores(queries, packed, token_major=True),
        lengths,
        at_max=np.where(np.arange(len(u_d)) % 2 == 0, u_d, -1.0).astype(np.float32),
    )[1]
    assert (sel > first).any()


@pytest.mark.parametrize("threads", [2, 3, 8, 64])
def test_document_groups_on_threads_give_the_one_thread_result_bit_for_bit(threads):
    codec, queries, s_t, codes, packed, lengths, u_d = _case(11, 4, 6)
    one = residual_max.residual_segment_max(
        codec, queries, s_t, codes, packed, lengths, at_max=u_d, threads=1
    )
    for _ in range(2):
        many = residual_max.residual_segment_max(
            codec, queries, s_t, codes, packed, lengths, at_max=u_d, threads=threads
        )
        for a, b in zip(many, one, strict=True):
            np.testing.assert_array_equal(a, b)


def test_no_documents_and_no_numba_paths(monkeypatch):
    codec, queries, s_t, codes, packed, lengths, u_d = _case(5, 2, 3)
    best, sel = residual_max.residual_segment_max(
        codec, queries, s_t, codes[:0], packed[:0], lengths[:0], at_max=u_d[:0], threads=2
    )
    assert best.shape == sel.shape == (0, 3)
    compiled = residual_max.residual_segment_max(
        codec, queries, s_t, codes, packed, lengths, at_max=u_d
    )
    monkeypatch.setattr(residual_max, "numba", None)
    numpy_path = residual_max.residual_segment_max(
        codec, queries, s_t, codes, packed, lengths, at_max=u_d, reference=cs.segment_max
    )
    np.testing.assert_allclose(numpy_path[0], compiled[0], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(numpy_path[1], compiled[1])
    assert gather_max.numba is not None  # the NumPy path above went through gather_max


def test_warm_up_compiles_the_pass_that_searches_then_reuse():
    """``Searcher.load`` calls ``warm_up``: afterwards refinement's calls (any codec width, the
    index's uint16 codes, float16 saliences or none) compile nothing."""
    code = (
        "import numpy as np\n"
        "from aligner_jax.indexing.codec import ResidualCodec\n"
        "from aligner_jax.retrieval import residual_max as r\n"
        "assert not r._residual_max.signatures\n"
        "r.warm_up()\n"
        "warm = list(r._residual_max.signatures)\n"
        "rng = np.random.default_rng(0)\n"
        "for bits in (2, 8):\n"
        "    codec = ResidualCodec.fit(rng.standard_normal((50, 6)).astype(np.float32), bits)\n"
        "    packed = codec.encode(rng.standard_normal((3, 6)).astype(np.float32))\n"
        "    s = np.ones((4, 2), np.float32)\n"
        "    codes = np.array([0, 3, 1], np.uint16)\n"
        "    r.residual_segment_max(codec, np.ones((2, 6), np.float32), s, codes, packed,\n"
        "                           np.array([2, 1]), at_max=np.ones(3, np.float16), threads=2)\n"
        "    r.residual_segment_max(codec, np.ones((2, 6), np.float32), s, codes, packed,\n"
        "                           np.array([2, 1]))\n"
        "assert len(warm) == 1 and list(r._residual_max.signatures) == warm, warm\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
