r"""Thirty query-path changes measured against the code they replaced, interleaved per query.

  .venv/bin/python benchmarks/query_path_ab.py \
      [--stores=scifact:outputs/zero_shot_scifact/index,cisi:outputs/zero_shot_cisi/index]

The machine is shared and its speed drifts 2–5× over hours, so each change is timed against its
predecessor in one process, alternating which goes first query by query, over ``--rounds``
timed passes (after one untimed pass), at ``--threads`` BLAS threads. The predecessors are kept
here, verbatim in behaviour, only to be measured against:

  * ``by_position`` (``inverted_lists.token_rows_in_memory``, stop 73): residual candidates
    reading the token lists by position (each entry's document and row: 8 bytes per kept
    token, the residual read from the index's map where it lies) — against the copy of every
    kept token's residual in cluster order (the lists a search built at load while they fit
    in ``LISTS_IN_MEMORY_MAX``). The price of the scattered reads: what a search pays past
    that size, where it ranked by centroid scores before. Timed: ``CentroidSearcher`` queries
    with ``residual_candidates=True``, as ``probe_scores``' (the same rankings).
  * ``float_all`` (``centroid_search.REFINE_FLOAT``, ``REFINE_FLOAT_MAX``, stop 79): a model
    with saliences re-scores every refined document from the store's float vectors (3·k, at
    most 300), so that the compressed pass of stage 4 is not run — against the best 2·k (at
    most 200) of that pass re-scored (``refine_float`` 2, ``refine_float_max`` 200: the search
    before). Timed: ``CentroidSearcher`` queries at the defaults at k = 10 and k = 100
    (rankings may differ; a model without saliences has no float refinement: the same).
  * ``tile_threads`` (``probe_scores.accumulate``, stop 78): stage 2's threads each scoring
    every ``threads``-th tile of documents into the caller's arrays — against cutting the
    query tokens into groups, each worker's scored into arrays of its own and added in
    afterwards (stop 77's ``accumulate`` and pass, verbatim: ``grouped_accumulate``,
    ``grouped_kernel``). Timed: ``CentroidSearcher`` queries at the defaults at k = 10 and
    k = 100 (scores may differ in the last bits: the groups' sums met in another order). Since
    then each earlier change's ``before`` runs on ``grouped_accumulate`` with its kept pass.
  * ``light`` (``CentroidSearchConfig.light_share``, stop 78): the lightest query tokens,
    together at most ``LIGHT_SHARE`` of the query's u^q, left out of stages 2–4's compressed
    scoring (the float refinement still counts them) — against every token of weight > 0
    taking part (``light_share`` = 0: the search before). Timed: ``CentroidSearcher`` queries
    at the defaults at k = 10 and k = 100 (a model with saliences; rankings may differ).
  * ``dense_clear`` (``scratch.clear``, ``probe_scores._add_group``, stop 77): stage 2's
    per-document arrays added and cleared over every document where more than one in
    ``scratch.DENSE_SHARE`` was reached — against at the reached documents only, whatever
    their share (``DENSE_SHARE`` = 0: the code before, but for one count; since stop 78
    stage 2 adds no groups, and the pair times ``CentroidSearcher._reached``'s clearing). Timed:
    ``CentroidSearcher`` queries at the defaults at k = 10 and k = 100, the same rankings.
  * ``tiles`` (``probe_scores._accumulate``, stop 77): stage 2's compiled pass taking the
    documents ``TILE_DOCS`` at a time, each probed list read per tile only as far as the
    tile's documents, so that the per-document arrays it visits stay in the core's cache —
    against one pass over each list whole (stop 76's ``_accumulate``, verbatim:
    ``untiled_accumulate``). Timed: ``CentroidSearcher`` queries at the defaults at k = 10 and
    k = 100, the same rankings (on a store of many tiles: SciFact grown 100×).
  * ``touch_lines`` (``probe_scores._touch``, stop 75): each scattered row's first and last
    bytes read outright, a loop only over the lines between — against a loop over a row's
    lines that read the first one too (stop 73's ``_touch``, verbatim: one turn per row of 32
    bytes). Timed: ``CentroidSearcher`` queries at the defaults, on an index whose search reads
    the lists by position (past ``LISTS_IN_MEMORY_MAX``: SciFact grown 100×), the same rankings.
  * ``touch`` (``probe_scores._run_sums``, stop 73): the lists by position read
    ``TOUCH_ROWS`` scattered rows at a time, each block's cache lines brought in by a loop of
    independent loads before its rows are scored (``_touch``) — against scoring each
    scattered row as it is read (stop 73's first lists by position, verbatim). Timed: as
    ``by_position``, on the lists by position (the same rankings).
  * ``rows_branch`` (``probe_scores._accumulate``, stop 73): the compiled pass that also reads
    lists by position (a ``rows`` argument, empty for lists holding their residuals) —
    against the pass before it, verbatim. Timed: as ``by_position``, on lists holding their
    residuals (the copy): what the change costs the searches it does not serve.
  * ``residual_default`` (``CentroidSearchConfig.decided``, stop 73): the default search of
    an index whose token lists are neither held nor copied (past ``LISTS_IN_MEMORY_MAX``),
    residual candidates by position — against ranking its candidates by centroid scores
    (``residual_candidates=False``), the default there before. For quality at scale: the pair
    prices it (rankings differ). Timed: searches at the defaults at k = 10 and k = 100.
  * ``at_best`` (``gather_max.tokens_at_best``): the residual interaction's choice of tokens
    (those whose centroid scores reach their document's best for some query token) in one
    compiled pass — against gathering the ``[rows, n]`` centroid scores and comparing them
    whole (``centroid_search._at_best``), the code before it. Timed: ``CentroidSearcher``
    queries on the centroid-interaction path (``residual_candidates=False``: the default
    where the token lists do not fit in memory) at k = 10 and k = 100.
  * ``gather_max`` (``retrieval/gather_max.py``): stages 3–4's centroid-score gather, residual
    sum and per-document maxima in one compiled pass — against its NumPy path (``np.take``, the
    sum, ``segment_max``), the code before it. Timed: ``CentroidSearcher`` queries at k = 10
    and k = 100 (query encoding excluded).
  * ``select_ties`` (``centroid_search._best``, stop 70): only the scores strictly above the
    sampled threshold partitioned, and none when the m-th largest is the threshold itself
    (the scores above it and the first of those equal to it) — against partitioning every
    score that reaches the threshold, ties at it included (stop 69's ``_best``, kept here as
    ``inclusive_best``). Timed: ``CentroidSearcher`` queries at the defaults at k = 10 and
    k = 100 (query encoding excluded).
  * ``probe_select`` (``retrieval/probe_select.py``, ``centroid_search.probed``, stop 70):
    each query token's probed centroids and imputed score selected in one compiled pass over
    Sᵀ ``[C, n]`` in memory order — against copying the query tokens' rows of S out of Sᵀ and
    selecting from them with block maxima and partitions (``top_columns``), the code before
    it (the NumPy path it keeps without numba). Timed: ``CentroidSearcher`` queries at the
    defaults at k = 10 and k = 100 (query encoding excluded).
  * ``select`` (``centroid_search._best``/``_top``, ``CentroidSearcher.search``, stop 69): the
    m best of stage 2's scores selected among those above a threshold estimated from a strided
    sample, and the reached documents outside stage 3 set apart only when the ranking reaches
    them (fewer documents in stage 3 than k) — against a partition of every score and that
    tail built for every query, the code before it. Timed: ``CentroidSearcher`` queries at the
    defaults at k = 10 and k = 100 (query encoding excluded).
  * ``store_reads`` (``TokenStore.concatenated``, stop 68): a store of more shards than its
    map cache holds read without ``merged_runs`` for a lone document of a shard and through
    a bare descriptor (``os.open``, its path kept) — against NumPy run merging for every shard
    and a Python file object per read, the code before it. Timed: ``CentroidSearcher``
    queries at the defaults (the float refinement reads the store) at k = 10 and k = 100, on a
    store of over 96 shards (SciFact grown 100×).
  * ``probe_split`` (``retrieval/probe_scores.py``, stop 68): stage 2's compiled pass scoring
    each probed cluster's rows into a buffer first, then folding them into their documents'
    maxima — against scoring and folding each row in one loop, the code before it. Timed:
    ``CentroidSearcher`` queries at the defaults at k = 10 and k = 100 (query encoding
    excluded).
  * ``probe_int16`` (``retrieval/probe_scores.py``): stage 2's compiled pass with the plane
    weights rounded to int16 and each row's sum in int32 (it vectorises) — against the same pass
    in float32 (scalar), the code before it, given the same rounded weights. Timed:
    ``CentroidSearcher`` queries at the defaults (residual candidates where the token lists
    fit) at k = 10 and k = 100 (query encoding excluded).
  * ``probe_scores`` (``retrieval/probe_scores.py``): WARP's candidate scoring (every token of
    each query token's probed clusters scored with its residual, per-document maxima) in one
    compiled pass — against its NumPy loop (a product per plane and query token, then
    ``np.maximum.at``), the code before it. Timed: ``CentroidSearcher`` queries with
    ``residual_candidates=True`` and ``--residual_candidates_refine_per_k`` at k = 10 and
    k = 100 (query encoding excluded).
  * ``cluster_residuals`` (``CentroidSearcher.token_lists``): the probed clusters' packed
    residuals read where they lie, one run per cluster of a cluster-ordered copy — against a
    gather of the union of their rows from the index's store order (fancy indexing, as
    ``Segmented`` read rows before), the code before it. Timed: ``CentroidSearcher`` queries
    with ``residual_candidates=True``, as ``probe_scores``'.
  * ``residual_chunk`` (``indexing/codec.py``'s ``CHUNK``): the compressed refinement's
    residual scores computed 2,048 tokens at a time — against 16,384 at a time. Timed:
    ``CentroidSearcher`` queries at the defaults, k = 10 and k = 100.
  * ``segment_max`` (``retrieval/centroid_search.py``), timed on that NumPy path (the compiled
    pass replaced it in the default search): per-document maxima of ``[tokens, n]``
    similarities through transposed blocks, and u^d of the selected token (Eq. 2) in the same
    pass — against ``np.maximum.reduceat`` along axis 0 and a ``[tokens, n]`` tie mask. Timed:
    ``CentroidSearcher`` queries at k = 10 and k = 100 (query encoding excluded).
  * ``host_top1`` (``RefineConfig.host_top1``, ``centroid_search.stored_top1_scores``): top-1
    alignment from the float store without JAX (a BLAS product and a compiled maximum per chunk
    of store rows) — against the JAX kernel over padded length buckets, the code before it.
    Timed: the exhaustive searcher (``mode="exhaustive"``) at k = 100, and ``Searcher.rerank``
    of each query's ``--rerank_candidates`` best documents.
  * ``rescore`` (``CentroidSearchConfig.rescore_per_refine``, stop 61): stage 3's residual
    interaction over stage 2's best 3 × ``refine_docs`` documents before they are refined, at
    k ≥ 100 — against refining stage 2's best directly, the search before it. A stage added for
    recall, not a faster path: the pair prices it (its rankings differ by design). Timed:
    ``CentroidSearcher`` queries at k = 10 and k = 100.
  * ``means`` (``CentroidSearchConfig.mean_weight``, stop 64): stage 2's best 3,000 documents
    scored also by their mean vector (q̄·m_d, ``CentroidSearcher.with_means``) — against stage
    2's estimate alone, the search before it. For quality at scale, not speed: the pair prices
    it (rankings may differ). Timed: ``CentroidSearcher`` queries at k = 10 and k = 100 (an
    index built with ``CentroidIndexConfig.doc_means``).
  * ``fill`` (``CentroidSearchConfig.fill_docs``, stop 65): stage 2's best documents count,
    for each query token that did not reach them, their best centroid score instead of the
    imputed one (``CentroidSearcher.with_centroid_terms``) — against the imputed terms, the
    search before it. For quality at scale: the pair prices it (rankings may differ). Timed:
    ``CentroidSearcher`` queries at k = 10 and k = 100.
  * ``reach_linear`` (``centroid_search.reach_factor``, stop 76): past 51,830 documents a
    query token reaches N / 51,830 times as many documents at k ≥ 100 (√ at k ≤ 10, in
    between interpolated) — against √(N / 51,830) at every k (stop 65's rule, verbatim:
    ``sqrt_reach_factor``). For recall at scale: the pair prices it (rankings differ at
    k = 100). Timed: ``CentroidSearcher`` queries at k = 10 and k = 100 (on a store that large).
  * ``reach`` (``centroid_search.reach_factor``, stop 65): past 51,830 documents a query
    token reaches √(N / 51,830) times as many documents (more probes) — against the fixed
    reach before it. For recall at scale: the pair prices it (rankings differ). Timed:
    ``CentroidSearcher`` queries at k = 10 and k = 100 (on a store that large).
  * ``TokenStore.gather_padded``: one slice copy per document — against a fancy index over
    every row. Timed: ``Searcher.rerank`` of each query's ``--rerank_candidates`` best documents.
  * ``DocumentTable.fetch``: the wanted (shard, slot) pairs joined to the table through its
    primary key — against a row-value ``IN (VALUES ...)``, which SQLite answers with a scan of
    the table. Timed: fetching each query's 10 best documents (title, text, metadata).

Every pair of results is compared (rankings, scores within 1e-5, fetched rows): the count of
identical ones is in the output. Writes ``benchmarks/results/--output_name.{json,md,png}``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pathlib
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence

from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import threadpoolctl  # noqa: E402

from aligner_jax.common import cli, fileio, half, scratch, workers  # noqa: E402
from aligner_jax.data import beir  # noqa: E402
from aligner_jax.indexing import centroid_index as ci  # noqa: E402
from aligner_jax.indexing import codec as codec_lib  # noqa: E402
from aligner_jax.indexing import documents as documents_lib  # noqa: E402
from aligner_jax.indexing import token_store as ts  # noqa: E402
from aligner_jax.indexing.inverted_lists import concatenated_ranges  # noqa: E402
from aligner_jax.retrieval import centroid_search as cs  # noqa: E402
from aligner_jax.retrieval import gather_max, probe_scores, probe_select  # noqa: E402
from aligner_jax.retrieval import searcher as search_lib  # noqa: E402

FLAGS = flags.FLAGS


# -- the predecessors ------------------------------------------------------------------------------
def reduceat_segment_max(values, lengths, at_max=None):
    """``segment_max`` before: ``np.maximum.reduceat`` along axis 0, a ``[T, n]`` tie mask."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    best = np.maximum.reduceat(values, starts, axis=0)
    if at_max is None:
        return best
    equal, chosen = cs._at_document_rows(values, best, lengths)  # scratch buffers, as before
    chosen.fill(-np.inf)
    np.copyto(chosen, at_max[:, None], where=equal)
    return best, np.maximum.reduceat(chosen, starts, axis=0)


