"""Spherical k-means in JAX: the token centroids of the compressed search index (PLAID §4.1).

Document token vectors are L2-normalised, so centroids are too and assignment is by dot product
(the maximum inner product equals the nearest centroid). Every step is a jitted fixed-shape kernel
over chunks of points; the centroid update is a segment sum. Empty clusters are re-seeded with the
points worst served by their centroid, so every centroid owns points.

Two levels (``fit_two_level``, ``assign_two_level``): k-means into ``cells`` coarse clusters,
then k-means inside each cell; a point goes to its best cell, then to the best centroid of that
cell. Assigning T tokens to C centroids then costs T·(cells + C/cells)·D instead of T·C·D (at
C = 2^15 and 128 cells, 85× less): what makes the build of a 100M-token index hours, not days.
The price is that a point near a cell boundary may miss its globally nearest centroid
(measured in ``benchmarks/results/scale_stop25_29/scale.md``).

Split across processes (``parallel``, a :class:`Serial` or ``distributed_build.ProcessSplit``):
the independent pieces of work — the assignment's fixed-shape chunks, the fit inside each cell
— are handed out by ``parallel.map`` and their results come back, in order, on every process,
which then does the rest (sums, normalisation, re-seeding) itself. Each piece is the very
computation one process would do, so the centroids equal the one-process fit's bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from aligner_jax.common import progress
from aligner_jax.indexing.sample_file import SampleFile

CHUNK = 1 << 15  # points per assignment kernel call (fixed shape: one compilation)


def code_dtype(num_centroids: int):
    """The dtype of centroid ids: uint16 up to 65,536 centroids, else int32."""
    return np.uint16 if num_centroids <= 1 << 16 else np.int32


def chunk_rows(n: int) -> int:
    """Rows of the fixed-shape chunks ``n`` points are cut into: ``CHUNK``, or for fewer points
    the next power of two (≥ 16)."""
    return min(CHUNK, 1 << max(int(n - 1).bit_length(), 4))


def _padded(part: np.ndarray, rows: int) -> np.ndarray:
    """``part`` as float32, zero rows appended up to ``rows`` (on the host: no kernel per
    length)."""
    part = np.asarray(part, np.float32)
    if len(part) < rows:
        part = np.concatenate([part, np.zeros((rows - len(part), part.shape[1]), np.float32)])
    return part


def default_num_centroids(
    num_tokens: int, per_sqrt: float = 16.0, dim: int | None = None, max_product: int | None = None
) -> int:
    """2^⌊log2(per_sqrt·√T)⌋ centroids for T indexed tokens (PLAID: 16·√T), at least 1.

    With ``dim`` and ``max_product``, at most the largest power of two C with C·dim ≤
    ``max_product`` (``CentroidIndexConfig``'s caps on the query–centroid product and on the
    centroid table's size)."""
    if num_tokens <= 1:
        return 1
    c = int(2 ** max(0, math.floor(math.log2(per_sqrt * math.sqrt(num_tokens)))))
    if dim and max_product:
        c = min(c, int(2 ** max(0, math.floor(math.log2(max_product / dim)))))
    return c


@jax.jit
def _assign_chunk(points: jax.Array, centroids: jax.Array) -> tuple[jax.Array, jax.Array]:
    scores = jnp.dot(points, centroids.T, precision=jax.lax.Precision.DEFAULT)
    return jnp.argmax(scores, axis=1).astype(jnp.int32), jnp.max(scores, axis=1)


class Serial:
    """Every piece of work done here, in order (one process)."""

    def map(self, fn: Callable[[int], object], count: int, template: object) -> list:
        """``[fn(0), …, fn(count - 1)]``; ``template``: zeros shaped as one result (unused
        here; a split over processes pads with it)."""
        del template
        return [fn(i) for i in range(count)]


SERIAL = Serial()


def assign(
    points: np.ndarray, centroids: np.ndarray, parallel: Serial = SERIAL
) -> tuple[np.ndarray, np.ndarray]:
    """Nearest (max dot product) centroid of every point: (codes [N] int32, scores [N] f32).

    Fixed-shape chunks (``chunk_rows``: one compilation per power of two below ``CHUNK``);
    ``parallel`` may hand them to other processes."""
    n = len(points)
    if n == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.float32)
    centroids = jnp.asarray(centroids, jnp.float32)
    chunk = chunk_rows(n)

    def one(j: int) -> tuple[np.ndarray, np.ndarray]:
        part = _padded(points[j * chunk : (j + 1) * chunk], chunk)
        c, s = _assign_chunk(jnp.asarray(part), centroids)
        return np.asarray(c), np.asarray(s)

    template = (np.zeros(chunk, np.int32), np.zeros(chunk, np.float32))
    parts = parallel.map(one, -(-n // chunk), template)
    codes = np.concatenate([c for c, _ in parts])[:n]
    best = np.concatenate([s for _, s in parts])[:n]
    return codes, best


@jax.jit
def _add_sums(sums: jax.Array, counts: jax.Array, points: jax.Array, codes: jax.Array):
    """``sums``/``counts`` plus the sum and count of the points per code; codes ≥
    ``len(sums)`` (padding) are dropped."""
    k = sums.shape[0]
    sums = sums + jax.ops.segment_sum(points, codes, num_segments=k)
    counts = counts + jax.ops.segment_sum(jnp.ones_like(codes), codes, num_segments=k)
    return sums, counts


def _chunked_sums(points: np.ndarray, codes: np.ndarray, num_centroids: int):
    """Sum and count of the points per code, chunk by chunk (``chunk_rows``): no sample-sized
    copy on the device, and the fits of a two-level k-means' many cells (of every size) share
    a few kernels instead of compiling one per cell size."""
    n = len(points)
    chunk = chunk_rows(n)
    sums = np.zeros((num_centroids, points.shape[1]), np.float32)
    counts = np.zeros(num_centroids, np.int32)
    for lo in range(0, n, chunk):
        part = _padded(points[lo : lo + chunk], chunk)
        c = codes[lo : lo + chunk]
        c = np.concatenate([c, np.full(chunk - len(c), num_centroids, c.dtype)])  # padding
        sums, counts = _add_sums(sums, counts, jnp.asarray(part), jnp.asarray(c))
    return np.array(sums), np.array(counts)


def _float(sample: np.ndarray | SampleFile) -> np.ndarray | SampleFile:
    """``sample`` as float16 or float32, whichever it is (a float16 token store's sample stays
    float16: half the memory; every kernel reads float32 chunks of it); a :class:`SampleFile`
    stays in its file (read a chunk at a time)."""
    if isinstance(sample, SampleFile):
        return sample
    sample = np.asarray(sample)
    return sample if sample.dtype in (np.float16, np.float32) else sample.astype(np.float32)


def _normalise(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def fit(
    sample: np.ndarray,
    num_centroids: int,
    iterations: int = 8,
    seed: int = 0,
    log: bool = True,
    parallel: Serial = SERIAL,
) -> np.ndarray:
    """Spherical k-means on ``sample [N, D]`` (float16 or float32): ``[min(num_centroids, N), D]``
    float32 centroids.

    Initialised from distinct random sample points; each iteration assigns every point (chunked
    jitted kernel, the chunks split by ``parallel``) and sets each centroid to the normalised
    mean of its points.
    """
    sample = _float(sample)
    n = len(sample)
    k = min(num_centroids, n)
    rng = np.random.default_rng(seed)
    centroids = _normalise(np.asarray(sample[rng.choice(n, k, replace=False)], np.float32))
    bar = progress.Progress(iterations, f"k-means ({k} centroids)", "iter", enabled=log)
    for it in range(iterations):
        codes, best = assign(sample, centroids, parallel)
        sums, counts = _chunked_sums(sample, codes, k)  # writable: re-seeding below
        empty = np.nonzero(counts == 0)[0]
        if len(empty):  # re-seed with the points farthest from their centroid
            worst = np.argsort(best)[: len(empty)]
            sums[empty] = sample[worst]
        centroids = _normalise(sums)
        bar.update(1)
        logging.debug(
            "k-means: iteration %d/%d, %d centroids, mean score %.4f, %d re-seeded",
            it + 1,
            iterations,
            k,
            float(best.mean()),
            len(empty),
        )
    bar.close()
    return centroids.astype(np.float32)


def default_cells(num_centroids: int) -> int:
    """Coarse cells of the two-level k-means: 2^⌊log2(C)/2⌋ (C = 2^15 → 128 cells of 256)."""
    return 1 << max(0, int(math.log2(max(num_centroids, 1))) // 2)


def fit_two_level(
    sample: np.ndarray,
    num_centroids: int,
    cells: int,
    iterations: int = 8,
    seed: int = 0,
    parallel: Serial = SERIAL,
) -> tuple[np.ndarray, np.ndarray]:
    """Two-level spherical k-means: (centroids ``[cells·⌈C/cells⌉, D]`` ordered by cell, cell
    centroids ``[cells, D]``). ``cells = 1`` is ``fit`` (one level). A cell with fewer sample
    points than centroids repeats its last centroid (the copies never win an assignment).
    ``parallel`` splits the coarse fit's assignment chunks and the cells' fits. A ``sample`` in
    a :class:`SampleFile` is copied, sorted by cell, into a second one, so that each cell's
    points are one contiguous read."""
    sample = _float(sample)
    if cells <= 1:
        centroids = fit(sample, num_centroids, iterations, seed, parallel=parallel)
        return centroids, _normalise(centroids.mean(0, keepdims=True))
    coarse = fit(sample, cells, iterations, seed, parallel=parallel)
    per_cell = -(-num_centroids // len(coarse))
    owner, _ = assign(sample, coarse, parallel)
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(len(coarse) + 1))
    by_cell = sample.permuted(order) if isinstance(sample, SampleFile) else None
    bar = progress.Progress(len(coarse), f"k-means: {per_cell} centroids in each cell", "cell")

    def cell(j: int) -> np.ndarray:
        span = slice(bounds[j], bounds[j + 1])
        points = sample[order[span]] if by_cell is None else by_cell[span]
        block = fit(points, per_cell, iterations, seed + 1 + j, log=False) if len(points) else None
        block = coarse[j : j + 1] if block is None else block
        out = np.empty((per_cell, sample.shape[1]), np.float32)
        out[: len(block)] = block
        out[len(block) :] = block[-1]
        bar.update(1)
        return out

    template = np.zeros((per_cell, sample.shape[1]), np.float32)
    try:
        blocks = parallel.map(cell, len(coarse), template)
    finally:
        if by_cell is not None:
            by_cell.close()
    bar.close()
    return np.concatenate(blocks), coarse


def assign_two_level(
    points: np.ndarray, centroids: np.ndarray, cells: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Best cell of every point, then its best centroid in that cell (one BLAS product per cell):
    (codes [N] int32, scores [N] float32). One cell is ``assign``."""
    if len(cells) <= 1:
        return assign(points, centroids)
    points = np.asarray(points, np.float32)
    per_cell = len(centroids) // len(cells)
    owner, _ = assign(points, cells)
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(len(cells) + 1))
    codes = np.empty(len(points), np.int32)
    best = np.empty(len(points), np.float32)
    for j in np.nonzero(np.diff(bounds))[0]:
        rows = order[bounds[j] : bounds[j + 1]]
        scores = points[rows] @ centroids[j * per_cell : (j + 1) * per_cell].T
        local = np.argmax(scores, axis=1)
        codes[rows] = j * per_cell + local
        best[rows] = scores[np.arange(len(rows)), local]
    return codes, best
