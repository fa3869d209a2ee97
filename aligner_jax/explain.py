r"""Explanation binary (``aligner-explain``): a thin absl + gin wrapper of
:mod:`aligner_jax.evaluation.explanation` that renders the saliences and alignments of one query–document pair
(paper §4.4, Tables 4–5) as a self-contained HTML page and prints a short summary.

  python -m aligner_jax.explain --gin_file=models/minilm_identity.gin \\
    --dataset_dir=../shared/data/beir/scifact --query_id=1 --doc_id=31715818 \\
    --alignment=top_k:4 --output=outputs/explain_q1.html

  python -m aligner_jax.explain --gin_file=models/minilm.gin \\
    --gin.load_encoder.checkpoint="'/path/model_dir'" \\
    --query="what is a fathom" --document="a fathom is six feet" --output=fathom.html

Flags: ``--gin_file`` / ``--gin_bindings`` / ``--gin.NAME=VALUE`` (the encoder, via
``load_encoder``), ``--query`` or ``--query_id``, ``--document`` or ``--doc_id`` (ids need
``--dataset_dir``), ``--output``, ``--alignment``, ``--beta_q``, ``--beta_d``, ``--num_aligned``.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import app, flags

from aligner_jax.common import cli
from aligner_jax.core import scoring
from aligner_jax.encoding import loading
from aligner_jax.evaluation import explanation

FLAGS = flags.FLAGS
flags.DEFINE_string("query", None, "The query text (or give --query_id with --dataset_dir).")
flags.DEFINE_string("document", None, "The document text (or give --doc_id with --dataset_dir).")
flags.DEFINE_string("dataset_dir", None, "A BEIR folder, for --query_id and --doc_id.")
flags.DEFINE_string("query_id", None, "A query id of DATASET_DIR/queries.jsonl.")
flags.DEFINE_string("doc_id", None, "A document id of DATASET_DIR/corpus.jsonl.")
flags.DEFINE_string("output", None, "Where the HTML page is written, e.g. explain.html.")
flags.DEFINE_string(
    "alignment",
    explanation.DEFAULT_ALIGNMENT,
    "Pairwise alignment strategy of the score, e.g. top_k:1 (ColBERT), top_k:4 (Table 5), "
    "top_p:0.01.",
)
flags.DEFINE_float("beta_q", explanation.DEFAULT_BETA_Q, "Fraction of query tokens highlighted.")
flags.DEFINE_float("beta_d", explanation.DEFAULT_BETA_D, "Fraction of document tokens highlighted.")
flags.DEFINE_integer(
    "num_aligned",
    explanation.DEFAULT_NUM_ALIGNED,
    "How many of the most salient query words are linked to their aligned document words.",
)


def _texts() -> tuple[str, str]:
    """The query and document texts from --query/--document or the ids, with flag checks."""
    for text_flag, id_flag in (("query", "query_id"), ("document", "doc_id")):
        text, ident = getattr(FLAGS, text_flag), getattr(FLAGS, id_flag)
        if (text is None) == (ident is None):
            raise app.UsageError(
                f"give exactly one of --{text_flag} (a text) and --{id_flag} (an id with "
                "--dataset_dir)"
            )
    if (FLAGS.query_id is not None or FLAGS.doc_id is not None) and not FLAGS.dataset_dir:
        raise app.UsageError("--query_id and --doc_id need --dataset_dir (a BEIR folder)")
    if FLAGS.dataset_dir and FLAGS.query_id is None and FLAGS.doc_id is None:
        raise app.UsageError("--dataset_dir is only used with --query_id or --doc_id")
    query_text, doc_text = FLAGS.query, FLAGS.document
    if FLAGS.dataset_dir:
        by_id = explanation.load_pair(FLAGS.dataset_dir, FLAGS.query_id, FLAGS.doc_id)
        query_text = by_id[0] if FLAGS.query_id is not None else query_text
        doc_text = by_id[1] if FLAGS.doc_id is not None else doc_text
    for flag, text in (("--query", query_text), ("--document", doc_text)):
        if not text.strip():
            raise app.UsageError(f"{flag}: the text is empty")
    return query_text, doc_text


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.output:
        raise app.UsageError("--output is required (the HTML file to write)")
    if not FLAGS.gin_file:
        raise app.UsageError(
            "--gin_file is required to pick the encoder, e.g. --gin_file=models/minilm_identity.gin "
            "(zero-shot backbone) or --gin_file=models/minilm.gin "
            "--gin.load_encoder.checkpoint=\"'/path/model_dir'\" (a trained model)"
        )
    try:
        scoring.AlignmentStrategy.parse(FLAGS.alignment)
    except ValueError as e:
        raise app.UsageError(f"--alignment: {e}") from None

    def run():
        query_text, doc_text = _texts()  # before loading the model: id errors come fast
        cli.parse_gin_flags()
        bundle = loading.load_encoder()
        ex = explanation.explain(
            bundle,
            query_text,
            doc_text,
            alignment=FLAGS.alignment,
            beta_q=FLAGS.beta_q,
            beta_d=FLAGS.beta_d,
            num_aligned=FLAGS.num_aligned,
        )
        return ex, explanation.write_html(ex, FLAGS.output)

    # BEIR format errors are ValueErrors; a bad --output path is an OSError.
    ex, path = cli.call_or_exit("aligner-explain", (OSError, ValueError), run)
    print(explanation.format_summary(ex))
    print(f"wrote {path}")


def console_entry() -> None:
    cli.run(main)


if __name__ == "__main__":
    console_entry()
