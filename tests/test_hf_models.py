"""``hf:DIR`` backbones and ``aligner-export`` (issue 13, items 1–2).

Folders are written by ``transformers`` ``save_pretrained`` for random small configs (BERT and
T5 v1.1 ``T5EncoderModel``); our hidden states must match ``transformers``' within 1e-4, and an
exported model must load back (``hf:``) with identical scores and load in ``transformers``.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import gin
import jax
import numpy as np
import pytest
import tokenizers
from conftest import importorskip
from fixtures import REPO, TOY_DOCS, TOY_QUERIES
from safetensors.numpy import load_file, save_file

from aligner_jax.common import fileio
from aligner_jax.common.errors import CheckpointError, ConfigError
from aligner_jax.core import scoring
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import Encoder
from aligner_jax.models import aligner as aligner_lib
from aligner_jax.models import bert, t5
from aligner_jax.weights import hf_export, hf_models, minilm

torch = importorskip("torch")
transformers = importorskip("transformers")

WORDS = sorted({w for doc in TOY_DOCS.values() for w in doc["text"].lower().split()})
TEXTS = [
    "a volcano erupts when magma rises",
    "honey bees store honey",
    "the sicilian defence is a sharp chess opening where black answers with the c5 pawn and "
    "white develops the knight while the bishop waits on its long diagonal for the endgame",
]


def _bert_vocab(folder) -> None:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (folder / "vocab.txt").write_text("\n".join(specials + WORDS) + "\n")


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory):
    """A random 2-layer BertModel and its WordPiece tokenizer, as save_pretrained writes them."""
    folder = tmp_path_factory.mktemp("hf_bert")
    _bert_vocab(folder)
    # ``vocab=`` (transformers 5 ignores ``vocab_file=``, leaving only the special tokens).
    tokenizer = transformers.BertTokenizerFast(vocab=str(folder / "vocab.txt"))
    assert tokenizer("honey", add_special_tokens=False)["input_ids"] != [tokenizer.unk_token_id]
    tokenizer.save_pretrained(folder)
    config = transformers.BertConfig(
        vocab_size=len(WORDS) + 5,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=96,
        hidden_act="gelu",
        layer_norm_eps=1e-7,
    )
    torch.manual_seed(0)
    transformers.BertModel(config).eval().save_pretrained(folder)
    return folder


def _spiece(folder) -> None:
    """A tiny SentencePiece model (T5's tokenizer kind) trained on the toy documents."""
    spm = importorskip("sentencepiece")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(d["text"] for d in TOY_DOCS.values()) * 3)
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / "spiece"),
        vocab_size=120,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        minloglevel=2,
    )
    corpus.unlink()
    (folder / "spiece.vocab").unlink()


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    """A random T5 v1.1-style encoder (gated GELU, shared relative bias) and spiece.model."""
    folder = tmp_path_factory.mktemp("hf_t5")
    config = transformers.T5Config(
        vocab_size=128,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=16,
        relative_attention_max_distance=40,
        layer_norm_epsilon=1e-6,
    )
    torch.manual_seed(1)
    model = transformers.T5EncoderModel(config).eval()
    with torch.no_grad():  # non-trivial norm scales, so a missed norm weight shows
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.mul_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    _spiece(folder)
    return folder


def _torch_hidden(model, ids, mask) -> np.ndarray:
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
        ).last_hidden_state
    return out.numpy() * mask[..., None]