def _float_row_score(row, w, bits):  # pragma: no cover - compiled
    """``probe_scores._row_score`` before, in float32: Σ_p Σ_b w[p, b] · level_{p, b} of one packed row (``bits`` 2, 4 or 8: 4, 2 or 1
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


def _counts_no_strays(kernel):
    """A kept pass under today's call, which returns the count of list entries out of store
    order (``probe_scores._accumulate``): these read each list whole and count none."""

    def call(*args):
        kernel(*args)
        return 0

    call.__doc__ = kernel.__doc__
    return call


def _float_accumulate(
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
                value = base + _float_row_score(packed[r], w, bits)
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


if probe_scores.numba is not None:
    _FLOAT_FLAGS = {"reassoc", "contract"}
    _float_row_score = probe_scores.numba.njit(inline="always", nogil=True, fastmath=_FLOAT_FLAGS)(
        _float_row_score
    )
    _float_accumulate = probe_scores.numba.njit(nogil=True, fastmath=_FLOAT_FLAGS)(
        _float_accumulate
    )


@_counts_no_strays
def float_accumulate(
    where, top_scores, starts, lengths, packed, rows, docs, planes, scale, constant, bits,
    weights, imputed, floor, acc, seen, touched, sums=None,
):  # fmt: skip
    """``probe_scores._accumulate`` before: the float32 pass, on the int16 weights times their
    scale (the rounded weights: the same sums up to float rounding); lists holding residuals
    only (``rows`` empty)."""
    assert not len(rows)
    float_planes = planes.astype(np.float32) * scale[:, None, None]
    _float_accumulate(
        where, top_scores, starts, lengths, packed, docs, float_planes, constant, bits, weights,
        imputed, floor, acc, seen, touched,
    )  # fmt: skip


def _joint_row_score(row, w, bits):  # pragma: no cover - compiled
    """``probe_scores``' row sum before stop 68, verbatim: Σ_p Σ_b w[p, b] · level_{p, b} of
    one packed row in int32 with int16 weights, each level cast from an int32."""
    s = np.int32(0)
    if bits == 4:
        w0, w1 = w[0], w[1]
        for b in range(len(row)):
            v = np.int32(row[b])
            s = np.int32(s + np.int32(np.int32(w0[b]) * (v & 15)))
            s = np.int32(s + np.int32(np.int32(w1[b]) * (v >> 4)))
    elif bits == 2:
        w0, w1, w2, w3 = w[0], w[1], w[2], w[3]
        for b in range(len(row)):
            v = np.int32(row[b])
            s = np.int32(s + np.int32(np.int32(w0[b]) * (v & 3)))
            s = np.int32(s + np.int32(np.int32(w1[b]) * ((v >> 2) & 3)))
            s = np.int32(s + np.int32(np.int32(w2[b]) * ((v >> 4) & 3)))
            s = np.int32(s + np.int32(np.int32(w3[b]) * (v >> 6)))
    else:
        w0 = w[0]
        for b in range(len(row)):
            s = np.int32(s + np.int32(np.int32(w0[b]) * np.int32(row[b])))
    return s


def _joint_accumulate(
    where, top_scores, starts, lengths, packed, docs, planes, scale, constant, bits, weights,
    imputed, floor, acc, seen, touched, sums=None,
):  # pragma: no cover - compiled  # fmt: skip
    """``probe_scores._accumulate`` before stop 68: each row scored and folded into its
    document's best in one loop (``sums`` unused)."""
    n, p = where.shape
    for i in range(n):
        m = 0
        w = planes[i]
        step = scale[i]
        for a in range(p):
            c = where[i, a]
            base = top_scores[i, a] + constant[i]
            for r in range(starts[c], starts[c] + lengths[c]):
                value = base + step * np.float32(_joint_row_score(packed[r], w, bits))
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


