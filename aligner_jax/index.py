r"""Indexing binary (``aligner-index``): corpus → sharded, resumable token store + search index.

  python -m aligner_jax.index --dataset_dir=../shared/data/beir/scifact --index_dir=outputs/idx
  python -m aligner_jax.index --gin_file=models/minilm.gin --gin_file=index/default.gin \
    --gin.load_encoder.checkpoint="'outputs/scifact_minilm'" --corpus=corpus.jsonl --index_dir=X

Default gin: ``models/minilm_identity.gin`` + ``index/default.gin``; ``--corpus``: JSONL, ``seqio:TASK``,
``tfds:NAME`` (``--corpus_split``) or ``--dataset_dir=DIR``; a killed job resumes. Updates, one process
(indexing/updates.py): ``--add``, ``--delete``, ``--compact``, ``--vacuum``, ``--search_index`` alone."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from absl import app, flags

from aligner_jax.common import cli, distributed
from aligner_jax.indexing import indexer, updates

FLAGS = flags.FLAGS
distributed.declare_key_flags()
DEFAULT_GIN_FILES = ("models/minilm_identity.gin", "index/default.gin")
flags.DEFINE_string("corpus", None, "What to index: corpus.jsonl, seqio:TASK or tfds:NAME.")
flags.DEFINE_string("corpus_split", "train", "Split of a seqio:/tfds: corpus.")
flags.DEFINE_string("dataset_dir", None, "A BEIR folder: index its corpus.jsonl (or --corpus).")
flags.DEFINE_string("index_dir", None, "Output folder of the token store (resumable).")
flags.DEFINE_integer("process_index", None, "This process's index (default: jax.process_index()).")
flags.DEFINE_integer("process_count", None, "Number of processes (default: jax.process_count()).")
flags.DEFINE_bool("search_index", True, "Build the search index (alone: rebuild --index_dir's).")
flags.DEFINE_string("add", None, "Update: add the documents of a corpus.jsonl to --index_dir.")
flags.DEFINE_string("delete", None, "Update: tombstone documents (ID,ID,... or @file).")
flags.DEFINE_bool("compact", False, "Update: re-cluster the search index if it drifted.")
flags.DEFINE_bool("force_compact", False, "Update: re-cluster (or rebuild) it regardless.")
flags.DEFINE_bool("vacuum", False, "Update: rewrite the store without deleted documents.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cli.refuse_empty("corpus", "dataset_dir", "index_dir", "add", "delete")
    given = FLAGS.corpus or FLAGS.dataset_dir
    rebuild = FLAGS["search_index"].present and FLAGS.search_index and not given
    asked = dict(add=FLAGS.add, delete=FLAGS.delete, compact_index=FLAGS.compact,
                 force_compact=FLAGS.force_compact, vacuum_store=FLAGS.vacuum)  # fmt: skip
    if FLAGS.index_dir and (rebuild or any(asked.values())):
        if given:  # building an index, or updating one: never one of them silently
            raise app.UsageError("--corpus/--dataset_dir build an index: not with --add etc.")
        if split := distributed.flags_given("process_index", "process_count"):  # each would run it
            raise app.UsageError(f"updates run as one process: drop {', '.join(split)}")
        summary = cli.run_job(
            "aligner-index", updates.update_index, index_dir=FLAGS.index_dir, search_index=rebuild,
            on_interrupt=updates.interrupted(FLAGS.index_dir), **asked,
        )  # fmt: skip
        return print(json.dumps(summary))
    if FLAGS.dataset_dir and FLAGS.corpus:
        raise app.UsageError("give --corpus or --dataset_dir (its corpus.jsonl), not both")
    corpus = FLAGS.corpus or (FLAGS.dataset_dir and str(Path(FLAGS.dataset_dir) / "corpus.jsonl"))
    if FLAGS.dataset_dir and not Path(corpus).is_file():
        raise app.UsageError(f"--dataset_dir={FLAGS.dataset_dir}: no corpus.jsonl in it")
    if not corpus or not FLAGS.index_dir:
        raise app.UsageError("--corpus (or --dataset_dir) and --index_dir are required")
    cli.call_or_exit("aligner-index", distributed.initialize_from_flags)
    summary = cli.run_job(
        "aligner-index", indexer.index_corpus, default_gin_files=DEFAULT_GIN_FILES,
        on_interrupt=f"the complete shards in {FLAGS.index_dir} are kept; re-run the same "
        "command to resume after the last one", corpus=corpus, index_dir=FLAGS.index_dir,
        process_index=FLAGS.process_index, process_count=FLAGS.process_count,
        corpus_split=FLAGS.corpus_split, search_index=FLAGS.search_index,
    )  # fmt: skip
    print(indexer.format_summary(summary) + "\n" + json.dumps(summary.as_dict()))


def console_entry() -> None:
    cli.run(main)


if __name__ == "__main__":
    console_entry()
