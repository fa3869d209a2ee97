"""Refinement: score candidate documents with all their stored token vectors (paper §2.1, §3.2).

For a batch of queries and their candidate documents, the refiner gathers the candidates' token
vectors from the token store into padded, length-bucketed chunks and computes Eq. 1–2 with one or
more alignment strategies in a single jitted kernel: the similarity matrix is computed once per
(query, document) pair and every strategy is derived from it. This is what makes few-shot
alignment adaptation cheap: candidates are retrieved once and re-scored per strategy.

Two shape policies: many candidates (exhaustive refinement, token-MIPS batches) are scored per
document-length bucket in large chunks (little padding); a few (a query's refinement, a rerank
of ~100 documents: at most ``RefineConfig.fixed_shape_docs``) are padded to the store's longest
document in blocks of ``RefineConfig.block_docs``, so a query's refinement has one shape per
query-length bucket, and :func:`warm_up` compiles all of them (with the query encoder's) when a
searcher loads: no query and no rerank compiles afterwards.

On the CPU, top-1 alignment (the default strategy) skips the kernel: ``RefineConfig.host_top1``
scores it from unpadded chunks of store rows with a BLAS product and a compiled maximum
(``centroid_search.stored_top1_scores``), the same scores, 1.6–3.4× faster on SciFact.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import threading
import time
from collections.abc import Iterable, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from aligner_jax.common import checks
from aligner_jax.core import scoring
from aligner_jax.encoding import batching
from aligner_jax.encoding.encoder import EncodedText, Encoder
from aligner_jax.indexing import token_store as ts
from aligner_jax.models import aligner as aligner_lib
from aligner_jax.retrieval import centroid_search


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RefineConfig:
    """Shapes and memory of refinement.

    Attributes:
      length_multiple: documents are padded to a multiple of this many tokens (bucket lengths).
      query_length_buckets: queries are padded to the smallest bucket ≥ their length (beyond
        the last, to a multiple of ``length_multiple``); the defaults (the query encoder's)
        reach BERT's 512 tokens, so a whole query of any length has one of seven shapes.
      max_elements: budget of similarity entries (queries × query tokens × docs × doc tokens)
        computed per kernel call; sets the number of documents per chunk.
      cache_bytes: pre-gather every document's padded vectors in memory (on first use) when
        they fit in this many bytes (fast exhaustive refinement); otherwise gather candidates
        per query batch.
      concurrent_chunks: chunks scored at once (None: one per CPU core on CPU, else 1).
      fixed_shape_docs: at most this many candidates (all queries of a call together) are
        scored in fixed-shape blocks: padded to the store's longest document, ``block_docs``
        documents per kernel call (one compiled shape per query bucket: see ``warm_up``).
      block_docs: documents per fixed-shape block.
      fixed_shape_device: where the fixed-shape blocks run: ``"cpu"``, the host's CPU whatever
        JAX's default backend is (on a GPU host a query's blocks, padded to the longest
        document, would otherwise be copied to the device for every query), or ``"default"``,
        JAX's default device. Larger refinements (exhaustive evaluation) always run on the
        default device.
      host_top1: where the blocks would run on the CPU (JAX's default backend is the CPU, or
        few candidates and ``fixed_shape_device="cpu"``), top-1 alignment alone is scored by
        ``centroid_search.stored_top1_scores`` (a BLAS product and a compiled maximum per
        chunk of store rows, no padding, nothing to compile) instead of the JAX kernel: the
        same scores (up to float summation order), several times faster for exhaustive search
        (``benchmarks/results/query_path_ab_host_top1.md``). False: always the kernel.
    """

    length_multiple: int = 32
    query_length_buckets: tuple[int, ...] = (16, 32, 48, 64, 128, 256, 512)
    max_elements: int = 1 << 24
    cache_bytes: int = 3 << 30
    concurrent_chunks: int | None = None
    fixed_shape_docs: int = 1024
    block_docs: int = 64
    fixed_shape_device: str = "cpu"
    host_top1: bool = True

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
        checks.integer(f"{name}.fixed_shape_docs", self.fixed_shape_docs, minimum=0)
        checks.integer(f"{name}.block_docs", self.block_docs, minimum=1)
        checks.choice(f"{name}.fixed_shape_device", self.fixed_shape_device, ("cpu", "default"))

    def query_buckets_upto(self, n: int) -> tuple[int, ...]:
        """Every query length bucket a query of at most ``n`` tokens can take."""
        return tuple(sorted({self.query_bucket(m) for m in range(1, n + 1)}))

    def query_bucket(self, n: int) -> int:
        for b in self.query_length_buckets:
            if n <= b:
                return b
        return int(math.ceil(n / self.length_multiple) * self.length_multiple)


TOP1 = (scoring.AlignmentStrategy.parse("top_k:1"),)  # what ``host_top1`` scores


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


@functools.cache
def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """The threads refinement chunks run on (one pool per size, for the process's life)."""
    return concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="refine")


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
        # The fixed-shape blocks' document length: the longest document's bucket.
        self.max_length = int(padded.max()) if len(padded) else mult
        cache_need = int(sum(len(v) * L for L, v in self.buckets.items())) * store.dim * 2
        self._use_cache = cache_need <= self.config.cache_bytes
        self._cache: dict[int, tuple] | None = None
        self._cache_lock = threading.Lock()
        self._host_cpu = jax.devices("cpu")[0]  # where fixed-shape blocks run by default

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
        fixed = len(union) <= self.config.fixed_shape_docs
        on_cpu = jax.default_backend() == "cpu" or (
            fixed and self.config.fixed_shape_device == "cpu"
        )
        if self.config.host_top1 and on_cpu and strategies == TOP1:
            rows = [
                (queries.vectors[i][queries.mask[i]], queries.salience[i][queries.mask[i]])
                for i in range(num_q)
            ]
            scores = centroid_search.stored_top1_scores(self.store, union, rows, self.salience)
            for i in range(num_q):
                hit = position[i] >= 0
                out[i][0, position[i, hit]] = scores[i, hit]
            return out
        # The queries committed to a device decide where every block runs (the blocks' NumPy
        # arrays follow them): the host CPU for fixed-shape blocks by default.
        device = self._host_cpu if fixed and self.config.fixed_shape_device == "cpu" else None
        q = tuple(
            jax.device_put(x, device)  # a transfer, not a compiled conversion
            for x in (queries.vectors, queries.mask, queries.salience, queries.token_ids)
        )
        if fixed:
            jobs = self._fixed_shape_jobs(union)
        else:
            jobs = self._bucket_jobs(union, queries.vectors.shape[1], num_q)

        def run(job):
            part, length, size, gather = job
            d, dm, du, di = gather(part, length)
            if not self.salience:
                du = dm.astype(np.float32)
            if len(part) < size:  # few shapes: one compilation per (n, L, block size)
                pad = [(0, size - len(part))]
                d = np.pad(d, pad + [(0, 0), (0, 0)])
                dm, du, di = (np.pad(x, pad + [(0, 0)]) for x in (dm, du, di))
            scores = score_chunk(*q, d, dm, du, di, strategies=strategies)
            return part, np.asarray(scores)[:, :, : len(part)]

        # XLA:CPU runs each fused op on one thread: keep one chunk in flight per core (threads
        # kept between calls: starting them costs milliseconds on a busy machine).
        workers = self.config.concurrent_chunks or batching.default_concurrent_batches(
            device.platform if device is not None else None
        )
        done = map(run, jobs) if len(jobs) == 1 else _pool(max(1, workers)).map(run, jobs)
        for part, scores in done:
            cols = np.searchsorted(union, part)
            for i in range(num_q):
                pos = position[i, cols]
                hit = pos >= 0
                out[i][:, pos[hit]] = scores[:, i, hit]
        return out

    def _fixed_shape_jobs(self, union: np.ndarray) -> list[tuple]:
        """A few candidates: blocks of ``block_docs`` documents at the longest length."""
        block = self.config.block_docs
        gather = self.store.gather_padded
        return [
            (union[lo : lo + block], self.max_length, block, gather)
            for lo in range(0, len(union), block)
        ]

    def _bucket_jobs(self, union: np.ndarray, query_len: int, num_q: int) -> list[tuple]:
        """Many candidates: per length bucket, chunks of up to ``max_elements`` similarities
        (padded to a power of two documents, see ``padded_chunk``)."""
        if self._use_cache:  # built once, on first use (a rerank never needs it)
            with self._cache_lock:
                if self._cache is None:
                    self._cache = {
                        L: self.store.gather_padded(d, L) for L, d in self.buckets.items()
                    }
        jobs = []
        for length, bucket_docs in self.buckets.items():
            docs = union[np.isin(union, bucket_docs, assume_unique=True)]
            chunk = self._chunk_docs(query_len, num_q, length)
            gather = functools.partial(self._gather, bucket_docs=bucket_docs)
            jobs += [
                (part, length, padded_chunk(len(part), chunk), gather)
                for part in (docs[lo : lo + chunk] for lo in range(0, len(docs), chunk))
            ]
        return jobs

    def warm_up(self, max_query_length: int, strategies: Iterable[Sequence] = ()) -> int:
        """Compiles the fixed-shape refinement of one query (what a query's refinement and a
        ``rerank`` of up to ``fixed_shape_docs`` candidates run) for every query bucket up to
        ``max_query_length`` tokens and every tuple of ``strategies``, by scoring the store's
        first documents (one shape per core at a time); returns the number of shapes run."""
        if not self.store.num_docs or self.config.fixed_shape_docs < 1:
            return 0
        docs = np.arange(min(self.store.num_docs, self.config.block_docs))
        parsed = [tuple(scoring.AlignmentStrategy.parse(st) for st in sts) for sts in strategies]
        host = self.config.host_top1 and self.config.fixed_shape_device == "cpu"
        shapes = [
            (strategy_tuple, length)
            for strategy_tuple in parsed
            if not (host and strategy_tuple == TOP1)  # scored without JAX: nothing to compile
            for length in self.config.query_buckets_upto(max_query_length)
        ]

        def run(shape):
            parsed, length = shape
            query = EncodedText(
                token_ids=np.zeros(length, np.int32),
                vectors=np.zeros((length, self.store.dim), np.float32),
                salience=np.ones(length, np.float32),
            )
            self.score(QueryBatch.from_encoded([query], length), [docs], parsed)

        platform = "cpu" if self.config.fixed_shape_device == "cpu" else None
        workers = self.config.concurrent_chunks or batching.default_concurrent_batches(platform)
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            list(pool.map(run, shapes))
        return len(shapes)

    def _gather(self, docs: np.ndarray, length: int, bucket_docs: np.ndarray):
        if self._cache is not None:
            vec, mask, sal, ids = self._cache[length]
            pos = np.searchsorted(bucket_docs, docs)
            if len(pos) and pos[-1] - pos[0] + 1 == len(pos):  # contiguous: a view, no copy
                sl = slice(int(pos[0]), int(pos[-1]) + 1)
                return vec[sl], mask[sl], sal[sl], ids[sl]
            return vec[pos], mask[pos], sal[pos], ids[pos]
        return self.store.gather_padded(docs, length)


