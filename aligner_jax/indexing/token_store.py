"""The token store: document token vectors on disk, in fixed-size shards, with a manifest.

Only real tokens are stored (no padding), so memory and disk scale with the number of tokens, not
with ``documents × max length × dimension``. Each shard holds, for ``num_docs`` consecutive
documents of the corpus stream:

  ``<shard>.vectors.npy``    float16 ``[T, D]``  token vectors (L2-normalised projections)
  ``<shard>.salience.npy``   float16 ``[T]``     unary salience u^d of each token (Eq. 3)
  ``<shard>.token_ids.npy``  int32   ``[T]``     vocabulary ids (COIL's exact match, explanations)
  ``<shard>.offsets.npy``    int64   ``[N+1]``   token range of each document
  ``<shard>.doc_ids.json``   the documents' ids

Every file is written under a temporary name, fsync'ed and renamed; the shard's own
``<shard>.json`` (counts, byte sizes, sha256 checksums) is written last, the same way, and is the
shard's commit marker: a killed job resumes after the last shard whose marker exists.
``manifest.json`` (model, settings, counts, every shard's checksums) is written once all shards are
complete. Reading verifies the manifest against the files and refuses anything that does not
match, naming the file: sizes on every open; every file's sha256 on the first open, after which
``.verified.json`` records the manifest's own sha256 and each file's size, mtime, ctime and inode,
so a later open re-hashes only when a file (or the manifest) changed (``verify_checksums=True``
re-hashes always). The job that writes the manifest writes that record too when it hashed every
file from the bytes it wrote (or verified it), so the first open after indexing skips the hashing. The cost is measured in ``benchmarks/results/store_verification.md``.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import math
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from absl import logging

from aligner_jax.common import doc_ids, errors, fileio, half, scratch

FORMAT = "aligner_jax.indexing.token_store/1"
MANIFEST = "manifest.json"
VERIFIED = ".verified.json"
SHARD_FILES = ("vectors", "salience", "token_ids", "offsets", "doc_ids")
VECTOR_DTYPE = np.float16
HALF_KINDS = ("vectors", "salience")  # the kinds stored as VECTOR_DTYPE


SHARD_SIZE = 500  # documents per shard unless told (the writer, aligner-index, an --add)


def shard_name(shard_index: int) -> str:
    return f"shard-{shard_index:05d}"


@dataclasses.dataclass
class EncodedDocument:
    """One document's real tokens, as produced by the encoder."""

    doc_id: str
    vectors: np.ndarray  # [m, D]
    salience: np.ndarray  # [m]
    token_ids: np.ndarray  # [m]


def write_shard(
    directory: Path,
    shard_index: int,
    docs: Sequence[EncodedDocument],
    dim: int,
    stats: dict | None = None,
) -> dict:
    """Writes one shard atomically and returns its manifest entry (also saved as <shard>.json).

    ``stats`` (e.g. truncation counts) is stored in the shard's marker for the job summary.
    """
    directory = Path(directory)
    name = shard_name(shard_index)
    lengths = np.array([len(d.token_ids) for d in docs], dtype=np.int64)
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    vectors = np.zeros((total, dim), dtype=VECTOR_DTYPE)
    salience = np.zeros((total,), dtype=VECTOR_DTYPE)
    token_ids = np.zeros((total,), dtype=np.int32)
    for i, doc in enumerate(docs):
        lo, hi = offsets[i], offsets[i + 1]
        if doc.vectors.shape != (hi - lo, dim):
            raise ValueError(
                f"document {doc.doc_id!r}: vectors of shape {doc.vectors.shape}, expected "
                f"{(int(hi - lo), dim)}"
            )
        vectors[lo:hi] = doc.vectors
        salience[lo:hi] = doc.salience
        token_ids[lo:hi] = doc.token_ids
    arrays = {"vectors": vectors, "salience": salience, "token_ids": token_ids, "offsets": offsets}
    files = {}
    for key, array in arrays.items():
        path = directory / f"{name}.{key}.npy"
        fileio.atomic_save_npy(path, array)
        files[key] = {
            "path": path.name,
            "bytes": path.stat().st_size,
            "sha256": fileio.sha256_tracked(path),
        }
    ids_path = directory / f"{name}.doc_ids.json"
    fileio.atomic_write_bytes(ids_path, json.dumps([d.doc_id for d in docs]).encode())
    files["doc_ids"] = {
        "path": ids_path.name,
        "bytes": ids_path.stat().st_size,
        "sha256": fileio.sha256_tracked(ids_path),
    }
    entry = {"name": name, "index": shard_index, "num_docs": len(docs), "num_tokens": total}
    entry["files"] = files
    if stats:
        entry["stats"] = stats
    fileio.fsync_dir(directory)
    fileio.atomic_write_json(directory / f"{name}.json", entry)
    return entry


