"""The process's worker threads for the query path's compiled passes (``retrieval.probe_scores``,
``retrieval.residual_max``): one pool, started on first use, grown when a caller needs more
threads, and forgotten in a forked child.

The passes release the GIL, so a search splits its work between the calling thread and these
workers, as many as ``--threads`` (``common.blas.threads()``) allows.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_POOL: dict = {"executor": None, "workers": 0}
_LOCK = threading.Lock()


def _forget() -> None:
    """In a forked child: the parent's worker threads do not exist there, and an executor that
    believes it has them would never run what it is given; the child starts its own."""
    global _LOCK
    _LOCK = threading.Lock()
    _POOL.update(executor=None, workers=0)


os.register_at_fork(after_in_child=_forget)


def pool(workers: int) -> ThreadPoolExecutor:
    """The process's worker threads, at least ``workers`` of them."""
    with _LOCK:
        if _POOL["workers"] < workers:
            # the old executor is dropped, not shut down: a caller that holds it may still
            # submit to it, and its idle threads exit once nothing refers to it
            _POOL["executor"] = ThreadPoolExecutor(workers, thread_name_prefix="query_workers")
            _POOL["workers"] = workers
        return _POOL["executor"]