def _batch(tokenizer, maxlen=64):
    seqs = tokenizer.encode_batch(TEXTS, max_length=maxlen)
    length = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), length), np.int32)
    mask = np.zeros((len(seqs), length), bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, True
    return ids, mask


def _ours_hidden(backbone_config, params, ids, mask) -> np.ndarray:
    module = aligner_lib.build_backbone(backbone_config)
    return np.asarray(module.apply({"params": params}, ids, mask))


def test_bert_folder_matches_transformers(bert_folder):
    config, params = hf_models.load_backbone(bert_folder)
    assert config == bert.BertConfig(
        vocab_size=len(WORDS) + 5,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=96,
        layer_norm_eps=1e-7,
    )
    tokenizer = loading.load_tokenizer(
        loading.resolve_tokenizer("auto", f"hf:{bert_folder}", config)
    )
    ids, mask = _batch(tokenizer)
    reference_ids = transformers.AutoTokenizer.from_pretrained(bert_folder)(TEXTS)["input_ids"]
    assert [list(r) for r in reference_ids] == [list(i[m]) for i, m in zip(ids, mask, strict=True)]
    assert mask.sum(1).max() > 30 and not mask.all()  # padding takes part in the comparison
    expected = _torch_hidden(transformers.AutoModel.from_pretrained(bert_folder).eval(), ids, mask)
    got = _ours_hidden(config, params, ids, mask)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    assert np.abs(expected).max() > 0.5


def test_t5_folder_matches_transformers(t5_folder):
    config, params = hf_models.load_backbone(t5_folder)
    assert config.mlp_activations == ("gelu", "linear") and config.num_layers == 2
    assert (config.relative_attention_num_buckets, config.relative_attention_max_distance) == (
        16,
        40,
    )
    tokenizer = loading.load_tokenizer(loading.resolve_tokenizer("auto", f"hf:{t5_folder}", config))
    ids, mask = _batch(tokenizer)
    # Long enough that relative distances reach the logarithmic buckets and the max distance.
    assert mask.sum(1).max() > 40
    model = transformers.T5EncoderModel.from_pretrained(t5_folder).eval()
    expected = _torch_hidden(model, ids, mask)
    got = _ours_hidden(config, params, ids, mask)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    assert np.abs(expected).max() > 0.5


def test_t5_v1_0_relu_and_full_t5_checkpoint(tmp_path):
    """A T5 v1.0-style ``T5Model`` (ReLU, one ``wi``): the decoder is skipped, the encoder
    matches."""
    config = transformers.T5Config(
        vocab_size=64,
        d_model=16,
        d_kv=4,
        d_ff=24,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=4,
        feed_forward_proj="relu",
    )
    torch.manual_seed(3)
    transformers.T5Model(config).save_pretrained(tmp_path)
    ours_config, params = hf_models.load_backbone(tmp_path)
    assert ours_config.mlp_activations == ("relu",)
    ids = np.array([[5, 9, 11, 1, 0], [7, 3, 1, 0, 0]], np.int32)
    mask = ids > 0
    encoder = transformers.T5EncoderModel.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(
        _ours_hidden(ours_config, params, ids, mask),
        _torch_hidden(encoder, ids, mask),
        atol=1e-4,
        rtol=0,
    )
    # config.json saying gated GELU over a ReLU checkpoint: one line naming file and tensor.
    hf_config = json.loads((tmp_path / "config.json").read_text())
    hf_config.update(feed_forward_proj="gated-gelu", dense_act_fn="gelu_new", is_gated_act=True)
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: tensor 'encoder.block.0.layer.1.DenseReluDense.wi.weight' "
        r"\(encoder/layers_0/mlp/wi/kernel\) is not part of a T5 encoder",
    ):
        hf_models.load_backbone(tmp_path)


def test_sharded_and_sentence_transformers_folders(bert_folder, tmp_path):
    _, params = hf_models.load_backbone(bert_folder)
    sharded = tmp_path / "sharded"
    transformers.BertModel.from_pretrained(bert_folder).save_pretrained(
        sharded, max_shard_size="20KB"
    )
    assert (sharded / "model.safetensors.index.json").is_file()
    _, sharded_params = hf_models.load_backbone(sharded)
    jax.tree_util.tree_map(np.testing.assert_array_equal, sharded_params, params)

    st = tmp_path / "st"
    shutil.copytree(bert_folder, st / "0_Transformer")
    (st / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "0_Transformer",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
            ]
        )
    )
    assert hf_models.folder_of(f"hf:{st}") == st / "0_Transformer"
    config = aligner_lib.AlignerConfig()
    assert loading.config_for_weights(config, f"hf:{st}").backbone is not None  # pooling: unused


def test_a_pylate_folder_with_a_dense_projection_is_refused(bert_folder, tmp_path):
    """A PyLate model re-saved by PyLate (no aligner_heads) loaded its Transformer alone, its
    1_Dense projection silently ignored: other vectors than the model's."""
    folder = shutil.copytree(bert_folder, tmp_path / "pylate")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match=r"modules.json: the model projects its token vectors "
                       r"with pylate.models.Dense.Dense after the Transformer"):  # fmt: skip
        loading.config_for_weights(aligner_lib.AlignerConfig(), f"hf:{folder}")


def test_a_tokenizer_larger_than_the_embedding_is_refused(bert_folder):
    config = aligner_lib.AlignerConfig(projection="identity", salience="none")
    with pytest.raises(ConfigError, match=r"tokenizer='minilm' has 30522 token ids but the "):
        loading.load_encoder(
            config=config, backbone_weights=f"hf:{bert_folder}", tokenizer="minilm"
        )


