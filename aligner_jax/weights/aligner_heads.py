"""ALIGNER's heads beside a Hugging Face backbone folder: ``aligner_heads.safetensors`` +
``aligner_config.json`` (+ a README saying how to apply them).

Tensors (PyTorch ``Linear`` layout ``[out, in]``, float32):

  * ``projection.weight`` ``[D, H]``: token vectors ``q_i = normalize(W_p · h_i)`` (§4.1; absent
    with ``projection='identity'``: ``q_i = normalize(h_i)``);
  * ``{query,doc}_salience.weight`` ``[1, H]`` and ``.bias`` ``[1]``: the salience scores
    ``s_i = ReLU(W·h_i + b)`` of Eq. 3 (absent with ``salience='none'``: u = 1).

``aligner_config.json`` records the architecture fields of ``AlignerConfig`` (projection, salience
method, α^q, α^d, ε, LP iterations) that turn ``s`` into ``u = λ·s`` (Eq. 4–5) and the token
budgets the model was trained with.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save

from aligner_jax.common import fileio
from aligner_jax.common.errors import CheckpointError, ConfigError, MissingPathError
from aligner_jax.models import aligner as aligner_lib
from aligner_jax.weights import hf_folder

HEADS_FILE = "aligner_heads.safetensors"
CONFIG_FILE = "aligner_config.json"
FORMAT = "aligner_jax/hf-export/1"
# AlignerConfig fields that define the heads (taken from the folder when it is loaded); the token
# budgets and dtype stay the caller's.
ARCHITECTURE_FIELDS = (
    "projection",
    "projection_dim",
    "salience",
    "alpha_q",
    "alpha_d",
    "epsilon",
    "lp_iters",
    "lp_init",
)
_HEADS = ("query_salience", "doc_salience")


def has_heads(model_dir: str | os.PathLike) -> bool:
    return (pathlib.Path(model_dir) / CONFIG_FILE).is_file()


def is_export(model_dir: str | os.PathLike) -> bool:
    """Whether the folder's ``aligner_config.json`` is one ``aligner-export`` wrote."""
    try:
        config = json.loads((pathlib.Path(model_dir) / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("format") == FORMAT


def read_architecture(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``AlignerConfig`` architecture fields recorded in ``aligner_config.json``."""
    path = pathlib.Path(model_dir) / CONFIG_FILE
    config = hf_folder.read_json(path)
    if config.get("format") != FORMAT:
        raise ConfigError(f"{path}: format {config.get('format')!r}, expected {FORMAT!r}")
    missing = [f for f in ARCHITECTURE_FIELDS if f not in config]
    if missing:
        raise ConfigError(f"{path}: missing {missing}")
    return {f: config[f] for f in ARCHITECTURE_FIELDS}


def heads_to_tensors(config: aligner_lib.AlignerConfig, params: dict) -> dict[str, np.ndarray]:
    tensors = {}
    if config.projection == "dense":
        tensors["projection.weight"] = np.asarray(params["projection"]["kernel"], np.float32).T
    if config.salience != "none":
        for head in _HEADS:
            tensors[f"{head}.weight"] = np.asarray(params[head]["kernel"], np.float32).T
            tensors[f"{head}.bias"] = np.asarray(params[head]["bias"], np.float32)
    return {k: np.ascontiguousarray(v) for k, v in tensors.items()}


def load_heads(model_dir: str | os.PathLike, params: dict) -> dict[str, Any]:
    """The head parameters (Flax layout) of ``aligner_heads.safetensors``. ``params`` is the
    configured model's parameter tree: each of its non-backbone entries must be in the file with
    its shape, and the file must hold nothing else."""
    path = pathlib.Path(model_dir) / HEADS_FILE
    wanted = {k: v for k, v in params.items() if k != "backbone"}
    if not path.is_file():
        raise MissingPathError(f"{path} does not exist (the folder's {CONFIG_FILE} needs it)")
    tensors = load_file(str(path))
    heads: dict[str, Any] = {}
    for module, leaves in wanted.items():
        heads[module] = {}
        for leaf, value in leaves.items():
            name = f"{module}.{'weight' if leaf == 'kernel' else leaf}"
            if name not in tensors:
                raise CheckpointError(f"{path}: no tensor {name!r}")
            array = tensors.pop(name)
            array = array.T if leaf == "kernel" else array
            if array.shape != np.shape(value):
                raise CheckpointError(
                    f"{path}: {name!r} has shape {array.shape[::-1]}, expected "
                    f"{np.shape(value)[::-1]} ({CONFIG_FILE} and config.json disagree)"
                )
            heads[module][leaf] = array
    if tensors:
        raise CheckpointError(f"{path}: tensors {sorted(tensors)} are not heads of this model")
    return heads


def save_heads(
    config: aligner_lib.AlignerConfig, params: dict, model_dir: str | os.PathLike, readme: str
) -> pathlib.Path:
    """Writes ``aligner_heads.safetensors``, ``aligner_config.json`` and ``README.md``."""
    model_dir = pathlib.Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_bytes(
        model_dir / HEADS_FILE, save(heads_to_tensors(config, params), {"format": "pt"})
    )
    record = {f: getattr(config, f) for f in ARCHITECTURE_FIELDS}
    record.update(
        format=FORMAT,
        backbone=type(config.backbone).__name__,
        hidden_size=aligner_lib.backbone_hidden_size(config.backbone),
        output_dim=config.output_dim,
        query_maxlen=config.query_maxlen,
        doc_maxlen=config.doc_maxlen,
        score="sim(Q,D) = sum(S*A)/sum(A), S=q_i.d_j, A = top-k(S) * (u^q x u^d) (Eq. 1-2)",
    )
    fileio.atomic_write_json(model_dir / CONFIG_FILE, record)
    fileio.atomic_write_text(model_dir / "README.md", readme)
    return model_dir


def architecture_changes(config: aligner_lib.AlignerConfig, model_dir) -> dict[str, Any]:
    """The ``AlignerConfig`` fields the folder's ``aligner_config.json`` sets differently."""
    recorded = read_architecture(model_dir)
    current = dataclasses.asdict(config)
    return {k: v for k, v in recorded.items() if current[k] != v}
