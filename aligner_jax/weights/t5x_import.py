"""Import the encoder of a T5X-format T5 v1.1 checkpoint into :class:`~aligner_jax.models.t5.T5Encoder`.

ALIGNER starts from T5 v1.1 (paper §4.1). Public T5 v1.1 weights are distributed as T5X
checkpoints (e.g. ``gs://t5-data/pretrained_models/t5x/t5_1_1_base/checkpoint_1000000``); this
module reads the encoder part of such a checkpoint, checks it against a :class:`T5Config` and
returns our encoder's parameter tree. Nothing of t5x itself is needed.

Two on-disk layouts are understood.

Classic T5X (``t5x.checkpoints.Checkpointer``)::

  <model_dir>/checkpoint_<step>/
    checkpoint                                      msgpack (flax serialization) of
                                                    {"version": 3, "optimizer": {"target": params,
                                                                                 "state": {...}}}
    target.encoder.layers_0.attention.key.kernel/   a zarr array written with tensorstore
    ...

  Each leaf of the msgpack tree is either the array itself (small, unpartitioned parameters) or
  a tensorstore spec (a dict with ``driver``, ``kvstore``, ``metadata``) whose path is relative
  to the step directory and is the parameter's '/'-path with '/' replaced by '.'.

Orbax (``t5x.checkpoints.OrbaxCheckpointManagerInterface``: an orbax ``CheckpointManager`` with
``step_prefix='checkpoint'`` saving the item ``state``; or any orbax ``PyTreeCheckpointer`` save of
a t5x state dict)::

  <model_dir>/checkpoint_<step>/          _CHECKPOINT_METADATA (step metadata, not the tree)
  <model_dir>/checkpoint_<step>/state/    _METADATA, manifest.ocdbt or per-array directories

  whose tree is ``{"target": params, "state": {...}}``.

Only ``target/token_embedder/...`` and ``target/encoder/...`` are read; the decoder, the logits
layer and all optimizer state are ignored and never loaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import serialization, traverse_util

from aligner_jax.common.errors import T5XCheckpointError
from aligner_jax.models.t5 import T5Config, abstract_params

_STEP_DIR_RE = re.compile(r"^checkpoint_(\d+)$")
_ORBAX_MARKERS = ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "_sharding")
_ENCODER_PREFIXES = ("encoder/", "token_embedder/")


def _is_ts_spec(value: Any) -> bool:
    return isinstance(value, Mapping) and "driver" in value and "kvstore" in value


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """'/'-joined paths of a nested mapping; tensorstore spec dicts are leaves."""
    if isinstance(tree, Mapping) and not _is_ts_spec(tree):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}{key}/"))
        return flat
    return {prefix.rstrip("/"): tree}


def _is_orbax_dir(path: epath.Path) -> bool:
    return path.is_dir() and any((path / marker).exists() for marker in _ORBAX_MARKERS)


def resolve_checkpoint(checkpoint_dir: str | os.PathLike, step: int | None = None):
    """Finds the checkpoint to read.

    Args:
      checkpoint_dir: a step directory (``.../checkpoint_1000000``), the msgpack file inside it,
        an orbax ``state`` directory, or a model directory holding ``checkpoint_<step>``
        sub-directories (the latest step is taken unless ``step`` is given).
      step: which ``checkpoint_<step>`` to take from a model directory.

    Returns:
      ``("t5x", msgpack_file)`` or ``("orbax", state_directory)``.

    Raises:
      T5XCheckpointError: nothing importable at that path.
    """
    path = epath.Path(checkpoint_dir)
    if not path.exists():
        raise T5XCheckpointError(f"T5X checkpoint path {path} does not exist.")
    if path.is_file():
        if path.name != "checkpoint":
            raise T5XCheckpointError(
                f"{path} is a file but not a T5X 'checkpoint' msgpack file; pass the "
                "checkpoint_<step> directory instead."
            )
        return "t5x", path
    step_dirs = {}
    for child in path.iterdir():
        match = _STEP_DIR_RE.match(child.name)
        if match and child.is_dir():
            step_dirs[int(match.group(1))] = child
    if step is not None:
        if step not in step_dirs:
            raise T5XCheckpointError(
                f"No checkpoint_{step} in {path}; available steps: {sorted(step_dirs) or 'none'}."
            )
        return resolve_checkpoint(step_dirs[step])
    # A step folder of an orbax CheckpointManager holds ``_CHECKPOINT_METADATA`` (the step's
    # metadata, an orbax marker) beside its item folders: the tree is in ``state/``, so that item
    # is looked at before the folder itself is taken for a tree.
    if _is_orbax_dir(path / "state"):
        return "orbax", path / "state"
    if (path / "checkpoint").is_file() and not _is_orbax_dir(path):
        return "t5x", path / "checkpoint"
    if _is_orbax_dir(path):
        return "orbax", path
    if step_dirs:
        latest = max(step_dirs)
        logging.info("Using the latest step %d of %s.", latest, path)
        return resolve_checkpoint(step_dirs[latest])
    raise T5XCheckpointError(
        f"{path} is not a T5X checkpoint: expected a 'checkpoint' msgpack file (classic T5X), an "
        "orbax 'state/' directory, or checkpoint_<step> sub-directories."
    )


# ----------------------------------------------------------------------------------------------
# Classic layout: msgpack tree + tensorstore arrays.
# ----------------------------------------------------------------------------------------------


def _read_msgpack_target(msgpack_file: epath.Path) -> dict[str, Any]:
    raw = msgpack_file.read_bytes()
    if raw.startswith(b"model_checkpoint_path"):
        raise T5XCheckpointError(
            f"{msgpack_file} is a TensorFlow (Mesh TF) checkpoint index, not a T5X checkpoint; "
            "convert it with t5x first."
        )
    try:
        contents = serialization.msgpack_restore(raw)
    except Exception as e:  # msgpack raises several unrelated types on corrupt input.
        raise T5XCheckpointError(f"Cannot parse T5X msgpack file {msgpack_file}: {e}") from e
    if not isinstance(contents, Mapping):
        raise T5XCheckpointError(f"{msgpack_file} does not hold a T5X state tree.")
    version = contents.get("version", 0)
    state = contents["optimizer"] if version and "optimizer" in contents else contents
    if not isinstance(state, Mapping) or "target" not in state:
        raise T5XCheckpointError(
            f"{msgpack_file} has no 'target' (model parameters) entry; top-level keys: "
            f"{sorted(state) if isinstance(state, Mapping) else type(state).__name__}."
        )
    return _flatten(state["target"])


def _absolute_ts_spec(spec: Mapping[str, Any], step_dir: str) -> dict[str, Any]:
    """A copy of a stored (relative-path) tensorstore spec that opens the array in ``step_dir``."""
    spec = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in spec.items()}
    metadata = spec.get("metadata", {})
    # Chunking/compression are properties of the stored array and are read from its .zarray.
    metadata.pop("chunks", None)
    metadata.pop("compressor", None)
    kvstore = spec["kvstore"]
    if "path" in kvstore:
        relative = kvstore["path"]
    elif "path" in spec:  # tensorstore < 0.1.14 wrote the path beside the kvstore.
        relative = spec.pop("path")
    else:
        raise T5XCheckpointError(f"Tensorstore spec without a path in {step_dir}: {spec}")
    gcs = re.fullmatch(r"gs://([^/]+)/?(.*)", step_dir)
    if gcs:
        bucket, base = gcs.groups()
        spec["kvstore"] = {
            "driver": "gcs",
            "bucket": bucket,
            "path": f"{base.rstrip('/')}/{relative}",
        }
    else:
        spec["kvstore"] = {"driver": "file", "path": os.path.join(step_dir, relative)}
    return spec


def _read_classic(
    msgpack_file: epath.Path, wanted: Mapping[str, tuple[int, ...]], param_dtype: np.dtype
) -> dict[str, np.ndarray]:
    import tensorstore as ts  # noqa: PLC0415  (only classic T5X checkpoints need it)

    step_dir = os.fspath(msgpack_file.parent)
    leaves = _read_msgpack_target(msgpack_file)
    _check_against_config(leaves, wanted, step_dir, shape_of=_classic_shape)
    pending = {}
    result = {}
    for name in wanted:
        leaf = leaves[name]
        if _is_ts_spec(leaf):
            spec = _absolute_ts_spec(leaf, step_dir)
            stored = spec.get("dtype") or spec.get("metadata", {}).get("dtype")
            if stored in ("uint16", "<u2"):
                raise T5XCheckpointError(
                    f"T5X checkpoint {step_dir}: 'target/{name}' is stored as uint16 (T5X "
                    "checkpoint version 2 bfloat16); re-save it with a recent t5x."
                )
            pending[name] = ts.open(spec, open=True, read=True)
        else:
            result[name] = np.asarray(leaf)
    reads = {}
    for name, future in pending.items():
        try:
            reads[name] = future.result().read()
        except Exception as e:  # tensorstore raises ValueError/OSError subclasses.
            raise T5XCheckpointError(
                f"T5X checkpoint {step_dir}: cannot open the tensorstore array of "
                f"'target/{name}': {e}"
            ) from e
    for name, future in reads.items():
        result[name] = np.asarray(future.result())
    return {name: _cast(result[name], param_dtype) for name in wanted}


def _classic_shape(leaf: Any) -> tuple[int, ...] | None:
    if _is_ts_spec(leaf):
        shape = leaf.get("metadata", {}).get("shape")
        return None if shape is None else tuple(int(d) for d in shape)
    if hasattr(leaf, "shape"):
        return tuple(leaf.shape)
    return None


# ----------------------------------------------------------------------------------------------
# Orbax layout.
# ----------------------------------------------------------------------------------------------


def _orbax_metadata_tree(state_dir: epath.Path) -> Any:

    metadata = ocp.PyTreeCheckpointer().metadata(state_dir)
    # orbax >= 0.9 wraps the tree: StepMetadata.item_metadata.tree; older versions return it.
    metadata = getattr(metadata, "item_metadata", metadata)
    return getattr(metadata, "tree", metadata)


def _read_orbax(
    state_dir: epath.Path, wanted: Mapping[str, tuple[int, ...]], param_dtype: np.dtype
) -> dict[str, np.ndarray]:

    tree = _orbax_metadata_tree(state_dir)
    if not isinstance(tree, Mapping) or "target" not in tree:
        raise T5XCheckpointError(
            f"Orbax checkpoint {state_dir} has no 'target' (model parameters) entry; top-level "
            f"keys: {sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__}."
        )
    leaves = _flatten(tree["target"])
    _check_against_config(
        leaves,
        wanted,
        os.fspath(state_dir),
        shape_of=lambda m: tuple(m.shape) if getattr(m, "shape", None) is not None else None,
    )
    item = traverse_util.unflatten_dict(
        {
            ("target", *name.split("/")): np.zeros((0,), np.float32)  # structure only
            for name in wanted
        }
    )
    restore_args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    restored = ocp.PyTreeCheckpointer().restore(
        state_dir,
        args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
    )
    flat = _flatten(restored["target"])
    return {name: _cast(np.asarray(flat[name]), param_dtype) for name in wanted}


# ----------------------------------------------------------------------------------------------
# Shared checks and the public entry point.
# ----------------------------------------------------------------------------------------------


def _cast(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(array).astype(dtype, copy=False))


def _check_against_config(
    leaves: Mapping[str, Any],
    wanted: Mapping[str, tuple[int, ...]],
    where: str,
    shape_of,
) -> None:
    """Every expected encoder parameter exists with the expected shape, and nothing extra."""
    encoder_names = {n for n in leaves if n.startswith(_ENCODER_PREFIXES)}
    missing = [n for n in wanted if n not in leaves]
    if missing:
        raise T5XCheckpointError(
            f"T5X checkpoint {where} has no parameter 'target/{missing[0]}' "
            f"({len(missing)} expected encoder parameter(s) missing: {missing[:5]}...). The "
            "checkpoint is not a T5 v1.1 encoder of this configuration: check the model gin "
            "(T5Config.num_layers, mlp_activations) against the checkpoint."
        )
    unexpected = sorted(encoder_names - set(wanted))
    if unexpected:
        raise T5XCheckpointError(
            f"T5X checkpoint {where} has encoder parameter 'target/{unexpected[0]}' that the "
            f"configured encoder does not have ({len(unexpected)} unexpected: "
            f"{unexpected[:5]}). Check T5Config.num_layers / mlp_activations in the model gin; "
            "scanned-layer checkpoints (t5x scan_layers=True) are not supported."
        )
    for name, expected in wanted.items():
        shape = shape_of(leaves[name])
        if shape is None:
            raise T5XCheckpointError(
                f"T5X checkpoint {where}: 'target/{name}' is not an array "
                f"({type(leaves[name]).__name__})."
            )
        if tuple(shape) != tuple(expected):
            raise T5XCheckpointError(
                f"T5X checkpoint {where}: parameter 'target/{name}' has shape {tuple(shape)} but "
                f"the configured T5 encoder expects {tuple(expected)}. The model gin's T5Config "
                "(vocab_size, emb_dim, num_heads, head_dim, mlp_dim) does not match this "
                "checkpoint; use the gin/models/t5_*.gin file of the checkpoint's size."
            )


def expected_encoder_shapes(config: T5Config) -> dict[str, tuple[int, ...]]:
    """'/'-path (as under ``target/`` in a T5X checkpoint) -> shape, for every encoder param."""
    flat = traverse_util.flatten_dict(abstract_params(config), sep="/")
    return {name: tuple(leaf.shape) for name, leaf in sorted(flat.items())}


def load_t5x_encoder(
    checkpoint_dir: str | os.PathLike, config: T5Config, *, step: int | None = None
) -> dict:
    """Reads the encoder of a T5X T5 v1.1 checkpoint as :class:`T5Encoder` parameters.

    Args:
      checkpoint_dir: a T5X step directory (``.../checkpoint_1000000``), its ``checkpoint``
        msgpack file, an orbax ``state`` directory, or a model directory (latest step, or
        ``step``). Local paths and ``gs://`` paths are accepted.
      config: the encoder configuration; every imported shape is checked against it.
      step: step to read when ``checkpoint_dir`` is a model directory.

    Returns:
      The ``params`` tree ``{"token_embedder": ..., "encoder": ...}`` of host numpy arrays in
      ``config.param_dtype``; use as ``T5Encoder(config).apply({"params": params}, ...)`` or place
      on devices with ``jax.device_put(params, shardings)``.

    Raises:
      T5XCheckpointError: no checkpoint, a missing / unexpected encoder parameter, or a shape
        that does not match ``config`` (the message names the checkpoint and the parameter).
    """
    kind, location = resolve_checkpoint(checkpoint_dir, step)
    wanted = expected_encoder_shapes(config)
    param_dtype = np.dtype(config.params_dtype)
    logging.info("Importing %d T5 encoder parameters from %s (%s).", len(wanted), location, kind)
    if kind == "t5x":
        flat = _read_classic(location, wanted, param_dtype)
    else:
        flat = _read_orbax(location, wanted, param_dtype)
    return traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()})


__all__ = [
    "expected_encoder_shapes",
    "load_t5x_encoder",
    "resolve_checkpoint",
]
