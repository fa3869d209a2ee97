"""Refinement: score candidate documents with all their stored token vectors (paper §2.1, §3.2).

For a batch of queries and their candidate documents, the refiner gathers the candidates' token
vectors from the token store into padded, length-bucketed chunks and computes Eq. 1–2 with one or
more alignment strategies in a single jitted kernel: the similarity matrix is computed once per
(query, document) pair and every strategy is derived from it. This is what makes few-shot
alignment adaptation cheap: candidates are retrieved once and re-scored per strategy.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
from collections.abc import Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np

from aligner_jax.common import checks
from aligner_jax.core import scoring
from aligner_jax.encoding import batching
from aligner_jax.indexing import token_store as ts


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RefineConfig:
    """Shapes and memory of refinement.

    Attributes:
      length_multiple: documents are padded to a multiple of this many tokens (bucket lengths).
      query_length_buckets: queries are padded to the smallest bucket ≥ their length.
      max_elements: budget of similarity entries (queries × query tokens × docs × doc tokens)
        computed per kernel call; sets the number of documents per chunk.
      cache_bytes: pre-gather every document's padded vectors in memory when they fit in this
        many bytes (fast exhaustive refinement); otherwise gather candidates per query batch.
      concurrent_chunks: chunks scored at once (None: one per CPU core on CPU, else 1).
    """

    length_multiple: int = 32
    query_length_buckets: tuple[int, ...] = (16, 32, 64, 128)
    max_elements: int = 1 << 24
    cache_bytes: int = 3 << 30
    concurrent_chunks: int | None = None

    def __post_init__(self):
        name = type(self).__name__
        checks.integer(f"{name}.length_multiple", self.length_multiple, minimum=1)
        checks.integers(
            f"{name}.query_length_buckets", self.query_length_buckets, minimum=1, increasing=True
        )
        checks.integer(f"{name}.max_elements", self.max_elements, minimum=1)
        checks.integer(f"{name}.cache_bytes", self.cache_bytes, minimum=0)
        checks.integer(
            f"{name}.concurrent_chunks", self.concurrent_chunks, minimum=1, allow_none=True
        )

    def query_bucket(self, n: int) -> int:
        for b in self.query_length_buckets:
            if n <= b:
                return b
        return int(math.ceil(n / self.length_multiple) * self.length_multiple)


@functools.partial(jax.jit, static_argnames=("strategies",))
def score_chunk(q, q_mask, u_q, q_ids, d, d_mask, u_d, d_ids, strategies):
    """Scores every query of a batch against every document of a chunk, for each strategy.

    Args:
      q [Q, n, D], q_mask/u_q/q_ids [Q, n]; d [C, L, D] (any float dtype), d_mask/u_d/d_ids [C, L];
      strategies: static tuple of ``scoring.AlignmentStrategy``.
    Returns:
      ``[len(strategies), Q, C]`` float32 scores (Eq. 1–2).
    """
    d = d.astype(jnp.float32)
    s = scoring.cross_similarity(q, d)  # [Q, C, n, L]
    num_q, num_c = q.shape[0], d.shape[0]
    qm = jnp.broadcast_to(q_mask[:, None, :], (num_q, num_c, q.shape[1]))
    dm = jnp.broadcast_to(d_mask[None, :, :], (num_q, num_c, d.shape[1]))
    uq = jnp.broadcast_to(u_q[:, None, :], qm.shape)
    ud = jnp.broadcast_to(u_d[None, :, :], dm.shape)
    family = tuple(st for st in strategies if st.kind in scoring.TOPK_FAMILY)
    results = {}
    if family:
        fam = scoring.topk_family_scores(s, qm, dm, family, u_q=uq, u_d=ud)
        results.update({st: fam[i] for i, st in enumerate(family)})
    for st in strategies:
        if st not in results:
            qi = jnp.broadcast_to(q_ids[:, None, :], qm.shape)
            di = jnp.broadcast_to(d_ids[None, :, :], dm.shape)
            results[st] = scoring.alignment_scores(
                s, qm, dm, st, u_q=uq, u_d=ud, q_ids=qi, d_ids=di
            )
    return jnp.stack([results[st] for st in strategies])


@dataclasses.dataclass
class QueryBatch:
    """Padded queries: vectors [Q, n, D] float32, mask/salience/token ids [Q, n]."""

    vectors: np.ndarray
    mask: np.ndarray
    salience: np.ndarray
    token_ids: np.ndarray

    @classmethod
    def from_encoded(cls, encoded: Sequence, length: int) -> QueryBatch:
        q = len(encoded)
        dim = encoded[0].vectors.shape[-1]
        vectors = np.zeros((q, length, dim), np.float32)
        mask = np.zeros((q, length), bool)
        salience = np.zeros((q, length), np.float32)
        token_ids = np.zeros((q, length), np.int32)
        for i, e in enumerate(encoded):
            m = min(len(e.token_ids), length)
            vectors[i, :m] = e.vectors[:m]
            mask[i, :m] = True
            salience[i, :m] = e.salience[:m]
            token_ids[i, :m] = e.token_ids[:m]
        return cls(vectors, mask, salience, token_ids)


def padded_chunk(num_docs: int, chunk: int) -> int:
    """Documents a chunk of ``num_docs`` is padded to: the next power of two (at least 8), at
    most ``chunk``: a few compiled shapes, and a query's few candidates in a length bucket are
    not padded to a full chunk (reranking ~100 documents per query)."""
    return min(chunk, max(8, 1 << max(0, num_docs - 1).bit_length()))


class Refiner:
    """Re-scores candidate documents of queries with their full stored token vectors."""

    def __init__(
        self, store: ts.TokenStore, config: RefineConfig | None = None, salience: bool = True
    ):
        """``salience=False``: every stored token's u^d is 1 (``SearchConfig.salience``)."""
        self.store = store
        self.config = config or RefineConfig()
        self.salience = salience
        mult = self.config.length_multiple
        lengths = store.doc_lengths
        padded = np.maximum(mult, np.ceil(lengths / mult).astype(np.int64) * mult)
        self.doc_bucket = padded
        self.buckets = {int(L): np.nonzero(padded == L)[0] for L in np.unique(padded)}
        cache_need = int(sum(len(v) * L for L, v in self.buckets.items())) * store.dim * 2
        self._cache: dict[int, tuple] | None = None
        if cache_need <= self.config.cache_bytes:
            self._cache = {L: store.gather_padded(docs, L) for L, docs in self.buckets.items()}

    def _chunk_docs(self, query_len: int, num_queries: int, length: int) -> int:
        per_doc = max(1, num_queries * query_len * length)
        c = max(8, self.config.max_elements // per_doc)
        return 1 << int(math.floor(math.log2(c)))

    def score(
        self,
        queries: QueryBatch,
        candidates: Sequence[np.ndarray],
        strategies: Sequence[scoring.AlignmentStrategy],
    ) -> list[np.ndarray]:
        """Scores each query's candidates.

        Args:
          queries: a padded batch of Q queries.
          candidates: Q arrays of document indices (into the store), one per query.
          strategies: alignment strategies to score with.
        Returns:
          Q arrays ``[len(strategies), len(candidates[i])]`` of scores (Eq. 1–2), in the order
          of ``candidates[i]``.
        """
        strategies = tuple(strategies)
        num_q = len(candidates)
        out = [np.full((len(strategies), len(c)), -np.inf, np.float32) for c in candidates]
        cands = [np.asarray(c, np.int64) for c in candidates]
        union = np.unique(np.concatenate(cands))
        if not len(union):
            return out
        # Where each union document sits in each query's candidate list (-1: not a candidate).
        position = np.full((num_q, len(union)), -1, np.int64)
        for i, c in enumerate(cands):
            position[i, np.searchsorted(union, c)] = np.arange(len(c))
        q = tuple(
            jnp.asarray(x)
            for x in (queries.vectors, queries.mask, queries.salience, queries.token_ids)
        )
        n = queries.vectors.shape[1]
        jobs = []
        for length, bucket_docs in self.buckets.items():
            docs = union[np.isin(union, bucket_docs, assume_unique=True)]
            chunk = self._chunk_docs(n, num_q, length)
            jobs += [
                (docs[lo : lo + chunk], length, chunk, bucket_docs)
                for lo in range(0, len(docs), chunk)
            ]

        def run(job):
            part, length, chunk, bucket_docs = job
            d, dm, du, di = self._gather(part, length, bucket_docs)
            if not self.salience:
                du = dm.astype(np.float32)
            size = padded_chunk(len(part), chunk)
            if len(part) < size:  # few shapes: one compilation per (n, L, power of two)
                pad = [(0, size - len(part))]
                d = np.pad(d, pad + [(0, 0), (0, 0)])
                dm, du, di = (np.pad(x, pad + [(0, 0)]) for x in (dm, du, di))
            scores = score_chunk(*q, d, dm, du, di, strategies=strategies)
            return part, np.asarray(scores)[:, :, : len(part)]

        # XLA:CPU runs each fused op on one thread: keep one chunk in flight per core.
        workers = self.config.concurrent_chunks or batching.default_concurrent_batches()
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            for part, scores in pool.map(run, jobs):
                cols = np.searchsorted(union, part)
                for i in range(num_q):
                    pos = position[i, cols]
                    hit = pos >= 0
                    out[i][:, pos[hit]] = scores[:, i, hit]
        return out

    def _gather(self, docs: np.ndarray, length: int, bucket_docs: np.ndarray):
        if self._cache is not None:
            vec, mask, sal, ids = self._cache[length]
            pos = np.searchsorted(bucket_docs, docs)
            if len(pos) and pos[-1] - pos[0] + 1 == len(pos):  # contiguous: a view, no copy
                sl = slice(int(pos[0]), int(pos[-1]) + 1)
                return vec[sl], mask[sl], sal[sl], ids[sl]
            return vec[pos], mask[pos], sal[pos], ids[pos]
        return self.store.gather_padded(docs, length)
