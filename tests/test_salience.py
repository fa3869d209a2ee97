"""Tests for aligner_jax.core.salience: the entropy-regularised LP gate (ALIGNER Eq. 3–5, A.1)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aligner_jax.core import salience

M = 12  # padded length used by the property tests (one compiled shape)
PROPERTY = settings(max_examples=25, deadline=None)


def _scores_and_mask(seed: int, lengths, width: int = M, garbage: float = 0.0):
    """Salience-like scores (ReLU of a normal: many exact zeros) and a mask of the given lengths."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    s = np.maximum(rng.normal(0.5, 0.5, (len(lengths), width)), 0.0).astype(np.float32)
    mask = np.arange(width)[None, :] < lengths[:, None]
    if garbage:
        s = np.where(mask, s, garbage).astype(np.float32)
    return jnp.asarray(s), jnp.asarray(mask)


@pytest.mark.parametrize(
    "ratio,length,rounding,expected",
    [
        (0.4, 5, "ceil", 2),  # 0.4 * 5 is 2.0000000298 in float32: a naive ceil gives 3
        (0.4, 6, "ceil", 3),
        (0.5, 7, "ceil", 4),
        (0.29, 100, "floor", 29),  # 0.29 * 100 = 28.999999999999996 in float64
        (0.005, 200, "floor", 1),
        (0.005, 199, "floor", 0),
        (0.015, 200, "floor", 3),
        (1.0, 9, "ceil", 9),
    ],
)
def test_ratio_count_is_exact(ratio, length, rounding, expected):
    assert salience.ratio_count(ratio, length, rounding) == expected
    array = salience.ratio_count(ratio, jnp.array([length, 0]), rounding)
    np.testing.assert_array_equal(np.asarray(array), [expected, 0])


@given(ratio=st.sampled_from([0.05, 0.1, 0.29, 0.4, 0.5, 0.015, 1.0]), length=st.integers(0, 5000))
@settings(max_examples=60, deadline=None)
def test_ratio_count_matches_fraction_arithmetic(ratio, length):
    from fractions import Fraction

    exact = Fraction(repr(ratio)) * length
    assert salience.ratio_count(ratio, length, "floor") == math.floor(exact)
    assert salience.ratio_count(ratio, length, "ceil") == math.ceil(exact)
    array = salience.ratio_count(ratio, jnp.array([length]), "ceil")
    assert int(array[0]) == math.ceil(exact)


@pytest.mark.parametrize(
    "beta,n,expected",
    [(0.07, 100, 7), (0.14, 50, 7), (0.28, 25, 7), (0.56, 25, 14), (0.1, 100, 10),
     (0.05, 10, 1), (0.3, 0, 0), (0.0, 5, 1), (1.0, 9, 9), (2.0, 9, 9)],
)  # fmt: skip
def test_pruning_keeps_exactly_the_ceiling_of_beta_n(beta, n, expected):
    """§3.2's top ⌈β·n⌉ in exact arithmetic: in floats 0.07 · 100 = 7.000000000000001 kept 8."""
    from aligner_jax.core import pruning

    assert pruning.keep_count(n, beta) == expected
    np.testing.assert_array_equal(pruning.keep_count(np.array([n, 3 * n]), beta)[:1], [expected])
    if n:
        kept = pruning.top_fraction(np.linspace(1.0, 0.5, n).astype(np.float32), beta)
        assert kept.tolist() == list(range(expected))


def test_sparsity_k_counts_only_real_tokens():
    mask = jnp.array([[True] * 5 + [False] * 3, [True] * 8, [False] * 8])
    np.testing.assert_array_equal(np.asarray(salience.sparsity_k(mask, 0.4)), [2, 4, 0])


@given(
    seed=st.integers(0, 2**31 - 1),
    lengths=st.lists(st.integers(0, M), min_size=3, max_size=3),
    alpha=st.sampled_from([0.1, 0.4, 0.5, 1.0]),
    epsilon=st.sampled_from([0.002, 0.01, 0.1]),
)
@PROPERTY
def test_lp_gate_is_feasible_and_masked(seed, lengths, alpha, epsilon):
    s, mask = _scores_and_mask(seed, lengths, garbage=1e30)
    lam = np.asarray(salience.lp_gate(s, mask, alpha, epsilon))
    assert np.all(np.isfinite(lam))
    assert lam.min() >= 0.0 and lam.max() <= 1.0
    assert np.all(lam[~np.asarray(mask)] == 0.0)
    k = [math.ceil(alpha * m - 1e-9) for m in lengths]
    np.testing.assert_allclose(lam.sum(-1), k, atol=1e-3)