if probe_scores.numba is not None:
    _joint_row_score = probe_scores.numba.njit(inline="always", nogil=True, fastmath=_FLOAT_FLAGS)(
        _joint_row_score
    )
    _joint_accumulate = probe_scores.numba.njit(nogil=True, fastmath=_FLOAT_FLAGS)(
        _joint_accumulate
    )


@_counts_no_strays
def joint_accumulate(where, top_scores, starts, lengths, packed, rows, docs, *rest):
    """``_joint_accumulate`` under today's call (``rows`` empty: lists holding residuals)."""
    assert not len(rows)
    _joint_accumulate(where, top_scores, starts, lengths, packed, docs, *rest)


def _direct_run_sums(packed, lo, length, w, bits, sums):  # pragma: no cover - compiled
    """``probe_scores._run_sums`` before stop 73, verbatim: ``sums[r]`` = Σ_p Σ_b w[p, b] · level_{p, b} of packed row ``lo + r``, for r <
    ``length`` (``bits`` 2, 4 or 8: 4, 2 or 1 planes), an integer sum with int16 weights
    (``ResidualCodec.integer_query_terms``, which keeps it within int32): each level is taken
    as an int16, so that the loop over a row's bytes vectorises (the same sum in float32
    stayed scalar). One pass over a row's bytes reads all its planes; the planes' weights are
    taken once per run."""
    if bits == 4:
        w0, w1 = w[0], w[1]
        for r in range(length):
            row = packed[lo + r]
            s = np.int32(0)
            for b in range(len(row)):
                v = np.int16(row[b])
                s += np.int32(w0[b]) * np.int32(v & np.int16(15)) + np.int32(w1[b]) * np.int32(
                    v >> np.int16(4)
                )
            sums[r] = s
    elif bits == 2:
        w0, w1, w2, w3 = w[0], w[1], w[2], w[3]
        for r in range(length):
            row = packed[lo + r]
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
        for r in range(length):
            row = packed[lo + r]
            s = np.int32(0)
            for b in range(len(row)):
                s += np.int32(w0[b]) * np.int32(np.int16(row[b]))
            sums[r] = s


def _direct_accumulate(
    where, top_scores, starts, lengths, packed, docs, planes, scale, constant, bits, weights,
    imputed, floor, acc, seen, touched, sums,
):  # pragma: no cover - compiled  # fmt: skip
    """``probe_scores._accumulate`` before stop 73 (no lists by position), verbatim: for
    each query token i and each of its probed clusters ``where[i, a]`` (rows
    ``starts[c] : starts[c] + lengths[c]`` of ``packed``/``docs``): the best score per document
    (``top_scores[i, a] + constant[i] + scale[i]·`` the row's integer sum, ``planes`` int16),
    kept in ``floor`` (−∞ on entry and on exit), then ``acc[d] += weights[i] · (best −
    imputed[i])`` and ``seen[d] = True`` for each document it reached.

    A cluster's rows are scored first, into ``sums`` (a loop of arithmetic only), then its
    documents are visited: kept apart, the row sums vectorise and the documents' scattered
    reads overlap one another. One loop doing both made the whole search 1.06–1.20× slower at
    k = 10, the same rankings (``benchmarks/results/query_path_ab_probe_split.md``, SciFact
    and CISI; ``query_path_ab_x100_stop68.md``, SciFact grown 100×: 1.17× at k = 100)."""
    n, p = where.shape
    for i in range(n):
        m = 0
        w = planes[i]
        step = scale[i]
        for a in range(p):
            c = where[i, a]
            base = top_scores[i, a] + constant[i]
            lo = starts[c]
            length = lengths[c]
            _direct_run_sums(packed, lo, length, w, bits, sums)
            for r in range(length):
                value = base + step * np.float32(sums[r])
                d = docs[lo + r]
                best = floor[d]
                touched[m] = d
                m += best == -np.inf  # the first time this query token reaches d
                floor[d] = value if value > best else best
        for t in range(m):
            d = touched[t]
            acc[d] += weights[i] * (floor[d] - imputed[i])
            seen[d] = True
            floor[d] = -np.inf


if probe_scores.numba is not None:
    _direct_run_sums = probe_scores.numba.njit(inline="always", nogil=True, fastmath=_FLOAT_FLAGS)(
        _direct_run_sums
    )
    _direct_accumulate = probe_scores.numba.njit(nogil=True, fastmath=_FLOAT_FLAGS)(
        _direct_accumulate
    )


@_counts_no_strays
def direct_accumulate(where, top_scores, starts, lengths, packed, rows, docs, *rest):
    """The pass before stop 73 under today's call (``rows`` empty: lists holding residuals)."""
    assert not len(rows), "the pass before stop 73 reads no lists by position"
    _direct_accumulate(where, top_scores, starts, lengths, packed, docs, *rest)


