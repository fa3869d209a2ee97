"""The β^d × β^q pruning sweep on a tiny BEIR folder: JSON, Markdown and PNG outputs."""

from __future__ import annotations

import json

import gin
from fixtures import run_module, write_toy_beir

from aligner_jax.common import cli
from aligner_jax.evaluation import pruning_sweep


def test_sweep_writes_table_json_and_small_plots(tmp_path):
    data = write_toy_beir(tmp_path / "data")
    gin.clear_config()
    try:
        cli.parse_gin(
            ["models/minilm_identity.gin", "sweeps/pruning.gin"],
            [
                "sweep.beta_d = (1.0, 0.25)",
                "sweep.beta_q = (1.0, 0.5)",
                "sweep.strategies = ('top_k:1', 'top_k:2', 'top_p:0.1')",
                "SearchConfig.backend = 'exact'",
                "SearchConfig.k_prime = 8",
            ],
        )
        report = pruning_sweep.sweep(dataset_dir=str(data), output_dir=str(tmp_path / "out"))
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
    assert saved["truncation"] == {  # as in aligner-eval's metrics.json
        "query_maxlen": 512,
        "queries_truncated": 0,
        "doc_maxlen": 256,
        "docs_truncated": 0,
    }
    assert saved["strategies"]["top_k:1"] == full["ndcg@10"]
    md = (out / "sweep.md").read_text()
    assert "| 25% |" in md and "of unpruned" in md
    assert "Truncated: 0 queries at 512 tokens, 0 documents at 256 tokens." in md
    # The zero-shot model has no saliences: β keeps the first tokens, and the report says so
    # (its plot was titled "pruning by unary salience").
    assert saved["pruned_by"] == pruning_sweep.PRUNED_BY[False] and saved["pruned_by"] in md
    fig = pruning_sweep.figure_ndcg_vs_beta_d(saved)
    assert "pruning by position" in fig.axes[0].get_title()
    for png in ("toy_ndcg_vs_beta_d.png", "toy_ndcg_vs_cost.png"):
        data_png = (out / png).read_bytes()
        assert data_png[:8] == b"\x89PNG\r\n\x1a\n" and len(data_png) < 200_000


def test_sweep_binary_reports_a_missing_dataset_in_one_line(tmp_path):
    proc = run_module(
        "aligner_jax.sweep",
        "--gin_file=models/bert_tiny.gin",
        "--gin_file=sweeps/pruning.gin",
        f"--dataset_dir={tmp_path / 'nowhere'}",
        f"--output_dir={tmp_path / 'o'}",
    )
    assert proc.returncode != 0
    assert "aligner-sweep: error:" in proc.stderr and "nowhere" in proc.stderr
    assert "Traceback (most recent call last)" not in proc.stderr
    assert "In call to configurable" not in proc.stderr
    assert not (tmp_path / "o" / "sweep.json").exists()


def test_a_bad_grid_is_refused_before_any_encoding_and_replot_names_a_bad_file(tmp_path):
    """sweep.beta_d=() ended in a ZeroDivisionError after encoding (sweep.json written with no
    points); beta_q=(2.0,) was refused as SearchConfig.beta_q, a binding the user never set,
    after the first token index; replot of a corrupt sweep.json was a JSONDecodeError."""
    import pytest

    from aligner_jax.common.errors import ConfigError

    data = write_toy_beir(tmp_path / "data")
    cases = [
        ("sweep.beta_d = ()", r"^--gin.sweep.beta_d=\(\): expected a non-empty tuple"),
        ("sweep.beta_q = (2.0,)", r"^--gin.sweep.beta_q=2.0: must be in \(0.0, 1.0\]"),
        ("sweep.alignment = 'top_x:3'", "top_x"),
    ]
    for binding, message in cases:
        gin.clear_config()
        try:
            cli.parse_gin(["models/bert_tiny.gin", "sweeps/pruning.gin"], [binding])
            with pytest.raises(ConfigError, match=message):
                pruning_sweep.sweep(dataset_dir=str(data), output_dir=str(tmp_path / "out"))
        finally:
            gin.clear_config()
        assert not (tmp_path / "out").exists()
    (tmp_path / "bad").mkdir()
    for text in ("{", "{}"):
        (tmp_path / "bad" / "sweep.json").write_text(text)
        with pytest.raises(ConfigError, match=r"sweep.json: not a sweep's results"):
            pruning_sweep.replot(str(tmp_path / "bad"))
