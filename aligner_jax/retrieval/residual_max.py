"""Stage 4 of ``centroid_search`` in one compiled pass: each document's top-1 alignment on
compressed vectors, max_j q_i·(c_j + r̂_j) per query token i over its stored tokens j (Eq. 1
with k = 1), and the salience u^d of the selected token (Eq. 2).

q_i·r̂_j is read from the packed levels without decoding them (``codec.ResidualCodec``:
q·r̂ = constant + Σ_p Σ_b (q⊙step)_{p,b}·level_{p,b}), and q_i·c_j from Sᵀ ``[C, n]``. NumPy
does this in three passes over a ``[tokens, query tokens]`` matrix: the levels unpacked and cast
per plane, one BLAS product per plane (``ResidualCodec.residual_scores``), then the maxima
(``gather_max``). This pass unpacks two tokens' levels into a buffer that stays in L1 and
multiplies them with four query tokens' weights at a time (eight sums in registers), keeping
only the ``[documents, query tokens]`` maxima: no per-token matrix is written.

**Threads.** Documents are independent: with ``threads`` > 1 they are cut into that many
contiguous groups of about equal token counts, the first scored on the calling thread, the
others on the process's workers (``common.workers``; the pass releases the GIL), each into its
own rows of the output. A document is always scored by one thread with the same arithmetic, so
the result does not depend on the thread count. The compiled sums reassociate, so they differ
from the NumPy passes in the last bits (a few 1e-7 on unit vectors); without numba, those
passes run instead.
"""

from __future__ import annotations

import numpy as np

from aligner_jax.common import workers
from aligner_jax.indexing.codec import ResidualCodec
from aligner_jax.retrieval import gather_max

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; kept for hosts without it
    numba = None


def _store(best, chosen, values, s_t_row, constant, u, with_sel):  # pragma: no cover
    """Folds one token's scores q_i·c + constant_i + values_i into its document's maxima."""
    for i in range(len(best)):
        v = s_t_row[i] + constant[i] + values[i]
        if v > best[i]:
            best[i] = v
            if with_sel:
                chosen[i] = u
        elif with_sel and v == best[i] and u > chosen[i]:
            chosen[i] = u


