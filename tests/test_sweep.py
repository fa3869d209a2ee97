"""The β^d × β^q pruning sweep on a tiny BEIR folder: JSON, Markdown and PNG outputs."""

from __future__ import annotations

import json

import gin
from fixtures import write_toy_beir

from aligner_jax import gin_utils, sweeps


def test_sweep_writes_table_json_and_small_plots(tmp_path):
    data = write_toy_beir(tmp_path / "data")
    gin.clear_config()
    try:
        gin_utils.parse_gin(
            ["models/minilm_identity.gin", "sweeps/pruning.gin"],
            [
                "sweep.beta_d = (1.0, 0.25)",
                "sweep.beta_q = (1.0, 0.5)",
                "sweep.strategies = ('top_k:1', 'top_k:2', 'top_p:0.1')",
                "SearchConfig.backend = 'exact'",
                "SearchConfig.k_prime = 8",
            ],
        )
        report = sweeps.sweep(dataset_dir=str(data), output_dir=str(tmp_path / "out"))
    finally:
        gin.clear_config()
    out = tmp_path / "out"
    saved = json.loads((out / "sweep.json").read_text())
    assert saved == json.loads(json.dumps(report))
    grid = {(p["beta_d"], p["beta_q"]): p for p in saved["points"]}
    assert set(grid) == {(1.0, 1.0), (1.0, 0.5), (0.25, 1.0), (0.25, 0.5)}
    # Pruning a quarter of the document tokens shrinks the token index accordingly.
    full, pruned = grid[(1.0, 1.0)], grid[(0.25, 1.0)]
    assert pruned["token_index_tokens"] < 0.35 * full["token_index_tokens"]
    assert pruned["token_index_bytes"] < 0.4 * full["token_index_bytes"]
    for p in saved["points"]:
        assert 0.0 <= p["ndcg@10"] <= 1.0 and p["search_ms_per_query_p50"] > 0
    assert set(saved["strategies"]) == {"top_k:1", "top_k:2", "top_p:0.1"}
    assert saved["strategies"]["top_k:1"] == full["ndcg@10"]
    md = (out / "sweep.md").read_text()
    assert "| 25% |" in md and "of unpruned" in md
    for png in ("toy_ndcg_vs_beta_d.png", "toy_ndcg_vs_cost.png"):
        data_png = (out / png).read_bytes()
        assert data_png[:8] == b"\x89PNG\r\n\x1a\n" and len(data_png) < 200_000
