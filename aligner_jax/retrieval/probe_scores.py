"""WARP's candidate scoring, compiled: every token of a query token's probed clusters scored
with its residual, q_i·(c + r̂), each document's best per query token, summed over query tokens
against their imputed scores (``centroid_search``'s ``residual_candidates`` and ``xtr``).

For query token i with weight w_i, probed clusters P_i and imputed score m_i (its first unprobed
centroid's score, WARPSELECT, for the XTR scorer; a deeper centroid's for Eq. 1–2's candidates:
``centroid_search.probed``, ``CentroidSearchConfig.impute_depth``), a document d reached by i gets

  acc[d] += w_i · (max_{j ∈ d, code_j ∈ P_i} q_i·(c_j + r̂_j) − m_i)

so that (Σ_i w_i·m_i + acc[d]) / Σ_i w_i is Eq. 1–2's top-1 score with the unreached query
tokens imputed (all w = 1: f_XTR′, XTR Eq. 4). q_i·r̂_j is read from the packed levels without
decoding (``codec.ResidualCodec``: q·r̂ = constant + Σ_p Σ_b (q⊙step)_{p,b}·level_{p,b}).

NumPy does this one query token at a time (a ``[rows, W] @ [W, 1]`` product per plane, then
``np.maximum.at``), and those passes, not the arithmetic, were most of the search: the compiled
loop reads each probed token's packed row once and keeps nothing per token (``residual_candidates``
with ``refine_per_k=1``, k = 100, 2 threads: SciFact zero-shot 34.2 → 25.0 ms p50, CISI
zero-shot 61.4 → 32.0 ms; ``benchmarks/results/query_path_ab_probe_scores.md``). A row's sum
runs in int32 over int16 weights (``ResidualCodec.integer_query_terms``), which the CPU does in
vector instructions where the float32 sum stayed scalar: the whole search 1.03–1.48× faster at
the same rankings (``benchmarks/results/query_path_ab_probe_int16.md``). Without
numba, ``centroid_search`` keeps its NumPy loop in float32 (the same values up to the weights'
int16 rounding, about 1e-6 for unit queries).

**Threads.** The query tokens are independent until their sums meet in ``acc``: with ``threads``
> 1 they are cut into that many contiguous groups, the first scored on the calling thread into
the caller's arrays, each other on a worker thread (the compiled pass releases the GIL) into
per-document arrays the calling thread keeps for that group (``_group_arrays``), which are then
added in, group by group, at the documents they reached. A document's sum then adds the groups' partial sums, so the scores
of 1 and of 2 threads can differ in the last bits (SciFact and CISI zero-shot, every test query:
the same top 100 in the same order, scores at most 1.2e-7 apart; stage 2 at 2 threads took 4.7–5.0
against 8.2–8.4 ms per SciFact query: ``benchmarks/results/README.md``, stop 48).
"""

from __future__ import annotations

import threading

import numpy as np

from aligner_jax.common import scratch, workers
from aligner_jax.indexing.codec import ResidualCodec

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; kept for hosts without it
    numba = None

TOUCH_ROWS = 64  # scattered rows of lists by position brought in at once (32-256: the same)
# documents whose per-document state stage 2 visits at a time (16k-128k: the same)
TILE_DOCS = 32_768


def _sums(packed, rows, indirect, lo, first, stop, w, bits, sums):  # pragma: no cover
    """``sums[r]`` = Σ_p Σ_b w[p, b] · level_{p, b} of packed row ``lo + r`` (row
    ``rows[lo + r]`` when ``indirect``: the lists by position), for ``first`` ≤ r <
    ``stop`` (``bits`` 2, 4 or 8: 4, 2 or 1 planes), an integer sum with int16 weights
    (``ResidualCodec.integer_query_terms``, which keeps it within int32): each level is taken
    as an int16, so that the loop over a row's bytes vectorises (the same sum in float32
    stayed scalar). One pass over a row's bytes reads all its planes; the planes' weights are
    taken once per call."""
    if bits == 4:
        w0, w1 = w[0], w[1]
        for r in range(first, stop):
            row = packed[rows[lo + r]] if indirect else packed[lo + r]
            s = np.int32(0)
            for b in range(len(row)):
                v = np.int16(row[b])
                s += np.int32(w0[b]) * np.int32(v & np.int16(15)) + np.int32(w1[b]) * np.int32(
                    v >> np.int16(4)
                )
            sums[r] = s
    elif bits == 2:
        w0, w1, w2, w3 = w[0], w[1], w[2], w[3]
        for r in range(first, stop):
            row = packed[rows[lo + r]] if indirect else packed[lo + r]
            s = np.int32(0)
            for b in range(len(row)):
                v = np.int16(row[b])
                s += (
                    np.int32(w0[b]) * np.int32(v & np.int16(3))
                    + np.int32(w1[b]) * np.int32((v >> np.int16(2)) & np.int16(3))
                    + np.int32(w2[b]) * np.int32((v >> np.int16(4)) & np.int16(3))
                    + np.int32(w3[b]) * np.int32(v >> np.int16(6))
                )
            sums[r] = s
    else:
        w0 = w[0]
        for r in range(first, stop):
            row = packed[rows[lo + r]] if indirect else packed[lo + r]
            s = np.int32(0)
            for b in range(len(row)):
                s += np.int32(w0[b]) * np.int32(np.int16(row[b]))
            sums[r] = s


