"""Query a published collection through Qdrant's own Query API (``aligner-publish --query``).

The query is encoded by the index's own encoder (``Searcher.load(...).encoder``: the model
recorded with the token store) and, for the lexical side, by the publication record's sparse
vectors (BM25's vocabulary and analysis; miniCOIL's saved index — meaning models, stems, cells —
loaded from beside the record, so a query fits nothing). Modes (``QueryConfig.mode``):

  ``multivector``  MaxSim over every point (exact: the collection has no HNSW graph). Scores
                   are divided by the query's token count n_q, which makes them ALIGNER's
                   top-1 score (Eq. 1, u ≡ 1) — the exhaustive searcher's, up to float rounding.
  ``fusion``       prefetch the sparse top ``prefetch_limit`` and the multivector top
                   ``prefetch_limit`` and fuse them with RRF (Qdrant: Σ 1/(k + 0-based rank)).
  ``rerank``       prefetch the sparse top ``prefetch_limit``, re-score them by MaxSim (÷ n_q).
  ``sparse``       the sparse vector alone (BM25 or miniCOIL scores, the IDF applied by Qdrant).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import gin

from aligner_jax.common import checks
from aligner_jax.common.errors import ConfigError, IndexIntegrityError
from aligner_jax.encoding.encoder import EncodedText, Encoder
from aligner_jax.lexical import minicoil as minicoil_lib
from aligner_jax.retrieval import searcher as search_lib
from aligner_jax.serving import exporter, targets
from aligner_jax.serving import sparse as sparse_lib


@gin.configurable
@dataclasses.dataclass(frozen=True)
class QueryConfig:
    """Attributes: mode (``targets.MODES``), prefetch_limit (candidates per prefetch),
    rrf_k (RRF's k, at least 1: Qdrant's ranks start at 0, so 0 would give its first hits
    1/0)."""

    mode: str = "fusion"
    prefetch_limit: int = 100
    rrf_k: int = 60

    def __post_init__(self):
        checks.choice("QueryConfig.mode", self.mode, targets.MODES)
        checks.integer("QueryConfig.prefetch_limit", self.prefetch_limit, minimum=1)
        checks.integer("QueryConfig.rrf_k", self.rrf_k, minimum=1)


def sparse_vectors(record: dict, minicoil_index=None, record_dir=None, encoder=None):
    """The query side's sparse vectors of a publication (None without any). miniCOIL: the
    given ``minicoil_index``, else the one saved with the publication (``exporter.
    minicoil_folder``: beside the record in ``record_dir``), loaded with ``encoder`` (the
    published model; its fingerprint is checked) — nothing is fitted at query time."""
    state = record.get("sparse")
    if state is None:
        return None
    if state["kind"] == "bm25":
        return sparse_lib.Bm25Vectors.from_state(state)
    if minicoil_index is None:
        folder = exporter.minicoil_folder(record, record_dir)
        if folder is None:
            raise ConfigError(
                "this collection's sparse vector is miniCOIL but its publication saved no "
                "miniCOIL index: pass its MiniCoilIndex, or publish again with aligner-publish"
            )
        minicoil_index = minicoil_lib.MiniCoilIndex.load(folder, encoder=encoder)
    return sparse_lib.MiniCoilVectors(minicoil_index)


class QdrantSearcher:
    """Free-text search of a published collection: ``search(text, k) → [(doc_id, score)]``."""

    def __init__(self, target, encoder: Encoder, sparse, config: QueryConfig | None = None):
        self.target = target
        self.encoder = encoder
        self.sparse = sparse
        self.config = config or QueryConfig()

    @classmethod
    def open(
        cls,
        target,
        record: dict,
        index_dir: str | None = None,
        checkpoint: str | None = None,
        encoder: Encoder | None = None,
        config: QueryConfig | None = None,
        minicoil_index=None,
        record_dir: str | None = None,
    ) -> QdrantSearcher:
        """Opens ``target`` (``EdgeTarget``/``ClientTarget``) as ``record`` describes it; the
        query encoder is the one of ``index_dir`` (default: the record's), refused when its
        fingerprint is not the published one. A miniCOIL collection's query vectors come from
        ``minicoil_index`` or the index saved beside the record (``record_dir``: the record's
        folder; default an embedded shard's own)."""
        store_dir = index_dir or record["index_dir"]
        loaded = search_lib.Searcher.load(
            store_dir, mode="exhaustive", checkpoint=checkpoint, encoder=encoder
        )
        published = record["model"].get("fingerprint")
        if loaded.store.manifest["model"].get("fingerprint") != published:
            raise ConfigError(
                f"--index_dir={store_dir}: its model is not the published one "
                f"({record['model'].get('name')}); give the index that was published"
            )
        encoder = loaded.query_encoder()
        sparse = sparse_vectors(record, minicoil_index, record_dir, encoder)
        target.open(None if sparse is None else sparse.name)
        held, published = target.count(), record.get("num_points")
        if published is not None and held != published:  # an interrupted --overwrite
            target.close()
            raise IndexIntegrityError(
                f"{target.describe()}: holds {held} points, its publication record "
                f"{published}: a publish was interrupted or the collection changed since; "
                "publish it again (aligner-publish --overwrite)"
            )
        return cls(target, encoder, sparse, config)

    def spec(self, encoded: EncodedText, text: str, k: int) -> targets.QuerySpec:
        cfg = self.config
        sparse = None
        if self.sparse is not None and cfg.mode != "multivector":
            sparse = sparse_lib.row_vector(self.sparse.query_matrix([text]), 0)
        return targets.QuerySpec(
            mode=cfg.mode,
            multivector=encoded.vectors,
            sparse=sparse,
            limit=k,
            prefetch_limit=max(cfg.prefetch_limit, k),
            rrf_k=cfg.rrf_k,
        )

    def search_encoded(
        self, encoded: Sequence[EncodedText], texts: Sequence[str], k: int
    ) -> list[list[targets.Hit]]:
        """Hits (point id, score, payload) of already encoded queries (``texts`` for the sparse
        side); MaxSim scores divided by n_q (ALIGNER's top-1 score)."""
        out = []
        for q, text in zip(encoded, texts, strict=True):
            hits = self.target.query(self.spec(q, text, k))
            scale = 1.0 / len(q.vectors) if self.config.mode in ("multivector", "rerank") else 1.0
            out.append([dataclasses.replace(h, score=h.score * scale) for h in hits])
        return out

    def search_hits(self, texts: Sequence[str], k: int = 10) -> list[list[targets.Hit]]:
        if k < 1:
            raise ConfigError(f"k={k}: must be >= 1")
        texts = list(texts)
        return self.search_encoded(self.encoder.encode(texts, "query"), texts, k)

    def search_batch(self, texts: Sequence[str], k: int = 10) -> list[list[tuple[str, float]]]:
        """``[(doc_id, score)]`` per query, best first."""
        return [
            [(h.payload["doc_id"], h.score) for h in hits] for hits in self.search_hits(texts, k)
        ]

    def search(self, text: str, k: int = 10) -> list[tuple[str, float]]:
        return self.search_batch([text], k)[0]
