"""Token-level maximum inner-product search (MIPS): ScaNN or exact brute force.

The token index holds the document tokens kept by salience pruning (the top β^d of each document's
tokens by unary salience, paper §3.2; β^d = 100% keeps all) and answers, for every query token, its
k′ nearest document tokens by dot product. Their documents are the search candidates.

Two backends:
  * ``scann``: ScaNN tree partitioning + asymmetric hashing + exact reordering (the paper's
    choice). Sizes follow from formulas in :class:`ScannConfig`, written once.
  * ``exact``: brute force in JAX over chunks of the token matrix with a running top-k′; exact,
    and the reference the ScaNN recall is measured against.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from pathlib import Path

import gin
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from aligner_jax.common import checks, errors, fileio, progress
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import pruning
from aligner_jax.indexing import token_store as ts

BACKENDS = ("scann", "exact")
REORDER_DTYPES = ("float32", "bfloat16", "int8")


def _import_scann():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from scann.scann_ops.py import scann_ops_pybind  # noqa: PLC0415 (imports tensorflow; lazy)

    return scann_ops_pybind


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ScannConfig:
    """ScaNN settings. ``None`` fields are derived from the index size by the formulas below.

    num_leaves = clip(round(sqrt(T)), 1, T // min_partition_size) for T indexed tokens of a part;
    num_leaves_to_search = max(ceil(leaves_to_search_fraction * num_leaves), 1);
    reorder_k = max(reorder_factor * k′, k′) (asserted ≥ k′ at search time).

    An index of more than ``max_tokens_per_part`` tokens is built as several ScaNN indexes over
    consecutive groups of shards (bounded build memory); search queries every part for k′
    neighbours and merges them by score (exact merge of the parts' top-k′ lists). Building a part
    peaks near 1.7 KiB per 128-d token (float32 copies inside ScaNN: 7.7 GiB at 4M tokens,
    benchmarks/scaling.py), so the 4M default keeps a build within a 24 GiB machine at any size.
    ``reorder_dtype`` stores the reordering vectors in float32, bfloat16 or int8.
    Every part stays resident at search time, so memory grows with the tokens (16M tokens at
    128-d searched at a peak RSS of 16.8 GiB): an index of more than ``max_token_dims`` tokens ×
    dimensions is refused in one line naming the compressed, memory-mapped centroid index
    (``indexing.centroid_index``), which has no such limit.
    """

    num_leaves: int | None = None
    leaves_to_search_fraction: float = 0.1
    num_leaves_to_search: int | None = None
    dimensions_per_block: int = 2
    anisotropic_quantization_threshold: float = 0.2
    training_sample_size: int = 250_000
    min_partition_size: int = 50
    reorder_factor: float = 2.0
    reorder_dtype: str = "float32"
    training_threads: int = 0
    max_tokens_per_part: int = 4_000_000
    max_token_dims: int = 16_000_000 * 128

    def __post_init__(self):
        name = type(self).__name__
        checks.integer(f"{name}.num_leaves", self.num_leaves, minimum=1, allow_none=True)
        checks.number(
            f"{name}.leaves_to_search_fraction", self.leaves_to_search_fraction, 0.0, 1.0, True
        )
        checks.integer(
            f"{name}.num_leaves_to_search", self.num_leaves_to_search, minimum=1, allow_none=True
        )
        checks.integer(f"{name}.dimensions_per_block", self.dimensions_per_block, minimum=1)
        checks.number(
            f"{name}.anisotropic_quantization_threshold", self.anisotropic_quantization_threshold
        )
        checks.integer(f"{name}.training_sample_size", self.training_sample_size, minimum=1)
        checks.integer(f"{name}.min_partition_size", self.min_partition_size, minimum=1)
        checks.number(f"{name}.reorder_factor", self.reorder_factor, 1.0)
        checks.choice(f"{name}.reorder_dtype", self.reorder_dtype, REORDER_DTYPES)
        checks.integer(f"{name}.training_threads", self.training_threads, minimum=0)
        checks.integer(f"{name}.max_tokens_per_part", self.max_tokens_per_part, minimum=1)
        checks.integer(f"{name}.max_token_dims", self.max_token_dims, minimum=1)

    def leaves(self, num_tokens: int) -> int:
        if self.num_leaves is not None:
            return self.num_leaves
        return int(max(1, min(round(math.sqrt(num_tokens)), num_tokens // self.min_partition_size)))

    def leaves_to_search(self, num_leaves: int) -> int:
        if self.num_leaves_to_search is not None:
            return min(self.num_leaves_to_search, num_leaves)
        return max(1, math.ceil(self.leaves_to_search_fraction * num_leaves))

    def reorder_k(self, k_prime: int) -> int:
        return max(int(math.ceil(self.reorder_factor * k_prime)), k_prime)


def prune_rows(store: ts.TokenStore, beta_d: float) -> np.ndarray:
    """Global token rows kept in the token index: each document's top ceil(β^d·m) by salience.

    Ties (e.g. uniform salience when the model has no salience head) keep the earlier tokens.
    """
    if not 0.0 < beta_d <= 1.0:
        raise ConfigError(f"beta_d={beta_d}: the document pruning ratio must be in (0, 1]")
    if beta_d >= 1.0:
        return np.arange(store.num_tokens, dtype=np.int64)
    kept = []
    offsets = store.offsets
    block = 4096  # documents per read: vectorised without holding every salience at once
    for start in range(0, store.num_docs, block):
        stop = min(start + block, store.num_docs)
        lo, hi = int(offsets[start]), int(offsets[stop])
        kept.append(
            pruning.top_fraction_segments(store.salience(lo, hi), offsets[start : stop + 1], beta_d)
        )
    return np.concatenate(kept) if kept else np.zeros(0, np.int64)


def _row_to_doc(store: ts.TokenStore, rows: np.ndarray) -> np.ndarray:
    return (np.searchsorted(store.offsets, rows, side="right") - 1).astype(np.int32)


def _gather_rows(store: ts.TokenStore, rows: np.ndarray, chunk: int = 1 << 18) -> np.ndarray:
    """float32 vectors of the given global rows (sorted), read chunk by chunk."""
    out = np.empty((len(rows), store.dim), dtype=np.float32)
    for i in range(0, len(rows), chunk):
        r = rows[i : i + chunk]
        lo, hi = int(r[0]), int(r[-1]) + 1
        out[i : i + len(r)] = store.vectors(lo, hi)[r - lo]
    return out


@jax.jit
def _scores_chunk(queries, chunk):
    return jnp.dot(queries, chunk.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)


def _part_bounds(store: ts.TokenStore, rows: np.ndarray, max_tokens: int) -> list[slice]:
    """Splits the sorted index rows into consecutive groups of whole shards of ≤ max_tokens."""
    if len(rows) <= max_tokens:
        return [slice(0, len(rows))]
    shard_of = np.searchsorted(store._shard_token_starts, rows, side="right") - 1
    bounds, start = [], 0
    counts = np.bincount(shard_of, minlength=len(store._shard_token_starts))
    current = 0
    pos = 0
    for count in counts:
        if current and current + count > max_tokens:
            bounds.append(slice(start, pos))
            start, current = pos, 0
        current += int(count)
        pos += int(count)
    bounds.append(slice(start, pos))
    return [b for b in bounds if b.stop > b.start]


def _build_scann(data: np.ndarray, k_prime: int, config: ScannConfig):
    scann = _import_scann()
    n = len(data)
    leaves = config.leaves(n)
    builder = scann.builder(data, k_prime, "dot_product")
    if leaves > 1:
        builder = builder.tree(
            num_leaves=leaves,
            num_leaves_to_search=config.leaves_to_search(leaves),
            training_sample_size=min(config.training_sample_size, n),
            min_partition_size=min(config.min_partition_size, n),
        )
    from scann.scann_ops.py.scann_builder import ReorderType  # noqa: PLC0415  (TensorFlow; lazy)

    quantize = {
        "float32": ReorderType.FLOAT32,
        "bfloat16": ReorderType.BFLOAT16,
        "int8": ReorderType.INT8,
    }[config.reorder_dtype]
    builder = builder.score_ah(
        config.dimensions_per_block,
        anisotropic_quantization_threshold=config.anisotropic_quantization_threshold,
        training_sample_size=min(config.training_sample_size, n),
    ).reorder(config.reorder_k(k_prime), quantize=quantize)
    builder.set_n_training_threads(config.training_threads)
    return builder.build(), leaves


class TokenIndex:
    """Token MIPS over (a salience-pruned subset of) a token store.

    ``search(queries, k)`` → ``(scores [n, k] float32, docs [n, k] int32, rows [n, k] int64)``,
    sorted by decreasing score, padded with score -inf / doc -1 when fewer than k tokens exist.
    A ScaNN index may consist of several parts (see :class:`ScannConfig`); their results are
    merged.
    """

    def __init__(
        self,
        store: ts.TokenStore,
        backend: str,
        rows: np.ndarray,
        searchers: list | None = None,
        part_bounds: list[slice] | None = None,
        scann_config: ScannConfig | None = None,
        build_seconds: float = 0.0,
    ):
        if backend not in BACKENDS:
            raise ConfigError(f"search backend {backend!r}: choose one of {BACKENDS}")
        self.store = store
        self.backend = backend
        self.rows = rows
        self.row_docs = _row_to_doc(store, rows)
        self.searchers = searchers or []
        self.part_bounds = part_bounds or [slice(0, len(rows))]
        self.scann_config = scann_config or ScannConfig()
        self.build_seconds = build_seconds
        self._scann_bytes: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.rows)

    @property
    def num_parts(self) -> int:
        return len(self.part_bounds)

    def nbytes(self) -> int:
        """Bytes of the token index as stored: the row→document map plus, for ScaNN, its
        serialized assets (partition centroids, hashed codes, reordering vectors), or, for the
        exact backend, the float16 vectors it scans."""
        if self.backend == "scann":
            if self._scann_bytes is None:
                total = 0
                for searcher in self.searchers:
                    with tempfile.TemporaryDirectory() as tmp:
                        searcher.serialize(tmp)
                        total += sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
                self._scann_bytes = total
            index_bytes = self._scann_bytes
        else:
            index_bytes = self.num_tokens * self.store.dim * np.dtype(ts.VECTOR_DTYPE).itemsize
        return int(index_bytes + self.row_docs.nbytes)

    @classmethod
    def build(
        cls,
        store: ts.TokenStore,
        backend: str = "scann",
        beta_d: float = 1.0,
        scann_config: ScannConfig | None = None,
        k_prime: int = 4000,
    ) -> TokenIndex:
        if backend not in BACKENDS:
            raise ConfigError(f"search backend {backend!r}: choose one of {BACKENDS}")
        start = time.perf_counter()
        rows = prune_rows(store, beta_d)
        if len(rows) == 0:
            raise ConfigError(f"{store.directory}: the index holds no tokens to search")
        config = scann_config or ScannConfig()
        searchers, bounds = [], [slice(0, len(rows))]
        if backend == "scann":
            if len(rows) * store.dim > config.max_token_dims:
                raise ConfigError(
                    f"{store.directory}: the ScaNN token index of {len(rows):,} tokens × "
                    f"{store.dim} dimensions exceeds its measured limit (ScannConfig."
                    f"max_token_dims={config.max_token_dims:,}: 16M tokens at 128-d peaked at "
                    "16.8 GiB, every token resident in memory); search this store with the "
                    "compressed index (--gin.SearchConfig.backend=\"'centroid'\", memory-mapped), or "
                    "raise the limit on a larger machine"
                )
            bounds = _part_bounds(store, rows, config.max_tokens_per_part)
            desc = "ScaNN token index: build parts"
            if len(bounds) == 1:  # no rate (it starts after the first part): time logged at the end
                desc = f"ScaNN token index: build 1 part ({len(rows):,} tokens)"
            bar = progress.Progress(len(bounds), desc, "part")
            for i, part in enumerate(bounds):
                data = _gather_rows(store, rows[part])
                searcher, leaves = _build_scann(data, k_prime, config)
                del data
                searchers.append(searcher)
                bar.update(1, tokens=part.stop - part.start)
                logging.debug(
                    "ScaNN token index part %d/%d: %d tokens, %d leaves (search %d), "
                    "reorder %d (%s); %.1fs so far",
                    i + 1,
                    len(bounds),
                    part.stop - part.start,
                    leaves,
                    config.leaves_to_search(leaves),
                    config.reorder_k(k_prime),
                    config.reorder_dtype,
                    time.perf_counter() - start,
                )
            bar.close()
            if len(bounds) == 1:
                logging.info(
                    "ScaNN token index: 1 part, %s tokens in %.1fs",
                    f"{len(rows):,}",
                    time.perf_counter() - start,
                )
        return cls(store, backend, rows, searchers, bounds, config, time.perf_counter() - start)

    def save(self, directory: Path) -> None:
        """Saves the token index beside the store (ScaNN assets + pruning rows + settings)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        np.save(directory / "rows.npy", self.rows)
        for i, searcher in enumerate(self.searchers):
            (directory / f"scann-{i:03d}").mkdir(exist_ok=True)
            searcher.serialize(str(directory / f"scann-{i:03d}"))
        meta = {
            "backend": self.backend,
            "num_tokens": self.num_tokens,
            "parts": [[b.start, b.stop] for b in self.part_bounds],
            "scann_config": dataclasses.asdict(self.scann_config),
            "store_fingerprint": self.store.manifest["model"].get("fingerprint"),
        }
        fileio.atomic_write_json(directory / "token_index.json", meta)

    @classmethod
    def load(cls, store: ts.TokenStore, directory: Path) -> TokenIndex:
        directory = Path(directory)
        meta = ts.read_json(directory / "token_index.json", "rebuild the token index")
        if meta["store_fingerprint"] != store.manifest["model"].get("fingerprint"):
            raise errors.IndexIntegrityError(
                f"{directory}: token index was built from another token store; rebuild it"
            )
        rows = np.load(directory / "rows.npy")
        bounds = [slice(a, b) for a, b in meta["parts"]]
        searchers = []
        if meta["backend"] == "scann":
            scann = _import_scann()
            searchers = [
                scann.load_searcher(str(directory / f"scann-{i:03d}")) for i in range(len(bounds))
            ]
        config = ScannConfig(**meta["scann_config"])
        return cls(store, meta["backend"], rows, searchers, bounds, config)

    def search(
        self, queries: np.ndarray, k: int, exact_chunk: int = 1 << 16
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        n = len(queries)
        if self.backend == "scann":
            reorder = self.scann_config.reorder_k(k)
            assert reorder >= k, f"ScaNN reorder_k={reorder} must be >= k'={k}"
            all_idx, all_scores = [], []
            for searcher, part in zip(self.searchers, self.part_bounds, strict=True):
                k_part = min(k, part.stop - part.start)
                idx, scores = searcher.search_batched(
                    queries, final_num_neighbors=k_part, pre_reorder_num_neighbors=reorder
                )
                # Fewer neighbours than asked (the searched leaves hold fewer tokens) are padded
                # with index 0 and a NaN score: invalid, not token 0 of the part.
                scores = np.asarray(scores, np.float32)
                found = np.isfinite(scores)
                idx = np.asarray(idx, dtype=np.int64)
                all_idx.append(np.where(found, idx + part.start, -1))
                all_scores.append(np.where(found, scores, -np.inf))
            idx, scores = np.concatenate(all_idx, axis=1), np.concatenate(all_scores, axis=1)
            if len(self.searchers) > 1:  # merge the parts' lists into one top-k
                order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
                idx = np.take_along_axis(idx, order, axis=1)
                scores = np.take_along_axis(scores, order, axis=1)
        else:
            idx, scores = self._exact(queries, min(k, self.num_tokens), exact_chunk)
        out_scores = np.full((n, k), -np.inf, dtype=np.float32)
        out_docs = np.full((n, k), -1, dtype=np.int32)
        out_rows = np.full((n, k), -1, dtype=np.int64)
        width = idx.shape[1] if idx.ndim == 2 else 0
        valid = idx[:, :width] >= 0
        out_scores[:, :width] = np.where(valid, scores, -np.inf)
        safe = np.where(valid, idx, 0)
        out_docs[:, :width] = np.where(valid, self.row_docs[safe], -1)
        out_rows[:, :width] = np.where(valid, self.rows[safe], -1)
        return out_scores, out_docs, out_rows

    def _exact(self, queries: np.ndarray, k: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """Brute-force top-k over the indexed rows with a running merge (exact)."""
        n = len(queries)
        best_scores = np.full((n, 0), -np.inf, dtype=np.float32)
        best_idx = np.zeros((n, 0), dtype=np.int64)
        q = jnp.asarray(queries)
        chunk = min(chunk, 1 << max(int(self.num_tokens - 1).bit_length(), 4))
        for start in range(0, self.num_tokens, chunk):
            rows = self.rows[start : start + chunk]
            block = _gather_rows(self.store, rows) if len(rows) else None
            if len(rows) < chunk:  # pad to a fixed shape: one compilation
                pad = np.zeros((chunk - len(rows), self.store.dim), np.float32)
                block = np.concatenate([block, pad])
            scores = np.array(_scores_chunk(q, jnp.asarray(block, dtype=jnp.float16)))
            scores[:, len(rows) :] = -np.inf
            cand_scores = np.concatenate([best_scores, scores], axis=1)
            cand_idx = np.concatenate(
                [best_idx, np.broadcast_to(np.arange(start, start + chunk), (n, chunk))], axis=1
            )
            if cand_scores.shape[1] > k:
                part = np.argpartition(-cand_scores, k - 1, axis=1)[:, :k]
                cand_scores = np.take_along_axis(cand_scores, part, axis=1)
                cand_idx = np.take_along_axis(cand_idx, part, axis=1)
            best_scores, best_idx = cand_scores, cand_idx
        order = np.argsort(-best_scores, axis=1, kind="stable")
        best_scores = np.take_along_axis(best_scores, order, axis=1)
        best_idx = np.take_along_axis(best_idx, order, axis=1)
        best_idx[~np.isfinite(best_scores)] = -1
        return best_idx, best_scores
