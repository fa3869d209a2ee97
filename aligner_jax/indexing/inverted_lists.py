"""The lists of the search index, written per group of store shards and read as one: the
inverted file (centroid → the documents owning one of its β^d-kept tokens, sorted; PLAID §4.1)
and the document → distinct centroid lists (centroid interaction).

**Groups keep an ``--add`` proportional to what it adds.** A build writes one group over every
store shard. An update that adds documents writes a *delta* group: the lists of every document
added since the last full write (reading only their shards), replacing the previous delta
group, so an index holds at most two groups and an ``--add`` costs the delta's tokens, not the
index's. Once the delta would hold more than ``DELTA_FRACTION`` of the tokens, every list is
written again as one group (an amortised rewrite). Groups hold disjoint, increasing document
ranges, so a centroid's list is the concatenation of its list in each group, still sorted, and
a document's centroids are in the one group that holds it.

A group's files (stems in its metadata entry ``{"first_shard", "first_doc", "tables"}``):

  ``ivf_offsets`` int64 ``[C + 1]``, ``ivf_docs`` int32  centroid → documents (store positions)
  ``doc_code_offsets`` int64 ``[group docs + 1]``, ``doc_codes`` uint16/int32  document →
      distinct centroid ids, only where they are shorter than the tokens' codes
      (``CentroidIndexConfig.doc_lists_max_fraction``; a delta group follows the full group)
  ``tok_offsets`` int64 ``[C + 1]``, ``tok_docs`` int32, ``tok_residuals`` uint8 ``[n, W]``
      centroid → its β^d-kept tokens, each token's document and packed residual, tokens of one
      centroid in store order (WARP's cluster-ordered residuals: what ``residual_candidates``
      and the XTR scorer read, one contiguous run per probed centroid), only with
      ``CentroidIndexConfig.token_lists`` (a delta group follows the full group)

Index formats up to 5 name one group's files in ``meta["tables"]`` (read as the group at 0).

**Bounded memory.** A group is written in two passes over its shards' codes, one shard at a
time: one counts, then the inverted file is filled one block of consecutive centroids at a time
(``IVF_BLOCK_PAIRS`` entries) and written in file order. The token lists likewise, in blocks of
at most ``TOKEN_BLOCK_BYTES`` (each block one more pass over the shards' codes and residuals,
read with plain reads, never mapped).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import NamedTuple

import numpy as np

from aligner_jax.common import blas, fileio, progress, workers
from aligner_jax.core import pruning
from aligner_jax.indexing import kmeans

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; kept for hosts without it
    numba = None

IVF_LISTS = ("ivf_offsets", "ivf_docs")
DOC_LISTS = ("doc_code_offsets", "doc_codes")
TOKEN_LISTS = ("tok_offsets", "tok_docs", "tok_residuals")
IVF_BLOCK_PAIRS = 1 << 25  # inverted-file entries (int32) filled in memory at once: 128 MiB
TOKEN_BLOCK_BYTES = 1 << 28  # token-list entries (document + residual) filled at once: 256 MiB
# a segment's residuals grouped by centroid, filled at once (and a document each): a smaller
# block than the token lists', for more passes, so that the build's peak stays as it was
CLUSTER_BLOCK_BYTES = 1 << 26
LOAD_BLOCK_TOKENS = 1 << 22  # tokens whose codes one pass of the lists by position reads at once
# an --add writes the delta group while it holds at most this fraction of the tokens: its cost
# is then at most this fraction of a full list write (which is ~1/8 of a build at 124M tokens)
DELTA_FRACTION = 0.1


class TokenLists(NamedTuple):
    """Centroid ``c``'s β^d-kept stored tokens are entries ``offsets[c]:offsets[c + 1]`` of
    ``docs`` (their documents, store positions) and ``residuals`` (their packed residuals), in
    store order within a centroid.

    With ``rows`` (the lists by position, ``token_rows_in_memory``) entry ``j``'s residual is
    ``residuals[rows[j]]``: ``residuals`` is then the index's own mapped segment, in store
    order, and the lists hold 8 bytes per kept token instead of a copy of every residual."""

    offsets: np.ndarray
    docs: np.ndarray
    residuals: np.ndarray
    rows: np.ndarray | None = None

    def residual_rows(self, entries: np.ndarray) -> np.ndarray:
        """The packed residuals of list entries ``entries``."""
        return self.residuals[entries if self.rows is None else self.rows[entries]]

    @property
    def nbytes(self) -> int:
        """Bytes these lists hold of their own (the mapped residuals of ``rows`` lists not
        counted)."""
        own = self.docs.nbytes + self.offsets.nbytes
        return own + (self.residuals.nbytes if self.rows is None else self.rows.nbytes)


def concatenated_ranges(offsets: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``offsets[i]:offsets[i+1]`` of every ``i`` in ``ids``, concatenated, and their lengths."""
    starts = offsets[ids]
    lengths = offsets[ids + 1] - starts
    ends = np.cumsum(lengths)
    rows = np.arange(int(ends[-1]) if len(ends) else 0) + np.repeat(
        starts - ends + lengths, lengths
    )
    return rows, lengths


