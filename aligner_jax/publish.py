r"""Publish binary (``aligner-publish``): serve a token store on Qdrant, and query it there.

The embedded engine (qdrant_edge), then a query:

  python -m aligner_jax.publish --index_dir=outputs/zero_shot_scifact/index \
    --qdrant_path=outputs/qdrant/scifact
  python -m aligner_jax.publish --qdrant_path=outputs/qdrant/scifact \
    --query="statins reduce cardiovascular risk" --mode=fusion

A Qdrant server or cluster (``--shards``, ``--replication``; ``--overwrite`` replaces):

  python -m aligner_jax.publish --index_dir=DIR --qdrant_url=http://qdrant:6333 \
    --collection=scifact --record=outputs/qdrant/scifact.json --shards=4 --replication=2

``--sparse=minicoil`` instead of BM25: meaning models fitted on the corpus with the index's own
encoder (as ``eval/minicoil.gin``), or ``--minicoil_models`` saved earlier (refused if fitted on
another encoder); a query loads them from beside the record. Every live document becomes a point:
token vectors as a multivector (MaxSim), the sparse vector with the IDF modifier, payload {doc_id,
title}; texts from the corpus the index records (``--corpus=PATH`` if it moved). Query modes:
``multivector`` (exact MaxSim), ``fusion`` (sparse + multivector prefetches, RRF), ``rerank``
(sparse prefetch re-scored by MaxSim) or ``sparse``. Details: ``serving/publish_job.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

from absl import app, flags

from aligner_jax.common import cli
from aligner_jax.serving import publish_job, sparse, targets

FLAGS = flags.FLAGS
flags.DEFINE_string("index_dir", None, "The token store to publish (queries: its encoder).")
flags.DEFINE_string("qdrant_path", None, "An embedded Qdrant shard folder (qdrant_edge).")
flags.DEFINE_string("qdrant_url", None, "A Qdrant server/cluster URL (key: $QDRANT_API_KEY).")
flags.DEFINE_string("collection", "aligner", "Collection name on the server (--qdrant_url).")
flags.DEFINE_string("record", None, "Publication record file (default: in --qdrant_path).")
flags.DEFINE_enum("sparse", None, list(sparse.KINDS), "Lexical sparse vector (default bm25).")
flags.DEFINE_boolean("overwrite", False, "Replace an existing publication (collection or shard).")
flags.DEFINE_integer("shards", None, "Server collection's shard_number (a Qdrant cluster).")
flags.DEFINE_integer("replication", None, "Server collection's replication_factor (cluster).")
flags.DEFINE_string("query", None, "Query the published collection: prints a ranked list.")
flags.DEFINE_integer("k", None, "Documents per query (default 10).")
flags.DEFINE_enum("mode", None, list(targets.MODES), "Query mode (default fusion).")
flags.DEFINE_string("minicoil_models", None, "--sparse=minicoil: saved models (default: fit).")
flags.DEFINE_string("corpus", None, "The indexed corpus (file or BEIR folder) if it moved.")


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    out = cli.run_job(
        "aligner-publish",
        publish_job.publish_job,
        on_interrupt="an embedded export leaves nothing at --qdrant_path",
        index_dir=FLAGS.index_dir,
        qdrant_path=FLAGS.qdrant_path,
        qdrant_url=FLAGS.qdrant_url,
        collection=FLAGS.collection,
        record=FLAGS.record,
        sparse=FLAGS.sparse,
        overwrite=FLAGS.overwrite,
        query=FLAGS.query,
        k=FLAGS.k,
        mode=FLAGS.mode,
        minicoil_models=FLAGS.minicoil_models,
        corpus=FLAGS.corpus,
        shards=FLAGS.shards,
        replication=FLAGS.replication,
    )
    print(out)


def console_entry() -> None:
    cli.run(main)


if __name__ == "__main__":
    console_entry()
