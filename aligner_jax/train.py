r"""Training binary (``aligner-train``), t5x style: a thin absl + gin wrapper of
:func:`aligner_jax.training.trainer.train`.

  python -m aligner_jax.train --gin_file=runs/scifact_minilm.gin \
    --gin.MODEL_DIR="'/tmp/aligner_scifact'" --gin.TRAIN_STEPS=600

A run has no default: ``--gin_file`` names it (a run file includes a model file and
``runs/train.gin``; ``MODEL_DIR`` and ``TRAIN_STEPS`` are required). It ends with a summary: steps,
time, final loss and the checkpoint written.

Flags: ``--gin_file`` (repeatable; the repository's ``gin/`` folder is on the search path),
``--gin_bindings`` / ``--gin.NAME=VALUE``, ``--gin_search_paths``. Many processes
(``common/distributed.py``): ``--coordinator_address``, ``--num_processes``, ``--process_id``, or
``--multiprocess`` on a TPU pod / SLURM cluster; the job is data-parallel across them and its
losses are those of one process with as many devices. On this machine:

  launch/local_processes.sh 2 train --gin_file=runs/scifact_minilm.gin \
    --gin.MODEL_DIR="'/tmp/aligner_scifact'" --gin.TRAIN_STEPS=600
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import app, flags

from aligner_jax.common import cli, distributed
from aligner_jax.training import trainer

FLAGS = flags.FLAGS
distributed.declare_key_flags()


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cli.call_or_exit("aligner-train", distributed.initialize_from_flags)
    cli.run_job(
        "aligner-train",
        trainer.train,
        needs_gin_file="name a run, e.g. --gin_file=runs/scifact_minilm.gin "
        "--gin.MODEL_DIR=\"'outputs/scifact_minilm'\" --gin.TRAIN_STEPS=400",
        on_interrupt="the checkpoints in MODEL_DIR/checkpoints are kept; re-run the same command "
        "to resume from the newest",
    )


def console_entry() -> None:
    cli.run(main)


if __name__ == "__main__":
    console_entry()
