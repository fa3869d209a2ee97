"""Tests for aligner_jax.core.scoring: ALIGNER Eq. 1–2, the pairwise alignments of §2.2/§3.1/A.2."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aligner_jax.core import scoring
from aligner_jax.core.scoring import AlignmentStrategy

N, M, H = 4, 9, 3  # query length, doc length, dim (fixed so compiled shapes are reused)
PROPERTY = settings(max_examples=20, deadline=None)
ALL_SPECS = (
    "top_k:1",
    "top_k:3",
    "top_p:0.34",
    "top_p:0.005",
    "colbert",
    "dpr",
    "mebert:3",
    "coil",
    "differentiable:k=2,epsilon=0.01",
)
FAMILY_SPECS = ("top_k:1", "top_k:2", "top_k:6", "top_k:20", "top_p:0.005", "top_p:0.34", "colbert")

_alignment_scores = jax.jit(scoring.alignment_scores, static_argnums=(3,))
_family_scores = jax.jit(scoring.topk_family_scores, static_argnums=(3,))


def _lengths(max_length):
    return st.lists(st.integers(0, max_length), min_size=3, max_size=3)


def _inputs(seed, q_lengths, d_lengths, n=N, m=M):
    """Paired inputs [B, n, h] / [B, m, h] with masks and positive saliences."""
    rng = np.random.default_rng(seed)
    b = len(q_lengths)
    q = rng.normal(size=(b, n, H)).astype(np.float32)
    d = rng.normal(size=(b, m, H)).astype(np.float32)
    q_mask = np.arange(n)[None, :] < np.asarray(q_lengths)[:, None]
    d_mask = np.arange(m)[None, :] < np.asarray(d_lengths)[:, None]
    u_q = rng.uniform(0.1, 2.0, (b, n)).astype(np.float32)
    u_d = rng.uniform(0.0, 2.0, (b, m)).astype(np.float32)
    q_ids = rng.integers(0, 4, (b, n))
    d_ids = rng.integers(0, 4, (b, m))
    return q, d, q_mask, d_mask, u_q, u_d, q_ids, d_ids


def _real_block(s, q_mask, d_mask):
    return s[np.ix_(np.flatnonzero(q_mask), np.flatnonzero(d_mask))]


# ------------------------------------------------------------------------------------------------
# Similarity, Eq. 1 and Eq. 2
# ------------------------------------------------------------------------------------------------


def test_similarity_matrices():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 3, 4)).astype(np.float32)
    d = rng.normal(size=(5, 6, 4)).astype(np.float32)
    paired = scoring.similarity_matrix(q, d[:2])
    np.testing.assert_allclose(paired, np.einsum("bnh,bmh->bnm", q, d[:2]), rtol=1e-5, atol=1e-6)
    cross = scoring.cross_similarity(q, d)
    assert cross.shape == (2, 5, 3, 6)
    np.testing.assert_allclose(cross[1, 4], q[1] @ d[4].T, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"cross_similarity expects q \[Q, n, h\]"):
        scoring.cross_similarity(q[0], d)


def test_aggregate_is_eq1_and_safe():
    s = jnp.array([[1.0, 2.0], [3.0, jnp.inf]])
    a = jnp.array([[1.0, 0.5], [0.0, 0.0]])
    assert float(scoring.aggregate(s, a)) == pytest.approx((1.0 + 1.0) / 1.5)
    assert float(scoring.aggregate(s, jnp.zeros((2, 2)))) == 0.0
    grad_s, grad_a = jax.grad(lambda x, y: scoring.aggregate(x, y), argnums=(0, 1))(s, a)
    assert np.all(np.isfinite(np.asarray(grad_s))) and np.all(np.isfinite(np.asarray(grad_a)))
    grad_zero = jax.grad(lambda y: scoring.aggregate(s, y))(jnp.zeros((2, 2)))
    assert np.all(np.isfinite(np.asarray(grad_zero)))


def test_factorized_alignment_is_eq2():
    pairwise = jnp.array([[1.0, 0.0], [0.0, 1.0]])
    out = scoring.factorized_alignment(pairwise, jnp.array([2.0, 3.0]), jnp.array([5.0, 7.0]))
    np.testing.assert_allclose(out, [[10.0, 0.0], [0.0, 21.0]])
    np.testing.assert_allclose(scoring.factorized_alignment(pairwise), pairwise)


# ------------------------------------------------------------------------------------------------
# Pairwise alignments
# ------------------------------------------------------------------------------------------------


@given(seed=st.integers(0, 2**31 - 1), q_lengths=_lengths(N), d_lengths=_lengths(M))
@PROPERTY
def test_top1_is_normalised_colbert_sum_of_max(seed, q_lengths, d_lengths):
    q, d, q_mask, d_mask, *_ = _inputs(seed, q_lengths, d_lengths)
    s = scoring.similarity_matrix(q, d)
    top1 = np.asarray(_alignment_scores(s, q_mask, d_mask, AlignmentStrategy.parse("top_k:1")))
    colbert = np.asarray(_alignment_scores(s, q_mask, d_mask, AlignmentStrategy.parse("colbert")))
    for b in range(len(q_lengths)):
        block = _real_block(np.asarray(s[b]), q_mask[b], d_mask[b])
        expected = block.max(axis=1).mean() if block.size else 0.0
        assert top1[b] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert colbert[b] == pytest.approx(expected, rel=1e-5, abs=1e-6)


@given(
    seed=st.integers(0, 2**31 - 1),
    q_lengths=_lengths(N),
    d_lengths=_lengths(M),
    k=st.sampled_from([1, 3, M + 2]),
)
@PROPERTY
def test_top_k_picks_min_k_m_largest_per_real_row(seed, q_lengths, d_lengths, k):
    q, d, q_mask, d_mask, *_ = _inputs(seed, q_lengths, d_lengths)
    s = np.asarray(scoring.similarity_matrix(q, d))
    a = np.asarray(scoring.top_k_alignment(s, q_mask, d_mask, k))
    for b in range(len(q_lengths)):
        real = np.outer(q_mask[b], d_mask[b])
        assert np.all(a[b][~real] == 0)
        assert set(np.unique(a[b])) <= {0.0, 1.0}
        for i in np.flatnonzero(q_mask[b]):
            row = a[b, i]
            assert row.sum() == min(k, d_lengths[b])
            chosen = s[b, i][row == 1]
            others = s[b, i][(row == 0) & d_mask[b]]
            if chosen.size and others.size:
                assert chosen.min() >= others.max()


@given(
    seed=st.integers(0, 2**31 - 1),
    p=st.sampled_from([0.005, 0.1, 0.25, 0.34, 0.5, 1.0]),
    lengths=st.lists(st.integers(0, 40), min_size=3, max_size=3),
)
@PROPERTY
def test_top_p_picks_max_floor_pm_1_per_real_row(seed, p, lengths):
    q, d, q_mask, d_mask, *_ = _inputs(seed, [N, 2, 0], lengths, m=40)
    s = scoring.similarity_matrix(q, d)
    a = np.asarray(scoring.top_p_alignment(s, q_mask, d_mask, p))
    for b, m in enumerate(lengths):
        expected = min(max(math.floor(p * m + 1e-9), 1), m)
        np.testing.assert_array_equal(a[b].sum(-1), np.where(q_mask[b], expected, 0))
        assert np.all(a[b][:, ~d_mask[b]] == 0)


def test_top_p_counts_are_exact_for_decimal_ratios():
    # 0.29·100 = 28.999999999999996 in float64: the count must still be 29.
    s = jnp.asarray(np.random.default_rng(0).normal(size=(1, 100)), jnp.float32)
    a = scoring.top_p_alignment(s, jnp.ones(1, bool), jnp.ones(100, bool), 0.29)
    assert float(a.sum()) == 29
    assert AlignmentStrategy.parse("top_p:0.5%").count(200) == 1
    assert AlignmentStrategy.parse("top_p:0.5%").count(199) == 1  # max(⌊0.995⌋, 1)
    assert AlignmentStrategy.parse("top_p:1.5%").count(200) == 3


@given(
    seed=st.integers(0, 2**31 - 1),
    q_lengths=_lengths(N),
    d_lengths=_lengths(M),
    k=st.integers(1, 4),
)
@PROPERTY
def test_differentiable_alignment_rows_sum_to_k(seed, q_lengths, d_lengths, k):
    q, d, q_mask, d_mask, *_ = _inputs(seed, q_lengths, d_lengths)
    s = scoring.similarity_matrix(q, d)
    a = np.asarray(scoring.differentiable_alignment(s, q_mask, d_mask, k, 0.01))
    assert a.min() >= 0 and a.max() <= 1
    for b in range(len(q_lengths)):
        expected = np.where(q_mask[b], min(k, d_lengths[b]), 0)
        np.testing.assert_allclose(a[b].sum(-1), expected, atol=1e-3)
        assert np.all(a[b][:, ~d_mask[b]] == 0)


def test_differentiable_alignment_approaches_top_k_as_epsilon_vanishes():
    rng = np.random.default_rng(1)
    s = jnp.asarray(np.stack([rng.permutation(M) / M for _ in range(N)])[None], jnp.float32)
    q_mask = np.ones((1, N), bool)
    d_mask = np.arange(M)[None] < 7
    hard = np.asarray(scoring.top_k_alignment(s, q_mask, d_mask, 3))
    errors = [
        np.abs(np.asarray(scoring.differentiable_alignment(s, q_mask, d_mask, 3, eps)) - hard).max()
        for eps in (0.1, 0.01, 0.001)
    ]
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 1e-6
    scores = [
        float(scoring.alignment_scores(s, q_mask, d_mask, f"differentiable:k=3,epsilon={eps}")[0])
        for eps in (0.1, 0.001)
    ]
    top3 = float(scoring.alignment_scores(s, q_mask, d_mask, "top_k:3")[0])
    assert abs(scores[1] - top3) < 1e-5 < abs(scores[0] - top3)


def test_dpr_alignment_by_hand():
    s = jnp.array([[0.3, 0.9], [0.8, 0.1]])
    q_mask = jnp.array([True, True])
    d_mask = jnp.array([True, True])
    a = scoring.dpr_alignment(s, q_mask, d_mask)
    np.testing.assert_array_equal(a, [[1, 0], [0, 0]])
    assert float(scoring.alignment_scores(s, q_mask, d_mask, "dpr")) == pytest.approx(0.3)
    # with saliences Eq. 1 still normalises by Σ A: one aligned pair → exactly S_11
    assert float(
        scoring.alignment_scores(s, q_mask, d_mask, "dpr", u_q=jnp.array([0.5, 9.0]))
    ) == pytest.approx(0.3)


def test_mebert_alignment_by_hand():
    # first query token, max among the first k = 2 doc tokens (0.4 beats 0.2; 0.95 is outside)
    s = jnp.array([[0.2, 0.4, 0.95], [0.9, 0.9, 0.9]])
    q_mask = jnp.array([True, True])
    d_mask = jnp.array([True, True, True])
    a = scoring.mebert_alignment(s, q_mask, d_mask, 2)
    np.testing.assert_array_equal(a, [[0, 1, 0], [0, 0, 0]])
    assert float(scoring.alignment_scores(s, q_mask, d_mask, "mebert:2")) == pytest.approx(0.4)
    # the window only contains real tokens: with doc token 2 padded, k = 2 → argmax is token 1
    a = scoring.mebert_alignment(s, q_mask, jnp.array([True, False, True]), 2)
    np.testing.assert_array_equal(a, [[1, 0, 0], [0, 0, 0]])


def test_coil_alignment_by_hand():
    s = jnp.array([[0.1, 0.7, 0.5, 0.9], [0.6, 0.2, 0.3, 0.4], [0.5, 0.5, 0.5, 0.5]])
    q_ids = jnp.array([7, 8, 9])
    d_ids = jnp.array([7, 7, 8, 7])
    q_mask = jnp.array([True, True, True])
    d_mask = jnp.array([True, True, True, False])  # the best id-7 match (0.9) is padding
    a = scoring.coil_alignment(s, q_mask, d_mask, q_ids, d_ids)
    # row 0: id 7 at tokens 0, 1 (3 is padding) → 0.7; row 1: id 8 at token 2 → 0.3; row 2: none
    np.testing.assert_array_equal(a, [[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]])
    score = scoring.alignment_scores(s, q_mask, d_mask, "coil", q_ids=q_ids, d_ids=d_ids)
    assert float(score) == pytest.approx((0.7 + 0.3) / 2)
    no_match = scoring.alignment_scores(s, q_mask, d_mask, "coil", q_ids=q_ids + 100, d_ids=d_ids)
    assert float(no_match) == 0.0
    with pytest.raises(ValueError, match="'coil' needs the token ids"):
        scoring.alignment_scores(s, q_mask, d_mask, "coil")


def test_saliences_weight_eq1():
    s = jnp.array([[1.0, 5.0], [2.0, 3.0]])
    mask = jnp.array([True, True])
    u_q = jnp.array([1.0, 3.0])
    u_d = jnp.array([2.0, 0.5])
    # top-1: row 0 picks j=1 (5.0), row 1 picks j=1 (3.0); A = u_q ⊗ u_d on those entries
    expected = (5.0 * 1.0 * 0.5 + 3.0 * 3.0 * 0.5) / (1.0 * 0.5 + 3.0 * 0.5)
    got = scoring.alignment_scores(s, mask, mask, "top_k:1", u_q=u_q, u_d=u_d)
    assert float(got) == pytest.approx(expected)
    # all-zero salience → Σ A = 0 → score 0
    zero = scoring.alignment_scores(s, mask, mask, "top_k:1", u_d=jnp.zeros(2))
    assert float(zero) == 0.0


# ------------------------------------------------------------------------------------------------
# Padding never changes a score (every strategy, the fast path included)
# ------------------------------------------------------------------------------------------------


def _pad(x, axis, extra, value):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return np.pad(x, widths, constant_values=value)


@given(
    seed=st.integers(0, 2**31 - 1),
    q_lengths=_lengths(N),
    d_lengths=_lengths(M),
    garbage=st.sampled_from([1e30, -1e30, 7.0]),
    with_salience=st.booleans(),
)
@settings(max_examples=6, deadline=None)
def test_padding_never_changes_any_score(seed, q_lengths, d_lengths, garbage, with_salience):
    q, d, q_mask, d_mask, u_q, u_d, q_ids, d_ids = _inputs(seed, q_lengths, d_lengths)
    # put garbage in the already padded positions too
    q = np.where(q_mask[..., None], q, garbage).astype(np.float32)
    d = np.where(d_mask[..., None], d, garbage).astype(np.float32)
    s = scoring.similarity_matrix(q, d)
    q2, d2 = _pad(q, 1, 2, garbage), _pad(d, 1, 3, garbage)
    q_mask2, d_mask2 = _pad(q_mask, 1, 2, False), _pad(d_mask, 1, 3, False)
    s2 = scoring.similarity_matrix(q2, d2)
    sal = (u_q, u_d) if with_salience else (None, None)
    sal2 = (_pad(u_q, 1, 2, 1e30), _pad(u_d, 1, 3, 1e30)) if with_salience else (None, None)
    ids2 = (_pad(q_ids, 1, 2, 1), _pad(d_ids, 1, 3, 1))
    for spec in ALL_SPECS:
        strategy = AlignmentStrategy.parse(spec)
        base = scoring.alignment_scores(s, q_mask, d_mask, strategy, *sal, q_ids, d_ids)
        padded = scoring.alignment_scores(s2, q_mask2, d_mask2, strategy, *sal2, *ids2)
        assert np.all(np.isfinite(np.asarray(padded))), spec
        np.testing.assert_allclose(padded, base, rtol=1e-5, atol=1e-6, err_msg=spec)
    family = tuple(AlignmentStrategy.parse(x) for x in FAMILY_SPECS)
    np.testing.assert_allclose(
        _family_scores(s2, q_mask2, d_mask2, family, *sal2),
        _family_scores(s, q_mask, d_mask, family, *sal),
        rtol=1e-5,
        atol=1e-6,
    )


# ------------------------------------------------------------------------------------------------
# Fast multi-strategy path
# ------------------------------------------------------------------------------------------------


@given(
    seed=st.integers(0, 2**31 - 1),
    q_lengths=_lengths(N),
    d_lengths=_lengths(M),
    with_salience=st.booleans(),
)
@PROPERTY
def test_topk_family_equals_alignment_scores(seed, q_lengths, d_lengths, with_salience):
    q, d, q_mask, d_mask, u_q, u_d, *_ = _inputs(seed, q_lengths, d_lengths)
    if with_salience:
        u_d = np.where(np.random.default_rng(seed).random(u_d.shape) < 0.3, 0.0, u_d)  # sparse u^d
    sal = (u_q, u_d) if with_salience else (None, None)
    s = scoring.similarity_matrix(q, d)
    strategies = tuple(AlignmentStrategy.parse(x) for x in FAMILY_SPECS)
    fast = np.asarray(_family_scores(s, q_mask, d_mask, strategies, *sal))
    assert fast.shape == (len(strategies), len(q_lengths))
    for index, strategy in enumerate(strategies):
        reference = np.asarray(_alignment_scores(s, q_mask, d_mask, strategy, *sal))
        np.testing.assert_allclose(
            fast[index], reference, rtol=1e-5, atol=1e-6, err_msg=str(strategy)
        )


def test_topk_family_cross_scores_with_broadcast_masks():
    rng = np.random.default_rng(4)
    q = rng.normal(size=(2, N, H)).astype(np.float32)
    d = rng.normal(size=(3, M, H)).astype(np.float32)
    q_mask = np.arange(N)[None] < np.array([[4], [2]])
    d_mask = np.arange(M)[None] < np.array([[9], [5], [1]])
    u_d = rng.uniform(size=(3, M)).astype(np.float32)
    s = scoring.cross_similarity(q, d)
    strategies = ("top_k:2", "top_p:0.25")
    fast = scoring.topk_family_scores(s, q_mask[:, None], d_mask[None], strategies, u_d=u_d[None])
    assert fast.shape == (2, 2, 3)
    for i, spec in enumerate(strategies):
        ref = scoring.alignment_scores(s, q_mask[:, None], d_mask[None], spec, u_d=u_d[None])
        np.testing.assert_allclose(fast[i], ref, rtol=1e-5, atol=1e-6)
    # the top-k in the fast path is taken once, with K = the largest count (top_p:0.25 of 9 → 2)
    jaxpr = jax.make_jaxpr(
        lambda x: scoring.topk_family_scores(x, q_mask[:, None], d_mask[None], strategies)
    )(s)
    assert str(jaxpr).count("top_k[") == 1


def test_topk_family_rejects_other_strategies():
    s = jnp.zeros((N, M))
    with pytest.raises(ValueError, match="handles top_k, top_p and colbert only, not 'dpr'"):
        scoring.topk_family_scores(s, jnp.ones(N, bool), jnp.ones(M, bool), ("top_k:1", "dpr"))


# ------------------------------------------------------------------------------------------------
# Gradients
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["top_k:2", "top_p:0.34", "differentiable:k=2,epsilon=0.01"])
def test_scores_have_finite_gradients_with_padding(spec):
    q, d, q_mask, d_mask, u_q, u_d, *_ = _inputs(3, [4, 1, 0], [9, 3, 0])
    q = np.where(q_mask[..., None], q, 1e3).astype(np.float32)
    d = np.where(d_mask[..., None], d, -1e3).astype(np.float32)
    strategy = AlignmentStrategy.parse(spec)

    def loss(q, d, u_q, u_d):
        s = scoring.similarity_matrix(q, d)
        return jnp.sum(scoring.alignment_scores(s, q_mask, d_mask, strategy, u_q, u_d))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, d, u_q, u_d)
    for grad in grads:
        assert np.all(np.isfinite(np.asarray(grad)))
    assert np.all(np.asarray(grads[0])[~q_mask] == 0)
    assert np.abs(np.asarray(grads[0])[q_mask]).sum() > 0


# ------------------------------------------------------------------------------------------------
# Strategy specs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,canonical,fields",
    [
        ("top_k:1", "top_k:1", {"kind": "top_k", "k": 1}),
        ("top_k:8", "top_k:8", {"kind": "top_k", "k": 8}),
        ("top_p:0.005", "top_p:0.005", {"kind": "top_p", "p": 0.005}),
        ("top_p:0.5%", "top_p:0.005", {"kind": "top_p", "p": 0.005}),
        ("top_p:1.5%", "top_p:0.015", {"kind": "top_p", "p": 0.015}),
        ("colbert", "colbert", {"kind": "colbert"}),
        ("dpr", "dpr", {"kind": "dpr"}),
        ("mebert:8", "mebert:8", {"kind": "mebert", "k": 8}),
        ("coil", "coil", {"kind": "coil"}),
        (
            "differentiable:k=1,epsilon=0.01",
            "differentiable:k=1,epsilon=0.01",
            {"kind": "differentiable", "k": 1, "epsilon": 0.01, "num_iters": 0},
        ),
        (
            " Differentiable: epsilon=0.002, k=4, num_iters=5 ",
            "differentiable:k=4,epsilon=0.002,num_iters=5",
            {"kind": "differentiable", "k": 4, "epsilon": 0.002, "num_iters": 5},
        ),
    ],
)
def test_strategy_parse_and_str_round_trip(spec, canonical, fields):
    strategy = AlignmentStrategy.parse(spec)
    for name, value in fields.items():
        assert getattr(strategy, name) == value
    assert str(strategy) == canonical
    assert AlignmentStrategy.parse(str(strategy)) == strategy
    assert hash(AlignmentStrategy.parse(canonical)) == hash(strategy)
    assert AlignmentStrategy.parse(strategy) is strategy


@pytest.mark.parametrize(
    "spec,reason",
    [
        ("top_k", "'top_k' needs a positive integer"),
        ("top_k:0", "k=0 must be an int >= 1"),
        ("top_k:1.5", "'top_k' needs a positive integer"),
        ("top_p:2", "p=2.0 must be a fraction in (0, 1]"),
        ("top_p:0", "p=0.0 must be a fraction in (0, 1]"),
        ("top_p:abc", "'top_p' needs a fraction"),
        ("colbert:3", "'colbert' takes no argument"),
        ("mebert:", "'mebert' needs a positive integer"),
        ("differentiable:k=1", "needs k=<int> and epsilon=<float>"),
        ("differentiable:k=1,epsilon=0", "epsilon=0.0 must be > 0"),
        ("differentiable:k=1,epsilon=0.1,temperature=2", "bad or repeated field 'temperature=2'"),
        ("xtr", "unknown kind 'xtr'"),
        ("", "unknown kind ''"),
    ],
)
def test_strategy_parse_errors_name_spec_and_valid_forms(spec, reason):
    with pytest.raises(ValueError) as error:
        AlignmentStrategy.parse(spec)
    message = str(error.value)
    assert f"Invalid alignment strategy {spec!r}" in message
    assert reason in message
    for form in ("top_k:<int K >= 1>", "top_p:<percent>%", "colbert", "dpr", "mebert:", "coil"):
        assert form in message
    assert "differentiable:k=<int K >= 1>,epsilon=<float > 0>" in message


def test_strategy_is_a_jit_static_argument():
    q, d, q_mask, d_mask, *_ = _inputs(0, [4, 2, 1], [9, 4, 1])
    s = scoring.similarity_matrix(q, d)
    traces = []

    def traced(s, q_mask, d_mask, strategy):
        traces.append(strategy)
        return scoring.alignment_scores(s, q_mask, d_mask, strategy)

    scorer = jax.jit(traced, static_argnames=("strategy",))
    a = scorer(s, q_mask, d_mask, strategy=AlignmentStrategy.parse("top_k:2"))
    b = scorer(s, q_mask, d_mask, strategy=AlignmentStrategy.top_k(2))
    np.testing.assert_array_equal(a, b)
    assert len(traces) == 1  # equal strategies hash equal: no retrace
    with pytest.raises(ValueError, match="Unknown alignment kind 'top_q'"):
        AlignmentStrategy("top_q", k=1)
    with pytest.raises(ValueError, match="'top_k' takes no p"):
        AlignmentStrategy("top_k", k=1, p=0.5)
