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

**Threads.** A document's sums are its own: with ``threads`` > 1 the documents are cut into
tiles (``_accumulate``) and each thread scores every ``threads``-th tile, the first on the
calling thread, the others on the process's workers (the compiled pass releases the GIL), all
into the caller's arrays, which no two threads write at the same document. A document's sums
are added in the same order whatever the thread count: 1 and 2 threads give the same floats.
Before stop 78 the query tokens were cut into groups instead, each worker's into per-document
arrays of its own then added in: stage 2's pass 17.0 → 14.3 ms p50 per k = 100 query on
SciFact grown 100× (60 captured queries, caches evicted between calls), the whole search
1.07× as fast at k = 10 and 1.05× at k = 100, 0.99–1.00× at 1×
(``benchmarks/results/stop78/query_path_ab_tile_threads*.md``).
"""

from __future__ import annotations

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
MIN_TILE_DOCS = 1024  # ... fewer in a small collection, so that each thread has a tile to score


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
    weights, imputed, floor, acc, seen, touched, sums, tile_docs, part, parts,
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

    **Tiles.** The documents are taken ``tile_docs`` at a time, every query token's probed
    clusters read in each tile only as far as its documents (a list holds its documents in
    store order, ``inverted_lists.TokenLists``: one cursor per cluster and query token, moved
    on by a binary search), so that the per-document arrays a tile visits stay in the core's
    cache; a document's sums are added in the same order as without tiles (the same
    floats). SciFact trained grown 100× (518,300 documents, 61 % of them reached by a k = 100
    query): the whole search 1.17× as fast at k = 100, the same rankings
    (``benchmarks/results/query_path_ab_tiles_stop77.md``). This call scores the tiles
    ``part``, ``part + parts``, ... (one of ``parts`` threads); every list is cut at the same
    tile bounds in every call, so that the parts cover each entry once."""
    n, p = where.shape
    num_docs = len(floor)
    cursor = np.empty((n, p), np.int64)
    for i in range(n):
        for a in range(p):
            cursor[i, a] = starts[where[i, a]]
    stray = 0
    for first_doc in range(0, num_docs, tile_docs):
        end_doc = first_doc + tile_docs
        mine = (first_doc // tile_docs) % parts == part
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
                if not mine:  # another thread's tile: its cursor moved on, nothing scored
                    continue
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
    ``threads``: document tiles scored at once (see the module docstring). ``rows``: the
    lists by position (``inverted_lists.TokenLists.rows``): entry j's residual is then
    ``packed[rows[j]]``, ``packed`` the index's segment in store order.

    Raises ``ValueError`` (``acc`` and ``seen`` left clear) where a list's documents are not
    in store order: the pass reads them tile by tile (``_accumulate``)."""
    planes, scale, constant = codec.integer_query_terms(queries)
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

    num_docs = len(floor)
    parts = max(min(max(threads, 1), -(-num_docs // MIN_TILE_DOCS)), 1)
    tile_docs = tile_size(num_docs, parts)

    def run(part: int) -> int:
        touched = scratch.buffer("probe_scores.touched", (max(num_docs, 1),), np.int64)
        sums = scratch.buffer("probe_scores.sums", (longest + 1,), np.int32)
        return _accumulate(
            *per_token[:2], *shared, *per_token[2:5], codec.bits, *per_token[5:], floor, acc,
            seen, touched, sums, tile_docs, part, parts,
        )  # fmt: skip

    futures = [workers.pool(parts - 1).submit(run, part) for part in range(1, parts)]
    stray = run(0)
    stray += sum(future.result() for future in futures)
    if stray:  # a list not in store order (its documents' sums are wrong): none kept
        acc[:] = 0.0
        seen[:] = False
        raise ValueError(f"{stray} token-list entries out of store order (rebuild the index)")


def tile_size(num_docs: int, parts: int = 1) -> int:
    """Documents per tile of stage 2's pass: ``TILE_DOCS``, or fewer where that would leave one
    of ``parts`` threads without a tile (at least ``MIN_TILE_DOCS``): every tile cuts each
    probed list once more, which costs where the lists are short (the trained SciFact store at
    1×, 5,183 documents, interleaved: four tiles per thread 0.96× as fast at k = 10, one run
    whose output the rerun with one per thread overwrote, 0.99×:
    ``benchmarks/results/stop78/query_path_ab_tile_threads_x1_stop78.md``)."""
    even = -(-num_docs // parts) if parts > 1 else TILE_DOCS
    return int(min(TILE_DOCS, max(MIN_TILE_DOCS, even)))


_NO_ROWS = np.zeros(0, np.int32)  # the lists hold their residuals (entry j: packed row j)


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