def _touch(packed, rows, lo, first, stop, sums, sink):  # pragma: no cover - compiled
    """Reads one byte of every cache line of rows ``rows[lo + first : lo + stop]`` (their sum
    kept in ``sums[sink]``, so that the reads stay): a loop of independent loads, whose misses
    the CPU serves many at a time, where the arithmetic between one row's reads and the next's
    lets it serve about one. A row's first and last bytes are read outright, a loop only for
    the lines between (rows of more than 64 bytes): with the first line's read inside that loop
    too, a row of 32 bytes took a loop of one turn per row, and those loops, not the reads,
    held back the loads (the scattered rows of SciFact grown 100×, trained, 2 bits: touched and
    scored in 26–30 against 14–16 ms per query, one thread; ``benchmarks/query_path_ab.py``'s
    ``touch_lines``)."""
    last = packed.shape[1] - 1
    t = np.uint8(0)
    for r in range(first, stop):
        j = rows[lo + r]
        t ^= packed[j, 0]
        for b in range(64, last, 64):
            t ^= packed[j, b]
        t ^= packed[j, last]
    sums[sink] = t


def _run_sums(packed, rows, lo, length, w, bits, sums):  # pragma: no cover - compiled
    """``sums[r]`` for the ``length`` rows of a run (``_sums``): read where they lie, or,
    for lists by position (``rows`` not empty: row ``rows[lo + r]``, scattered over the
    index's map), ``TOUCH_ROWS`` at a time, each block's lines first brought in by
    ``_touch`` (``sums`` holds ``length + 1`` entries). Scoring the scattered rows directly
    took 4-6× as long as touched first (SciFact zero-shot grown 10×, 2 bits, ~450k rows of
    96 bytes: ``benchmarks/results/query_path_ab_touch_stop73.md``)."""
    if len(rows) == 0:
        _sums(packed, rows, False, lo, 0, length, w, bits, sums)
        return
    for first in range(0, length, TOUCH_ROWS):
        stop = min(first + TOUCH_ROWS, length)
        _touch(packed, rows, lo, first, stop, sums, length)
        _sums(packed, rows, True, lo, first, stop, w, bits, sums)


