"""The search index of a multi-process ``aligner-index`` job, built by all of its processes.

``launch/local_processes.sh 2 index --corpus=... --index_dir=DIR`` (or N hosts sharing DIR):
each process encodes its own store shards (shard ``i`` on process ``i mod P``, ``indexer``);
then, after a barrier, the search index (``centroid_index.CentroidIndex.build``) is built by all
of them together, every step through JAX's collectives (``multihost_utils``; gloo on CPU):

  1. the k-means sample is read by every process from the shared store (the same rows: the same
     seed), and the k-means work is split: each iteration's assignment chunks (fixed-shape,
     ``kmeans.CHUNK`` points) go to the processes in turn and their codes and scores are
     all-gathered (``process_allgather``); every process then forms the per-centroid sums and
     counts of the whole sample itself; the second level's cells are fitted one per process in
     turn and the blocks of centroids all-gathered;
  2. process 0's centroids, cells and residual grid are broadcast (``broadcast_one_to_all``), so
     every process compresses with exactly the tables process 0 writes;
  3. each process assigns and compresses its own shards (the rule of the encoding) into a part
     file (``segment-G.part-R-of-P.*.npy``);
  4. after a barrier, process 0 concatenates the parts in store order into the generation's
     segment, writes the inverted file and the metadata, and commits the manifest once; a last
     barrier returns every process after the commit.

**Equal to one process, bit for bit.** The index is the same bytes as a one-process build of the
same store and settings (the same top-10 for every query, because the same index): every piece
of split work — an assignment chunk, a cell's fit, a shard's compression — is the computation a
single process would do on the same inputs (same shapes, same kernel), and everything summed —
the per-centroid sums, the drift reference — is summed on one process in one process's order.
All-reducing per-process partial sums instead (a ``psum`` of each process's sums and counts)
would add the same float32 numbers in another order: centroids a few ulps apart, so some tokens
near a boundary change centroid and the index (and a few rankings) differ from the one-process
build. Gathering the codes instead costs 4 bytes per sample point per iteration on the wire and
an O(sample × D) segment sum on every process, small beside the assignment (sample × centroids
× D) that is split. This assumes homogeneous hosts; on mixed hardware the codes may differ in
the last bits of a near tie, and step 2 still makes the index consistent.

**What it costs.** Each process gathers the whole k-means sample (32 per centroid × D float16, as
one process does) into its own scratch file (``sample_file``); the second level's split balances
cells, not points. The chunks of one iteration are few when the sample is small (a sample of ≤
32,768 points is one chunk: then the coarse assignment runs on process 0 while the others wait). The
parts are copied once into the segment by process 0 (codes + residuals + saliences: about 200 bytes
per token at 384-d, 4 bits).

A job killed at any point leaves the store's last commit as it was: the parts and generation
files it wrote are never published, and the next commit's ``collect_garbage`` removes them;
re-running the same command rebuilds the search index from the start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from aligner_jax.common import errors, fileio
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import token_store as ts

# dtypes that cross processes unchanged (JAX without x64 would narrow 64-bit ones)
_EXACT = (np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.float16), np.dtype(np.uint8))


class ProcessSplit:
    """The processes of this JAX job (``jax.process_count()`` of them) sharing one build."""

    def __init__(self):
        self.count, self.rank = jax.process_count(), jax.process_index()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def barrier(self, name: str) -> None:
        multihost_utils.sync_global_devices(f"aligner-index: {name}")

    def map(self, fn: Callable[[int], object], count: int, template: object) -> list:
        """``[fn(0), …, fn(count - 1)]`` on every process, ``fn(j)`` computed by process
        ``j mod P`` only (``kmeans.Serial.map`` split). Every result has ``template``'s
        structure, shapes and dtypes (the padding of a process with fewer items)."""
        per = -(-count // self.count)
        if per == 0:
            return []
        mine = [fn(j) for j in range(self.rank, count, self.count)]
        mine += [template] * (per - len(mine))
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *mine)
        for leaf in jax.tree.leaves(stacked):
            if leaf.dtype not in _EXACT:
                raise TypeError(f"ProcessSplit.map: {leaf.dtype} does not cross processes exactly")
        gathered = multihost_utils.process_allgather(stacked)  # [P, per, ...]
        return [
            jax.tree.map(lambda a, j=j: np.asarray(a[j % self.count, j // self.count]), gathered)
            for j in range(count)
        ]

    def share(self, centroids: np.ndarray, cells: np.ndarray, codec):
        """Process 0's tables on every process (``broadcast_one_to_all``)."""
        tables = (centroids, cells, codec.lower, codec.step)
        for t in tables:
            if t.dtype not in _EXACT:
                raise TypeError(f"ProcessSplit.share: {t.dtype} does not cross processes exactly")
        centroids, cells, lower, step = (
            np.asarray(t) for t in multihost_utils.broadcast_one_to_all(tables)
        )
        return centroids, cells, dataclasses.replace(codec, lower=lower, step=step)

    def part_name(self, name: str, rank: int) -> str:
        return f"{name}.part-{rank}-of-{self.count}"

    def write_segment(
        self, store, shards, name: str, centroids, cells, codec, out: Path, salience_scale, score,
        means: bool = False,
    ) -> dict | None:  # fmt: skip
        """``centroid_index._write_segment`` split: this process compresses its shards into its
        part; after a barrier process 0 merges the parts into ``name`` in store order (and
        ``score`` with the chunks' score sums in the one-process order) and returns the
        segment entry; the other processes return None."""
        shards = list(shards)
        mine = [i for i in shards if i % self.count == self.rank]
        part = self.part_name(name, self.rank)
        chunks = _ChunkScores()
        ci._write_segment(
            store, mine, part, centroids, cells, codec, out, salience_scale, chunks, means
        )
        fileio.atomic_write_json(out / f"{part}.scores.json", chunks.sums)
        logging.info(
            "search index: process %d of %d compressed %d of %d shards (%d tokens) into %s",
            self.rank, self.count, len(mine), len(shards), sum(n for _, n in chunks.sums), part,
        )  # fmt: skip
        self.barrier(f"{name}: every part compressed")
        if not self.leader:
            return None
        return self._merge(store, shards, name, out, salience_scale, score, means)

    def _merge(self, store, shards, name: str, out: Path, salience_scale, score, means) -> dict:
        spans = store.shard_spans()
        meta = {"salience": salience_scale is not None, "doc_means": means}
        token_kinds, doc_kinds = ci._segment_kinds(meta), ci._doc_kinds(meta)
        kinds = token_kinds + doc_kinds
        sizes = {i: spans[i][0]["num_tokens"] for i in shards}
        doc_sizes = {i: spans[i][0]["num_docs"] for i in shards}
        parts, cursor, sums = {}, {}, {}
        for rank in range(self.count):
            part = self.part_name(name, rank)
            parts[rank] = {k: np.load(out / f"{part}.{k}.npy", mmap_mode="r") for k in kinds}
            sums[rank] = json.loads((out / f"{part}.scores.json").read_text())
            cursor[rank] = [0, 0, 0]  # next token row, next chunk, next document row of the part
        tokens, docs = sum(sizes.values()), sum(doc_sizes.values())
        first = parts[0]
        with contextlib.ExitStack() as stack:
            streams = {
                k: stack.enter_context(
                    fileio.NpyStream(
                        out / f"{name}.{k}.npy",
                        (docs if k in doc_kinds else tokens,) + first[k].shape[1:],
                        first[k].dtype,
                    )
                )
                for k in kinds
            }
            for i in shards:
                rank = i % self.count
                row, chunk, doc_row = cursor[rank]
                for k in token_kinds:
                    streams[k].write(parts[rank][k][row : row + sizes[i]])
                for k in doc_kinds:
                    streams[k].write(parts[rank][k][doc_row : doc_row + doc_sizes[i]])
                seen = 0
                while seen < sizes[i]:  # the shard's chunks, replayed in the one-process order
                    total, count = sums[rank][chunk]
                    score.total += total
                    score.count += count
                    seen, chunk = seen + count, chunk + 1
                cursor[rank] = [row + sizes[i], chunk, doc_row + doc_sizes[i]]
        del parts, first
        for rank in range(self.count):
            part = self.part_name(name, rank)
            for path in [out / f"{part}.{k}.npy" for k in kinds] + [out / f"{part}.scores.json"]:
                fileio.remove(path)
        logging.info("search index: %d parts merged into %s (%d tokens)", self.count, name, tokens)
        shard_names = [spans[i][0]["name"] for i in shards]
        return ci.segment_entry(name, shard_names, tokens, salience_scale)