def test_unsupported_model_type_is_a_user_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "roberta", "hidden_size": 8}))
    with pytest.raises(ConfigError, match=r"config.json: model_type='roberta' is not supported"):
        hf_models.load_backbone(tmp_path)
    config = aligner_lib.AlignerConfig(backbone=None)
    with pytest.raises(ConfigError, match="'roberta'"):
        loading.load_encoder(config=config, backbone_weights=f"hf:{tmp_path}")


def _encode(bundle, texts, kind):
    seqs = bundle.tokenizer.encode_batch(texts, max_length=bundle.config.maxlen(kind))
    ids = np.zeros((len(seqs), max(len(x) for x in seqs)), np.int32)
    mask = np.zeros(ids.shape, bool)
    for i, x in enumerate(seqs):
        ids[i, : len(x)], mask[i, : len(x)] = x, True
    apply = jax.jit(bundle.module.apply, static_argnums=3)
    vectors, salience = apply({"params": bundle.params}, ids, mask, kind)
    return np.asarray(vectors), np.asarray(salience), mask


def _scores(bundle) -> np.ndarray:
    """Top-1 (ColBERT) ALIGNER scores (Eq. 1-2) of the toy queries against the toy documents."""
    d, u_d, d_mask = _encode(bundle, [d["text"] for d in TOY_DOCS.values()], "doc")
    q, u_q, q_mask = _encode(bundle, list(TOY_QUERIES.values()), "query")
    s = np.einsum("qnh,dmh->qdnm", q, d)
    return np.asarray(
        scoring.alignment_scores(
            s, q_mask[:, None], d_mask[None], "top_k:1", u_q[:, None], u_d[None]
        )
    )


def test_bundled_model_folder_scores_as_minilm():
    config = aligner_lib.AlignerConfig(
        backbone=loading.minilm_backbone(), projection="identity", salience="none"
    )
    default = loading.load_encoder(config=config)
    via_hf = loading.load_encoder(
        config=aligner_lib.AlignerConfig(projection="identity", salience="none"),
        backbone_weights=f"hf:{minilm.minilm_model_dir()}",
    )
    assert via_hf.config == default.config
    assert via_hf.fingerprint() == default.fingerprint()
    np.testing.assert_array_equal(_scores(via_hf), _scores(default))


def _trained_like(backbone_config, folder_spec, tmp_path):
    """A tiny ALIGNER model on the hf backbone with random (non-trivial) heads, as training
    would leave it."""
    config = aligner_lib.AlignerConfig(
        backbone=None,
        projection="dense",
        projection_dim=8,
        salience="lp",
        query_maxlen=16,
        doc_maxlen=48,
    )
    bundle = loading.load_encoder(config=config, backbone_weights=folder_spec, seed=3)
    assert bundle.config.backbone == backbone_config
    return bundle


@pytest.mark.parametrize("kind", ["bert", "t5"])
def test_export_roundtrip(kind, bert_folder, t5_folder, tmp_path):
    folder = bert_folder if kind == "bert" else t5_folder
    backbone_config, _ = hf_models.load_backbone(folder)
    bundle = _trained_like(backbone_config, f"hf:{folder}", tmp_path)
    out = tmp_path / "export"
    files = hf_export.export_model(bundle.config, bundle.params, bundle.source["tokenizer"], out)
    expected_files = {
        "config.json",
        "model.safetensors",
        "aligner_heads.safetensors",
        "aligner_config.json",
        "README.md",
    }
    assert expected_files <= set(files)
    assert ("spiece.model" if kind == "t5" else "tokenizer.json") in files

    # hf: alone brings the backbone, the heads and their architecture back: identical scores.
    plain = aligner_lib.AlignerConfig(query_maxlen=16, doc_maxlen=48)  # gin defaults otherwise
    loaded = loading.load_encoder(config=plain, backbone_weights=f"hf:{out}", seed=99)
    assert loaded.config == bundle.config
    jax.tree_util.tree_map(np.testing.assert_array_equal, loaded.params, bundle.params)
    scores = _scores(loaded)
    np.testing.assert_array_equal(scores, _scores(bundle))
    assert np.ptp(scores) > 0
    rebuilt = loading.encoder_from_spec(loaded.spec())  # what an index's encoder.json gives
    assert rebuilt.fingerprint() == loaded.fingerprint() == bundle.fingerprint()

    # transformers loads the backbone; the README's recipe gives our token vectors.
    ids, mask = _batch(loaded.tokenizer, maxlen=48)
    if kind == "t5":
        model = transformers.T5EncoderModel.from_pretrained(out)
    else:
        model = transformers.AutoModel.from_pretrained(out, add_pooling_layer=False)
    hidden = _torch_hidden(model.eval(), ids, mask)
    ours = _ours_hidden(loaded.config.backbone, loaded.params["backbone"], ids, mask)
    np.testing.assert_allclose(ours, hidden, atol=1e-4, rtol=0)
    heads = load_file(str(out / "aligner_heads.safetensors"))
    v = hidden @ heads["projection.weight"].T
    v = v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12) * mask[..., None]
    vectors, _ = loaded.module.apply({"params": loaded.params}, ids, mask, "doc")
    np.testing.assert_allclose(v, np.asarray(vectors), atol=1e-4, rtol=0)
    readme = (out / "README.md").read_text()
    assert "Eq. 1-2" in readme and "Eq. 4" in readme and "Eq. 5" in readme