read_json = fileio.read_json  # a JSON file of an index, invalid JSON named in one line


def read_shard_marker(directory: Path, shard_index: int) -> dict | None:
    """The committed manifest entry of a shard, or None when the shard is not complete."""
    marker = Path(directory) / f"{shard_name(shard_index)}.json"
    if not marker.exists():
        return None
    entry = read_json(marker, "delete it (the shard is then re-encoded)")
    for meta in entry["files"].values():
        path = Path(directory) / meta["path"]
        if not path.exists() or path.stat().st_size != meta["bytes"]:
            return None  # a shard whose files changed after its marker is rewritten
    return entry


def write_manifest(directory: Path, manifest: dict) -> None:
    """Writes ``manifest.json``, and ``.verified.json`` when this process hashed every file it
    lists from the bytes it wrote (or verified it on opening the store), unchanged since
    (``fileio.record_verified``): the first open after indexing or an update does not hash
    the store again, and a file altered later is still caught."""
    directory = Path(directory)
    manifest = dict(manifest)
    manifest["format"] = FORMAT
    fileio.atomic_write_json(directory / MANIFEST, manifest)
    files = {
        directory / meta["path"]: meta["sha256"]
        for shard in manifest.get("shards", [])
        for meta in shard["files"].values()
    }
    fileio.record_verified(files, directory / MANIFEST, directory / VERIFIED)


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise errors.IndexIntegrityError(
            f"{path} does not exist: {directory} is not a complete index (build it with "
            "aligner-index, or re-run the interrupted indexing job to finish it)"
        )
    manifest = read_json(
        path,
        "the index's commit record was altered (updates never leave it torn): rebuild the index "
        "into a new folder (aligner-index --corpus=CORPUS.jsonl --index_dir=NEW_DIR)",
    )
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise errors.IndexIntegrityError(
            f"{path}: format {manifest.get('format')!r}, this version reads {FORMAT!r}"
        )
    return manifest


def verify_files(directory: Path, shards: Sequence[dict], checksums: bool = False) -> bool:
    """Checks every shard file against the manifest: its size, and its sha256 unless
    ``.verified.json`` shows that exactly these files were verified before (always when
    ``checksums``; the rule of ``fileio.verify_once``). Returns whether sha256 checksums were
    computed."""
    directory = Path(directory)
    _verify_sizes(directory, shards)
    files = {
        directory / meta["path"]: meta["sha256"]
        for shard in shards
        for meta in shard["files"].values()
    }
    return fileio.verify_once(
        files, directory / MANIFEST, directory / VERIFIED, force=checksums, log=logging.warning
    )


def _verify_sizes(directory: Path, shards: Iterable[dict]) -> None:
    for shard in shards:
        for key in SHARD_FILES:
            meta = shard["files"].get(key)
            if meta is None:
                raise errors.IndexIntegrityError(
                    f"manifest shard {shard['name']} lists no {key} file"
                )
            path = Path(directory) / meta["path"]
            if not path.exists():
                raise errors.IndexIntegrityError(
                    f"{path} is missing (listed in {directory / MANIFEST})"
                )
            size = path.stat().st_size
            if size != meta["bytes"]:
                raise errors.IndexIntegrityError(
                    f"{path} has {size} bytes, the manifest says {meta['bytes']}: the file is "
                    "truncated or was altered; rebuild the index into a new folder (aligner-index "
                    "--corpus=CORPUS.jsonl --index_dir=NEW_DIR)"
                )


