"""Rows of a 2-D array kept in a scratch file and read back piece by piece (the k-means sample).

The k-means sample is O(centroids) — 32 vectors per centroid — but not small: 2.1M float16
rows of 128 dimensions (0.5 GiB) at 65,536 centroids. Held in memory, it set the peak RSS of a
124M-token build (1.23 GiB against 0.92 GiB at 12M tokens and 32,768 centroids). A
:class:`SampleFile` keeps the rows in a file that is unlinked as soon as it is opened (a killed
build leaves nothing behind) and reads and writes them with ``pread``/``pwrite``, never a memory
map: the rows live in the kernel's page cache, outside the process's resident memory, and the
build holds one chunk of them at a time. It reads like the array it replaces: ``len``,
``shape``, ``dtype``, ``f[lo:hi]`` (a contiguous read), ``f[rows]`` for any index array (a
gather: rows close together are read in one call), ``f[lo:hi] = values`` (a write).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

GAP_ROWS = 64  # rows this close in a gather are read in one call (with the rows between)
SPAN_ROWS = 1 << 16  # rows read in one call at most


class SampleFile:
    """A ``[rows, dim]`` array of ``dtype`` in an unlinked scratch file under ``directory``."""

    def __init__(self, directory: Path | str, shape: tuple[int, int], dtype):
        self.shape = (int(shape[0]), int(shape[1]))
        self.dtype = np.dtype(dtype)
        self.ndim = 2
        self._row_bytes = self.shape[1] * self.dtype.itemsize
        self.directory = Path(directory)
        fd, path = tempfile.mkstemp(prefix=".sample-", suffix=".tmp", dir=directory)
        os.unlink(path)  # the file lives while ``fd`` is open, never after
        self._fd = fd
        os.ftruncate(fd, self.shape[0] * self._row_bytes)

    def __len__(self) -> int:
        return self.shape[0]

    def __enter__(self) -> SampleFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _read(self, start: int, stop: int) -> np.ndarray:
        out = np.empty((stop - start, self.shape[1]), self.dtype)
        view = memoryview(out.reshape(-1).view(np.uint8))
        done, offset = 0, start * self._row_bytes
        while done < len(view):  # pread may return less than asked
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(f"short read of the k-means sample file at byte {offset + done}")
            done += n
        return out

    def _write(self, start: int, values: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(values, self.dtype).reshape(-1).view(np.uint8))
        done, offset = 0, start * self._row_bytes
        while done < len(data):
            done += os.pwrite(self._fd, data[done:], offset + done)

    def _span(self, key: slice) -> tuple[int, int]:
        start, stop, step = key.indices(self.shape[0])
        if step != 1:
            raise IndexError("a SampleFile reads contiguous slices (step 1) or index arrays")
        return start, max(start, stop)

    def __getitem__(self, key) -> np.ndarray:
        if isinstance(key, slice):
            return self._read(*self._span(key))
        return self.take(np.asarray(key))

    def __setitem__(self, key: slice, values: np.ndarray) -> None:
        start, stop = self._span(key)
        values = np.asarray(values)
        if values.shape != (stop - start, self.shape[1]):
            raise ValueError(f"rows {start}:{stop} take shape {(stop - start, self.shape[1])}")
        self._write(start, values)

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (any order, repeats allowed) as one array; sorted, rows at most
        ``GAP_ROWS`` apart are read together, ``SPAN_ROWS`` at most per read."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.shape[0]):
            raise IndexError(f"rows out of range [0, {self.shape[0]})")
        order = np.argsort(rows, kind="stable")
        ordered = rows[order]
        out = np.empty((len(rows), self.shape[1]), self.dtype)
        cuts = np.flatnonzero(np.diff(ordered) > GAP_ROWS) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(ordered)], strict=True):
            while lo < hi:  # a run of nearby rows, in reads of at most SPAN_ROWS rows
                first = int(ordered[lo])
                end = int(np.searchsorted(ordered[lo:hi], first + SPAN_ROWS)) + lo
                block = self._read(first, int(ordered[end - 1]) + 1)
                out[order[lo:end]] = block[ordered[lo:end] - first]
                lo = end
        return out

    def permuted(self, order: np.ndarray, chunk: int = SPAN_ROWS) -> SampleFile:
        """A new file (same directory) whose row ``i`` is this file's row ``order[i]``, written
        chunk by chunk of this file (one read each, then one write per run of destinations)."""
        order = np.asarray(order, np.int64)
        destination = np.empty(len(order), np.int64)
        destination[order] = np.arange(len(order))
        out = SampleFile(self.directory, (len(order), self.shape[1]), self.dtype)
        for lo in range(0, self.shape[0], chunk):
            block = self._read(lo, min(lo + chunk, self.shape[0]))
            dest = destination[lo : lo + len(block)]
            by_dest = np.argsort(dest, kind="stable")
            dest = dest[by_dest]
            cuts = np.flatnonzero(np.diff(dest) != 1) + 1
            for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(dest)], strict=True):
                out._write(int(dest[a]), block[by_dest[a:b]])
        return out