def test_export_keeps_the_casing_of_a_vocabulary_of_any_name(tmp_path):
    """wordpiece:DIR/my_vocab.txt with DIR/tokenizer_config.json {"do_lower_case": false}: only
    the vocabulary was exported, so the export lower-cased ('Hello' became another token)."""
    source = tmp_path / "cased"
    source.mkdir()
    (source / "my_vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nHello\n")
    (source / "tokenizer_config.json").write_text('{"do_lower_case": false}')
    sources = hf_export._tokenizer_sources(f"wordpiece:{source / 'my_vocab.txt'}")
    assert sources == {
        "vocab.txt": source / "my_vocab.txt",
        "tokenizer_config.json": source / "tokenizer_config.json",
    }
    exported = tmp_path / "export"
    exported.mkdir()
    for name, path in sources.items():
        shutil.copy(path, exported / name)
    assert hf_models.lowercase(source) is False and hf_models.lowercase(exported) is False


def test_export_refuses_a_foreign_folder(bert_folder, tmp_path):
    backbone_config, _ = hf_models.load_backbone(bert_folder)
    bundle = _trained_like(backbone_config, f"hf:{bert_folder}", tmp_path)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not empty and not an aligner-export folder"):
        hf_export.export_model(
            bundle.config, bundle.params, bundle.source["tokenizer"], tmp_path / "busy"
        )
    # a file merely named aligner_config.json does not make an export (the folder was deleted)
    (tmp_path / "busy" / "aligner_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="not empty and not an aligner-export folder"):
        hf_export.export_model(
            bundle.config, bundle.params, bundle.source["tokenizer"], tmp_path / "busy"
        )
    assert (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    out = tmp_path / "export"
    hf_export.export_model(bundle.config, bundle.params, bundle.source["tokenizer"], out)
    # an earlier export with the user's own files beside it is not replaced (they went with it)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds 1 file\(s\) or folder\(s\) an export does not"):
        hf_export.export_model(bundle.config, bundle.params, bundle.source["tokenizer"], out)
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    heads = load_file(str(out / "aligner_heads.safetensors"))
    del heads["doc_salience.bias"]
    save_file(heads, str(out / "aligner_heads.safetensors"))
    config = aligner_lib.AlignerConfig()
    with pytest.raises(CheckpointError, match=r"aligner_heads.safetensors: no tensor 'doc_sal"):
        loading.load_encoder(config=config, backbone_weights=f"hf:{out}")


def _identity_bundle(folder_spec):
    """The hf backbone's own vectors (zero-shot: identity projection, no salience)."""
    config = aligner_lib.AlignerConfig(
        backbone=None, projection="identity", salience="none", query_maxlen=16, doc_maxlen=48
    )
    return loading.load_encoder(config=config, backbone_weights=folder_spec)


@pytest.mark.parametrize("projection", ["dense", "identity"])
def test_export_pylate_layout(projection, bert_folder, tmp_path):
    """What PyLate reads (modules.json, sentence_bert_config.json, config_sentence_transformers
    .json, 1_Dense/) is written so that ColBERT(FOLDER) gives our token vectors: Transformer at
    the root, a bias-free Dense of W_p (or the identity), no prefixes, no query expansion, no
    skiplist, our token budgets; the computation these files define matches our Encoder."""
    backbone_config, _ = hf_models.load_backbone(bert_folder)
    if projection == "dense":
        bundle = _trained_like(backbone_config, f"hf:{bert_folder}", tmp_path)
        expected_weight = np.asarray(bundle.params["projection"]["kernel"]).T
    else:
        bundle = _identity_bundle(f"hf:{bert_folder}")
        expected_weight = np.eye(32, dtype=np.float32)
    out = tmp_path / "export"
    files = hf_export.export_model(bundle.config, bundle.params, bundle.source["tokenizer"], out)
    assert {
        "modules.json",
        "sentence_bert_config.json",
        "config_sentence_transformers.json",
        "1_Dense/config.json",
        "1_Dense/model.safetensors",
        "tokenizer.json",
    } <= set(files)
    modules = json.loads((out / "modules.json").read_text())
    assert [(m["idx"], m["path"], m["type"]) for m in modules] == [
        (0, "", "sentence_transformers.models.Transformer"),
        (1, "1_Dense", "pylate.models.Dense.Dense"),
    ]
    transformer = json.loads((out / "sentence_bert_config.json").read_text())
    assert transformer == {
        "max_seq_length": 48,
        "do_lower_case": False,
        "model_args": {"add_pooling_layer": False},
    }
    colbert = json.loads((out / "config_sentence_transformers.json").read_text())
    assert (colbert["model_type"], colbert["similarity_fn_name"]) == ("ColBERT", "MaxSim")
    assert (colbert["query_prefix"], colbert["document_prefix"]) == ("", "")
    assert (colbert["query_length"], colbert["document_length"]) == (16, 48)
    assert colbert["do_query_expansion"] is False
    assert colbert["attend_to_expansion_tokens"] is False
    assert colbert["skiplist_words"] == []
    dense = json.loads((out / "1_Dense" / "config.json").read_text())
    assert dense == {
        "in_features": 32,
        "out_features": bundle.config.output_dim,
        "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity",
        "use_residual": False,
    }
    weight = load_file(str(out / "1_Dense" / "model.safetensors"))
    assert list(weight) == ["linear.weight"]
    np.testing.assert_array_equal(weight["linear.weight"], expected_weight)
    assert "models.ColBERT" in (out / "README.md").read_text()

    # PyLate's computation from these files: the folder's tokenizer cut at query_length /
    # document_length, AutoModel(**model_args), Dense, L2 normalisation of the real tokens.
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModel.from_pretrained(out, **transformer["model_args"]).eval()
    encoder = Encoder(bundle)
    texts = [*TEXTS, " ".join(TEXTS * 2)]  # the last is cut at both budgets
    for kind, budget in (("query", 16), ("doc", 48)):
        batch = tokenizer(
            texts, truncation=True, max_length=budget, padding=True, return_tensors="pt"
        )
        with torch.no_grad():
            v = model(**batch).last_hidden_state @ torch.from_numpy(weight["linear.weight"]).T
            v = torch.nn.functional.normalize(v, p=2, dim=-1).numpy()
        ours = encoder.encode(texts, kind)
        assert len(ours[-1].token_ids) == budget and len(ours[0].token_ids) < budget
        for row, e in enumerate(ours):
            m = int(batch["attention_mask"][row].sum())
            assert batch["input_ids"][row][:m].tolist() == e.token_ids.tolist()
            np.testing.assert_allclose(v[row, :m], e.vectors, atol=1e-5, rtol=0)


def test_export_layouts_replace_each_other(bert_folder, tmp_path):
    backbone_config, _ = hf_models.load_backbone(bert_folder)
    bundle = _trained_like(backbone_config, f"hf:{bert_folder}", tmp_path)
    args = (bundle.config, bundle.params, bundle.source["tokenizer"], tmp_path / "export")
    pylate_files = set(hf_export.export_model(*args))
    plain = set(hf_export.export_model(*args, layout="transformers"))
    assert pylate_files - plain == {
        "modules.json",
        "sentence_bert_config.json",
        "config_sentence_transformers.json",
        "1_Dense/config.json",
        "1_Dense/model.safetensors",
    }
    assert not (tmp_path / "export" / "1_Dense").exists()
    assert "models.ColBERT" not in (tmp_path / "export" / "README.md").read_text()
    assert set(hf_export.export_model(*args, layout="pylate")) == pylate_files
    with pytest.raises(ConfigError, match=r"--format=onnx: choose one of pylate, transformers"):
        hf_export.export_model(*args, layout="onnx")


def test_a_reexport_through_a_symbolic_link_replaces_its_target(bert_folder, tmp_path):
    """The link was renamed aside and left behind (rmtree cannot remove a link), the real
    folder put in its place, and the export it pointed to left stale."""
    backbone_config, _ = hf_models.load_backbone(bert_folder)
    bundle = _trained_like(backbone_config, f"hf:{bert_folder}", tmp_path)
    args = (bundle.config, bundle.params, bundle.source["tokenizer"])
    hf_export.export_model(*args, tmp_path / "v1", layout="transformers")
    (tmp_path / "current").symlink_to(tmp_path / "v1")
    hf_export.export_model(*args, tmp_path / "current", layout="pylate")
    assert (tmp_path / "current").is_symlink() and (tmp_path / "v1" / "modules.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("failure", ["disk full", "interrupt"])
def test_a_failed_reexport_leaves_the_earlier_export_whole(
    bert_folder, tmp_path, monkeypatch, failure
):
    """The export is written beside the folder and renamed into place: a full disk or a
    Ctrl-C once deleted the PyLate files first and left a transformers-only folder (or a new
    backbone beside old heads)."""
    import errno

    from aligner_jax.common import errors

    backbone_config, _ = hf_models.load_backbone(bert_folder)
    bundle = _trained_like(backbone_config, f"hf:{bert_folder}", tmp_path)
    out = tmp_path / "export"
    args = (bundle.config, bundle.params, bundle.source["tokenizer"], out)
    hf_export.export_model(*args)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def fail(*_, **__):
        if failure == "interrupt":
            raise KeyboardInterrupt
        raise fileio.storage_error(out / "aligner_heads.safetensors", errno.ENOSPC) from OSError(
            errno.ENOSPC, "No space left on device"
        )

    monkeypatch.setattr(hf_export.aligner_heads, "save_heads", fail)
    if failure == "interrupt":
        with pytest.raises(KeyboardInterrupt):
            hf_export.export_model(*args, layout="transformers")
    else:
        with pytest.raises(errors.OutputWriteError, match="the export there before is unchanged"):
            hf_export.export_model(*args, layout="transformers")
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".export")) == []
    monkeypatch.undo()
    assert "modules.json" not in hf_export.export_model(*args, layout="transformers")


PEER_PYTHON = pathlib.Path("/work/peer-venv/bin/python")


@pytest.mark.slow
def test_pylate_loads_exports_as_they_are(bert_folder, tmp_path):
    """PyLate (in the peers' venv) loads the bundled zero-shot MiniLM's export and a trained-like
    model's (dense projection, LP saliences, its own WordPiece vocabulary) with no edits and
    encodes our token vectors within 1e-5 (benchmarks/peers/pylate_check.py)."""
    if not PEER_PYTHON.is_file():
        pytest.skip(f"{PEER_PYTHON} missing: bash benchmarks/peers/setup_peer_venv.sh")
    probe = subprocess.run([str(PEER_PYTHON), "-c", "import pylate"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"{PEER_PYTHON} has no pylate: bash benchmarks/peers/setup_peer_venv.sh")
    sys.path.insert(0, str(REPO / "benchmarks"))
    import pylate_export

    texts = [*TEXTS, *pylate_export.TEXTS]
    minilm_bundle = loading.load_encoder(
        config=aligner_lib.AlignerConfig(
            backbone=loading.minilm_backbone(), projection="identity", salience="none"
        )
    )
    backbone_config, _ = hf_models.load_backbone(bert_folder)
    trained = _trained_like(backbone_config, f"hf:{bert_folder}", tmp_path)
    pylate_export.write_case(tmp_path / "cases" / "minilm_zero_shot", minilm_bundle, texts)
    pylate_export.write_case(tmp_path / "cases" / "trained_like", trained, texts)
    report = tmp_path / "pylate.json"
    assert pylate_export.run_check(str(PEER_PYTHON), tmp_path / "cases", str(report)) == 0
    result = json.loads(report.read_text())
    assert result["pass"] and [c["case"] for c in result["cases"]] == [
        "minilm_zero_shot",
        "trained_like",
    ]
    for case in result["cases"]:
        for side in ("query", "doc"):
            assert case[side]["token_ids_equal"] and case[side]["max_abs_diff"] <= 1e-5
        assert case["settings"]["query_prefix"] == "" and not case["settings"]["do_query_expansion"]
    assert result["cases"][1]["query"]["dim"] == 8


def test_t5_tokenizer_for_t5x_checkpoints(tmp_path):
    """aligner_t5.gin's tokenizer 'auto': SentencePiece beside a t5x: checkpoint, or a clear
    refusal; the bundled WordPiece vocabulary is refused for T5X weights."""
    config = t5.T5Config(
        vocab_size=128, emb_dim=16, num_heads=2, num_layers=1, head_dim=8, mlp_dim=24
    )
    step = tmp_path / "model" / "checkpoint_5"
    step.mkdir(parents=True)
    spec = f"t5x:{step}"
    with pytest.raises(ConfigError, match="needs T5's SentencePiece vocabulary.*tokenizer="):
        loading.resolve_tokenizer("auto", spec, config)
    with pytest.raises(ConfigError, match="tokenizer='minilm' is BERT's WordPiece"):
        loading.resolve_tokenizer("minilm", spec, config)
    _spiece(tmp_path / "model")
    resolved = loading.resolve_tokenizer("auto", spec, config)
    assert resolved == f"sentencepiece:{tmp_path / 'model' / 'spiece.model'}"
    tok = loading.load_tokenizer(resolved)
    assert type(tok).__name__ == "SentencePieceTokenizer" and tok.encode("honey bees")[-1] == 1
    explicit = f"sentencepiece:{tmp_path / 'model' / 'spiece.model'}"
    assert loading.resolve_tokenizer(explicit, spec, config) == explicit


def _train_bindings(folder, tmp_path) -> list[str]:
    """A tiny training run (toy BEIR, learning rate 0) from the backbone ``hf:folder``."""
    from fixtures import write_toy_beir

    data = write_toy_beir(tmp_path / "data")
    bindings = {
        "MODEL_DIR": repr(str(tmp_path / "m")),
        "TRAIN_STEPS": 2,
        "QUERY_LENGTH": 8,
        "DOC_LENGTH": 16,
        "BATCH_SIZE": 2,
        "LEARNING_RATE": 0.0,
        "WARMUP_STEPS": 1,
        "DataConfig.task": "'beir_train_bm25'",
        "beir_train_source.dataset_dir": repr(str(data)),
        "beir_train_source.qrels_split": "'test'",
        "train.backbone_weights": repr(f"hf:{folder}"),
        "CheckpointConfig.period": 2,
    }
    return [f"{k} = {v}" for k, v in bindings.items()]


def test_trainer_takes_backbone_config_and_weights_from_hf(tmp_path):
    """``train.backbone_weights='hf:DIR'`` alone: the folder's architecture replaces the model
    gin's (bert_tiny: 32-d, 2 layers) and its weights initialise the backbone (learning rate 0:
    they come out of training unchanged); evaluation loads the checkpoint the same way."""

    from aligner_jax.common import cli
    from aligner_jax.training import trainer

    folder = tmp_path / "hf"
    config = transformers.BertConfig(
        vocab_size=30522,  # the task's WordPiece vocabulary (the bundled one)
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
    )
    torch.manual_seed(2)
    transformers.BertModel(config).save_pretrained(folder)
    shutil.copy(minilm.minilm_model_dir() / "tokenizer.json", folder / "tokenizer.json")
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], _train_bindings(folder, tmp_path))
    trainer.train()
    bundle = loading.load_encoder(checkpoint=str(tmp_path / "m"), backbone_weights=f"hf:{folder}")
    assert bundle.config.backbone.hidden_size == 16 and bundle.config.projection_dim == 16
    _, expected = hf_models.load_backbone(folder)
    jax.tree_util.tree_map(np.testing.assert_array_equal, bundle.params["backbone"], expected)


