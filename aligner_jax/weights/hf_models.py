"""``hf:DIR``: a Hugging Face BERT-family or T5 folder as an ALIGNER backbone, in and out.

A folder written by ``transformers`` ``save_pretrained`` (``config.json`` + ``model.safetensors``
or sharded safetensors) or a sentence-transformers folder (``modules.json`` → the Transformer
module's folder) gives everything a backbone needs:

  * the architecture, from ``config.json``: ``model_type`` ``bert`` (BERT, MiniLM, BGE, E5, … —
    every checkpoint whose config says ``bert``) → :class:`BertConfig`; ``t5`` (T5 v1.1 / v1.0,
    ``T5EncoderModel``, ``T5Model`` or ``T5ForConditionalGeneration``; the encoder only) →
    :class:`T5Config`. Any other ``model_type`` is a user error naming it;
  * the weights (``bert_safetensors`` / ``t5_safetensors``);
  * the tokenizer: ``tokenizer.json`` or WordPiece ``vocab.txt`` for BERT, ``spiece.model`` for
    T5 (:func:`tokenizer_file`).

:func:`save_backbone` writes the inverse folder (``BertModel`` / ``T5EncoderModel`` layout), which
``transformers.AutoModel`` / ``T5EncoderModel.from_pretrained`` load.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from aligner_jax.common.errors import ConfigError, MissingPathError
from aligner_jax.models.bert import BertConfig
from aligner_jax.models.t5 import T5Config
from aligner_jax.weights import bert_safetensors, hf_folder, t5_safetensors

PREFIX = "hf:"
SUPPORTED_MODEL_TYPES = ("bert", "t5")


def folder_of(spec: str) -> pathlib.Path:
    """The model folder of ``'hf:DIR'`` (a sentence-transformers folder resolved)."""
    if not spec.startswith(PREFIX) or not spec[len(PREFIX) :]:
        raise ConfigError(f"{spec!r}: expected 'hf:/path/to/model_folder'")
    path = pathlib.Path(spec[len(PREFIX) :]).expanduser()
    if not path.exists():
        raise MissingPathError(f"{spec!r}: {path} does not exist")
    return hf_folder.model_folder(path)


def model_type(model_dir: str | os.PathLike) -> str:
    """``config.json``'s ``model_type``, refused unless we implement it."""
    config = hf_folder.read_config(model_dir)
    kind = config.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{pathlib.Path(model_dir) / hf_folder.CONFIG_FILE}: model_type={kind!r} is not "
            f"supported by hf: (supported: {', '.join(SUPPORTED_MODEL_TYPES)}; BERT-family "
            "checkpoints load when their config.json says 'bert')"
        )
    return kind


def backbone_config(model_dir: str | os.PathLike) -> BertConfig | T5Config:
    """The backbone configuration of a model folder (from ``config.json``)."""
    source = str(pathlib.Path(model_dir) / hf_folder.CONFIG_FILE)
    if model_type(model_dir) == "t5":
        return t5_safetensors.config_from_hf(hf_folder.read_config(model_dir), source)
    return bert_safetensors.read_bert_config(model_dir)


def load_backbone(model_dir: str | os.PathLike) -> tuple[BertConfig | T5Config, dict[str, Any]]:
    """``(config, params)`` of the backbone in a model folder (float32 arrays)."""
    if model_type(model_dir) == "t5":
        return t5_safetensors.load_t5_from_safetensors(model_dir)
    return bert_safetensors.load_bert_from_safetensors(model_dir)


def save_backbone(
    config: BertConfig | T5Config, params: dict[str, Any], model_dir: str | os.PathLike
) -> pathlib.Path:
    """Writes ``config.json`` + ``model.safetensors`` in the ``transformers`` layout."""
    if isinstance(config, T5Config):
        return t5_safetensors.save_t5_to_safetensors(config, params, model_dir)
    if isinstance(config, BertConfig):
        return bert_safetensors.save_bert_to_safetensors(config, params, model_dir)
    raise TypeError(f"no Hugging Face layout for {type(config).__name__}")


def tokenizer_file(model_dir: str | os.PathLike, config: BertConfig | T5Config) -> pathlib.Path:
    """The folder's tokenizer: ``spiece.model`` (T5), else ``tokenizer.json`` or ``vocab.txt``."""
    model_dir = pathlib.Path(model_dir)
    names = ("spiece.model",) if isinstance(config, T5Config) else ("tokenizer.json", "vocab.txt")
    for name in names:
        if (model_dir / name).is_file():
            return model_dir / name
    raise MissingPathError(
        f"{model_dir}: no tokenizer ({' or '.join(names)}); save the tokenizer into the folder "
        "(tokenizer.save_pretrained) or set --gin.load_encoder.tokenizer"
    )


def lowercase(model_dir: str | os.PathLike) -> bool:
    """``do_lower_case`` of the folder's ``tokenizer_config.json`` (BERT's default: True)."""
    path = pathlib.Path(model_dir) / "tokenizer_config.json"
    if not path.is_file():
        return True
    config = hf_folder.read_json(path)
    return bool(config.get("do_lower_case", True))
