"""Where a collection lives: an embedded Qdrant shard, or a Qdrant server/cluster, behind one
interface.

* ``EdgeTarget(path)``: ``qdrant_edge`` (the embedded engine of ``qdrant-edge-py``, in-process,
  no server): one shard in a local folder.
* ``ClientTarget(url=..., collection=...)``: ``qdrant_client.QdrantClient`` for a server or a
  cluster (``url``), or the client's local mode (``location=":memory:"``, used by the tests).
  ``qdrant-client`` is the optional extra ``aligner_jax[qdrant]``. On a cluster, ``shards`` and
  ``replication`` set the collection's ``shard_number`` and ``replication_factor`` (Qdrant
  distributes the shards and their replicas over the peers; a query fans out to every shard).

Both make the same collection (``CollectionLayout``): a named multivector ``aligner`` (the
document's token vectors, ``MaxSim`` comparator, dot product, no HNSW graph: m = 0, so
multivector scoring is exact — over every point, or over the prefetched candidates) and,
optionally, one named sparse vector with the ``idf`` modifier (``serving.sparse``). They answer
the same ``QuerySpec`` through Qdrant's Query API: one nearest query, or prefetches fused with
RRF, or a sparse prefetch re-scored by the multivector. Qdrant's RRF gives a document
Σ 1 / (k + r), r its 0-based rank in each prefetch that returned it (``rrf_scores``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import qdrant_edge as edge

from aligner_jax.common import checks
from aligner_jax.common.errors import ConfigError, LockedError, MissingPathError

MULTIVECTOR = "aligner"
DATATYPES = ("float32", "float16")
MODES = ("multivector", "fusion", "rerank", "sparse")


@dataclasses.dataclass(frozen=True)
class CollectionLayout:
    """The vectors of a collection. ``datatype='float16'`` halves the bytes of the multivector
    but makes Qdrant round the *query* to float16 too (scores then differ from ours by ~1e-3);
    the store's float16 token vectors are exact in ``float32``."""

    dim: int
    datatype: str = "float32"
    sparse: str | None = None  # the sparse vector's name ("bm25", "minicoil") or None

    def __post_init__(self):
        checks.choice("ExportConfig.datatype", self.datatype, DATATYPES)


@dataclasses.dataclass
class PointData:
    """One document: its point id (store order), token vectors [m, D], sparse (indices,
    values) without idf, payload (doc_id, title)."""

    id: int
    multivector: np.ndarray | None
    sparse: tuple[np.ndarray, np.ndarray] | None
    payload: dict


@dataclasses.dataclass(frozen=True)
class QuerySpec:
    """One query: ``mode`` (``MODES``), the query's token vectors [n, D], its sparse vector,
    ``limit`` results, ``prefetch_limit`` candidates per prefetch, RRF's ``rrf_k``."""

    mode: str
    multivector: np.ndarray | None
    sparse: tuple[np.ndarray, np.ndarray] | None
    limit: int
    prefetch_limit: int = 100
    rrf_k: int = 60


@dataclasses.dataclass(frozen=True)
class Hit:
    id: int
    score: float
    payload: dict


def rrf_scores(rankings: Sequence[Sequence[int]], k: int) -> dict[int, float]:
    """Qdrant's reciprocal-rank fusion: Σ over rankings of 1 / (k + r), r the 0-based rank."""
    fused: dict[int, float] = {}
    for ranking in rankings:
        for r, point in enumerate(ranking):
            fused[point] = fused.get(point, 0.0) + 1.0 / (k + r)
    return fused


def _named_vectors(point: PointData, sparse_name, make_sparse, dense=lambda a: a) -> dict:
    """A point's named vectors in an engine's types (``make_sparse(indices, values)``)."""
    vectors = {}
    if point.multivector is not None:
        vectors[MULTIVECTOR] = dense(np.asarray(point.multivector, np.float32))
    if point.sparse is not None:
        vectors[sparse_name] = make_sparse(point.sparse[0].tolist(), point.sparse[1].tolist())
    return vectors


def _needs(spec: QuerySpec, sparse_name: str | None) -> None:
    if spec.mode not in MODES:
        raise ConfigError(f"--mode={spec.mode}: choose one of {list(MODES)}")
    if spec.mode != "multivector" and sparse_name is None:
        raise ConfigError(
            f"--mode={spec.mode} needs a sparse vector; this collection was published with "
            "--sparse=none (use --mode=multivector, or publish with --sparse=bm25)"
        )


