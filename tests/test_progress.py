"""common/progress.py: rates and ETAs exclude the first (compiling) update; quiet off a terminal."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from aligner_jax.common import progress


@pytest.fixture(autouse=True)
def _restore_mode():
    yield
    progress.set_mode("auto")


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_rate_starts_after_the_first_update(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(progress.time, "perf_counter", clock)
    progress.set_mode("none")
    bar = progress.Progress(10, "encode", "doc")
    clock.now += 50.0  # the first batch compiles for 50 s
    bar.update(2, tokens=100)
    assert bar.rate() == 0.0
    clock.now += 4.0  # then 4 docs (400 tokens) in 4 s: 1 doc/s, not 6 docs in 54 s
    bar.update(4, tokens=400)
    assert bar.rate() == pytest.approx(1.0)
    line = bar.line()
    assert line.startswith("encode: 6/10 (60%), 1.00doc/s, 100 tokens/s, ETA 00:04"), line


def test_skip_takes_done_work_out_of_the_total(monkeypatch):
    progress.set_mode("none")
    bar = progress.Progress(10, "index", "doc")
    bar.skip(4)
    assert bar.total == 6


def test_auto_is_quiet_off_a_terminal(monkeypatch, caplog):
    """Tests, log files and cluster jobs: no bar; a log line only every LOG_EVERY_S."""
    clock = FakeClock()
    monkeypatch.setattr(progress.time, "perf_counter", clock)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a TTY
    assert progress.current_mode() == "log"
    with caplog.at_level(logging.INFO):
        with progress.Progress(100, "search", "query") as bar:
            for _ in range(10):
                clock.now += 1.0
                bar.update(1)
        assert not [r for r in caplog.records if "search:" in r.getMessage()]
        with progress.Progress(100, "search", "query") as bar:
            for _ in range(40):
                clock.now += 1.0
                bar.update(1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("search:")]
    assert lines == ["search: 31/100 (31%), 1.00query/s, ETA 01:09"]
    assert sys.stderr.getvalue() == ""


def test_bar_mode_draws_on_stderr(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    progress.set_mode("bar")
    with progress.Progress(3, "train", "step") as bar:
        for _ in range(3):
            bar.update(1, tokens=10)
    assert "train: 100%" in err.getvalue() and "3/3" in err.getvalue()
    with pytest.raises(ValueError, match="progress mode 'loud'"):
        progress.set_mode("loud")
