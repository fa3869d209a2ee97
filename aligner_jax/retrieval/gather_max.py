"""Per-document maxima of gathered centroid scores, fused into one pass (stages 3–4 of
``centroid_search``: max_j over a document's stored tokens of S[i, code_j] (+ q_i·r̂_j), Eq. 1's
top-1 alignment on compressed vectors, and the salience u^d of the selected token, Eq. 2).

NumPy needs three passes over a ``[tokens, query tokens]`` matrix for this (``np.take`` of the
centroid-score rows, the residual sum, ``segment_max``), and on long queries those passes, not
the arithmetic, were most of a k = 100 search (CISI trained, stop 40: ``take`` 35 % and
``segment_max`` 34 % of the search's time). The compiled loop reads each token's score row
once and keeps only the ``[documents, query tokens]`` maxima. It runs on the calling thread
(``--threads`` bounds the BLAS products; this loop is single-threaded, so thread counts stay
comparable). Without numba installed, the NumPy passes give the same values.
"""

from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; kept for hosts without it
    numba = None


def _gather_max(s_t, codes, lengths, add, at_max, out, sel):  # pragma: no cover - compiled
    """out[d, i] = max over document d's rows j of s_t[codes[j], i] (+ add[j, i]); sel[d, i] =
    the largest at_max[j] among the rows attaining it. Both −∞ for a document without rows."""
    n = s_t.shape[1]
    with_add, with_sel = add.shape[0] > 0, at_max.shape[0] > 0
    j = 0
    for d in range(lengths.shape[0]):
        best = out[d]
        chosen = sel[d]
        for i in range(n):
            best[i] = -np.inf
            if with_sel:
                chosen[i] = -np.inf
        for _ in range(lengths[d]):
            row = s_t[codes[j]]
            u = at_max[j] if with_sel else 0.0
            for i in range(n):
                v = row[i] + add[j, i] if with_add else row[i]
                if v > best[i]:
                    best[i] = v
                    if with_sel:
                        chosen[i] = u
                elif with_sel and v == best[i] and u > chosen[i]:
                    chosen[i] = u
            j += 1


def _at_best(s_t, codes, lengths, best, live, out):  # pragma: no cover - compiled
    """out[j] = whether row j's centroid scores s_t[codes[j]] reach its document's ``best``
    row for some query token i with live[i]."""
    n = s_t.shape[1]
    j = 0
    for d in range(lengths.shape[0]):
        target = best[d]
        for _ in range(lengths[d]):
            row = s_t[codes[j]]
            hit = False
            for i in range(n):
                if live[i] and row[i] == target[i]:
                    hit = True
                    break
            out[j] = hit
            j += 1


def _at_own_best(s_t, codes, lengths, live, out):  # pragma: no cover - compiled
    """out[j] = whether row j's centroid scores s_t[codes[j]] reach, for some query token i
    with live[i], their maximum over its document's rows: each document's rows are read twice,
    the second time from cache, instead of a pass for the maxima and another for the rows."""
    n = s_t.shape[1]
    best = np.empty(n, np.float32)
    j = 0
    for d in range(lengths.shape[0]):
        for i in range(n):
            best[i] = -np.inf
        for t in range(j, j + lengths[d]):
            row = s_t[codes[t]]
            for i in range(n):
                best[i] = max(best[i], row[i])
        for t in range(j, j + lengths[d]):
            row = s_t[codes[t]]
            hit = False
            for i in range(n):
                hit |= live[i] & (row[i] == best[i])
            out[t] = hit
        j += lengths[d]


if numba is not None:
    _gather_max = numba.njit(cache=True, nogil=True)(_gather_max)
    _at_best = numba.njit(cache=True, nogil=True)(_at_best)
    _at_own_best = numba.njit(cache=True, nogil=True)(_at_own_best)


