"""Unary salience with a sparse gate: ALIGNER §3.2 (Eq. 3–5), Appendix A.1 and the ablations of §4.3.

The salience of token i is ``u_i = λ_i · s_i`` (Eq. 3), where ``s = ReLU(W·x + b)`` is computed by
the model's salience head and passed in here, and ``λ`` is the solution of the entropy-regularised
linear program (Eq. 4)

    max_λ  sᵀλ + ε·H(λ)   s.t.  1ᵀλ = k,  λ_i ∈ [0, 1],        k = ⌈α·m⌉

with m the *real* length of the sequence (padding never counts).

Solver (Eq. 5, Appendix A.1). The dual variables (a, b) are updated by coordinate descent

    a' = ε·ln k − ε·ln Σ_i exp((s_i + b_i)/ε),      b'_i = min(−s_i − a', 0)

and the solution is ``λ_i = exp((s_i + b_i + a)/ε) = min(1, exp((s_i + a)/ε))``. All sums are
computed in log space (logsumexp), so ε = 0.002 is stable in float32.

Convergence (measured on CPU, 64 rows per setting, ε = 0.002, scores ReLU(N(0.5, 0.5)) or
U(0, 1), real lengths in [m/2, m]): one update moves the threshold −a by ε·ln(f(a)/k), where
``f(a) = Σ_i min(1, exp((s_i + a)/ε))``; near the solution the error of Σλ shrinks only by a factor
≈ 1 − λ_frac/k per update (λ_frac ≈ 1 is the mass of the un-capped tokens), i.e. linearly with rate
≈ 1 − 1/k. Share of rows with |Σλ − k| < 1e-2 after T updates:

    m = 256, α = 0.4   init "zero":      T=500: 0 %,   T=1000: 2–12 %,  T=2000: 78–100 %, T=4000: 100 %
                       init "threshold": T=5: 20–23 %, T=200: 53–58 %,  T=500: 100 %
    m = 64,  α = 0.5   init "zero":      T=500: 0–2 %, T=1000: 19–55 %, T=2000: 94–100 %
                       init "threshold": T=5: 66–72 %, T=200: 100 %
    init "exact": |Σλ − k| ≤ 1e-4 for every row (float32 rounding).

So "a few iterations" from a = b = 0 do not solve Eq. 4 at the paper's α and ε. A gradient step
through [256, 256] scores costs ~52 ms with "exact", ~300 ms with 500 "threshold" updates and
~1.2 s with 2,000 "zero" updates (2 shared CPU cores).

Three initialisations are therefore offered (``init``):

* ``"exact"`` (default): the fixed point of Eq. 5 in closed form. Sorting s (descending),
  ``a* = max_{0 ≤ c < k} [ε·ln(k − c) − ε·ln Σ_{i ≥ c} exp(s_(i)/ε)]`` (c = the number of tokens
  capped at λ = 1). Its gradient is the exact implicit derivative of the LP solution
  (``da = (ε·dk − Σ_i u_i ds_i) / Σ_i u_i`` with u_i = λ_i on un-capped tokens). ``num_iters``
  further Eq. 5 updates may follow (they leave the solution and its gradient unchanged); 0 is enough.
* ``"threshold"``: a starts at minus the k-th largest score (under ``stop_gradient``), b = min(−s−a, 0);
  then ``num_iters`` Eq. 5 updates.
* ``"zero"``: the paper's initialisation a = 0, b = 0; then ``num_iters`` Eq. 5 updates.

Ablations (§4.3, Figure 6), selected by ``unary_salience(method=...)``: ``"lp"`` (ours),
``"relu"`` (no gate, u = s), ``"hard_topk"`` (λ = exact top-k mask, no entropy), ``"l1"`` (u = s; add
``l1_penalty`` to the loss) and ``"none"`` (u = 1 on real tokens: no salience at all).
"""

from __future__ import annotations

import functools
from fractions import Fraction

import jax
import jax.numpy as jnp

from aligner_jax.common.errors import ConfigError

SALIENCE_METHODS = ("lp", "relu", "hard_topk", "l1", "none")
LP_INITS = ("exact", "threshold", "zero")

# Paper defaults (§4.1): α^q = 50 %, α^d = 40 %, ε = 0.002.
DEFAULT_EPSILON = 0.002
DEFAULT_NUM_ITERS = 0
DEFAULT_INIT = "exact"