def run_slots(cursor: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The slot of each of ``keys`` (in their order) in a CSR fill whose key ``c`` has its next
    free slot at ``cursor[c]``: entries of one key take consecutive slots in their order.
    Advances ``cursor``; ``out[slots] = values`` then fills any number of arrays alike."""
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    first = np.searchsorted(ordered, ordered, side="left")
    slots = np.empty(len(keys), np.int64)
    slots[order] = cursor[ordered] + (np.arange(len(keys)) - first)
    cursor += np.bincount(keys, minlength=len(cursor))
    return slots


def fill_runs(out: np.ndarray, cursor: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
    """Appends ``values`` to the runs of ``out`` of their ``keys`` (``run_slots``), in their
    order within each key, and advances ``cursor``."""
    out[run_slots(cursor, keys)] = values


# -- writing -----------------------------------------------------------------------------------------
def _shard_pairs(store, codes, i: int, span: tuple, beta_d: float, num_centroids: int):
    """Shard ``i``'s (document, centroid) pairs, documents local to the shard: every token's
    (document → centroid lists) and the β^d-kept tokens' (inverted file), each unique and
    sorted by document."""
    shard, token_start, _ = span
    local_codes = np.asarray(codes.span(token_start, token_start + shard["num_tokens"]), np.int64)
    salience, local = store.shard_arrays(i)[1:]
    docs = np.repeat(np.arange(len(local) - 1, dtype=np.int64), np.diff(local))
    every = np.unique(docs * num_centroids + local_codes)
    if beta_d >= 1.0:
        kept = every
    else:
        rows = pruning.top_fraction_segments(salience, local, beta_d)
        kept = np.unique(docs[rows] * num_centroids + local_codes[rows])
    return every, kept


def write_group(
    store,
    codes,
    first_shard: int,
    name: str,
    out: Path,
    num_centroids: int,
    beta_d: float,
    doc_lists: bool | float,
    block_pairs: int | None = None,
    residuals=None,
    token_block_bytes: int | None = None,
) -> dict:
    """Writes the lists of store shards ``first_shard:`` (their tokens' centroid ids in
    ``codes``, indexed by store row) as the group ``name`` in ``out``; returns its entry.
    With ``residuals`` (the tokens' packed residuals, indexed alike) the group's token lists
    are written too (``write_token_lists``, blocks of ``token_block_bytes``).

    ``doc_lists``: whether to write the document → centroid lists, or a fraction: write them
    when they hold at most that fraction of the group's tokens. One pass over the shards
    counts; then the inverted file is filled one block of consecutive centroids at a time (at
    most ``block_pairs`` entries in memory, default ``IVF_BLOCK_PAIRS``), one more pass over the
    shards per block (the first also streaming the document → centroid lists). Documents come
    in increasing order, so every list is sorted as it is filled."""
    block_pairs = block_pairs or IVF_BLOCK_PAIRS
    c = num_centroids
    spans = store.shard_spans()
    shards = range(first_shard, len(spans))
    first_doc, first_token = spans[first_shard][2], spans[first_shard][1]
    num_docs, num_tokens = store.num_docs - first_doc, store.num_tokens - first_token
    ivf_counts = np.zeros(c, np.int64)
    doc_counts = np.zeros(num_docs, np.int64)
    for i in shards:
        every, kept = _shard_pairs(store, codes, i, spans[i], beta_d, c)
        ivf_counts += np.bincount(kept % c, minlength=c)
        lo, n = spans[i][2] - first_doc, spans[i][0]["num_docs"]
        doc_counts[lo : lo + n] = np.bincount(every // c, minlength=n)
    ivf_offsets = np.zeros(c + 1, np.int64)
    np.cumsum(ivf_counts, out=ivf_offsets[1:])
    doc_offsets = np.zeros(num_docs + 1, np.int64)
    np.cumsum(doc_counts, out=doc_offsets[1:])
    if not isinstance(doc_lists, bool):
        doc_lists = bool(doc_offsets[-1] <= doc_lists * num_tokens)
    tables = {kind: f"{name}.{kind}" for kind in IVF_LISTS + (DOC_LISTS if doc_lists else ())}
    bounds = _blocks(ivf_offsets, block_pairs)
    with contextlib.ExitStack() as stack:
        ivf = stack.enter_context(
            fileio.NpyStream(out / f"{tables['ivf_docs']}.npy", (int(ivf_offsets[-1]),), np.int32)
        )
        if doc_lists:
            dc = stack.enter_context(
                fileio.NpyStream(
                    out / f"{tables['doc_codes']}.npy",
                    (int(doc_offsets[-1]),),
                    kmeans.code_dtype(c),
                )
            )
        for b, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            block = np.empty(int(ivf_offsets[hi] - ivf_offsets[lo]), np.int32)
            cursor = ivf_offsets[lo:hi] - ivf_offsets[lo]
            for i in shards:
                every, kept = _shard_pairs(store, codes, i, spans[i], beta_d, c)
                if b == 0 and doc_lists:
                    dc.write(every % c)
                cents = kept % c
                inside = (cents >= lo) & (cents < hi)
                cents, docs = cents[inside] - lo, kept[inside] // c + spans[i][2]
                fill_runs(block, cursor, cents, docs)  # documents come in increasing order
            ivf.write(block)
            del block
    fileio.atomic_save_npy(out / f"{tables['ivf_offsets']}.npy", ivf_offsets)
    if doc_lists:
        fileio.atomic_save_npy(out / f"{tables['doc_code_offsets']}.npy", doc_offsets)
    if residuals is not None:
        tables |= write_token_lists(
            store, codes, residuals, first_shard, name, out, c, beta_d, token_block_bytes
        )
    return {"first_shard": first_shard, "first_doc": int(first_doc), "tables": tables}


def _blocks(offsets: np.ndarray, entries: int) -> list[int]:
    """Bounds of the blocks of consecutive centroids (CSR ``offsets [C + 1]``) that hold at most
    ``entries`` entries each (one centroid at least)."""
    c, bounds = len(offsets) - 1, [0]
    while bounds[-1] < c:
        lo = bounds[-1]
        hi = int(np.searchsorted(offsets, offsets[lo] + entries, side="right")) - 1
        bounds.append(min(max(hi, lo + 1), c))
    return bounds


def _shard_tokens(store, codes, span: tuple, i: int, beta_d: float):
    """Shard ``i``'s β^d-kept tokens: (rows local to the shard, their centroid ids, their
    documents as store positions), rows in store order."""
    shard, token_start, doc_start = span
    salience, local = store.shard_arrays(i)[1:]
    rows = pruning.top_fraction_segments(salience, local, beta_d)
    cents = np.asarray(codes.span(token_start, token_start + shard["num_tokens"]), np.int64)
    docs = np.searchsorted(local, rows, side="right") - 1 + doc_start
    return rows, cents[rows], docs


def _token_offsets(store, codes, shards: range, beta_d: float, num_centroids: int) -> np.ndarray:
    """The token lists' CSR offsets ``[C + 1]`` over store shards ``shards``: one pass over
    their codes that counts each centroid's kept tokens."""
    spans = store.shard_spans()
    counts = np.zeros(num_centroids, np.int64)
    for i in shards:
        cents = _shard_tokens(store, codes, spans[i], i, beta_d)[1]
        counts += np.bincount(cents, minlength=num_centroids)
        codes.release()
    offsets = np.zeros(num_centroids + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets


def _place_tokens(cursor, cents, lo, hi, rows, docs, residuals, docs_out, residuals_out):
    """For each token t in order whose centroid ``cents[t]`` is in ``[lo, hi)``: its slot is
    ``cursor[cents[t] - lo]`` (then advanced), where its document and residual row go — what
    ``run_slots`` computes, in one pass without sorting (compiled with numba). Building the
    lists in memory at load: SciFact zero-shot (1.24M tokens, 243 MB) 0.77 → 0.12 s, the
    trained store grown 30× at 2 bits (19.2M tokens, 690 MB) 6.84 → 1.48 s, the same arrays
    (``benchmarks/results/scale_stop72/token_lists_in_memory_compiled_vs_numpy.txt``)."""
    for t in range(len(cents)):
        c = cents[t]
        if lo <= c < hi:
            slot = cursor[c - lo]
            cursor[c - lo] = slot + 1
            docs_out[slot] = docs[t]
            r = rows[t]
            for b in range(residuals.shape[1]):
                residuals_out[slot, b] = residuals[r, b]


if numba is not None:
    _place_tokens = numba.njit(cache=True, nogil=True)(_place_tokens)


def _token_block(store, codes, residuals, shards: range, beta_d: float, offsets, lo: int, hi: int):
    """The entries of centroids ``[lo, hi)`` of the token lists (``offsets``): (documents,
    packed residuals), each centroid's tokens in store order. One pass over the shards: each
    shard's codes and residuals are read, its tokens of the block placed (``_place_tokens``;
    NumPy's ``run_slots`` without numba), and the pages of mapped inputs released
    (``Segmented.release``), so that memory holds the block and one shard."""
    spans = store.shard_spans()
    size = int(offsets[hi] - offsets[lo])
    docs_block = np.empty(size, np.int32 if store.num_docs < 2**31 else np.int64)
    residual_block = np.empty((size, residuals.arrays[0].shape[1]), np.uint8)
    cursor = offsets[lo:hi] - offsets[lo]
    for i in shards:
        rows, cents, docs = _shard_tokens(store, codes, spans[i], i, beta_d)
        inside = (cents >= lo) & (cents < hi)
        if inside.any():
            start = spans[i][1]
            shard_residuals = residuals.span(start, start + spans[i][0]["num_tokens"])
            if numba is not None:
                _place_tokens(
                    cursor, cents, lo, hi, rows, docs, np.asarray(shard_residuals), docs_block,
                    residual_block,
                )  # fmt: skip
            else:
                slots = run_slots(cursor, cents[inside] - lo)
                docs_block[slots] = docs[inside]
                residual_block[slots] = shard_residuals[rows[inside]]
            del shard_residuals
        codes.release()
        residuals.release()
    return docs_block, residual_block


def token_lists_in_memory(store, codes, residuals, num_centroids: int, beta_d: float) -> TokenLists:
    """The token lists of every store shard built in memory (an index written without them):
    the offsets, then every centroid as one block (``_token_block``)."""
    shards = range(len(store.shard_spans()))
    offsets = _token_offsets(store, codes, shards, beta_d, num_centroids)
    docs, packed = _token_block(store, codes, residuals, shards, beta_d, offsets, 0, num_centroids)
    return TokenLists(offsets, docs, packed)


def write_clustered(
    store, codes, residuals, num_centroids: int, path: Path, block_bytes: int | None = None
) -> None:
    """Rewrites ``path``, the packed residuals of every store token (``residuals``, indexed by
    store row as ``codes``), grouped by centroid, each centroid's tokens in store order
    (``CentroidIndexConfig.cluster_order``): the token lists' residuals over every token
    (``write_token_lists`` without their documents), each block of consecutive centroids of
    at most ``block_bytes`` (default ``CLUSTER_BLOCK_BYTES``) filled by one pass over the
    shards (``_token_block``). The file is replaced when every block is written
    (``fileio.NpyStream``: until then it is read as it was)."""
    shards = range(len(store.shard_spans()))
    width = residuals.arrays[0].shape[1]
    offsets = _token_offsets(store, codes, shards, 1.0, num_centroids)
    per_block = max(1, (block_bytes or CLUSTER_BLOCK_BYTES) // (width + 4))
    total = int(offsets[-1])
    with (
        fileio.NpyStream(path, (total, width), np.uint8) as out,
        progress.Progress(total, "search index: residuals grouped by centroid", "token") as bar,
    ):
        bounds = _blocks(offsets, per_block)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            _, packed = _token_block(store, codes, residuals, shards, 1.0, offsets, lo, hi)
            out.write(packed)
            bar.update(len(packed))
            del packed


def _shard_runs(spans, shards: range, tokens: int) -> list[range]:
    """``shards`` cut into runs of consecutive shards holding at most ``tokens`` tokens each
    (one shard at least)."""
    runs, first, size = [], shards.start, 0
    for i in shards:
        n = spans[i][0]["num_tokens"]
        if i > first and size + n > tokens:
            runs.append(range(first, i))
            first, size = i, 0
        size += n
    if first < shards.stop:
        runs.append(range(first, shards.stop))
    return runs


def _run_bounds(spans, run: range) -> tuple[int, int, int, int]:
    """(first token, end token, first document, end document) of a run of store shards."""
    (_, first, first_doc), (last, start, doc_start) = spans[run[0]], spans[run[-1]]
    return first, start + last["num_tokens"], first_doc, doc_start + last["num_docs"]


def _kept_mask(store, spans, run: range, beta_d: float) -> np.ndarray | None:
    """Which tokens of a run of store shards β^d keeps (``pruning.top_fraction_segments`` of
    each shard's documents), or None where it keeps every token (the saliences not read)."""
    if beta_d >= 1.0:
        return None
    start, stop = _run_bounds(spans, run)[:2]
    mask = np.zeros(stop - start, bool)
    for i in run:
        salience, local = store.shard_arrays(i)[1:]
        mask[pruning.top_fraction_segments(salience, local, beta_d) + (spans[i][1] - start)] = 1
    return mask


def token_rows_in_memory(
    store,
    codes,
    residuals,
    num_centroids: int,
    beta_d: float,
    block_tokens: int | None = None,
    threads: int | None = None,
) -> list[TokenLists]:
    """The token lists by position, built in memory: for each segment of the index's
    ``residuals`` (``centroid_index.Segmented``), the lists of its shards' kept tokens with
    each token's document and its row in that segment (int32 below 2³¹ rows), the residuals
    read where they lie (``TokenLists.rows``). 8 bytes per kept token, whatever the bits and
    dimension: what a search holds where a copy of the residuals would not fit
    (``centroid_index.LISTS_IN_MEMORY_MAX``).

    Two passes over the segment's codes in runs of whole shards of at most ``block_tokens``
    tokens (default ``LOAD_BLOCK_TOKENS``; their mapped pages released after each run): one
    counts each centroid's kept tokens, one places them (``_place_rows``: each document's
    tokens in order, no per-token document lookup). β^d's selection is made once per shard,
    kept as one byte per token between the passes (none at β^d = 1). The placing pass is
    split by centroid between ``threads`` (default ``blas.threads()``, the search's
    ``--threads``): each reads the run's codes and writes only its centroids' slots, the
    scattered writes of one thread being what that pass waits on (63.9M tokens: 2.6 s of
    the build's 3.6 s in one thread).

    A segment grouped by centroid (``CentroidIndexConfig.cluster_order``; β^d = 1) holds its
    lists' residuals in list order already: its lists read them where they lie (no ``rows``),
    and the placing pass writes each token's position in the segment instead, the position
    map its store-order reads go through (``Segmented.set_positions``): 8 bytes per token
    as well."""
    block_tokens = block_tokens or LOAD_BLOCK_TOKENS
    spans = store.shard_spans()
    token_starts = np.array([span[1] for span in spans], np.int64)
    doc_dtype = np.int32 if store.num_docs < 2**31 else np.int64
    out = []
    for k, segment in enumerate(residuals.arrays):
        start, stop = int(residuals.starts[k]), int(residuals.starts[k + 1])
        shards = range(*np.searchsorted(token_starts, [start, stop]).tolist())
        runs = _shard_runs(spans, shards, block_tokens)
        masks = [_kept_mask(store, spans, run, beta_d) for run in runs]
        counts = np.zeros(num_centroids, np.int64)
        for run, kept in zip(runs, masks, strict=True):
            cents = codes.span(*_run_bounds(spans, run)[:2])
            counts += np.bincount(cents if kept is None else cents[kept], minlength=num_centroids)
            codes.release()
        offsets = np.zeros(num_centroids + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        clustered = residuals.clustered(k)
        if clustered and beta_d < 1.0:
            raise ValueError("a segment grouped by centroid holds every token: beta_d must be 1")
        docs_out = np.empty(int(offsets[-1]), doc_dtype)
        rows_out = np.empty(len(docs_out), np.int32 if stop - start < 2**31 else np.int64)
        cursor = offsets[:-1].copy()
        parts = _centroid_parts(offsets, threads or blas.threads())
        for run, kept in zip(runs, masks, strict=True):
            first, end, first_doc, end_doc = _run_bounds(spans, run)
            cents = np.asarray(codes.span(first, end))
            doc_offsets = store.offsets[first_doc : end_doc + 1] - first  # rows of the run
            if numba is not None:
                mask = _NO_MASK if kept is None else kept
                _place_in_parts(
                    parts, cursor, cents, mask, doc_offsets, first_doc, first - start, clustered,
                    docs_out, rows_out,
                )  # fmt: skip
            else:
                rows = np.arange(end - first) if kept is None else np.flatnonzero(kept)
                slots = run_slots(cursor, np.asarray(cents[rows], np.int64))
                docs_out[slots] = np.searchsorted(doc_offsets, rows, side="right") - 1 + first_doc
                if clustered:
                    rows_out[rows + (first - start)] = slots
                else:
                    rows_out[slots] = rows + (first - start)
            codes.release()
        if clustered:  # rows_out holds the position map
            residuals.set_positions(k, rows_out)
        out.append(
            TokenLists(offsets, docs_out, np.asarray(segment), None if clustered else rows_out)
        )
    return out


_NO_MASK = np.zeros(0, bool)


def _centroid_parts(offsets: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """Ranges of consecutive centroids holding about equal shares of the entries of CSR
    ``offsets`` (at most ``parts``, none empty of centroids)."""
    c = len(offsets) - 1
    cuts = np.searchsorted(offsets, offsets[-1] * np.arange(1, parts) / parts, side="left")
    bounds = np.unique(np.clip(np.r_[0, cuts, c], 0, c))
    return [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


def _place_in_parts(parts, cursor, cents, kept, doc_offsets, first_doc, first_row, inverse, *out):
    """``_place_rows`` of each centroid range of ``parts``, the first in this thread, the
    others in ``common.workers``' threads (the compiled pass releases the GIL; the ranges
    share no slot)."""
    args = (cursor, cents, kept, doc_offsets, first_doc, first_row, inverse)
    if len(parts) == 1:
        _place_rows(*args, *parts[0], *out)
        return
    pool = workers.pool(len(parts) - 1)
    futures = [pool.submit(_place_rows, *args, lo, hi, *out) for lo, hi in parts[1:]]
    _place_rows(*args, *parts[0], *out)
    for future in futures:
        future.result()


def _place_rows(
    cursor, cents, kept, doc_offsets, first_doc, first_row, inverse, lo, hi, docs_out, rows_out
):
    """``_place_tokens`` for the lists by position, over a run of whole documents: each kept
    token (every token where ``kept`` is empty) of document ``first_doc + d`` — rows
    ``doc_offsets[d]:doc_offsets[d + 1]`` of ``cents`` — whose centroid is in ``[lo, hi)``
    goes to its centroid's next slot, its document and its row in the segment (``first_row``
    + its row in the run); with ``inverse``, ``rows_out`` at that row gets the slot instead
    (a segment grouped by centroid: the position map)."""
    every = len(kept) == 0
    for d in range(len(doc_offsets) - 1):
        for t in range(doc_offsets[d], doc_offsets[d + 1]):
            c = cents[t]
            if (every or kept[t]) and lo <= c < hi:
                slot = cursor[c]
                cursor[c] = slot + 1
                docs_out[slot] = first_doc + d
                if inverse:
                    rows_out[first_row + t] = slot
                else:
                    rows_out[slot] = first_row + t


if numba is not None:
    _place_rows = numba.njit(cache=True, nogil=True)(_place_rows)


def write_token_lists(
    store,
    codes,
    residuals,
    first_shard: int,
    name: str,
    out: Path,
    num_centroids: int,
    beta_d: float,
    block_bytes: int | None = None,
) -> dict:
    """Writes the token lists of store shards ``first_shard:`` (see the module docstring) as
    ``out/<name>.tok_*.npy``; returns their tables. One pass over the shards' codes counts each
    centroid's kept tokens (``_token_offsets``); then each block of consecutive centroids whose
    entries hold at most ``block_bytes`` (default ``TOKEN_BLOCK_BYTES``; one centroid at least)
    is filled by one more pass (``_token_block``) and appended in file order, so that memory
    holds one block and one shard."""
    shards = range(first_shard, len(store.shard_spans()))
    width = residuals.arrays[0].shape[1]
    doc_dtype = np.int32 if store.num_docs < 2**31 else np.int64
    offsets = _token_offsets(store, codes, shards, beta_d, num_centroids)
    per_block = max(1, (block_bytes or TOKEN_BLOCK_BYTES) // (width + doc_dtype().itemsize))
    tables = {kind: f"{name}.{kind}" for kind in TOKEN_LISTS}
    total = int(offsets[-1])
    with (
        fileio.NpyStream(out / f"{tables['tok_docs']}.npy", (total,), doc_dtype) as doc_file,
        fileio.NpyStream(
            out / f"{tables['tok_residuals']}.npy", (total, width), np.uint8
        ) as residual_file,
    ):
        bounds = _blocks(offsets, per_block)
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            docs, packed = _token_block(store, codes, residuals, shards, beta_d, offsets, lo, hi)
            doc_file.write(docs)
            residual_file.write(packed)
            del docs, packed  # else they live while the next block fills: two blocks in memory
    fileio.atomic_save_npy(out / f"{tables['tok_offsets']}.npy", offsets)
    return tables


def groups_of(meta: dict) -> list[dict]:
    """The list groups of an index's metadata (formats up to 5: one group, in ``tables``)."""
    if "lists" in meta:
        return meta["lists"]
    t = meta["tables"]
    kinds = [k for k in IVF_LISTS + DOC_LISTS if k in t]
    return [{"first_shard": 0, "first_doc": 0, "tables": {k: t[k] for k in kinds}}]


def next_groups(
    store, codes, meta: dict, name: str, out: Path, new_shards: list[int], residuals=None
) -> list[dict]:
    """The list groups of an update that adds ``new_shards`` (store shard indices, the last
    ones): the full group kept and a delta group written over every shard added since the full
    group, or, when that delta would hold more than ``DELTA_FRACTION`` of the tokens, one full
    group written again (see the module docstring). Token lists are written where the index's
    settings ask for them (``token_lists``; ``residuals`` then indexes every token's)."""
    groups = groups_of(meta)
    spans = store.shard_spans()
    first = groups[1]["first_shard"] if len(groups) > 1 else new_shards[0]
    token_residuals = residuals if writes_lists(meta) else None
    write = lambda shard, doc_lists: write_group(  # noqa: E731
        store, codes, shard, f"{name}-{shard:05d}", out, meta["num_centroids"],
        meta["config"]["beta_d"], doc_lists, residuals=token_residuals,
    )  # fmt: skip
    if store.num_tokens - spans[first][1] > DELTA_FRACTION * store.num_tokens:
        return [write(0, meta["config"]["doc_lists_max_fraction"])]
    return [groups[0], write(first, "doc_codes" in groups[0]["tables"])]


def group_files(meta: dict) -> list[str]:
    """The file stems of every list group of ``meta``."""
    return [stem for g in groups_of(meta) for stem in g["tables"].values()]


# -- reading ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Group:
    first_doc: int
    ivf_offsets: np.ndarray  # read: [C + 1]
    ivf_docs: np.ndarray  # mapped
    doc_offsets: np.ndarray | None  # mapped, [group docs + 1]
    doc_codes: np.ndarray | None  # mapped
    tokens: TokenLists | None  # offsets read, documents and residuals mapped


class Lists:
    """An index's list groups, read as one set of lists (see the module docstring)."""

    def __init__(self, groups: list[_Group]):
        self.groups = groups
        self.first_docs = np.array([g.first_doc for g in groups], np.int64)
        # without lists in every group, centroid interaction reads the tokens' codes instead
        self.has_doc_lists = all(g.doc_codes is not None for g in groups)
        self.has_token_lists = all(g.tokens is not None for g in groups)

    @classmethod
    def open(cls, out: Path, meta: dict) -> Lists:
        """Maps the list files of ``meta``'s groups in ``out`` (the offsets of the inverted
        file read: C + 1 entries per group)."""
        groups = []
        for g in groups_of(meta):
            files = {kind: out / f"{stem}.npy" for kind, stem in g["tables"].items()}
            lists = "doc_codes" in files
            tokens = None
            if "tok_offsets" in files:  # plain arrays over the maps (numba takes no memmap)
                tokens = TokenLists(
                    fileio.load_npy(files["tok_offsets"], mmap=False),
                    np.asarray(fileio.load_npy(files["tok_docs"])),
                    np.asarray(fileio.load_npy(files["tok_residuals"])),
                )
            groups.append(
                _Group(
                    int(g["first_doc"]),
                    fileio.load_npy(files["ivf_offsets"], mmap=False),
                    fileio.load_npy(files["ivf_docs"]),
                    fileio.load_npy(files["doc_code_offsets"]) if lists else None,
                    fileio.load_npy(files["doc_codes"]) if lists else None,
                    tokens,
                )
            )
        return cls(groups)

    def token_lists(self) -> list[TokenLists] | None:
        """Every group's token lists (a document's tokens are all in the one group that holds
        it), or None when some group has none (an index built without ``token_lists``)."""
        return [g.tokens for g in self.groups] if self.has_token_lists else None

    @property
    def num_entries(self) -> int:
        """Entries of the inverted file (document, centroid pairs), every group's."""
        return sum(len(g.ivf_docs) for g in self.groups)

    def doc_code_count(self) -> int:
        """Entries of the document → centroid lists (0 without them)."""
        return sum(len(g.doc_codes) for g in self.groups if g.doc_codes is not None)

    def probe(self, centroids: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The documents of the inverted lists of ``centroids`` — concatenated in that order
        within each group, groups one after the other — and each entry's centroid's score
        (``scores``, one per centroid). A document's lists are all in one group, so its first
        entry is that of the first of ``centroids`` that lists it."""
        docs, values = [], []
        for g in self.groups:
            rows, lengths = concatenated_ranges(g.ivf_offsets, centroids)
            docs.append(np.asarray(g.ivf_docs[rows]))
            values.append(np.repeat(scores, lengths))
        if len(self.groups) == 1:
            return docs[0], values[0]
        return np.concatenate(docs), np.concatenate(values)

    def inverted_list(self, centroid: int) -> np.ndarray:
        """The documents of one centroid's list, sorted."""
        return self.probe(np.array([centroid]), np.zeros(1, np.float32))[0]

    def document_centroids(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The distinct centroid ids of each of ``docs`` (concatenated, in the order of
        ``docs``) and their counts; only with ``has_doc_lists``."""
        docs = np.asarray(docs, np.int64)
        if len(self.groups) == 1:
            g = self.groups[0]
            rows, lengths = concatenated_ranges(g.doc_offsets, docs)
            return np.asarray(g.doc_codes[rows]), lengths
        where = np.searchsorted(self.first_docs, docs, side="right") - 1
        lengths = np.empty(len(docs), np.int64)
        for k, g in enumerate(self.groups):
            local = docs[where == k] - g.first_doc
            lengths[where == k] = g.doc_offsets[local + 1] - g.doc_offsets[local]
        ends = np.zeros(len(docs) + 1, np.int64)
        np.cumsum(lengths, out=ends[1:])
        codes = np.empty(int(ends[-1]), self.groups[0].doc_codes.dtype)
        for k, g in enumerate(self.groups):
            mine = np.flatnonzero(where == k)
            rows, _ = concatenated_ranges(g.doc_offsets, docs[mine] - g.first_doc)
            codes[concatenated_ranges(ends, mine)[0]] = g.doc_codes[rows]
        return codes, lengths


def writes_lists(meta: dict) -> bool:
    """Whether the index of ``meta`` holds token lists (decided at its build; an index of
    format /6 written before that decision was recorded: its config's ``token_lists``)."""
    return bool(meta.get("token_lists", meta["config"].get("token_lists")))
