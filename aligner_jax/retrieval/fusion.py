"""Fusion of two rankings of the same candidates (hybrid retrieval: ALIGNER + a lexical system).

Both systems score one query's candidate union, ``a`` (ALIGNER) and ``b`` (BM25 / miniCOIL),
arrays over the same documents with NaN where a system gave no score (a document it did not
return). ``w`` is ALIGNER's weight, ``1 − w`` the lexical system's; ``w = 1`` is ALIGNER's
ranking, ``w = 0`` the lexical ranking.

* **Reciprocal-rank fusion** (Cormack, Clarke & Büttcher, SIGIR 2009), weighted:
  ``f(d) = w / (k + r_a(d)) + (1 − w) / (k + r_b(d))``, ``r(d)`` the 1-based rank of d among the
  documents the system scored (best first; equal scores keep candidate order), a document it did
  not score contributes 0; ``k = 60`` (the paper's constant).
* **Normalised-score fusion** (convex combination, Fox & Shaw's CombSUM with weights), min–max
  normalisation per system and query: ``f(d) = w · n_a(d) + (1 − w) · n_b(d)`` with
  ``n(d) = (s(d) − min s) / (max s − min s)`` over the documents the system scored (1 when they
  all score alike) and ``n(d) = 0`` (the system's minimum) for a document it did not score.

Pure NumPy, no I/O; ranks and normalisation are per query.
"""

from __future__ import annotations

import numpy as np

from aligner_jax.data import runs

FUSIONS = ("rrf", "score")
RRF_K = 60


def ranks(scores: np.ndarray) -> np.ndarray:
    """1-based rank of each scored entry (best first; ties keep index order); NaN → NaN."""
    scores = np.asarray(scores, np.float64)
    scored = np.flatnonzero(~np.isnan(scores))
    order = scored[np.argsort(-scores[scored], kind="stable")]
    out = np.full(scores.shape, np.nan)
    out[order] = np.arange(1, len(order) + 1)
    return out


def reciprocal_ranks(scores: np.ndarray, k: float = RRF_K) -> np.ndarray:
    """``1 / (k + rank)`` per entry, 0 where the system gave no score (RRF's term)."""
    r = ranks(scores)
    return np.where(np.isnan(r), 0.0, 1.0 / (k + np.nan_to_num(r, nan=0.0)))


def minmax(scores: np.ndarray) -> np.ndarray:
    """Min–max normalisation to [0, 1] over the scored entries (all equal → 1); NaN → 0."""
    scores = np.asarray(scores, np.float64)
    scored = ~np.isnan(scores)
    if not scored.any():
        return np.zeros(scores.shape)
    lo, hi = scores[scored].min(), scores[scored].max()
    norm = (scores - lo) / (hi - lo) if hi > lo else np.ones(scores.shape)
    return np.where(scored, norm, 0.0)


def fuse(
    a: np.ndarray, b: np.ndarray, weight: float, method: str = "rrf", rrf_k: float = RRF_K
) -> np.ndarray:
    """Fused scores of one query's candidates: ``weight`` on ``a``, ``1 − weight`` on ``b``."""
    if method == "rrf":
        fa, fb = reciprocal_ranks(a, rrf_k), reciprocal_ranks(b, rrf_k)
    elif method == "score":
        fa, fb = minmax(a), minmax(b)
    else:
        raise ValueError(f"fusion method {method!r}: choose one of {FUSIONS}")
    return weight * fa + (1.0 - weight) * fb


def top(doc_ids, fused: np.ndarray, k: int) -> dict[str, float]:
    """The ``k`` best documents by fused score, ``{doc_id: score}`` best first, in trec_eval's
    order (ties: the larger doc id first; candidate order kept other tied documents than
    trec_eval scores when the cut fell among ties)."""
    scored = {doc_ids[i]: float(x) for i, x in enumerate(np.asarray(fused))}
    return dict(runs.ranked(scored)[:k])
