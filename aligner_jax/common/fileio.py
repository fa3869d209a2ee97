"""Atomic file writes and checksums, shared by every stage that writes outputs.

A file is written under a temporary name beside its destination, flushed, fsync'ed and renamed
over it, then the folder is fsync'ed: a reader (or a resumed job) sees the old file or the new
one, never a torn one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np


def fsync_dir(directory: str | os.PathLike) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> Path:
    """Calls ``write(f)`` on a temporary binary file beside ``path``, then renames it to ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, sort_keys: bool = True) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=sort_keys) + "\n")


def atomic_save_npy(path: str | os.PathLike, array: np.ndarray) -> Path:
    return atomic_write(path, lambda f: np.save(f, np.ascontiguousarray(array), allow_pickle=False))


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
