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
says so once, with the fix, when a searcher loads.

:func:`threads` reads how many threads the BLAS may use now: the query path's own parallel pass
(``retrieval.probe_scores``) follows it, so that ``--threads`` (``threadpool_limits``) bounds
both.
"""

from __future__ import annotations

import ctypes

import threadpoolctl
from absl import logging

_checked = False
_controller: list = []


def spinning_openblas() -> list[str]:
    """The loaded OpenBLAS libraries whose idle workers spin: more than one thread, and the
    thread timeout OpenBLAS read at load is its default (``openblas_thread_timeout() == 0``)."""
    paths = []
    for info in threadpoolctl.threadpool_info():
        if info.get("internal_api") != "openblas" or info.get("num_threads", 1) <= 1:
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
            "its idle workers spin ~0.1 s after each BLAS call and slow the search itself "
            "and the next query's encoding (~1.4-1.5x on 2 cores). Import aligner_jax before "
            "numpy, or set OPENBLAS_THREAD_TIMEOUT=4 in the environment.",
            paths[0],
        )


def threads() -> int:
    """The threads NumPy's BLAS may use now (its limit under ``threadpoolctl.threadpool_limits``,
    which the binaries' ``--threads`` set); 1 where no BLAS library reports one. The libraries
    are found once per process; reading their limit costs ~1 µs."""
    if not _controller:
        _controller.append(threadpoolctl.ThreadpoolController().select(user_api="blas"))
    counts = [lib.num_threads for lib in _controller[0].lib_controllers]
    return max(counts, default=1)