@given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(1, M), min_size=2, max_size=2))
@PROPERTY
def test_lp_gate_approaches_hard_top_k_as_epsilon_vanishes(seed, lengths):
    rng = np.random.default_rng(seed)
    # distinct scores, spaced by 1/M, in random order
    s = jnp.asarray(np.stack([rng.permutation(M) / M for _ in lengths]).astype(np.float32))
    mask = jnp.asarray(np.arange(M)[None, :] < np.asarray(lengths)[:, None])
    hard = np.asarray(salience.hard_top_k_mask(s, mask, salience.sparsity_k(mask, 0.4)))
    errors = [
        np.abs(np.asarray(salience.lp_gate(s, mask, 0.4, eps)) - hard).max()
        for eps in (0.1, 0.01, 0.002)
    ]
    assert errors[-1] < 1e-6
    assert errors[0] >= errors[1] >= errors[2]


def test_lp_gate_solves_eq4_on_a_hand_example():
    # k = ⌈0.5·4⌉ = 2; with ε large enough to be soft the solution is min(1, exp((s + a)/ε)).
    s = jnp.array([[3.0, 2.0, 1.0, 0.0]])
    mask = jnp.ones((1, 4), bool)
    lam = np.asarray(salience.lp_gate(s, mask, 0.5, epsilon=1.0))[0]
    assert lam[0] == pytest.approx(1.0)  # capped
    # the others share the remaining mass 1: exp((s_i + a)/ε) with Σ = 1 → softmax of (2, 1, 0)
    np.testing.assert_allclose(
        lam[1:], np.exp([2.0, 1.0, 0.0]) / np.exp([2.0, 1.0, 0.0]).sum(), rtol=1e-5
    )


def test_eq5_iterations_converge_to_the_exact_solution():
    s, mask = _scores_and_mask(3, [12, 9, 5, 1])
    exact = salience.lp_gate(s, mask, 0.4, epsilon=0.05)
    for init in ("zero", "threshold"):
        iterated = salience.lp_gate(s, mask, 0.4, epsilon=0.05, num_iters=2000, init=init)
        np.testing.assert_allclose(np.asarray(iterated), np.asarray(exact), atol=2e-4)
    # extra Eq. 5 updates after the exact initialisation leave the fixed point in place
    refined = salience.lp_gate(s, mask, 0.4, epsilon=0.05, num_iters=3, init="exact")
    np.testing.assert_allclose(np.asarray(refined), np.asarray(exact), atol=1e-5)


def test_paper_zero_init_needs_many_iterations_at_small_epsilon():
    """Documents the measured convergence: a few Eq. 5 updates from a = b = 0 miss Σλ = k."""
    s, mask = _scores_and_mask(5, [M] * 4)
    k = np.asarray(salience.sparsity_k(mask, 0.4))
    few = np.asarray(salience.lp_gate(s, mask, 0.4, 0.002, num_iters=5, init="zero"))
    assert np.abs(few.sum(-1) - k).max() > 0.1
    exact = np.asarray(salience.lp_gate(s, mask, 0.4, 0.002))
    assert np.abs(exact.sum(-1) - k).max() < 1e-3


def _finite_difference(f, x, h):
    x = np.asarray(x, np.float64)
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        step = np.zeros_like(x)
        step[index] = h
        grad[index] = (f(x + step) - f(x - step)) / (2 * h)
    return grad


@pytest.mark.parametrize("init,num_iters", [("exact", 0), ("exact", 2), ("zero", 400)])
def test_lp_gate_gradients_match_finite_differences(init, num_iters):
    rng = np.random.default_rng(0)
    s = np.maximum(rng.normal(0.5, 0.5, (3, 8)), 0.0)
    mask = jnp.asarray(np.arange(8)[None, :] < np.array([[8], [6], [3]]))
    weights = rng.normal(size=(3, 8))
    with jax.enable_x64(True):
        w = jnp.asarray(weights)

        @jax.jit
        def objective(x):
            lam = salience.lp_gate(x, mask, 0.5, 0.1, num_iters=num_iters, init=init)
            return jnp.sum(w * lam)

        grad = np.asarray(jax.jit(jax.grad(objective))(jnp.asarray(s)))
        numeric = _finite_difference(lambda x: float(objective(jnp.asarray(x))), s, 1e-6)
    assert np.all(np.isfinite(grad))
    np.testing.assert_allclose(grad, numeric, atol=1e-5)


def _weighted_gate_sum(s, mask, weights, num_iters, init):
    return jnp.sum(weights * salience.lp_gate(s, mask, 0.4, 0.002, num_iters, init))


_GATE_GRAD = jax.jit(jax.grad(_weighted_gate_sum), static_argnums=(3, 4))


@given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(0, M), min_size=3, max_size=3))
@PROPERTY
def test_lp_gate_gradients_are_finite_with_padding(seed, lengths):
    s, mask = _scores_and_mask(seed, lengths, garbage=1e30)
    weights = jnp.asarray(np.random.default_rng(seed).normal(size=s.shape), jnp.float32)
    for init, num_iters in (("exact", 0), ("threshold", 3), ("zero", 3)):
        grad = np.asarray(_GATE_GRAD(s, mask, weights, num_iters, init))
        assert np.all(np.isfinite(grad))
        assert np.all(grad[~np.asarray(mask)] == 0.0)


