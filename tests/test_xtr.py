"""Tests for aligner_jax.core.xtr: f_XTR (XTR Eq. 2, in-batch token retrieval) and f_XTR′ (Eq. 4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aligner_jax.core import scoring, xtr

PROPERTY = settings(max_examples=15, deadline=None)
_train_scores = jax.jit(xtr.xtr_train_scores, static_argnums=(4,))
_inference_scores = jax.jit(xtr.xtr_inference_scores)


def _one_hot_tokens(rows):
    return jnp.asarray(np.array(rows, np.float32))


def test_f_xtr_hand_example_z_counts_tokens_that_retrieved_the_doc():
    # h = 3 one-hot-ish vectors make every similarity readable.
    q = _one_hot_tokens([[[1, 0, 0], [0, 1, 0], [0, 0, 1]]])  # B = 1, n = 3
    d = _one_hot_tokens(
        [
            [[0.9, 0, 0], [0, 0.2, 0]],  # doc 0: q0·d = 0.9, q1·d = 0.2
            [[0.5, 0, 0], [0, 0.8, 0]],  # doc 1: q0·d = 0.5, q1·d = 0.8
            [[0, 0, 0.1], [0, 0, 0]],  # doc 2: q2·d = 0.1 (and a zero vector)
        ]
    )
    d_mask = jnp.ones((3, 2), bool)
    q_mask = jnp.ones((1, 3), bool)
    # k_train = 1: q0 retrieves doc0 (0.9), q1 retrieves doc1 (0.8), q2 retrieves doc2 (0.1)
    got = np.asarray(xtr.xtr_train_scores(q, q_mask, d, d_mask, 1))[0]
    np.testing.assert_allclose(got, [0.9 / 1, 0.8 / 1, 0.1 / 1], rtol=1e-6)
    # k_train = 2: q0 → {doc0 0.9, doc1 0.5}; q1 → {doc1 0.8, doc0 0.2}; q2 → {doc2 0.1, a 0.0 tie
    # broken by position: doc0's second token}; Z(doc0) = 3, Z(doc1) = 2, Z(doc2) = 1
    got = np.asarray(xtr.xtr_train_scores(q, q_mask, d, d_mask, 2))[0]
    np.testing.assert_allclose(got, [(0.9 + 0.2 + 0.0) / 3, (0.5 + 0.8) / 2, 0.1 / 1], rtol=1e-6)


def test_f_xtr_is_zero_when_nothing_of_the_doc_is_retrieved():
    q = _one_hot_tokens([[[1, 0], [0, 1]]])
    d = _one_hot_tokens([[[1, 0], [0, 1]], [[0.1, 0], [0, 0.1]]])
    scores = np.asarray(
        xtr.xtr_train_scores(q, jnp.ones((1, 2), bool), d, jnp.ones((2, 2), bool), 1)
    )
    np.testing.assert_allclose(scores, [[1.0, 0.0]])


def _batch(seed, q_lengths, d_lengths, n=4, m=5, h=3, garbage=None):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(len(q_lengths), n, h)).astype(np.float32)
    d = rng.normal(size=(len(d_lengths), m, h)).astype(np.float32)
    q_mask = np.arange(n)[None] < np.asarray(q_lengths)[:, None]
    d_mask = np.arange(m)[None] < np.asarray(d_lengths)[:, None]
    if garbage is not None:
        q = np.where(q_mask[..., None], q, garbage).astype(np.float32)
        d = np.where(d_mask[..., None], d, garbage).astype(np.float32)
    return q, q_mask, d, d_mask


@given(
    seed=st.integers(0, 2**31 - 1),
    q_lengths=st.lists(st.integers(1, 4), min_size=2, max_size=2),
    d_lengths=st.lists(st.integers(1, 5), min_size=3, max_size=3),
)
@PROPERTY
def test_f_xtr_with_everything_retrieved_is_colbert(seed, q_lengths, d_lengths):
    q, q_mask, d, d_mask = _batch(seed, q_lengths, d_lengths)
    got = _train_scores(q, q_mask, d, d_mask, 1000)  # k_train ≥ C·m: every token retrieved
    s = scoring.cross_similarity(q, d)
    colbert = scoring.alignment_scores(s, q_mask[:, None], d_mask[None], "colbert")
    np.testing.assert_allclose(got, colbert, rtol=1e-5, atol=1e-6)


@given(
    seed=st.integers(0, 2**31 - 1),
    q_lengths=st.lists(st.integers(0, 4), min_size=2, max_size=2),
    d_lengths=st.lists(st.integers(0, 5), min_size=3, max_size=3),
    k_train=st.sampled_from([1, 3, 7]),
    garbage=st.sampled_from([1e30, -1e30, 50.0]),
)
@PROPERTY
def test_f_xtr_padding_never_changes_scores(seed, q_lengths, d_lengths, k_train, garbage):
    q, q_mask, d, d_mask = _batch(seed, q_lengths, d_lengths, garbage=garbage)
    base = _train_scores(q, q_mask, d, d_mask, k_train)
    pad_q = ((0, 0), (0, 2), (0, 0))
    pad_d = ((0, 0), (0, 3), (0, 0))
    q2 = np.pad(q, pad_q, constant_values=garbage)
    d2 = np.pad(d, pad_d, constant_values=garbage)
    q_mask2 = np.pad(q_mask, pad_q[:2])
    d_mask2 = np.pad(d_mask, pad_d[:2])
    padded = _train_scores(q2, q_mask2, d2, d_mask2, k_train)
    assert np.all(np.isfinite(np.asarray(padded)))
    np.testing.assert_allclose(padded, base, rtol=1e-5, atol=1e-6)


def test_f_xtr_is_differentiable():
    q, q_mask, d, d_mask = _batch(0, [4, 2], [5, 3, 1], garbage=1e3)

    def loss(q, d):
        scores = xtr.xtr_train_scores(q, q_mask, d, d_mask, 3)
        return -jnp.sum(jax.nn.log_softmax(scores, axis=-1)[:, 0])

    grad_q, grad_d = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, d)
    for grad in (grad_q, grad_d):
        assert np.all(np.isfinite(np.asarray(grad)))
    assert np.abs(np.asarray(grad_q)).sum() > 0 and np.abs(np.asarray(grad_d)).sum() > 0
    assert np.all(np.asarray(grad_q)[~q_mask] == 0) and np.all(np.asarray(grad_d)[~d_mask] == 0)


def test_f_xtr_rejects_bad_arguments():
    q, q_mask, d, d_mask = _batch(0, [4], [5])
    with pytest.raises(ValueError, match="k_train=0 must be a Python int >= 1"):
        xtr.xtr_train_scores(q, q_mask, d, d_mask, 0)
    with pytest.raises(ValueError, match=r"expects q \[B, n, h\] and d \[C, m, h\]"):
        xtr.xtr_train_scores(q[0], q_mask, d, d_mask, 1)


# ------------------------------------------------------------------------------------------------
# f_XTR′ (Eq. 4)
# ------------------------------------------------------------------------------------------------


def test_f_xtr_prime_imputes_the_k_prime_th_score():
    # n = 2 query tokens, k′ = 3 retrieved (score, doc) pairs each.
    scores = jnp.array([[0.9, 0.7, 0.4], [0.8, 0.6, 0.5]])
    docs = jnp.array([[10, 11, 10], [11, 11, 12]])
    q_mask = jnp.array([True, True])
    candidates = jnp.array([10, 11, 12, -1])
    got = np.asarray(xtr.xtr_inference_scores(scores, docs, q_mask, candidates))
    # m_1 = 0.4, m_2 = 0.5.  doc 10: (0.9 + m_2) / 2; doc 11: (0.7 + 0.8) / 2; doc 12: (m_1 + 0.5) / 2
    np.testing.assert_allclose(got[:3], [(0.9 + 0.5) / 2, (0.7 + 0.8) / 2, (0.4 + 0.5) / 2])
    assert got[3] == -np.inf  # padded candidate slot
    # unsorted candidates give the same scores in their own order
    permuted = np.asarray(xtr.xtr_inference_scores(scores, docs, q_mask, candidates[::-1]))
    np.testing.assert_allclose(permuted[::-1], got)
    # sparse host version
    ids, host = xtr.xtr_inference_scores_numpy(np.asarray(scores), np.asarray(docs))
    np.testing.assert_array_equal(ids, [10, 11, 12])
    np.testing.assert_allclose(host, got[:3], rtol=1e-6)
    # a masked (pruned) query token and empty result slots (doc id −1) never count
    scores3 = jnp.concatenate([scores, jnp.array([[99.0, 99.0, 99.0]])])
    docs3 = jnp.concatenate([docs, jnp.array([[12, 12, -1]])])
    got3 = xtr.xtr_inference_scores(scores3, docs3, jnp.array([True, True, False]), candidates)
    np.testing.assert_allclose(np.asarray(got3), got)


def test_f_xtr_prime_equals_colbert_when_everything_is_retrieved():
    rng = np.random.default_rng(0)
    n, num_docs, m, h = 3, 4, 5, 6
    q = rng.normal(size=(n, h)).astype(np.float32)
    d = rng.normal(size=(num_docs, m, h)).astype(np.float32)
    s = np.einsum("nh,cmh->ncm", q, d)  # [n, C, m]
    k_prime = num_docs * m  # every token of every document
    token_scores = s.reshape(n, k_prime)
    token_docs = np.broadcast_to(np.repeat(np.arange(num_docs), m), (n, k_prime))
    order = np.argsort(-token_scores, axis=1)  # as a MIPS index returns them
    token_scores = np.take_along_axis(token_scores, order, 1)
    token_docs = np.take_along_axis(token_docs, order, 1)
    got = xtr.xtr_inference_scores(token_scores, token_docs, np.ones(n, bool), np.arange(num_docs))
    colbert = s.max(axis=2).mean(axis=0)
    np.testing.assert_allclose(np.asarray(got), colbert, rtol=1e-5)
    ids, host = xtr.xtr_inference_scores_numpy(token_scores, token_docs)
    np.testing.assert_array_equal(ids, np.arange(num_docs))
    np.testing.assert_allclose(host, colbert, rtol=1e-5)


@given(
    seed=st.integers(0, 2**31 - 1),
    num_docs=st.integers(1, 30),
    q_len=st.integers(1, 4),
    empty_slots=st.booleans(),
)
@PROPERTY
def test_f_xtr_prime_jax_and_numpy_agree(seed, num_docs, q_len, empty_slots):
    rng = np.random.default_rng(seed)
    n, k_prime = 4, 16
    scores = -np.sort(-rng.normal(size=(2, n, k_prime)), axis=-1).astype(np.float32)
    docs = rng.integers(0, num_docs, (2, n, k_prime))
    if empty_slots:
        docs[:, :, -3:] = -1
        scores[:, :, -3:] = 1e30  # garbage in empty slots
    q_mask = np.arange(n)[None] < np.array([[q_len], [n]])
    candidates = np.asarray(xtr.xtr_candidates(docs))
    assert candidates.shape == (2, n * k_prime)
    got = np.asarray(_inference_scores(scores, docs, q_mask, candidates))
    for b in range(2):
        ids, host = xtr.xtr_inference_scores_numpy(scores[b], docs[b], q_mask[b])
        real = candidates[b] >= 0
        np.testing.assert_array_equal(candidates[b][real], np.unique(docs[b][docs[b] >= 0]))
        assert np.all(candidates[b][~real] == -1)
        # host candidates come only from searched tokens: they are a subset of all retrieved docs
        position = np.searchsorted(candidates[b][real], ids)
        np.testing.assert_allclose(got[b][real][position], host, rtol=1e-5, atol=1e-6)
        assert np.all(np.isfinite(got[b][real])) and np.all(got[b][~real] == -np.inf)


def test_xtr_candidates_are_unique_sorted_and_padded():
    docs = jnp.array([[[5, 3, -1], [3, 9, 5]]])
    np.testing.assert_array_equal(np.asarray(xtr.xtr_candidates(docs)), [[3, 5, 9, -1, -1, -1]])
    np.testing.assert_array_equal(np.asarray(xtr.xtr_candidates(docs[0], size=3)), [3, 5, 9])
    np.testing.assert_array_equal(
        np.asarray(xtr.xtr_candidates(jnp.array([[0, 1], [2, 3]]))), [0, 1, 2, 3]
    )


def test_f_xtr_prime_shape_errors():
    with pytest.raises(ValueError, match="token_scores .* and token_doc_ids .* must match"):
        xtr.xtr_inference_scores(
            jnp.zeros((2, 3)), jnp.zeros((2, 4), int), jnp.ones(2, bool), jnp.arange(3)
        )
