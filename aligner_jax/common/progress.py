"""Progress of long steps (encoding, indexing, index builds, search, adaptation, sweeps, training).

One mechanism, :class:`Progress`, rendered one of three ways (``--progress``, set by
``common/cli.py`` for every binary; :func:`set_mode` in a library session):

- ``auto`` (default): a tqdm bar on stderr when stderr is a terminal; otherwise (a log file, a
  cluster job, a test) nothing but an absl INFO line every ``LOG_EVERY_S`` seconds for a step that
  runs that long, so short steps and tests stay quiet.
- ``bar``: always the tqdm bar; ``log``: always the periodic log lines; ``none``: nothing.

Rates and ETAs exclude compilation: the clock starts after the first update (the first batch or
training step, which is where XLA compiles), and the rate is the plain mean since then.
"""

from __future__ import annotations

import sys
import time

import tqdm
from absl import logging

MODES = ("auto", "bar", "log", "none")
LOG_EVERY_S = 30.0
_BAR_FORMAT = (
    "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}"
    "{postfix}]"
)
_LOG_FORMAT = (
    "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%), {rate_fmt}{postfix}, ETA {remaining}"
)
_LOG_FORMAT_NO_TOTAL = "{desc}: {n_fmt} done, {rate_fmt}{postfix}"

_mode = "auto"


def set_mode(mode: str) -> None:
    """Chooses how every later :class:`Progress` renders (one of ``MODES``)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"progress mode {mode!r}: choose one of {MODES}")
    _mode = mode


def current_mode() -> str:
    """The mode in force: ``auto`` resolved to ``bar`` (stderr is a terminal) or ``log``."""
    if _mode != "auto":
        return _mode
    return "bar" if sys.stderr.isatty() else "log"


class Progress:
    """A counter of ``total`` units (None: unknown) with rate and ETA, closed at the end.

    ``update(n, tokens=k)`` adds ``n`` units and, as a ``tokens/s`` rate beside the main one, any
    other named count. Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str = "it",
        log_every_s: float = 0.0,
        enabled: bool = True,
    ):
        self.total, self.desc, self.unit = total, desc, unit
        self.mode = current_mode() if enabled else "none"
        self.n = 0
        self.warm_n = 0  # units done before the clock started (the first, compiling update)
        self.counts: dict[str, float] = {}
        self.warm_counts: dict[str, float] = {}
        self.start: float | None = None
        self.created = self.last_log = time.perf_counter()
        self.log_every_s = log_every_s or LOG_EVERY_S
        self._bar = None
        if self.mode == "bar":
            self._bar = tqdm.tqdm(
                total=total,
                desc=desc,
                unit=unit,
                file=sys.stderr,
                smoothing=0.0,  # the mean rate since the clock started, not a noisy EMA
                dynamic_ncols=True,
                leave=True,
                bar_format=_BAR_FORMAT if total else None,
            )

    # -- counting ------------------------------------------------------------------------------
    def update(self, n: int = 1, **counts: float) -> None:
        self.n += n
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0.0) + value
        now = time.perf_counter()
        if self.start is None:  # the first update compiled: the clock starts now
            self.start, self.warm_n, self.warm_counts = now, self.n, dict(self.counts)
            self.last_log = now  # log lines every log_every_s of the clock, not of compiling
            if self._bar is not None:
                self._bar.n = self._bar.initial = self.n  # tqdm: rate = (n - initial) / elapsed
                self._bar.start_t = self._bar.last_print_t = self._bar._time()
                self._bar.last_print_n = self.n
                self._bar.refresh()
            return
        if self._bar is not None:
            if self.counts:
                self._bar.set_postfix_str(self._postfix(now), refresh=False)
            self._bar.update(n)
        elif self.mode == "log" and now - self.last_log >= self.log_every_s:
            self.last_log = now
            logging.info("%s", self.line(now))

    def skip(self, n: int) -> None:
        """Takes ``n`` units out of the total (work found already done, e.g. a resumed job's
        complete shards), so rate and ETA cover only what is computed now."""
        if self.total is not None:
            self.total = max(self.total - n, self.n)
            if self._bar is not None:
                self._bar.total = self.total
                self._bar.refresh()

    def rate(self, now: float | None = None) -> float:
        """Units per second since the clock started (0 before two updates)."""
        if self.start is None:
            return 0.0
        elapsed = (now or time.perf_counter()) - self.start
        return (self.n - self.warm_n) / elapsed if elapsed > 0 else 0.0

    def _postfix(self, now: float) -> str:
        elapsed = max(now - (self.start or now), 1e-9)
        return ", ".join(
            f"{(v - self.warm_counts.get(k, 0.0)) / elapsed:,.0f} {k}/s"
            for k, v in self.counts.items()
        )

    def line(self, now: float | None = None) -> str:
        """The progress as one line of text (what the ``log`` mode prints)."""
        now = now or time.perf_counter()
        elapsed = now - (self.start or now)
        fmt = _LOG_FORMAT if self.total else _LOG_FORMAT_NO_TOTAL
        postfix = self._postfix(now)
        text = tqdm.tqdm.format_meter(
            self.n,
            self.total,
            elapsed,
            prefix=self.desc,
            unit=self.unit,
            initial=self.warm_n,
            bar_format=fmt,
            postfix=postfix,
        )
        return " ".join(text.split())  # tqdm pads the rate to a fixed width

    def write(self, text: str) -> None:
        """Prints a line of results without breaking the bar (stdout)."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    # -- the end -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._bar is not None:
            if self.counts:
                self._bar.set_postfix_str(self._postfix(time.perf_counter()), refresh=False)
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