def _unpack(row, bits, out):  # pragma: no cover - compiled
    """The levels of one packed row into ``out [P·W]`` float32, plane after plane."""
    width = len(row)
    mask = (1 << bits) - 1
    for p in range(8 // bits):
        shift = bits * p
        for b in range(width):
            out[p * width + b] = np.float32((np.int32(row[b]) >> shift) & mask)


def _residual_max(
    s_t, codes, packed, at_max, lengths, starts, weights, constant, bits, out, sel, lo, hi
):  # pragma: no cover - compiled
    """Documents ``lo:hi``: ``out[d, i]`` = max over d's rows j (``starts[d]`` on, ``lengths[d]``
    of them, in ``codes``/``packed``/``at_max``) of s_t[codes[j], i] + constant[i] +
    weights[i]·levels(packed[j]); ``sel[d, i]`` the largest ``at_max[j]`` among the rows
    attaining it. Both −∞ for a document without rows."""
    n = s_t.shape[1]
    dim = weights.shape[1]
    with_sel = at_max.shape[0] > 0
    levels = np.zeros((2, dim), np.float32)
    values = np.empty((2, n), np.float32)
    for d in range(lo, hi):
        best = out[d]
        chosen = sel[d]
        for i in range(n):
            best[i] = -np.inf
            chosen[i] = -np.inf
        j = starts[d]
        end = j + lengths[d]
        while j < end:
            pair = 2 if j + 1 < end else 1
            _unpack(packed[j], bits, levels[0])
            if pair == 2:
                _unpack(packed[j + 1], bits, levels[1])
            x0 = levels[0]
            x1 = levels[1]
            i = 0
            while i + 4 <= n:  # two tokens × four query tokens: eight sums in registers
                w0, w1, w2, w3 = weights[i], weights[i + 1], weights[i + 2], weights[i + 3]
                a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
                for t in range(dim):
                    u = x0[t]
                    v = x1[t]
                    a0 += u * w0[t]
                    a1 += u * w1[t]
                    a2 += u * w2[t]
                    a3 += u * w3[t]
                    b0 += v * w0[t]
                    b1 += v * w1[t]
                    b2 += v * w2[t]
                    b3 += v * w3[t]
                values[0, i], values[0, i + 1], values[0, i + 2], values[0, i + 3] = a0, a1, a2, a3
                values[1, i], values[1, i + 1], values[1, i + 2], values[1, i + 3] = b0, b1, b2, b3
                i += 4
            while i < n:
                w0 = weights[i]
                a0 = b0 = np.float32(0.0)
                for t in range(dim):
                    a0 += x0[t] * w0[t]
                    b0 += x1[t] * w0[t]
                values[0, i], values[1, i] = a0, b0
                i += 1
            for r in range(pair):
                u = at_max[j + r] if with_sel else np.float32(0.0)
                _store(best, chosen, values[r], s_t[codes[j + r]], constant, u, with_sel)
            j += pair


if numba is not None:
    # no "ninf"/"nnan" fast-math flags: the pass compares with −∞
    _FLAGS = {"reassoc", "contract"}
    _store = numba.njit(inline="always", nogil=True, fastmath=_FLAGS)(_store)
    _unpack = numba.njit(inline="always", nogil=True, fastmath=_FLAGS)(_unpack)
    _residual_max = numba.njit(cache=True, nogil=True, fastmath=_FLAGS)(_residual_max)


def residual_segment_max(
    codec: ResidualCodec,
    queries: np.ndarray,
    s_t: np.ndarray,
    codes: np.ndarray,
    packed: np.ndarray,
    lengths: np.ndarray,
    at_max: np.ndarray | None = None,
    threads: int = 1,
    reference=None,
):
    """Each document's maxima of q_i·(c_j + r̂_j) over its rows, without a per-row matrix.

    ``queries`` ``[n, D]``; ``s_t`` ``[C, n]`` float32 (Sᵀ = centroids · queriesᵀ); ``codes``
    ``[T]`` each row's centroid, ``packed`` ``[T, W]`` its packed residual (``codec``), rows of
    consecutive documents, ``lengths`` rows each (summing to T); ``at_max`` ``[T]`` a value per
    row (u^d). Returns the maxima ``[docs, n]`` (−∞ for a document without rows) or, with
    ``at_max``, ``(maxima, selected)`` — what ``gather_max.gather_segment_max(s_t, codes,
    lengths, add=codec.residual_scores(queries, packed, token_major=True), at_max=at_max)``
    returns. ``reference`` is ``centroid_search.segment_max``, for the NumPy path without
    numba. ``threads``: document groups scored at once (module docstring)."""
    lengths = np.asarray(lengths, np.int64)
    if numba is None:
        add = codec.residual_scores(queries, packed, token_major=True)
        return gather_max.gather_segment_max(s_t, codes, lengths, add, at_max, reference)
    planes, constant = codec.query_terms(queries)
    n = len(constant)
    weights = np.concatenate(planes, axis=1) if n else np.zeros((0, codec.padded_dim), np.float32)
    out = np.empty((len(lengths), n), np.float32)
    sel = np.empty((len(lengths), n), np.float32)
    starts = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    args = (
        np.ascontiguousarray(s_t, np.float32),
        np.ascontiguousarray(codes, np.int64),
        np.ascontiguousarray(packed, np.uint8),
        np.empty(0, np.float32) if at_max is None else np.ascontiguousarray(at_max, np.float32),
        lengths,
        starts,
        np.ascontiguousarray(weights, np.float32),
        np.ascontiguousarray(constant, np.float32),
        codec.bits,
        out,
        sel,
    )
    # contiguous document groups of about equal token counts (one when there is one thread)
    groups = min(max(threads, 1), max(len(lengths), 1))
    cuts = np.searchsorted(starts, int(lengths.sum()) * np.arange(1, groups) / groups)
    bounds = sorted({0, len(lengths), *cuts.tolist()})
    futures = [
        workers.pool(len(bounds) - 2).submit(_residual_max, *args, lo, hi)
        for lo, hi in zip(bounds[1:-1], bounds[2:], strict=True)
    ]
    _residual_max(*args, 0, bounds[1] if len(bounds) > 1 else 0)
    for future in futures:
        future.result()
    return out if at_max is None else (out, sel)


def warm_up() -> None:
    """Compiles the pass now (or loads it from numba's cache), so that the first search after
    ``Searcher.load`` does not pay for it. A no-op without numba."""
    if numba is None:
        return
    codec = ResidualCodec(4, np.zeros(2, np.float32), np.ones(2, np.float32))
    one = np.zeros((1, 1), np.float32)
    residual_segment_max(
        codec, np.zeros((1, 2), np.float32), one, np.zeros(1, np.int64),
        np.zeros((1, 1), np.uint8), np.ones(1, np.int64), at_max=one[0],
    )  # fmt: skip
