"""Scoring-stage FLOPs of full refinement vs XTR's f_XTR′ (XTR Appendix B), applied to a run.

XTR Appendix B counts, for n query tokens, k′ retrieved tokens per query token and the worst case
of C = n·k′ candidate documents (every retrieved token from a different document):

  * ColBERT-style refinement (gather all m tokens of every candidate, Eq. 1): per candidate
    2·n·m̄·d (token inner products) + n·m̄ (row maxima) + n (average), in all
    ``n² k′ (2 m̄ d + m̄ + 1)``;
  * XTR (f_XTR′, no gather): per candidate n·r̄ (row maxima over the r̄ retrieved tokens of the
    candidate) + n (average), in all ``n² k′ (r̄ + 1)``.

``run_flops`` evaluates both formulas with the averages of an actual run (n, m̄, d, k′, r̄) and
also the exact counts over the run's real candidate sets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class QueryCost:
    """What one query's scoring touched."""

    query_tokens: int  # n: tokens scored in refinement (all real query tokens)
    searched_tokens: int  # tokens that searched the token index (after β^q pruning)
    candidates: int  # C
    candidate_doc_tokens: int  # Σ_c m_c
    retrieved_hits: int  # Σ_c r_c: retrieved (query token, doc token) pairs of the candidates


def colbert_formula(n: float, k_prime: float, m_bar: float, d: float) -> float:
    """n² k′ (2 m̄ d + m̄ + 1): full refinement, worst case C = n k′ (XTR App. B)."""
    return n * n * k_prime * (2 * m_bar * d + m_bar + 1)


def xtr_formula(n: float, k_prime: float, r_bar: float) -> float:
    """n² k′ (r̄ + 1): f_XTR′ scoring, worst case C = n k′ (XTR App. B)."""
    return n * n * k_prime * (r_bar + 1)


def run_flops(costs: Sequence[QueryCost], dim: int, k_prime: int | None) -> dict:
    """Both formulas with the run's averages, and exact per-query counts over real candidates.
    ``k_prime``: the token search's k′; None when no k′ search ran (a centroid index, a
    reranked run, exhaustive search): the formulas, which count candidates by k′, are then
    None."""
    if not costs:
        return {}
    n = float(np.mean([c.searched_tokens for c in costs]))
    cands = np.array([c.candidates for c in costs], dtype=np.float64)
    doc_tokens = np.array([c.candidate_doc_tokens for c in costs], dtype=np.float64)
    hits = np.array([c.retrieved_hits for c in costs], dtype=np.float64)
    q_tokens = np.array([c.query_tokens for c in costs], dtype=np.float64)
    searched = np.array([c.searched_tokens for c in costs], dtype=np.float64)
    m_bar = float(doc_tokens.sum() / max(cands.sum(), 1))
    # r̄: retrieved tokens per (candidate, searching query token) row.
    r_bar = float(hits.sum() / max((cands * searched).sum(), 1))
    # Full refinement: Σ_c n (2 m_c d + m_c + 1). XTR: a max over each row's retrieved tokens
    # (Σ_c Σ_i r_ci = hits) plus the n-term average per candidate.
    full_actual = q_tokens * (2 * doc_tokens * dim + doc_tokens + cands)
    xtr_actual = hits + searched * cands
    return {
        "n_avg": n,
        "m_bar": m_bar,
        "r_bar": r_bar,
        "dim": dim,
        "k_prime": k_prime,
        "formula_full_refinement": None
        if k_prime is None
        else colbert_formula(n, k_prime, m_bar, dim),
        "formula_xtr": None if k_prime is None else xtr_formula(n, k_prime, r_bar),
        "actual_full_refinement_per_query": float(full_actual.mean()),
        "actual_xtr_per_query": float(xtr_actual.mean()),
        "candidates_per_query_mean": float(cands.mean()),
    }