class EdgeTarget:
    """A collection in an embedded ``qdrant_edge`` shard at ``path`` (a folder)."""

    kind = "edge"

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.sparse_name: str | None = None
        self._shard = None

    def describe(self) -> str:
        return f"qdrant_edge shard {self.path}"

    def create(self, layout: CollectionLayout) -> None:
        vector = edge.EdgeVectorParams(
            size=layout.dim,
            distance=edge.Distance.Dot,
            multivector_config=edge.MultiVectorConfig(edge.MultiVectorComparator.MaxSim),
            datatype=getattr(edge.VectorStorageDatatype, layout.datatype.capitalize()),
            hnsw_config=edge.HnswIndexConfig(m=0, ef_construct=100, full_scan_threshold=10000),
        )
        sparse = {}
        if layout.sparse:
            sparse[layout.sparse] = edge.EdgeSparseVectorParams(modifier=edge.Modifier.Idf)
        config = edge.EdgeConfig(vectors={MULTIVECTOR: vector}, sparse_vectors=sparse)
        self._shard = edge.EdgeShard.create(str(self.path), config)
        self.sparse_name = layout.sparse

    def open(self, sparse_name: str | None) -> None:
        if not (self.path / "edge_config.json").is_file():
            raise MissingPathError(
                f"--qdrant_path={self.path}: not a qdrant_edge shard (publish one with "
                "aligner-publish --index_dir=DIR --qdrant_path=DIR)"
            )
        try:
            self._shard = edge.EdgeShard.load(str(self.path))
        except Exception as e:  # qdrant_edge raises a bare Exception
            if "WouldBlock" not in str(e):
                raise
            raise LockedError(
                f"--qdrant_path={self.path}: another process (or object) has this embedded shard "
                "open; one process at a time opens it (serve many clients with a Qdrant server)"
            ) from e
        self.sparse_name = sparse_name

    def upsert(self, points: Sequence[PointData]) -> None:
        out = [
            edge.Point(int(p.id), _named_vectors(p, self.sparse_name, edge.SparseVector), p.payload)
            for p in points
        ]
        self._shard.update(edge.UpdateOperation.upsert_points(out))

    def finish(self) -> None:
        """Merges the segments (the optimizers run in-process) and writes everything."""
        self._shard.optimize()
        self._shard.flush()

    def count(self) -> int:
        return int(self._shard.info().points_count)

    def _nearest(self, spec: QuerySpec, sparse: bool):
        if sparse:
            vector = edge.SparseVector(spec.sparse[0].tolist(), spec.sparse[1].tolist())
            return edge.Query.Nearest(vector, using=self.sparse_name)
        return edge.Query.Nearest(np.asarray(spec.multivector, np.float32), using=MULTIVECTOR)

    def request(self, spec: QuerySpec):
        _needs(spec, self.sparse_name)
        limit, prefetch = spec.limit, spec.prefetch_limit
        if spec.mode in ("multivector", "sparse"):
            query = self._nearest(spec, spec.mode == "sparse")
            return edge.QueryRequest(limit=limit, query=query, with_payload=True)
        sparse = edge.Prefetch(limit=prefetch, query=self._nearest(spec, True))
        if spec.mode == "rerank":
            query = self._nearest(spec, False)
            return edge.QueryRequest(
                limit=limit, prefetches=[sparse], query=query, with_payload=True
            )
        dense = edge.Prefetch(limit=prefetch, query=self._nearest(spec, False))
        return edge.QueryRequest(
            limit=limit,
            prefetches=[sparse, dense],
            query=edge.Fusion.Rrf(k=spec.rrf_k),
            with_payload=True,
        )

    def query(self, spec: QuerySpec) -> list[Hit]:
        points = self._shard.query(self.request(spec))
        return [Hit(int(p.id), float(p.score), dict(p.payload or {})) for p in points]

    def close(self) -> None:
        if self._shard is not None:
            self._shard.close()
            self._shard = None


