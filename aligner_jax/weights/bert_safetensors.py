"""Hugging Face BERT safetensors folders ↔ the Flax tree of ``models.bert.BertEncoder``.

``load_bert_from_safetensors`` maps Hugging Face tensor names onto the Flax tree of
``aligner_jax.models.bert.BertEncoder`` (kernels transposed from PyTorch's ``[out, in]`` to
``[in, out]``), checks that every tensor is used exactly once and has the expected shape, and
returns plain (unboxed) arrays. ``abstract_bert_params`` gives the boxed
(``nn.LogicallyPartitioned``) abstract tree from which ``aligner_jax.models.partitioning`` derives
shardings.

Library code reads only the safetensors, ``config.json`` and ``tokenizer.json`` files: it never
imports torch or sentence-transformers.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import traverse_util

from aligner_jax.models.bert import BertConfig, BertEncoder
from aligner_jax.weights import hf_folder

# Tensors of a BERT checkpoint that the encoder does not use: the registered position-id buffer
# and the pre-training / pooling heads.
_UNUSED_TENSORS = re.compile(r"^(embeddings\.position_ids|pooler\..*|cls\..*)$")

_EMBEDDINGS = {
    "embeddings.word_embeddings.weight": ("embeddings", "word_embeddings", "embedding"),
    "embeddings.position_embeddings.weight": ("embeddings", "position_embeddings", "embedding"),
    "embeddings.token_type_embeddings.weight": (
        "embeddings",
        "token_type_embeddings",
        "embedding",
    ),
}
_LAYER = {
    "attention.self.query": ("attention", "query"),
    "attention.self.key": ("attention", "key"),
    "attention.self.value": ("attention", "value"),
    "attention.output.dense": ("attention", "output"),
    "attention.output.LayerNorm": ("attention", "LayerNorm"),
    "intermediate.dense": ("intermediate",),
    "output.dense": ("output",),
    "output.LayerNorm": ("LayerNorm",),
}
_LEAF = {"weight": None, "bias": "bias", "gamma": "scale", "beta": "bias"}
_LAYER_RE = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias|gamma|beta)$")
_EMB_LN_RE = re.compile(r"^embeddings\.LayerNorm\.(weight|bias|gamma|beta)$")


def read_bert_config(model_dir: str | os.PathLike) -> BertConfig:
    """``BertConfig`` from ``<model_dir>/config.json``."""
    return BertConfig.from_hf_config(
        hf_folder.read_config(model_dir), source=str(pathlib.Path(model_dir) / "config.json")
    )


def read_max_seq_length(model_dir: str | os.PathLike, default: int | None = None) -> int | None:
    """``max_seq_length`` of ``sentence_bert_config.json`` (256 for all-MiniLM-L6-v2), or default."""
    path = pathlib.Path(model_dir) / "sentence_bert_config.json"
    if not path.is_file():
        return default
    return int(json.loads(path.read_text()).get("max_seq_length", default))


def hf_to_flax_path(name: str, num_layers: int) -> tuple[str, ...] | None:
    """The Flax parameter path of a Hugging Face BERT tensor name (``bert.`` prefix stripped).

    Returns None for tensors the encoder does not use (position-id buffer, pooler, MLM heads) and
    raises ValueError for names it does not know.
    """
    if _UNUSED_TENSORS.match(name):
        return None
    if name in _EMBEDDINGS:
        return _EMBEDDINGS[name]
    m = _EMB_LN_RE.match(name)
    if m:
        leaf = _LEAF[m.group(1)] or "scale"
        return ("embeddings", "LayerNorm", leaf)
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER and int(m.group(1)) < num_layers:
        module = _LAYER[m.group(2)]
        leaf = _LEAF[m.group(3)]
        if leaf is None:
            leaf = "scale" if module[-1] == "LayerNorm" else "kernel"
        return (f"layer_{int(m.group(1))}",) + module + (leaf,)
    raise ValueError(name)


def abstract_bert_params(
    config: BertConfig, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32
) -> dict[str, Any]:
    """Boxed abstract parameter tree (``nn.LogicallyPartitioned`` of ``ShapeDtypeStruct``).

    No memory is allocated. ``aligner_jax.models.partitioning.params_shardings(tree, mesh)`` turns it into
    NamedShardings; ``nn.unbox`` gives the plain shapes.
    """
    model = BertEncoder(config, dtype=dtype, param_dtype=param_dtype)
    ids = jax.ShapeDtypeStruct((1, 2), jnp.int32)
    mask = jax.ShapeDtypeStruct((1, 2), jnp.bool_)
    variables = jax.eval_shape(lambda i, m: model.init(jax.random.key(0), i, m), ids, mask)
    return variables["params"]


def init_bert_params(
    config: BertConfig, rng: jax.Array, param_dtype: Any = jnp.float32
) -> dict[str, Any]:
    """Randomly initialised, unboxed parameters (tests and training from scratch)."""
    model = BertEncoder(config, param_dtype=param_dtype)
    ids = jnp.zeros((1, 2), jnp.int32)
    variables = model.init(rng, ids, jnp.ones((1, 2), bool))
    return nn.unbox(variables["params"])


def load_bert_from_safetensors(
    model_dir: str | os.PathLike, dtype: Any = jnp.float32
) -> tuple[BertConfig, dict[str, Any]]:
    """Loads ``<model_dir>/{config.json, model.safetensors}`` into ``BertEncoder`` parameters.

    Tensor names may carry a ``bert.`` prefix (``BertForMaskedLM`` checkpoints) or not
    (``BertModel``); the weights may be sharded (``model.safetensors.index.json``). The
    position-id buffer, pooler and MLM heads are skipped; any other tensor the encoder does not
    know, a tensor mapped twice, a missing tensor or a shape mismatch raises a ``CheckpointError``
    naming the file and the tensor.

    Args:
      model_dir: Hugging Face model folder.
      dtype: dtype the parameters are returned in (``BertEncoder.param_dtype``).

    Returns:
      ``(config, params)`` with plain arrays; use ``BertEncoder(config).apply({'params': params},
      ids, mask)``.
    """
    config = read_bert_config(model_dir)
    expected = {
        k: v.shape
        for k, v in traverse_util.flatten_dict(
            nn.unbox(abstract_bert_params(config, param_dtype=dtype))
        ).items()
    }

    def target_of(name: str):
        short = name[len("bert.") :] if name.startswith("bert.") else name
        try:
            path = hf_to_flax_path(short, config.num_hidden_layers)
        except ValueError:
            raise KeyError(name) from None
        return None if path is None else (path, path[-1] == "kernel")

    params = hf_folder.load_mapped(
        model_dir,
        target_of,
        expected,
        flax_to_hf_name,
        f"a BERT encoder with num_hidden_layers={config.num_hidden_layers} (check config.json)",
        dtype,
    )
    return config, params


def flax_to_hf_name(flax_path: tuple[str, ...]) -> str:
    """Hugging Face ``BertModel`` tensor name of a Flax parameter path (inverse of
    ``hf_to_flax_path``)."""
    for name, p in _EMBEDDINGS.items():
        if p == tuple(flax_path):
            return name
    leaf = {"kernel": "weight", "scale": "weight", "bias": "bias"}[flax_path[-1]]
    if flax_path[0] == "embeddings" and flax_path[1] == "LayerNorm":
        return f"embeddings.LayerNorm.{leaf}"
    layer = flax_path[0].removeprefix("layer_")
    for hf, module in _LAYER.items():
        if module == tuple(flax_path[1:-1]):
            return f"encoder.layer.{layer}.{hf}.{leaf}"
    raise ValueError(f"{'/'.join(flax_path)} is not a BertEncoder parameter.")


def save_bert_to_safetensors(
    config: BertConfig, params: dict[str, Any], model_dir: str | os.PathLike
) -> pathlib.Path:
    """Writes ``config.json`` and ``model.safetensors`` (Hugging Face ``BertModel`` layout).

    The inverse of ``load_bert_from_safetensors``: kernels are transposed back to ``[out, in]``.
    Returns the folder.
    """
    tensors = hf_folder.hf_tensors(
        nn.unbox(params), lambda path: (flax_to_hf_name(path), path[-1] == "kernel")
    )
    return hf_folder.write_folder(model_dir, config.to_hf_config(), tensors)
