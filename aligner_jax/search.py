r"""Search binary (``aligner-search``): free text against a persisted index.

  python -m aligner_jax.search --index_dir=outputs/zero_shot_scifact/index \
    --query="statins reduce cardiovascular risk" --k=10

  python -m aligner_jax.search --index_dir=outputs/zero_shot_scifact/index \
    --queries=../shared/data/beir/scifact/queries.jsonl --output=run.trec --k=100

The index is a token store with its compressed search index (``aligner-index --search_index``,
or any store ``aligner-eval`` has searched); the query encoder is the one recorded with it
(``encoder.json``), or ``--checkpoint`` (refused if its fingerprint differs). ``--mode=exhaustive``
refines every document (the quality ceiling). ``--show=text`` prints a snippet of each hit,
``--filter='{"year": {"gte": 2015}}'`` keeps documents whose metadata match, ``--offset`` pages
(``--depth=N``: every page cut from one ranking of N, ``Searcher.search``).
With ``--query`` only warnings are logged (``--verbosity=0`` shows the load's log).
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import app, flags, logging

from aligner_jax.common import cli
from aligner_jax.retrieval import search_job

FLAGS = flags.FLAGS
flags.DEFINE_string("index_dir", None, "A token store folder with its search_index/.")
flags.DEFINE_string("query", None, "One free-text query: prints the ranked documents.")
flags.DEFINE_string("queries", None, "A queries.jsonl ({'_id', 'text'} per line).")
flags.DEFINE_string("output", None, "TREC run file written for --queries.")
flags.DEFINE_integer("k", 10, "Documents per query.")
flags.DEFINE_enum("mode", "fast", ["fast", "exhaustive", "device"],
                  "Compressed index, every document, or every document on the accelerators.")  # fmt: skip
flags.DEFINE_integer("threads", 2, "BLAS threads of the search.")
flags.DEFINE_string("checkpoint", None, "A trained model folder replacing the index's own.")
flags.DEFINE_string("alignment", "top_k:1", "Alignment strategy of the final stage (§3.1).")
flags.DEFINE_enum("show", "title", ["title", "text"], "Print titles, or titles and snippets.")
flags.DEFINE_string(
    "filter", None, """Metadata conditions (JSON), e.g. '{"year": {"gte": 2015}}'."""
)
flags.DEFINE_integer("offset", 0, "Hits skipped before the first printed (a page's start).")
flags.DEFINE_integer("depth", None, "Ranking a page is cut from (default --offset + --k).")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.index_dir:
        raise app.UsageError("--index_dir is required")
    if FLAGS.query is not None and not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # one query: its ranking, not the load's log
    out = cli.run_job(
        "aligner-search",
        search_job.search_job,
        index_dir=FLAGS.index_dir,
        query=FLAGS.query,
        queries=FLAGS.queries,
        output=FLAGS.output,
        k=FLAGS.k,
        mode=FLAGS.mode,
        threads=FLAGS.threads,
        checkpoint=FLAGS.checkpoint,
        alignment=FLAGS.alignment,
        show=FLAGS.show,
        filter=FLAGS.filter,
        offset=FLAGS.offset,
        depth=FLAGS.depth,
    )
    print(out)


def console_entry() -> None:
    cli.run(main)


if __name__ == "__main__":
    console_entry()
