"""Hugging Face model folders on disk: ``config.json``, (sharded) safetensors, tokenizer files.

The format-level rules shared by every architecture we map (``bert_safetensors``,
``t5_safetensors``), written once:

  * ``model_folder``: a ``transformers`` folder, or a sentence-transformers folder whose
    ``modules.json`` names the Transformer module's sub-folder (its pooling is irrelevant for
    token vectors);
  * ``read_config``: ``config.json`` as a dict (a user error naming the file when it is missing or
    not JSON);
  * ``load_mapped``: the tensors of ``model.safetensors`` or of the shards listed in
    ``model.safetensors.index.json``, mapped onto a Flax parameter tree by a per-architecture
    name map, each used once, with the expected shapes;
  * ``write_folder``: ``config.json`` + ``model.safetensors`` written atomically.

Only safetensors are read (``pytorch_model.bin`` would need torch): the library never imports
torch or transformers.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import traverse_util
from safetensors import safe_open
from safetensors.numpy import save

from aligner_jax.common import fileio
from aligner_jax.common.errors import CheckpointError, ConfigError, MissingPathError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
MODULES_FILE = "modules.json"  # sentence-transformers
# Files a tokenizer may consist of, copied as they are when a model is exported.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "spiece.model",
)

# (flax parameter path, transpose?) of a checkpoint tensor; None: a tensor the encoder ignores.
Target = tuple[tuple[str, ...], bool] | None


def model_folder(path: str | os.PathLike) -> pathlib.Path:
    """The folder holding ``config.json``: ``path`` itself, or the Transformer module's folder of
    a sentence-transformers model (``modules.json``)."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise MissingPathError(f"{path}: not a folder (expected a Hugging Face model folder)")
    modules = path / MODULES_FILE
    if (path / CONFIG_FILE).is_file() or not modules.is_file():
        return path
    try:
        entries = json.loads(modules.read_text())
        subfolders = [
            e.get("path", "") for e in entries if str(e.get("type", "")).endswith("Transformer")
        ]
    except (json.JSONDecodeError, AttributeError, TypeError) as e:
        raise ConfigError(f"{modules}: not a sentence-transformers modules.json ({e})") from e
    if not subfolders:
        raise ConfigError(f"{modules}: no sentence_transformers.models.Transformer module")
    return path / subfolders[0]


