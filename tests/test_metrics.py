"""Tests for aligner_jax.evaluation.metrics against nDCG / Recall / MRR computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aligner_jax.evaluation import metrics

L2 = math.log2

QRELS = {
    "q1": {"d1": 1, "d2": 1, "d3": 0},
    "q2": {"d4": 2, "d5": 1},
    "q3": {"d6": 1},
}
RESULTS = {
    # ranking d3 (rel 0), d1 (1), dx (unjudged), d2 (1).
    "q1": {"d3": 0.9, "d1": 0.8, "dx": 0.7, "d2": 0.6},
    # ranking d5 (rel 1), d4 (rel 2).
    "q2": {"d4": 0.4, "d5": 0.5},
    # q3: no results at all. q4: not judged.
    "q4": {"d1": 1.0},
}

# Hand computation. trec_eval nDCG uses linear gains: DCG@k = sum_{r<=k} rel_r / log2(r + 1).
Q1 = {
    "ndcg@1": 0.0,  # top-1 is d3 with relevance 0
    "ndcg@2": (1 / L2(3)) / (1 + 1 / L2(3)),
    "ndcg@10": (1 / L2(3) + 1 / L2(5)) / (1 + 1 / L2(3)),
    "recall@1": 0.0,
    "recall@2": 1 / 2,
    "recall@10": 2 / 2,
    "mrr@1": 0.0,  # the first relevant document (rank 2) is cut off at k=1
    "mrr@2": 1 / 2,
    "mrr@10": 1 / 2,
}
Q2 = {
    "ndcg@1": 1 / 2,  # DCG = 1 (d5), ideal DCG = 2 (d4)
    "ndcg@2": (1 + 2 / L2(3)) / (2 + 1 / L2(3)),
    "ndcg@10": (1 + 2 / L2(3)) / (2 + 1 / L2(3)),
    "recall@1": 1 / 2,
    "recall@2": 1.0,
    "recall@10": 1.0,
    "mrr@1": 1.0,
    "mrr@2": 1.0,
    "mrr@10": 1.0,
}
Q3 = dict.fromkeys(Q1, 0.0)


def test_per_query_and_aggregate_match_hand_computation():
    ev = metrics.evaluate_run(QRELS, RESULTS, k_values=(1, 2, 10))
    assert set(ev.per_query) == {"q1", "q2", "q3"}
    for qid, expected in [("q1", Q1), ("q2", Q2), ("q3", Q3)]:
        assert ev.per_query[qid] == pytest.approx(expected, abs=1e-6), qid
    # Mean over all judged queries; q3 (no results) counts as 0.
    for name in Q1:
        assert ev[name] == pytest.approx((Q1[name] + Q2[name] + Q3[name]) / 3, abs=1e-6), name
    assert list(ev.aggregate) == [f"{m}@{k}" for m in ("ndcg", "recall", "mrr") for k in (1, 2, 10)]
    assert ev.num_queries == 3
    assert ev.num_queries_without_results == 1
    assert ev.num_unjudged_queries == 1


def test_run_is_evaluated_as_given_identical_ids_included():
    """Nothing is dropped inside evaluate_run: trec_eval on the run file must agree with it."""
    with_self = {"q1": {**RESULTS["q1"], "q1": 5.0}}
    kept = metrics.evaluate_run({"q1": QRELS["q1"]}, with_self, (10,))
    # "q1" (non-relevant) takes rank 1: relevant docs at ranks 3 and 5.
    assert kept["mrr@10"] == pytest.approx(1 / 3)
    assert kept["ndcg@10"] == pytest.approx((1 / L2(4) + 1 / L2(6)) / (1 + 1 / L2(3)))
    with pytest.raises(TypeError):
        metrics.evaluate_run({"q1": QRELS["q1"]}, with_self, (10,), ignore_identical_ids=True)


def test_ties_follow_trec_eval_and_truncation_agrees():
    # Equal scores: trec_eval ranks the larger doc id first ("b" before "a").
    results = {"q": {"a": 1.0, "b": 1.0, "c": 0.5}}
    assert metrics.top_k_results(results, 1) == {"q": {"b": 1.0}}
    assert list(metrics.top_k_results(results, 3)["q"]) == ["b", "a", "c"]
    ev = metrics.evaluate_run({"q": {"a": 1}}, results, k_values=(1, 2))
    assert ev["mrr@1"] == 0.0 and ev["ndcg@1"] == 0.0
    assert ev["mrr@2"] == pytest.approx(0.5)
    assert ev["ndcg@2"] == pytest.approx(1 / L2(3))


def test_top_k_results_does_not_mutate_and_handles_empty():
    results = {"q": {"a": 3, "b": 2, "c": 1}, "e": {}}
    out = metrics.top_k_results(results, 2)
    assert out == {"q": {"a": 3.0, "b": 2.0}, "e": {}}
    assert len(results["q"]) == 3
    with pytest.raises(ValueError, match="k=0"):
        metrics.top_k_results(results, 0)


def test_relevance_level_for_binary_metrics():
    qrels = {"q": {"a": 1, "b": 2}}
    results = {"q": {"a": 2.0, "b": 1.0}}
    ev = metrics.evaluate_run(qrels, results, k_values=(1,), relevance_level=2)
    assert ev["mrr@1"] == 0.0 and ev["recall@1"] == 0.0  # only "b" counts as relevant
    assert metrics.evaluate_run(qrels, results, k_values=(1,))["mrr@1"] == 1.0


def test_metric_subset_and_formatting():
    ev = metrics.evaluate_run(QRELS, RESULTS, k_values=(10,), metrics=("ndcg",))
    assert list(ev.aggregate) == ["ndcg@10"]
    assert metrics.format_metrics({"ndcg@10": 0.6861, "recall@100": 0.913}) == (
        "ndcg@10 68.6 | recall@100 91.3"
    )
    assert ev.as_dict()["num_queries"] == 3


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"qrels": {}}, "qrels is empty"),
        ({"qrels": {"q": {}}}, "qrels is empty"),
        ({"k_values": (0,)}, "k_values entry=0"),
        ({"k_values": ()}, "k_values is empty"),
        ({"metrics": ("map",)}, "expected a non-empty subset"),
        ({"results": {"q1": {"d1": float("nan")}}}, "is NaN"),
    ],
)
def test_bad_arguments(kwargs, fragment):
    args = {"qrels": QRELS, "results": RESULTS, **kwargs}
    with pytest.raises(ValueError, match=fragment):
        metrics.evaluate_run(**args)


@settings(max_examples=30, deadline=None)
@given(
    relevant=st.sets(st.integers(0, 19), min_size=1, max_size=5),
    scores=st.lists(st.floats(-10, 10), min_size=20, max_size=20),
)
def test_bounds_and_perfect_ranking(relevant, scores):
    qrels = {"q": {f"d{i:02d}": 1 for i in relevant}}
    run = {"q": {f"d{i:02d}": s for i, s in enumerate(scores)}}
    ev = metrics.evaluate_run(qrels, run, k_values=(1, 5, 20))
    assert all(0.0 <= v <= 1.0 for v in ev.aggregate.values())
    assert ev["recall@20"] == 1.0  # every document is retrieved
    # Relevant documents scored above all others: a perfect ranking.
    perfect = {"q": {f"d{i:02d}": (100.0 if i in relevant else s) for i, s in enumerate(scores)}}
    ev = metrics.evaluate_run(qrels, perfect, k_values=(1, 5, 20))
    assert ev["ndcg@1"] == ev["ndcg@5"] == ev["ndcg@20"] == ev["mrr@1"] == pytest.approx(1.0)
    assert ev["recall@5"] == pytest.approx(1.0)


def test_paired_bootstrap_intervals():
    rng = np.random.default_rng(3)
    x = rng.uniform(0, 1, 300)
    assert metrics.paired_bootstrap(x, x, 1000, seed=0) == [0.0, 0.0]  # identical runs
    lo, hi = metrics.paired_bootstrap(x + 0.02, x, 1000, seed=0)  # a constant shift
    assert lo == pytest.approx(0.02) and hi == pytest.approx(0.02)
    noisy = x + 0.02 + rng.normal(0, 0.05, 300)
    lo, hi = metrics.paired_bootstrap(noisy, x, 1000, seed=0)
    assert lo < 0.02 < hi and hi - lo < 0.03  # around the shift, about ±2 standard errors
    assert [lo, hi] == metrics.paired_bootstrap(noisy, x, 1000, seed=0)  # seeded
    # paired: a query-level offset shared by both runs does not widen the interval
    assert metrics.paired_bootstrap(x + 5 * x, x + 5 * x, 200, seed=1) == [0.0, 0.0]
    assert metrics.paired_bootstrap([], [], 10) is None
