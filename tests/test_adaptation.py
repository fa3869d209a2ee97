"""Few-shot alignment adaptation (§4.1 protocol) and its wiring into the beir_eval."""

from __future__ import annotations

import json

import gin
import numpy as np
import pytest
from fixtures import write_toy_beir

from aligner_jax.common import cli
from aligner_jax.common.errors import ConfigError
from aligner_jax.evaluation import adaptation, beir_eval


def _table(num_queries=40, seed=0):
    rng = np.random.default_rng(seed)
    qids = [f"q{i}" for i in range(num_queries)]
    base = rng.uniform(0, 1, size=num_queries)
    per_query = {}
    for j, s in enumerate(adaptation.PAPER_STRATEGIES):
        # top_k:2 is best on every query by a margin; the others are noisy copies.
        bonus = 0.2 if s == "top_k:2" else 0.0
        per_query[s] = {
            q: float(np.clip(base[i] + bonus - 0.01 * j + rng.normal(0, 0.01), 0, 1))
            for i, q in enumerate(qids)
        }
    return per_query


def test_protocol_by_hand():
    per_query = _table()
    config = adaptation.AdaptationConfig(seed=3)
    result = adaptation.few_shot_adaptation(per_query, config)
    qids = sorted(per_query["top_k:1"])
    folds = adaptation.make_folds(qids, 8, 3)
    assert result.num_folds == len(folds) == 5 and all(len(f) == 8 for f in folds)
    assert sorted(q for f in folds for q in f) == qids  # 40 = 5 full folds
    # Recompute each fold by hand: choose on the fold, score on the rest.
    expected = []
    for fold in folds:
        best = max(
            adaptation.PAPER_STRATEGIES,
            key=lambda s: (
                np.mean([per_query[s][q] for q in fold]),
                -adaptation.PAPER_STRATEGIES.index(s),
            ),
        )
        expected.append(np.mean([per_query[best][q] for q in qids if q not in fold]))
    np.testing.assert_allclose(result.fold_scores, expected)
    assert result.fold_choices == ["top_k:2"] * 5
    assert result.adapted_mean == pytest.approx(np.mean(expected))
    assert result.adapted_std == pytest.approx(np.std(expected))
    assert result.default == pytest.approx(np.mean(list(per_query["top_k:1"].values())))
    assert result.oracle_strategy == "top_k:2"
    assert result.oracle == max(result.per_strategy.values())


def test_default_and_oracle_are_measured_on_the_queries_adapted_is():
    """10 queries, one fold of 8: the adapted score was the mean of the 2 remaining queries,
    the default and oracle the mean of all 10, so adapted (63.0) could beat the oracle (41.9)."""
    qids = [f"q{i}" for i in range(10)]
    rng = np.random.default_rng(0)
    per_query = {s: {q: float(rng.random()) for q in qids} for s in adaptation.PAPER_STRATEGIES}
    result = adaptation.few_shot_adaptation(per_query, adaptation.AdaptationConfig())
    (fold,) = adaptation.make_folds(sorted(qids), 8, 0)
    rest = [q for q in qids if q not in fold]
    for s in adaptation.PAPER_STRATEGIES:
        assert result.per_strategy[s] == pytest.approx(np.mean([per_query[s][q] for q in rest]))
    assert result.default == result.per_strategy["top_k:1"]
    assert result.adapted_mean <= result.oracle == max(result.per_strategy.values())


def test_incomplete_fold_is_not_a_few_shot_set_and_ties_prefer_default():
    qids = [f"q{i}" for i in range(20)]
    flat = {s: {q: 0.5 for q in qids} for s in adaptation.PAPER_STRATEGIES}
    result = adaptation.few_shot_adaptation(flat, adaptation.AdaptationConfig())
    assert result.num_folds == 2  # 20 queries: two folds of 8, 4 left over
    assert result.fold_choices == ["top_k:1", "top_k:1"]
    assert result.adapted_std == 0.0


def test_errors():
    with pytest.raises(ValueError, match="default='top_k:3' must be one of"):
        adaptation.AdaptationConfig(default="top_k:3")
    with pytest.raises(ValueError, match="more than fold_size=8"):
        adaptation.few_shot_adaptation(_table(num_queries=8))
    table = _table()
    del table["top_p:0.02"]
    with pytest.raises(ValueError, match="top_p:0.02"):
        adaptation.few_shot_adaptation(table)


def test_markdown_table_marks_the_best_strategy():
    result = adaptation.few_shot_adaptation(_table())
    md = adaptation.markdown_table({"toy": result})
    header = md.splitlines()[0]
    for label in ("k=1", "k=8", "p=0.5%", "p=2%", "default", "adapted (±std)", "oracle"):
        assert label in header
    row = md.splitlines()[2]
    assert f"**{100 * result.per_strategy['top_k:2']:.1f}**" in row
    assert f"{100 * result.adapted_mean:.1f} ± {100 * result.adapted_std:.1f}" in row


def test_evaluate_with_adapt_writes_reports(tmp_path):
    data = write_toy_beir(tmp_path / "data")
    gin.clear_config()
    try:
        cli.parse_gin(
            ["eval/zero_shot.gin", "eval/exhaustive.gin"], ["AdaptationConfig.fold_size = 2"]
        )
        report = beir_eval.evaluate(
            dataset_dir=str(data), output_dir=str(tmp_path / "out"), adapt=True
        )
    finally:
        gin.clear_config()
    saved = json.loads((tmp_path / "out" / "adaptation.json").read_text())
    assert saved["num_folds"] == 2 and saved["fold_size"] == 2
    assert set(saved["per_strategy"]) == set(adaptation.PAPER_STRATEGIES)
    # The default equals the main evaluation's nDCG@10 (same candidates, same strategy).
    assert saved["default"] == pytest.approx(report["metrics"]["ndcg@10"])
    assert report["adaptation"]["oracle"] >= saved["default"]
    assert report["timing"]["includes_adaptation_scoring"] is True  # its latencies say so
    assert "| toy |" in (tmp_path / "out" / "adaptation.md").read_text()
    # the summary names the metric and the default strategy ("adaptation default 23.7" was
    # top_k:1's MRR@10 beside the run's nDCG@10, neither named)
    a = report["adaptation"]
    assert (a["metric"], a["default_strategy"]) == ("ndcg@10", "top_k:1")
    assert f"adaptation ndcg@10: default (top_k:1) {100 * a['default']:.1f}  adapted" in (
        beir_eval.summary(report)
    )


def test_a_fold_larger_than_the_judged_queries_is_refused_before_the_search(tmp_path):
    """Once refused only after the corpus was encoded and searched."""
    data = write_toy_beir(tmp_path / "data")
    gin.clear_config()
    try:
        cli.parse_gin(["eval/zero_shot.gin"], ["AdaptationConfig.fold_size = 50"])
        with pytest.raises(ConfigError, match=r"more than fold_size=50 judged queries .* got \d+ "):
            beir_eval.evaluate(dataset_dir=str(data), output_dir=str(tmp_path / "o"), adapt=True)
    finally:
        gin.clear_config()
    assert not (tmp_path / "o").exists()  # nothing encoded, nothing written