def gather_segment_max(
    s_t: np.ndarray,
    codes: np.ndarray,
    lengths: np.ndarray,
    add: np.ndarray | None = None,
    at_max: np.ndarray | None = None,
    reference=None,
):
    """``segment_max(s_t[codes] + add, lengths, at_max)`` without the gathered matrix.

    ``s_t`` ``[C, n]`` float32 (Sᵀ), ``codes`` ``[T]`` the centroid of each row, ``lengths``
    the rows of each document (summing to T), ``add`` ``[T, n]`` float32 added to each gathered
    row (the residual scores), ``at_max`` ``[T]`` a value per row (u^d). Returns the maxima
    ``[docs, n]`` (−∞ for a document of no rows) or, with ``at_max``, ``(maxima, selected)``.
    ``reference`` is ``centroid_search.segment_max``, the NumPy path used without numba."""
    lengths = np.asarray(lengths, np.int64)
    if numba is None:
        gathered = np.take(s_t, np.asarray(codes, np.intp), axis=0)
        if add is not None:
            gathered += add
        return reference(gathered, lengths, at_max)
    n = s_t.shape[1]
    out = np.empty((len(lengths), n), np.float32)
    sel = np.full((len(lengths), n), -np.inf, np.float32)  # −∞ also when no document has rows
    _gather_max(
        np.ascontiguousarray(s_t, np.float32),
        np.ascontiguousarray(codes, np.int64),
        lengths,
        np.empty((0, n), np.float32) if add is None else np.ascontiguousarray(add, np.float32),
        np.empty(0, np.float32) if at_max is None else np.ascontiguousarray(at_max, np.float32),
        out,
        sel,
    )
    return out if at_max is None else (out, sel)


def tokens_at_best(
    s_t: np.ndarray,
    codes: np.ndarray,
    lengths: np.ndarray,
    best: np.ndarray,
    weights: np.ndarray,
    reference=None,
) -> np.ndarray:
    """Whether each row's centroid scores ``s_t[codes[j]]`` reach its document's ``best [docs,
    n]`` for some query token of weight > 0 (any query token when none or all have): the
    tokens the residual interaction scores (``centroid_search.CentroidSearcher.refine``), in
    one pass that reads each row's scores once — NumPy gathers the ``[rows, n]`` matrix first
    and compares it whole. ``reference`` is ``centroid_search._at_best`` (on the gathered
    matrix), the path used without numba."""
    lengths = np.asarray(lengths, np.int64)
    if numba is None:
        sims = np.take(s_t, np.asarray(codes, np.intp), axis=0)
        return reference(sims, best, lengths, weights)
    live = np.asarray(weights) > 0
    if live.all() or not live.any():
        live = np.ones(s_t.shape[1], bool)
    out = np.empty(int(lengths.sum()), bool)
    _at_best(
        np.ascontiguousarray(s_t, np.float32),
        np.ascontiguousarray(codes, np.int64),
        lengths,
        np.ascontiguousarray(best, np.float32),
        live,
        out,
    )
    return out


def tokens_at_own_best(
    s_t: np.ndarray, codes: np.ndarray, lengths: np.ndarray, weights: np.ndarray, reference=None
) -> np.ndarray:
    """``tokens_at_best`` against each document's own best centroid scores (the maxima of
    ``gather_segment_max`` over the same rows), in one pass: the tokens of every document's
    best centroids, without the ``[docs, n]`` maxima. ``reference(sims, lengths, weights)``
    (on the gathered ``[rows, n]`` matrix) is the path used without numba."""
    lengths = np.asarray(lengths, np.int64)
    if numba is None:
        return reference(np.take(s_t, np.asarray(codes, np.intp), axis=0), lengths, weights)
    live = np.asarray(weights) > 0
    if live.all() or not live.any():
        live = np.ones(s_t.shape[1], bool)
    out = np.empty(int(lengths.sum()), bool)
    _at_own_best(
        np.ascontiguousarray(s_t, np.float32),
        np.ascontiguousarray(codes, np.int64),
        lengths,
        live,
        out,
    )
    return out


def warm_up() -> None:
    """Compiles the pass now (or loads it from numba's cache, ~0.5 s on 2 cores), so that the
    first search after ``Searcher.load`` does not pay for it. A no-op without numba."""
    if numba is None:
        return
    one = np.zeros((1, 1), np.float32)
    ids = np.zeros(1, np.int64)
    gather_segment_max(one, ids, ids + 1, add=one, at_max=one[0], reference=None)
    tokens_at_best(one, ids, ids + 1, one, np.ones(1, np.float32))
    tokens_at_own_best(one, ids, ids + 1, np.ones(1, np.float32))