class _ChunkScores:
    """``centroid_index._ScoreMean`` that keeps each chunk's sum (merged in store order)."""

    def __init__(self):
        self.sums: list[tuple[float, int]] = []

    def add(self, scores: np.ndarray) -> None:
        self.sums.append((float(np.sum(scores, dtype=np.float64)), len(scores)))


def build_search_index(index_dir: str | Path, split: ProcessSplit, lock) -> None:
    """The search index of the complete store ``index_dir``, built by every process of the job
    (see the module docstring) unless a valid one is published. ``lock``: process 0's writer
    lock (``indexer.writer_lock``), held by process 0 while it builds and commits; another
    writer holding it skips the build on every process. Every process returns after the
    commit."""
    with contextlib.ExitStack() as stack:
        decision = np.int32(0)  # 0: build, 1: up to date, 2: another writer holds the lock
        if split.leader:
            try:
                stack.enter_context(lock)
                store = ts.TokenStore(index_dir)  # verified here once: the others reuse the record
                try:
                    ci.CentroidIndex.load(store)
                    decision = np.int32(1)
                except errors.IndexIntegrityError:
                    pass
            except errors.LockedError as e:
                logging.warning("search index not built: %s", e)
                decision = np.int32(2)
        decision = int(multihost_utils.broadcast_one_to_all(decision))
        if decision == 1:
            logging.info("the search index of %s is up to date", index_dir)
        if decision != 0:
            return
        if not split.leader:
            store = ts.TokenStore(index_dir)
        ci.CentroidIndex.build(store, split=split)
        split.barrier("search index committed")
