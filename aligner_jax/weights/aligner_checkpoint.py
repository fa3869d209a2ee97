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


def saved_tree(state_dir: str | Path) -> Any:
    """The tree of a saved train state (``STEP/state``) from orbax's metadata: each leaf's shape
    and dtype, no array read."""
    saved = ocp.StandardCheckpointHandler().metadata(Path(state_dir))
    return getattr(saved, "tree", saved)


def restore_params(path: str | Path, config=None) -> tuple[Any, int]:
    """The encoder parameters (numpy arrays) of a training checkpoint, and its step; the rest of
    the train state (step, optimizer state) is not read.

    ``path`` may be the training MODEL_DIR (newest checkpoint), its ``checkpoints`` folder or one
    step folder. With ``config`` (an ``AlignerConfig``) the parameter tree is checked against
    the model the caller is about to build.
    """
    step_dir, step = _resolve_step_dir(Path(path))
    state_dir = step_dir / "state"
    try:
        saved = saved_tree(state_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{state_dir}: not a readable orbax checkpoint ({e})") from e
    if not isinstance(saved, dict) or "params" not in saved:
        raise CheckpointError(f"{state_dir}: not an aligner-train checkpoint (no params)")
    # only the params: the optimizer's moments (twice their bytes with Adam) are never read
    item = {"params": saved["params"]}
    as_numpy = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        state = checkpointer.restore(
            state_dir,
            args=ocp.args.PyTreeRestore(item=item, restore_args=as_numpy, partial_restore=True),
        )
    params = jax.tree_util.tree_map(np.asarray, state["params"])
    if config is not None:
        param_checks.check_param_tree(aligner_lib.abstract_params(config), params, str(step_dir))
    return params, step