def merged_runs(lo: np.ndarray, hi: np.ndarray, to: np.ndarray) -> list[tuple[int, int, int]]:
    """Copies ``rows lo:hi → out[to:]`` (one per document), adjacent ones merged: a document
    that starts where the previous one ended, in the source and in ``out``, extends its run —
    consecutive documents (an exhaustive search's) are one copy per shard, not one per
    document."""
    if not len(lo):
        return []
    joins = (lo[1:] == hi[:-1]) & (to[1:] == to[:-1] + hi[:-1] - lo[:-1])
    first = np.flatnonzero(np.concatenate([[True], ~joins]))
    last = np.concatenate([first[1:], [len(lo)]]) - 1
    return list(zip(lo[first].tolist(), hi[last].tolist(), to[first].tolist(), strict=True))


class TokenStore:
    """Read-only view over a complete token store, memory-mapped shard by shard.

    Documents are numbered 0..N-1 in corpus order across shards (``doc_ids[i]``); the tokens of
    document ``i`` are the global rows ``offsets[i]:offsets[i+1]``.

    Shard files are mapped when first read and kept in a small least-recently-used cache
    (``max_open_arrays`` maps, one open file each): a store of any number of shards holds at
    most that many files open, so a 100M-token store (thousands of shards) searches and builds
    under ``ulimit -n 1024``. Opening reads only the offsets and document ids of every shard.
    """

    MAX_OPEN_ARRAYS = 96

    @property
    def max_open_arrays(self) -> int:
        """The cache's size: ``MAX_OPEN_ARRAYS``, or a quarter of the process's open-file limit
        when that is lower (at least 4): under ``ulimit -n 64`` a search keeps 16 maps."""
        return min(self.MAX_OPEN_ARRAYS, max(4, fileio.open_file_limit() // 4))

    def __init__(
        self,
        directory: str | os.PathLike,
        verify_checksums: bool = False,
        manifest: dict | None = None,
    ):
        """Opens a complete store; every file's sha256 is checked on the first open (and on
        every open with ``verify_checksums``), sizes and counts on every open. ``manifest``:
        a view of the store as an update's pending manifest describes it (not committed yet;
        sizes checked, checksums not: the update wrote and hashed the new files)."""
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory) if manifest is None else manifest
        shards = sorted(self.manifest["shards"], key=lambda s: s["index"])
        num_shards = self.manifest["counts"].get("num_shards", len(shards))
        first = int(self.manifest.get("first_shard", 0))  # > 0 once vacuumed (updates.vacuum)
        if [s["index"] for s in shards] != list(range(first, first + num_shards)):
            raise errors.IndexIntegrityError(
                f"{self.directory / MANIFEST}: lists shards {[s['index'] for s in shards]}, "
                f"expected {first}..{first + num_shards - 1}; the manifest was altered, rebuild "
                "this index"
            )
        if manifest is None:
            self.checksums_verified = verify_files(self.directory, shards, verify_checksums)
        else:
            _verify_sizes(self.directory, shards)
            self.checksums_verified = False
        self._shards = shards
        self._open: collections.OrderedDict = collections.OrderedDict()
        self._open_lock = threading.Lock()
        # _read_runs' parsed .npy headers: (kind, shard) -> (data offset, dtype, row, row bytes)
        self._headers: dict[tuple[str, int], tuple] = {}
        self.dim = int(self.manifest["model"]["dim"])
        offsets, self.doc_ids = [np.zeros(1, np.int64)], []
        base_tokens = 0
        for shard in shards:
            files = shard["files"]
            local = self._map(files["offsets"])
            local = np.array(local)  # small: read, not mapped
            ids = read_json(self.directory / files["doc_ids"]["path"])
            if len(ids) != shard["num_docs"] or len(local) != shard["num_docs"] + 1:
                raise errors.IndexIntegrityError(
                    f"{self.directory / files['doc_ids']['path']}: {len(ids)} documents, the "
                    f"manifest says {shard['num_docs']}"
                )
            expected = {
                "vectors": _npy_bytes((int(local[-1]), self.dim), VECTOR_DTYPE),
                "salience": _npy_bytes((int(local[-1]),), VECTOR_DTYPE),
                "token_ids": _npy_bytes((int(local[-1]),), np.int32),
            }
            if int(local[-1]) != shard["num_tokens"] or any(
                files[k]["bytes"] != v for k, v in expected.items()
            ):
                raise errors.IndexIntegrityError(
                    f"{self.directory / files['offsets']['path']}: token counts disagree with "
                    "the manifest"
                )
            offsets.append(local[1:] + base_tokens)
            base_tokens += int(local[-1])
            self.doc_ids.extend(ids)
        self.offsets = np.concatenate(offsets)
        counts = self.manifest["counts"]
        if len(self.doc_ids) != counts["num_docs"] or base_tokens != counts["num_tokens"]:
            raise errors.IndexIntegrityError(
                f"{self.directory / MANIFEST}: counts {counts} disagree with the shards "
                f"({len(self.doc_ids)} docs, {base_tokens} tokens)"
            )
        self._shard_token_starts = np.array(
            [0] + list(np.cumsum([s["num_tokens"] for s in shards])), dtype=np.int64
        )
        self._shard_doc_starts = np.array(
            [0] + list(np.cumsum([s["num_docs"] for s in shards])), dtype=np.int64
        )
        # Documents deleted by ``aligner-index --delete``: stored, never returned by search.
        # ``deleted`` lists store positions (an id deleted and added again is a new position);
        # ``tombstones`` (ids) is how earlier versions wrote them.
        self.deleted = np.zeros(self.num_docs, bool)
        positions = self.manifest.get("deleted", [])
        if any(not isinstance(p, int) or not 0 <= p < self.num_docs for p in positions):
            raise errors.IndexIntegrityError(
                f"{self.directory / MANIFEST}: 'deleted' holds positions outside 0.."
                f"{self.num_docs - 1}; the manifest was altered, rebuild this index"
            )
        self.deleted[positions] = True
        tombstones = self.manifest.get("tombstones", [])
        if tombstones:
            position = {d: i for i, d in enumerate(self.doc_ids)}
            unknown = [d for d in tombstones if d not in position]
            if unknown:
                raise errors.IndexIntegrityError(
                    f"{self.directory / MANIFEST}: tombstones name {len(unknown)} document(s) "
                    f"the store does not hold (first: {unknown[0]!r}); the manifest was altered, "
                    "rebuild this index"
                )
            self.deleted[[position[d] for d in tombstones]] = True

    def live_positions(self) -> dict[str, int]:
        """``{doc_id: position}`` of the documents not deleted."""
        return {d: i for i, d in enumerate(self.doc_ids) if not self.deleted[i]}

    def _map(self, meta: dict) -> np.ndarray:
        path = self.directory / meta["path"]
        try:
            return fileio.load_npy(path)
        except FileNotFoundError:
            raise self._missing(meta["path"]) from None
        except ValueError as e:
            raise errors.IndexIntegrityError(f"{path}: not a readable .npy file ({e})") from e

    def _missing(self, name: str) -> errors.IndexIntegrityError:
        """The error of a shard file ``name`` that no longer exists (it did at open): removed by
        a commit since (a vacuum replaces the shards), or lost."""
        listed = {
            m["path"] for s in read_manifest(self.directory)["shards"] for m in s["files"].values()
        }
        if name in listed:
            return errors.IndexIntegrityError(
                f"{self.directory / name}: missing (it existed when the store was opened); "
                "rebuild this index"
            )
        return errors.SnapshotGoneError(
            f"{self.directory / name}: removed by an update committed after this store was "
            "opened (aligner-index --vacuum replaces the shards); load the index again "
            "(searcher = searcher.refresh(), or Searcher.load)"
        )

    def _array(self, kind: str, s: int, evict: bool = True) -> np.ndarray | None:
        """Shard ``s``'s ``kind`` array (vectors, salience, token_ids), mapped through the
        least-recently-used cache of open maps; with ``evict=False``, None where it is not
        mapped and the cache is full."""
        key = (kind, s)
        with self._open_lock:  # searches read from several threads (the cache, and np.load's
            array = self._open.get(key)  # header parsing, which CPython 3.11 races on)
            if array is None and not evict and len(self._open) >= self.max_open_arrays:
                return None
            if array is None:
                array = self._map(self._shards[s]["files"][kind])
                self._open[key] = array
                while len(self._open) > self.max_open_arrays:
                    self._open.popitem(last=False)  # unmapped (file closed) when collected
            else:
                self._open.move_to_end(key)
            return array

    def close(self) -> None:
        """Unmaps every open shard file (they are mapped again on the next read)."""
        self._open.clear()

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def has_saliences(self) -> bool:
        """Whether the store's model weights tokens by learned saliences (u^q, u^d of Eq. 2–5):
        its manifest names a salience kind other than ``"none"`` (a model without stores u^d =
        1). The one rule for every reader of the store (search, index build, export)."""
        return self.manifest["model"].get("salience") != "none"

    @property
    def num_docs(self) -> int:
        return len(self.doc_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    @property
    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def nbytes(self) -> int:
        """Bytes on disk of the refinement store (all shard files)."""
        return sum(m["bytes"] for s in self._shards for m in s["files"].values())

    # -- shard by shard --------------------------------------------------------------------------
    def shard_spans(self) -> list[tuple[dict, int, int]]:
        """(manifest entry, first global token, first global document) of every shard."""
        return [
            (shard, int(self._shard_token_starts[i]), int(self._shard_doc_starts[i]))
            for i, shard in enumerate(self._shards)
        ]

    def shard_arrays(self, s: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(vectors, salience, local offsets ``[n+1]``) of shard ``s``, mapped outside the cache:
        dropping them unmaps the shard (what streaming jobs do to bound their resident memory)."""
        files = self._shards[s]["files"]
        lo, hi = self._shard_doc_starts[s], self._shard_doc_starts[s + 1]
        local = self.offsets[lo : hi + 1] - self.offsets[lo]
        return self._map(files["vectors"]), self._map(files["salience"]), local

    # -- access --------------------------------------------------------------------------------
    def _rows(self, kind: str, start: int, stop: int) -> np.ndarray:
        """Global rows [start, stop) gathered across shards."""
        parts = []
        first = int(np.searchsorted(self._shard_token_starts, start, side="right") - 1)
        for s in range(max(first, 0), len(self._shards)):
            lo = self._shard_token_starts[s]
            if lo >= stop:
                break
            n = self._shard_token_starts[s + 1] - lo
            a = max(start - lo, 0)
            b = min(stop - lo, n)
            if b > a:
                parts.append(self._array(kind, s)[a:b])
        if not parts:
            return np.asarray(self._array(kind, 0)[:0]) if self._shards else np.zeros(0)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def vectors(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self._rows("vectors", start, self.num_tokens if stop is None else stop)

    def salience(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self._rows("salience", start, self.num_tokens if stop is None else stop)

    def token_ids(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self._rows("token_ids", start, self.num_tokens if stop is None else stop)

    def take(self, kind: str, rows: np.ndarray) -> np.ndarray:
        """Global ``rows`` (any order) of ``kind`` (vectors, salience, token_ids), read shard by
        shard: one fancy index per touched shard."""
        rows = np.asarray(rows, np.int64)
        shard_of_row = np.searchsorted(self._shard_token_starts, rows, side="right") - 1
        first = self._array(kind, 0)
        out = np.empty((len(rows),) + first.shape[1:], first.dtype)
        for s in np.unique(shard_of_row):
            sel = shard_of_row == s
            out[sel] = self._array(kind, int(s))[rows[sel] - self._shard_token_starts[s]]
        return out

    def document(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(vectors [m, D] float16, salience [m], token ids [m]) of document ``i``."""
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.vectors(lo, hi), self.salience(lo, hi), self.token_ids(lo, hi)

    def gather_padded(
        self, doc_indices: np.ndarray, length: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Pads the given documents to ``length`` tokens.

        Returns (vectors [C, length, D] float16, mask [C, length] bool, salience [C, length]
        float32, token ids [C, length] int32); documents longer than ``length`` are an error.
        """
        doc_indices = np.asarray(doc_indices, dtype=np.int64)
        starts = self.offsets[doc_indices]
        lengths = self.offsets[doc_indices + 1] - starts
        if len(lengths) and lengths.max() > length:
            raise ValueError(f"gather_padded: a document has {lengths.max()} tokens > {length}")
        c = len(doc_indices)
        vectors = np.zeros((c, length, self.dim), dtype=VECTOR_DTYPE)
        salience = np.zeros((c, length), dtype=np.float32)
        token_ids = np.zeros((c, length), dtype=np.int32)
        mask = np.arange(length)[None, :] < lengths[:, None]
        kinds = ("vectors", "salience", "token_ids")
        for i, (arrays, lo, hi) in enumerate(self._document_runs(kinds, doc_indices)):
            for out, array in zip((vectors, salience, token_ids), arrays, strict=True):
                out[i, : hi - lo] = array[lo:hi]
        return vectors, mask, salience, token_ids

    def concatenated(self, kind: str, doc_indices: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The rows of ``kind`` of the given documents, concatenated in their order, copied
        into ``out`` (``[their tokens, ...]``; of another dtype, e.g. float32 vectors, the cast
        happens in the copy); returns ``out``.

        Shard by shard: from its map where it is mapped or the cache has room for it, else
        read from its file in place (one open file at a time, ``_read_runs``) without evicting
        a map. A store of more shards than the cache holds would otherwise map and unmap a file
        for nearly every document (at 104 shards, 100 documents took 31 ms, 27 of them in
        ``np.load``)."""
        doc_indices = np.asarray(doc_indices, dtype=np.int64)
        starts = self.offsets[doc_indices]
        ends = self.offsets[doc_indices + 1]
        at = np.concatenate([[0], np.cumsum(ends - starts)])
        if at[-1] != len(out):
            raise ValueError(f"concatenated: the documents hold {at[-1]} rows, out has {len(out)}")
        shard = np.searchsorted(self._shard_doc_starts, doc_indices, side="right") - 1
        order = np.argsort(shard, kind="stable")
        sorted_shards = shard[order]
        bounds = [0, *(np.flatnonzero(np.diff(sorted_shards)) + 1).tolist(), len(order)]
        sorted_shards = sorted_shards.tolist()
        target = out
        if kind in HALF_KINDS and out.dtype == np.float32:
            # rows copied as they are stored, then cast at once (NumPy's cast is 6x slower)
            out = scratch.buffer(f"store.concatenated.{kind}", out.shape, VECTOR_DTYPE)
        for first, last in zip(bounds[:-1], bounds[1:], strict=True) if len(order) else []:
            s = sorted_shards[first]
            off = int(self._shard_token_starts[s])
            if last - first == 1:  # one document (a search's usual case): no merging to do
                d = int(order[first])
                runs = [(int(starts[d]) - off, int(ends[d]) - off, int(at[d]))]
            else:
                group = order[first:last]
                runs = merged_runs(starts[group] - off, ends[group] - off, at[group])
            array = self._array(kind, s, evict=False)
            if array is None:
                self._read_runs(kind, s, runs, out)
                continue
            array = array.view(np.ndarray)  # slices of a plain view skip memmap's bookkeeping
            for lo, hi, to in runs:
                out[to : to + hi - lo] = array[lo:hi]
        return target if out is target else half.to_float32(out, target)

    def _read_runs(self, kind: str, s: int, runs: list, out: np.ndarray) -> None:
        """Copies rows ``lo:hi`` of shard ``s``'s ``kind`` array to ``out[to:]`` for each
        ``(lo, hi, to)`` of ``runs``, read with ``os.pread`` from its ``.npy`` file (its path
        and header parsed once per file and kept)."""
        header = self._headers.get((kind, s))
        try:
            if header is None:
                header = self._headers[(kind, s)] = self._read_header(kind, s)
            path, start, dtype, row, row_bytes = header
            fd = os.open(path, os.O_RDONLY)  # a bare descriptor: a Python file object costs more
        except FileNotFoundError:
            raise self._missing(self._shards[s]["files"][kind]["path"]) from None
        try:
            for lo, hi, to in runs:
                data = os.pread(fd, (hi - lo) * row_bytes, start + lo * row_bytes)
                out[to : to + hi - lo] = np.frombuffer(data, dtype).reshape((hi - lo, *row))
        finally:
            os.close(fd)

    def _read_header(self, kind: str, s: int) -> tuple:
        """(path, data offset, dtype, row shape, row bytes) of shard ``s``'s ``kind`` file."""
        path = str(self.directory / self._shards[s]["files"][kind]["path"])
        with open(path, "rb") as f:
            major, _ = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if major == 1 else None
            shape, fortran, dtype = (read or np.lib.format.read_array_header_2_0)(f)
            if fortran:
                raise errors.IndexIntegrityError(f"{path}: a Fortran-ordered array")
            row = tuple(shape[1:])
            return path, f.tell(), dtype, row, dtype.itemsize * math.prod(row)

    def _document_runs(self, kinds: tuple[str, ...], doc_indices: np.ndarray):
        """(its shard's arrays of ``kinds``, first row, end row) of each document, in order. A
        document is a run of rows of its shard: one slice copy per document is 4-5x faster than
        a fancy index over every row."""
        doc_indices = np.asarray(doc_indices, dtype=np.int64)
        starts = self.offsets[doc_indices]
        ends = self.offsets[doc_indices + 1]
        shard = np.searchsorted(self._shard_doc_starts, doc_indices, side="right") - 1
        arrays: dict[int, tuple] = {}
        for lo, hi, s in zip(starts.tolist(), ends.tolist(), shard.tolist(), strict=True):
            if s not in arrays:
                arrays[s] = tuple(self._array(kind, s) for kind in kinds)
            off = int(self._shard_token_starts[s])
            yield arrays[s], lo - off, hi - off


def _npy_bytes(shape: tuple, dtype) -> int:
    """Size of a ``.npy`` file of this shape and dtype as ``np.save`` writes it."""
    header = io.BytesIO()
    fields = np.lib.format.header_data_from_array_1_0(np.empty((0,), dtype))
    np.lib.format.write_array_header_1_0(header, fields | {"shape": tuple(shape)})
    return header.tell() + int(np.prod(shape)) * np.dtype(dtype).itemsize


def checked_document(
    doc_id, vectors, salience=None, token_ids=None, dim: int | None = None
) -> EncodedDocument:
    """A document encoded elsewhere, checked as the index will need it: ``doc_id`` by
    ``doc_ids.clean``; ``vectors [m, dim]`` of real numbers, ``m >= 1``, finite once stored as
    float16; ``salience [m]`` finite and >= 0 (the unary weights u, Eq. 3; default 1);
    ``token_ids [m]`` integers (default 0). A ``ConfigError`` names the document and the fault
    (one NaN would otherwise make a non-finite centroid that hides every search result)."""
    try:
        doc_id = doc_ids.clean(doc_id)
    except ValueError as reason:
        raise errors.ConfigError(f"a document id {reason}") from None
    where = f"document {doc_id!r}"
    vectors = _real_array(where, "vectors", vectors, "fiu")
    dim = vectors.shape[-1] if dim is None else dim
    if vectors.ndim != 2 or vectors.shape[1] != dim or not len(vectors):
        raise errors.ConfigError(
            f"{where}: vectors of shape {vectors.shape}, expected [m, {dim}] with m >= 1 (a "
            "document needs at least one token vector)"
        )
    m = len(vectors)
    with np.errstate(over="ignore", invalid="ignore"):
        stored = vectors.astype(VECTOR_DTYPE)
    if not np.isfinite(stored).all():
        raise errors.ConfigError(
            f"{where}: vectors hold NaN or infinite values, or values beyond float16's range "
            f"(|x| > 65504) that become infinite on disk; largest |x|: {np.abs(vectors).max()}"
        )
    if salience is None:
        salience = np.ones(m, VECTOR_DTYPE)
    salience = _real_array(where, "salience", salience, "fiu", m)
    with np.errstate(over="ignore", invalid="ignore"):
        bad = ~(np.isfinite(salience.astype(VECTOR_DTYPE)) & (salience >= 0))
    if bad.any():
        raise errors.ConfigError(
            f"{where}: salience must be finite and >= 0 (the weights u, Eq. 3), found "
            f"{salience[bad][:3].tolist()}"
        )
    token_ids = _real_array(
        where, "token_ids", np.zeros(m, np.int32) if token_ids is None else token_ids, "iu", m
    )
    return EncodedDocument(doc_id, stored, salience, token_ids)


def _real_array(where: str, name: str, value, kinds: str, length: int | None = None):
    """``value`` as an array whose dtype kind is in ``kinds`` (and ``[length]`` when given)."""
    try:
        array = np.asarray(value)
    except ValueError as error:  # a ragged list
        raise errors.ConfigError(f"{where}: {name} is not an array ({error})") from None
    if array.dtype.kind not in kinds:
        wanted = "integers" if kinds == "iu" else "real numbers"
        raise errors.ConfigError(f"{where}: {name} of dtype {array.dtype}, expected {wanted}")
    if length is not None and array.shape != (length,):
        raise errors.ConfigError(
            f"{where}: {name} of shape {array.shape}, expected [{length}] (one per token vector)"
        )
    return array


class TokenStoreWriter:
    """Writes a token store from vectors computed elsewhere: the same shard files, manifest and
    checksums as ``aligner-index``, so every reader, ``aligner-index --index_dir=DIR
    --search_index`` and ``aligner-search`` take it as it is::

        with TokenStoreWriter(dir, model={"name": "mine", "fingerprint": "...", "dim": 128}) as w:
            for doc_id, vectors, salience in my_documents():
                w.add(doc_id, vectors, salience)
        store = w.store  # the finished TokenStore

    ``model`` needs ``name``, ``fingerprint`` and ``dim`` (``salience: "none"`` for a model
    without saliences; ``encoder.json`` is the caller's to write when queries are to be encoded
    by the project). Documents are cut into shards of ``shard_size``; a shard is written (and its
    memory released) as soon as it is full, so memory is bounded by one shard. The manifest is
    written by ``close()``; a directory that already holds one is refused.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        model: dict,
        shard_size: int = SHARD_SIZE,
        corpus: dict | None = None,
    ):
        self.directory = Path(directory)
        missing = [k for k in ("name", "fingerprint", "dim") if k not in model]
        if missing:
            raise errors.ConfigError(f"TokenStoreWriter: model lacks {missing}")
        if (self.directory / MANIFEST).exists():
            raise errors.ConfigError(
                f"{self.directory / MANIFEST} exists: write a new store into an empty folder"
            )
        self.directory.mkdir(parents=True, exist_ok=True)
        self.model, self.dim, self.shard_size = dict(model), int(model["dim"]), int(shard_size)
        self.corpus = corpus or {}
        self._pending: list[EncodedDocument] = []
        self._entries: list[dict] = []
        self._ids: set[str] = set()
        self.store: TokenStore | None = None

    def add(self, doc_id: str, vectors, salience=None, token_ids=None) -> None:
        """One document (``checked_document``'s rules): refused with a ``ConfigError`` naming
        it before anything of it is written; the documents added before it are kept."""
        try:
            doc = checked_document(doc_id, vectors, salience, token_ids, self.dim)
        except errors.ConfigError as error:
            raise errors.ConfigError(f"TokenStoreWriter.add: {error}") from None
        if doc.doc_id in self._ids:
            raise errors.ConfigError(
                f"TokenStoreWriter.add: document {doc.doc_id!r} was added already; ids must be "
                "unique"
            )
        self._ids.add(doc.doc_id)
        self._pending.append(doc)
        if len(self._pending) == self.shard_size:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._entries.append(
                write_shard(self.directory, len(self._entries), self._pending, self.dim)
            )
            self._pending = []

    def close(self) -> TokenStore:
        """Writes the last shard and the manifest; returns the store."""
        if self.store is None:
            self._flush()
            if not self._entries:
                raise errors.ConfigError(f"TokenStoreWriter: no documents for {self.directory}")
            manifest = {
                "model": self.model,
                "indexing": {"shard_size": self.shard_size, "store_beta_d": 1.0},
                "corpus": self.corpus,
                "counts": {
                    "num_docs": sum(e["num_docs"] for e in self._entries),
                    "num_tokens": sum(e["num_tokens"] for e in self._entries),
                    "num_shards": len(self._entries),
                },
                "stats": {"truncated_docs": 0, "empty_docs": 0},
                "shards": self._entries,
            }
            write_manifest(self.directory, manifest)
            self.store = TokenStore(self.directory)
        return self.store

    def __enter__(self) -> TokenStoreWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()


def check_model_matches(manifest: dict, model_info: dict, directory: Path) -> None:
    """Refuses an index built by another model (name, fingerprint, projection or dimension)."""
    built = manifest.get("model", {})
    for key in ("fingerprint", "projection", "dim", "doc_maxlen"):
        if key in model_info and built.get(key) != model_info[key]:
            raise errors.IndexIntegrityError(
                f"{Path(directory) / MANIFEST}: the index was built with {key}="
                f"{built.get(key)!r} ({built.get('name')}), but the model searching it has "
                f"{key}={model_info[key]!r} ({model_info.get('name')}). Search with the model "
                "that built the index, or rebuild the index with this model."
            )