def _untouched_run_sums(packed, rows, lo, length, w, bits, sums):  # pragma: no cover - compiled
    """``probe_scores._run_sums`` of stop 73's first lists by position, verbatim: ``sums[r]`` = Σ_p Σ_b w[p, b] · level_{p, b} of packed row ``lo + r`` (row
    ``rows[lo + r]`` when ``rows`` is not empty: the lists by position), for r <
    ``length`` (``bits`` 2, 4 or 8: 4, 2 or 1 planes), an integer sum with int16 weights
    (``ResidualCodec.integer_query_terms``, which keeps it within int32): each level is taken
    as an int16, so that the loop over a row's bytes vectorises (the same sum in float32
    stayed scalar). One pass over a row's bytes reads all its planes; the planes' weights are
    taken once per run."""
    indirect = len(rows) > 0
    if bits == 4:
        w0, w1 = w[0], w[1]
        for r in range(length):
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
        for r in range(length):
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
        for r in range(length):
            row = packed[rows[lo + r]] if indirect else packed[lo + r]
            s = np.int32(0)
            for b in range(len(row)):
                s += np.int32(w0[b]) * np.int32(np.int16(row[b]))
            sums[r] = s


def _untouched_accumulate(
    where, top_scores, starts, lengths, packed, rows, docs, planes, scale, constant, bits,
    weights, imputed, floor, acc, seen, touched, sums,
):  # pragma: no cover - compiled  # fmt: skip
    """``probe_scores._accumulate`` of stop 73's first lists by position (each scattered row
    scored as it is read), verbatim: for each query token i and each of its probed clusters
    ``where[i, a]`` (rows
    ``starts[c] : starts[c] + lengths[c]`` of ``packed``/``docs``, of ``rows``/``docs`` when
    ``rows`` is not empty, ``packed`` then read at ``rows``): the best score per document
    (``top_scores[i, a] + constant[i] + scale[i]·`` the row's integer sum, ``planes`` int16),
    kept in ``floor`` (−∞ on entry and on exit), then ``acc[d] += weights[i] · (best −
    imputed[i])`` and ``seen[d] = True`` for each document it reached.

    A cluster's rows are scored first, into ``sums`` (a loop of arithmetic only), then its
    documents are visited: kept apart, the row sums vectorise and the documents' scattered
    reads overlap one another. One loop doing both made the whole search 1.06–1.20× slower at
    k = 10, the same rankings (``benchmarks/results/query_path_ab_probe_split.md``, SciFact
    and CISI; ``query_path_ab_x100_stop68.md``, SciFact grown 100×: 1.17× at k = 100)."""
    n, p = where.shape
    for i in range(n):
        m = 0
        w = planes[i]
        step = scale[i]
        for a in range(p):
            c = where[i, a]
            base = top_scores[i, a] + constant[i]
            lo = starts[c]
            length = lengths[c]
            _untouched_run_sums(packed, rows, lo, length, w, bits, sums)
            for r in range(length):
                value = base + step * np.float32(sums[r])
                d = docs[lo + r]
                best = floor[d]
                touched[m] = d
                m += best == -np.inf  # the first time this query token reaches d
                floor[d] = value if value > best else best
        for t in range(m):
            d = touched[t]
            acc[d] += weights[i] * (floor[d] - imputed[i])
            seen[d] = True
            floor[d] = -np.inf


if probe_scores.numba is not None:
    _untouched_run_sums = probe_scores.numba.njit(
        inline="always", nogil=True, fastmath=_FLOAT_FLAGS
    )(_untouched_run_sums)
    _untouched_accumulate = probe_scores.numba.njit(nogil=True, fastmath=_FLOAT_FLAGS)(
        _untouched_accumulate
    )
untouched_accumulate = _counts_no_strays(_untouched_accumulate)


def _looped_touch(packed, rows, lo, first, stop, sums, sink):  # pragma: no cover - compiled
    """``probe_scores._touch`` of stop 73, verbatim: one byte of every cache line of rows
    ``rows[lo + first : lo + stop]`` read, the first line's inside the loop over lines."""
    last = packed.shape[1] - 1
    t = np.uint8(0)
    for r in range(first, stop):
        j = rows[lo + r]
        for b in range(0, last, 64):
            t ^= packed[j, b]
        t ^= packed[j, last]
    sums[sink] = t


def _looped_run_sums(packed, rows, lo, length, w, bits, sums):  # pragma: no cover - compiled
    """``probe_scores._run_sums`` with stop 73's ``_touch`` (``_looped_touch``)."""
    if len(rows) == 0:
        _row_sums(packed, rows, False, lo, 0, length, w, bits, sums)
        return
    for first in range(0, length, probe_scores.TOUCH_ROWS):
        stop = min(first + probe_scores.TOUCH_ROWS, length)
        _looped_touch(packed, rows, lo, first, stop, sums, length)
        _row_sums(packed, rows, True, lo, first, stop, w, bits, sums)


_row_sums = probe_scores._sums  # compiled (inlined) where numba is installed
if probe_scores.numba is not None:
    _looped_touch = probe_scores.numba.njit(inline="always", nogil=True)(_looped_touch)
    _looped_run_sums = probe_scores.numba.njit(inline="always", nogil=True, fastmath=_FLOAT_FLAGS)(
        _looped_run_sums
    )


def _one_pass(run_sums):
    """``probe_scores._accumulate`` of stop 76, verbatim but for its rows' sums (``run_sums``,
    compiled): each probed list read whole, its documents' state visited wherever they lie
    among all the collection's."""

    def one_pass(
        where, top_scores, starts, lengths, packed, rows, docs, planes, scale, constant, bits,
        weights, imputed, floor, acc, seen, touched, sums,
    ):  # pragma: no cover - compiled  # fmt: skip
        n, p = where.shape
        for i in range(n):
            m = 0
            w = planes[i]
            step = scale[i]
            for a in range(p):
                c = where[i, a]
                base = top_scores[i, a] + constant[i]
                lo = starts[c]
                length = lengths[c]
                run_sums(packed, rows, lo, length, w, bits, sums)
                for r in range(length):
                    value = base + step * np.float32(sums[r])
                    d = docs[lo + r]
                    best = floor[d]
                    touched[m] = d
                    m += best == -np.inf  # the first time this query token reaches d
                    floor[d] = value if value > best else best
            for t in range(m):
                d = touched[t]
                acc[d] += weights[i] * (floor[d] - imputed[i])
                seen[d] = True
                floor[d] = -np.inf

    if probe_scores.numba is None:
        return one_pass
    return probe_scores.numba.njit(nogil=True, fastmath=_FLOAT_FLAGS)(one_pass)


# stop 76's pass (untiled), and over stop 73's touch loop: stop 74's
untiled_accumulate = _counts_no_strays(_one_pass(probe_scores._run_sums))
looped_accumulate = _counts_no_strays(_one_pass(_looped_run_sums))


def gathered_tokens_at_best(s_t, codes, lengths, best, weights, reference=None):
    """``gather_max.tokens_at_best`` before: the rows' centroid scores gathered into a scratch
    ``[rows, n]`` matrix, then compared whole (``centroid_search._at_best``)."""
    sims = scratch.buffer("refine.sims", (len(codes), s_t.shape[1]), np.float32)
    np.take(s_t, np.asarray(codes, np.intp), axis=0, out=sims)
    return cs._at_best(sims, best, lengths, weights)


def _list_rows(self) -> np.ndarray:
    """The store rows of the token lists' entries (the lists no longer keep them): the kept
    rows in the stable order of their codes, computed once per searcher."""
    rows = getattr(self, "_ab_list_rows", None)
    if rows is None:
        kept = ci.kept_rows(self.store, self.index.meta["config"]["beta_d"])
        codes = np.asarray(self.index.codes[kept], np.int64)
        rows = self._ab_list_rows = kept[np.argsort(codes, kind="stable")]
    return rows


