r"""Indexing binary (``aligner-index``): corpus → sharded, resumable token store.

  python -m aligner_jax.index --corpus=../shared/data/beir/scifact/corpus.jsonl \
    --index_dir=outputs/scifact_zero_shot_index

  python -m aligner_jax.index --gin_file=models/minilm.gin --gin_file=index/default.gin \
    --gin.load_encoder.checkpoint="'outputs/scifact_minilm'" \
    --corpus=../shared/data/beir/scifact/corpus.jsonl --index_dir=outputs/scifact_index \
    --gin.IndexingConfig.shard_size=500

Without ``--gin_file``: the zero-shot bundled backbone (``models/minilm_identity.gin``) with
``index/default.gin``. Updates: ``--add=more.jsonl``, ``--delete=ID,ID``, ``--compact`` (indexing/updates.py). ``--corpus``
may also name a seqio task (``seqio:TASK``, its raw source) or a TFDS dataset
(``tfds:NAME``), split ``--corpus_split``; feature names via ``CorpusFeatures`` (gin).

Reads the corpus as a stream and writes fixed-size shards atomically; a killed job re-run with
the same flags resumes after its last complete shard. On N hosts run the same command on each
(``--multiprocess`` for jax.distributed, or ``--process_index``/``--process_count``): each encodes
its own shards, and the manifest is written when the last shard is done; then the compressed
search index is built (``--nosearch_index`` skips it) for ``aligner-search`` and ``aligner-eval``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import jax
from absl import app, flags

from aligner_jax.common import cli
from aligner_jax.indexing import indexer, updates

FLAGS = flags.FLAGS
DEFAULT_GIN_FILES = ("models/minilm_identity.gin", "index/default.gin")
flags.DEFINE_string(
    "corpus", None, "What to index: a BEIR corpus.jsonl, seqio:TASK_NAME or tfds:NAME[:VERSION]."
)
flags.DEFINE_string("corpus_split", "train", "Split of a seqio:/tfds: corpus.")
flags.DEFINE_string("index_dir", None, "Output folder of the token store (resumable).")
flags.DEFINE_integer("process_index", None, "This process's index (default: jax.process_index()).")
flags.DEFINE_integer("process_count", None, "Number of processes (default: jax.process_count()).")
flags.DEFINE_bool("multiprocess", False, "Call jax.distributed.initialize() first.")
flags.DEFINE_bool("search_index", True, "Also build the compressed search index (aligner-search).")
flags.DEFINE_string("add", None, "Update: add the documents of a corpus.jsonl to --index_dir.")
flags.DEFINE_string("delete", None, "Update: tombstone documents (ID,ID,... or @file).")
flags.DEFINE_bool("compact", False, "Update: re-cluster the search index if it drifted.")
flags.DEFINE_bool("force_compact", False, "Update: re-cluster (or rebuild) it regardless.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.index_dir and (FLAGS.add or FLAGS.delete or FLAGS.compact or FLAGS.force_compact):
        summary = cli.run_job(
            "aligner-index", updates.update_index, index_dir=FLAGS.index_dir, add=FLAGS.add,
            delete=FLAGS.delete, compact_index=FLAGS.compact, force_compact=FLAGS.force_compact,
        )  # fmt: skip
        print(json.dumps(summary))
        return
    if not FLAGS.corpus or not FLAGS.index_dir:
        raise app.UsageError("--corpus and --index_dir are required")
    if FLAGS.multiprocess:
        jax.distributed.initialize()
    summary = cli.run_job(
        "aligner-index", indexer.index_corpus, default_gin_files=DEFAULT_GIN_FILES,
        on_interrupt=f"the complete shards in {FLAGS.index_dir} are kept; re-run the same "
        "command to resume after the last one", corpus=FLAGS.corpus, index_dir=FLAGS.index_dir,
        process_index=FLAGS.process_index, process_count=FLAGS.process_count,
        corpus_split=FLAGS.corpus_split, search_index=FLAGS.search_index,
    )  # fmt: skip
    print(indexer.format_summary(summary) + "\n" + json.dumps(summary.as_dict()))


def console_entry() -> None:
    cli.run(main)


if __name__ == "__main__":
    console_entry()
