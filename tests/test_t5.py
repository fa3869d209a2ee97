"""Tests of the T5 v1.1 encoder (aligner_jax/models/t5.py) and the gin/models/t5_*.gin files."""

from __future__ import annotations

import dataclasses
import math

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixtures import LOGICAL_AXES, REPO, TINY_T5, scatter_add_dtypes
from flax import linen as nn
from flax import traverse_util

from aligner_jax.models import partitioning, t5

TINY = TINY_T5


@pytest.fixture(scope="module")
def boxed_variables():
    return t5.init_t5_encoder(TINY, jax.random.key(0))


@pytest.fixture(scope="module")
def params(boxed_variables):
    return nn.unbox(boxed_variables)["params"]


def _batch():
    """Two right-padded sequences of real lengths 5 and 3 (length 6)."""
    ids = np.array([[5, 9, 17, 33, 2, 0], [7, 12, 40, 0, 0, 0]], np.int32)
    return jnp.asarray(ids), jnp.asarray(ids > 0)


# ---------------------------------------------------------------- config


def test_config_defaults_are_t5_v1_1_base():
    cfg = t5.T5Config()
    assert (cfg.vocab_size, cfg.emb_dim, cfg.num_heads, cfg.num_layers) == (32128, 768, 12, 12)
    assert (cfg.head_dim, cfg.mlp_dim, cfg.mlp_activations) == (64, 2048, ("gelu", "linear"))
    assert cfg.relative_attention_num_buckets == 32
    assert cfg.relative_attention_max_distance == 128
    assert cfg.compute_dtype == jnp.float32 and cfg.params_dtype == jnp.float32
    assert cfg.mlp_input_names() == ("wi_0", "wi_1")
    assert dataclasses.replace(cfg, mlp_activations=("relu",)).mlp_input_names() == ("wi",)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("dtype", "float16", "T5Config.dtype='float16' is not supported"),
        ("param_dtype", "int8", "T5Config.param_dtype='int8' is not supported"),
        ("num_layers", 0, "T5Config.num_layers must be a positive integer"),
        ("relative_attention_num_buckets", 31, "relative_attention_num_buckets must be an even"),
        ("mlp_activations", ("gelu", "tanh2"), "T5Config.mlp_activations="),
        ("dropout_rate", 1.0, "T5Config.dropout_rate must be in [0, 1)"),
    ],
)
def test_config_rejects_bad_values(field, value, message):
    with pytest.raises(ValueError) as err:
        dataclasses.replace(TINY, **{field: value})
    assert message in str(err.value)


def test_config_is_frozen_and_normalises_activation_list():
    cfg = dataclasses.replace(TINY, mlp_activations=["gelu", "linear"])
    assert cfg.mlp_activations == ("gelu", "linear")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.emb_dim = 8  # type: ignore[misc]


# ---------------------------------------------------------------- relative position buckets

# (key_position - query_position, bucket) for 32 bidirectional buckets, max distance 128.
# Keys at/before the query use buckets 0..15, keys after it 16..31. Distances 0..7 are exact;
# beyond, bucket = 8 + floor(log(d / 8) / log(128 / 8) * 8), capped at 15 (e.g. d=12:
# log(1.5)/log(16)*8 = 1.17 -> 9; d=20: log(2.5)/log(16)*8 = 2.64 -> 10).
HAND_BUCKETS = [
    (0, 0),
    (-1, 1),
    (1, 17),
    (-7, 7),
    (7, 23),
    (-8, 8),
    (8, 24),
    (-12, 9),
    (12, 25),
    (-16, 10),
    (-20, 10),
    (20, 26),
    (-32, 12),
    (-64, 14),
    (64, 30),
    (-100, 15),
    (-127, 15),
    (-128, 15),
    (128, 31),
    (-1000, 15),
    (1000, 31),
]


def test_relative_position_bucket_hand_computed():
    rel = np.array([r for r, _ in HAND_BUCKETS])
    expected = np.array([b for _, b in HAND_BUCKETS])
    got = t5.relative_position_bucket(rel, bidirectional=True, num_buckets=32, max_distance=128)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)


