"""BERT encoder (aligner_jax/models/bert.py) and its weight loading (aligner_jax/backbones.py)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import importorskip
from fixtures import LOGICAL_AXES, TINY_BERT, scatter_add_dtypes
from flax import linen as nn
from flax import traverse_util
from safetensors.numpy import load_file, save_file

from aligner_jax.encoding import batching, tokenization
from aligner_jax.models import partitioning
from aligner_jax.models.bert import BertConfig, BertEncoder
from aligner_jax.weights import bert_safetensors
from aligner_jax.weights import minilm as minilm_weights

TINY = TINY_BERT
SENTENCES = [
    "Hello world.",
    "Microstructural development of human newborn cerebral white matter assessed in vivo by "
    "diffusion tensor magnetic resonance imaging.",
    "x",
    "ALIGNER: multi-vector retrieval as sparse alignment; 0.4 salience, [SEP] inside, naïve café.",
]


@pytest.fixture(scope="module")
def minilm():
    return batching.load_minilm()


@pytest.fixture(scope="module")
def minilm_batch(minilm):
    _, _, tok = minilm
    seqs = tok.encode_batch(SENTENCES, max_length=tokenization.DEFAULT_DOC_MAXLEN)
    ids, mask = tokenization.pad_batch(seqs, max(len(s) for s in seqs) + 3)
    return seqs, ids, mask


@pytest.fixture(scope="module")
def minilm_hidden(minilm, minilm_batch):
    config, params, _ = minilm
    _, ids, mask = minilm_batch
    return np.asarray(batching.make_encode_fn(config)(params, ids, mask))


def _tiny_params(seed=0):
    return bert_safetensors.init_bert_params(TINY, jax.random.key(seed))


def _tiny_inputs():
    ids = np.array([[1, 5, 9, 3, 2, 0, 0], [1, 7, 2, 0, 0, 0, 0]], np.int32)
    return ids, ids != 0


# ----------------------------------------------------------------------------- parity with HF


def test_minilm_matches_pytorch_reference(minilm, minilm_batch, minilm_hidden):
    torch = importorskip("torch")
    transformers = importorskip("transformers")
    _, ids, mask = minilm_batch
    model = transformers.AutoModel.from_pretrained(str(minilm_weights.minilm_model_dir())).eval()
    with torch.no_grad():
        ref = model(
            input_ids=torch.as_tensor(ids, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
        ).last_hidden_state.numpy()
    assert minilm_hidden.shape == ref.shape == (4, ids.shape[1], 384)
    diff = np.abs(minilm_hidden - ref)[mask]
    assert diff.max() <= 1e-4, diff.max()
    # Padding never takes part downstream: the encoder returns zeros there.
    assert np.all(minilm_hidden[~mask] == 0.0)


def test_minilm_matches_sentence_transformers_token_embeddings(minilm_batch, minilm_hidden):
    importorskip("torch")
    st = importorskip("sentence_transformers")
    seqs, _, _ = minilm_batch
    model = st.SentenceTransformer(str(minilm_weights.minilm_model_dir()), device="cpu")
    assert model.max_seq_length == tokenization.DEFAULT_DOC_MAXLEN
    ref = model.encode(SENTENCES, output_value="token_embeddings", convert_to_numpy=False)
    for i, seq in enumerate(seqs):
        # Same tokenization (length and hence ids) and the same vectors.
        assert ref[i].shape == (len(seq), 384)
        np.testing.assert_allclose(minilm_hidden[i, : len(seq)], ref[i].numpy(), atol=1e-4)


def test_padding_invariance(minilm, minilm_batch, minilm_hidden):
    config, params, _ = minilm
    seqs, _, _ = minilm_batch
    encode = batching.make_encode_fn(config)
    alone_ids, alone_mask = tokenization.pad_batch([seqs[1]], len(seqs[1]))
    alone = np.asarray(encode(params, alone_ids, alone_mask))[0]
    np.testing.assert_allclose(alone, minilm_hidden[1, : len(seqs[1])], atol=2e-5)
    # The same sequences through encode_sequences' buckets (different padded shapes).
    bucketed = batching.encode_sequences(encode, params, seqs, boundaries=(8, 16, 48))
    for i, seq in enumerate(seqs):
        np.testing.assert_allclose(bucketed[i], minilm_hidden[i, : len(seq)], atol=2e-5)


def test_iter_encoded_batches_streams_all_sequences_in_any_concurrency():
    params = _tiny_params(2)
    encode = batching.make_encode_fn(TINY)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, 64, size=n).astype(np.int32) for n in [3, 12, 5, 9, 1, 12, 7, 2]]
    runs = {}
    for workers in (1, 3):
        stream = list(
            batching.iter_encoded_batches(
                encode,
                params,
                seqs,
                (4, 8, 12),
                max_tokens_per_batch=16,
                concurrent_batches=workers,
            )
        )
        runs[workers] = stream
        seen = np.concatenate([indices for indices, _ in stream])
        assert sorted(seen.tolist()) == list(range(len(seqs)))
        for indices, vectors in stream:
            for i, v in zip(indices, vectors, strict=True):
                assert v.shape == (len(seqs[i]), 16) and v.dtype == np.float32
    # Same batches in the same order, same numbers, whatever the number of batches in flight.
    for (i1, v1), (i3, v3) in zip(runs[1], runs[3], strict=True):
        np.testing.assert_array_equal(i1, i3)
        for a, b in zip(v1, v3, strict=True):
            np.testing.assert_array_equal(a, b)
    collected = batching.encode_sequences(
        encode, params, seqs, boundaries=(4, 8, 12), max_tokens_per_batch=16
    )
    direct_ids, direct_mask = tokenization.pad_batch(seqs, 12)
    direct = np.asarray(encode(params, direct_ids, direct_mask))
    for i, seq in enumerate(seqs):
        np.testing.assert_allclose(collected[i], direct[i, : len(seq)], atol=1e-5)
    assert batching.encode_sequences(encode, params, []) == []
    with pytest.raises(ValueError, match="concurrent_batches=0"):
        batching.encode_sequences(encode, params, seqs, concurrent_batches=0)


# ----------------------------------------------------------------------------- model


def test_tiny_bert_runs_and_jits():
    params = _tiny_params()
    ids, mask = _tiny_inputs()
    model = BertEncoder(TINY)
    encode = jax.jit(lambda p, i, m: model.apply({"params": p}, i, m))
    out = encode(params, ids, mask)
    assert out.shape == (2, 7, 16) and out.dtype == jnp.float32
    out = np.asarray(out)
    assert np.all(np.isfinite(out))
    assert np.all(out[~mask] == 0.0)
    # Post-LayerNorm with unit scale and zero bias at init: every real token has mean 0, std 1.
    real = out[mask]
    np.testing.assert_allclose(real.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(real.std(-1), 1.0, atol=1e-3)
    # An all-padding filler row (as length_buckets adds) stays finite and zero.
    filler = np.asarray(encode(params, np.zeros_like(ids), np.zeros_like(mask)))
    assert np.all(filler == 0.0)


def test_padding_invariance_tiny_and_token_types():
    params = _tiny_params(1)
    model = BertEncoder(TINY)
    ids, mask = _tiny_inputs()
    full = np.asarray(model.apply({"params": params}, ids, mask))
    trimmed = np.asarray(model.apply({"params": params}, ids[1:, :3], mask[1:, :3]))
    np.testing.assert_allclose(full[1, :3], trimmed[0], atol=1e-5)
    # Changing what sits at padding positions changes nothing.
    noisy = np.where(mask, ids, 17)
    np.testing.assert_allclose(
        np.asarray(model.apply({"params": params}, noisy, mask)), full, atol=1e-6
    )
    types = np.ones_like(ids)
    other = np.asarray(model.apply({"params": params}, ids, mask, token_type_ids=types))
    assert np.abs(other - full)[mask].max() > 1e-3


def test_dropout_only_when_not_deterministic():
    config = dataclasses.replace(TINY, hidden_dropout_prob=0.5)
    params = bert_safetensors.init_bert_params(config, jax.random.key(0))
    model = BertEncoder(config)
    ids, mask = _tiny_inputs()
    a = model.apply({"params": params}, ids, mask)
    b = model.apply({"params": params}, ids, mask, deterministic=True)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    c = model.apply(
        {"params": params}, ids, mask, deterministic=False, rngs={"dropout": jax.random.key(1)}
    )
    assert np.abs(np.asarray(c) - np.asarray(a))[mask].max() > 1e-2
    with pytest.raises(Exception, match="dropout"):
        model.apply({"params": params}, ids, mask, deterministic=False)


def test_bfloat16_compute_dtype():
    params = _tiny_params()
    ids, mask = _tiny_inputs()
    f32 = BertEncoder(TINY).apply({"params": params}, ids, mask)
    bf16 = BertEncoder(TINY, dtype=jnp.bfloat16).apply({"params": params}, ids, mask)
    assert bf16.dtype == jnp.bfloat16
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda x: x.dtype == jnp.float32, params))
    np.testing.assert_allclose(np.asarray(bf16, np.float32), np.asarray(f32), atol=0.1)


def test_bfloat16_training_scatters_embedding_gradients_in_float32():
    params = _tiny_params()
    ids, mask = _tiny_inputs()
    model = BertEncoder(TINY, dtype=jnp.bfloat16)

    def loss(p):
        return jnp.sum(model.apply({"params": p}, ids, mask).astype(jnp.float32) ** 2)

    assert scatter_add_dtypes(jax.grad(loss), params) == {"f32"}


def test_input_errors():
    params = _tiny_params()
    model = BertEncoder(TINY)
    ids = np.ones((1, 13), np.int32)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=12"):
        model.apply({"params": params}, ids, ids > 0)
    with pytest.raises(ValueError, match=r"mask of the same shape"):
        model.apply({"params": params}, ids[:, :4], np.ones((1, 5), bool))


def test_config_from_hf_dict():
    hf = json.loads((minilm_weights.minilm_model_dir() / "config.json").read_text())
    config = BertConfig.from_hf_config(hf)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (
        384,
        6,
        12,
    )
    assert config.head_dim == 32 and config.layer_norm_eps == 1e-12
    assert BertConfig.from_hf_config(config.to_hf_config()) == config
    with pytest.raises(ValueError, match="my.json: model_type='t5'"):
        BertConfig.from_hf_config({**hf, "model_type": "t5"}, source="my.json")
    with pytest.raises(ValueError, match="position_embedding_type='relative_key'"):
        BertConfig.from_hf_config({**hf, "position_embedding_type": "relative_key"})
    with pytest.raises(ValueError, match="hidden_act='swish'"):
        BertConfig.from_hf_config({**hf, "hidden_act": "swish"})
    with pytest.raises(ValueError, match="divisible by num_attention_heads=5"):
        BertConfig.from_hf_config({**hf, "num_attention_heads": 5})


# ----------------------------------------------------------------------------- partitioning


def test_every_param_has_logical_axes():
    boxed = bert_safetensors.abstract_bert_params(TINY)
    leaves = jax.tree_util.tree_leaves_with_path(
        boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
    )
    assert len(leaves) == 5 + 16 * TINY.num_hidden_layers
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        assert isinstance(leaf, nn.LogicallyPartitioned), name
        assert len(leaf.names) == len(leaf.value.shape), name
        assert set(leaf.names) <= LOGICAL_AXES, name
    flat = traverse_util.flatten_dict(boxed)
    expected = {
        ("embeddings", "word_embeddings", "embedding"): ("vocab", "embed"),
        ("embeddings", "position_embeddings", "embedding"): ("abspos_buckets", "embed"),
        ("embeddings", "token_type_embeddings", "embedding"): ("token_type", "embed"),
        ("embeddings", "LayerNorm", "scale"): ("embed",),
        ("layer_0", "attention", "query", "kernel"): ("embed", "joined_kv"),
        ("layer_0", "attention", "value", "bias"): ("joined_kv",),
        ("layer_0", "attention", "output", "kernel"): ("joined_kv", "embed"),
        ("layer_1", "intermediate", "kernel"): ("embed", "mlp"),
        ("layer_1", "output", "kernel"): ("mlp", "embed"),
        ("layer_1", "LayerNorm", "bias"): ("embed",),
    }
    for path, names in expected.items():
        assert flat[path].names == names, path


def test_sharded_apply_on_a_mesh():
    params = _tiny_params()
    mesh = partitioning.create_mesh(num_partitions=1)
    rules = partitioning.standard_logical_axis_rules()
    shardings = partitioning.params_shardings(
        bert_safetensors.abstract_bert_params(TINY), mesh, rules
    )
    params = jax.device_put(params, shardings)
    ids, mask = _tiny_inputs()
    model = BertEncoder(TINY)
    with mesh, nn.logical_axis_rules(rules):
        out = jax.jit(lambda p, i, m: model.apply({"params": p}, i, m))(params, ids, mask)
    expected = model.apply({"params": jax.device_get(params)}, ids, mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-5)


# ----------------------------------------------------------------------------- weight loading


def test_minilm_load_shapes(minilm):
    config, params, tok = minilm
    abstract = nn.unbox(bert_safetensors.abstract_bert_params(config))
    assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure(params)
    for a, p in zip(
        jax.tree_util.tree_leaves(abstract), jax.tree_util.tree_leaves(params), strict=True
    ):
        assert a.shape == p.shape and p.dtype == jnp.float32
    assert not any(
        isinstance(x, nn.LogicallyPartitioned)
        for x in jax.tree_util.tree_leaves(
            params, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
        )
    )
    # Kernels are transposed from PyTorch's [out, in].
    raw = load_file(str(minilm_weights.minilm_model_dir() / "model.safetensors"))
    np.testing.assert_array_equal(
        params["layer_3"]["intermediate"]["kernel"],
        raw["encoder.layer.3.intermediate.dense.weight"].T,
    )
    assert tok.vocab_size == config.vocab_size
    assert bert_safetensors.read_max_seq_length(minilm_weights.minilm_model_dir()) == 256


def test_save_load_roundtrip_with_and_without_prefix(tmp_path):
    params = _tiny_params(3)
    model_dir = bert_safetensors.save_bert_to_safetensors(TINY, params, tmp_path / "plain")
    config, loaded = bert_safetensors.load_bert_from_safetensors(model_dir)
    assert config == TINY
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, params)
    # A BertForMaskedLM-style file: "bert." prefix, position-id buffer, pooler and MLM head.
    tensors = {f"bert.{k}": v for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    tensors["bert.embeddings.position_ids"] = np.arange(12, dtype=np.int64)[None]
    tensors["bert.pooler.dense.weight"] = np.zeros((16, 16), np.float32)
    tensors["cls.predictions.bias"] = np.zeros((64,), np.float32)
    prefixed = _write(tmp_path / "prefixed", tensors)
    _, loaded = bert_safetensors.load_bert_from_safetensors(prefixed, dtype=jnp.bfloat16)
    assert loaded["layer_1"]["output"]["kernel"].dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(loaded["layer_1"]["output"]["kernel"], np.float32),
        np.asarray(params["layer_1"]["output"]["kernel"]),
        rtol=1e-2,
    )


def _write(model_dir, tensors, config=TINY):
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps(config.to_hf_config()))
    return model_dir


@pytest.fixture()
def tiny_tensors(tmp_path):
    model_dir = bert_safetensors.save_bert_to_safetensors(TINY, _tiny_params(), tmp_path / "src")
    return load_file(str(model_dir / "model.safetensors"))


def test_loader_error_missing_tensor(tmp_path, tiny_tensors):
    del tiny_tensors["encoder.layer.1.attention.self.key.weight"]
    model_dir = _write(tmp_path / "m", tiny_tensors)
    with pytest.raises(ValueError) as e:
        bert_safetensors.load_bert_from_safetensors(model_dir)
    assert str(model_dir / "model.safetensors") in str(e.value)
    assert "1 encoder tensor(s) missing: 'encoder.layer.1.attention.self.key.weight'" in str(
        e.value
    )


def test_loader_error_wrong_shape(tmp_path, tiny_tensors):
    tiny_tensors["encoder.layer.0.intermediate.dense.weight"] = np.zeros((24, 15), np.float32)
    model_dir = _write(tmp_path / "m", tiny_tensors)
    with pytest.raises(ValueError) as e:
        bert_safetensors.load_bert_from_safetensors(model_dir)
    msg = str(e.value)
    assert str(model_dir / "model.safetensors") in msg
    assert (
        "'encoder.layer.0.intermediate.dense.weight' has shape (24, 15), expected (24, 16)" in msg
    )


def test_loader_error_unknown_and_duplicate_tensor(tmp_path, tiny_tensors):
    extra = dict(tiny_tensors, **{"encoder.layer.2.output.dense.bias": np.zeros(16, np.float32)})
    with pytest.raises(ValueError, match=r"'encoder.layer.2.output.dense.bias' is not part of"):
        bert_safetensors.load_bert_from_safetensors(_write(tmp_path / "a", extra))
    twice = dict(tiny_tensors)
    twice["bert.embeddings.LayerNorm.weight"] = twice["embeddings.LayerNorm.weight"]
    with pytest.raises(ValueError, match="both map to parameter embeddings/LayerNorm/scale"):
        bert_safetensors.load_bert_from_safetensors(_write(tmp_path / "b", twice))


def test_loader_error_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        bert_safetensors.load_bert_from_safetensors(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_config()))
    with pytest.raises(FileNotFoundError, match="model.safetensors does not exist"):
        bert_safetensors.load_bert_from_safetensors(tmp_path)