# Stands in for log(0) of padded tokens in log-space sums: finite, so no inf − inf = NaN.
_LOG_ZERO = -1e30
# Ratios are turned into exact fractions with a bounded denominator so that counts such as
# ⌈0.4·5⌉ = 2 or ⌊0.005·200⌋ = 1 are computed in integer arithmetic (float32 gets them wrong).
_MAX_RATIO_DENOMINATOR = 10_000


def ratio_fraction(ratio: float, name: str) -> Fraction:
    """``ratio`` as the exact fraction it prints as (0.07 → 7/100; denominators ≤ 10,000)."""
    if not isinstance(ratio, int | float) or isinstance(ratio, bool):
        raise TypeError(
            f"{name}={ratio!r} must be a Python float (a static ratio), not a traced array."
        )
    if not 0.0 < float(ratio) <= 1.0:
        raise ConfigError(f"{name}={ratio!r} must be a ratio in (0, 1].")
    return Fraction(repr(float(ratio))).limit_denominator(_MAX_RATIO_DENOMINATOR)


def ratio_count(ratio: float, length, rounding: str, name: str = "ratio"):
    """``⌊ratio·length⌋`` or ``⌈ratio·length⌉`` computed exactly in integer arithmetic.

    Args:
      ratio: a static ratio in (0, 1] (e.g. α of Eq. 4 or p of top-p, §3.1). It is read as the
        decimal it prints as (0.005 → 1/200), with denominators limited to 10,000.
      length: a Python int or an integer array (real lengths m).
      rounding: ``"floor"`` or ``"ceil"``.
      name: the parameter's name, used in error messages.

    Returns:
      An int (for an int ``length``) or an int32 array of ``length``'s shape.
    """
    frac = ratio_fraction(ratio, name)
    num, den = frac.numerator, frac.denominator
    if rounding not in ("floor", "ceil"):
        raise ValueError(f"rounding={rounding!r} must be 'floor' or 'ceil'.")
    if isinstance(length, int):
        return (num * length) // den if rounding == "floor" else -((-num * length) // den)
    length = jnp.asarray(length).astype(jnp.int32)
    # length·num/den split as (length // den)·num + (length % den)·num/den: no int32 overflow.
    whole = (length // den) * num
    rest = (length % den) * num
    if rounding == "floor":
        return whole + rest // den
    return whole + (rest + den - 1) // den


def sparsity_k(mask: jax.Array, alpha: float) -> jax.Array:
    """k = ⌈α·m⌉ of §3.2 per sequence, m = number of real tokens in ``mask [..., m]``. Returns int32."""
    return ratio_count(alpha, jnp.sum(mask, axis=-1), "ceil", name="alpha")


def _check_solver_args(epsilon: float, num_iters: int, init: str) -> None:
    if not isinstance(epsilon, int | float) or not epsilon > 0:
        raise ConfigError(f"epsilon={epsilon!r} must be a Python float > 0 (ε of Eq. 4 / Eq. 9).")
    if not isinstance(num_iters, int) or num_iters < 0:
        raise ConfigError(f"num_iters={num_iters!r} must be a Python int >= 0 (Eq. 5 updates).")
    if init not in LP_INITS:
        raise ConfigError(f"init={init!r} is not one of {LP_INITS} (initialisation of Eq. 5).")
    if init != "exact" and num_iters < 1:
        raise ConfigError(
            f"init={init!r} needs num_iters >= 1 Eq. 5 updates (got {num_iters}); about 2,000–4,000 "
            "are needed to converge at epsilon=0.002 from init='zero', 200–500 from 'threshold'. "
            "Use init='exact' for the converged solution with num_iters=0."
        )


def _sort_desc(s: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Stable descending order of the real entries (padding last, as −inf) and the sorted values."""
    order = jnp.argsort(jnp.where(mask, -s, jnp.inf), axis=-1, stable=True)
    return order, jnp.take_along_axis(jnp.where(mask, s, -jnp.inf), order, axis=-1)


def _exact_dual(s, k, mask, epsilon):
    """Closed-form fixed point of Eq. 5: returns (a*, c* = number of tokens capped at λ = 1, order).

    For c tokens capped (the c largest scores), Σλ = k gives ``a_c = ε·ln(k − c) − ε·ln T_c`` with
    ``T_c = Σ_{i ≥ c} exp(s_(i)/ε)``. Since ``Σ_i min(1, e_i) ≤ c + Σ_{i ≥ c} e_i`` for every c, with
    equality at the true capped count, and Σλ increases with a, the solution is ``a* = max_c a_c``.
    """
    order, s_sorted = _sort_desc(s, mask)
    length = jnp.sum(mask, axis=-1)
    logits = jnp.where(jnp.isfinite(s_sorted), s_sorted / epsilon, _LOG_ZERO)
    suffix = jax.lax.cumlogsumexp(logits, axis=logits.ndim - 1, reverse=True)  # ln T_c
    capped = jnp.arange(s.shape[-1], dtype=s.dtype)
    k = k[..., None]
    valid = (capped < k) & (capped < length[..., None])
    free_mass = jnp.where(valid, k - capped, 1.0)
    candidates = jnp.where(valid, epsilon * jnp.log(free_mass) - epsilon * suffix, -jnp.inf)
    c_star = jnp.argmax(candidates, axis=-1)
    a = jnp.max(candidates, axis=-1)
    return jnp.where(jnp.isfinite(a), a, 0.0), c_star, order


def _free_weights(s_sorted, mask_sorted, a, c_star, epsilon):
    """exp((s_i + a)/ε) on the un-capped real tokens (sorted positions ≥ c*), 0 elsewhere."""
    position = jnp.arange(s_sorted.shape[-1])
    free = mask_sorted & (position >= c_star[..., None])
    z = jnp.where(free, s_sorted + a[..., None], 0.0)
    # z ≤ 0 on un-capped tokens up to rounding; the cap at ε only guards against overflow.
    return jnp.where(free, jnp.exp(jnp.minimum(z, epsilon) / epsilon), 0.0)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3,))
def _lp_dual_a(s, k, mask, epsilon):
    return _exact_dual(s, k, mask, epsilon)[0]


@_lp_dual_a.defjvp
def _lp_dual_a_jvp(epsilon, primals, tangents):
    """Implicit derivative of Σ_i min(1, exp((s_i + a)/ε)) = k:  da = (ε·dk − Σ_i u_i ds_i) / Σ_i u_i,

    with u_i = exp((s_i + a)/ε) on the un-capped tokens (Σ u = k − c* > 0) and 0 on capped ones.
    """
    s, k, mask = primals
    ds, dk, _ = tangents
    a, c_star, order = _exact_dual(s, k, mask, epsilon)
    s_sorted = jnp.take_along_axis(s, order, axis=-1)
    mask_sorted = jnp.take_along_axis(mask, order, axis=-1)
    u = _free_weights(s_sorted, mask_sorted, a, c_star, epsilon)
    total = jnp.sum(u, axis=-1)
    numer = epsilon * dk - jnp.sum(u * jnp.take_along_axis(ds, order, axis=-1), axis=-1)
    da = jnp.where(total > 0, numer / jnp.where(total > 0, total, 1.0), 0.0)
    return a, da


def _exact_gate(s, k, mask, epsilon):
    """λ at the exact solution: 1 on the c* capped tokens, exp((s_i + a*)/ε) on the others."""
    a = _lp_dual_a(s, k, mask, epsilon)
    _, c_star, order = jax.lax.stop_gradient(_exact_dual(s, k, mask, epsilon))
    rank = jnp.argsort(order, axis=-1)
    capped = rank < c_star[..., None]
    z = jnp.where(mask & ~capped, s + a[..., None], 0.0)
    free = jnp.exp(jnp.minimum(z, epsilon) / epsilon)
    # Rounding can leave an un-capped λ a few ulps above 1: clip the value, keep its gradient.
    free = free - jax.lax.stop_gradient(jnp.maximum(free - 1.0, 0.0))
    return jnp.where(mask, jnp.where(capped, 1.0, free), 0.0)


def _threshold_dual_a(s, k, mask):
    """Minus the ⌈k⌉-th largest real score (the hard top-k threshold)."""
    _, s_sorted = _sort_desc(s, mask)
    length = jnp.sum(mask, axis=-1)
    index = jnp.clip(jnp.ceil(k).astype(jnp.int32) - 1, 0, jnp.maximum(length - 1, 0))
    kth = jnp.take_along_axis(s_sorted, index[..., None], axis=-1)[..., 0]
    return jax.lax.stop_gradient(jnp.where(jnp.isfinite(kth), -kth, 0.0))


def entropic_top_k(
    s: jax.Array,
    mask: jax.Array,
    k,
    epsilon: float = DEFAULT_EPSILON,
    num_iters: int = DEFAULT_NUM_ITERS,
    init: str = DEFAULT_INIT,
) -> jax.Array:
    """Generic solver of the entropy-regularised LP (Eq. 4; Eq. 9 row-wise) by Eq. 5.

    ``max_λ sᵀλ + ε·H(λ)  s.t. Σ_i λ_i = k, λ_i ∈ [0, 1]`` over the real entries of each row.

    Args:
      s: scores ``[..., m]`` (salience scores for Eq. 4, a row of S for Eq. 9). Any real values.
      mask: ``[..., m]`` bool, True = real token. Padding gets λ = 0 and never counts.
      k: budget per row, broadcastable to ``s.shape[:-1]`` (int or float, may differ per row). It is
        clipped to [0, m] with m the row's real length (k ≥ m gives λ = 1 on all real tokens).
      epsilon: ε > 0, static.
      num_iters: Eq. 5 coordinate-descent updates after the initialisation, static.
      init: ``"exact"`` (closed-form fixed point with implicit gradient; default), ``"threshold"``
        (a at the hard top-k threshold, stop-gradient) or ``"zero"`` (the paper's a = b = 0).

    Returns:
      λ ``[..., m]`` in [0, 1], zero on padding; Σλ = k (up to float rounding for ``"exact"``, up to
      the convergence of Eq. 5 otherwise). Differentiable with finite gradients.
    """
    _check_solver_args(epsilon, num_iters, init)
    s = jnp.asarray(s)
    out_dtype = s.dtype if jnp.issubdtype(s.dtype, jnp.floating) else jnp.float32
    # The solver runs in at least float32: s/ε with ε = 0.002 needs the exponent range.
    s = s.astype(jnp.promote_types(out_dtype, jnp.float32))
    mask = jnp.broadcast_to(jnp.asarray(mask, bool), s.shape)
    s = jnp.where(mask, s, 0.0)
    length = jnp.sum(mask, axis=-1).astype(s.dtype)
    k = jnp.clip(jnp.broadcast_to(jnp.asarray(k, s.dtype), s.shape[:-1]), 0.0, length)
    active = k > 0  # rows with nothing to select (k = 0 or no real token) get λ = 0
    k_safe = jnp.where(active, k, 1.0)
    keep = mask & active[..., None]

    if init == "exact" and num_iters == 0:
        return jnp.where(keep, _exact_gate(s, k_safe, mask, epsilon), 0.0).astype(out_dtype)
    if init == "exact":
        a = _lp_dual_a(s, k_safe, mask, epsilon)
        b = jnp.minimum(-s - a[..., None], 0.0)
    elif init == "threshold":
        a = _threshold_dual_a(s, k_safe, mask)
        b = jnp.minimum(-s - a[..., None], 0.0)
    else:
        a = jnp.zeros(s.shape[:-1], s.dtype)
        b = jnp.zeros_like(s)

    log_k = jnp.log(k_safe)

    def update(carry, _):
        _, b = carry
        logits = jnp.where(mask, (s + b) / epsilon, _LOG_ZERO)
        a_new = epsilon * log_k - epsilon * jax.nn.logsumexp(logits, axis=-1)
        b_new = jnp.minimum(-s - a_new[..., None], 0.0)
        return (a_new, b_new), None

    (a, b), _ = jax.lax.scan(update, (a, b), None, length=num_iters)
    # λ = exp((s + b + a)/ε); s + b + a ≤ 0 in exact arithmetic, the min removes rounding above 0.
    exponent = jnp.where(keep, jnp.minimum(s + b + a[..., None], 0.0) / epsilon, -jnp.inf)
    return jnp.exp(exponent).astype(out_dtype)


def lp_gate(
    s: jax.Array,
    mask: jax.Array,
    alpha: float,
    epsilon: float = DEFAULT_EPSILON,
    num_iters: int = DEFAULT_NUM_ITERS,
    init: str = DEFAULT_INIT,
) -> jax.Array:
    """The sparse gate λ of Eq. 3, the solution of Eq. 4 with k = ⌈α·m⌉ per sequence (§3.2).

    Args:
      s: salience scores ``[..., m]`` (``ReLU(W·x + b)``, from the model's head).
      mask: ``[..., m]`` bool, True = real token.
      alpha: sparsity ratio α ∈ (0, 1] (paper: α^q = 0.5, α^d = 0.4), static.
      epsilon, num_iters, init: see ``entropic_top_k``.

    Returns:
      λ ``[..., m]`` ∈ [0, 1], zero on padding, Σλ = ⌈α·m⌉.
    """
    k = sparsity_k(jnp.broadcast_to(jnp.asarray(mask, bool), jnp.shape(s)), alpha)
    return entropic_top_k(s, mask, k, epsilon=epsilon, num_iters=num_iters, init=init)


def hard_top_k_mask(s: jax.Array, mask: jax.Array, k) -> jax.Array:
    """λ without the entropy term (the 'Hard' ablation of §4.3): 1 on the top-k real tokens.

    Ties are broken towards the earlier position. ``k`` broadcasts to ``s.shape[:-1]``. Returns a
    float mask ``[..., m]`` with min(k, m) ones per row (m = real length), zero on padding.
    """
    s = jnp.asarray(s)
    mask = jnp.broadcast_to(jnp.asarray(mask, bool), s.shape)
    order = jnp.argsort(jnp.where(mask, -s, jnp.inf), axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)
    k = jnp.broadcast_to(jnp.asarray(k), s.shape[:-1])
    return ((rank < k[..., None]) & mask).astype(s.dtype if s.dtype != bool else jnp.float32)


def unary_salience(
    s: jax.Array,
    mask: jax.Array,
    method: str = "lp",
    alpha: float = 0.4,
    epsilon: float = DEFAULT_EPSILON,
    num_iters: int = DEFAULT_NUM_ITERS,
    init: str = DEFAULT_INIT,
) -> jax.Array:
    """Unary salience u = λ·s (Eq. 3) and the ablations of §4.3 / Figure 6.

    Args:
      s: salience scores ``[..., m]`` = ``f(W·x + b)`` with f = ReLU, computed by the model's head.
      mask: ``[..., m]`` bool, True = real token.
      method: ``"lp"`` (λ from Eq. 4), ``"relu"`` (u = s, no gate), ``"hard_topk"`` (λ = exact
        top-⌈α·m⌉ mask), ``"l1"`` (u = s; the loss adds ``l1_penalty(u, mask)``), ``"none"``
        (u = 1 on every real token).
      alpha, epsilon, num_iters, init: the LP's parameters (used by ``"lp"``; α also by
        ``"hard_topk"``).

    Returns:
      u ``[..., m]``, zero on padding.
    """
    if method not in SALIENCE_METHODS:
        raise ConfigError(
            f"Unknown salience method {method!r}; valid methods are {SALIENCE_METHODS} "
            "(ALIGNER §3.2 and the ablations of §4.3)."
        )
    s = jnp.asarray(s)
    mask = jnp.broadcast_to(jnp.asarray(mask, bool), s.shape)
    s = jnp.where(mask, s, 0.0)
    if method == "none":
        return mask.astype(s.dtype)
    if method in ("relu", "l1"):
        return s
    if method == "hard_topk":
        return hard_top_k_mask(s, mask, sparsity_k(mask, alpha)) * s
    return lp_gate(s, mask, alpha, epsilon=epsilon, num_iters=num_iters, init=init) * s


def l1_penalty(u: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean |u_i| over the real tokens of each sequence (the 'L1' ablation of §4.3). Shape ``[...]``.

    The training loss adds ``coefficient · mean_batch(l1_penalty(u, mask))``; a sequence without real
    tokens contributes 0.
    """
    u = jnp.asarray(u)
    mask = jnp.broadcast_to(jnp.asarray(mask, bool), u.shape)
    total = jnp.sum(jnp.where(mask, jnp.abs(u), 0.0), axis=-1)
    count = jnp.sum(mask, axis=-1)
    return total / jnp.maximum(count, 1).astype(total.dtype)
