"""The scaling benchmark's pieces on small inputs (the full runs live in benchmarks/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import scaling  # noqa: E402


def test_calibration_recovers_the_generating_noise(tmp_path):
    scaling.make_store(tmp_path / "store", 200_000, noise=0.074)
    stats = scaling.calibrate(tmp_path / "store")
    assert stats["tokens"] == 200_000 and stats["dim"] == scaling.DIM
    assert stats["matching_noise"] == pytest.approx(0.074, abs=0.01)
    assert stats["held_out_mean_cos_to_nearest_centroid"] == pytest.approx(
        scaling.cos_to_centre(0.074), abs=0.03
    )


def test_scaling_measures_a_small_corpus(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "scaling.py"),
            "--sizes=100000",
            "--num_queries=3",
            "--k_prime=100",
            f"--workdir={tmp_path / 'work'}",
            f"--output={tmp_path / 'out'}",
            "--name=small",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "out" / "small.json").read_text())
    assert row["num_tokens"] == 100_000 and row["num_docs"] == 500 and row["num_parts"] == 1
    assert row["noise"] == scaling.DEFAULT_NOISE and row["k_prime"] == 100
    assert 0.5 <= row["token_recall_10"] <= 1.0 and 0.0 < row["candidate_recall"] <= 1.0
    assert row["index_bytes"] > 100_000 * scaling.DIM  # codes + the float32 reorder copy
    table = (tmp_path / "out" / "small.md").read_text()
    assert "| 100,000 | 1 |" in table and "σ = 0.074" in table
    assert not (tmp_path / "out" / "small.png").exists()  # a plot needs several sizes