def test_relative_position_bucket_invariants():
    rel = np.arange(-300, 301)
    buckets = t5.relative_position_bucket(rel)
    assert buckets.min() == 0 and buckets.max() == 31
    before = buckets[rel <= 0][::-1]  # distance 0, 1, 2, ... for keys at/before the query
    after = buckets[rel > 0]
    assert np.all(np.diff(before) >= 0) and np.all(np.diff(after) >= 0)
    assert set(before.tolist()) == set(range(16))
    assert set(after.tolist()) == set(range(17, 32))  # distance 0 is never "after"
    # Symmetric: +d lands exactly 16 buckets above -d.
    np.testing.assert_array_equal(
        t5.relative_position_bucket(np.arange(1, 300)),
        t5.relative_position_bucket(-np.arange(1, 300)) + 16,
    )
    # Causal variant: keys after the query all share bucket 0; all 32 buckets look back, 16 of
    # them exact (d=20: 16 + floor(log(20/16)/log(128/16)*16) = 16 + floor(1.72) = 17).
    causal = t5.relative_position_bucket(np.array([5, 1, 0, -1, -9, -20]), bidirectional=False)
    np.testing.assert_array_equal(causal, [0, 0, 0, 1, 9, 17])


# ---------------------------------------------------------------- parameters


def test_param_tree_names_and_shapes_follow_t5x(params):
    flat = {"/".join(k): v.shape for k, v in traverse_util.flatten_dict(params).items()}
    expected = {
        "token_embedder/embedding": (64, 32),
        "encoder/relpos_bias/rel_embedding": (4, 32),
        "encoder/encoder_norm/scale": (32,),
    }
    for i in range(2):
        layer = f"encoder/layers_{i}"
        expected.update(
            {
                f"{layer}/pre_attention_layer_norm/scale": (32,),
                f"{layer}/attention/query/kernel": (32, 32),
                f"{layer}/attention/key/kernel": (32, 32),
                f"{layer}/attention/value/kernel": (32, 32),
                f"{layer}/attention/out/kernel": (32, 32),
                f"{layer}/pre_mlp_layer_norm/scale": (32,),
                f"{layer}/mlp/wi_0/kernel": (32, 64),
                f"{layer}/mlp/wi_1/kernel": (32, 64),
                f"{layer}/mlp/wo/kernel": (64, 32),
            }
        )
    assert flat == expected
    assert all(v.dtype == jnp.float32 for v in jax.tree_util.tree_leaves(params))


def test_every_param_has_logical_axis_names(boxed_variables):
    leaves = jax.tree_util.tree_leaves(
        boxed_variables["params"], is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )
    assert len(leaves) == 3 + 2 * 9
    for leaf in leaves:
        assert isinstance(leaf, nn.LogicallyPartitioned)
        assert len(leaf.names) == leaf.value.ndim
        assert set(leaf.names) <= LOGICAL_AXES
    specs = t5.params_logical_axes(TINY)
    assert tuple(specs["encoder"]["layers_1"]["attention"]["out"]["kernel"]) == (
        "joined_kv",
        "embed",
    )
    assert tuple(specs["encoder"]["relpos_bias"]["rel_embedding"]) == ("heads", "relpos_buckets")
    assert tuple(specs["token_embedder"]["embedding"]) == ("vocab", "embed")


def test_init_is_t5x_style(params):
    layer = params["encoder"]["layers_0"]
    # Norm scales start at one; the query kernel carries the folded 1/sqrt(head_dim).
    np.testing.assert_array_equal(layer["pre_attention_layer_norm"]["scale"], np.ones(32))
    std = lambda x: float(np.std(np.asarray(x)))
    q, k = layer["attention"]["query"]["kernel"], layer["attention"]["key"]["kernel"]
    assert std(k) == pytest.approx(1 / math.sqrt(32), rel=0.25)
    assert std(q) == pytest.approx(1 / math.sqrt(32) / math.sqrt(8), rel=0.25)
    assert std(params["token_embedder"]["embedding"]) == pytest.approx(1.0, rel=0.15)


# ---------------------------------------------------------------- forward pass


def _reference_forward(params, ids, mask, cfg):
    """Independent numpy T5 v1.1 encoder forward (float64)."""
    p = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)
    ids, mask = np.asarray(ids), np.asarray(mask)
    b, length = ids.shape
    h, d = cfg.num_heads, cfg.head_dim

    def rms(x, scale):
        return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6) * scale

    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

    rel = np.arange(length)[None, :] - np.arange(length)[:, None]
    bias = p["encoder"]["relpos_bias"]["rel_embedding"][:, t5.relative_position_bucket(rel)]
    x = p["token_embedder"]["embedding"][ids]
    for i in range(cfg.num_layers):
        lp = p["encoder"][f"layers_{i}"]
        a = lp["attention"]
        y = rms(x, lp["pre_attention_layer_norm"]["scale"])
        q = (y @ a["query"]["kernel"]).reshape(b, length, h, d)
        k = (y @ a["key"]["kernel"]).reshape(b, length, h, d)
        v = (y @ a["value"]["kernel"]).reshape(b, length, h, d)
        logits = np.einsum("bqhd,bkhd->bhqk", q, k) + bias[None]  # no 1/sqrt(d)
        logits = np.where(mask[:, None, None, :], logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        ctx = np.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, length, h * d)
        x = x + ctx @ a["out"]["kernel"]
        m = lp["mlp"]
        y = rms(x, lp["pre_mlp_layer_norm"]["scale"])
        x = x + (gelu_tanh(y @ m["wi_0"]["kernel"]) * (y @ m["wi_1"]["kernel"])) @ m["wo"]["kernel"]
    x = rms(x, p["encoder"]["encoder_norm"]["scale"])
    return x * mask[..., None]