def refuse_unread_modules(path: pathlib.Path) -> None:
    """A sentence-transformers / PyLate folder whose ``modules.json`` transforms the token
    vectors after the Transformer (a ``Dense`` projection: ColBERT's 128-d layer) is refused:
    only its Transformer would be read, and its vectors would not be the model's. (An
    ``aligner-export`` folder reads its projection from ``aligner_heads.safetensors``.)"""
    modules = path.expanduser() / MODULES_FILE
    if not modules.is_file():
        return
    try:
        types = [str(e.get("type", "")) for e in json.loads(modules.read_text())]
    except (json.JSONDecodeError, AttributeError, TypeError) as e:
        raise ConfigError(f"{modules}: not a sentence-transformers modules.json ({e})") from e
    dense = [t for t in types if t.rsplit(".", 1)[-1] == "Dense"]
    if dense:
        raise ConfigError(
            f"{modules}: the model projects its token vectors with {dense[0]} after the "
            "Transformer, which aligner_jax does not read (nor PyLate's [Q]/[D] prefixes and "
            "query expansion): its vectors would not be this model's. Load an aligner-export "
            "folder, or put the Transformer's own files (config.json, model.safetensors, the "
            "tokenizer) in a folder of their own to use it as a backbone"
        )


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON object file of a model folder (a user error naming it if missing or invalid)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise MissingPathError(
            f"{path} does not exist: expected a Hugging Face model folder (config.json, "
            "model.safetensors)."
        )
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e}).") from e
    if not isinstance(obj, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return obj


def read_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of a model folder, as a dict."""
    return read_json(pathlib.Path(model_dir) / CONFIG_FILE)


def weight_files(model_dir: str | os.PathLike) -> tuple[pathlib.Path, list[pathlib.Path]]:
    """(the file to name in messages, the safetensors files): ``model.safetensors``, or the shards
    of ``model.safetensors.index.json``."""
    model_dir = pathlib.Path(model_dir)
    single = model_dir / WEIGHTS_FILE
    if single.is_file():
        return single, [single]
    index = model_dir / WEIGHTS_INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted({model_dir / name for name in weight_map.values()})
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index}: not a safetensors index ({e})") from e
        for shard in shards:
            if not shard.is_file():
                raise MissingPathError(f"{index} lists {shard.name}, which does not exist")
        return index, shards
    raise MissingPathError(
        f"{single} does not exist; convert the checkpoint to safetensors (pytorch_model.bin is "
        "not read, to keep torch out of the library)."
    )


def load_mapped(
    model_dir: str | os.PathLike,
    target_of: Callable[[str], Target],
    expected: Mapping[tuple[str, ...], tuple[int, ...]],
    hf_name_of: Callable[[tuple[str, ...]], str],
    unknown_hint: str,
    dtype: Any = jnp.float32,
) -> dict[str, Any]:
    """The Flax parameter tree of ``expected``'s paths, read from a folder's safetensors.

    ``target_of(name)`` maps a checkpoint tensor to ``(flax path, transpose)`` (PyTorch ``Linear``
    stores ``[out, in]``), to None for tensors the encoder does not use, or raises ``KeyError``
    for a name it does not know (reported with ``unknown_hint``). Every expected parameter must
    come from exactly one tensor of the expected shape; errors name the file and the tensor.
    """
    where, files = weight_files(model_dir)
    loaded: dict[tuple[str, ...], np.ndarray] = {}
    source_of: dict[tuple[str, ...], str] = {}
    skipped = []
    for file in files:
        with safe_open(str(file), framework="numpy") as f:
            for name in f.keys():
                try:
                    target = target_of(name)
                except KeyError:
                    raise CheckpointError(
                        f"{file}: tensor {name!r} is not part of {unknown_hint}."
                    ) from None
                if target is None:
                    skipped.append(name)
                    continue
                path, transpose = target
                if path not in expected:
                    raise CheckpointError(
                        f"{file}: tensor {name!r} ({'/'.join(path)}) is not part of {unknown_hint}."
                    )
                if path in loaded:
                    raise CheckpointError(
                        f"{file}: tensors {source_of[path]!r} and {name!r} both map to "
                        f"parameter {'/'.join(path)}; the checkpoint holds the encoder twice."
                    )
                array = f.get_tensor(name)
                want = tuple(reversed(expected[path])) if transpose else tuple(expected[path])
                if tuple(array.shape) != want:
                    raise CheckpointError(
                        f"{file}: tensor {name!r} has shape {tuple(array.shape)}, expected "
                        f"{want} from {pathlib.Path(model_dir) / CONFIG_FILE} (parameter "
                        f"{'/'.join(path)})."
                    )
                loaded[path] = array.T if transpose else array
                source_of[path] = name
    missing = sorted(set(expected) - set(loaded))
    if missing:
        names = ", ".join(repr(hf_name_of(p)) for p in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise CheckpointError(f"{where}: {len(missing)} encoder tensor(s) missing: {names}{more}.")
    if skipped:
        logging.info(
            "%s: skipped %d tensors not used by the encoder: %s",
            where,
            len(skipped),
            skipped[:10],
        )
    return traverse_util.unflatten_dict({k: jnp.asarray(v, dtype=dtype) for k, v in loaded.items()})


def hf_tensors(
    params: Mapping[str, Any], hf_name_of: Callable[[tuple[str, ...]], tuple[str, bool]]
) -> dict[str, np.ndarray]:
    """PyTorch-layout float32 tensors of a Flax tree: ``hf_name_of(path) -> (name, transpose)``."""
    tensors = {}
    for path, value in traverse_util.flatten_dict(dict(params)).items():
        name, transpose = hf_name_of(path)
        array = np.asarray(value, dtype=np.float32)
        tensors[name] = np.ascontiguousarray(array.T if transpose else array)
    return tensors


def write_folder(
    model_dir: str | os.PathLike, config: Mapping[str, Any], tensors: Mapping[str, np.ndarray]
) -> pathlib.Path:
    """Writes ``config.json`` and ``model.safetensors`` (``{"format": "pt"}`` metadata, as
    ``transformers`` writes) atomically; returns the folder."""
    model_dir = pathlib.Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_bytes(model_dir / WEIGHTS_FILE, save(dict(tensors), {"format": "pt"}))
    fileio.atomic_write_text(model_dir / CONFIG_FILE, json.dumps(dict(config), indent=2) + "\n")
    return model_dir