def gathered_score_probed(self, q, w, top, top_scores, imputed, alive) -> tuple:
    """``CentroidSearcher._score_probed`` before: the union of the probed clusters' rows
    gathered from the index's store-ordered residuals (fancy indexing), then scored."""
    (lists,) = self.token_lists()  # one set: an index without --add, lists built in memory
    clusters, where = np.unique(top, return_inverse=True)
    where = where.reshape(top.shape)
    sel, lengths = concatenated_ranges(lists.offsets, clusters)
    union = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rows = _list_rows(self)[sel]
    arrays, starts = self.index.residuals.arrays, self.index.residuals.starts
    segment = np.searchsorted(starts, rows, side="right") - 1
    packed = np.empty((len(rows), arrays[0].shape[1]), np.uint8)
    for k in np.unique(segment):
        packed[segment == k] = arrays[k][rows[segment == k] - starts[k]]
    _, acc, seen = self._buffers()
    probe_scores.accumulate(
        self.index.codec, q, where, top_scores, union[:-1], lengths, packed,
        lists.docs[sel].astype(np.int64), w, imputed, self._floor(), acc, seen,
    )  # fmt: skip
    return self._reached(w, imputed, alive)


# -- stage 2's pass before stop 78: query-token groups on the threads ------------------------------
def _grouped_kernel(
    where, top_scores, starts, lengths, packed, rows, docs, planes, scale, constant, bits,
    weights, imputed, floor, acc, seen, touched, sums,
):  # pragma: no cover - compiled  # fmt: skip
    """``probe_scores._accumulate`` of stop 77, verbatim: every tile of documents scored by
    this call (the query tokens ``where`` of one group; see ``grouped_accumulate``)."""
    n, p = where.shape
    num_docs = len(floor)
    cursor = np.empty((n, p), np.int64)
    for i in range(n):
        for a in range(p):
            cursor[i, a] = starts[where[i, a]]
    stray = 0
    for first_doc in range(0, num_docs, probe_scores.TILE_DOCS):
        end_doc = first_doc + probe_scores.TILE_DOCS
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
                probe_scores._run_sums(packed, rows, lo, length, w, bits, sums)
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


if probe_scores.numba is not None:
    _grouped_kernel = probe_scores.numba.njit(nogil=True, fastmath={"reassoc", "contract"})(
        _grouped_kernel
    )


def grouped_kernel(*args):
    """``_grouped_kernel`` (the count of entries out of store order it returns)."""
    return _grouped_kernel(*args)


