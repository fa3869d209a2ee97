"""Full-SciFact acceptance checks (``make test-slow``; skipped by ``make test`` / CI).

They encode the whole SciFact corpus (1.24M tokens, several minutes on 2 CPU cores).
"""

from __future__ import annotations

from pathlib import Path

import gin
import pytest

from aligner_jax.common import cli
from aligner_jax.evaluation import beir_eval

SCIFACT = Path(__file__).resolve().parents[2] / "shared" / "data" / "beir" / "scifact"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SCIFACT.is_dir(), reason=f"{SCIFACT} is not available"),
]


def _evaluate(tmp_path_factory, *files, bindings=()):
    gin.clear_config()
    try:
        cli.parse_gin(list(files), list(bindings))
        return beir_eval.evaluate(
            dataset_dir=str(SCIFACT),
            output_dir=str(tmp_path_factory.mktemp("out")),
            index_dir=str(INDEX_DIR),
        )
    finally:
        gin.clear_config()


INDEX_DIR = Path("/tmp/aligner_jax_slow_scifact_index")


def test_zero_shot_scifact_exhaustive_and_scann(tmp_path_factory):
    exhaustive = _evaluate(tmp_path_factory, "eval/zero_shot.gin", "eval/exhaustive.gin")
    # all-MiniLM-L6-v2 token vectors, sum-of-max: 0.707 with PyTorch on this machine.
    assert exhaustive["metrics"]["ndcg@10"] >= 0.700
    scann = _evaluate(tmp_path_factory, "eval/zero_shot.gin")
    assert scann["config"]["search"] == "scann" and scann["config"]["k_prime"] == 4000
    assert abs(scann["metrics"]["ndcg@10"] - exhaustive["metrics"]["ndcg@10"]) <= 0.005
