r"""Publish binary (``aligner-publish``): serve a token store on Qdrant, and query it there.

The embedded engine (qdrant_edge), then a query:

  python -m aligner_jax.publish --index_dir=outputs/zero_shot_scifact/index \
    --qdrant_path=outputs/qdrant/scifact
  python -m aligner_jax.publish --qdrant_path=outputs/qdrant/scifact \
    --query="statins reduce cardiovascular risk" --mode=fusion

A Qdrant server or cluster:

  python -m aligner_jax.publish --index_dir=DIR --qdrant_url=http://qdrant:6333 \
    --collection=scifact --record=outputs/qdrant/scifact.json

miniCOIL instead of BM25 (meaning models fitted on the corpus with the index's own encoder, as
``aligner-eval --gin_file=eval/minicoil.gin`` does; ``--gin.MiniCoilConfig.X=...`` applies), or
with models saved earlier (``--minicoil_models=FILE.safetensors`` or a saved miniCOIL folder, e.g.
an earlier publication's ``aligner_minicoil/``; refused if fitted on another encoder):

  python -m aligner_jax.publish --index_dir=DIR --qdrant_path=outputs/qdrant/scifact_mc \
    --sparse=minicoil
  python -m aligner_jax.publish --qdrant_path=outputs/qdrant/scifact_mc --query="..." \
    --mode=sparse

Every live document becomes a point: its token vectors as a multivector (MaxSim), BM25 (or
miniCOIL) as a sparse vector with the IDF modifier, payload {doc_id, title}. The documents' texts
come from the corpus the index records (``--corpus=PATH`` if it moved). The miniCOIL index is
saved beside the record (``aligner_minicoil/`` in the shard; ``NAME.minicoil/`` beside
``--record=NAME.json``), so a query loads its models and fits nothing. Queries run through Qdrant's Query
API: ``--mode=multivector`` (exact MaxSim), ``fusion`` (sparse + multivector prefetches, RRF),
``rerank`` (sparse prefetch re-scored by MaxSim) or ``sparse``.
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
flags.DEFINE_boolean("overwrite", False, "Replace an existing server collection.")
flags.DEFINE_string("query", None, "Query the published collection: prints a ranked list.")
flags.DEFINE_integer("k", 10, "Documents per query.")
flags.DEFINE_enum("mode", None, list(targets.MODES), "Query mode (default fusion).")
flags.DEFINE_string(
    "minicoil_models",
    None,
    "--sparse=minicoil: saved meaning models (a .safetensors file or a saved miniCOIL folder) of "
    "this index's encoder; default: fit them on the corpus.",
)
flags.DEFINE_string(
    "corpus", None, "The indexed corpus (file or BEIR folder) if it moved since indexing."
)


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
    )
    print(out)


def console_entry() -> None:
    cli.run(main)


if __name__ == "__main__":
    console_entry()
