"""Building a ready encoder (config + params + tokenizer) from gin: pretrained, Hugging Face, T5X
or trained.

``load_encoder`` is the single gin-configurable entry point used by the evaluation, indexing and
explanation binaries:

  * ``checkpoint=None``: a fresh ALIGNER encoder whose backbone weights come from
    ``backbone_weights``: ``'minilm'`` (the bundled all-MiniLM-L6-v2), ``'hf:/path/folder'`` (a
    Hugging Face BERT-family or T5 folder, or a sentence-transformers folder: its config,
    weights and tokenizer all come from the folder, and an ``aligner-export`` folder brings its
    projection and salience heads too), ``'t5x:/path/checkpoint_N'`` (a T5X T5 v1.1
    checkpoint) or ``'random'`` (initialised from ``seed``). Heads not given by the weights are
    freshly initialised (with ``projection='identity'`` and ``salience='none'`` there are none:
    the zero-shot setting);
  * ``checkpoint='/path/to/model_dir'`` (or a ``checkpoint_<step>`` folder): the parameters of a
    model trained with ``aligner-train``, restored with orbax (with ``hf:`` weights the
    architecture is the folder's, as in training).

``tokenizer='auto'`` (the default) takes the tokenizer that belongs to the weights: the bundled
WordPiece one for ``minilm`` / ``random``, the folder's for ``hf:``, a SentencePiece model beside
a ``t5x:`` checkpoint (refused, naming the flag, when there is none).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import gin
import jax
import jax.numpy as jnp
import tokenizers
from absl import logging

from aligner_jax.common import checks
from aligner_jax.common.errors import ConfigError
from aligner_jax.encoding import tokenization
from aligner_jax.encoding.encoder import EncoderBundle
from aligner_jax.models import aligner as aligner_lib
from aligner_jax.models import bert, t5
from aligner_jax.weights import (
    aligner_checkpoint,
    aligner_heads,
    bert_safetensors,
    hf_folder,
    hf_models,
    minilm,
    param_checks,
    t5x_import,
)

# ``BertConfig(...)`` in gin files (e.g. tiny test models): ``BACKBONE = @BertConfig()``.
gin.external_configurable(bert.BertConfig, name="BertConfig", module="aligner_jax.models.bert")

AUTO = "auto"
TRAINED_CONFIG = "config.gin"  # written by aligner-train into MODEL_DIR
# SentencePiece models looked for beside a T5X checkpoint (its folder and the model folder).
_T5X_VOCABULARIES = ("spiece.model", "sentencepiece.model")
_PATH_PREFIXES = ("t5x:", "hf:", "sentencepiece:", "wordpiece:")


@gin.configurable
def minilm_backbone():
    """The BertConfig of the bundled all-MiniLM-L6-v2 (read from its config.json)."""
    return bert_safetensors.read_bert_config(minilm.minilm_model_dir())


@gin.configurable
def load_tokenizer(name: str = "minilm"):
    """``'minilm'`` (the bundled WordPiece tokenizer), ``'sentencepiece:/path/spiece.model'``
    (T5), ``'wordpiece:/path/vocab.txt'`` (a BERT vocabulary; lower-casing from the
    ``tokenizer_config.json`` beside it) or a path to a Hugging Face tokenizer.json."""
    if name == "minilm":
        return tokenization.Tokenizer(minilm.minilm_model_dir() / "tokenizer.json")
    if name.startswith("sentencepiece:"):
        return tokenization.SentencePieceTokenizer(name[len("sentencepiece:") :])
    if name.startswith("wordpiece:"):
        return _wordpiece_tokenizer(Path(name[len("wordpiece:") :]))
    return tokenization.Tokenizer(name)


def _wordpiece_tokenizer(vocab_file: Path) -> tokenization.Tokenizer:
    """The BERT tokenizer of a ``vocab.txt`` (what ``BertTokenizerFast`` builds from it)."""
    if not vocab_file.is_file():
        raise FileNotFoundError(f"WordPiece vocabulary {vocab_file} does not exist")
    built = tokenizers.BertWordPieceTokenizer(
        str(vocab_file), lowercase=hf_models.lowercase(vocab_file.parent)
    )
    with tempfile.TemporaryDirectory() as tmp:  # Tokenizer reads a tokenizer.json file
        built.save(str(Path(tmp) / "tokenizer.json"))
        return tokenization.Tokenizer(Path(tmp) / "tokenizer.json")


def resolve_tokenizer(tokenizer: str, backbone_weights: str, backbone_config) -> str:
    """The concrete tokenizer spec of ``load_encoder(tokenizer=..., backbone_weights=...)``."""
    if backbone_weights.startswith("t5x:"):
        if tokenizer == AUTO:
            return "sentencepiece:" + str(_t5x_vocabulary(backbone_weights))
        if tokenizer == "minilm":
            raise ConfigError(
                f"load_encoder.tokenizer='minilm' is BERT's WordPiece vocabulary, but "
                f"load_encoder.backbone_weights={backbone_weights!r} is a T5 checkpoint: set "
                "--gin.load_encoder.tokenizer=\"'sentencepiece:/path/spiece.model'\" (or 'auto' "
                "with spiece.model beside the checkpoint)"
            )
    if tokenizer != AUTO:
        return tokenizer
    if backbone_weights.startswith(hf_models.PREFIX):
        file = hf_models.tokenizer_file(hf_models.folder_of(backbone_weights), backbone_config)
        prefix = {".model": "sentencepiece:", ".txt": "wordpiece:"}.get(file.suffix, "")
        return prefix + str(file)
    return "minilm"


def _t5x_vocabulary(backbone_weights: str) -> Path:
    checkpoint = Path(backbone_weights[len("t5x:") :])
    for folder in (checkpoint, checkpoint.parent, checkpoint.parent.parent):
        for name in _T5X_VOCABULARIES:
            if (folder / name).is_file():
                return folder / name
    raise ConfigError(
        f"load_encoder.backbone_weights={backbone_weights!r} is a T5 checkpoint, which needs T5's "
        f"SentencePiece vocabulary, and no {' or '.join(_T5X_VOCABULARIES)} is beside it: set "
        "--gin.load_encoder.tokenizer=\"'sentencepiece:/path/spiece.model'\" (T5 v1.1: "
        "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model)"
    )


def config_for_weights(config: aligner_lib.AlignerConfig, backbone_weights: str | None):
    """``config`` with what ``hf:`` weights define: the backbone's config (``config.json``) and,
    for an ``aligner-export`` folder, the head architecture (``aligner_config.json``)."""
    if not backbone_weights or not backbone_weights.startswith(hf_models.PREFIX):
        return config
    folder = hf_models.folder_of(backbone_weights)
    if not aligner_heads.has_heads(folder):
        hf_folder.refuse_unread_modules(Path(backbone_weights[len(hf_models.PREFIX) :]))
    changes = {"backbone": hf_models.backbone_config(folder)}
    if aligner_heads.has_heads(folder):
        changes.update(aligner_heads.read_architecture(folder))
    replaced = {k for k, v in changes.items() if getattr(config, k) != v}
    if replaced and config.backbone is not None:
        logging.info("%s sets %s (replacing the gin bindings)", backbone_weights, sorted(replaced))
    return dataclasses.replace(config, **changes)


def load_backbone_params(spec: str, backbone_config, seed: int = 0):
    """Backbone parameters from ``'minilm'``, ``'hf:<folder>'``, ``'t5x:<checkpoint dir>'`` or
    ``'random'`` (None)."""
    if spec == "minilm":
        _, params = bert_safetensors.load_bert_from_safetensors(minilm.minilm_model_dir())
        return params
    if spec.startswith(hf_models.PREFIX):
        config, params = hf_models.load_backbone(hf_models.folder_of(spec))
        if config != backbone_config:
            raise ConfigError(
                f"backbone weights {spec!r}: the model is configured with {backbone_config} but "
                f"the folder holds {config}"
            )
        return params
    if spec.startswith("t5x:"):
        return t5x_import.load_t5x_encoder(spec[len("t5x:") :], backbone_config)
    check_weights_spec(spec)
    return None  # 'random'


def check_weights_spec(spec, binding: str = "load_encoder.backbone_weights") -> None:
    """Refuses a weights spec that is none of the four kinds, naming ``binding``."""
    if isinstance(spec, str) and (
        spec in ("minilm", "random") or spec.startswith((hf_models.PREFIX, "t5x:"))
    ):
        return
    raise ConfigError(
        f"{binding}={spec!r}: expected 'minilm', 'hf:/path/to/model_folder', "
        "'t5x:/path/to/checkpoint_N' or 'random'"
    )


@gin.configurable
def load_encoder(
    config: aligner_lib.AlignerConfig | None = None,
    backbone_weights: str = "minilm",
    checkpoint: str | None = None,
    tokenizer: str = AUTO,
    seed: int = 0,
    name: str | None = None,
) -> EncoderBundle:
    """An :class:`EncoderBundle` ready for encoding (see the module docstring); ``config``
    must be bound (a model file)."""
    checks.required("load_encoder.config", config)
    config = config_for_weights(config, backbone_weights)
    if config.backbone is None:
        raise ConfigError(
            "AlignerConfig.backbone is not bound: include a gin model file "
            "(e.g. --gin_file=models/minilm.gin) or use hf: backbone weights"
        )
    tokenizer = resolve_tokenizer(tokenizer, backbone_weights, config.backbone)
    tok = load_tokenizer(tokenizer)
    if tok.vocab_size > config.backbone.vocab_size:  # larger ids would silently read other rows
        raise ConfigError(
            f"load_encoder.tokenizer={tokenizer!r} has {tok.vocab_size} token ids but the "
            f"backbone's embedding has {config.backbone.vocab_size} rows: use the backbone's own "
            "tokenizer (load_encoder.tokenizer='auto')"
        )
    source = {
        "backbone_weights": _absolute(backbone_weights),
        "checkpoint": str(Path(checkpoint).resolve()) if checkpoint else None,
        "tokenizer": _absolute(tokenizer),
        "seed": seed,
    }
    if checkpoint:
        params, step = aligner_checkpoint.restore_params(checkpoint, config)
        label = name or f"{Path(checkpoint).resolve()}@{step}"
        return EncoderBundle(config=config, params=params, tokenizer=tok, name=label, source=source)
    backbone = load_backbone_params(backbone_weights, config.backbone, seed)
    if backbone is None:
        params = aligner_lib.init_params(config, seed)
    else:
        param_checks.check_param_tree(
            aligner_lib.abstract_params(config)["backbone"],
            backbone,
            f"backbone weights {backbone_weights!r}",
        )
        params = aligner_lib.init_head_params(config, seed)
        params["backbone"] = jax.tree_util.tree_map(jnp.asarray, backbone)
    heads = exported_heads(backbone_weights, params)
    if heads is not None:
        params = dict(params)
        params.update(jax.tree_util.tree_map(jnp.asarray, heads))
    if backbone is not None and heads is None and any(k != "backbone" for k in params):
        logging.warning(
            "the model's %s projection and %s salience heads are randomly initialised (pretrained "
            "backbone %r, no load_encoder.checkpoint): its vectors and saliences are not a trained "
            "model's. Give --gin.load_encoder.checkpoint=\"'MODEL_DIR'\" (an aligner-train run), or use "
            "models/minilm_identity.gin for the zero-shot model",
            config.projection, config.salience, backbone_weights,
        )  # fmt: skip
    label = name or f"{backbone_weights}/{config.projection}/{config.salience}"
    return EncoderBundle(config=config, params=params, tokenizer=tok, name=label, source=source)


def exported_heads(backbone_weights: str, params: dict) -> dict | None:
    """The projection and salience heads an ``aligner-export`` folder (``hf:DIR``) holds, shaped
    as ``params``' (None for other weights or a plain Hugging Face folder): ``load_encoder``
    and the trainer both start from them."""
    if not backbone_weights.startswith(hf_models.PREFIX):
        return None
    folder = hf_models.folder_of(backbone_weights)
    return aligner_heads.load_heads(folder, params) if aligner_heads.has_heads(folder) else None


def _absolute(spec: str) -> str:
    """``spec`` with a relative path made absolute (``minilm``/``random``/URLs unchanged)."""
    if spec in ("minilm", "random", AUTO):
        return spec
    prefix = next((p for p in _PATH_PREFIXES if spec.startswith(p)), "")
    path = spec[len(prefix) :]
    return spec if "://" in path else prefix + str(Path(path).resolve())


_BACKBONES = {"BertConfig": bert.BertConfig, "T5Config": t5.T5Config}


def encoder_from_spec(spec: dict, checkpoint: str | None = None) -> EncoderBundle:
    """Rebuilds the encoder an index was built with from ``EncoderBundle.spec()`` (saved as the
    index's ``encoder.json``); ``checkpoint`` replaces the recorded one."""
    source = spec.get("source") or {}
    cfg = dict(spec["config"])
    backbone = dict(cfg.pop("backbone"))
    kind = backbone.pop("type")
    if kind not in _BACKBONES:
        raise ConfigError(f"encoder spec: unknown backbone type {kind!r}")
    tuples = lambda d: {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}  # noqa: E731
    config = aligner_lib.AlignerConfig(**tuples(cfg), backbone=_BACKBONES[kind](**tuples(backbone)))
    return load_encoder(
        config=config,
        backbone_weights=source.get("backbone_weights", "minilm"),
        checkpoint=checkpoint or source.get("checkpoint"),
        tokenizer=source.get("tokenizer", "minilm"),
        seed=source.get("seed", 0),
    )


def bundle_with(bundle: EncoderBundle, **config_changes) -> EncoderBundle:
    """The same parameters under a modified (compatible) config, e.g. other max lengths."""
    return dataclasses.replace(
        bundle, config=dataclasses.replace(bundle.config, **config_changes), _fingerprint=None
    )


def trained_config(checkpoint: str | None) -> Path | None:
    """The ``config.gin`` of the MODEL_DIR that ``checkpoint`` names (MODEL_DIR, its
    ``checkpoints`` folder or a step folder), or None."""
    if not checkpoint:
        return None
    path = Path(checkpoint).resolve()
    for folder in (path, path.parent, path.parent.parent):
        if (folder / TRAINED_CONFIG).is_file():
            return folder / TRAINED_CONFIG
    return None


def gin_file_needed(checkpoint: str | None) -> str:
    """Why ``checkpoint`` alone does not name a model (``""`` when it does: no checkpoint, or
    its MODEL_DIR's ``config.gin`` is found): what a binary without ``--gin_file`` says."""
    if not checkpoint or trained_config(checkpoint):
        return ""
    if not Path(checkpoint).exists():
        return f"--checkpoint={checkpoint}: no such folder"
    return (
        f"--checkpoint={checkpoint} has no {TRAINED_CONFIG} (written by aligner-train in "
        "MODEL_DIR): name the model file it was trained with, e.g. --gin_file=models/minilm.gin"
    )


def bind_encoder_as_trained() -> None:
    """Binds what a training ``config.gin`` gives ``train``/``task_vocabulary`` but
    ``load_encoder`` needs: the model, the backbone weights and the training tokenizer (each
    only when not bound already)."""
    if checks.bound_value("load_encoder.config") is None:
        gin.parse_config("load_encoder.config = @AlignerConfig()")
    if checks.bound_value("load_encoder.backbone_weights") is None:
        gin.bind_parameter(
            "load_encoder.backbone_weights",
            checks.bound_value("train.backbone_weights") or "random",
        )
    kind = checks.bound_value("task_vocabulary.kind")
    sentencepiece = checks.bound_value("task_vocabulary.sentencepiece_model_file")
    wordpiece = checks.bound_value("task_vocabulary.tokenizer_file")
    if checks.bound_value("load_encoder.tokenizer") is None and (sentencepiece or wordpiece):
        spec = f"sentencepiece:{sentencepiece}" if kind == "sentencepiece" else wordpiece
        gin.bind_parameter("load_encoder.tokenizer", spec)