class ClientTarget:
    """A collection on a Qdrant server or cluster (``url``), or in the client's local mode
    (``location=':memory:'`` or a folder). The API key, if any, is read from ``QDRANT_API_KEY``.
    ``shards`` / ``replication``: the collection's ``shard_number`` / ``replication_factor`` when
    it is created (None: the server's default, one shard, one copy)."""

    kind = "client"

    def __init__(
        self,
        collection: str,
        url: str | None = None,
        location: str | None = None,
        overwrite: bool = False,
        shards: int | None = None,
        replication: int | None = None,
    ):
        from qdrant_client import QdrantClient  # noqa: PLC0415  optional extra aligner_jax[qdrant]

        for name, value in (("--shards", shards), ("--replication", replication)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{name}={value}: expected an integer")
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value}: must be >= 1")
        self.shards, self.replication = shards, replication

        if (url is None) == (location is None):
            raise ValueError("ClientTarget: give exactly one of url or location")
        self.collection = collection
        self.url = url or location
        self.overwrite = overwrite
        api_key = os.environ.get("QDRANT_API_KEY") or None
        self.client = QdrantClient(url=url, api_key=api_key) if url else QdrantClient(location)
        self.sparse_name: str | None = None

    def describe(self) -> str:
        return f"collection {self.collection!r} at {self.url}"

    def exists(self) -> bool:
        return self.client.collection_exists(self.collection)

    def create(self, layout: CollectionLayout) -> None:
        from qdrant_client import models  # noqa: PLC0415  optional extra aligner_jax[qdrant]

        if self.exists():
            if not self.overwrite:
                raise ConfigError(
                    f"--collection={self.collection}: already exists at {self.url}; choose "
                    "another name or pass --overwrite"
                )
            self.client.delete_collection(self.collection)
        vector = models.VectorParams(
            size=layout.dim,
            distance=models.Distance.DOT,
            multivector_config=models.MultiVectorConfig(
                comparator=models.MultiVectorComparator.MAX_SIM
            ),
            datatype=getattr(models.Datatype, layout.datatype.upper()),
            hnsw_config=models.HnswConfigDiff(m=0),
        )
        sparse = {}
        if layout.sparse:
            sparse[layout.sparse] = models.SparseVectorParams(modifier=models.Modifier.IDF)
        self.client.create_collection(
            self.collection,
            vectors_config={MULTIVECTOR: vector},
            sparse_vectors_config=sparse,
            shard_number=self.shards,
            replication_factor=self.replication,
        )
        self.sparse_name = layout.sparse

    def open(self, sparse_name: str | None) -> None:
        if not self.exists():
            raise MissingPathError(
                f"--collection={self.collection}: no such collection at {self.url}"
            )
        self.sparse_name = sparse_name

    def upsert(self, points: Sequence[PointData]) -> None:
        from qdrant_client import models  # noqa: PLC0415  optional extra aligner_jax[qdrant]

        def sparse(indices, values):
            return models.SparseVector(indices=indices, values=values)

        out = [
            models.PointStruct(
                id=int(p.id),
                vector=_named_vectors(p, self.sparse_name, sparse, np.ndarray.tolist),
                payload=p.payload,
            )
            for p in points
        ]
        self.client.upsert(self.collection, out, wait=True)

    def finish(self) -> None:
        """Nothing to do: the server runs its optimizers in the background."""

    def count(self) -> int:
        return int(self.client.count(self.collection, exact=True).count)

    def _nearest(self, spec: QuerySpec, sparse: bool) -> dict:
        from qdrant_client import models  # noqa: PLC0415  optional extra aligner_jax[qdrant]

        if sparse:
            vector = models.SparseVector(
                indices=spec.sparse[0].tolist(), values=spec.sparse[1].tolist()
            )
            return {"query": vector, "using": self.sparse_name}
        return {"query": np.asarray(spec.multivector, np.float32).tolist(), "using": MULTIVECTOR}

    def query(self, spec: QuerySpec) -> list[Hit]:
        from qdrant_client import models  # noqa: PLC0415  optional extra aligner_jax[qdrant]

        _needs(spec, self.sparse_name)
        kwargs: dict = {"limit": spec.limit, "with_payload": True}
        if spec.mode in ("multivector", "sparse"):
            kwargs.update(self._nearest(spec, spec.mode == "sparse"))
        else:
            sparse = models.Prefetch(limit=spec.prefetch_limit, **self._nearest(spec, True))
            if spec.mode == "rerank":
                kwargs.update(prefetch=[sparse], **self._nearest(spec, False))
            else:
                dense = models.Prefetch(limit=spec.prefetch_limit, **self._nearest(spec, False))
                fusion = models.RrfQuery(rrf=models.Rrf(k=spec.rrf_k))
                kwargs.update(prefetch=[sparse, dense], query=fusion)
        points = self.client.query_points(self.collection, **kwargs).points
        return [Hit(int(p.id), float(p.score), dict(p.payload or {})) for p in points]

    def close(self) -> None:
        self.client.close()
