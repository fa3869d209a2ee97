"""Tests of aligner_jax/t5x_import.py on tiny T5X checkpoints written here.

The classic layout is written by hand the way t5x's Checkpointer does it: a msgpack file
``checkpoint_<step>/checkpoint`` holding ``{"version": 3, "optimizer": {"target": ...,
"state": ...}}`` (numpy arrays as msgpack ExtType 1, as flax.serialization encodes them) in which
large arrays are replaced by tensorstore zarr specs with a path relative to the step directory
(``target.encoder.layers_0.attention.key.kernel``). The orbax layout is written with orbax.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import pytest
import tensorstore as ts
from fixtures import TINY_T5_IMPORT
from flax import linen as nn
from flax import traverse_util

from aligner_jax.common import errors
from aligner_jax.models import t5
from aligner_jax.weights import t5x_import

CFG = TINY_T5_IMPORT
# Parameters written into the msgpack file itself (t5x does this for unpartitioned arrays).
INLINE = ("encoder/encoder_norm/scale", "encoder/layers_1/pre_mlp_layer_norm/scale")
# Written as bfloat16 in tensorstore, to check the cast to the float32 param dtype.
BF16 = ("encoder/layers_0/mlp/wo/kernel",)


def _encode(tree):
    """msgpack-encodes a nested dict whose leaves are numpy arrays, as flax.serialization does."""

    def convert(x):
        if isinstance(x, dict):
            return {k: convert(v) for k, v in x.items()}
        if isinstance(x, np.ndarray):
            payload = msgpack.packb(
                (list(x.shape), x.dtype.name, x.tobytes("C")), use_bin_type=True
            )
            return msgpack.ExtType(1, payload)
        return x

    return msgpack.packb(convert(tree), use_bin_type=True)


def _write_tensorstore(step_dir: str, name: str, array: np.ndarray) -> dict:
    """Writes ``array`` as a zarr array named like t5x does; returns the relative spec."""
    relative = name.replace("/", ".")
    dtype = "bfloat16" if array.dtype == ml_dtypes.bfloat16 else array.dtype.name
    metadata = {
        "compressor": {"id": "gzip"},
        "shape": list(array.shape),
        "chunks": list(array.shape),
    }
    store = ts.open(
        {
            "driver": "zarr",
            "dtype": dtype,
            "kvstore": {"driver": "file", "path": os.path.join(step_dir, relative)},
            "metadata": metadata,
        },
        create=True,
    ).result()
    store.write(array).result()
    return {
        "driver": "zarr",
        "dtype": dtype,
        "kvstore": {"driver": "file", "path": relative},
        "metadata": metadata,
    }


def _other_entries(rng: np.random.Generator) -> tuple[dict, dict]:
    """Decoder / logits params and Adafactor-like optimizer state that must be ignored."""
    decoder = {
        "decoder/layers_0/self_attention/query/kernel": rng.normal(size=(16, 16)),
        "decoder/relpos_bias/rel_embedding": rng.normal(size=(2, 32)),
        "decoder/decoder_norm/scale": np.ones(16),
        "decoder/logits_dense/kernel": rng.normal(size=(16, 40)),
    }
    state = {
        "step": np.asarray(1000, np.int32),
        "param_states/encoder/layers_0/attention/query/kernel/v_row": rng.normal(size=(16,)),
        "param_states/encoder/layers_0/attention/query/kernel/v_col": rng.normal(size=(16,)),
        "param_states/token_embedder/embedding/v": rng.normal(size=(40, 16)),
    }
    as_f32 = lambda d: {
        k: np.asarray(v, np.float32 if k != "step" else np.int32) for k, v in d.items()
    }
    return as_f32(decoder), as_f32(state)


def write_classic_checkpoint(
    model_dir: str,
    step: int,
    target: dict[str, np.ndarray],
    state: dict[str, np.ndarray],
    *,
    inline=INLINE,
    broken=(),
) -> str:
    """A T5X (v3, tensorstore) checkpoint; names in ``broken`` point at missing arrays."""
    step_dir = os.path.join(model_dir, f"checkpoint_{step}")
    os.makedirs(step_dir)
    written = {}
    for prefix, arrays in (("target", target), ("state", state)):
        for name, array in arrays.items():
            full = f"{prefix}/{name}"
            if name in inline or array.ndim == 0:
                written[full] = np.asarray(array)
            elif full in broken:
                spec = _write_tensorstore(step_dir, full, array)
                spec["kvstore"]["path"] = "does.not.exist"
                written[full] = spec
            else:
                written[full] = _write_tensorstore(step_dir, full, array)
    tree = traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in written.items()})
    with open(os.path.join(step_dir, "checkpoint"), "wb") as f:
        f.write(_encode({"version": 3, "optimizer": tree}))
    return step_dir


@pytest.fixture(scope="module")
def original():
    """Tiny encoder params (flat '/'-paths) with non-trivial norm scales."""
    params = nn.unbox(t5.init_t5_encoder(CFG, jax.random.key(7)))["params"]
    flat = {k: np.asarray(v) for k, v in traverse_util.flatten_dict(params, sep="/").items()}
    rng = np.random.default_rng(0)
    for name in flat:
        if name.endswith("/scale"):
            flat[name] = (1.0 + 0.1 * rng.normal(size=flat[name].shape)).astype(np.float32)
    for name in BF16:
        flat[name] = flat[name].astype(ml_dtypes.bfloat16)
    return flat


@pytest.fixture(scope="module")
def classic_dir(tmp_path_factory, original):
    model_dir = str(tmp_path_factory.mktemp("t5x_model"))
    decoder, state = _other_entries(np.random.default_rng(1))
    # Decoder arrays point at missing files: importing must never try to read them.
    broken = tuple(f"target/{name}" for name in decoder) + (
        "state/param_states/token_embedder/embedding/v",
    )
    write_classic_checkpoint(model_dir, 1000, {**original, **decoder}, state, broken=broken)
    return model_dir


def _as_expected(original):
    return {k: np.asarray(v, np.float32) for k, v in original.items()}


def _assert_params_equal(imported, original):
    flat = traverse_util.flatten_dict(imported, sep="/")
    expected = _as_expected(original)
    assert set(flat) == set(expected)
    for name, value in flat.items():
        assert isinstance(value, np.ndarray) and value.dtype == np.float32, name
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_classic_checkpoint_roundtrip_and_same_encoder_output(classic_dir, original):
    imported = t5x_import.load_t5x_encoder(os.path.join(classic_dir, "checkpoint_1000"), CFG)
    _assert_params_equal(imported, original)
    assert set(imported) == {"token_embedder", "encoder"}

    ids = jnp.array([[3, 9, 21, 4, 0, 0], [5, 6, 7, 8, 9, 10]], jnp.int32)
    mask = ids > 0
    reference_params = traverse_util.unflatten_dict(
        {tuple(k.split("/")): jnp.asarray(v) for k, v in _as_expected(original).items()}
    )
    model = t5.T5Encoder(CFG)
    expected = model.apply({"params": reference_params}, ids, mask)
    got = model.apply({"params": imported}, ids, mask)
    np.testing.assert_array_equal(got, expected)
    assert float(jnp.max(jnp.abs(got))) > 0.1


@pytest.mark.parametrize("where", ["model_dir", "model_dir_step", "msgpack_file"])
def test_checkpoint_path_forms(classic_dir, original, where):
    path, step = {
        "model_dir": (classic_dir, None),
        "model_dir_step": (classic_dir, 1000),
        "msgpack_file": (os.path.join(classic_dir, "checkpoint_1000", "checkpoint"), None),
    }[where]
    _assert_params_equal(t5x_import.load_t5x_encoder(path, CFG, step=step), original)


def test_latest_step_is_taken(tmp_path, original):
    decoder, state = _other_entries(np.random.default_rng(2))
    older = {k: np.zeros_like(v) for k, v in original.items()}
    write_classic_checkpoint(str(tmp_path), 5, older, state, inline=tuple(original))
    write_classic_checkpoint(
        str(tmp_path), 20, {**original, **decoder}, state, inline=tuple(original)
    )
    _assert_params_equal(t5x_import.load_t5x_encoder(str(tmp_path), CFG), original)
    step5 = t5x_import.load_t5x_encoder(str(tmp_path), CFG, step=5)
    assert all(not np.any(v) for v in jax.tree_util.tree_leaves(step5))
    with pytest.raises(
        errors.T5XCheckpointError, match=r"No checkpoint_7 in .*available steps: \[5, 20\]"
    ):
        t5x_import.load_t5x_encoder(str(tmp_path), CFG, step=7)


def test_shape_mismatch_names_checkpoint_and_parameter(classic_dir):
    wrong = dataclasses.replace(CFG, mlp_dim=32)
    with pytest.raises(errors.T5XCheckpointError) as err:
        t5x_import.load_t5x_encoder(classic_dir, wrong)
    message = str(err.value)
    assert os.path.join(classic_dir, "checkpoint_1000") in message
    assert "'target/encoder/layers_0/mlp/wi_0/kernel' has shape (16, 24)" in message
    assert "expects (16, 32)" in message
    with pytest.raises(
        errors.T5XCheckpointError, match=r"token_embedder/embedding' has shape \(40, 16\)"
    ):
        t5x_import.load_t5x_encoder(classic_dir, dataclasses.replace(CFG, vocab_size=32128))


def test_missing_parameter_is_reported(tmp_path, classic_dir, original):
    with pytest.raises(errors.T5XCheckpointError) as err:
        t5x_import.load_t5x_encoder(classic_dir, dataclasses.replace(CFG, num_layers=3))
    assert "has no parameter 'target/encoder/layers_2/" in str(err.value)
    assert "checkpoint_1000" in str(err.value)

    _, state = _other_entries(np.random.default_rng(3))
    partial = {k: v for k, v in original.items() if k != "encoder/relpos_bias/rel_embedding"}
    write_classic_checkpoint(str(tmp_path), 1, partial, state)
    with pytest.raises(
        errors.T5XCheckpointError,
        match="has no parameter 'target/encoder/relpos_bias/rel_embedding'",
    ):
        t5x_import.load_t5x_encoder(str(tmp_path), CFG)


def test_unexpected_encoder_parameter_is_reported(classic_dir):
    with pytest.raises(
        errors.T5XCheckpointError,
        match=r"encoder parameter 'target/encoder/layers_1/.*T5Config.num_layers",
    ):
        t5x_import.load_t5x_encoder(classic_dir, dataclasses.replace(CFG, num_layers=1))


def test_missing_tensorstore_array_is_reported(tmp_path, original):
    _, state = _other_entries(np.random.default_rng(4))
    write_classic_checkpoint(
        str(tmp_path), 3, original, state, broken=("target/encoder/layers_0/attention/out/kernel",)
    )
    with pytest.raises(
        errors.T5XCheckpointError,
        match="cannot open the tensorstore array of 'target/encoder/layers_0/attention/out/kernel'",
    ):
        t5x_import.load_t5x_encoder(str(tmp_path), CFG)


def test_orbax_checkpoint_roundtrip(tmp_path, original):
    import orbax.checkpoint as ocp

    decoder, state = _other_entries(np.random.default_rng(5))
    target = traverse_util.unflatten_dict(
        {tuple(k.split("/")): np.asarray(v) for k, v in {**original, **decoder}.items()}
    )
    tree = {
        "target": target,
        "state": traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in state.items()}),
    }
    state_dir = tmp_path / "checkpoint_300" / "state"
    ocp.PyTreeCheckpointer().save(state_dir, tree)
    for path in (tmp_path, tmp_path / "checkpoint_300", state_dir):
        _assert_params_equal(t5x_import.load_t5x_encoder(path, CFG), original)
    with pytest.raises(
        errors.T5XCheckpointError,
        match=r"layers_0/mlp/wi_0/kernel' has shape \(16, 24\) .*expects \(16, 8\)",
    ):
        t5x_import.load_t5x_encoder(tmp_path, dataclasses.replace(CFG, mlp_dim=8))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(errors.T5XCheckpointError, match="does not exist"):
        t5x_import.load_t5x_encoder(tmp_path / "nope", CFG)
    with pytest.raises(errors.T5XCheckpointError, match="is not a T5X checkpoint"):
        t5x_import.load_t5x_encoder(tmp_path, CFG)
    tf_dir = tmp_path / "checkpoint_1"
    tf_dir.mkdir()
    (tf_dir / "checkpoint").write_bytes(b'model_checkpoint_path: "model.ckpt-1"\n')
    with pytest.raises(errors.T5XCheckpointError, match="TensorFlow"):
        t5x_import.load_t5x_encoder(tf_dir, CFG)
    no_target = tmp_path / "checkpoint_2"
    no_target.mkdir()
    (no_target / "checkpoint").write_bytes(_encode({"version": 3, "optimizer": {"state": {}}}))
    with pytest.raises(errors.T5XCheckpointError, match="no 'target'"):
        t5x_import.load_t5x_encoder(no_target, CFG)


def test_expected_encoder_shapes():
    shapes = t5x_import.expected_encoder_shapes(CFG)
    assert shapes["token_embedder/embedding"] == (40, 16)
    assert shapes["encoder/layers_1/attention/out/kernel"] == (16, 16)
    assert shapes["encoder/relpos_bias/rel_embedding"] == (2, 32)
    assert len(shapes) == 3 + 2 * 9


def test_orbax_checkpoint_manager_layout(tmp_path, original):
    """t5x's OrbaxCheckpointManagerInterface: ``checkpoint_<step>/`` holds
    ``_CHECKPOINT_METADATA`` and the item folder ``state/`` whose tree is ``{'target': params}``.
    The step folder itself is not the orbax tree (the old importer read it and found no
    'target')."""
    import orbax.checkpoint as ocp

    decoder, _ = _other_entries(np.random.default_rng(6))
    target = traverse_util.unflatten_dict(
        {tuple(k.split("/")): np.asarray(v) for k, v in {**original, **decoder}.items()}
    )
    options = ocp.CheckpointManagerOptions(step_prefix="checkpoint")
    with ocp.CheckpointManager(tmp_path, options=options) as manager:
        manager.save(8, args=ocp.args.Composite(state=ocp.args.PyTreeSave({"target": target})))
        manager.wait_until_finished()
    step_dir = tmp_path / "checkpoint_8"
    assert (step_dir / "_CHECKPOINT_METADATA").exists() and (step_dir / "state").is_dir()
    for path in (tmp_path, step_dir, step_dir / "state"):
        _assert_params_equal(t5x_import.load_t5x_encoder(path, CFG), original)
    assert t5x_import.resolve_checkpoint(step_dir) == ("orbax", step_dir / "state")
