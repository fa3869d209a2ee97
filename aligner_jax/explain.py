r"""Explanation binary (``aligner-explain``): a thin absl + gin wrapper of
:mod:`aligner_jax.evaluation.explanation` that renders the saliences and alignments of one
query–document pair (paper §4.4, Tables 4–5) as a self-contained HTML page and prints a summary.

  python -m aligner_jax.explain --gin_file=models/minilm_identity.gin \\
    --dataset_dir=../shared/data/beir/scifact --query_id=1 --doc_id=31715818 \\
    --alignment=top_k:4 --output=outputs/explain_q1.html

  python -m aligner_jax.explain --gin_file=models/minilm.gin \\
    --gin.load_encoder.checkpoint="'/path/model_dir'" \\
    --query="what is a fathom" --document="a fathom is six feet" --output=fathom.html
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import app, flags

from aligner_jax.common import cli
from aligner_jax.encoding import loading
from aligner_jax.evaluation import explanation, explanation_html

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
    "Alignment strategy, e.g. top_k:1, top_k:4, top_p:0.01.",
)
flags.DEFINE_float("beta_q", explanation.DEFAULT_BETA_Q, "Fraction of query tokens highlighted.")
flags.DEFINE_float("beta_d", explanation.DEFAULT_BETA_D, "Fraction of document tokens highlighted.")
flags.DEFINE_integer(
    "num_aligned",
    explanation.DEFAULT_NUM_ALIGNED,
    "Most salient query words linked to the document.",
)


def _explain():
    f = FLAGS
    texts = explanation.pair_texts(f.query, f.document, f.dataset_dir, f.query_id, f.doc_id)
    cli.parse_gin_flags()  # after the texts: id errors come before the model loads
    ex = explanation.explain(
        loading.load_encoder(),
        *texts,
        alignment=f.alignment,
        beta_q=f.beta_q,
        beta_d=f.beta_d,
        num_aligned=f.num_aligned,
    )
    return ex, explanation_html.write_html(ex, f.output)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.output:
        raise app.UsageError("--output is required (the HTML file to write)")
    if not FLAGS.gin_file:
        raise app.UsageError(
            "--gin_file is required to pick the encoder, e.g. --gin_file=models/minilm_identity.gin"
        )
    ex, path = cli.call_or_exit("aligner-explain", _explain)
    print(explanation_html.format_summary(ex))
    print(f"wrote {path}")


def console_entry() -> None:
    cli.run(main)


if __name__ == "__main__":
    console_entry()