def test_forward_matches_numpy_reference_and_zeroes_padding(params):
    ids, mask = _batch()
    out = t5.T5Encoder(TINY).apply({"params": params}, ids, mask)
    assert out.shape == (2, 6, 32) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, _reference_forward(params, ids, mask, TINY), atol=2e-4)
    np.testing.assert_array_equal(np.asarray(out)[1, 3:], 0.0)
    # token_type_ids is accepted for BERT parity and ignored.
    out_tt = t5.T5Encoder(TINY).apply(
        {"params": params}, ids, mask, token_type_ids=jnp.ones_like(ids)
    )
    np.testing.assert_array_equal(out, out_tt)


def test_padding_invariance(params):
    model = t5.T5Encoder(TINY)
    sentence = jnp.array([[7, 12, 40]], jnp.int32)
    alone = model.apply({"params": params}, sentence, jnp.ones((1, 3), bool))
    ids, mask = _batch()  # row 1 is the same sentence padded to length 6 beside a longer one
    batched = model.apply({"params": params}, ids, mask)
    np.testing.assert_allclose(batched[1, :3], alone[0], atol=1e-5)
    # Changing the ids under the padding changes nothing.
    noisy = ids.at[1, 3:].set(jnp.array([50, 51, 52]))
    np.testing.assert_allclose(model.apply({"params": params}, noisy, mask), batched, atol=1e-6)


def test_rejects_mismatched_mask_shape(params):
    ids, mask = _batch()
    with pytest.raises(ValueError, match="T5Encoder expects input_ids"):
        t5.T5Encoder(TINY).apply({"params": params}, ids, mask[:, :4])


def test_dropout_only_when_not_deterministic(params):
    ids, mask = _batch()
    model = t5.T5Encoder(TINY)
    variables = {"params": params}
    det_a = model.apply(variables, ids, mask, deterministic=True)
    det_b = model.apply(
        variables, ids, mask, deterministic=True, rngs={"dropout": jax.random.key(3)}
    )
    np.testing.assert_array_equal(det_a, det_b)
    drop_1 = model.apply(
        variables, ids, mask, deterministic=False, rngs={"dropout": jax.random.key(1)}
    )
    drop_2 = model.apply(
        variables, ids, mask, deterministic=False, rngs={"dropout": jax.random.key(2)}
    )
    assert float(jnp.max(jnp.abs(drop_1 - det_a))) > 1e-3
    assert float(jnp.max(jnp.abs(drop_1 - drop_2))) > 1e-3
    np.testing.assert_array_equal(np.asarray(drop_1)[1, 3:], 0.0)  # padding stays zero
    no_dropout = t5.T5Encoder(dataclasses.replace(TINY, dropout_rate=0.0))
    np.testing.assert_allclose(
        no_dropout.apply(
            variables, ids, mask, deterministic=False, rngs={"dropout": jax.random.key(1)}
        ),
        det_a,
        atol=1e-6,
    )


def test_bfloat16_compute_path(params):
    ids, mask = _batch()
    cfg16 = dataclasses.replace(TINY, dtype="bfloat16")
    out16 = t5.T5Encoder(cfg16).apply({"params": params}, ids, mask)
    out32 = t5.T5Encoder(TINY).apply({"params": params}, ids, mask)
    assert out16.dtype == jnp.bfloat16
    assert bool(jnp.all(jnp.isfinite(out16)))
    np.testing.assert_allclose(np.asarray(out16, np.float32), out32, atol=0.15, rtol=0.05)
    # Parameters stay float32 when computing in bfloat16.
    init16 = nn.unbox(t5.init_t5_encoder(cfg16, jax.random.key(0)))["params"]
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(init16))


def test_bfloat16_training_scatters_gradients_in_float32(params):
    ids, mask = _batch()
    model = t5.T5Encoder(dataclasses.replace(TINY, dtype="bfloat16"))

    def loss(p):
        return jnp.sum(model.apply({"params": p}, ids, mask).astype(jnp.float32) ** 2)

    assert scatter_add_dtypes(jax.grad(loss), params) == {"f32"}