def _accumulate(
    where, top_scores, starts, lengths, packed, rows, docs, planes, scale, constant, bits,
    weights, imputed, floor, acc, seen, touched, sums,
):  # pragma: no cover - compiled  # fmt: skip
    """For each query token i and each of its probed clusters ``where[i, a]`` (rows
    ``starts[c] : starts[c] + lengths[c]`` of ``packed``/``docs``, of ``rows``/``docs`` when
    ``rows`` is not empty, ``packed`` then read at ``rows``): the best score per document
    (``top_scores[i, a] + constant[i] + scale[i]·`` the row's integer sum, ``planes`` int16),
    kept in ``floor`` (−∞ on entry and on exit), then ``acc[d] += weights[i] · (best −
    imputed[i])`` and ``seen[d] = True`` for each document it reached. Returns the number of
    list entries found outside the documents of their tile (0 unless a list is out of order).

    A cluster's rows are scored first, into ``sums`` (a loop of arithmetic only), then its
    documents are visited: kept apart, the row sums vectorise and the documents' scattered
    reads overlap one another. One loop doing both made the whole search 1.06–1.20× slower at
    k = 10, the same rankings (``benchmarks/results/query_path_ab_probe_split.md``, SciFact
    and CISI; ``query_path_ab_x100_stop68.md``, SciFact grown 100×: 1.17× at k = 100).

    **Tiles.** The documents are taken ``TILE_DOCS`` at a time, every query token's probed
    clusters read in each tile only as far as its documents (a list holds its documents in
    store order, ``inverted_lists.TokenLists``: one cursor per cluster and query token, moved
    on by a binary search), so that the per-document arrays a tile visits stay in the core's
    cache; a document's sums are added in the same order as without tiles (the same
    floats). SciFact trained grown 100× (518,300 documents, 61 % of them reached by a k = 100
    query): the whole search 1.17× as fast at k = 100, the same rankings
    (``benchmarks/results/query_path_ab_tiles_stop77.md``)."""
    n, p = where.shape
    num_docs = len(floor)
    cursor = np.empty((n, p), np.int64)
    for i in range(n):
        for a in range(p):
            cursor[i, a] = starts[where[i, a]]
    stray = 0
    for first_doc in range(0, num_docs, TILE_DOCS):
        end_doc = first_doc + TILE_DOCS
        for i in range(n):
            m = 0
            w = planes[i]
            step = scale[i]
            for a in range(p):
                c = where[i, a]
                lo = cursor[i, a]
                end = starts[c] + lengths[c]
                length = end - lo
                if end_doc < num_docs and length > 0:
                    length = np.searchsorted(docs[lo:end], end_doc)  # this tile's part
                if length == 0:
                    continue
                cursor[i, a] = lo + length
                base = top_scores[i, a] + constant[i]
                _run_sums(packed, rows, lo, length, w, bits, sums)
                for r in range(length):
                    value = base + step * np.float32(sums[r])
                    d = docs[lo + r]
                    stray += (d < first_doc) | (d >= end_doc)
                    best = floor[d]
                    touched[m] = d
                    m += best == -np.inf  # the first time this query token reaches d
                    floor[d] = value if value > best else best
            for t in range(m):
                d = touched[t]
                acc[d] += weights[i] * (floor[d] - imputed[i])
                seen[d] = True
                floor[d] = -np.inf
    return stray


if numba is not None:
    # no "ninf"/"nnan" fast-math flags: the loop compares with −∞
    _FLAGS = {"reassoc", "contract"}
    _sums = numba.njit(inline="always", nogil=True, fastmath=_FLAGS)(_sums)
    _touch = numba.njit(inline="always", nogil=True)(_touch)
    _run_sums = numba.njit(inline="always", nogil=True, fastmath=_FLAGS)(_run_sums)
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
    threads: int = 1,
    rows: np.ndarray | None = None,
) -> None:
    """Adds each query token's best probed score per document (minus its imputed score, times
    its weight) into ``acc`` and marks ``seen``, in place (see the module docstring).

    ``codec``: the index's ``ResidualCodec``; ``queries`` ``[n, D]`` the probing query tokens;
    ``where`` ``[n, p]`` each token's probed clusters as indices into ``starts``/``lengths``
    (the clusters' rows of ``packed [R, W]`` and ``docs [R]``, int32 or int64: the token
    lists' own arrays, read where they lie); ``top_scores`` ``[n, p]``
    their centroid scores; ``floor`` ``[num_docs]`` float32, −∞ everywhere (left so).
    ``threads``: query-token groups scored at once (see the module docstring). ``rows``: the
    lists by position (``inverted_lists.TokenLists.rows``): entry j's residual is then
    ``packed[rows[j]]``, ``packed`` the index's segment in store order.

    Raises ``ValueError`` (``acc`` and ``seen`` left clear) where a list's documents are not
    in store order: the pass reads them tile by tile (``_accumulate``)."""
    planes, scale, constant = codec.integer_query_terms(queries)
    n = len(constant)
    probed = np.asarray(lengths)[np.asarray(where)] if np.size(where) else np.zeros(1, np.int64)
    longest = max(int(probed.max()), 1)  # rows of the longest probed cluster
    shared = (
        np.ascontiguousarray(starts, np.int64),
        np.ascontiguousarray(lengths, np.int64),
        np.ascontiguousarray(packed, np.uint8),
        _NO_ROWS if rows is None else np.ascontiguousarray(rows),  # int32 below 2³¹ rows
        np.ascontiguousarray(docs),  # int32 or int64, as the token lists hold them
    )
    per_token = (
        np.ascontiguousarray(where, np.int64),
        np.ascontiguousarray(top_scores, np.float32),
        np.ascontiguousarray(planes),
        scale,
        np.ascontiguousarray(constant, np.float32),
        np.ascontiguousarray(weights, np.float32),
        np.ascontiguousarray(imputed, np.float32),
    )

    def run(lo: int, hi: int, out: tuple) -> int:
        where_, scores_, planes_, scale_, constant_, weights_, imputed_ = (
            a[lo:hi] for a in per_token
        )
        touched = scratch.buffer("probe_scores.touched", (max(len(out[0]), 1),), np.int64)
        sums = scratch.buffer("probe_scores.sums", (longest + 1,), np.int32)
        return _accumulate(
            where_, scores_, *shared, planes_, scale_, constant_, codec.bits, weights_, imputed_,
            *out, touched, sums,
        )  # fmt: skip

    bounds = np.linspace(0, n, min(max(threads, 1), max(n, 1)) + 1).astype(int)
    if len(bounds) <= 2:
        stray = run(0, n, (floor, acc, seen))
    else:
        extra = _group_arrays(len(floor), len(bounds) - 2)
        pool = workers.pool(len(extra))
        futures = [
            pool.submit(run, lo, hi, out)
            for lo, hi, out in zip(bounds[1:-1], bounds[2:], extra, strict=True)
        ]
        stray = run(0, bounds[1], (floor, acc, seen))
        for future, (_, part, reached) in zip(futures, extra, strict=True):
            stray += future.result()  # in group order: the same sums whatever finishes first
            _add_group(acc, seen, part, reached)
    if stray:  # a list not in store order (its documents' sums are wrong): none kept
        acc[:] = 0.0
        seen[:] = False
        raise ValueError(f"{stray} token-list entries out of store order (rebuild the index)")


