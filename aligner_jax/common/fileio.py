"""Atomic file writes and checksums, shared by every stage that writes outputs.

A file is written under a temporary name beside its destination, flushed, fsync'ed and renamed
over it, then the folder is fsync'ed: a reader (or a resumed job) sees the old file or the new
one, never a torn one. Files get the mode the umask gives a new file (0644 under umask 022),
as ``open`` would, not ``mkstemp``'s 0600: another user of a shared machine can read an index.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import mmap
import os
import resource
import secrets
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from aligner_jax.common import errors

#: Fault injection for the crash-consistency tests: ``ALIGNER_JAX_FAULT=kill:N`` kills this
#: process (SIGKILL) at its N-th durable step, ``enospc:N`` makes that step fail as a full disk
#: would. A step is a file about to be renamed into place, a rename done, or a file removed.
FAULT_ENV = "ALIGNER_JAX_FAULT"
_steps = [0]


def fault_point() -> None:
    """Counts one durable step; kills the process or raises ENOSPC there when
    ``ALIGNER_JAX_FAULT`` says so (tests only; unset, it only counts)."""
    _steps[0] += 1
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    kind, _, at = spec.partition(":")
    if int(at) != _steps[0]:
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def remove(path: str | os.PathLike) -> None:
    """Removes a file (a durable step of ``fault_point``); a missing file is no error."""
    fault_point()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def fsync_dir(directory: str | os.PathLike) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create_temporary(path: Path) -> tuple[int, str]:
    """A new file ``.NAME.<random>.tmp`` beside ``path``, mode 0666 minus the umask."""
    while True:
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Calls ``write(f)`` on a temporary binary file beside ``path``, then renames it to ``path``."""
    path = Path(path)
    try:
        fd, tmp = _create_temporary(path)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            fault_point()
            os.replace(tmp, path)
            fault_point()
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        fsync_dir(path.parent)
    except OSError as e:
        if e.errno not in STORAGE_ERRNOS or isinstance(e, errors.UserError):
            raise
        raise storage_error(path, e.errno, "nothing partial is left and ") from e
    return path


#: errno values of a storage that cannot take the write (the user's to fix), not of a bug.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES})


def storage_error(path: Any, code: int, partial: str = "") -> errors.OutputWriteError:
    """The one-line error of a write that the storage refused (``code`` in ``STORAGE_ERRNOS``):
    it names ``path``, says that completed files are kept and how to fix it. ``partial`` is
    what the caller knows of the file itself (``"nothing partial is left and "``)."""
    kept = (
        f"{partial}the files completed before it are kept (an indexing job resumes after its "
        "last complete shard; an index update is applied whole or not at all)"
    )
    if code == errno.EACCES:  # also a read: the message must not say "not written"
        return errors.OutputWriteError(
            f"{path}: {os.strerror(code)}; {kept}: give this user access to it (or choose "
            "another folder) and re-run"
        )
    fix = "free space and re-run"
    if code == errno.EROFS:
        fix = "choose a folder on a writable filesystem and re-run"
    elif code == errno.EFBIG:
        fix = "raise the file size limit (ulimit -f) or use a filesystem that allows larger files"
    return errors.OutputWriteError(f"{path}: not written ({os.strerror(code)}); {kept}: {fix}")