def test_trainer_tokenizes_with_the_hf_folder_tokenizer(bert_folder, tmp_path):
    """The training data of an ``hf:`` backbone is tokenized with the folder's tokenizer (here
    a vocabulary of the toy words, not the bundled WordPiece, whose ids would overrun the
    embedding); config.gin records it. A task_vocabulary binding naming another vocabulary is
    refused in one line; one naming the same vocabulary is accepted."""
    from aligner_jax.common import cli
    from aligner_jax.training import input_pipeline, trainer

    vocab_size = len(WORDS) + 5
    bundled = minilm.minilm_model_dir() / "tokenizer.json"
    bindings = _train_bindings(bert_folder, tmp_path)
    cli.parse_gin(
        ["models/bert_tiny.gin", "runs/train.gin"],
        [*bindings, f"task_vocabulary.tokenizer_file = {str(bundled)!r}"],
    )
    with pytest.raises(ConfigError, match=r"is not the tokenizer of train.backbone_weights") as e:
        trainer.train()
    assert "remove the task_vocabulary.tokenizer_file" in str(e.value).splitlines()[0]

    gin.clear_config()
    cli.parse_gin(["models/bert_tiny.gin", "runs/train.gin"], bindings)
    trainer.train()
    recorded = (tmp_path / "m" / "config.gin").read_text().replace("\\\n    ", "")
    assert f"task_vocabulary.tokenizer_file = {str(bert_folder / 'tokenizer.json')!r}" in recorded
    batch = next(input_pipeline.train_batches(input_pipeline.DataConfig()))
    assert 0 < batch["doc_tokens"].max() < vocab_size and batch["query_tokens"].max() < vocab_size

    # The check alone (training itself ran above): the folder's own tokenizer named explicitly is
    # accepted; a folder with only vocab.txt gets a tokenizer.json built from it in MODEL_DIR.
    gin.clear_config()
    own = bert_folder / "tokenizer.json"
    cli.parse_gin(["models/bert_tiny.gin"], [f"task_vocabulary.tokenizer_file = {str(own)!r}"])
    backbone = hf_models.backbone_config(bert_folder)
    trainer._use_weights_vocabulary(f"hf:{bert_folder}", backbone, tmp_path / "m")
    gin.clear_config()
    only_vocab = tmp_path / "vocab_only"
    shutil.copytree(bert_folder, only_vocab, ignore=shutil.ignore_patterns("tokenizer.json"))
    (tmp_path / "m2").mkdir()
    trainer._use_weights_vocabulary(f"hf:{only_vocab}", backbone, tmp_path / "m2")
    from aligner_jax import tasks

    vocabulary = tasks.task_vocabulary()
    assert vocabulary.tokenizer_file == str(tmp_path / "m2" / "tokenizer.json")
    expected = tokenizers.Tokenizer.from_file(str(own))  # the folder's tokenizer.json
    for text in TEXTS:
        assert vocabulary.encode(text) == expected.encode(text, add_special_tokens=False).ids


