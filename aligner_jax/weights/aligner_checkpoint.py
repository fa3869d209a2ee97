"""Reading the encoder parameters of an ``aligner-train`` checkpoint (orbax).

``MODEL_DIR/checkpoints/<step>/state`` holds the train state written by
``training.checkpointing``; evaluation, indexing and explanations need only its ``params``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from aligner_jax.common.errors import CheckpointError, MissingPathError
from aligner_jax.models import aligner as aligner_lib
from aligner_jax.weights import param_checks

CHECKPOINT_SUBDIR = "checkpoints"


def _resolve_step_dir(path: Path) -> tuple[Path, int]:
    """Accepts MODEL_DIR, MODEL_DIR/checkpoints or MODEL_DIR/checkpoints/<step>."""
    path = Path(path).resolve()
    if (path / "state").is_dir():
        return path, int(path.name)
    root = path / CHECKPOINT_SUBDIR if (path / CHECKPOINT_SUBDIR).is_dir() else path
    steps = (
        sorted(int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / "state").is_dir())
        if root.is_dir()
        else []
    )
    if not steps:
        raise MissingPathError(
            f"{path}: no checkpoint found (expected MODEL_DIR, MODEL_DIR/{CHECKPOINT_SUBDIR} or "
            f"MODEL_DIR/{CHECKPOINT_SUBDIR}/<step> written by aligner-train)"
        )
    return root / str(steps[-1]), steps[-1]


def restore_params(path: str | Path, config=None) -> tuple[Any, int]:
    """The encoder parameters (numpy/jax arrays) of a training checkpoint, and its step.

    ``path`` may be the training MODEL_DIR (newest checkpoint), its ``checkpoints`` folder or one
    step folder. With ``config`` (an ``AlignerConfig``) the parameter tree is checked against
    the model the caller is about to build.
    """
    step_dir, step = _resolve_step_dir(Path(path))
    checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    state = checkpointer.restore(step_dir / "state")
    if "params" not in state:
        raise CheckpointError(f"{step_dir / 'state'}: not an aligner-train checkpoint (no params)")
    params = jax.tree_util.tree_map(np.asarray, state["params"])
    if config is not None:
        param_checks.check_param_tree(aligner_lib.abstract_params(config), params, str(step_dir))
    return params, step
