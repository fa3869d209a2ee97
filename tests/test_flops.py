"""XTR Appendix B FLOP formulas and their application to a run's candidate sets."""

from __future__ import annotations

import pytest

from aligner_jax.core import flops


def test_formulas_match_xtr_appendix_b():
    # XTR's MS MARCO setting: n=16, k'=1000, m̄=55, d=128 (Table 1 / App. B).
    assert flops.colbert_formula(16, 1000, 55, 128) == 16 * 16 * 1000 * (2 * 55 * 128 + 55 + 1)
    assert flops.xtr_formula(16, 1000, 2.5) == 16 * 16 * 1000 * 3.5


def test_run_flops_exact_counts():
    costs = [
        flops.QueryCost(
            query_tokens=4,
            searched_tokens=2,
            candidates=3,
            candidate_doc_tokens=30,
            retrieved_hits=6,
        ),
        flops.QueryCost(
            query_tokens=6,
            searched_tokens=4,
            candidates=1,
            candidate_doc_tokens=8,
            retrieved_hits=4,
        ),
    ]
    out = flops.run_flops(costs, dim=8, k_prime=5)
    # full: n (2 d Σm + Σm + C); xtr: hits + n_searched · C
    q1_full, q2_full = 4 * (2 * 8 * 30 + 30 + 3), 6 * (2 * 8 * 8 + 8 + 1)
    assert out["actual_full_refinement_per_query"] == pytest.approx((q1_full + q2_full) / 2)
    assert out["actual_xtr_per_query"] == pytest.approx(((6 + 2 * 3) + (4 + 4 * 1)) / 2)
    assert out["m_bar"] == pytest.approx(38 / 4)
    assert out["r_bar"] == pytest.approx(10 / (3 * 2 + 1 * 4))
    assert out["formula_full_refinement"] == pytest.approx(flops.colbert_formula(3.0, 5, 38 / 4, 8))
    assert flops.run_flops([], 8, 5) == {}
    # no k′ search ran (centroid index, --rerank_run, exhaustive): its formulas do not apply;
    # a reranked run reported k′ 4000 and a formula 4,000x its real cost
    unsearched = flops.run_flops(costs, dim=8, k_prime=None)
    assert unsearched["formula_full_refinement"] is None and unsearched["formula_xtr"] is None
    assert unsearched["actual_full_refinement_per_query"] == out["actual_full_refinement_per_query"]