def warm_up(
    encoder: Encoder | None,
    refiner: Refiner | None,
    alignment: scoring.AlignmentStrategy | str = "top_k:1",
) -> dict:
    """Compiles, once at load, every shape a single query takes: the query encoder's length
    buckets (:meth:`Encoder.warm_up`) and, with a refiner, its fixed-shape refinement
    (:meth:`Refiner.warm_up`) for every query bucket up to the encoder's query budget, with the
    searcher's ``alignment`` and with ``rerank``'s default ``top_k:1``. Returns
    ``{"seconds", "query_buckets", "refine_shapes"}`` (logged)."""
    start = time.perf_counter()
    buckets: tuple[int, ...] = ()
    shapes = 0
    if encoder is not None:
        buckets = encoder.warm_up(aligner_lib.QUERY)
    if refiner is not None:
        top1 = scoring.AlignmentStrategy.parse("top_k:1")
        strategies = dict.fromkeys([(scoring.AlignmentStrategy.parse(alignment),), (top1,)])
        longest = encoder.maxlen(aligner_lib.QUERY) if encoder is not None else refiner.max_length
        shapes = refiner.warm_up(longest, strategies)
    seconds = time.perf_counter() - start
    logging.info(
        "warm-up: %d query buckets %s and %d refinement shapes compiled in %.1f s",
        len(buckets),
        list(buckets),
        shapes,
        seconds,
    )
    return {"seconds": seconds, "query_buckets": list(buckets), "refine_shapes": shapes}
