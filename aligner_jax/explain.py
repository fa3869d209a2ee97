r"""Explanation binary (``aligner-explain``): a thin absl + gin wrapper of
:mod:`aligner_jax.evaluation.explanation` that renders the saliences and alignments of one
query–document pair (paper §4.4, Tables 4–5) as a self-contained HTML page and prints a summary.

  python -m aligner_jax.explain --dataset_dir=../shared/data/beir/scifact \
    --query_id=1 --doc_id=31715818 --output_dir=outputs/explain_q1

  python -m aligner_jax.explain --gin_file=models/minilm.gin \
    --gin.load_encoder.checkpoint="'/path/model_dir'" --gin.evaluate.alignment="'top_k:4'" \
    --query="what is a fathom" --document="a fathom is six feet" --output_dir=outputs/fathom

Without ``--gin_file`` it explains the zero-shot bundled backbone (``models/minilm_identity.gin``).
The alignment and the highlighted fractions are aligner-eval's bindings: ``evaluate.alignment``,
``SearchConfig.beta_q`` and ``SearchConfig.beta_d`` (Table 4's 50% / 20% when unbound). Writes
``OUTPUT_DIR/explanation.html``.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import app, flags

from aligner_jax.common import cli, fileio
from aligner_jax.encoding import loading
from aligner_jax.evaluation import beir_eval, explanation, explanation_html  # noqa: F401 (gin)
from aligner_jax.indexing import indexer
from aligner_jax.retrieval import searcher  # noqa: F401 (SearchConfig bindings)

FLAGS = flags.FLAGS
DEFAULT_GIN_FILES = ("models/minilm_identity.gin",)
PAGE = "explanation.html"
flags.DEFINE_string("query", None, "The query text (or give --query_id with --dataset_dir).")
flags.DEFINE_string("document", None, "The document text (or give --doc_id with --dataset_dir).")
flags.DEFINE_string("dataset_dir", None, "A BEIR folder, for --query_id and --doc_id.")
flags.DEFINE_string("query_id", None, "A query id of DATASET_DIR/queries.jsonl.")
flags.DEFINE_string("doc_id", None, "A document id of DATASET_DIR/corpus.jsonl.")
flags.DEFINE_string("output_dir", None, f"Where the page ({PAGE}) is written.")
flags.DEFINE_integer(
    "num_aligned",
    explanation.DEFAULT_NUM_ALIGNED,
    "Most salient query words linked to the document.",
)


def _explain():
    f = FLAGS
    texts = explanation.pair_texts(f.query, f.document, f.dataset_dir, f.query_id, f.doc_id)
    output = fileio.check_output_dir(f.output_dir, "--output_dir")
    cli.parse_gin_flags(DEFAULT_GIN_FILES)  # after the texts: id errors come before the model
    settings = explanation.settings_from_gin()
    stored = indexer.IndexingConfig()  # the tokens aligner-eval's index keeps (gin-bound)
    ex = explanation.explain(
        loading.load_encoder(), *texts, num_aligned=f.num_aligned, stored=stored, **settings
    )  # fmt: skip
    return ex, explanation_html.write_html(ex, output / PAGE)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.output_dir:
        raise app.UsageError("--output_dir is required (the page is OUTPUT_DIR/explanation.html)")
    ex, path = cli.call_or_exit("aligner-explain", _explain)
    print(explanation_html.format_summary(ex))
    print(f"wrote {path}")


def console_entry() -> None:
    cli.run(main)


if __name__ == "__main__":
    console_entry()