def test_total_mass_has_zero_gradient():
    s, mask = _scores_and_mask(7, [M, 7])
    grad = jax.jit(jax.grad(lambda x: jnp.sum(salience.lp_gate(x, mask, 0.4, 0.05))))(s)
    np.testing.assert_allclose(np.asarray(grad), 0.0, atol=1e-4)


def test_entropic_top_k_generic_budget_per_row():
    s, mask = _scores_and_mask(11, [M, M, 4, 0])
    k = jnp.array([1.0, 2.5, 7.0, 3.0])  # 7 > 4 real tokens → all of them; no real token → 0
    lam = np.asarray(salience.entropic_top_k(s, mask, k, epsilon=0.01))
    np.testing.assert_allclose(lam.sum(-1), [1.0, 2.5, 4.0, 0.0], atol=1e-4)
    np.testing.assert_allclose(lam[2, :4], 1.0)


def test_lp_gate_is_jittable_and_batched():
    s, mask = _scores_and_mask(13, [M, 3, 8, 1])
    s = s.reshape(2, 2, M)
    mask = mask.reshape(2, 2, M)
    jitted = jax.jit(salience.lp_gate, static_argnums=(2, 3, 4, 5))
    out = jitted(s, mask, 0.5, 0.002, 0, "exact")
    assert out.shape == (2, 2, M)
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(salience.lp_gate(s, mask, 0.5)), atol=1e-6
    )


def test_unary_salience_methods():
    s = jnp.array([[0.9, 0.0, 0.5, 0.7, 3.0]])
    mask = jnp.array([[True, True, True, True, False]])
    # α = 0.5 of 4 real tokens → k = 2
    np.testing.assert_array_equal(
        np.asarray(salience.unary_salience(s, mask, "none")), [[1, 1, 1, 1, 0]]
    )
    np.testing.assert_allclose(
        np.asarray(salience.unary_salience(s, mask, "relu")), [[0.9, 0.0, 0.5, 0.7, 0.0]]
    )
    np.testing.assert_allclose(
        np.asarray(salience.unary_salience(s, mask, "l1")), [[0.9, 0.0, 0.5, 0.7, 0.0]]
    )
    np.testing.assert_allclose(
        np.asarray(salience.unary_salience(s, mask, "hard_topk", alpha=0.5)),
        [[0.9, 0.0, 0.0, 0.7, 0.0]],
    )
    lp = np.asarray(salience.unary_salience(s, mask, "lp", alpha=0.5, epsilon=0.002))
    np.testing.assert_allclose(lp, [[0.9, 0.0, 0.0, 0.7, 0.0]], atol=1e-6)
    lam = np.asarray(salience.lp_gate(s, mask, 0.5, 0.2))
    np.testing.assert_allclose(
        np.asarray(salience.unary_salience(s, mask, "lp", alpha=0.5, epsilon=0.2)),
        lam * np.array([[0.9, 0.0, 0.5, 0.7, 0.0]]),
        rtol=1e-6,
    )


def test_hard_top_k_breaks_ties_towards_earlier_tokens():
    s = jnp.array([0.0, 0.0, 0.0, 1.0])
    out = salience.hard_top_k_mask(s, jnp.ones(4, bool), 2)
    np.testing.assert_array_equal(np.asarray(out), [1, 0, 0, 1])


def test_l1_penalty_is_mean_absolute_salience_of_real_tokens():
    u = jnp.array([[1.0, -2.0, 100.0], [0.0, 0.0, 0.0]])
    mask = jnp.array([[True, True, False], [False, False, False]])
    np.testing.assert_allclose(np.asarray(salience.l1_penalty(u, mask)), [1.5, 0.0])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"method": "sparsemax"}, "Unknown salience method 'sparsemax'"),
        ({"alpha": 1.5}, "alpha=1.5 must be a ratio in (0, 1]"),
        ({"alpha": 0.0}, "alpha=0.0 must be a ratio in (0, 1]"),
        ({"epsilon": 0.0}, "epsilon=0.0 must be a Python float > 0"),
        ({"init": "random"}, "init='random' is not one of"),
        ({"init": "zero", "num_iters": 0}, "init='zero' needs num_iters >= 1"),
        ({"num_iters": -1}, "num_iters=-1 must be a Python int >= 0"),
    ],
)
def test_user_errors_are_explained(kwargs, message):
    s, mask = _scores_and_mask(0, [4])
    with pytest.raises(ValueError) as error:
        salience.unary_salience(s, mask, **{"method": "lp", **kwargs})
    assert message in str(error.value)
