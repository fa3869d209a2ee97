"""Counting XLA compilations with JAX's own monitoring hooks (issue 27: nothing compiles after
load). One rule for the tests and ``benchmarks/e2e_latency.py``.

Every compilation request records the ``backend_compile_duration`` event, which JAX times around
the persistent compilation cache's lookup as well as XLA: with a cache configured
(``JAX_COMPILATION_CACHE_DIR``) an executable loaded from it is still
counted, so a cache cannot hide a compilation after load. The hits are also counted apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from jax import monitoring

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"  # recorded on hits only


class CompileCounter:
    """Listener (``monitoring.register_event_duration_secs_listener``) that records each
    compilation's function name and seconds, and how many of them the persistent cache served."""

    def __init__(self):
        self.names: list[str] = []
        self.seconds = 0.0
        self.cache_hits = 0

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            self.names.append(str(kwargs.get("fun_name", "?")))
            self.seconds += duration
        elif event == CACHE_HIT_EVENT:
            self.cache_hits += 1

    @property
    def count(self) -> int:
        return len(self.names)


@contextlib.contextmanager
def counting() -> Iterator[CompileCounter]:
    """``with counting() as c:`` — every compilation inside the block lands in ``c.names``."""
    counter = CompileCounter()
    monitoring.register_event_duration_secs_listener(counter)
    try:
        yield counter
    finally:
        monitoring.unregister_event_duration_listener(counter)
