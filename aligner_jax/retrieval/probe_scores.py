"""WARP's candidate scoring, compiled: every token of a query token's probed clusters scored
with its residual, q_i·(c + r̂), each document's best per query token, summed over query tokens
against their imputed scores (``centroid_search``'s ``residual_candidates`` and ``xtr``).

For query token i with weight w_i, probed clusters P_i and imputed score m_i (its first unprobed
centroid's score, WARPSELECT), a document d reached by i gets

  acc[d] += w_i · (max_{j ∈ d, code_j ∈ P_i} q_i·(c_j + r̂_j) − m_i)

so that (Σ_i w_i·m_i + acc[d]) / Σ_i w_i is Eq. 1–2's top-1 score with the unreached query
tokens imputed (all w = 1: f_XTR′, XTR Eq. 4). q_i·r̂_j is read from the packed levels without
decoding (``codec.ResidualCodec``: q·r̂ = constant + Σ_p Σ_b (q⊙step)_{p,b}·level_{p,b}).

NumPy does this one query token at a time (a ``[rows, W] @ [W, 1]`` product per plane, then
``np.maximum.at``), and those passes, not the arithmetic, were most of the search: the compiled
loop reads each probed token's packed row once and keeps nothing per token (``residual_candidates``
with ``refine_per_k=1``, k = 100, 2 threads: SciFact zero-shot 34.2 → 25.0 ms p50, CISI
zero-shot 61.4 → 32.0 ms; ``benchmarks/results/query_path_ab_probe_scores.md``). It runs on the
calling thread. Without numba, ``centroid_search`` keeps its NumPy loop (same values up to float
rounding: the compiled sum reassociates).
"""

from __future__ import annotations

import numpy as np

from aligner_jax.common import scratch
from aligner_jax.indexing.codec import ResidualCodec

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; kept for hosts without it
    numba = None


def _row_score(row, w, bits):  # pragma: no cover - compiled
    """Σ_p Σ_b w[p, b] · level_{p, b} of one packed row (``bits`` 2, 4 or 8: 4, 2 or 1
    planes), each plane in its own accumulator over one pass of the row's bytes (a loop per
    plane, re-reading the row, took 1.3× as long at 4 bits)."""
    s0 = s1 = s2 = s3 = np.float32(0.0)
    if bits == 4:
        for b in range(len(row)):
            v = np.int32(row[b])
            s0 += w[0, b] * np.float32(v & 15)
            s1 += w[1, b] * np.float32(v >> 4)
    elif bits == 2:
        for b in range(len(row)):
            v = np.int32(row[b])
            s0 += w[0, b] * np.float32(v & 3)
            s1 += w[1, b] * np.float32((v >> 2) & 3)
            s2 += w[2, b] * np.float32((v >> 4) & 3)
            s3 += w[3, b] * np.float32(v >> 6)
    else:
        for b in range(len(row)):
            s0 += w[0, b] * np.float32(row[b])
    return (s0 + s1) + (s2 + s3)


def _accumulate(
    where, top_scores, starts, lengths, packed, docs, planes, constant, bits, weights, imputed,
    floor, acc, seen, touched,
):  # pragma: no cover - compiled  # fmt: skip
    """For each query token i and each of its probed clusters ``where[i, a]`` (rows
    ``starts[c] : starts[c] + lengths[c]`` of ``packed``/``docs``): the best score per document,
    kept in ``floor`` (−∞ on entry and on exit), then ``acc[d] += weights[i] · (best −
    imputed[i])`` and ``seen[d] = True`` for each document it reached."""
    n, p = where.shape
    for i in range(n):
        m = 0
        w = planes[i]
        for a in range(p):
            c = where[i, a]
            base = top_scores[i, a] + constant[i]
            for r in range(starts[c], starts[c] + lengths[c]):
                value = base + _row_score(packed[r], w, bits)
                d = docs[r]
                if floor[d] == -np.inf:
                    touched[m] = d
                    m += 1
                if value > floor[d]:
                    floor[d] = value
        for t in range(m):
            d = touched[t]
            acc[d] += weights[i] * (floor[d] - imputed[i])
            seen[d] = True
            floor[d] = -np.inf


if numba is not None:
    # no "ninf"/"nnan" fast-math flags: the loop compares with −∞
    _FLAGS = {"reassoc", "contract"}
    _row_score = numba.njit(inline="always", nogil=True, fastmath=_FLAGS)(_row_score)
    _accumulate = numba.njit(cache=True, nogil=True, fastmath=_FLAGS)(_accumulate)


def available() -> bool:
    """Whether the compiled pass runs here (numba installed)."""
    return numba is not None


def accumulate(
    codec,
    queries: np.ndarray,
    where: np.ndarray,
    top_scores: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    packed: np.ndarray,
    docs: np.ndarray,
    weights: np.ndarray,
    imputed: np.ndarray,
    floor: np.ndarray,
    acc: np.ndarray,
    seen: np.ndarray,
) -> None:
    """Adds each query token's best probed score per document (minus its imputed score, times
    its weight) into ``acc`` and marks ``seen``, in place (see the module docstring).

    ``codec``: the index's ``ResidualCodec``; ``queries`` ``[n, D]`` the probing query tokens;
    ``where`` ``[n, p]`` each token's probed clusters as indices into ``starts``/``lengths``
    (the clusters' rows of ``packed [R, W]`` and ``docs [R]``, int32 or int64: the token
    lists' own arrays, read where they lie); ``top_scores`` ``[n, p]``
    their centroid scores; ``floor`` ``[num_docs]`` float32, −∞ everywhere (left so)."""
    planes, constant = codec.query_terms(queries)
    n = len(constant)
    _accumulate(
        np.ascontiguousarray(where, np.int64),
        np.ascontiguousarray(top_scores, np.float32),
        np.ascontiguousarray(starts, np.int64),
        np.ascontiguousarray(lengths, np.int64),
        np.ascontiguousarray(packed, np.uint8),
        np.ascontiguousarray(docs),  # int32 or int64, as the token lists hold them
        np.ascontiguousarray(np.stack(planes, axis=1) if n else np.zeros((0, 1, 1), np.float32)),
        np.ascontiguousarray(constant, np.float32),
        codec.bits,
        np.ascontiguousarray(weights, np.float32),
        np.ascontiguousarray(imputed, np.float32),
        floor,
        acc,
        seen,
        scratch.buffer("probe_scores.touched", (max(len(floor), 1),), np.int64),
    )


def warm_up() -> None:
    """Compiles the pass now (or loads it from numba's cache), so that the first search after
    ``Searcher.load`` does not pay for it. A no-op without numba."""
    if numba is None:
        return
    codec = ResidualCodec(4, np.zeros(2, np.float32), np.ones(2, np.float32))
    one = np.zeros(1, np.int64)
    floor = np.full(1, -np.inf, np.float32)
    for docs in (one.astype(np.int32), one):  # the token lists' documents: int32 below 2³¹
        accumulate(
            codec, np.zeros((1, 2), np.float32), np.zeros((1, 1), np.int64), np.zeros((1, 1)),
            one, one + 1, np.zeros((1, 1), np.uint8), docs, np.ones(1), np.zeros(1), floor,
            np.zeros(1, np.float32), np.zeros(1, bool),
        )  # fmt: skip