def test_evaluate_binary_with_only_an_hf_backbone_flag(bert_folder, run_binary, tmp_path):
    """``aligner-eval`` with no --gin_file and only the hf: flag: the default zero-shot run on
    the folder's architecture, weights and tokenizer."""
    from fixtures import write_toy_beir

    data = write_toy_beir(tmp_path / "data")
    out = tmp_path / "out"
    proc = run_binary(
        "evaluate",
        f"--dataset_dir={data}",
        f"--output_dir={out}",
        f"--gin.load_encoder.backbone_weights='hf:{bert_folder}'",  # a shell's "'hf:DIR'"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["model"] == f"hf:{bert_folder}/identity/none"
    assert metrics["num_queries"] == len(TOY_QUERIES)
    spec = json.loads((out / "index" / "encoder.json").read_text())
    assert spec["config"]["backbone"]["hidden_size"] == 32
    assert spec["source"]["tokenizer"] == str(bert_folder / "tokenizer.json")


def test_export_binary(run_binary, tmp_path):
    out = tmp_path / "exported"
    proc = run_binary(
        "export",
        "--gin_file=models/bert_tiny.gin",
        "--gin.load_encoder.seed=4",
        f"--output_dir={out}",
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        f"-> {out} (pylate): 1_Dense/config.json, 1_Dense/model.safetensors, README.md, "
        "aligner_config.json, aligner_heads.safetensors"
    ) in proc.stdout
    assert f"backbone_weights=\"'hf:{out}'\"" in proc.stdout
    assert (out / "tokenizer.json").is_file() and (out / "vocab.txt").is_file()
    recorded = json.loads((out / "aligner_config.json").read_text())
    assert (recorded["projection"], recorded["projection_dim"], recorded["salience"]) == (
        "dense",
        16,
        "lp",
    )
    # A folder holding something else is refused in one line.
    proc = run_binary("export", "--gin_file=models/bert_tiny.gin", f"--output_dir={tmp_path}")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"aligner-export: error: --output_dir={tmp_path}: not empty and not an aligner-export "
        "folder; choose an empty or new folder"
    )


