"""Fusion math (retrieval/fusion.py), the hybrid's fused rankings and the few-shot fusion weight."""

from __future__ import annotations

import numpy as np
import pytest

from aligner_jax.common.errors import ConfigError
from aligner_jax.evaluation import adaptation, fusion_weights, metrics
from aligner_jax.retrieval import fusion, hybrid

NAN = np.nan


def test_rrf_values_and_unscored_documents():
    a = np.array([3.0, 1.0, 2.0, 0.5])
    b = np.array([NAN, 5.0, 1.0, NAN])
    np.testing.assert_array_equal(fusion.ranks(a), [1, 3, 2, 4])
    np.testing.assert_array_equal(fusion.ranks(b), [NAN, 1, 2, NAN])
    np.testing.assert_allclose(fusion.reciprocal_ranks(b), [0, 1 / 61, 1 / 62, 0])
    fused = fusion.fuse(a, b, 0.25, "rrf")
    expected = [0.25 / 61, 0.25 / 63 + 0.75 / 61, 0.25 / 62 + 0.75 / 62, 0.25 / 64]
    np.testing.assert_allclose(fused, expected, rtol=1e-15)
    # The constant k: 1/(k + r).
    np.testing.assert_allclose(fusion.reciprocal_ranks(a, k=0), [1, 1 / 3, 1 / 2, 1 / 4])
    # Equal scores keep candidate order.
    np.testing.assert_array_equal(fusion.ranks(np.array([1.0, 2.0, 1.0])), [2, 1, 3])


def test_minmax_normalisation():
    np.testing.assert_allclose(fusion.minmax(np.array([2.0, 4.0, 3.0, NAN])), [0, 1, 0.5, 0])
    np.testing.assert_allclose(fusion.minmax(np.array([7.0, 7.0, NAN])), [1, 1, 0])
    np.testing.assert_allclose(fusion.minmax(np.array([NAN, NAN])), [0, 0])
    a, b = np.array([0.9, 0.5, 0.7]), np.array([10.0, 30.0, NAN])
    np.testing.assert_allclose(fusion.fuse(a, b, 0.5, "score"), [0.5, 0.5, 0.25])
    with pytest.raises(ValueError, match="'mean'"):
        fusion.fuse(a, b, 0.5, "mean")


@pytest.mark.parametrize("method", fusion.FUSIONS)
def test_weight_limits_are_each_systems_ranking(method):
    rng = np.random.default_rng(0)
    docs = [f"d{i}" for i in range(30)]
    a = rng.normal(size=30)
    b = np.where(rng.random(30) < 0.5, rng.normal(size=30) + 5, NAN)
    ranking_a = [docs[i] for i in np.argsort(-a, kind="stable")]
    assert list(fusion.top(docs, fusion.fuse(a, b, 1.0, method), 30)) == ranking_a
    # w = 0: the lexical ranking; documents it did not return come after it (score 0).
    scored = np.flatnonzero(~np.isnan(b))
    ranking_b = [docs[i] for i in scored[np.argsort(-b[scored], kind="stable")]]
    fused = fusion.fuse(a, b, 0.0, method)
    top = list(fusion.top(docs, fused, 30))
    if method == "rrf":
        assert top[: len(ranking_b)] == ranking_b
    else:  # min-max maps the lexical minimum to 0, where the unscored documents are
        assert top[: len(ranking_b) - 1] == ranking_b[:-1]
    assert np.all(fused[np.isnan(b)] == 0.0)
    # In between, both systems count: a document first in both is first.
    both = np.array([1.0, 0.0, 0.5]), np.array([3.0, 2.0, 1.0])
    assert np.argmax(fusion.fuse(*both, 0.5, method)) == 0


def test_a_cut_among_tied_fused_scores_keeps_what_trec_eval_ranks_first():
    """Ties went by candidate order: cut at k among them, the kept documents were not the
    ones trec_eval ranks first (larger doc id first), so metrics.py's promise failed."""
    docs = ["a", "c", "b", "z"]
    fused = np.array([1.0, 1.0, 1.0, 2.0])
    assert list(fusion.top(docs, fused, 3)) == ["z", "c", "b"]


