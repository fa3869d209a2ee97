"""The ``aligner-publish`` job: export a token store to Qdrant, or query what was published.

Export (no ``--query``): ``--index_dir`` → an embedded shard (``--qdrant_path``) or a server
collection (``--qdrant_url`` + ``--collection``, record in ``--record``). Query (``--query``):
the published collection, with the index's own encoder, printed as a ranked list.
"""

from __future__ import annotations

import time
from pathlib import Path

from aligner_jax.common.errors import ConfigError
from aligner_jax.indexing import token_store as ts
from aligner_jax.retrieval import search_job
from aligner_jax.serving import exporter, querying, targets


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _minicoil(store: ts.TokenStore):
    """A miniCOIL index of the store's documents (``aligner_jax.lexical``, being built)."""
    raise ConfigError(
        "--sparse=minicoil: the miniCOIL index (aligner_jax.lexical.minicoil) is not wired into "
        "aligner-publish yet; export it from Python with "
        "exporter.export_store(..., minicoil_index=MiniCoilIndex) or use --sparse=bm25"
    )


def publish_job(
    index_dir: str | None,
    qdrant_path: str | None = None,
    qdrant_url: str | None = None,
    collection: str = "aligner",
    record: str | None = None,
    sparse: str | None = None,
    overwrite: bool = False,
    query: str | None = None,
    k: int = 10,
    mode: str | None = None,
) -> str:
    """Runs ``aligner-publish``; returns what it prints."""
    if (qdrant_path is None) == (qdrant_url is None):
        raise ConfigError("give exactly one of --qdrant_path=DIR or --qdrant_url=URL")
    if qdrant_url and not record:
        raise ConfigError("--qdrant_url needs --record=FILE.json (what the query side reads)")
    record_path = Path(record) if record else Path(qdrant_path) / exporter.RECORD

    def target():
        if qdrant_path:
            return targets.EdgeTarget(qdrant_path)
        return targets.ClientTarget(collection, url=qdrant_url, overwrite=overwrite)

    if query is not None:
        published = exporter.read_record(record_path)
        config = querying.QueryConfig(**({"mode": mode} if mode else {}))
        searcher = querying.QdrantSearcher.open(target(), published, index_dir, config=config)
        try:
            hits = searcher.search_hits([query], k=k)[0]
        finally:
            searcher.target.close()
        ranked = [(h.payload["doc_id"], h.score) for h in hits]
        titles = {h.payload["doc_id"]: h.payload.get("title", "") for h in hits}
        return search_job.format_ranking(f"{query}  [{config.mode}]", ranked, titles)
    if not index_dir:
        raise ConfigError("--index_dir is required to publish (or give --query=TEXT)")
    store = ts.TokenStore(index_dir)
    config = exporter.ExportConfig(**({"sparse": sparse} if sparse else {}))
    extra = {"minicoil_index": _minicoil(store)} if config.sparse == "minicoil" else {}
    start = time.perf_counter()
    if qdrant_path:
        out = exporter.publish_embedded(store, qdrant_path, config, **extra)
        where = f"{qdrant_path} ({_du(Path(qdrant_path)) / 1e6:.1f} MB on disk)"
    else:
        out = exporter.publish_client(store, target(), record_path, config, **extra)
        where = f"collection {collection!r} at {qdrant_url} (record {record_path})"
    return (
        f"aligner-publish: {out['num_points']} documents ({out['deleted_skipped']} deleted "
        f"skipped), multivector {out['datatype']} β^d={out['beta_d']}, sparse "
        f"{config.sparse}, in {time.perf_counter() - start:.1f}s → {where}"
    )