def _add_group(acc, seen, part, reached) -> None:
    """Adds a worker group's sums ``part`` at the documents it ``reached`` into the caller's
    ``acc`` and ``seen``, and clears the group's arrays (as ``_group_arrays`` hands them out):
    at those documents only, or over every document where it reached more than one in
    ``scratch.DENSE_SHARE`` (adding the zeros elsewhere changes nothing)."""
    if scratch.dense(np.count_nonzero(reached), len(acc)):
        np.add(acc, part, out=acc)
        np.logical_or(seen, reached, out=seen)
        part.fill(0)
        reached.fill(False)
        return
    hit = np.flatnonzero(reached)
    acc[hit] += part[hit]
    seen[hit] = True
    scratch.clear((part, reached), hit)


_CALLER = threading.local()
_NO_ROWS = np.zeros(0, np.int32)  # the lists hold their residuals (entry j: packed row j)


def _group_arrays(num_docs: int, groups: int) -> list[tuple]:
    """The calling thread's (floor −∞, acc 0, seen False) per document for each of ``groups``
    query-token groups scored on workers, kept so between calls (``accumulate`` waits for its
    workers and resets what they touched, so no other call shares them)."""
    arrays = getattr(_CALLER, "arrays", [])
    if arrays and len(arrays[0][0]) != num_docs:
        arrays = []
    while len(arrays) < groups:
        arrays.append(
            (
                np.full(num_docs, -np.inf, np.float32),
                np.zeros(num_docs, np.float32),
                np.zeros(num_docs, bool),
            )
        )
    _CALLER.arrays = arrays
    return arrays[:groups]


def warm_up() -> None:
    """Compiles the pass now (or loads it from numba's cache), so that the first search after
    ``Searcher.load`` does not pay for it. A no-op without numba."""
    if numba is None:
        return
    codec = ResidualCodec(4, np.zeros(2, np.float32), np.ones(2, np.float32))
    one = np.zeros(1, np.int64)
    floor = np.full(1, -np.inf, np.float32)
    # the token lists' documents: int32 below 2³¹ (lists by position share the signature of
    # lists holding their residuals: int32 rows, empty for those; int64 rows compile on use)
    for docs in (one.astype(np.int32), one):
        accumulate(
            codec, np.zeros((1, 2), np.float32), np.zeros((1, 1), np.int64), np.zeros((1, 1)),
            one, one + 1, np.zeros((1, 1), np.uint8), docs, np.ones(1), np.zeros(1), floor,
            np.zeros(1, np.float32), np.zeros(1, bool),
        )  # fmt: skip
