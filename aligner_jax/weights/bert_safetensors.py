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
import numpy as np
from absl import logging
from flax import linen as nn
from flax import traverse_util
from safetensors import safe_open
from safetensors.numpy import save_file

from aligner_jax.common.errors import CheckpointError, ConfigError
from aligner_jax.models.bert import BertConfig, BertEncoder

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
    path = pathlib.Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: expected a Hugging Face model folder.")
    try:
        hf_config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e}).") from e
    return BertConfig.from_hf_config(hf_config, source=str(path))


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
    (``BertModel``). The position-id buffer, pooler and MLM heads are skipped; any other tensor
    the encoder does not know, a tensor mapped twice, a missing tensor or a shape mismatch raises
    a ValueError naming the file and the tensor.

    Args:
      model_dir: Hugging Face model folder.
      dtype: dtype the parameters are returned in (``BertEncoder.param_dtype``).

    Returns:
      ``(config, params)`` with plain arrays; use ``BertEncoder(config).apply({'params': params},
      ids, mask)``.
    """
    model_dir = pathlib.Path(model_dir)
    config = read_bert_config(model_dir)
    path = model_dir / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; convert the checkpoint to safetensors (pytorch_model.bin is "
            "not read, to keep torch out of the library)."
        )
    expected = {
        k: v.shape
        for k, v in traverse_util.flatten_dict(
            nn.unbox(abstract_bert_params(config, param_dtype=dtype))
        ).items()
    }
    loaded: dict[tuple[str, ...], np.ndarray] = {}
    source_of: dict[tuple[str, ...], str] = {}
    skipped = []
    with safe_open(str(path), framework="numpy") as f:
        for name in f.keys():
            short = name[len("bert.") :] if name.startswith("bert.") else name
            try:
                flax_path = hf_to_flax_path(short, config.num_hidden_layers)
            except ValueError:
                raise CheckpointError(
                    f"{path}: tensor {name!r} is not part of a BERT encoder with "
                    f"num_hidden_layers={config.num_hidden_layers} (check config.json)."
                ) from None
            if flax_path is None:
                skipped.append(name)
                continue
            if flax_path in loaded:
                raise CheckpointError(
                    f"{path}: tensors {source_of[flax_path]!r} and {name!r} both map to "
                    f"parameter {'/'.join(flax_path)}; the checkpoint holds the encoder twice."
                )
            array = f.get_tensor(name)
            hf_shape = tuple(array.shape)
            if flax_path[-1] == "kernel":
                array = array.T  # PyTorch Linear stores [out, in].
            if array.shape != expected[flax_path]:
                raise CheckpointError(
                    f"{path}: tensor {name!r} has shape {hf_shape}, expected "
                    f"{_hf_shape(flax_path, expected[flax_path])} from "
                    f"{model_dir / 'config.json'} (parameter {'/'.join(flax_path)})."
                )
            loaded[flax_path] = array
            source_of[flax_path] = name
    missing = sorted(set(expected) - set(loaded))
    if missing:
        names = ", ".join(repr(flax_to_hf_name(p)) for p in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise CheckpointError(f"{path}: {len(missing)} encoder tensor(s) missing: {names}{more}.")
    if skipped:
        logging.info(
            "%s: skipped %d tensors not used by the encoder: %s", path, len(skipped), skipped
        )
    params = traverse_util.unflatten_dict(
        {k: jnp.asarray(v, dtype=dtype) for k, v in loaded.items()}
    )
    return config, params


def _hf_shape(flax_path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(reversed(shape)) if flax_path[-1] == "kernel" else tuple(shape)


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

    model_dir = pathlib.Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for flax_path, value in traverse_util.flatten_dict(nn.unbox(params)).items():
        array = np.asarray(value, dtype=np.float32)
        if flax_path[-1] == "kernel":
            array = array.T
        tensors[flax_to_hf_name(flax_path)] = np.ascontiguousarray(array)
    save_file(tensors, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2) + "\n")
    return model_dir