def test_aligner_t5_gin_with_a_t5x_checkpoint_takes_sentencepiece(tmp_path):
    """models/aligner_t5.gin leaves the tokenizer on 'auto': a t5x: checkpoint without a
    SentencePiece model beside it is refused in one line naming the flag; with spiece.model
    beside it, that model is the tokenizer."""
    import orbax.checkpoint as ocp
    from flax import linen as nn

    from aligner_jax.common import cli

    step = tmp_path / "t5x_model" / "checkpoint_10"
    bindings = [
        f"load_encoder.backbone_weights = {f't5x:{step}'!r}",
        "T5Config.dropout_rate = 0.0",
    ]
    cli.parse_gin(["models/t5_tiny.gin", "models/aligner_t5.gin"], bindings)
    config = t5.T5Config()  # t5_tiny's sizes, from gin
    params = nn.unbox(t5.init_t5_encoder(config, jax.random.key(0)))["params"]
    ocp.PyTreeCheckpointer().save(step / "state", {"target": jax.device_get(params)})
    with pytest.raises(ConfigError, match=r"SentencePiece vocabulary.*load_encoder.tokenizer="):
        loading.load_encoder()
    _spiece(tmp_path / "t5x_model")
    bundle = loading.load_encoder()
    assert type(bundle.tokenizer).__name__ == "SentencePieceTokenizer"
    assert bundle.source["tokenizer"] == f"sentencepiece:{tmp_path / 't5x_model' / 'spiece.model'}"
    jax.tree_util.tree_map(np.testing.assert_array_equal, bundle.params["backbone"], params)