def grouped_accumulate(
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
    kernel=None,
) -> None:
    """``probe_scores.accumulate`` of stop 77, verbatim but for its pass (``kernel``, of
    stop 77's call; default ``grouped_kernel``): the query tokens cut into ``threads``
    contiguous groups, each worker's scored into per-document arrays of its own, then added
    in (``_add_group``)."""
    planes, scale, constant = codec.integer_query_terms(queries)
    n = len(constant)
    probed = np.asarray(lengths)[np.asarray(where)] if np.size(where) else np.zeros(1, np.int64)
    longest = max(int(probed.max()), 1)  # rows of the longest probed cluster
    shared = (
        np.ascontiguousarray(starts, np.int64),
        np.ascontiguousarray(lengths, np.int64),
        np.ascontiguousarray(packed, np.uint8),
        probe_scores._NO_ROWS
        if rows is None
        else np.ascontiguousarray(rows),  # int32 below 2³¹ rows
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
        return (kernel or grouped_kernel)(
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


def grouped(kernel):
    """``grouped_accumulate`` with a kept pass of stop 77's call: the search's stage 2 before
    stop 78 (``tile_threads``) and before each earlier change (their ``before``)."""
    return functools.partial(grouped_accumulate, kernel=kernel)


def fancy_gather_padded(self, doc_indices, length):
    """``TokenStore.gather_padded`` before: one fancy index over every row."""
    doc_indices = np.asarray(doc_indices, dtype=np.int64)
    starts = self.offsets[doc_indices]
    lengths = self.offsets[doc_indices + 1] - starts
    c = len(doc_indices)
    vectors = np.zeros((c, length, self.dim), dtype=ts.VECTOR_DTYPE)
    salience = np.zeros((c, length), dtype=np.float32)
    token_ids = np.zeros((c, length), dtype=np.int32)
    mask = np.arange(length)[None, :] < lengths[:, None]
    rows = (starts[:, None] + np.arange(length)[None, :])[mask]
    where_c, where_l = np.nonzero(mask)
    vectors[where_c, where_l] = self.take("vectors", rows)
    salience[where_c, where_l] = self.take("salience", rows)
    token_ids[where_c, where_l] = self.take("token_ids", rows)
    return vectors, mask, salience, token_ids


def opened_concatenated(self, kind, doc_indices, out):
    """``TokenStore.concatenated`` before stop 68: every shard's documents merged into runs
    with NumPy (``merged_runs``), even a single document's, and the unmapped shards read by
    ``opened_read_runs``."""
    doc_indices = np.asarray(doc_indices, dtype=np.int64)
    starts = self.offsets[doc_indices]
    ends = self.offsets[doc_indices + 1]
    at = np.concatenate([[0], np.cumsum(ends - starts)])
    if at[-1] != len(out):
        raise ValueError(f"concatenated: the documents hold {at[-1]} rows, out has {len(out)}")
    shard = np.searchsorted(self._shard_doc_starts, doc_indices, side="right") - 1
    order = np.argsort(shard, kind="stable")
    bounds = np.flatnonzero(np.diff(shard[order])) + 1
    target = out
    if kind in ts.HALF_KINDS and out.dtype == np.float32:
        out = scratch.buffer(f"store.concatenated.{kind}", out.shape, ts.VECTOR_DTYPE)
    for group in np.split(order, bounds) if len(order) else []:
        s = int(shard[group[0]])
        off = int(self._shard_token_starts[s])
        runs = ts.merged_runs(starts[group] - off, ends[group] - off, at[group])
        array = self._array(kind, s, evict=False)
        if array is None:
            opened_read_runs(self, kind, s, runs, out)
            continue
        array = array.view(np.ndarray)
        for lo, hi, to in runs:
            out[to : to + hi - lo] = array[lo:hi]
    return target if out is target else half.to_float32(out, target)


def opened_read_runs(self, kind, s, runs, out):
    """``TokenStore._read_runs`` before stop 68: the file opened as a Python file object per
    call, its path built each time (its header cached apart from the current code's)."""
    meta = self._shards[s]["files"][kind]
    path = self.directory / meta["path"]
    headers = self.__dict__.setdefault("_ab_headers", {})
    with open(path, "rb") as f:
        header = headers.get((kind, s))
        if header is None:
            major, _ = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if major == 1 else None
            shape, _, dtype = (read or np.lib.format.read_array_header_2_0)(f)
            row = tuple(shape[1:])
            header = headers[(kind, s)] = (f.tell(), dtype, row, dtype.itemsize * math.prod(row))
        start, dtype, row, row_bytes = header
        for lo, hi, to in runs:
            data = os.pread(f.fileno(), (hi - lo) * row_bytes, start + lo * row_bytes)
            out[to : to + hi - lo] = np.frombuffer(data, dtype).reshape((hi - lo, *row))


def scan_fetch_sql(num_pairs: int) -> str:
    """``documents.fetch_sql`` before: a row-value IN over the pairs (a table scan)."""
    marks = ", ".join("(?, ?)" for _ in range(num_pairs))
    return (
        "SELECT shard, slot, doc_id, title, text, metadata FROM documents "
        f"WHERE (shard, slot) IN (VALUES {marks})"
    )


def sqrt_reach_factor(num_docs: int, k: int | None = None) -> float:
    """``centroid_search.reach_factor`` before stop 76, verbatim but for the ignored ``k``:
    max(1, √(N / REACH_DOCS)) at every k."""
    del k
    return max(1.0, math.sqrt(num_docs / cs.REACH_DOCS))


def partition_best(scores: np.ndarray, m: int) -> np.ndarray:
    """``centroid_search._best`` before stop 69: a partition of every score."""
    if m < len(scores):
        return np.argpartition(-scores, m - 1)[:m]
    return np.arange(len(scores))


def inclusive_best(scores: np.ndarray, m: int) -> np.ndarray:
    """``centroid_search._best`` of stop 69, verbatim: every score that reaches the sampled
    threshold partitioned, ties at the threshold included."""
    n = len(scores)
    if m >= n:
        return np.arange(n)
    kept = None
    if n >= cs.SELECT_PREFILTER_MIN and m * 8 <= n:
        sample = scores[:: max(n // cs.SELECT_SAMPLE, 1)]
        j = min(len(sample), math.ceil(1.5 * m * len(sample) / n) + 8)
        threshold = np.partition(sample, len(sample) - j)[len(sample) - j]
        kept = np.flatnonzero(scores >= threshold)
        if len(kept) < m:
            kept = None
    part = scores if kept is None else scores[kept]
    mth = np.partition(part, len(part) - m)[len(part) - m]  # the m-th largest
    taken = part > mth  # then the first of the ties at the m-th, as many as are missing
    taken[np.flatnonzero(part == mth)[: m - int(taken.sum())]] = True
    chosen = np.flatnonzero(taken)
    if len(chosen) < m:  # NaN scores (sorted above every number): as before, never chosen
        return np.argpartition(-scores, m - 1)[:m]
    return chosen if kept is None else kept[chosen]


def partition_top(scores: np.ndarray, k: int) -> np.ndarray:
    """``centroid_search._top`` before stop 69."""
    if k < len(scores):
        part = np.argpartition(-scores, k - 1)[:k]
    else:
        part = np.arange(len(scores))
    return part[np.argsort(-scores[part], kind="stable")]


def eager_tail_search(
    self,
    q: np.ndarray,
    u_q: np.ndarray,
    probe_rows: np.ndarray,
    k: int,
    refine_fn=None,
    allowed: np.ndarray | None = None,
) -> tuple:
    """``CentroidSearcher.search`` before stop 69: the stage-2 tail (reached documents not in
    stage 3) built for every query, whether or not the ranking reaches it."""
    alive = self.alive if allowed is None else self.alive & allowed
    q = np.asarray(q, np.float32)
    u_q = np.asarray(u_q, np.float32)
    live = u_q > 0
    if live.any() and not live.all():
        # a query token of weight 0 changes no score (Eq. 2: it adds 0 to both sums):
        # it is not probed, gathered or refined (a trained model zeroes about 1 in 5)
        rows = np.flatnonzero(live)
        probe_rows = np.searchsorted(rows, probe_rows[live[probe_rows]])
        q, u_q = q[rows], u_q[rows]
    s_t = scratch.buffer("search.s_t", (self.index.num_centroids, len(q)), np.float32)
    np.matmul(self.index.centroids, q.T, out=s_t)  # Sᵀ (stage 2's selection as today's)
    probes, interaction_docs, refine_docs = self.counts(k, len(probe_rows))
    if self.config.residual_candidates:
        probe = cs.probed(s_t, probes, self.config.impute_depth, probe_rows)
        cands, approx = self.residual_candidates(q, s_t, probe_rows, u_q, alive, probes, probe)
        approx = self.with_centroid_terms(s_t, probe_rows, probe, u_q, cands, approx)
        approx = self.with_means(q, u_q, probe_rows, cands, approx)
        m = min(self.config.rescored(refine_docs, k), len(cands))
        top = cs._top(approx, max(m, min(refine_docs, len(cands))))
        below = self.config.rescore_below_reach
        if m > refine_docs and below < 1.0:  # only where stage 2 mostly imputed
            docs = cands[top[:refine_docs]]
            reached = self.reached_share(s_t, probe_rows, probes, docs, u_q, probe)
            m, top = (m, top) if reached < below else (0, top[:refine_docs])
        first, inter = cands[top], approx[top]
        order = np.arange(len(first))
        if m > refine_docs:  # the residual interaction of stage 3 over stage 2's best m
            keep = self.best_centroid_tokens(s_t, first, u_q)
            inter = self.refine(q, s_t, first, u_q, keep=keep)
            order = cs._top(inter, refine_docs)
    else:
        cands, approx = self.candidates(s_t, probe_rows, u_q, alive, probes)
        approx = self.with_means(q, u_q, probe_rows, cands, approx)
        first = cands[cs._top(approx, min(interaction_docs, len(cands)))]
        if self.config.residual_interaction:  # the best by centroid scores, by residuals
            m = math.ceil(self.config.residual_per_refine * refine_docs)
            inter, best_centroids = self._interaction(s_t, first, u_q)
            best = cs._top(inter, m)
            shifted = self.refine(q, s_t, first[best], u_q, best_centroids=best_centroids[best])
            # the others keep their order, below every re-scored document
            inter = inter - inter.max() + (shifted.min() if len(shifted) else 0.0) - 1.0
            inter[best] = shifted
        else:
            inter = self.interaction(s_t, first, u_q)
        order = cs._top(inter, min(refine_docs, len(first)))
    refined = first[order]
    rest = np.ones(len(first), bool)
    rest[order] = False
    others = ~np.isin(cands, first, assume_unique=True)
    tail = [(first[rest], inter[rest]), (cands[others], approx[others])]
    rankings = self._ranked(q, s_t, u_q, refined, tail, k, refine_fn)
    tokens = int((self.store.offsets[refined + 1] - self.store.offsets[refined]).sum())
    return rankings, cs.StageCounts(len(cands), len(first), len(refined), tokens)


# the current code, put back after each "before" run
NEW = {
    "segment_max": cs.segment_max,
    "numba": gather_max.numba,
    "probe_numba": probe_scores.numba,
    "select_numba": probe_select.numba,
    "gather": ts.TokenStore.gather_padded,
    "fetch_sql": documents_lib.fetch_sql,
    "concatenated": ts.TokenStore.concatenated,
    "score_probed": cs.CentroidSearcher._score_probed,
    "chunk": codec_lib.CHUNK,
    "accumulate": probe_scores.accumulate,
    "dense_share": scratch.DENSE_SHARE,
    "tokens_at_best": gather_max.tokens_at_best,
    "reach_factor": cs.reach_factor,
    "best": cs._best,
    "top": cs._top,
    "search": cs.CentroidSearcher.search,
}
BEFORE_CHUNK = 16384  # codec.CHUNK before
FILL_DOCS = cs.FILL_DOCS or 3000  # the "fill" pair's documents (the default, else 3,000)


CHANGES = (
    "float_all", "tile_threads", "light", "dense_clear", "tiles", "touch_lines", "touch", "by_position", "rows_branch", "residual_default", "select_ties", "probe_select", "select", "at_best", "store_reads", "probe_split", "probe_int16", "gather_max", "probe_scores", "cluster_residuals", "residual_chunk", "segment_max",
    "gather_padded", "fetch", "host_top1", "rescore", "means", "fill", "reach", "reach_linear",
)  # fmt: skip


# -- timing ------------------------------------------------------------------------------------------
def interleaved(items, run: Callable, use: Callable, rounds: int) -> tuple[dict, dict]:
    """Times ``run(item)`` under ``use("before")`` and ``use("after")`` (alternating which goes
    first), one untimed pass then ``rounds`` timed ones; counts identical results."""
    ms = {"before": [], "after": []}
    same = 0
    for r in range(rounds + 1):
        for i, item in enumerate(items):
            results = {}
            for which in ("before", "after") if (i + r) % 2 else ("after", "before"):
                use(which)
                t = time.perf_counter()
                results[which] = run(item)
                if r:
                    ms[which].append(1000.0 * (time.perf_counter() - t))
            same += results["before"] == results["after"]
    use("after")
    row = {"n": len(ms["after"]), "identical": f"{same}/{(rounds + 1) * len(items)}"}
    for which, values in ms.items():
        a = np.asarray(values)
        row[which] = {f"p{p}_ms": round(float(np.percentile(a, p)), 3) for p in (50, 90, 99)}
    row["p50_speedup"] = round(row["before"]["p50_ms"] / row["after"]["p50_ms"], 3)
    return row, ms


def _ranking(results: dict) -> tuple:
    """A ranking with scores rounded to 1e-5 (the same ranking, scores within rounding)."""
    return tuple((d, round(s, 5)) for d, s in results.items())


def bench_store(name: str, index_dir: str, rounds: int) -> tuple[list[dict], dict]:
    data = pathlib.Path(FLAGS.data_root) / name
    dataset = beir.load_beir(data, split="test")
    qids = sorted(dataset.queries)[: FLAGS.max_queries or None]
    searcher = search_lib.Searcher.load(index_dir)
    encoded = {q: searcher.encoder.encode([dataset.queries[q]], "query")[0] for q in qids}
    rows, samples = [], {}
    label = f"{name} ({pathlib.Path(index_dir).parent.name})"  # two stores of one dataset differ

    def fused(which):
        gather_max.numba = NEW["numba"] if which == "after" else None

    def segment_max(which):  # on gather_max's NumPy path, where segment_max still runs
        gather_max.numba = None
        cs.segment_max = NEW["segment_max"] if which == "after" else reduceat_segment_max

    def at_best(which):
        gather_max.tokens_at_best = (
            NEW["tokens_at_best"] if which == "after" else gathered_tokens_at_best
        )

    def integer(which):
        probe_scores.accumulate = (
            NEW["accumulate"] if which == "after" else grouped(float_accumulate)
        )

    def reads(which):
        after = which == "after"
        ts.TokenStore.concatenated = NEW["concatenated"] if after else opened_concatenated

    def select(which):
        after = which == "after"
        cs._best = NEW["best"] if after else partition_best
        cs._top = NEW["top"] if after else partition_top
        cs.CentroidSearcher.search = NEW["search"] if after else eager_tail_search

    def tile_threads(which):  # stage 2's threads by document tiles, or by query-token groups
        probe_scores.accumulate = NEW["accumulate"] if which == "after" else grouped(grouped_kernel)

    def float_all(which):  # every refined document from float vectors, or the best 2·k
        config = searcher.centroid.config
        if config.refine_float:  # a model with saliences (else no float refinement either way)
            after = which == "after"
            searcher.centroid.config = dataclasses.replace(
                config,
                refine_float=cs.REFINE_FLOAT if after else 2.0,
                refine_float_max=cs.REFINE_FLOAT_MAX if after else 200,
            )

    def light(which):  # the light query tokens left out of the compressed stages
        config = searcher.centroid.config
        share = cs.LIGHT_SHARE if which == "after" else 0.0
        searcher.centroid.config = dataclasses.replace(config, light_share=share)

    def dense_clear(which):  # stage 2's per-document arrays cleared whole when mostly set
        scratch.DENSE_SHARE = NEW["dense_share"] if which == "after" else 0

    def tiled(which):  # the default search, stage 2 per tile of documents
        probe_scores.accumulate = (
            NEW["accumulate"] if which == "after" else grouped(untiled_accumulate)
        )

    def lined(which):  # the default search (lists by position past LISTS_IN_MEMORY_MAX)
        probe_scores.accumulate = (
            NEW["accumulate"] if which == "after" else grouped(looped_accumulate)
        )

    def touched(which):  # on the lists by position
        residual.centroid._token_lists = lists["by_position"]
        probe_scores.accumulate = (
            NEW["accumulate"] if which == "after" else grouped(untouched_accumulate)
        )

    def branch(which):  # on the copy (by_position leaves the lists by position in place)
        residual.centroid._token_lists = lists["copy"]
        probe_scores.accumulate = (
            NEW["accumulate"] if which == "after" else grouped(direct_accumulate)
        )

    def position(which):
        residual.centroid._token_lists = lists["by_position" if which == "after" else "copy"]

    def residual_path(which):
        searcher.centroid = default_centroid if which == "after" else centroid_path.centroid

    def ties(which):
        cs._best = NEW["best"] if which == "after" else inclusive_best

    def scan(which):
        probe_select.numba = NEW["select_numba"] if which == "after" else None

    def split(which):
        probe_scores.accumulate = (
            NEW["accumulate"] if which == "after" else grouped(joint_accumulate)
        )

    def probed(which):
        probe_scores.numba = NEW["probe_numba"] if which == "after" else None

    def clustered(which):
        cs.CentroidSearcher._score_probed = (
            NEW["score_probed"] if which == "after" else gathered_score_probed
        )

    def chunk(which):
        codec_lib.CHUNK = NEW["chunk"] if which == "after" else BEFORE_CHUNK

    def rescore(which):
        config = searcher.centroid.config
        count = cs.RESCORE_PER_REFINE if which == "after" else 0.0
        searcher.centroid.config = dataclasses.replace(config, rescore_per_refine=count)

    def means(which):
        config = searcher.centroid.config
        weight = cs.MEAN_WEIGHT if which == "after" else 0.0
        searcher.centroid.config = dataclasses.replace(config, mean_weight=weight)

    def fill(which):
        config = searcher.centroid.config
        docs = FILL_DOCS if which == "after" else 0
        searcher.centroid.config = dataclasses.replace(config, fill_docs=docs)

    def reach_with(factor):  # the reach rule, and the searcher's counts that follow from it
        cs.reach_factor = factor
        centroid = searcher.centroid
        centroid.probes, centroid.interaction_docs, centroid.refine_docs = centroid.counts()

    def reach(which):
        reach_with(NEW["reach_factor"] if which == "after" else lambda num_docs, k=None: 1.0)

    def reach_linear(which):
        reach_with(NEW["reach_factor"] if which == "after" else sqrt_reach_factor)

    residual = search_lib.Searcher.load(
        index_dir,
        encoder=searcher.encoder,
        centroid_config=cs.CentroidSearchConfig(
            residual_candidates=True, refine_per_k=FLAGS.residual_candidates_refine_per_k
        ),
    )
    centroid_path = search_lib.Searcher.load(
        index_dir,
        encoder=searcher.encoder,
        centroid_config=cs.CentroidSearchConfig(residual_candidates=False),
    )
    default_centroid = searcher.centroid
    lists = {}
    if {"touch", "by_position", "rows_branch"} & set(FLAGS.changes):
        lists["copy"] = residual.centroid._build_token_lists()
        lists["by_position"] = residual.centroid._build_token_lists(by_position=True)
    changes = (
        ("float_all", float_all, searcher),  # every refined document from float vectors
        ("tile_threads", tile_threads, searcher),  # stage 2's threads by document tiles
        ("light", light, searcher),  # the light query tokens not probed
        ("dense_clear", dense_clear, searcher),  # stage 2's per-document arrays cleared
        ("tiles", tiled, searcher),  # the default search, stage 2 per tile of documents
        ("touch_lines", lined, searcher),  # the default search, lists by position at scale
        ("touch", touched, residual),  # the lists by position: rows touched in blocks first
        ("by_position", position, residual),  # residual candidates' lists: copy or positions
        ("rows_branch", branch, residual),  # the compiled pass, lists holding residuals
        ("residual_default", residual_path, searcher),  # the default's stage 2 (stop 73)
        ("select_ties", ties, searcher),  # stage 2's selections, every search path
        ("probe_select", scan, searcher),  # the probed centroids, every search path
        ("select", select, searcher),  # stage 2's selections and tail, every search path
        ("at_best", at_best, centroid_path),
        ("store_reads", reads, searcher),  # the float refinement's reads (models with u^d)
        ("probe_split", split, searcher),  # residual candidates, the default where lists fit
        ("probe_int16", integer, searcher),  # residual candidates, the default where lists fit
        ("gather_max", fused, searcher),
        ("probe_scores", probed, residual),
        ("cluster_residuals", clustered, residual),
        ("residual_chunk", chunk, searcher),
        ("segment_max", segment_max, searcher),
        ("rescore", rescore, searcher),
        ("means", means, searcher),
        ("fill", fill, searcher),
        ("reach", reach, searcher),
        ("reach_linear", reach_linear, searcher),
    )
    for change, use, by in changes:
        if change not in FLAGS.changes:
            continue
        for k in (10, 100):

            def search(q, k=k, by=by):
                out = by.run([q], [encoded[q]], show_progress=False, k=k)
                return _ranking(out.results[next(iter(out.results))][q])

            row, ms = interleaved(qids, search, use, rounds)
            gather_max.numba = NEW["numba"]
            rows.append({"change": change, "timed": f"search, k = {k}", **row})
            samples[f"{label}: {change}, search k={k}"] = ms

    candidates = {}
    for q in qids:
        out = searcher.run([q], [encoded[q]], show_progress=False, k=FLAGS.rerank_candidates)
        candidates[q] = list(out.results[next(iter(out.results))][q])

    def gather(which):
        ts.TokenStore.gather_padded = NEW["gather"] if which == "after" else fancy_gather_padded

    def rerank(q):
        out = searcher.rerank([q], [encoded[q]], {q: candidates[q]}, show_progress=False, k=10)
        return _ranking(out.results[next(iter(out.results))][q])

    if "gather_padded" in FLAGS.changes:
        row, ms = interleaved(qids, rerank, gather, rounds)
        rows.append(
            {"change": "gather_padded", "timed": f"rerank of {FLAGS.rerank_candidates}", **row}
        )  # fmt: skip
        samples[f"{label}: rerank {FLAGS.rerank_candidates}"] = ms

    if "host_top1" in FLAGS.changes:
        exhaustive = search_lib.Searcher.load(
            index_dir, mode="exhaustive", encoder=searcher.encoder
        )

        def host(which):
            for r in (exhaustive.refiner, searcher.refiner):
                r.config = dataclasses.replace(r.config, host_top1=which == "after")

        def exact(q):
            out = exhaustive.run([q], [encoded[q]], show_progress=False, k=100)
            return _ranking(out.results[next(iter(out.results))][q])

        for timed, run in (("exhaustive search, k = 100", exact), (
            f"rerank of {FLAGS.rerank_candidates}", rerank
        )):  # fmt: skip
            row, ms = interleaved(qids, run, host, rounds)
            rows.append({"change": "host_top1", "timed": timed, **row})
            samples[f"{label}: host_top1, {timed}"] = ms

    table = searcher.documents
    positions = searcher.doc_positions
    top10 = {q: [positions[d] for d in candidates[q][:10]] for q in qids}

    def sql(which):
        documents_lib.fetch_sql = NEW["fetch_sql"] if which == "after" else scan_fetch_sql

    def fetch(q):
        return tuple(r["doc_id"] for r in table.fetch(top10[q]))

    if "fetch" in FLAGS.changes:
        row, ms = interleaved(qids, fetch, sql, rounds)
        rows.append({"change": "fetch", "timed": "fetch of 10 hits", **row})
        samples[f"{label}: fetch 10"] = ms
    for r in rows:
        r.update(dataset=name, index_dir=index_dir, queries=len(qids), load_1m=os.getloadavg()[0])
    return rows, samples


def markdown(report: dict) -> str:
    lines = [
        "# Query-path changes against the code they replaced (interleaved per query)",
        "",
        f"`{report['command']}`",
        "",
        f"{report['machine']}; {report['threads']} threads; {report['rounds']} timed rounds "
        f"after one untimed; load average before {report['loadavg_before']}, after "
        f"{report['loadavg_after']}.",
        "",
        "| dataset | index | change | timed | n | before p50 / p99 ms | after p50 / p99 ms "
        "| p50 speed-up | identical results | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        b, a = r["before"], r["after"]
        lines.append(
            f"| {r['dataset']} | `{r.get('index_dir', '')}` | {r['change']} | {r['timed']} "
            f"| {r['n']} | "
            f"{b['p50_ms']:.2f} / {b['p99_ms']:.2f} | {a['p50_ms']:.2f} / {a['p99_ms']:.2f} | "
            f"{r['p50_speedup']:.2f}× | {r['identical']} | {r['load_1m']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(samples: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(samples)
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(names)))
    for i, name in enumerate(names):
        for which, color, dy in (("before", "tab:gray", 0.12), ("after", "tab:blue", -0.12)):
            p50, p99 = np.percentile(samples[name][which], [50, 99])
            ax.plot([p50, p99], [i + dy] * 2, color=color, lw=1)
            ax.plot(p50, i + dy, "o", color=color, label=which if i == 0 else None)
    ax.set_yticks(range(len(names)), names)
    ax.set_xscale("log")
    ax.set_xlabel("ms per query (dot: p50, line to p99)")
    ax.invert_yaxis()
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # beside the rows
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def define_flags() -> None:
    """The flags (defined when run, so tests import the predecessors without them)."""
    flags.DEFINE_list(
        "stores",
        ["scifact:outputs/zero_shot_scifact/index", "cisi:outputs/zero_shot_cisi/index"],
        "DATASET:INDEX_DIR pairs (the dataset under --data_root); each needs its search index.",
    )
    flags.DEFINE_string("data_root", "../shared/data/beir", "BEIR folders.")
    flags.DEFINE_integer("threads", 2, "BLAS threads (threadpoolctl).", lower_bound=1)
    flags.DEFINE_integer("rounds", 2, "Timed passes over the queries.", lower_bound=1)
    flags.DEFINE_integer("max_queries", 0, "At most this many test queries (0: all).")
    flags.DEFINE_integer("rerank_candidates", 100, "Documents per rerank.", lower_bound=1)
    flags.DEFINE_string("output_name", "query_path_ab", "benchmarks/results/NAME.*")
    flags.DEFINE_multi_enum(
        "changes",
        list(CHANGES),
        list(CHANGES),
        "The changes to time (repeat the flag for several; default: all).",
    )
    flags.DEFINE_float(
        "residual_candidates_refine_per_k",
        1.0,
        "CentroidSearchConfig.refine_per_k of the probe_scores pair's searcher.",
        lower_bound=0.0,
    )


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cli.quiet_logs()
    pairs = []
    for spec in FLAGS.stores:
        name, sep, index_dir = spec.partition(":")
        if not sep or not (pathlib.Path(index_dir) / ts.MANIFEST).exists():
            raise app.UsageError(f"--stores: {spec!r} is not DATASET:INDEX_DIR of a token store")
        pairs.append((name, index_dir))
    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    rows, samples = [], {}
    with threadpoolctl.threadpool_limits(FLAGS.threads):
        for name, index_dir in pairs:
            r, s = bench_store(name, index_dir, FLAGS.rounds)
            rows += r
            samples.update(s)
            for row in r:
                print(row, flush=True)
    report = {
        "command": " ".join(["benchmarks/query_path_ab.py", *sys.argv[1:]]),
        "threads": FLAGS.threads,
        "rounds": FLAGS.rounds,
        "rows": rows,
        "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
        "loadavg_before": loadavg_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    out = REPO / "benchmarks" / "results" / FLAGS.output_name
    fileio.atomic_write_json(out.with_suffix(".json"), report, sort_keys=False)
    fileio.atomic_write_text(out.with_suffix(".md"), markdown(report))
    plot(samples, out.with_suffix(".png"))
    print(markdown(report))
    print(f"wrote {out}.json, .md, .png")


if __name__ == "__main__":
    define_flags()
    app.run(main)
