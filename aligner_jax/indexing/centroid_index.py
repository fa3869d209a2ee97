"""The compressed search index: token centroids, centroid ids, packed residuals and an inverted
file, persisted beside the token store (PLAID §4.1, WARP §3).

Built once from a complete token store (``aligner-index --index_dir=DIR --search_index``, or by
``aligner-eval`` the first time it searches a store) and loaded by every later search without
rebuilding anything:

  ``search_index/search_index-G.json``        generation G: settings, counts, its files with
                                              sizes and sha256, segments, update log (drift)
  ``search_index/centroids-G.npy``            float32 ``[C, D]`` (two-level spherical k-means)
  ``search_index/cells-G.npy``                float32 ``[cells, D]`` its coarse cells
  ``search_index/codec-G.npy``                float32 ``[2, D]`` residual grid (lower, step)
  ``search_index/segment-G.codes.npy``        uint16/int32 ``[T_G]`` centroid id of each token
  ``search_index/segment-G.residuals.npy``    uint8 ``[T_G, W]`` packed b-bit residuals, in
                                              store order, or grouped by centroid
                                              (``cluster_order``: the segment's ``order``)
  ``search_index/segment-G.salience.npy``     uint8 ``[T_G]`` u^d (models with saliences), in
                                              steps of the segment's ``salience_scale`` (its
                                              largest u^d / 255; 0 stays exactly 0)
  ``search_index/segment-G.means.npy``        float16 ``[N_G, D]`` each document's mean token
                                              vector, unit length (``doc_means``)
  ``search_index/lists-G-S.*.npy``           the inverted file (centroid → documents owning
                                              one of its tokens kept by β^d pruning) and the
                                              document → distinct centroid lists of store
                                              shards S.. (``inverted_lists``: a build writes
                                              one group, an ``--add`` a delta group) and, with
                                              ``token_lists``, its centroid → token lists

**One commit point.** Files are never rewritten: each build or update writes the files of a new
generation beside the current one, then publishes it by one atomic rename of the store's
``manifest.json``, whose ``search_index`` entry names the generation's metadata file and its
sha256 (``commit``); only then are the files no generation uses removed
(``collect_garbage``, which also removes what a killed writer left). A crash at any instant
leaves the previous manifest and every file it names: the index as it was, fully searchable.
A reader keeps the generation it opened (its files stay mapped even once removed).

**Bounded memory.** Every step streams over the store shard by shard: the k-means sample is
gathered shard by shard, in the store's float16, into a scratch file (``sample_file``: read a
chunk at a time, never resident as a whole; the k-means kernels read float32 chunks of it; the
codec's grid is fitted on at most ``CODEC_SAMPLE`` of its rows); codes, residuals and saliences
are computed per shard and appended to their segment files (written, never mapped); the
inverted file and the document → centroid lists are built in passes over the segments' codes,
one shard at a time, read with plain reads (``fileio.NpyRows``). Each shard is unmapped when
done, so the build's peak resident memory is O(centroids + one chunk of the sample + one shard +
one block of the inverted file (``inverted_lists.IVF_BLOCK_PAIRS`` entries, filled and written
block by block)), not O(tokens × D).
**Loading maps** every array (``mmap_mode='r'``): nothing is concatenated or copied, resident
memory after load is the centroid table plus what searches touch, and an index larger than RAM
answers from the page cache.

A segment covers consecutive store shards: the build writes one, each ``--add`` one more for
the new shards (compressed with the existing centroids) and a delta list group (so an ``--add``
reads and writes what it adds, not the index), so the files open at search time are a handful
per segment, not per shard. Deleted documents are tombstones of the store's manifest:
kept on disk, never returned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from pathlib import Path

import gin
import numpy as np
import scipy.sparse
from absl import logging

from aligner_jax.common import checks, errors, fileio, progress
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import pruning
from aligner_jax.indexing import codec as codec_lib
from aligner_jax.indexing import inverted_lists as lists_lib
from aligner_jax.indexing import kmeans
from aligner_jax.indexing import token_store as ts
from aligner_jax.indexing.sample_file import SampleFile

SUBDIR = "search_index"
DRIFT_LIMIT = 0.02  # drift above which --compact re-clusters (mean max centroid score)
LISTS_IN_MEMORY_MAX = 512 << 20  # bytes of token lists a search copies at load (past: by position)
FORMAT = "aligner_jax.indexing.centroid_index/7"
# /3: float16 saliences (no ``salience_scale``), still read segment by segment; /3 and /4 always
# hold document → centroid lists; up to /5 one list group named in ``tables``; up to /6 every
# segment in store order (/7: a segment's ``order`` may be ``clusters``, ``cluster_order``)
READABLE = (
    "aligner_jax.indexing.centroid_index/3",
    "aligner_jax.indexing.centroid_index/4",
    "aligner_jax.indexing.centroid_index/5",
    "aligner_jax.indexing.centroid_index/6",
    FORMAT,
)
CHUNK = 1 << 16  # tokens per assignment / compression step


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CentroidIndexConfig:
    """How the compressed index is built.

    Attributes:
      num_centroids: None = 2^⌊log2(centroids_per_sqrt_token·√T)⌋ for T indexed tokens, capped
        by ``max_centroid_product`` and ``centroid_bytes_per_token``.
      centroids_per_sqrt_token: 16, as PLAID. Centroid interaction (stage 3 of
        ``retrieval.centroid_search``) ranks with centroid scores alone, so finer centroids
        choose the refined documents better: on the trained 128-d SciFact store, SciFact
        *train* queries (809), 16 against 8 gives nDCG@10 75.98 vs 75.48 (exhaustive 76.16)
        and top-10 agreement with exhaustive search 92.4 % vs 91.1 %, at the same probes and
        refinement counts, for +0.2 ms per query and a 3× longer k-means.
      max_centroid_product: at most the largest power of two C with C·D ≤ this (D: the vector
        dimension), a cap on the query–centroid product per query token: 2^23 (65,536
        centroids at 128-d, from 16.8M tokens; 16,384 at 384-d). Past the cap the inverted
        lists lengthen with the corpus, and a query token's automatic reach, counted in
        documents (``centroid_search.reach_factor``), takes fewer probes. Finer centroids at
        the same reach buy little: the trained 128-d store grown 10× (6.4M tokens, SciFact's
        train queries, ``benchmarks/results/tune_stop66/centroids``) with 65,536 centroids
        instead of its 32,768 (27 probes instead of 14) gave a k = 10 search's top-10 overlap
        with exhaustive search 0.865 → 0.866 and a k = 100 search's top-100 overlap 0.714 →
        0.728, for p50 10.1 → 13.6 ms (k = 10) and 24.8 → 31.5 ms (k = 100). Where the cap
        binds, halving it trades recall for speed (``benchmarks/results/scale_stop72``: the
        trained store grown 30× and 100×, 32,768 centroids against 65,536, searches timed
        interleaved in one process): at 4 bits 1.13–1.25× faster at k = 10 and 1.15–1.26× at
        k = 100, for a k = 10 search's top-10 overlap −0.036 / −0.034 (test queries; −0.009 on
        200 train queries at 100×) and R@100 ±0.0 / −1.0; at 2 bits, where candidates are
        ranked by centroid scores, −5 points of R@100 and −2.9 of nDCG@10 at 30×. Not adopted:
        ``--gin.CentroidIndexConfig.max_centroid_product=6291456`` (16,384 × 384) builds it.
      centroid_bytes_per_token: and with 4·C·D ≤ this × T, a cap on the float32 centroid
        table's share of the index size. 16 bytes per token holds 384-d stores at the count
        their size affords (SciFact zero-shot, 1.24M tokens: 8,192 rather than 16,384, whose
        product alone would cost about half of the 10 ms query budget; CISI zero-shot, 219k
        tokens: 2,048, where 4,096 centroids would add 29 bytes per token and make the index
        larger per token than FastPlaid's) and leaves 128-d stores at 16·√T (SciFact trained
        16,384, CISI trained 4,096).
      cells: coarse cells of the two-level k-means (``kmeans.fit_two_level``); None =
        2^⌊log2(C)/2⌋ (128 cells of 128 centroids at C = 16,384); 1 = one-level k-means
        (every token compared with every centroid: T·C·D, days at 100M tokens).
      kmeans_iterations: k-means iterations on the sample.
      sample_per_centroid: k-means sample size = this × centroids (≤ all indexed tokens).
      residual_bits: 2, 4 (default, as FastPlaid and WARP) or 8 bits per residual dimension.
      beta_d: fraction of each document's tokens (top by salience) in the inverted file (§3.2);
        refinement still scores every stored token.
      doc_lists_max_fraction: the document → distinct centroid lists are stored only when they
        hold at most this fraction of the tokens; otherwise centroid interaction reads the
        tokens' own codes (a max over a document's tokens equals the max over its distinct
        centroids, so rankings are the same), saving 2 bytes per token (4 above 65,536
        centroids) where almost every token is its own (document, centroid) pair: SciFact's
        1.24M trained tokens at 16,384 centroids make 0.44 pairs per token (lists kept, they
        halve the interaction's reads); its 100× scale store at 65,536 makes 0.99 (dropped).
      token_lists: also write each list group's centroid → token lists (its β^d-kept tokens'
        documents and packed residuals in centroid order, WARP's layout; ``inverted_lists``),
        which ``CentroidSearchConfig.residual_candidates`` and ``SearchConfig.refine='xtr'``
        then map instead of building them in memory at load (a copy of every kept token's
        residual and document: W + 4 bytes per kept token in memory, and a sort of every code,
        at each load). Costs those bytes again on disk. None (the default,
        ``writes_token_lists``): written when that copy would exceed ``LISTS_IN_MEMORY_MAX``
        (where a search would otherwise read the lists by position: one scattered read per
        probed token, ``CentroidSearcher.token_lists``) and the residuals take more than 2
        bits; a 2-bit index stays compact (its lists would double it: 40 → 76 B per token at
        128-d). SciFact zero-shot grown 10× (12.4M tokens, 384-d, 4 bits):
        top-10 overlap with exhaustive search 0.881 → 0.968, R@100 88 → 94 (exhaustive 94),
        p50 at k = 100 32.8 → 26.5 ms, for 200 → 396 B per token on disk
        (``benchmarks/results/scale_stop59``).
      doc_means: also write each document's mean token vector, normalised (float16, 2·D bytes
        per document: 2.1 per token on the trained 128-d SciFact store, 3.2 on the zero-shot
        384-d one), which stage 2 of ``retrieval.centroid_search`` adds to its estimate
        (``CentroidSearchConfig.mean_weight``). None (the default, ``writes_doc_means``):
        written unless the residuals take 2 bits (the compact index: 39 → 41 B per token at
        128-d).
      cluster_order: write the segment's residuals grouped by centroid (each centroid's
        tokens in store order; the segment's ``"order": "clusters"``) instead of in store
        order, the same bytes: a search then reads each probed cluster's residuals as one run
        where they lie, with no copy of them (WARP's layout without ``token_lists``' second copy),
        and finds a token's residual for refinement through a position map it builds at load
        (4 bytes per token in memory, in place of the 4 of the lists by position's rows:
        ``Segmented``, ``inverted_lists.token_rows_in_memory``). None (the default,
        ``writes_cluster_order``): where a search would otherwise read the lists by position
        (no ``token_lists``, β^d = 1, their copy over ``LISTS_IN_MEMORY_MAX``). Requires β^d
        = 1 and no ``token_lists``. Segments an ``--add`` writes stay in store order.
      seed: k-means initialisation and sampling.
    """

    num_centroids: int | None = None
    centroids_per_sqrt_token: float = 16.0
    max_centroid_product: int = 1 << 23
    centroid_bytes_per_token: float = 16.0
    cells: int | None = None
    kmeans_iterations: int = 8
    sample_per_centroid: int = 32
    residual_bits: int = 4
    beta_d: float = 1.0
    doc_lists_max_fraction: float = 0.75
    token_lists: bool | None = None
    doc_means: bool | None = None
    cluster_order: bool | None = None
    seed: int = 0

    def __post_init__(self):
        name = type(self).__name__
        checks.choice(f"{name}.residual_bits", self.residual_bits, codec_lib.BITS)
        checks.integer(f"{name}.num_centroids", self.num_centroids, minimum=1, allow_none=True)
        checks.integer(f"{name}.cells", self.cells, minimum=1, allow_none=True)
        for field in ("centroids_per_sqrt_token", "centroid_bytes_per_token"):
            checks.number(f"{name}.{field}", getattr(self, field), 0.0, low_open=True)
        checks.number(f"{name}.beta_d", self.beta_d, 0.0, 1.0, low_open=True)
        checks.number(f"{name}.doc_lists_max_fraction", self.doc_lists_max_fraction, 0.0, 1.0)
        if self.token_lists is not None and not isinstance(self.token_lists, bool):
            raise ConfigError(
                f"{checks.flag(name + '.token_lists', self.token_lists)}: expected True, False "
                "or None (written where a search could not hold them in memory)"
            )
        if self.doc_means is not None and not isinstance(self.doc_means, bool):
            raise ConfigError(
                f"{checks.flag(name + '.doc_means', self.doc_means)}: expected True, False "
                "or None (written unless the residuals take 2 bits)"
            )
        if self.cluster_order is not None and not isinstance(self.cluster_order, bool):
            raise ConfigError(
                f"{checks.flag(name + '.cluster_order', self.cluster_order)}: expected True, "
                "False or None (where a search would read the lists by position)"
            )
        if self.cluster_order and (self.beta_d < 1.0 or self.token_lists):
            raise ConfigError(
                f"{name}.cluster_order=True needs beta_d=1.0 and token_lists other than True "
                f"(got beta_d={self.beta_d}, token_lists={self.token_lists})"
            )
        for field in ("kmeans_iterations", "sample_per_centroid", "max_centroid_product"):
            checks.integer(f"{name}.{field}", getattr(self, field), minimum=1)
        checks.integer(f"{name}.seed", self.seed)


def kept_rows(store: ts.TokenStore, beta_d: float) -> np.ndarray:
    """Global rows kept by β^d pruning, computed shard by shard (O(kept) memory)."""
    return np.concatenate([np.zeros(0, np.int64), *kept_rows_by_shard(store, beta_d)])


def kept_rows_by_shard(store: ts.TokenStore, beta_d: float):
    """The global rows kept by β^d pruning, one array per shard in store order."""
    for i, (_, token_start, _) in enumerate(store.shard_spans()):
        salience, local = store.shard_arrays(i)[1:]
        yield pruning.top_fraction_segments(salience, local, beta_d) + token_start


class Segmented:
    """Rows of several memory-mapped arrays read as one (``codes``, ``residuals`` and
    ``salience`` of the segments, in store order); ``[rows]`` gathers any rows.

    ``scales`` (one per segment, or None): the arrays hold quantised values, read as float32
    ``value × scale`` (a None scale: that segment's values as stored).

    ``orders`` (one per segment, or None): for a segment written grouped by centroid
    (``CentroidIndexConfig.cluster_order``), the codes of its tokens in store order, from which
    its position map (store row → row of the array: ``cluster_positions``) is made on first
    read, unless a search handed it over first (``set_positions``); None: store order."""

    def __init__(
        self,
        arrays: list[np.ndarray],
        scales: list[float | None] | None = None,
        orders: list | None = None,
    ):
        self.arrays = arrays
        self.scales = scales if scales and any(x is not None for x in scales) else None
        self.starts = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)
        self.orders = orders or [None] * len(arrays)
        self._positions = [None] * len(arrays)
        self._lock = threading.Lock()

    def clustered(self, k: int) -> bool:
        """Whether segment ``k``'s rows lie grouped by centroid (read through its positions)."""
        return self.orders[k] is not None

    def set_positions(self, k: int, positions: np.ndarray) -> None:
        """Segment ``k``'s position map, built elsewhere (``token_rows_in_memory``)."""
        self._positions[k] = positions

    def positions_nbytes(self) -> int:
        """Bytes of the position maps made or handed over so far."""
        return sum(p.nbytes for p in self._positions if p is not None)

    def positions(self, k: int) -> np.ndarray:
        """Segment ``k``'s position map: the row of its array holding each store row."""
        with self._lock:
            if self._positions[k] is None:
                self._positions[k] = cluster_positions(np.asarray(self.orders[k]))
            return self._positions[k]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _read(self, k: int, rows) -> np.ndarray:
        array = self.arrays[k]
        if self.orders[k] is not None:  # grouped by centroid: store rows through the map
            rows = self.positions(k)[rows]
        if isinstance(rows, slice) or np.asarray(rows).dtype == bool:
            values = array[rows]
        else:  # np.take gathers rows about twice as fast as fancy indexing (29k rows of 192 B)
            values = np.take(np.asarray(array), rows, 0)
        if self.scales is None:
            return values
        scale = self.scales[k]
        return values.astype(np.float32) if scale is None else values * np.float32(scale)

    def __getitem__(self, rows) -> np.ndarray:
        if len(self.arrays) == 1:
            return self._read(0, rows)
        rows = np.asarray(rows)
        rows = np.flatnonzero(rows) if rows.dtype == bool else rows.astype(np.int64)
        seg = np.searchsorted(self.starts, rows, side="right") - 1
        first = self.arrays[0]
        dtype = first.dtype if self.scales is None else np.float32
        out = np.empty((len(rows),) + first.shape[1:], dtype)
        for k in np.unique(seg):
            sel = seg == k
            out[sel] = self._read(k, rows[sel] - self.starts[k])
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """Every row in memory (small indexes and tests; searches gather rows instead)."""
        whole = np.concatenate([self._read(k, slice(None)) for k in range(len(self.arrays))])
        return whole if dtype is None else whole.astype(dtype)

    def release(self) -> None:
        """Drops the pages of the mapped segments from the process's resident set
        (``fileio.release_pages``), e.g. after a pass over every row."""
        for array in self.arrays:
            fileio.release_pages(array)

    def span(self, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` (a view when they lie in one segment and are not scaled),
        read as one contiguous slice of each segment they cover."""
        parts = []
        while True:
            k = min(
                int(np.searchsorted(self.starts, start, side="right")) - 1, len(self.arrays) - 1
            )
            end = min(stop, int(self.starts[k + 1]))
            parts.append(self._read(k, slice(start - self.starts[k], end - self.starts[k])))
            if end >= stop:
                return parts[0] if len(parts) == 1 else np.concatenate(parts)
            start = end


def cluster_positions(codes: np.ndarray) -> np.ndarray:
    """Where each token lies in a segment grouped by centroid (``cluster_order``): the stable
    order of ``codes`` inverted (int32 below 2³¹ tokens)."""
    order = np.argsort(codes, kind="stable")
    positions = np.empty(len(codes), np.int32 if len(codes) < 2**31 else np.int64)
    positions[order] = np.arange(len(codes), dtype=positions.dtype)
    return positions


class CentroidIndex:
    """A loaded compressed index over a token store (see the module docstring)."""

    def __init__(self, directory: Path, meta: dict, arrays: dict):
        self.directory = Path(directory)
        self.meta = meta
        self.centroids = arrays["centroids"]
        self.cells = arrays["cells"]
        self.codec = arrays["codec"]
        self.codes = arrays["codes"]  # Segmented [T]: every token, store order
        self.residuals = arrays["residuals"]  # Segmented [T, W]
        self.salience = arrays.get("salience")  # Segmented [T] (float32 when read), or None
        self.means = arrays.get("means")  # Segmented [N, D] float16 (``doc_means``), or None
        # the inverted file and the document → distinct centroid lists (``inverted_lists``)
        self.lists = arrays["lists"]

    @property
    def num_centroids(self) -> int:
        return len(self.centroids)

    def nbytes(self) -> int:
        return int(sum(f["bytes"] for f in self.meta["files"].values()))

    # -- building -------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        store: ts.TokenStore,
        config: CentroidIndexConfig | None = None,
        commit: bool = True,
        split=None,
    ) -> CentroidIndex | None:
        """Two-level k-means on a sample of the kept tokens (gathered shard by shard), then every
        token's code, residual (and salience) streamed into one segment, then the inverted
        file; memory bounded as the module docstring says. Every file is new (named by the new
        generation); ``commit`` then publishes the index in the store's manifest (``commit``)
        and removes the files of the index it replaces.

        ``split`` (``distributed_build.ProcessSplit``): every process of a multi-process job
        calls ``build`` with it; the k-means work and the shards' compression are split among
        them, process 0 writes the rest and returns the index, the others return None."""
        config = config or CentroidIndexConfig()
        pointer = store.manifest.get("search_index") or {}
        gen = int(pointer.get("generation", 0)) + 1
        start = time.perf_counter()
        spans = store.shard_spans()
        kept_counts = np.zeros(len(spans) + 1, np.int64)
        for i in range(len(spans)):
            if config.beta_d >= 1.0:
                kept_counts[i + 1] = spans[i][0]["num_tokens"]
            else:
                salience, local = store.shard_arrays(i)[1:]
                kept_counts[i + 1] = len(
                    pruning.top_fraction_segments(salience, local, config.beta_d)
                )
        np.cumsum(kept_counts, out=kept_counts)
        total_kept = int(kept_counts[-1])
        if not total_kept:
            raise ConfigError(f"{store.directory}: the store holds no tokens to index")
        table_cap = config.centroid_bytes_per_token * total_kept / 4  # float32 entries
        c = config.num_centroids or kmeans.default_num_centroids(
            total_kept,
            config.centroids_per_sqrt_token,
            store.dim,
            min(config.max_centroid_product, table_cap),
        )
        c = min(c, total_kept)
        rng = np.random.default_rng(config.seed)
        size = min(total_kept, config.sample_per_centroid * c)
        picks = np.sort(rng.choice(total_kept, size, replace=False))  # positions among kept rows
        out = Path(store.directory) / SUBDIR
        out.mkdir(exist_ok=True)
        # the sample in the store's own precision, in a scratch file (out of resident memory)
        with SampleFile(out, (size, store.dim), ts.VECTOR_DTYPE) as sample:
            _gather_kept(store, picks, kept_counts, config.beta_d, sample)
            cells = config.cells or kmeans.default_cells(c)
            centroids, cell_centroids = kmeans.fit_two_level(
                sample, c, min(cells, c), config.kmeans_iterations, config.seed,
                split or kmeans.SERIAL,
            )  # fmt: skip
            codec = _fit_codec(sample, centroids, cell_centroids, config.residual_bits, rng)
        if split is not None:  # process 0's tables, whatever another host's arithmetic gave
            centroids, cell_centroids, codec = split.share(centroids, cell_centroids, codec)
        kmeans_s = time.perf_counter() - start
        salience = store.has_saliences
        scale = salience_scale(store, range(len(spans))) if salience else None
        score = _ScoreMean()
        means = writes_doc_means(config)
        write_segment = _write_segment if split is None else split.write_segment
        segment = write_segment(
            store, range(len(spans)), f"segment-{gen:05d}", centroids, cell_centroids, codec, out,
            scale, score, means,
        )  # fmt: skip
        if segment is None:  # a process of a ``split`` job other than 0: its part is written
            return None
        tables = {kind: f"{kind}-{gen:05d}" for kind in ("centroids", "cells", "codec")}
        fileio.atomic_save_npy(out / f"{tables['centroids']}.npy", centroids)
        fileio.atomic_save_npy(out / f"{tables['cells']}.npy", cell_centroids)
        fileio.atomic_save_npy(out / f"{tables['codec']}.npy", np.stack([codec.lower, codec.step]))
        lists = writes_token_lists(config, total_kept, store.dim)
        meta = {
            "format": FORMAT,
            "generation": gen,
            "tables": tables,
            "config": dataclasses.asdict(config),
            "token_lists": lists,  # config's rule decided at this build (updates follow it)
            "doc_means": means,  # the same
            "num_centroids": len(centroids),
            "num_cells": len(cell_centroids),
            "dim": store.dim,
            "salience": salience,
            "store_fingerprint": store.manifest["model"].get("fingerprint"),
            # mean max centroid score of tokens the k-means never saw: the reference of the
            # drift measure (the sample's fit the centroids better; _held_out_score)
            "mean_centroid_score": _held_out_score(
                store, picks, kept_counts, config, centroids, cell_centroids, score
            ),
            "segments": [segment],
            "updates": [
                {
                    "op": "build",
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "num_docs": store.num_docs,
                    "num_tokens": store.num_tokens,
                    "kmeans_s": round(kmeans_s, 3),
                    "seconds": round(time.perf_counter() - start, 3),
                }
            ],
        }
        meta["lists"] = [
            lists_lib.write_group(
                store, _segment_rows(out, meta), 0, f"lists-{gen:05d}-00000", out, len(centroids),
                config.beta_d, config.doc_lists_max_fraction,
                residuals=_segment_rows(out, meta, "residuals") if lists else None,
            )
        ]  # fmt: skip
        if writes_cluster_order(config, total_kept, store.dim):
            _group_by_centroid(store, out, meta, segment, len(centroids))
        index = cls._finish(out, meta)
        if commit:
            index.commit(store)
        logging.info(
            "search index: %d centroids in %d cells, %d-bit residuals, %d tokens in %.1fs "
            "(k-means %.1fs)",
            len(centroids),
            len(cell_centroids),
            config.residual_bits,
            store.num_tokens,
            time.perf_counter() - start,
            kmeans_s,
        )
        return index

    @classmethod
    def _finish(cls, out: Path, meta: dict) -> CentroidIndex:
        """Writes the generation's metadata file (every file it names hashed) and returns the
        index, loaded (mapped) from what was written. Nothing is published: see ``commit``."""
        gen = meta["generation"]
        names = list(meta["tables"].values()) + lists_lib.group_files(meta)
        for g in meta["segments"]:
            names += [f"{g['name']}.{kind}" for kind in _segment_kinds(meta) + _doc_kinds(meta)]
        meta["files"] = {n: _file_entry(out / f"{n}.npy") for n in names}
        meta_path = out / f"{SUBDIR}-{gen:05d}.json"
        fileio.atomic_write_json(meta_path, meta)
        # hashed just now from the bytes written: the first load need not hash them again
        fileio.record_verified(
            {out / f"{n}.npy": e["sha256"] for n, e in meta["files"].items()},
            meta_path,
            out / ts.VERIFIED,
        )
        return cls._open(out, meta)

    @property
    def meta_path(self) -> Path:
        return self.directory / f"{SUBDIR}-{self.meta['generation']:05d}.json"

    def pointer(self) -> dict:
        """The manifest's ``search_index`` entry that publishes this index."""
        return {
            "meta": f"{SUBDIR}/{self.meta_path.name}",
            "sha256": fileio.sha256_tracked(self.meta_path),
            "generation": self.meta["generation"],
        }

    def commit(self, store: ts.TokenStore, manifest: dict | None = None) -> None:
        """Publishes this index: one atomic rename of the store's manifest (``manifest``, the
        store's own by default, with this index's ``pointer``) — the commit point of every
        change to an index directory. Then removes what no generation needs any more
        (``collect_garbage``).

        Publishing the store's own manifest refuses (``LockedError``, nothing published) when
        the committed one has changed since ``store`` was opened: another process's update
        committed meanwhile, and this manifest would undo it."""
        if manifest is None:
            _check_unchanged(store)
        manifest = dict(store.manifest if manifest is None else manifest)
        manifest["search_index"] = self.pointer()
        ts.write_manifest(store.directory, manifest)
        store.manifest = ts.read_manifest(store.directory)  # the store view is the committed one
        collect_garbage(store.directory)

    # -- updates ----------------------------------------------------------------------------------
    def update(self, store: ts.TokenStore, op: str, **record) -> CentroidIndex:
        """The next generation of this index for ``store`` (the store after ``aligner-index
        --add/--delete``, usually a pending manifest not yet committed): the store's new shards
        compressed with the existing centroids into a new segment, the lists of the documents
        added since the last full list write written as a delta group
        (``inverted_lists.next_groups``), the update logged with its centroid drift (``drift``).
        Written beside the current generation, not published: the caller commits it together
        with the store's manifest (``commit``)."""
        meta = json.loads(json.dumps(self.meta))  # a copy: this generation stays as it is
        gen = meta["generation"] + 1
        meta["generation"] = gen
        meta["format"] = FORMAT  # older generations' segments and tables are read as they are
        meta["config"].setdefault("doc_lists_max_fraction", 1.0)  # /3, /4: lists always kept
        meta["lists"] = lists_lib.groups_of(meta)  # up to /5: one group named in ``tables``
        for kind in lists_lib.IVF_LISTS + lists_lib.DOC_LISTS:
            meta["tables"].pop(kind, None)
        known = {name for g in meta["segments"] for name in g["shards"]}
        new = [i for i, (sh, _, _) in enumerate(store.shard_spans()) if sh["name"] not in known]
        if new:
            score = _ScoreMean()
            meta["segments"].append(
                _write_segment(
                    store,
                    new,
                    f"segment-{gen:05d}",
                    np.asarray(self.centroids),
                    np.asarray(self.cells),
                    self.codec,
                    self.directory,
                    salience_scale(store, new) if meta["salience"] else None,
                    score,
                    meta.get("doc_means", False),
                )  # fmt: skip
            )
            record.update(
                new_tokens=score.count,
                mean_centroid_score=score.mean,
                drift=meta["mean_centroid_score"] - score.mean,
            )
            meta["lists"] = lists_lib.next_groups(
                store, _segment_rows(self.directory, meta), meta, f"lists-{gen:05d}",
                self.directory, new, _segment_rows(self.directory, meta, "residuals"),
            )  # fmt: skip
            record["list_groups"] = len(meta["lists"])
        record.update(op=op, time=time.strftime("%Y-%m-%dT%H:%M:%S"))
        meta["updates"].append(record)
        return CentroidIndex._finish(self.directory, meta)

    def drift(self) -> float:
        """How much worse the centroids fit the tokens added since the build: the mean max
        centroid score of build-time tokens outside the k-means sample (``_held_out_score``)
        minus that of all added tokens (token-weighted); 0 without additions. ``--compact``
        re-clusters when it exceeds ``DRIFT_LIMIT``."""
        adds = [u for u in self.meta["updates"] if u.get("new_tokens")]
        if not adds:
            return 0.0
        tokens = sum(u["new_tokens"] for u in adds)
        mean = sum(u["mean_centroid_score"] * u["new_tokens"] for u in adds) / tokens
        return self.meta["mean_centroid_score"] - mean

    # -- loading --------------------------------------------------------------------------------
    @classmethod
    def exists(cls, store_dir: Path) -> bool:
        """Whether the store's manifest publishes a search index."""
        path = Path(store_dir) / ts.MANIFEST
        return path.exists() and bool(ts.read_manifest(store_dir).get("search_index"))

    @classmethod
    def load_unchecked(cls, store: ts.TokenStore) -> CentroidIndex:
        """Loads the index even when it does not cover every token of ``store`` (a pending
        manifest of an update)."""
        return cls.load(store, _check_store=False)

    @classmethod
    def load(
        cls, store: ts.TokenStore, verify_checksums: bool = False, _check_store: bool = True
    ) -> CentroidIndex:
        """Maps the index the store's manifest publishes (the generation the store was opened
        at: a reader keeps it while writers commit newer ones): sizes always checked; every
        file's sha256 on the first open and whenever a file changed (``fileio.verify_once``),
        always with ``verify_checksums``."""
        out = Path(store.directory) / SUBDIR
        rebuild = f"aligner-index --index_dir={store.directory} --search_index"
        pointer = store.manifest.get("search_index")
        if not pointer:
            raise errors.IndexIntegrityError(
                f"{store.directory}: the index has no search index (or one of an older "
                f"version); build it with {rebuild}"
            )
        path = Path(store.directory) / pointer["meta"]
        try:
            digest = fileio.sha256_tracked(path)
        except FileNotFoundError as e:
            raise errors.IndexIntegrityError(
                f"{path} (the search index {store.directory / ts.MANIFEST} publishes) does not "
                f"exist; rebuild it with {rebuild}"
            ) from e
        if digest != pointer.get("sha256"):
            raise errors.IndexIntegrityError(
                f"{path} is not the file {store.directory / ts.MANIFEST} published (altered, or "
                f"copied from another index); rebuild it with {rebuild}"
            )
        try:
            meta = json.loads(path.read_text())
            if meta.get("format") not in READABLE:
                raise errors.IndexIntegrityError(
                    f"{path}: format {meta.get('format')!r}, this version reads {FORMAT!r}; "
                    f"rebuild it with {rebuild}"
                )
            other = meta["store_fingerprint"] != store.manifest["model"].get("fingerprint")
            files = {out / f"{n}.npy": (e["bytes"], e["sha256"]) for n, e in meta["files"].items()}
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise errors.IndexIntegrityError(
                f"{path}: damaged ({type(e).__name__}: {e}); rebuild it with {rebuild}"
            ) from e
        if other:
            raise errors.IndexIntegrityError(
                f"{path}: built for another model's token store; rebuild it with {rebuild}"
            )
        for f, (size, _) in files.items():
            if not f.exists() or f.stat().st_size != size:
                raise errors.IndexIntegrityError(
                    f"{f} is missing or has another size than {path} records; rebuild it with "
                    f"{rebuild}"
                )
        # sha256 on the first open (and whenever a file changed), then a record: as the store
        fileio.verify_once(
            {f: digest for f, (_, digest) in files.items()},
            path,
            out / ts.VERIFIED,
            force=verify_checksums,
            log=logging.warning,
        )
        index = cls._open(out, meta)
        if _check_store and len(index.codes) != store.num_tokens:
            raise errors.IndexIntegrityError(
                f"{path}: {len(index.codes)} tokens, the store has {store.num_tokens}; rebuild "
                f"it with {rebuild}"
            )
        return index

    @classmethod
    def open_snapshot(
        cls,
        directory: Path,
        verify_checksums: bool = False,
        attempts: int = 5,
        store: ts.TokenStore | None = None,
    ) -> tuple[ts.TokenStore, CentroidIndex]:
        """The store and search index of the generation committed last, opened together. A
        writer may commit (and remove the files of the generation this reader was about to
        map) between reading the manifest and mapping the index: then the newer manifest is
        read and the open retried; once mapped, a generation stays readable."""
        for attempt in range(attempts):
            if store is None or attempt:  # ``store``: one the caller opened just before
                store = ts.TokenStore(directory, verify_checksums=verify_checksums)
            try:
                return store, cls.load(store, verify_checksums=verify_checksums)
            except (errors.IndexIntegrityError, FileNotFoundError):
                current = ts.read_manifest(directory).get("search_index")
                if attempt + 1 == attempts or current == store.manifest.get("search_index"):
                    raise  # not a commit in between: the index is damaged
        raise AssertionError("unreachable")

    @classmethod
    def _open(cls, out: Path, meta: dict) -> CentroidIndex:
        """Maps the files of ``meta`` (small tables read, large arrays mapped)."""
        mapped = lambda n: fileio.load_npy(out / f"{n}.npy")  # noqa: E731
        read = lambda n: fileio.load_npy(out / f"{n}.npy", mmap=False)  # noqa: E731
        t = meta["tables"]
        lower, step = read(t["codec"])
        arrays = {
            "centroids": read(t["centroids"]),
            "cells": read(t["cells"]),
            "codec": codec_lib.ResidualCodec(meta["config"]["residual_bits"], lower, step),
            "lists": lists_lib.Lists.open(out, meta),
        }
        for kind in _segment_kinds(meta):
            scales = (
                [g.get("salience_scale") for g in meta["segments"]] if kind == "salience" else None
            )
            orders = (  # segments grouped by centroid: read through their codes
                [
                    codes if g.get("order") == "clusters" else None
                    for g, codes in zip(meta["segments"], arrays["codes"].arrays, strict=True)
                ]
                if kind == "residuals"
                else None
            )
            arrays[kind] = Segmented(
                [mapped(f"{g['name']}.{kind}") for g in meta["segments"]], scales, orders
            )
        for kind in _doc_kinds(meta):  # one row per document, segments in store order
            arrays[kind] = Segmented([mapped(f"{g['name']}.{kind}") for g in meta["segments"]])
        return cls(out, meta, arrays)


# k-means sample rows whose residuals set the codec's grid (a 128 MiB float32 copy at 128-d)
CODEC_SAMPLE = 1 << 18


def _fit_codec(sample, centroids, cells, bits: int, rng) -> codec_lib.ResidualCodec:
    """The residual codec's grid (per-dimension quantiles) fitted on the residuals of the k-means
    sample, or of ``CODEC_SAMPLE`` random rows of it: a float32 copy of at most that many rows."""
    rows = np.arange(len(sample))
    if len(rows) > CODEC_SAMPLE:
        rows = np.sort(rng.choice(len(rows), CODEC_SAMPLE, replace=False))
    residuals = np.empty((len(rows), sample.shape[1]), np.float32)
    for lo in range(0, len(rows), CHUNK):
        part = np.asarray(sample[rows[lo : lo + CHUNK]], np.float32)
        codes, _ = kmeans.assign_two_level(part, centroids, cells)
        residuals[lo : lo + CHUNK] = part - centroids[codes]
    return codec_lib.ResidualCodec.fit(residuals, bits)


def _segment_rows(out: Path, meta: dict, kind: str = "codes") -> Segmented:
    """Every token's centroid id (or packed residual: ``kind``), the segments' files read as
    one, for the list writer's passes over the shards: read shard by shard, never mapped (a
    mapping's touched pages would stay resident: 248 MB of codes at 124M tokens)."""
    return Segmented([fileio.NpyRows(out / f"{g['name']}.{kind}.npy") for g in meta["segments"]])


def _segment_kinds(meta: dict) -> tuple[str, ...]:
    """A segment's files with one row per token."""
    return ("codes", "residuals", "salience") if meta.get("salience") else ("codes", "residuals")


def _doc_kinds(meta: dict) -> tuple[str, ...]:
    """A segment's files with one row per document."""
    return ("means",) if meta.get("doc_means") else ()


def document_sums(vectors: np.ndarray, offsets: np.ndarray, start: int = 0) -> np.ndarray:
    """The sum of each document's rows among ``vectors [t, D]`` (float32), which are the rows
    ``start .. start + t`` of a run of documents whose rows are ``offsets[i]:offsets[i + 1]``
    (``[N + 1]``, from 0): ``[N, D]``, 0 where a document has no row there. One product with a
    sparse indicator matrix (a document's rows are consecutive), 10× faster than
    ``np.add.reduceat`` along the rows."""
    t = len(vectors)
    indptr = np.clip(np.asarray(offsets, np.int64), start, start + t) - start
    indicator = scipy.sparse.csr_matrix(
        (np.ones(t, np.float32), np.arange(t), indptr), shape=(len(indptr) - 1, t)
    )
    return np.asarray(indicator @ vectors, np.float32)


def unit_rows(sums: np.ndarray) -> np.ndarray:
    """``sums`` scaled to unit length per row (rows of zeros stay 0), float16: of
    ``document_sums``, each document's mean token vector as the index stores it."""
    norms = np.linalg.norm(sums, axis=1, keepdims=True)
    return (sums / np.maximum(norms, 1e-12)).astype(np.float16)


def _file_entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": fileio.sha256_tracked(path)}


def _gather_kept(store, positions, kept_counts, beta_d: float, into) -> None:
    """``into[j]`` = the vector of the ``positions[j]``-th kept token (sorted positions among the
    tokens ``beta_d`` keeps, ``kept_counts``: their cumulative count per shard), gathered shard
    by shard (each unmapped before the next)."""
    bounds = np.searchsorted(positions, kept_counts)
    for i in np.nonzero(np.diff(bounds))[0]:
        vectors, salience, local = store.shard_arrays(int(i))
        local_kept = pruning.top_fraction_segments(salience, local, beta_d)
        rows = local_kept[positions[bounds[i] : bounds[i + 1]] - kept_counts[i]]
        into[bounds[i] : bounds[i + 1]] = vectors[rows]
        del vectors, salience  # unmapped: one shard at a time


HELD_OUT_TOKENS = 1 << 16  # tokens outside the k-means sample scored for the drift reference


def _held_out_score(store, picks, kept_counts, config, centroids, cells, score) -> float:
    """The mean max centroid score of up to ``HELD_OUT_TOKENS`` kept tokens outside the k-means
    sample ``picks`` (seeded, apart from the build's own random stream): what tokens of the
    corpus's distribution the centroids were not fitted to score, the reference an update's
    new tokens are compared with. Scoring every token (``score``) instead made additions of the
    same corpus look like drift (``benchmarks/compaction_drift.py``, SciFact: 0.023 against the
    0.02 limit, 0.018 with this reference).
    ``score.mean`` when the sample holds every token."""
    total = int(kept_counts[-1])
    rest = total - len(picks)
    if rest <= 0:
        return score.mean
    rng = np.random.default_rng([config.seed, 1])
    if rest <= 4 * HELD_OUT_TOKENS:  # few outside the sample: take them from the whole list
        outside = np.setdiff1d(np.arange(total), picks, assume_unique=True)
    else:  # many outside the sample: random draws, those that miss it
        draws = np.sort(rng.choice(total, 4 * HELD_OUT_TOKENS, replace=False))
        at = np.minimum(np.searchsorted(picks, draws), len(picks) - 1)
        outside = draws[picks[at] != draws]
    if len(outside) > HELD_OUT_TOKENS:
        outside = np.sort(rng.choice(outside, HELD_OUT_TOKENS, replace=False))
    if not len(outside):
        return score.mean
    vectors = np.empty((len(outside), store.dim), ts.VECTOR_DTYPE)
    _gather_kept(store, outside, kept_counts, config.beta_d, vectors)
    held = _ScoreMean()
    for lo in range(0, len(vectors), CHUNK):
        v = np.asarray(vectors[lo : lo + CHUNK], np.float32)
        held.add(kmeans.assign_two_level(v, centroids, cells)[1])
    return held.mean


class _ScoreMean:
    """Running mean of the tokens' max centroid scores (the drift reference)."""

    def __init__(self):
        self.total, self.count = 0.0, 0

    def add(self, scores: np.ndarray) -> None:
        self.total += float(np.sum(scores, dtype=np.float64))
        self.count += len(scores)

    @property
    def mean(self) -> float:
        return self.total / max(self.count, 1)


def salience_scale(store, shards) -> float:
    """The quantisation step of a segment's saliences: its shards' largest u^d / 255 (read
    shard by shard; 1/255 when every u^d is 0), so that uint8 steps cover them, 0 exactly."""
    top = 0.0
    for i in shards:
        salience = store.shard_arrays(int(i))[1]
        if len(salience):
            top = max(top, float(np.max(salience)))
        del salience
    return (top if top > 0 else 1.0) / 255.0


def quantize_salience(salience: np.ndarray, scale: float) -> np.ndarray:
    """u^d as uint8 steps of ``scale`` (rounded to the nearest; 0 stays 0)."""
    steps = np.rint(np.asarray(salience, np.float32) / np.float32(scale))
    return np.clip(steps, 0, 255).astype(np.uint8)


def _write_segment(
    store, shards, name: str, centroids, cells, codec, out: Path, salience_scale, score,
    means: bool = False,
) -> dict:  # fmt: skip
    """Codes, packed residuals (and saliences, quantised in steps of ``salience_scale``; None:
    none stored; with ``means``, each document's normalised mean vector, ``unit_rows``) of the tokens
    of store ``shards`` (consecutive indices), streamed shard by shard into
    ``out/<name>.*.npy``; returns the segment entry."""
    spans = store.shard_spans()
    shards = list(shards)
    tokens = sum(spans[i][0]["num_tokens"] for i in shards)
    docs = sum(spans[i][0]["num_docs"] for i in shards)
    streams = {
        "codes": fileio.NpyStream(
            out / f"{name}.codes.npy", (tokens,), kmeans.code_dtype(len(centroids))
        ),
        "residuals": fileio.NpyStream(
            out / f"{name}.residuals.npy", (tokens, codec.bytes_per_token), np.uint8
        ),
    }
    if salience_scale is not None:
        streams["salience"] = fileio.NpyStream(out / f"{name}.salience.npy", (tokens,), np.uint8)
    if means:
        streams["means"] = fileio.NpyStream(
            out / f"{name}.means.npy", (docs, store.dim), np.float16
        )
    with contextlib.ExitStack() as stack:
        for stream in streams.values():
            stack.enter_context(stream)
        bar = progress.Progress(tokens, "search index: compress tokens", "token")
        for i in shards:
            vectors, sal, local = store.shard_arrays(i)
            sums = np.zeros((len(local) - 1, store.dim), np.float32) if means else None
            for lo in range(0, len(vectors), CHUNK):
                v = np.asarray(vectors[lo : lo + CHUNK], np.float32)
                if means:  # each document's sum, chunk by chunk
                    sums += document_sums(v, local, lo)
                c, best = kmeans.assign_two_level(v, centroids, cells)
                score.add(best)
                streams["codes"].write(c)
                streams["residuals"].write(codec.encode(v - centroids[c]))
                bar.update(len(v))
            if salience_scale is not None:
                streams["salience"].write(quantize_salience(sal, salience_scale))
            if means:
                streams["means"].write(unit_rows(sums))
            del vectors, sal, local  # unmapped: one shard at a time
        bar.close()
    return segment_entry(name, [spans[i][0]["name"] for i in shards], tokens, salience_scale)


def segment_entry(name: str, shards: list[str], tokens: int, salience_scale) -> dict:
    """A segment of ``meta['segments']``: its files' stem, store shards, tokens, salience step."""
    entry = {"name": name, "shards": shards, "num_tokens": tokens}
    if salience_scale is not None:
        entry["salience_scale"] = salience_scale
    return entry


def published_meta(directory: Path) -> Path | None:
    """The metadata file of the search index the manifest of ``directory`` publishes (None:
    none is)."""
    pointer = ts.read_manifest(directory).get("search_index")
    return Path(directory) / pointer["meta"] if pointer else None


def token_lists_bytes(kept_tokens: int, dim: int, bits: int) -> int:
    """Bytes of the centroid → token lists of ``kept_tokens`` tokens: a document (4 bytes) and
    a packed residual each."""
    return kept_tokens * (4 + codec_lib.packed_bytes(dim, bits))


def writes_doc_means(config: CentroidIndexConfig) -> bool:
    """Whether a build writes the documents' mean vectors: as set, or (``doc_means=None``)
    unless the residuals take 2 bits (see ``CentroidIndexConfig``)."""
    return config.residual_bits > 2 if config.doc_means is None else config.doc_means


def writes_token_lists(config: CentroidIndexConfig, kept_tokens: int, dim: int) -> bool:
    """Whether a build of ``kept_tokens`` β^d-kept tokens writes token lists: as set, or
    (``token_lists=None``) where their copy in memory would exceed ``LISTS_IN_MEMORY_MAX`` and
    the residuals take more than 2 bits (see ``CentroidIndexConfig``)."""
    if config.token_lists is not None:
        return config.token_lists
    bits = config.residual_bits
    return bits > 2 and token_lists_bytes(kept_tokens, dim, bits) > LISTS_IN_MEMORY_MAX


def writes_cluster_order(config: CentroidIndexConfig, kept_tokens: int, dim: int) -> bool:
    """Whether a build writes its segment's residuals grouped by centroid: as set, or
    (``cluster_order=None``) where a search would read its token lists by position (no token
    lists written, β^d = 1, their copy in memory over ``LISTS_IN_MEMORY_MAX``)."""
    if config.cluster_order is not None:
        return config.cluster_order
    return (
        not writes_token_lists(config, kept_tokens, dim)
        and config.beta_d >= 1.0
        and token_lists_bytes(kept_tokens, dim, config.residual_bits) > LISTS_IN_MEMORY_MAX
    )


def _group_by_centroid(store, out: Path, meta: dict, segment: dict, num_centroids: int) -> None:
    """Rewrites the build's segment residuals grouped by centroid (``cluster_order``), in
    blocks of consecutive centroids (``inverted_lists.write_clustered``), and marks the
    segment so."""
    path = out / f"{segment['name']}.residuals.npy"
    lists_lib.write_clustered(
        store, _segment_rows(out, meta), _segment_rows(out, meta, "residuals"), num_centroids,
        path,
    )  # fmt: skip
    segment["order"] = "clusters"


def recorded_config(directory: Path) -> CentroidIndexConfig:
    """The settings of the search index the manifest of ``directory`` publishes (the defaults
    when there is none or it cannot be read), each overridden by an explicit gin binding
    (``--gin.CentroidIndexConfig.residual_bits=2``): what a rebuild keeps, unless told."""
    recorded = {}
    try:
        pointer = ts.read_manifest(directory).get("search_index")
        if pointer:
            recorded = dict(ts.read_json(Path(directory) / pointer["meta"])["config"])
    except (errors.IndexIntegrityError, OSError, TypeError, KeyError) as e:
        logging.warning(
            "%s: search index settings not readable (%s); using the defaults", directory, e
        )
    fields = {f.name for f in dataclasses.fields(CentroidIndexConfig)}
    recorded = {k: v for k, v in recorded.items() if k in fields}
    for name in fields:
        if checks.is_bound(f"CentroidIndexConfig.{name}"):
            recorded.pop(name, None)  # gin's value: the constructor takes it
    CentroidIndexConfig()  # a bad gin binding is refused as itself, not blamed on the record
    try:
        return CentroidIndexConfig(**recorded)
    except (ValueError, TypeError) as e:
        logging.warning(
            "%s: recorded search index settings refused (%s); using the defaults", directory, e
        )
        return CentroidIndexConfig()


def _check_unchanged(store: ts.TokenStore) -> None:
    """Raises ``LockedError`` where the committed manifest of ``store``'s directory is no longer
    the one ``store`` was opened with (its search index aside)."""
    now = ts.read_manifest(store.directory)
    if {**now, "search_index": None} != {**store.manifest, "search_index": None}:
        raise errors.LockedError(
            f"{store.directory} changed while its search index was built (another process "
            "committed an update meanwhile): nothing was published; re-run the command"
        )


def collect_garbage(directory: Path) -> list[str]:
    """Removes what the committed generation of an index directory does not use: files of
    ``search_index/`` that its published metadata does not list (earlier generations, files of
    an interrupted writer), store shard files the manifest does not list (an interrupted
    ``--add``) and temporary files (``.NAME.*.tmp``, killed writes). Call it holding the
    writer lock, with a manifest committed. Readers that loaded an earlier generation keep
    their maps (a removed file lives on while mapped). Returns the names removed."""
    directory = Path(directory)
    manifest = ts.read_manifest(directory)
    keep = {m["path"] for shard in manifest["shards"] for m in shard["files"].values()}
    keep |= {f"{shard['name']}.json" for shard in manifest["shards"]}
    removed = []
    for path in directory.iterdir():
        name = path.name
        stale_shard = name.startswith("shard-") and name not in keep
        if path.is_file() and (stale_shard or (name.startswith(".") and name.endswith(".tmp"))):
            fileio.remove(path)
            removed.append(name)
    out = directory / SUBDIR
    pointer = manifest.get("search_index")
    if out.is_dir():
        used = {ts.VERIFIED}
        if pointer:
            used.add(Path(pointer["meta"]).name)
            try:
                used |= {f"{n}.npy" for n in ts.read_json(directory / pointer["meta"])["files"]}
            except (errors.IndexIntegrityError, OSError, KeyError, TypeError):
                return removed  # a missing or damaged metadata file: keep all for the repair
        for path in out.iterdir():
            if path.is_file() and path.name not in used:
                fileio.remove(path)
                removed.append(f"{SUBDIR}/{path.name}")
    if removed:
        logging.info("%s: removed %d unused file(s)", directory, len(removed))
    return removed
