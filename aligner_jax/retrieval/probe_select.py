"""Each query token's best centroids, compiled: WARPSELECT's selection (stage 2 of
``centroid_search``: the ``p`` probed clusters of query token i and its imputed score, the
⌈depth·(p + 1)⌉-th best of S[i, :]) in one pass over Sᵀ as the query path holds it.

The search computes Sᵀ = C·qᵀ ``[C, n]`` (centroid-major: stages 3–4 gather whole rows of it),
so a row of S is a strided column there. NumPy selected from S = (Sᵀ)ᵀ: a copy into query-token
rows (a transpose of C·n floats), a pass for block maxima and partitions (``top_columns``):
1.4 ms of the 100× query's ~17 at k = 10 (stop 69's stage profile: 65,536 centroids, ~26
query tokens), more than half of it the transpose. Here one pass reads Sᵀ row by row, in
memory order, keeping for each query token its ``width`` best so far (sorted, best first) and
the smallest of them as a threshold; a row none of whose scores passes its token's threshold
(all but a few hundred of 65,536, after the first ``width`` rows) costs one vectorised
comparison. Ties go to the lower centroid index (a later equal score does not pass the
threshold, and an insertion stops above an equal score), so the choice does not depend on a
partition's order.

Runs on the calling thread. Without numba installed, or when a column holds fewer than
``width`` scores above −∞ (NaN or −∞ scores: never selected here), ``centroid_search.probed``
takes the NumPy path.
"""

from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; kept for hosts without it
    numba = None


def _select(s_t, probing, top, scores):  # pragma: no cover - compiled
    """For each column j of ``s_t [C, n]`` with ``probing[j]``: ``top[j]`` the row indices of
    its ``width = top.shape[1]`` largest values, best first (ties: lower row first), and
    ``scores[j]`` those values; −1 / −∞ where fewer than ``width`` values exceed −∞. The rows
    of the other columns are left −1 / −∞."""
    c, n = s_t.shape
    width = top.shape[1]
    threshold = np.empty(n, np.float32)
    for j in range(n):
        threshold[j] = -np.inf if probing[j] else np.inf
        for a in range(width):
            top[j, a] = -1
            scores[j, a] = -np.inf
    for r in range(c):
        row = s_t[r]
        hit = False
        for j in range(n):
            hit |= row[j] > threshold[j]
        if not hit:
            continue
        for j in range(n):
            v = row[j]
            if v > threshold[j]:
                a = width - 1
                while a > 0 and scores[j, a - 1] < v:
                    scores[j, a] = scores[j, a - 1]
                    top[j, a] = top[j, a - 1]
                    a -= 1
                scores[j, a] = v
                top[j, a] = r
                threshold[j] = scores[j, width - 1]


if numba is not None:
    _select = numba.njit(cache=True, nogil=True)(_select)


def available() -> bool:
    """Whether the compiled pass runs here (numba installed)."""
    return numba is not None


def select(s_t: np.ndarray, rows: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray] | None:
    """For each query token ``rows[i]`` (a column of Sᵀ ``s_t [C, n]``, float32): the
    ``width`` centroids of its largest scores, best first (ties: lower centroid first), and
    those scores, ``([len(rows), width] int64, [len(rows), width] float32)``; None where a
    token has fewer than ``width`` scores above −∞ (the caller's NumPy path then decides)."""
    s_t = np.ascontiguousarray(s_t, np.float32)
    n = s_t.shape[1]
    probing = np.zeros(n, np.bool_)
    probing[rows] = True
    top = np.empty((n, width), np.int64)
    scores = np.empty((n, width), np.float32)
    _select(s_t, probing, top, scores)
    top, scores = top[rows], scores[rows]
    if len(top) and top[:, -1].min() < 0:
        return None
    return top, scores


def warm_up() -> None:
    """Compiles the pass now (or loads it from numba's cache), so that the first search after
    ``Searcher.load`` does not pay for it. A no-op without numba."""
    if numba is not None:
        select(np.zeros((2, 1), np.float32), np.zeros(1, np.int64), 1)
