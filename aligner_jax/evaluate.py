r"""BEIR evaluation binary (``aligner-eval``): a thin absl + gin wrapper of
:func:`aligner_jax.evaluation.beir_eval.evaluate`.

  python -m aligner_jax.evaluate \
    --dataset_dir=../shared/data/beir/scifact --output_dir=outputs/scifact

  python -m aligner_jax.evaluate --gin_file=eval/zero_shot.gin \
    --dataset_dir=../shared/data/beir/scifact --output_dir=outputs/scifact_exact \
    --gin.SearchConfig.backend="'exact'" --gin.SearchConfig.k_prime=0

Without ``--gin_file`` it runs the zero-shot default, ``eval/zero_shot.gin``. Writes ``run.trec``
(TREC run), ``results.json`` (BEIR's ``{qid: {doc_id: score}}``), ``config.gin`` and, last,
``metrics.json``. ``--rerank_run=FILE`` refines the candidates
of a TREC run (any system's) instead of searching.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import app, flags

from aligner_jax.common import cli
from aligner_jax.data import beir
from aligner_jax.evaluation import beir_eval

FLAGS = flags.FLAGS
DEFAULT_GIN_FILES = ("eval/zero_shot.gin",)
flags.DEFINE_string("dataset_dir", None, "A BEIR folder (corpus.jsonl, queries.jsonl, qrels/).")
flags.DEFINE_string("split", "test", "qrels split to evaluate (qrels/<split>.tsv).")
flags.DEFINE_string(
    "output_dir", None, "Where metrics.json, run.trec, results.json and config.gin go."
)
flags.DEFINE_string("index_dir", None, "Token store folder (default: OUTPUT_DIR/index).")
flags.DEFINE_enum("unknown_qrels", "error", ["error", "skip"], "qrels naming unknown ids.")
flags.DEFINE_enum(
    "ignore_identical_ids",
    "same_text",
    list(beir.IDENTICAL_ID_MODES),
    "Drop the document whose id is the query's id from its ranking: same_text (only when its "
    "text is the query's, as in ArguAna/Quora), always (BEIR) or never.",
)
flags.DEFINE_integer("query_maxlen", None, "Query token budget (default: the backbone's max).")
flags.DEFINE_bool("verify_checksums", False, "Re-hash every index file even if verified before.")
flags.DEFINE_bool("adapt", False, "Also run few-shot adaptation (§4.1; hybrid: the fusion weight).")
flags.DEFINE_string("rerank_run", None, "A TREC run file: ALIGNER refines its candidates.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.dataset_dir or not FLAGS.output_dir:
        raise app.UsageError("--dataset_dir (a BEIR folder) and --output_dir are required")
    index_dir = FLAGS.index_dir or f"{FLAGS.output_dir}/index"
    cli.run_job(
        "aligner-eval",
        beir_eval.evaluate,
        default_gin_files=DEFAULT_GIN_FILES,
        on_interrupt=f"no metrics.json written in {FLAGS.output_dir}; the complete shards of "
        f"{index_dir} are kept and reused by a re-run",
        dataset_dir=FLAGS.dataset_dir,
        output_dir=FLAGS.output_dir,
        split=FLAGS.split,
        index_dir=FLAGS.index_dir,
        unknown_qrels=FLAGS.unknown_qrels,
        ignore_identical_ids=FLAGS.ignore_identical_ids,
        query_maxlen=FLAGS.query_maxlen,
        verify_checksums=FLAGS.verify_checksums,
        adapt=FLAGS.adapt,
        rerank_run=FLAGS.rerank_run,
    )


def console_entry() -> None:
    cli.run(main)


if __name__ == "__main__":
    console_entry()
