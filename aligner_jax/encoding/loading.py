"""Building a ready encoder (config + params + tokenizer) from gin: pretrained, T5X or trained.

``load_encoder`` is the single gin-configurable entry point used by the evaluation, indexing and
explanation binaries:

  * ``checkpoint=None``: a fresh ALIGNER encoder whose backbone weights come from
    ``backbone_weights`` (``'minilm'``: the bundled all-MiniLM-L6-v2; ``'t5x:/path/checkpoint_N'``:
    a T5X T5 v1.1 checkpoint; ``'random'``: initialised from ``seed``), and whose projection and
    salience heads are freshly initialised (with ``projection='identity'`` and
    ``salience='none'`` there are none: the zero-shot setting);
  * ``checkpoint='/path/to/model_dir'`` (or a ``checkpoint_<step>`` folder): the parameters of a
    model trained with ``aligner-train``, restored with orbax.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gin
import jax
import jax.numpy as jnp

from aligner_jax.common.errors import ConfigError
from aligner_jax.encoding import tokenization
from aligner_jax.encoding.encoder import EncoderBundle
from aligner_jax.models import aligner as aligner_lib
from aligner_jax.models import bert, t5
from aligner_jax.weights import (
    aligner_checkpoint,
    bert_safetensors,
    minilm,
    param_checks,
    t5x_import,
)

# ``BertConfig(...)`` in gin files (e.g. tiny test models): ``BACKBONE = @BertConfig()``.
gin.external_configurable(bert.BertConfig, name="BertConfig", module="aligner_jax.models.bert")


@gin.configurable
def minilm_backbone():
    """The BertConfig of the bundled all-MiniLM-L6-v2 (read from its config.json)."""
    return bert_safetensors.read_bert_config(minilm.minilm_model_dir())


@gin.configurable
def load_tokenizer(name: str = "minilm"):
    """``'minilm'`` (the bundled WordPiece tokenizer), ``'sentencepiece:/path/spiece.model'``
    (T5) or a path to a Hugging Face tokenizer.json."""
    if name == "minilm":
        return tokenization.Tokenizer(minilm.minilm_model_dir() / "tokenizer.json")
    if name.startswith("sentencepiece:"):
        return tokenization.SentencePieceTokenizer(name[len("sentencepiece:") :])
    return tokenization.Tokenizer(name)


def load_backbone_params(spec: str, backbone_config, seed: int = 0):
    """Backbone parameters from ``'minilm'``, ``'t5x:<checkpoint dir>'`` or ``'random'``."""
    if spec == "minilm":
        _, params = bert_safetensors.load_bert_from_safetensors(minilm.minilm_model_dir())
        return params
    if spec.startswith("t5x:"):
        return t5x_import.load_t5x_encoder(spec[len("t5x:") :], backbone_config)
    if spec == "random":
        return None
    raise ConfigError(
        f"load_encoder.backbone_weights={spec!r}: expected 'minilm', 't5x:/path/to/checkpoint_N' "
        "or 'random'"
    )


@gin.configurable
def load_encoder(
    config: aligner_lib.AlignerConfig = gin.REQUIRED,
    backbone_weights: str = "minilm",
    checkpoint: str | None = None,
    tokenizer: str = "minilm",
    seed: int = 0,
    name: str | None = None,
) -> EncoderBundle:
    """An :class:`EncoderBundle` ready for encoding (see the module docstring)."""
    if config.backbone is None:
        raise ConfigError(
            "AlignerConfig.backbone is not bound: include a gin model file "
            "(e.g. --gin_file=models/minilm.gin)"
        )
    tok = load_tokenizer(tokenizer)
    source = {
        "backbone_weights": _absolute(backbone_weights, "t5x:"),
        "checkpoint": str(Path(checkpoint).resolve()) if checkpoint else None,
        "tokenizer": _absolute(tokenizer, "sentencepiece:"),
        "seed": seed,
    }
    if checkpoint:
        params, step = aligner_checkpoint.restore_params(checkpoint, config)
        label = name or f"{Path(checkpoint).resolve()}@{step}"
        return EncoderBundle(config=config, params=params, tokenizer=tok, name=label, source=source)
    params = aligner_lib.init_params(config, seed)
    backbone = load_backbone_params(backbone_weights, config.backbone, seed)
    if backbone is not None:
        param_checks.check_param_tree(
            params["backbone"], backbone, f"backbone weights {backbone_weights!r}"
        )
        params = dict(params)
        params["backbone"] = jax.tree_util.tree_map(jnp.asarray, backbone)
    label = name or f"{backbone_weights}/{config.projection}/{config.salience}"
    return EncoderBundle(config=config, params=params, tokenizer=tok, name=label, source=source)


def _absolute(spec: str, prefix: str) -> str:
    """``spec`` with a relative path made absolute (``minilm``/``random`` unchanged)."""
    if spec in ("minilm", "random"):
        return spec
    has_prefix = spec.startswith(prefix)
    path = spec[len(prefix) :] if has_prefix else spec
    return (prefix if has_prefix else "") + str(Path(path).resolve())


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
