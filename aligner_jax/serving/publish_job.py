"""The ``aligner-publish`` job: export a token store to Qdrant, or query what was published.

Export (no ``--query``): ``--index_dir`` → an embedded shard (``--qdrant_path``) or a server
collection (``--qdrant_url`` + ``--collection``, record in ``--record``). ``--sparse=minicoil``
builds the miniCOIL index of the store's documents with the store's own encoder (meaning models
fitted on the corpus, or ``--minicoil_models``) and saves it beside the record. Query
(``--query``): the published collection, with the index's own encoder (and the saved miniCOIL
models), printed as a ranked list.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from aligner_jax.common import checks
from aligner_jax.common.errors import ConfigError
from aligner_jax.data import beir
from aligner_jax.indexing import token_store as ts
from aligner_jax.lexical import meaning
from aligner_jax.retrieval import lexical_stages as lexical_lib
from aligner_jax.retrieval import search_job
from aligner_jax.retrieval import searcher as search_lib
from aligner_jax.serving import exporter, querying, targets


def _du(path: Path) -> int:
    """Bytes the folder's files occupy on disk, as ``du`` counts them (Qdrant preallocates
    sparse files: their apparent size was 3.5x this)."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def _minicoil(
    store: ts.TokenStore, models: str | None, corpus: str | None
) -> tuple[object, np.ndarray, str]:
    """A miniCOIL index of the store's live documents, as ``aligner-eval
    --gin_file=eval/minicoil.gin`` builds it (``lexical_stages.build``, ``MiniCoilConfig`` from
    gin) with the store's own encoder: meaning models fitted on the corpus (no labels), or the
    saved ones of ``models`` (refused when fitted on another encoder's vectors). Returns the
    index, each store position's row in it, and how the models were obtained."""
    overrides = {}
    if models is not None:
        path = meaning.models_file(models, "--minicoil_models")
        fingerprint = meaning.MeaningModels.load(path).encoder_fingerprint
        model = store.manifest.get("model", {})
        if fingerprint != model.get("fingerprint"):
            raise ConfigError(
                f"--minicoil_models={models}: fitted on another encoder's vectors (fingerprint "
                f"{fingerprint[:12] or 'none'}, this index's model {model.get('name')} is "
                f"{str(model.get('fingerprint'))[:12]}); omit the flag to fit them on the corpus"
            )
        overrides["minicoil_models"] = str(path)
    config = lexical_lib.LexicalConfig(kind="minicoil", **overrides)
    live = np.flatnonzero(~store.deleted)
    ids = [store.doc_ids[r] for r in live]
    docs = exporter.store_documents(store, set(ids), corpus)
    encoder = search_lib.Searcher.load(str(store.directory), mode="exhaustive").query_encoder()
    t0 = time.perf_counter()
    index = lexical_lib.build(config, ids, [beir.document_text(docs[i]) for i in ids], encoder)
    seconds = time.perf_counter() - t0
    rows = np.full(store.num_docs, -1, np.int64)
    rows[live] = np.arange(len(live))
    how = f"models {config.minicoil_models}" if config.minicoil_models else "fitted on the corpus"
    words = len(index.models.words)
    return index, rows, f"{words} dim-{index.models.dim} word models {how}, {seconds:.1f}s"