def _two_doc_run(num_queries: int) -> tuple[hybrid.HybridRun, dict]:
    """Every query: relevant "a", non-relevant "b"; ALIGNER prefers b, the lexical stage a."""
    qids = [f"q{i}" for i in range(num_queries)]
    run = hybrid.HybridRun(
        candidates={q: ["a", "b"] for q in qids},
        aligner={q: np.array([0.4, 0.9]) for q in qids},
        lexical={q: np.array([7.0, 3.0]) for q in qids},
        aligner_ms=[0.0] * num_queries,
        lexical_ms=[0.0] * num_queries,
        rerank_ms=[0.0] * num_queries,
    )
    return run, {q: {"a": 1} for q in qids}


def test_hybrid_run_fuses_any_weight():
    run, _ = _two_doc_run(2)
    assert list(run.fused(1.0, "score")["q0"]) == ["b", "a"]
    assert list(run.fused(0.0, "score")["q0"]) == ["a", "b"]
    assert list(run.fused(0.2, "rrf")["q1"]) == ["a", "b"]
    assert run.fused(0.2, "rrf", k=1)["q1"] == pytest.approx({"a": 0.2 / 62 + 0.8 / 61})


def test_few_shot_weight_selection_on_synthetic_queries():
    run, qrels = _two_doc_run(24)
    config = hybrid.HybridConfig(weights=(0.0, 0.3, 1.0), weight=0.5)
    chosen = fusion_weights.choose_weights(
        run, qrels, config, adaptation.AdaptationConfig(fold_size=8), k=10
    )
    assert set(chosen) == {"rrf", "score"}
    for method, r in chosen.items():
        names = [f"{method}:w=0", f"{method}:w=0.3", f"{method}:w=1", f"{method}:w=0.5"]
        assert list(r.per_strategy) == names
        # The lexical side is right on every query: every fold picks the first best, w = 0.
        assert r.fold_choices == [f"{method}:w=0"] * 3 and r.num_folds == 3
        assert (r.adapted_mean, r.adapted_std) == (1.0, 0.0)
        assert r.per_strategy[f"{method}:w=1"] == pytest.approx(1 / np.log2(3))
    # At w = 0.5 both documents tie: trec_eval ranks "b" (larger id) first.
    assert chosen["rrf"].default == pytest.approx(1 / np.log2(3))
    table = fusion_weights.markdown_table("toy", chosen)
    assert "| toy | rrf | **100.0** | **100.0** | 63.1 | 63.1 | 63.1 | 100.0 ± 0.0 |" in table


def test_select_on_folds_reuses_the_alignment_protocol():
    rng = np.random.default_rng(1)
    qids = [f"q{i}" for i in range(40)]
    per_query = {
        name: {q: float(v) for q, v in zip(qids, rng.random(40) + bonus, strict=True)}
        for name, bonus in (("w=0", 0.0), ("w=0.5", 0.5), ("w=1", 0.0))
    }
    r = adaptation.select_on_folds(per_query, ["w=0", "w=0.5", "w=1"], "w=0", fold_size=8)
    assert r.fold_choices == ["w=0.5"] * 5 and r.oracle_strategy == "w=0.5"
    assert r.default == pytest.approx(np.mean(list(per_query["w=0"].values())))
    folds = adaptation.make_folds(sorted(qids), 8, 0)
    rest = [np.mean([per_query["w=0.5"][q] for q in qids if q not in f]) for f in folds]
    assert r.adapted_mean == pytest.approx(np.mean(rest))
    with pytest.raises(ValueError, match="default"):
        adaptation.select_on_folds(per_query, ["w=0", "w=1"], "w=0.5")


def test_hybrid_config_is_checked():
    with pytest.raises(
        ConfigError, match=r"--gin.HybridConfig.weight=1.5: must be in \[0.0, 1.0\]"
    ):
        hybrid.HybridConfig(weight=1.5)
    with pytest.raises(ConfigError, match="HybridConfig.fusion='mean'"):
        hybrid.HybridConfig(fusion="mean")
    with pytest.raises(ConfigError, match="HybridConfig.depth=0"):
        hybrid.HybridConfig(depth=0)
    with pytest.raises(ConfigError, match="HybridConfig.weights"):
        hybrid.HybridConfig(weights=())


def test_fused_runs_are_scored_by_pytrec_eval():
    run, qrels = _two_doc_run(3)
    ev = metrics.evaluate_run(qrels, run.fused(0.0, "rrf"), k_values=(10,))
    assert ev.aggregate["ndcg@10"] == 1.0
