"""XTR scoring (XTR §3): in-batch token retrieval for training (Eq. 2) and f_XTR′ for inference (Eq. 4).

Training (``xtr_train_scores``, Eq. 2): every query token retrieves its top-k_train document tokens
among ALL real tokens of ALL documents of the batch (positives and negatives), giving Â; then

    f_XTR(Q, D) = (1/Z) Σ_i max_{j: Â_ij = 1} q_iᵀd_j,    Z = |{i : ∃ j, Â_ij = 1}|

i.e. a query token contributes the largest similarity among the tokens of D it retrieved (as in the
appendix derivation: the row max that is also in the in-batch top-k; 0 when none), and Z counts the
query tokens that retrieved at least one token of D. When nothing of D was retrieved Z is clipped
(to 1) and the score is 0.

Inference (``xtr_inference_scores``, Eq. 4): no document vectors are read. For each query token i
the token index returned k′ (score, document) pairs; m_i is the k′-th (lowest) retrieved score of
token i. A candidate's score is

    f_XTR′(Q, D) = (1/n) Σ_i [ max retrieved score of D for token i,  or m_i if token i retrieved
                               no token of D ]

with n the number of real (searched) query tokens. It is computed as a scatter-max of the n·k′
retrieved pairs into an ``[n, C]`` table over the candidates (one pass, no loop over tokens) and an
imputation with m_i, so the cost is O(n·k′ + n·C) per query.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from aligner_jax.common.errors import ConfigError


def xtr_train_scores(
    q: jax.Array, q_mask: jax.Array, d: jax.Array, d_mask: jax.Array, k_train: int
) -> jax.Array:
    """f_XTR (XTR Eq. 2) of every query against every in-batch document.

    Args:
      q: ``[B, n, h]`` query token vectors; ``q_mask [B, n]`` (True = real).
      d: ``[C, m, h]`` all documents of the batch (positives and negatives); ``d_mask [C, m]``.
      k_train: tokens retrieved per query token among the C·m in-batch document tokens (static). If
        larger than the number of real tokens, every real token is retrieved.

    Returns:
      ``[B, C]`` scores, differentiable w.r.t. q and d (through the retrieved similarities).
    """
    if q.ndim != 3 or d.ndim != 3:
        raise ValueError(
            f"xtr_train_scores expects q [B, n, h] and d [C, m, h]; got {q.shape}, {d.shape}."
        )
    if not isinstance(k_train, int) or k_train < 1:
        raise ConfigError(f"k_train={k_train!r} must be a Python int >= 1 (XTR §3.1 top-k_train).")
    num_docs, doc_len = d.shape[:2]
    q_mask = jnp.asarray(q_mask, bool)
    d_mask = jnp.asarray(d_mask, bool)
    s = jnp.einsum("bnh,cmh->bncm", q, d)
    s = nn.with_logical_constraint(s, ("batch", "length", None, None))
    real = q_mask[:, :, None, None] & d_mask[None, None, :, :]
    s = jnp.where(real, s, 0.0)
    flat = jnp.where(real, s, -jnp.inf).reshape(s.shape[:2] + (num_docs * doc_len,))
    k = min(k_train, num_docs * doc_len)
    values, index = jax.lax.top_k(flat, k)  # in-batch token retrieval per query token
    hit = jnp.isfinite(values)  # a real token was retrieved (fewer than k real tokens → padding)
    retrieved = jnp.put_along_axis(
        jnp.zeros(flat.shape, bool), index, hit, axis=-1, inplace=False
    ).reshape(s.shape)
    any_retrieved = jnp.any(retrieved, axis=-1)  # [B, n, C]
    row_max = jnp.max(jnp.where(retrieved, s, -jnp.inf), axis=-1)
    contribution = jnp.where(any_retrieved, row_max, 0.0)
    z = jnp.sum(any_retrieved, axis=1)  # [B, C]
    return jnp.sum(contribution, axis=1) / jnp.maximum(z, 1).astype(contribution.dtype)


def xtr_missing_similarity(
    token_scores: jax.Array, token_valid: jax.Array | None = None
) -> jax.Array:
    """m_i of Eq. 4: the lowest (k′-th) valid retrieved score of each query token; 0 if none.

    ``token_scores [..., n, k′]`` → ``[..., n]``.
    """
    token_scores = jnp.asarray(token_scores)
    valid = jnp.ones(token_scores.shape, bool) if token_valid is None else token_valid
    lowest = jnp.min(jnp.where(valid, token_scores, jnp.inf), axis=-1)
    return jnp.where(jnp.isfinite(lowest), lowest, 0.0)


def xtr_inference_scores(
    token_scores: jax.Array,
    token_doc_ids: jax.Array,
    q_mask: jax.Array,
    candidate_ids: jax.Array,
    token_valid: jax.Array | None = None,
) -> jax.Array:
    """f_XTR′ (XTR Eq. 4) of candidate documents from the retrieved token scores only.

    Args:
      token_scores: ``[..., n, k′]`` similarity of each retrieved token (any order).
      token_doc_ids: ``[..., n, k′]`` int document id of each retrieved token.
      q_mask: ``[..., n]`` True for query tokens that searched (padding and pruned tokens False);
        n in Eq. 4 is their number.
      candidate_ids: ``[..., C]`` int document ids to score, unique per query; entries < 0 are
        padding and score −inf. ``xtr_candidates`` builds them from the retrieved ids.
      token_valid: ``[..., n, k′]`` bool, False for empty result slots (default: doc id ≥ 0).

    Returns:
      ``[..., C]`` scores: (1/n) Σ_i (max retrieved score of the candidate for token i, else m_i),
      with m_i the lowest valid retrieved score of token i.
    """
    token_scores = jnp.asarray(token_scores)
    token_doc_ids = jnp.asarray(token_doc_ids)
    candidate_ids = jnp.asarray(candidate_ids)
    if token_scores.shape != token_doc_ids.shape:
        raise ValueError(
            f"token_scores {token_scores.shape} and token_doc_ids {token_doc_ids.shape} must match."
        )
    q_mask = jnp.broadcast_to(jnp.asarray(q_mask, bool), token_scores.shape[:-1])
    valid = token_doc_ids >= 0 if token_valid is None else jnp.asarray(token_valid, bool)
    valid = valid & q_mask[..., None]
    batch_shape = token_scores.shape[:-2]
    candidate_ids = jnp.broadcast_to(candidate_ids, batch_shape + candidate_ids.shape[-1:])

    def one_query(scores, doc_ids, valid, q_mask, candidates):
        n, k_prime = scores.shape
        num_candidates = candidates.shape[0]
        order = jnp.argsort(candidates)
        sorted_candidates = candidates[order]
        position = jnp.clip(jnp.searchsorted(sorted_candidates, doc_ids), 0, num_candidates - 1)
        is_candidate = valid & (sorted_candidates[position] == doc_ids)
        rows = jnp.broadcast_to(jnp.arange(n)[:, None], (n, k_prime))
        # Segment max of the retrieved scores into (query token, candidate) cells.
        table = jnp.full((n, num_candidates), -jnp.inf, scores.dtype)
        table = table.at[rows, position].max(jnp.where(is_candidate, scores, -jnp.inf))
        missing = xtr_missing_similarity(scores, valid)
        filled = jnp.where(jnp.isfinite(table), table, missing[:, None])
        filled = jnp.where(q_mask[:, None], filled, 0.0)
        num_tokens = jnp.maximum(jnp.sum(q_mask), 1).astype(scores.dtype)
        sorted_scores = jnp.sum(filled, axis=0) / num_tokens
        scores_out = jnp.zeros_like(sorted_scores).at[order].set(sorted_scores)
        return jnp.where(candidates >= 0, scores_out, -jnp.inf)

    fn = one_query
    for _ in batch_shape:
        fn = jax.vmap(fn)
    return fn(token_scores, token_doc_ids, valid, q_mask, candidate_ids)


def xtr_candidates(
    token_doc_ids: jax.Array, token_valid: jax.Array | None = None, size: int | None = None
) -> jax.Array:
    """Candidate documents of Eq. 3: the unique doc ids retrieved by any query token.

    ``token_doc_ids [..., n, k′]`` → ``[..., size]`` sorted unique ids padded with −1 (``size``
    defaults to n·k′, the most there can be; static). With a smaller ``size`` and more distinct
    documents, only the ``size`` smallest ids are kept.
    """
    token_doc_ids = jnp.asarray(token_doc_ids)
    valid = token_doc_ids >= 0 if token_valid is None else jnp.asarray(token_valid, bool)
    n, k_prime = token_doc_ids.shape[-2:]
    size = n * k_prime if size is None else size
    flat = jnp.where(valid, token_doc_ids, -1).reshape(token_doc_ids.shape[:-2] + (n * k_prime,))

    def one_query(ids):
        # −1 sorts first; drop it by asking for one more and shifting when present.
        unique = jnp.unique(ids, size=size + 1, fill_value=-1)
        has_pad = unique[0] < 0
        shifted = jnp.where(has_pad, jnp.roll(unique, -1), unique)
        shifted = shifted.at[-1].set(jnp.where(has_pad, -1, shifted[-1]))
        return shifted[:size]

    fn = one_query
    for _ in token_doc_ids.shape[:-2]:
        fn = jax.vmap(fn)
    return fn(flat)


def xtr_inference_scores_numpy(
    token_scores: np.ndarray,
    token_doc_ids: np.ndarray,
    q_mask: np.ndarray | None = None,
    token_valid: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Host (NumPy) f_XTR′ for one query, sparse in the candidates: returns (doc_ids, scores).

    ``token_scores`` / ``token_doc_ids``: ``[n, k′]``. Every doc retrieved by some token is a
    candidate (Eq. 3). Uses ``score = mean_i m_i + (1/n) Σ_{i retrieved D} (max_i(D) − m_i)``, so only
    the retrieved (token, doc) pairs are touched: O(n·k′·log(n·k′)), no ``[n, C]`` table.
    """
    token_scores = np.asarray(token_scores)
    token_doc_ids = np.asarray(token_doc_ids)
    n = token_scores.shape[0]
    q_mask = np.ones(n, bool) if q_mask is None else np.asarray(q_mask, bool)
    valid = token_doc_ids >= 0 if token_valid is None else np.asarray(token_valid, bool)
    valid = valid & q_mask[:, None]
    lowest = np.where(valid, token_scores, np.inf).min(axis=1)
    missing = np.where(np.isfinite(lowest), lowest, 0.0)
    missing = np.where(q_mask, missing, 0.0)
    num_tokens = max(int(q_mask.sum()), 1)
    rows = np.broadcast_to(np.arange(n)[:, None], token_scores.shape)[valid]
    docs = token_doc_ids[valid]
    scores = token_scores[valid]
    if docs.size == 0:
        return np.zeros(0, token_doc_ids.dtype), np.zeros(0, token_scores.dtype)
    # Max per (doc, token): sort by (doc, token, score) and keep each group's last entry.
    order = np.lexsort((scores, rows, docs))
    docs, rows, scores = docs[order], rows[order], scores[order]
    last = np.ones(docs.size, bool)
    last[:-1] = (docs[1:] != docs[:-1]) | (rows[1:] != rows[:-1])
    docs, rows, scores = docs[last], rows[last], scores[last]
    unique_docs, inverse = np.unique(docs, return_inverse=True)
    gain = np.bincount(inverse, weights=scores - missing[rows], minlength=unique_docs.size)
    total = (missing.sum() + gain) / num_tokens
    return unique_docs, total.astype(token_scores.dtype)