class NpyStream:
    """A ``.npy`` file of known shape written chunk by chunk, atomically: the rows go to a
    temporary file beside ``path`` (nothing is mapped, so a streaming job's resident memory does
    not grow with the file), and ``close()`` checks that every row came, fsyncs and renames it
    into place. Its sha256 is computed while writing and remembered as ``sha256_tracked``'s
    (the job that wrote it need not read it again). Used as a context manager: an exception
    removes the temporary file."""

    def __init__(self, path: str | os.PathLike, shape: tuple, dtype):
        self.path = Path(path)
        self.shape, self.dtype = tuple(int(x) for x in shape), np.dtype(dtype)
        self._rows = 0
        self._hash = hashlib.sha256()
        fd, self._tmp = _create_temporary(self.path)
        self._file = os.fdopen(fd, "wb")
        fields = np.lib.format.header_data_from_array_1_0(np.empty((0,) + self.shape[1:], dtype))
        header = _BytesSink()
        np.lib.format.write_array_header_1_0(header, fields | {"shape": self.shape})
        self._put(header.data)

    def _put(self, data: bytes | memoryview) -> None:
        try:
            self._file.write(data)
        except OSError as e:
            if e.errno in STORAGE_ERRNOS:
                raise storage_error(self.path, e.errno, "nothing partial is left and ") from e
            raise
        self._hash.update(data)

    def write(self, rows: np.ndarray) -> None:
        rows = np.ascontiguousarray(rows, self.dtype)
        if rows.shape[1:] != self.shape[1:] or self._rows + len(rows) > self.shape[0]:
            raise ValueError(f"{self.path}: rows of shape {rows.shape} do not fit {self.shape}")
        self._put(memoryview(rows.reshape(-1).view(np.uint8)))  # the rows' own bytes, no copy
        self._rows += len(rows)

    def close(self) -> str:
        """Commits the file; returns its sha256."""
        if self._rows != self.shape[0]:
            raise ValueError(f"{self.path}: {self._rows} rows written, expected {self.shape[0]}")
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            fault_point()
            os.replace(self._tmp, self.path)
            fault_point()
            fsync_dir(self.path.parent)
        except OSError as e:
            if e.errno in STORAGE_ERRNOS:
                raise storage_error(self.path, e.errno, "nothing partial is left and ") from e
            raise
        digest = self._hash.hexdigest()
        _remember(self.path, _file_state(self.path), digest)
        return digest

    def abort(self) -> None:
        self._file.close()
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)

    def __enter__(self) -> NpyStream:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


class _BytesSink:
    def __init__(self):
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, sort_keys: bool = True) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=sort_keys) + "\n")


def atomic_save_npy(path: str | os.PathLike, array: np.ndarray) -> Path:
    """``np.save`` atomically. NumPy writes through ``write`` here, not ``tofile``, whose short
    write on a full disk raises an ``OSError`` without its errno (and so a traceback, not the
    one line of ``storage_error``)."""
    array = np.ascontiguousarray(array)
    return atomic_write(path, lambda f: np.save(_Writes(f), array, allow_pickle=False))


class _Writes:
    """A file seen only through its ``write`` (NumPy then writes in chunks through it)."""

    def __init__(self, file):
        self.write = file.write


_LOAD_LOCK = threading.Lock()


class NpyRows:
    """The rows of a ``.npy`` file read on demand with plain reads, never mapped: what a streaming
    job reads leaves its resident memory when dropped (the pages of a mapped file count as the
    process's own for as long as the mapping lives). ``len``, ``shape``, ``dtype`` and
    ``rows[lo:hi]`` (contiguous slices only)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with _LOAD_LOCK, open(self.path, "rb") as f:  # the header is parsed as np.load does
            version = np.lib.format.read_magic(f)
            header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = header(f)
            self._offset = f.tell()
        if fortran and len(shape) > 1:
            raise ValueError(f"{self.path}: a Fortran-ordered array cannot be read by rows")
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self._row_items = int(np.prod(self.shape[1:], dtype=np.int64))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError(f"{self.path}: NpyRows reads contiguous slices of rows only")
        start, stop, step = key.indices(self.shape[0])
        if step != 1:
            raise TypeError(f"{self.path}: NpyRows reads contiguous slices of rows only")
        count = max(stop - start, 0) * self._row_items
        offset = self._offset + start * self._row_items * self.dtype.itemsize
        rows = np.fromfile(self.path, self.dtype, count=count, offset=offset)
        return rows.reshape((max(stop - start, 0),) + self.shape[1:])


def open_file_limit() -> int:
    """The process's soft limit on open files (``ulimit -n``); 1 << 20 when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)


def load_npy(path: str | os.PathLike, mmap: bool = True) -> np.ndarray:
    """``np.load`` of an index array (mapped by default), one thread at a time: ``np.load``
    parses the header with ``ast``, which CPython 3.11 is not safe to run in several threads
    at once (searches open shard files from worker threads)."""
    with _LOAD_LOCK:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)


