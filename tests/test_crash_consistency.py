"""Crash-consistent updates (issue 24): every update (add, delete, compact, search-index rebuild,
vacuum) killed at each of its durable steps in turn, or hitting a full disk there, leaves an
index that opens with verified checksums and answers exactly as before or exactly as after the
update; the same command run again reaches the after-state and removes what the killed writer
left. And a reader searching while another process commits sees only committed generations.

The work runs in ``tests/crash_driver.py`` (its own process, which forks one child per fault).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import TEST_XLA_FLAGS

DRIVER = Path(__file__).with_name("crash_driver.py")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The drivers' environment: CPU, and a persistent compilation cache shared by every
    forked child (each would otherwise compile the same kernels again: 2.5x slower)."""
    cache = tmp_path_factory.mktemp("jax_cache")
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache))
    env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env.update(JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    env["XLA_FLAGS"] = TEST_XLA_FLAGS  # the run's flags, without any forced device count
    return env


def _driver(env: dict, *args: str, timeout: int = 600) -> dict:
    proc = subprocess.run(
        [sys.executable, str(DRIVER), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


@pytest.mark.parametrize(
    "op, fault",
    [
        ("add", "kill"),
        ("delete", "kill"),
        ("compact", "kill"),
        ("rebuild", "kill"),
        ("vacuum", "kill"),
        ("add", "enospc"),
    ],
)
def test_an_update_killed_at_any_step_leaves_the_old_or_the_new_index(env, tmp_path, op, fault):
    report = _driver(env, f"--op={op}", f"--work={tmp_path}", f"--fault={fault}")
    results = report["results"]
    assert results[-1]["exit"] == 0 and results[-1]["state"] == "after"  # ran past its last step
    faults = results[:-1]
    assert len(faults) >= 8, f"only {len(faults)} durable steps: is fault injection wired?"
    assert {r["state"] for r in faults} <= {"before", "after"}, faults
    assert "before" in {r["state"] for r in faults}  # faults before the commit point
    if fault == "kill":
        assert all(r["exit"] == -9 for r in faults)
        assert "after" in {r["state"] for r in faults}  # and after it (cleanup steps)
    else:  # a full disk is one clear error (exit 3), never a crash; a write that may fail
        # (the record of a verification) lets the update finish (exit 0)
        assert {r["exit"] for r in faults} <= {0, 3} and 3 in {r["exit"] for r in faults}
    for r in faults:
        assert r["rerun_state"] == "after", r  # re-running the command completes it
        assert r["tmp_after_rerun"] == 0, r  # and the next writer removed the leftovers


def test_a_reader_sees_only_committed_generations_while_a_writer_commits(env, tmp_path):
    """1,000 searches in one process while another commits 20 transactions: no error, and every
    answer is the exhaustive answer of a committed generation."""
    _driver(env, "--op=make_base", f"--work={tmp_path}")
    base = [sys.executable, str(DRIVER), f"--work={tmp_path}"]
    writer = subprocess.Popen(
        base + ["--op=writer", "--n=20", f"--out={tmp_path / 'writer.json'}"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    reader = subprocess.Popen(
        base + ["--op=reader", "--n=1000", f"--out={tmp_path / 'reader.json'}"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, werr = writer.communicate(timeout=600)
    _, rerr = reader.communicate(timeout=600)
    assert writer.returncode == 0, werr[-3000:]
    assert reader.returncode == 0, rerr[-3000:]
    committed = json.loads((tmp_path / "writer.json").read_text())
    seen = json.loads((tmp_path / "reader.json").read_text())
    assert seen["errors"] == []
    assert len(seen["answers"]) >= 1000  # and on until the writer was done
    assert len({json.dumps(a) for a in committed}) > 5  # the generations answer differently
    assert len({json.dumps(a) for a in seen["answers"]}) > 1  # the reader saw commits happen
    unknown = [a for a in seen["answers"] if a not in committed]
    assert unknown == []
