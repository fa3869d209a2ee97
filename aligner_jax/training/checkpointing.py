"""Orbax checkpoints of the train state plus the data iterator position (t5x habit).

A checkpoint of step N under ``MODEL_DIR/checkpoints/N/`` holds two items:

  * ``state``: the sharded train state (step, params, optimizer state);
  * ``data``: JSON with the position of the input pipeline (batches consumed) and the settings
    that define it (task, seed, batch size, feature lengths), so a restarted job continues with
    exactly the batches an uninterrupted job would have seen, and refuses to resume under a
    different pipeline.

``weights.aligner_checkpoint.restore_params`` reads only the encoder parameters of a checkpoint
(for evaluation and indexing).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gin
import orbax.checkpoint as ocp

from aligner_jax.common import checks
from aligner_jax.common.errors import CheckpointError
from aligner_jax.weights import aligner_checkpoint, param_checks
from aligner_jax.weights.aligner_checkpoint import CHECKPOINT_SUBDIR


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Attributes:
    period: save every this many steps (and at the last step).
    keep: how many checkpoints to keep (None: all).
    restore: ``latest`` (resume from MODEL_DIR's newest checkpoint when one exists), ``none``
      (start fresh; refuses a MODEL_DIR that already has checkpoints), or a checkpoint path.
    async_save: write checkpoints in the background (orbax async checkpointing).
    """

    period: int = 1000
    keep: int | None = 3
    restore: str = "latest"
    async_save: bool = False

    def __post_init__(self):
        checks.integer("CheckpointConfig.period", self.period, minimum=1)
        checks.integer("CheckpointConfig.keep", self.keep, minimum=1, allow_none=True)


def _differences(state_dir: Path, abstract_state: Any, show: int = 3) -> str:
    """The leaves where the checkpoint's tree (orbax's metadata: shapes only, nothing read)
    and ``abstract_state`` differ, as one line, the params first; "" where they agree.

    Checked before restoring: a restore that fails part-way leaves orbax's pending reads
    behind (a "coroutine was never awaited" warning per array at garbage collection)."""
    try:
        stored = aligner_checkpoint.saved_tree(state_dir)
    except (OSError, ValueError, KeyError, TypeError):
        return ""  # no readable metadata: the restore itself decides
    missing, extra, wrong = param_checks.shape_differences(abstract_state, stored)
    found = [(k, f"{k}: {have} in the checkpoint, {want} now") for k, have, want in wrong]
    found += [(k, f"{k} only in the checkpoint") for k in extra]
    found += [(k, f"{k} not in the checkpoint") for k in missing]
    lines = [
        line for _, line in sorted(found, key=lambda f: (not f[0].startswith("params."), f[0]))
    ]
    more = f"; {len(lines) - show} more" if len(lines) > show else ""
    return "; ".join(lines[:show]) + more


def checkpoint_dir(model_dir: str | Path) -> Path:
    return Path(model_dir) / CHECKPOINT_SUBDIR


def manager(
    model_dir: str | Path, config: CheckpointConfig, create: bool = True
) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=config.keep,
        save_interval_steps=1,  # the trainer decides when to save
        create=create,
        # a save killed mid-way leaves STEP.orbax-checkpoint-tmp: removed when a run resumes
        cleanup_tmp_directories=create,
        enable_async_checkpointing=config.async_save,
    )
    return ocp.CheckpointManager(
        checkpoint_dir(model_dir).resolve(), options=options, item_names=("state", "data")
    )


def save(mngr: ocp.CheckpointManager, step: int, state: Any, data_state: dict) -> None:
    mngr.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
        ),
        force=True,
    )


def restore(mngr: ocp.CheckpointManager, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """Restores (state, data_state) of ``step`` into the shardings of ``abstract_state``; a
    checkpoint of another model or optimizer (shapes, tree), or an incomplete one, is a
    ``CheckpointError``."""
    folder = Path(mngr.directory) / str(step)
    missing = [item for item in ("state", "data") if not (folder / item).is_dir()]
    if missing:
        raise CheckpointError(
            f"{folder}: an incomplete checkpoint (no {' or '.join(missing)}: a copy or save that "
            "did not finish); remove that folder to resume from the checkpoint before it"
        )
    differences = _differences(folder / "state", abstract_state)
    if differences:
        raise CheckpointError(
            f"{mngr.directory}/{step}: written for another model or optimizer than the gin files "
            f"describe now ({differences}); resume with the same model and optimizer bindings, "
            "or use another MODEL_DIR"
        )
    try:
        restored = mngr.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
            ),
        )
    except (ValueError, KeyError, TypeError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{mngr.directory}/{step}: written for another model or optimizer than the gin files "
            f"describe now ({reason[:300]}); resume with the same model and optimizer bindings, "
            "or use another MODEL_DIR"
        ) from e
    return restored["state"], restored["data"]


def restore_source(spec: str) -> tuple[Path, int]:
    """``CheckpointConfig.restore``'s path: an aligner-train MODEL_DIR (its newest checkpoint)
    or one of its step folders (``MODEL_DIR/checkpoints/STEP``); returns (MODEL_DIR, step).
    Anything else is refused naming the accepted values, without creating a folder."""
    path = Path(spec)
    if path.name.isdigit() and path.parent.name == CHECKPOINT_SUBDIR and path.is_dir():
        return path.parent.parent, int(path.name)
    if checkpoint_dir(path).is_dir():
        step = manager(path, CheckpointConfig(), create=False).latest_step()
        if step is not None:
            return path, step
    raise CheckpointError(
        f"--gin.CheckpointConfig.restore={spec!r}: no checkpoint there; give 'latest', 'none', "
        "an aligner-train MODEL_DIR or one of its step folders (MODEL_DIR/checkpoints/STEP)"
    )