def release_pages(array: np.ndarray) -> bool:
    """Drops the pages of a memory-mapped array (``load_npy``'s) from this process's resident
    set: ``madvise(MADV_DONTNEED)`` on its read-only shared map, so the pages a pass over the
    whole file touched stop counting in RSS while the kernel's page cache keeps them (a later
    read faults them back from memory, the same bytes). False, and nothing done, for an array
    that is not a map or where the call is not available."""
    mapped = getattr(array, "_mmap", None)
    if not isinstance(mapped, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return False
    mapped.madvise(mmap.MADV_DONTNEED)
    return True


def read_json(path: str | os.PathLike, fix: str = "rebuild this index"):
    """A JSON file the project wrote (an index's manifest, ``encoder.json``...); invalid JSON is
    an ``IndexIntegrityError`` naming the file and ``fix``."""
    try:
        return json.loads(Path(path).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise errors.IndexIntegrityError(f"{path}: not valid JSON ({e}); {fix}") from e


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def check_output_dir(path: str | os.PathLike, flag: str) -> Path:
    """Refuses, without creating anything, an output folder that could not be written: a file,
    a folder under a file, or a folder (or its first existing parent) without write permission
    or on a read-only filesystem. ``flag`` names it in the message (``--output_dir``)."""
    path = Path(path)
    where = f"{flag}={path}"
    if path.exists() and not path.is_dir():
        raise errors.ConfigError(f"{where}: is a file, not a folder; choose another {flag}")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise errors.ConfigError(f"{where}: {existing} is a file, not a folder")
    try:  # a real write: permission bits, read-only mounts, ACLs and root all answer alike
        fd, probe = tempfile.mkstemp(prefix=".aligner-write-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise errors.ConfigError(
            f"{where}: cannot write in {existing} ({os.strerror(e.errno) if e.errno else e}); "
            f"choose another {flag}"
        ) from None
    return path


PENDING_OUTPUTS = ".outputs-pending.json"  # the files a write_outputs in progress may leave


def write_outputs(directory: Path, files: dict[str, str | bytes], report: dict) -> dict:
    """Writes a job's output files and then ``metrics.json`` as the commit marker.

    The previous ``metrics.json`` is removed first, every file is written atomically, the files
    the previous ``metrics.json`` listed that this run does not write are removed (a re-run
    without ``--adapt`` leaves no ``adaptation.json`` of the run before), and the new
    ``metrics.json`` (``report`` plus ``files``: each file's sha256) is written last: a folder
    either has a ``metrics.json`` whose listed files are exactly the job's files beside it, or
    none (an interrupted run, whose files the next run still removes: ``PENDING_OUTPUTS`` lists
    them meanwhile). Files the job never wrote are left alone. Returns the report as written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # what an earlier run listed, also one interrupted after it removed metrics.json (its
    # pending list): a run after it still removes those files
    pending = directory / PENDING_OUTPUTS
    previous = _listed_files(directory / "metrics.json") + _listed_files(pending)
    atomic_write_json(pending, {"files": dict.fromkeys([*previous, *files], "")})
    (directory / "metrics.json").unlink(missing_ok=True)
    sums = {}
    for name, content in files.items():
        data = content.encode("utf-8") if isinstance(content, str) else content
        atomic_write_bytes(directory / name, data)
        sums[name] = hashlib.sha256(data).hexdigest()
    for name in previous:
        if name not in sums and Path(name).name == name:  # a file of this folder, by name
            remove(directory / name)
    report = {**report, "files": sums}
    atomic_write_json(directory / "metrics.json", report, sort_keys=False)
    remove(pending)
    return report


def _listed_files(metrics: Path) -> list[str]:
    """The files a job's ``metrics.json`` lists; none when it is missing or unreadable."""
    try:
        return list(json.loads(metrics.read_text()).get("files", {}))
    except (OSError, ValueError, AttributeError):
        return []


@contextlib.contextmanager
def exclusive_lock(path: str | os.PathLike, what: str):
    """Holds an advisory ``fcntl`` lock on ``path`` (created, holding the holder's pid) for the
    duration of the block. A second holder is refused with a ``LockedError`` naming the pid. The
    kernel drops the lock when its process dies, so a lock file left by a killed run is simply
    taken over."""
    path = Path(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise errors.LockedError(
                f"{what}: another process (pid {holder}) is writing it and holds {path}; wait "
                "for it to finish, or use another folder"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock


def _file_state(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


# sha256 digests this process knows to be those of a file's current bytes, each with the file's
# state (size, mtime, ctime, inode) when it was hashed: files it wrote and hashed
# (``sha256_tracked``) and files ``verify_once`` verified. ``record_verified`` writes
# ``verify_once``'s record from them, so the first open of a freshly written index does not
# hash it again; a file whose state changed since is not known any more.
_KNOWN_DIGESTS: dict[Path, tuple[list[int], str]] = {}


def _remember(path: Path, state: list[int], digest: str) -> None:
    _KNOWN_DIGESTS[Path(os.path.abspath(path))] = (state, digest)


def sha256_tracked(path: str | os.PathLike) -> str:
    """``sha256_file`` of a file this process writes into a manifest, remembered with the file's
    state (when that did not change while hashing) for ``record_verified``; a digest already
    known for the file's current state is reused (a file rewritten since has another inode and
    ctime, so it is hashed again)."""
    path = Path(path)
    state = _file_state(path)
    known = _KNOWN_DIGESTS.get(Path(os.path.abspath(path)))
    if known is not None and known[0] == state:
        return known[1]
    digest = sha256_file(path)
    if _file_state(path) == state:
        _remember(path, state, digest)
    return digest


def record_verified(files: dict[Path, str], anchor: Path, record: Path) -> bool:
    """Writes ``verify_once``'s record for ``files`` (path → the digest ``anchor`` lists) without
    hashing them, when this process knows each file's digest (it wrote and hashed it, or
    verified it) and the file's state is still the one it had then: the job that has just written
    an index records it as verified, and a later open skips the hashing until a file changes.
    Returns whether the record was written (otherwise the next open verifies, as always)."""
    states = {}
    for path, digest in files.items():
        known = _KNOWN_DIGESTS.get(Path(os.path.abspath(path)))
        try:
            if known is None or known[1] != digest or _file_state(Path(path)) != known[0]:
                return False
        except OSError:
            return False
        states[Path(path).name] = known[0]
    try:
        atomic_write_json(record, {"manifest_sha256": sha256_file(anchor), "files": states})
    except OSError:
        return False
    return True


def verify_once(
    files: dict[Path, str], anchor: Path, record: Path, force: bool = False, log=None
) -> bool:
    """Checks each file's sha256 (``files``: path → expected hex digest) unless ``record`` shows
    that exactly these files were verified before: the sha256 of ``anchor`` (the manifest that
    holds the expected digests) and every file's size, mtime, ctime and inode (ctime cannot be
    set back by a user, so any rewrite invalidates the record). ``force`` re-hashes always.
    Raises ``IndexIntegrityError`` naming the first file that differs; returns whether digests
    were computed. A record that cannot be written (read-only folder) only means verifying
    again next time."""
    key = {
        "manifest_sha256": sha256_file(anchor),
        "files": {p.name: _file_state(p) for p in files},
    }
    if not force and record.exists():
        try:
            if json.loads(record.read_bytes()) == key:
                for path, digest in files.items():
                    _remember(path, key["files"][path.name], digest)
                return False
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass  # a damaged record only means verifying again
    for path, digest in files.items():
        if sha256_file(path) != digest:
            raise errors.IndexIntegrityError(
                f"{path}: sha256 does not match {anchor.name}: the file was altered or "
                "corrupted; rebuild this index"
            )
        _remember(path, key["files"][path.name], digest)
    try:
        atomic_write_json(record, key)
    except OSError as e:
        if log is not None:
            log("%s: cannot record the verification (%s)", record, e)
    return True