def test_jitted_forward_and_grad_are_finite_with_remat_and_mesh(params):
    ids, mask = _batch()
    cfg = dataclasses.replace(TINY, remat=True)
    model = t5.T5Encoder(cfg)

    def loss(p, rng):
        out = model.apply({"params": p}, ids, mask, deterministic=False, rngs={"dropout": rng})
        return jnp.sum(jnp.square(out)) / jnp.sum(mask)

    mesh = partitioning.create_mesh(num_partitions=1)
    with mesh, nn.logical_axis_rules(partitioning.standard_logical_axis_rules()):
        value, grads = jax.jit(jax.value_and_grad(loss))(params, jax.random.key(0))
        out = jax.jit(lambda p: model.apply({"params": p}, ids, mask))(params)
    assert np.isfinite(float(value))
    for path, g in traverse_util.flatten_dict(grads, sep="/").items():
        assert np.all(np.isfinite(g)), path
        assert float(np.max(np.abs(g))) > 0.0, path  # every parameter receives gradient
    reference = t5.T5Encoder(TINY).apply({"params": params}, ids, mask)
    np.testing.assert_allclose(out, reference, atol=1e-5)  # remat/mesh change nothing


def test_layer_norm_is_rms_without_bias():
    x = jnp.array([[1.0, -2.0, 3.0, 0.5]])
    norm = t5.T5LayerNorm()
    variables = norm.init(jax.random.key(0), x)
    assert set(variables["params"]) == {"scale"}
    y = norm.apply({"params": {"scale": jnp.array([1.0, 2.0, 1.0, 1.0])}}, x)
    rms = np.sqrt(np.mean(np.square(np.asarray(x))) + 1e-6)
    np.testing.assert_allclose(y, np.asarray(x) / rms * np.array([1, 2, 1, 1]), rtol=1e-6)


# ---------------------------------------------------------------- gin model files


@gin.configurable
def _t5_gin_probe(backbone=gin.REQUIRED):
    return backbone


PUBLISHED = {
    # name: (vocab, emb, heads, layers, head_dim, mlp, dtype)
    "tiny": (30522, 32, 4, 2, 8, 64, "float32"),
    "small": (32128, 512, 6, 8, 64, 1024, "bfloat16"),
    "base": (32128, 768, 12, 12, 64, 2048, "bfloat16"),
    "large": (32128, 1024, 16, 24, 64, 2816, "bfloat16"),
    "xl": (32128, 2048, 32, 24, 64, 5120, "bfloat16"),
    "xxl": (32128, 4096, 64, 24, 64, 10240, "bfloat16"),
}


@pytest.mark.parametrize("size", sorted(PUBLISHED))
def test_gin_model_file_parses_alone_and_binds_backbone(size):
    gin.parse_config_file(str(REPO / "gin" / "models" / f"t5_{size}.gin"))
    gin.parse_config("_t5_gin_probe.backbone = %BACKBONE")
    cfg = _t5_gin_probe()
    assert isinstance(cfg, t5.T5Config)
    vocab, emb, heads, layers, head_dim, mlp, dtype = PUBLISHED[size]
    assert (cfg.vocab_size, cfg.emb_dim, cfg.num_heads, cfg.num_layers) == (
        vocab,
        emb,
        heads,
        layers,
    )
    assert (cfg.head_dim, cfg.mlp_dim, cfg.dtype, cfg.param_dtype) == (
        head_dim,
        mlp,
        dtype,
        "float32",
    )
    assert cfg.mlp_activations == ("gelu", "linear")
    assert (cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance) == (32, 128)


def test_gin_command_line_override():
    gin.parse_config_files_and_bindings(
        [str(REPO / "gin" / "models" / "t5_base.gin")],
        ["T5Config.dropout_rate = 0.0", "T5Config.dtype = 'float32'"],
        finalize_config=False,
    )
    gin.parse_config("_t5_gin_probe.backbone = %BACKBONE")
    cfg = _t5_gin_probe()
    assert (cfg.dropout_rate, cfg.dtype, cfg.num_layers) == (0.0, "float32", 12)


def test_tiny_gin_param_count():
    gin.parse_config_file(str(REPO / "gin" / "models" / "t5_tiny.gin"))
    gin.parse_config("_t5_gin_probe.backbone = %BACKBONE")
    shapes = t5.abstract_params(_t5_gin_probe())
    count = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes))
    per_layer = 2 * 32 + 4 * 32 * 32 + 3 * 32 * 64
    assert count == 30522 * 32 + 4 * 32 + 32 + 2 * per_layer
