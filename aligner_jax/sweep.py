r"""Pruning / alignment sweep binary (``aligner-sweep``): a thin absl + gin wrapper of
:func:`aligner_jax.evaluation.pruning_sweep.sweep`.

  python -m aligner_jax.sweep --dataset_dir=../shared/data/beir/scifact \
    --output_dir=outputs/sweep_scifact_zero_shot

  python -m aligner_jax.sweep --gin_file=models/minilm.gin --gin_file=sweeps/pruning.gin \
    --gin.load_encoder.checkpoint="'outputs/scifact_minilm'" \
    --dataset_dir=../shared/data/beir/scifact --output_dir=benchmarks/results/sweep_scifact
  # redraw sweep.md and the plots from a saved sweep.json (nothing is searched):
  python -m aligner_jax.sweep --replot --output_dir=benchmarks/results/sweep_scifact

Without ``--gin_file``: the zero-shot bundled backbone (``models/minilm_identity.gin``) with the
paper's grid, ``sweeps/pruning.gin``.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import app, flags

from aligner_jax.common import cli
from aligner_jax.evaluation import pruning_sweep

FLAGS = flags.FLAGS
DEFAULT_GIN_FILES = ("models/minilm_identity.gin", "sweeps/pruning.gin")
flags.DEFINE_string("dataset_dir", None, "A BEIR folder (corpus.jsonl, queries.jsonl, qrels/).")
flags.DEFINE_string("split", "test", "qrels split to evaluate (qrels/<split>.tsv).")
flags.DEFINE_string("output_dir", None, "Where sweep.json, sweep.md and the PNG plots go.")
flags.DEFINE_string("index_dir", None, "Token store folder (default: OUTPUT_DIR/index).")
flags.DEFINE_bool("replot", False, "Only redraw sweep.md and the plots from OUTPUT_DIR/sweep.json.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.replot:
        if not FLAGS.output_dir:
            raise app.UsageError("--replot needs --output_dir (the folder holding sweep.json)")
        cli.call_or_exit("aligner-sweep", pruning_sweep.replot, output_dir=FLAGS.output_dir)
        return
    if not FLAGS.dataset_dir or not FLAGS.output_dir:
        raise app.UsageError("--dataset_dir and --output_dir are required")
    cli.run_job(
        "aligner-sweep",
        pruning_sweep.sweep,
        default_gin_files=DEFAULT_GIN_FILES,
        on_interrupt=f"no sweep.json written in {FLAGS.output_dir}; the complete shards of "
        f"{FLAGS.index_dir or FLAGS.output_dir + '/index'} are kept and reused by a re-run",
        dataset_dir=FLAGS.dataset_dir,
        output_dir=FLAGS.output_dir,
        split=FLAGS.split,
        index_dir=FLAGS.index_dir,
    )


def console_entry() -> None:
    cli.run(main)


if __name__ == "__main__":
    console_entry()
