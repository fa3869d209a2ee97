"""Exhaustive search with the documents' token vectors sharded over the devices of a mesh.

TPU-KNN style (Chern et al., 2022): the documents are split into equal contiguous slices, one per
device of a ``jax.sharding.Mesh`` (every axis of it: processes × local devices); each device
scores its slice of documents against the queries (Eq. 1–2 with top-1 alignment: each query
token aligned with its best document token, weighted by the saliences u^q ⊗ u^d, or by 1 without
them — ColBERT's sum of maxima, averaged) and keeps its exact top-k (``jax.lax.top_k``); the
per-device lists are all-gathered and the global top-k taken from them. Only the k best of each
device cross the interconnect, and a process reads only the documents of its own devices
(``jax.make_array_from_callback``), so an index larger than one host's memory can be searched by
a multi-host slice. A :class:`~aligner_jax.retrieval.searcher.Searcher` uses it when opened with
``Searcher.load(index_dir, mode="exhaustive", mesh=document_mesh())``.

The ranking equals the single-device exhaustive ranking (``Refiner`` over every document, the
same kernel, ``refine.score_chunk``'s scores): a device's top-k holds every document of the
global top-k it owns, and ties keep the lower document first, as a single ``top_k`` would.

Shapes: the device search runs with k rounded up to a power of two (16 at least) and the query
batch padded to a power of two, so nearby requests share one compilation; ``Searcher.load``
compiles a single query's search for every query length bucket at k ≤ 16 and k ≤ 128 (what
``search(text, k=10)`` and ``k=100`` run), none after load.

Layout: each document is padded to the store's longest document (``ShardedSearchConfig.
length_multiple``), so memory is ``num_docs × max_length × dim`` (float16) over all devices;
deleted documents (tombstones) and the padding up to a multiple of the device count never rank.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import gin
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from aligner_jax.common import checks
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import scoring
from aligner_jax.indexing import token_store as ts

DOC_AXIS = "docs"
MIN_K = 16  # the smallest k the device search runs with (see ``k_bucket``)
WARM_KS = (10, 100)  # the k values whose shapes ``Searcher.load`` compiles
_TOP1 = (scoring.AlignmentStrategy.parse("top_k:1"),)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ShardedSearchConfig:
    """Attributes:
    salience: weight the alignment by u^q ⊗ u^d (Eq. 2); False: u = 1 (ColBERT's MaxSim).
    block_docs: documents a device scores per step (its slice is scanned in blocks of this many:
      queries × query tokens × block_docs × max length similarity entries at a time).
    length_multiple: documents are padded to a multiple of this many tokens.
    """

    salience: bool = True
    block_docs: int = 64
    length_multiple: int = 8

    def __post_init__(self):
        checks.integer("ShardedSearchConfig.block_docs", self.block_docs, minimum=1)
        checks.integer("ShardedSearchConfig.length_multiple", self.length_multiple, minimum=1)


def check_mesh(mesh, mode: str, alignment: str) -> None:
    """Refuses a ``Searcher.load(mesh=...)`` this search cannot serve, in one line."""
    if not isinstance(mesh, Mesh):
        raise ConfigError(
            f"Searcher.load: mesh must be a jax.sharding.Mesh (e.g. "
            f"sharded_search.document_mesh()), got {type(mesh).__name__}"
        )
    if mode != "exhaustive":
        raise ConfigError(
            f"Searcher.load: mesh= shards the exhaustive search; use mode='exhaustive' (got "
            f"mode={mode!r})"
        )
    if scoring.AlignmentStrategy.parse(alignment) != _TOP1[0]:
        raise ConfigError(
            f"Searcher.load: mesh= scores with top-1 alignment; use alignment='top_k:1' (got "
            f"{alignment!r})"
        )


def document_mesh(devices=None) -> Mesh:
    """A 1-D mesh (axis ``docs``) over ``devices`` (default: every device of every process)."""
    return Mesh(np.asarray(jax.devices() if devices is None else devices), (DOC_AXIS,))


def _power_of_two(n: int) -> int:
    """The smallest power of two ≥ ``n`` (1 for n ≤ 1)."""
    return 1 << max(n - 1, 0).bit_length()


def k_bucket(k: int, total: int) -> int:
    """The k the device search runs with for a request of ``k`` (≤ ``total`` documents): the
    next power of two, ``MIN_K`` at least, at most ``total``."""
    return min(total, max(MIN_K, _power_of_two(k)))


def _replicated(value: np.ndarray, mesh: Mesh) -> jax.Array:
    """``value`` (the same on every process) as an array replicated on every device of ``mesh``."""
    sharding = NamedSharding(mesh, PartitionSpec())
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


class ShardedExhaustiveSearch:
    """A token store's documents laid out over a mesh, searched exhaustively (see module doc).

    ``search(q, q_mask, u_q, k)`` takes padded queries (``refine.QueryBatch``'s arrays) and
    returns, per query, ``(store position, score)`` best first.
    """

    def __init__(
        self,
        store: ts.TokenStore,
        mesh: Mesh | None = None,
        config: ShardedSearchConfig | None = None,
    ):
        self.store, self.config = store, config or ShardedSearchConfig()
        self.mesh = mesh if mesh is not None else document_mesh()
        self.axes = tuple(self.mesh.axis_names)
        num_devices = self.mesh.devices.size
        block = self.config.block_docs
        per_device = math.ceil(max(store.num_docs, 1) / num_devices)
        self.per_device = math.ceil(per_device / block) * block  # whole blocks per device
        self.total = self.per_device * num_devices
        longest = int(store.doc_lengths.max()) if store.num_docs else 1
        multiple = self.config.length_multiple
        self.length = max(multiple, math.ceil(longest / multiple) * multiple)
        docs = NamedSharding(self.mesh, PartitionSpec(self.axes))
        live = np.zeros(self.total, bool)
        live[: store.num_docs] = ~np.asarray(store.deleted, bool)
        self.live = jax.make_array_from_callback(live.shape, docs, lambda i: live[i])
        self.vectors = self._sharded(docs, 0, (self.total, self.length, store.dim))
        self.mask = self._sharded(docs, 1, (self.total, self.length))
        self.salience = self._sharded(docs, 2, (self.total, self.length))

    def _sharded(self, sharding: NamedSharding, part: int, shape: tuple) -> jax.Array:
        """One of ``gather_padded``'s arrays for every document, each device's slice read from
        the store only on the process that holds the device."""

        def rows(index) -> np.ndarray:
            lo, hi, _ = index[0].indices(self.total)
            real = np.arange(lo, min(hi, self.store.num_docs))
            out = self.store.gather_padded(real, self.length)[part]
            padding = np.zeros((hi - lo - len(real),) + out.shape[1:], out.dtype)
            return np.concatenate([out, padding])[(slice(None),) + tuple(index[1:])]

        return jax.make_array_from_callback(shape, sharding, rows)

    def search(
        self, q: np.ndarray, q_mask: np.ndarray, u_q: np.ndarray, k: int
    ) -> list[list[tuple[int, float]]]:
        """The top ``k`` live documents of each query: ``q [Q, n, D]``, ``q_mask``/``u_q [Q, n]``."""
        checks.integer("k", k, minimum=1)
        k = min(k, self.total)
        rows = len(q)
        batch = _power_of_two(rows)  # padded queries: no token, never read
        args = []
        for x, dtype in ((q, np.float32), (q_mask, bool), (u_q, np.float32)):
            x = np.asarray(x, dtype)
            if batch > rows:
                x = np.concatenate([x, np.zeros((batch - rows,) + x.shape[1:], dtype)])
            args.append(_replicated(x, self.mesh))
        scores, positions = _search(
            *args, self.vectors, self.mask, self.salience, self.live,
            k=k_bucket(k, self.total), mesh=self.mesh, salience=self.config.salience,
            block=self.config.block_docs,
        )  # fmt: skip
        scores = np.asarray(scores.addressable_data(0))[:rows, :k]
        positions = np.asarray(positions.addressable_data(0))[:rows, :k]
        return [
            [(int(p), float(s)) for p, s in zip(pos, sc, strict=True) if np.isfinite(s)]
            for pos, sc in zip(positions, scores, strict=True)
        ]

    def warm_up(self, query_lengths, ks=WARM_KS, batches=(1,)) -> int:
        """Compiles the search of ``batches`` queries (each padded to a power of two) for every
        length of ``query_lengths`` (the refiner's query buckets) and every k of ``ks``;
        returns the number of shapes run."""
        shapes = sorted(
            {
                (_power_of_two(b), n, k_bucket(min(k, self.total), self.total))
                for b in batches
                for n in query_lengths
                for k in ks
            }
        )
        for b, n, k in shapes:
            ones = np.ones((b, n), np.float32)
            self.search(np.zeros((b, n, self.store.dim), np.float32), ones > 0, ones, k)
        return len(shapes)


@functools.partial(jax.jit, static_argnames=("k", "mesh", "salience", "block"))
def _search(q, q_mask, u_q, vectors, mask, u_d, live, *, k, mesh, salience, block):
    """Per-device exact top-k of Eq. 1–2 (top-1 alignment), then the global top-k of those."""
    axes = tuple(mesh.axis_names)
    docs, every = PartitionSpec(axes), PartitionSpec()

    def local(q, q_mask, u_q, d, d_mask, u_d, d_live):
        n_local, length, dim = d.shape
        blocks = n_local // block

        def score(part):
            d_b, m_b, u_b = part
            s = scoring.cross_similarity(q, d_b.astype(jnp.float32))  # [Q, block, n, L]
            shape = s.shape[:2]
            qm = jnp.broadcast_to(q_mask[:, None, :], (*shape, q.shape[1]))
            dm = jnp.broadcast_to(m_b[None], (*shape, length))
            uq = jnp.broadcast_to(u_q[:, None, :], qm.shape)
            weights = (uq, jnp.broadcast_to(u_b[None], dm.shape)) if salience else (None, None)
            return scoring.topk_family_scores(s, qm, dm, _TOP1, *weights)[0]  # [Q, block]

        parts = (
            d.reshape(blocks, block, length, dim),
            d_mask.reshape(blocks, block, length),
            u_d.reshape(blocks, block, length),
        )
        scores = jax.lax.map(score, parts)  # [blocks, Q, block]
        scores = jnp.moveaxis(scores, 1, 0).reshape(q.shape[0], n_local)
        scores = jnp.where(d_live[None], scores, -jnp.inf)
        values, index = jax.lax.top_k(scores, min(k, n_local))
        index = index + jax.lax.axis_index(axes) * n_local  # store positions
        values = jax.lax.all_gather(values, axes, axis=1, tiled=True)  # device order = doc order
        index = jax.lax.all_gather(index, axes, axis=1, tiled=True)
        best, where = jax.lax.top_k(values, k)
        return best, jnp.take_along_axis(index, where, axis=1)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(every, every, every, docs, docs, docs, docs),
        out_specs=(every, every),
        check_vma=False,
    )(q, q_mask, u_q, vectors, mask, u_d, live)
