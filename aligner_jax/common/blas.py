"""NumPy's OpenBLAS workers between searches: asleep, or spinning beside the query encoder.

After each BLAS call OpenBLAS keeps its worker threads spinning for 2^28 cycles (~0.1 s) unless
``OPENBLAS_THREAD_TIMEOUT`` was set when the library loaded. On a few cores they then take the
cores XLA needs to encode the next query (SciFact, 2 threads: encoding p50 13.4 ms after a
search against 8.9 ms with workers that sleep; ``benchmarks/results/README.md``, stop 44), and
the cores of the search's own parallel passes, which run right after its first matrix product
(CISI zero-shot, 38 queries, 2 threads, stop 92: search p50 18.3–20.0 ms with NumPy imported
first against 13.5–13.7 ms with the package first).
``import aligner_jax`` sets the variable, but a program that imported NumPy first has already
loaded OpenBLAS with the default, and no call changes it afterwards: :func:`warn_if_spinning`
says so once, with the fix, when a searcher loads. The search then keeps those workers asleep
itself: :func:`one_thread_if_spinning` (:func:`held`: ``Searcher.run`` and ``rerank``,
``CentroidSearcher.search``) holds such a library at one thread while a query runs (a
one-thread call wakes no worker), and :func:`matmul` cuts the query's matrix products between
the search's own threads instead, each on one BLAS thread. Measured with NumPy imported first
(``benchmarks/import_order.py``, 2 threads, the default search, stop 93): CISI zero-shot at
k = 100, search p50 44.5 → 29.2 ms and end to end 71.5 → 45.6 (the package first: 29.3 and
46.2); SciFact zero-shot at k = 10, 11.6 → 8.4 and 24.5 → 17.0 (8.8 and 17.6). What the
program's own BLAS calls leave spinning still slows the next encoding.

:func:`threads` reads how many threads the BLAS may use now: the query path's own parallel pass
(``retrieval.probe_scores``) follows it, so that ``--threads`` (``threadpool_limits``) bounds
both.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading

import numpy as np
import threadpoolctl
from absl import logging

from aligner_jax.common import workers

_checked = False
_controller: list = []
_spinning: list = []  # [the spinning libraries' controllers], found once per process
# while a query holds the spinning libraries at one thread: how many queries, the thread count
# the search may use (the BLAS limit before), and each library's count to restore
_QUIET = {"depth": 0, "threads": 1, "saved": []}
_QUIET_LOCK = threading.Lock()
MATMUL_PART_ROWS = 256  # rows of a product's left factor per thread, at least


def spinning_openblas(any_count: bool = False) -> list[str]:
    """The loaded OpenBLAS libraries whose idle workers spin: more than one thread (any count
    with ``any_count``: a library limited to one now may get more later), and the thread
    timeout OpenBLAS read at load is its default (``openblas_thread_timeout() == 0``)."""
    paths = []
    for info in threadpoolctl.threadpool_info():
        if info.get("internal_api") != "openblas":
            continue
        if not any_count and info.get("num_threads", 1) <= 1:
            continue
        try:
            timeout = ctypes.CDLL(info["filepath"]).openblas_thread_timeout()
        except (OSError, AttributeError):  # a build without the getter: nothing to say
            continue
        if timeout == 0:
            paths.append(info["filepath"])
    return paths


def warn_if_spinning() -> None:
    """Logs one warning per process when :func:`spinning_openblas` finds a library. Looks once:
    the timeout is fixed when OpenBLAS loads (a server's every snapshot load would ask again)."""
    global _checked
    if _checked:
        return
    _checked = True
    paths = spinning_openblas()
    if paths:
        logging.warning(
            "NumPy's OpenBLAS (%s) was loaded before aligner_jax without OPENBLAS_THREAD_TIMEOUT: "
            "its idle workers spin ~0.1 s after each BLAS call. The search holds it at one "
            "thread while a query runs, but the program's own NumPy calls still leave them "
            "spinning beside the next query's encoding. Import aligner_jax before numpy, or "
            "set OPENBLAS_THREAD_TIMEOUT=4 in the environment.",
            paths[0],
        )


def _blas() -> list:
    """The process's BLAS libraries' controllers (``threadpoolctl``), found once."""
    if not _controller:
        _controller.append(threadpoolctl.ThreadpoolController().select(user_api="blas"))
    return _controller[0].lib_controllers


def threads() -> int:
    """The threads NumPy's BLAS may use now (its limit under ``threadpoolctl.threadpool_limits``,
    which the binaries' ``--threads`` set); 1 where no BLAS library reports one. While
    :func:`one_thread_if_spinning` holds a library at one thread, the limit it had before.

    The fewest of any loaded library's: a library loaded after the limit was set keeps its
    default (a thread per core), as SciPy's own OpenBLAS does, which ``Searcher.load`` loads
    after the binaries set ``--threads`` (the most of them gave ``--threads=1`` a stage 2 on
    every core). The libraries are found once per process; reading their limits costs ~1 µs."""
    if _QUIET["depth"]:
        return _QUIET["threads"]
    return min((lib.num_threads for lib in _blas()), default=1)


def _spinning_libraries() -> list:
    """The controllers of :func:`spinning_openblas`'s libraries, found once per process (the
    timeout is fixed when a library loads; asking costs milliseconds)."""
    if not _spinning:
        paths = set(spinning_openblas(any_count=True))
        _spinning.append([lib for lib in _blas() if lib.filepath in paths])
    return _spinning[0]


@contextlib.contextmanager
def one_thread_if_spinning():
    """Holds the loaded OpenBLAS libraries whose idle workers spin (:func:`spinning_openblas`) at
    one thread for the block, and restores their counts after; nothing where none spins (the
    package imported before NumPy). A one-thread call runs on the calling thread and wakes no
    worker, so none spins beside the search's own threads or the next query's encoding;
    :func:`threads` still gives the limit before, which the search's passes and
    :func:`matmul` share out themselves. Queries on several threads at once hold it together:
    the first one in sets the counts, the last one out restores them."""
    libs = _spinning_libraries()
    if not libs:
        yield
        return
    with _QUIET_LOCK:
        if not _QUIET["depth"]:
            _QUIET["threads"] = threads()
            _QUIET["saved"] = [(lib, lib.num_threads) for lib in libs]
            for lib in libs:
                lib.set_num_threads(1)
        _QUIET["depth"] += 1
    try:
        yield
    finally:
        with _QUIET_LOCK:
            _QUIET["depth"] -= 1
            if not _QUIET["depth"]:
                for lib, count in _QUIET["saved"]:
                    lib.set_num_threads(count)


def held(fn):
    """``fn`` run inside :func:`one_thread_if_spinning` (the query path's entry points)."""

    @functools.wraps(fn)
    def holding(*args, **kwargs):
        with one_thread_if_spinning():
            return fn(*args, **kwargs)

    return holding


def _forget() -> None:
    """In a forked child: no query of the parent's runs there; its libraries get their counts
    back (the child's own queries hold them again)."""
    global _QUIET_LOCK
    _QUIET_LOCK = threading.Lock()
    if _QUIET["depth"]:
        for lib, count in _QUIET["saved"]:
            lib.set_num_threads(count)
    _QUIET.update(depth=0, saved=[])


os.register_at_fork(after_in_child=_forget)


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``np.matmul(a, b, out=out)`` for a 2-D ``a``. While :func:`one_thread_if_spinning` holds
    OpenBLAS at one thread, ``a``'s rows are cut between :func:`threads` threads (the calling
    one and :mod:`workers`'), each product on one BLAS thread: the product as parallel as
    before, and no OpenBLAS worker woken. Every row is the same product as without the cut."""
    parts = min(_QUIET["threads"], a.shape[0] // MATMUL_PART_ROWS) if _QUIET["depth"] else 1
    if parts <= 1:
        return np.matmul(a, b, out=out)
    bounds = np.linspace(0, a.shape[0], parts + 1).astype(int)
    pool = workers.pool(parts - 1)
    futures = [
        pool.submit(np.matmul, a[lo:hi], b, out=out[lo:hi])
        for lo, hi in zip(bounds[1:-1], bounds[2:], strict=True)
    ]
    np.matmul(a[: bounds[1]], b, out=out[: bounds[1]])
    for future in futures:
        future.result()
    return out