def _given(config_class, flags: dict[str, bool]) -> list[str]:
    """The flags of ``flags`` given, then ``--gin.CLASS.*`` where a field of ``config_class``
    is bound in gin: what one side of the job (publish or query) would ignore."""
    bound = any(
        checks.is_bound(f"{config_class.__name__}.{f.name}")
        for f in dataclasses.fields(config_class)
    )
    return [f for f, given in flags.items() if given] + (
        [f"--gin.{config_class.__name__}.*"] if bound else []
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
    k: int | None = None,
    mode: str | None = None,
    minicoil_models: str | None = None,
    corpus: str | None = None,
    shards: int | None = None,
    replication: int | None = None,
) -> str:
    """Runs ``aligner-publish``; returns what it prints.

    ``shards`` / ``replication`` (``--shards``, ``--replication``): the server collection's
    ``shard_number`` / ``replication_factor`` (a Qdrant cluster spreads them over its peers),
    recorded in the publication record; an embedded shard refuses them.
    """
    if (qdrant_path is None) == (qdrant_url is None):
        raise ConfigError("give exactly one of --qdrant_path=DIR or --qdrant_url=URL")
    cluster = [f"--{n}" for n, v in (("shards", shards), ("replication", replication)) if v]
    if cluster and qdrant_path:
        raise ConfigError(
            f"{' and '.join(cluster)}: an embedded shard (--qdrant_path) is one shard in one "
            "process; shards and replicas are a Qdrant cluster's: publish with --qdrant_url=URL"
        )
    if cluster and query is not None:
        raise ConfigError(
            f"{' and '.join(cluster)}: set when publishing; a query reads the collection as it is"
        )
    if qdrant_url and not record:
        raise ConfigError("--qdrant_url needs --record=FILE.json (what the query side reads)")
    if qdrant_path and record:
        raise ConfigError(
            f"--record={record}: an embedded shard keeps its record inside it "
            f"({Path(qdrant_path) / exporter.RECORD}); drop --record (it is for --qdrant_url)"
        )
    record_path = Path(record) if record else Path(qdrant_path) / exporter.RECORD

    def target():
        if qdrant_path:
            return targets.EdgeTarget(qdrant_path)
        return targets.ClientTarget(
            collection, url=qdrant_url, overwrite=overwrite, shards=shards, replication=replication
        )

    if query is not None:
        if not query.strip():
            raise ConfigError("--query is empty: give the text to search for")
        k = 10 if k is None else k
        if k < 1:
            raise ConfigError(f"--k={k}: must be >= 1")
        publishing = _given(
            exporter.ExportConfig,
            {
                "--minicoil_models": minicoil_models is not None,
                "--sparse": sparse is not None,
                "--overwrite": overwrite,
                "--corpus": corpus is not None,
            },
        )
        if publishing:
            raise ConfigError(
                f"{', '.join(publishing)}: for publishing; a query (--query) reads the "
                "publication as it was made (its sparse vectors and models are the ones saved "
                "with it)"
            )
        published = exporter.read_record(record_path)
        config = querying.QueryConfig(**({"mode": mode} if mode else {}))
        searcher = querying.QdrantSearcher.open(
            target(), published, index_dir, config=config, record_dir=str(record_path.parent)
        )
        try:
            hits = searcher.search_hits([query], k=k)[0]
        finally:
            searcher.target.close()
        ranked = [(h.payload["doc_id"], h.score) for h in hits]
        titles = {h.payload["doc_id"]: h.payload.get("title", "") for h in hits}
        return search_job.format_ranking(f"{query}  [{config.mode}]", ranked, titles)
    querying_flags = _given(
        querying.QueryConfig, {"--k": k is not None, "--mode": mode is not None}
    )
    if querying_flags:
        raise ConfigError(
            f"{', '.join(querying_flags)}: for a query (--query=TEXT); publishing writes every "
            "document, and a query chooses its own mode and k"
        )
    if not index_dir:
        raise ConfigError("--index_dir is required to publish (or give --query=TEXT)")
    store = ts.TokenStore(index_dir)
    config = exporter.ExportConfig(**({"sparse": sparse} if sparse else {}))
    if minicoil_models is not None and config.sparse != "minicoil":
        raise ConfigError(f"--minicoil_models is for --sparse=minicoil (not {config.sparse})")
    start = time.perf_counter()
    extra, sparse_note = {"corpus": corpus}, config.sparse
    if config.sparse == "minicoil":
        index, rows, how = _minicoil(store, minicoil_models, corpus)
        extra.update(minicoil_index=index, minicoil_rows=rows)
        sparse_note = f"minicoil ({how})"
    if qdrant_path:
        out = exporter.publish_embedded(store, qdrant_path, config, overwrite=overwrite, **extra)
        where = f"{qdrant_path} ({_du(Path(qdrant_path)) / 1e6:.1f} MB on disk)"
    else:
        out = exporter.publish_client(store, target(), record_path, config, **extra)
        layout = f", {shards or 1} shard(s) x {replication or 1} replica(s)" if cluster else ""
        where = f"collection {collection!r} at {qdrant_url}{layout} (record {record_path})"
    return (
        f"aligner-publish: {out['num_points']} documents ({out['deleted_skipped']} deleted "
        f"skipped), multivector {out['datatype']} β^d={out['beta_d']}, sparse "
        f"{sparse_note}, in {time.perf_counter() - start:.1f}s → {where}"
    )
