"""Sparse-alignment scoring: ALIGNER §2.2 (Eq. 1), §3 (Eq. 2), §3.1 and Appendix A.2 (Eq. 9).

Conventions (all functions): queries ``q [..., n, h]`` with ``q_mask [..., n]`` and documents
``d [..., m, h]`` with ``d_mask [..., m]`` (bool, True = real token). The similarity matrix is
``S [..., n, m]``; masks only need to broadcast against it (``q_mask[..., :, None]``,
``d_mask[..., None, :]``), so ``S [Q, C, n, m]`` from ``cross_similarity`` is scored with
``q_mask[:, None]`` and ``d_mask[None]``. Padding never takes part: a padded position never gets
alignment, never counts in the document length m, and arbitrary (even inf/NaN) values of S on
padded rows/columns never change a score.

Pipeline: pairwise alignment Ã (a strategy below) → A = Ã ⊙ (u^q ⊗ u^d) (Eq. 2) →
sim = Σ S⊙A / Σ A (Eq. 1), 0 where Σ A = 0.

Alignment strategies (``AlignmentStrategy.parse`` spellings, also used by gin flags such as
``--gin.<configurable>.alignment='top_k:8'``):

  ``top_k:K``                 top-K per query token (§3.1); ``top_k:1`` = ColBERT
  ``top_p:P`` / ``top_p:X%``  max(⌊P·m⌋, 1) per query token, m = real doc length (§3.1)
  ``colbert``                 top-1 (§2.2)
  ``dpr``                     A_{1,1} = 1 (§2.2)
  ``mebert:K``                first query token with the max of the first K doc tokens (§2.2)
  ``coil``                    per query token, the max over doc tokens with the same token id (§2.2)
  ``differentiable:k=K,epsilon=E[,num_iters=N]``  Eq. 9 (Appendix A.2), rows sum to K
"""

from __future__ import annotations

import dataclasses
import decimal
import math
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from aligner_jax.common.errors import ConfigError
from aligner_jax.core import salience as salience_lib

# ---------------------------------------------------------------------------------------------
# Similarity matrices
# ---------------------------------------------------------------------------------------------


def similarity_matrix(q: jax.Array, d: jax.Array) -> jax.Array:
    """S_ij = q_iᵀd_j (§2.2) for paired inputs: ``q [..., n, h]``, ``d [..., m, h]`` → ``[..., n, m]``.

    Leading dimensions broadcast against each other.
    """
    return jnp.einsum("...nh,...mh->...nm", q, d)


def cross_similarity(q: jax.Array, d: jax.Array) -> jax.Array:
    """S for every query against every document: ``q [Q, n, h]``, ``d [C, m, h]`` → ``[Q, C, n, m]``.

    Score it with masks ``q_mask[:, None]`` (``[Q, 1, n]``) and ``d_mask[None]`` (``[1, C, m]``).
    """
    if q.ndim != 3 or d.ndim != 3:
        raise ValueError(
            f"cross_similarity expects q [Q, n, h] and d [C, m, h]; got {q.shape} and {d.shape}."
        )
    s = jnp.einsum("qnh,cmh->qcnm", q, d)
    return nn.with_logical_constraint(s, ("batch", None, "length", None))


# ---------------------------------------------------------------------------------------------
# Eq. 1 and Eq. 2
# ---------------------------------------------------------------------------------------------


# Floor of the normaliser Z in Eq. 1. With learned saliences (the LP gate of Eq. 4 puts weights
# like exp(-500) on unselected tokens) Z can be positive but tiny; dividing by it is
# ill-conditioned (the gradient s/Z - num/Z² overflows to inf - inf = NaN). Below the floor the
# score goes smoothly to 0, as it is when nothing is aligned (Z = 0).
MIN_NORMALIZER = 1e-6


def normalized(numerator: jax.Array, z: jax.Array) -> jax.Array:
    """numerator / Z of Eq. 1 with Z floored at ``MIN_NORMALIZER`` (0 when Z = 0)."""
    return numerator / jnp.maximum(z, MIN_NORMALIZER)


def aggregate(s: jax.Array, a: jax.Array) -> jax.Array:
    """sim(Q, D) = Σ_ij S_ij·A_ij / Σ_ij A_ij (Eq. 1, Z = Σ A); 0 where Σ A = 0.

    Entries of S where A = 0 are never read (they may be inf or NaN). Reduces the last two axes.
    Z is floored at ``MIN_NORMALIZER`` for finite gradients (see there).
    """
    a = jnp.asarray(a)
    s = jnp.where(a != 0, s, 0.0)
    numerator = jnp.sum(s * a, axis=(-2, -1))
    z = jnp.sum(a, axis=(-2, -1))
    return normalized(numerator, z)


def factorized_alignment(
    pairwise: jax.Array, u_q: jax.Array | None = None, u_d: jax.Array | None = None
) -> jax.Array:
    """A = Ã ⊙ (u^q ⊗ u^d) (Eq. 2). ``pairwise [..., n, m]``, ``u_q [..., n]``, ``u_d [..., m]``.

    A missing salience is 1 on every token; since Ã is zero on padding this equals passing the mask.
    """
    a = jnp.asarray(pairwise)
    if u_q is not None:
        a = a * jnp.asarray(u_q)[..., :, None]
    if u_d is not None:
        a = a * jnp.asarray(u_d)[..., None, :]
    return a


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------

KINDS = ("top_k", "top_p", "colbert", "dpr", "mebert", "coil", "differentiable")
TOPK_FAMILY = ("top_k", "top_p", "colbert")
DEFAULT_DA_NUM_ITERS = 0

VALID_FORMS = (
    "top_k:<int K >= 1> (e.g. top_k:8), "
    "top_p:<fraction in (0, 1]> or top_p:<percent>% (e.g. top_p:0.005 or top_p:0.5%), "
    "colbert, dpr, mebert:<int K >= 1> (e.g. mebert:8), coil, "
    "differentiable:k=<int K >= 1>,epsilon=<float > 0>[,num_iters=<int >= 0>] "
    "(e.g. differentiable:k=1,epsilon=0.01)"
)


def _format_float(x: float) -> str:
    return repr(float(x))


@dataclasses.dataclass(frozen=True)
class AlignmentStrategy:
    """A pairwise alignment strategy Ã (§2.2, §3.1, A.2). Hashable: usable as a jit static arg.

    Attributes:
      kind: one of ``KINDS``.
      k: K of ``top_k`` / ``mebert`` / ``differentiable`` (row sum); None otherwise.
      p: the ratio of ``top_p`` (0.005 = 0.5 %); None otherwise.
      epsilon: ε of ``differentiable`` (Eq. 9); None otherwise.
      num_iters: Eq. 5 updates after the exact initialisation for ``differentiable`` (see
        ``salience.entropic_top_k``); None otherwise.
    """

    kind: str
    k: int | None = None
    p: float | None = None
    epsilon: float | None = None
    num_iters: int | None = None

    def __post_init__(self):
        fields = {"k": self.k, "p": self.p, "epsilon": self.epsilon, "num_iters": self.num_iters}
        needed = {
            "top_k": ("k",),
            "top_p": ("p",),
            "colbert": (),
            "dpr": (),
            "mebert": ("k",),
            "coil": (),
            "differentiable": ("k", "epsilon", "num_iters"),
        }
        if self.kind not in needed:
            raise ConfigError(f"Unknown alignment kind {self.kind!r}; valid forms: {VALID_FORMS}.")
        for name, value in fields.items():
            if name in needed[self.kind] and value is None:
                raise ConfigError(
                    f"Alignment {self.kind!r} needs {name}; valid forms: {VALID_FORMS}."
                )
            if name not in needed[self.kind] and value is not None:
                raise ConfigError(
                    f"Alignment {self.kind!r} takes no {name} (got {value!r}); "
                    f"valid forms: {VALID_FORMS}."
                )
        if self.k is not None and (
            not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1
        ):
            raise ConfigError(f"Alignment {self.kind!r}: k={self.k!r} must be an int >= 1.")
        if self.p is not None:
            if not isinstance(self.p, int | float) or not 0.0 < self.p <= 1.0:
                raise ConfigError(f"Alignment 'top_p': p={self.p!r} must be a fraction in (0, 1].")
            object.__setattr__(self, "p", float(self.p))
        if self.epsilon is not None:
            if not isinstance(self.epsilon, int | float) or not self.epsilon > 0:
                raise ConfigError(f"Alignment {self.kind!r}: epsilon={self.epsilon!r} must be > 0.")
            object.__setattr__(self, "epsilon", float(self.epsilon))
        if self.num_iters is not None and (
            not isinstance(self.num_iters, int) or self.num_iters < 0
        ):
            raise ConfigError(
                f"Alignment {self.kind!r}: num_iters={self.num_iters!r} must be an int >= 0."
            )

    # Convenience constructors.
    @classmethod
    def top_k(cls, k: int) -> AlignmentStrategy:
        return cls("top_k", k=k)

    @classmethod
    def top_p(cls, p: float) -> AlignmentStrategy:
        return cls("top_p", p=p)

    @classmethod
    def parse(cls, spec: str | AlignmentStrategy) -> AlignmentStrategy:
        """Parses a spelling listed in the module docstring (case and spaces are ignored).

        ``str(AlignmentStrategy.parse(s))`` is the canonical spelling (``top_p:0.5%`` → ``top_p:0.005``)
        and ``parse(str(x)) == x``. Raises ValueError naming the spec and listing the valid forms.
        """
        if isinstance(spec, AlignmentStrategy):
            return spec
        if not isinstance(spec, str):
            raise ConfigError(
                f"Alignment strategy {spec!r} must be a string; valid forms: {VALID_FORMS}."
            )
        try:
            return cls._parse_text(re.sub(r"\s+", "", spec).lower())
        except ValueError as error:
            raise ConfigError(
                f"Invalid alignment strategy {spec!r}: {error}. Valid forms: {VALID_FORMS}."
            ) from None

    @classmethod
    def _parse_text(cls, text: str) -> AlignmentStrategy:
        kind, _, arg = text.partition(":")
        if kind in ("colbert", "dpr", "coil"):
            if arg:
                raise ValueError(f"{kind!r} takes no argument")
            return cls(kind)
        if kind in ("top_k", "mebert"):
            if not re.fullmatch(r"[0-9]+", arg):
                raise ValueError(f"{kind!r} needs a positive integer, as in {kind}:8")
            return cls(kind, k=int(arg))
        if kind == "top_p":
            percent = arg.endswith("%")
            number = arg[:-1] if percent else arg
            if not re.fullmatch(r"[0-9]*\.?[0-9]+(e-?[0-9]+)?", number):
                raise ValueError(
                    "'top_p' needs a fraction (top_p:0.005) or a percentage (top_p:0.5%)"
                )
            value = decimal.Decimal(number)
            return cls("top_p", p=float(value / 100 if percent else value))
        if kind == "differentiable":
            fields = {}
            for item in arg.split(","):
                name, eq, value = item.partition("=")
                if not eq or name not in ("k", "epsilon", "num_iters") or name in fields:
                    raise ValueError(f"bad or repeated field {item!r}")
                fields[name] = value
            if "k" not in fields or "epsilon" not in fields:
                raise ValueError("'differentiable' needs k=<int> and epsilon=<float>")
            num_iters = fields.get("num_iters", str(DEFAULT_DA_NUM_ITERS))
            if not re.fullmatch(r"[0-9]+", fields["k"]) or not re.fullmatch(r"[0-9]+", num_iters):
                raise ValueError("k and num_iters must be non-negative integers")
            epsilon = float(fields["epsilon"])  # ValueError names the bad value
            if not math.isfinite(epsilon):
                raise ValueError("epsilon must be finite")
            return cls(
                "differentiable", k=int(fields["k"]), epsilon=epsilon, num_iters=int(num_iters)
            )
        raise ValueError(f"unknown kind {kind!r}")

    def __str__(self) -> str:
        if self.kind in ("top_k", "mebert"):
            return f"{self.kind}:{self.k}"
        if self.kind == "top_p":
            return f"top_p:{_format_float(self.p)}"
        if self.kind == "differentiable":
            text = f"differentiable:k={self.k},epsilon={_format_float(self.epsilon)}"
            if self.num_iters != DEFAULT_DA_NUM_ITERS:
                text += f",num_iters={self.num_iters}"
            return text
        return self.kind

    def count(self, length):
        """Alignments per query token for the top-k family given the real doc length (int or array).

        top_k: min(K, m); top_p: min(max(⌊p·m⌋, 1), m); colbert: min(1, m). Zero when m = 0.
        """
        if self.kind not in TOPK_FAMILY:
            raise ValueError(f"count() is defined for {TOPK_FAMILY}, not {self.kind!r}.")
        if self.kind == "top_p":
            per_token = salience_lib.ratio_count(self.p, length, "floor", name="top_p p")
            if isinstance(length, int):
                return min(max(per_token, 1), length)
            return jnp.minimum(jnp.maximum(per_token, 1), length)
        k = 1 if self.kind == "colbert" else self.k
        if isinstance(length, int):
            return min(k, length)
        return jnp.minimum(k, jnp.asarray(length).astype(jnp.int32))


def canonical_name(strategy: str | AlignmentStrategy) -> str:
    """The canonical spelling of a strategy (``top_p:0.5%`` → ``top_p:0.005``): result keys."""
    return str(AlignmentStrategy.parse(strategy))


# ---------------------------------------------------------------------------------------------
# Pairwise alignments Ã (same shape as S, zeros on padding)
# ---------------------------------------------------------------------------------------------


def _pair_masks(s, q_mask, d_mask):
    """Broadcast masks: (q [..., n], d [..., m], pair [..., n, m]) matching ``s [..., n, m]``."""
    s = jnp.asarray(s)
    q_mask = jnp.asarray(q_mask, bool)
    d_mask = jnp.asarray(d_mask, bool)
    pair = jnp.broadcast_to(q_mask[..., :, None] & d_mask[..., None, :], s.shape)
    q_full = jnp.broadcast_to(q_mask, s.shape[:-1])
    d_full = jnp.broadcast_to(d_mask, s.shape[:-2] + s.shape[-1:])
    return q_full, d_full, pair


def _selection_scores(s, eligible):
    """S on eligible pairs and −inf elsewhere, for ranking doc tokens within a row."""
    return jnp.where(eligible, s, -jnp.inf)


def _ranked_alignment(s, eligible, max_count: int, count):
    """Ã with ones on the ``count`` (per row, ≤ max_count) largest eligible S_ij of each row.

    ``eligible [..., n, m]`` marks the pairs a row may align with; rows with fewer eligible pairs
    than ``count`` align all of them. Ties go to the earlier token (``lax.top_k`` order).
    """
    max_count = min(max_count, s.shape[-1])
    zeros = jnp.zeros(s.shape, jnp.result_type(s.dtype, jnp.float32))
    if max_count == 0:
        return zeros
    _, index = jax.lax.top_k(_selection_scores(s, eligible), max_count)
    rank = jnp.arange(max_count)
    selected = (rank < count[..., None]) & jnp.take_along_axis(eligible, index, axis=-1)
    return jnp.put_along_axis(zeros, index, selected.astype(zeros.dtype), axis=-1, inplace=False)


def _real_length(s, d_mask):
    """Real doc length m for every row of ``s [..., n, m]``: ``[..., n]`` int32."""
    d_full = jnp.broadcast_to(jnp.asarray(d_mask, bool), s.shape[:-2] + s.shape[-1:])
    return jnp.broadcast_to(jnp.sum(d_full, axis=-1)[..., None], s.shape[:-1]).astype(jnp.int32)


def top_k_alignment(s: jax.Array, q_mask: jax.Array, d_mask: jax.Array, k: int) -> jax.Array:
    """Top-k (§3.1): Ã_ij = 1 if j is among the k largest S_ij of row i over real doc tokens.

    Rows of documents with m < k align all m tokens; ties go to the earlier token. k is static.
    """
    s = jnp.asarray(s)
    _, _, pair = _pair_masks(s, q_mask, d_mask)
    count = AlignmentStrategy.top_k(k).count(_real_length(s, d_mask))
    return _ranked_alignment(s, pair, k, count)


def top_p_alignment(s: jax.Array, q_mask: jax.Array, d_mask: jax.Array, p: float) -> jax.Array:
    """Top-p (§3.1): each query token aligns with max(⌊p·m⌋, 1) tokens, m = the doc's real length.

    p is a static fraction (0.005 = 0.5 %); ⌊p·m⌋ is computed exactly in integer arithmetic.
    """
    s = jnp.asarray(s)
    _, _, pair = _pair_masks(s, q_mask, d_mask)
    strategy = AlignmentStrategy.top_p(p)
    count = strategy.count(_real_length(s, d_mask))
    return _ranked_alignment(s, pair, strategy.count(s.shape[-1]), count)


def colbert_alignment(s: jax.Array, q_mask: jax.Array, d_mask: jax.Array) -> jax.Array:
    """ColBERT (§2.2): the maximum of each row of S, i.e. top-1."""
    return top_k_alignment(s, q_mask, d_mask, 1)


def dpr_alignment(s: jax.Array, q_mask: jax.Array, d_mask: jax.Array) -> jax.Array:
    """DPR (§2.2): A_{1,1} = 1 (first query token with first doc token) and 0 otherwise.

    Zero if either first position is padding.
    """
    s = jnp.asarray(s)
    _, _, pair = _pair_masks(s, q_mask, d_mask)
    n, m = s.shape[-2:]
    first = (jnp.arange(n)[:, None] == 0) & (jnp.arange(m)[None, :] == 0)
    return (pair & first).astype(jnp.result_type(s.dtype, jnp.float32))


def mebert_alignment(s: jax.Array, q_mask: jax.Array, d_mask: jax.Array, k: int) -> jax.Array:
    """ME-BERT (§2.2): A_{1,j} = 1 for j = argmax of S_{1,1..k} (real doc tokens); 0 otherwise."""
    s = jnp.asarray(s)
    _, _, pair = _pair_masks(s, q_mask, d_mask)
    n, m = s.shape[-2:]
    window = (jnp.arange(n)[:, None] == 0) & (jnp.arange(m)[None, :] < k)
    return _ranked_alignment(s, pair & window, 1, jnp.ones(s.shape[:-1], jnp.int32))


def coil_alignment(
    s: jax.Array, q_mask: jax.Array, d_mask: jax.Array, q_ids: jax.Array, d_ids: jax.Array
) -> jax.Array:
    """COIL (§2.2): per query token, the max of S over doc tokens with the same token id.

    ``q_ids [..., n]`` and ``d_ids [..., m]`` are vocabulary ids. A row with no exact match aligns
    nothing.
    """
    s = jnp.asarray(s)
    _, _, pair = _pair_masks(s, q_mask, d_mask)
    q_ids = jnp.asarray(q_ids)
    d_ids = jnp.asarray(d_ids)
    match = jnp.broadcast_to(q_ids[..., :, None] == d_ids[..., None, :], s.shape) & pair
    return _ranked_alignment(s, match, 1, jnp.ones(s.shape[:-1], jnp.int32))


def differentiable_alignment(
    s: jax.Array,
    q_mask: jax.Array,
    d_mask: jax.Array,
    k: int,
    epsilon: float,
    num_iters: int = DEFAULT_DA_NUM_ITERS,
    init: str = salience_lib.DEFAULT_INIT,
) -> jax.Array:
    """Differentiable alignment (Appendix A.2, Eq. 9): each row of Ã solves

    ``max ⟨S_i, Ã_i⟩ + ε·H(Ã_i)  s.t. Σ_j Ã_ij = k, Ã_ij ∈ [0, 1]``

    over the real doc tokens, with the solver of Eq. 5 (``salience.entropic_top_k``; k is capped at
    the real length m). Padded query rows are zero. Tends to top-k as ε → 0.
    """
    q_mask, _, pair = _pair_masks(s, q_mask, d_mask)
    s = jnp.where(pair, s, 0.0)
    k_rows = jnp.where(q_mask, float(k), 0.0)
    return salience_lib.entropic_top_k(
        s, pair, k_rows, epsilon=epsilon, num_iters=num_iters, init=init
    )


def pairwise_alignment(
    s: jax.Array,
    q_mask: jax.Array,
    d_mask: jax.Array,
    strategy: str | AlignmentStrategy,
    q_ids: jax.Array | None = None,
    d_ids: jax.Array | None = None,
) -> jax.Array:
    """Ã for any strategy (dispatch on ``strategy.kind``)."""
    strategy = AlignmentStrategy.parse(strategy)
    kind = strategy.kind
    if kind == "top_k":
        return top_k_alignment(s, q_mask, d_mask, strategy.k)
    if kind == "top_p":
        return top_p_alignment(s, q_mask, d_mask, strategy.p)
    if kind == "colbert":
        return colbert_alignment(s, q_mask, d_mask)
    if kind == "dpr":
        return dpr_alignment(s, q_mask, d_mask)
    if kind == "mebert":
        return mebert_alignment(s, q_mask, d_mask, strategy.k)
    if kind == "coil":
        if q_ids is None or d_ids is None:
            raise ValueError("Alignment 'coil' needs the token ids: pass q_ids and d_ids.")
        return coil_alignment(s, q_mask, d_mask, q_ids, d_ids)
    return differentiable_alignment(
        s, q_mask, d_mask, strategy.k, strategy.epsilon, strategy.num_iters
    )


def _masked_salience(u, mask, shape):
    if u is None:
        return None
    return jnp.where(jnp.broadcast_to(mask, shape), jnp.broadcast_to(jnp.asarray(u), shape), 0.0)


def alignment_scores(
    s: jax.Array,
    q_mask: jax.Array,
    d_mask: jax.Array,
    strategy: str | AlignmentStrategy,
    u_q: jax.Array | None = None,
    u_d: jax.Array | None = None,
    q_ids: jax.Array | None = None,
    d_ids: jax.Array | None = None,
) -> jax.Array:
    """sim(Q, D) (Eq. 1) with A = Ã ⊙ (u^q ⊗ u^d) (Eq. 2) for every leading index of ``s``.

    Args:
      s: ``[..., n, m]`` similarity matrices.
      q_mask, d_mask: ``[..., n]`` / ``[..., m]`` masks broadcasting against s.
      strategy: an ``AlignmentStrategy`` or its spelling (static under jit).
      u_q, u_d: unary saliences ``[..., n]`` / ``[..., m]`` (default 1 on real tokens); values on
        padding are ignored.
      q_ids, d_ids: token ids, needed by ``coil`` only.

    Returns:
      ``s.shape[:-2]`` scores; 0 where nothing is aligned.
    """
    s = jnp.asarray(s)
    q_full, d_full, pair = _pair_masks(s, q_mask, d_mask)
    s = jnp.where(pair, s, 0.0)
    pairwise = pairwise_alignment(s, q_full, d_full, strategy, q_ids, d_ids)
    u_q = _masked_salience(u_q, q_full, q_full.shape)
    u_d = _masked_salience(u_d, d_full, d_full.shape)
    return aggregate(s, factorized_alignment(pairwise, u_q, u_d))


# ---------------------------------------------------------------------------------------------
# Fast path: many top-k / top-p strategies from one top-k
# ---------------------------------------------------------------------------------------------


def topk_family_scores(
    s: jax.Array,
    q_mask: jax.Array,
    d_mask: jax.Array,
    strategies: Sequence[str | AlignmentStrategy],
    u_q: jax.Array | None = None,
    u_d: jax.Array | None = None,
) -> jax.Array:
    """Eq. 1–2 scores of several top-k / top-p / colbert strategies from ONE ``lax.top_k``.

    Used by refinement and few-shot alignment adaptation (§3.1), where thousands of candidates are
    re-scored with many strategies. With M the padded doc length, one ``jax.lax.top_k`` with
    K = max over strategies of their count at length M (top-p: max(⌊p·M⌋, 1)) sorts each row of S;
    each strategy then keeps the first ``count(m)`` ranks of a row (m = real length) and computes
    ``Σ u^q_i u^d_j S_ij / Σ u^q_i u^d_j`` over them, with u^d gathered at the selected tokens.
    Selection is by S alone; saliences only weight the selected entries. Equals
    ``alignment_scores`` for each strategy (up to float summation order).

    Args:
      s, q_mask, d_mask, u_q, u_d: as for ``alignment_scores``.
      strategies: a static sequence of strategies (or spellings) of kind top_k, top_p or colbert.

    Returns:
      ``[len(strategies), *s.shape[:-2]]``.
    """
    strategies = tuple(AlignmentStrategy.parse(x) for x in strategies)
    if not strategies:
        raise ValueError("topk_family_scores needs at least one strategy.")
    for strategy in strategies:
        if strategy.kind not in TOPK_FAMILY:
            raise ValueError(
                f"topk_family_scores handles top_k, top_p and colbert only, not {str(strategy)!r}; "
                "score it with alignment_scores."
            )
    s = jnp.asarray(s)
    q_full, d_full, pair = _pair_masks(s, q_mask, d_mask)
    padded_length = s.shape[-1]
    max_count = max(strategy.count(padded_length) for strategy in strategies)
    out_dtype = jnp.result_type(s.dtype, jnp.float32)
    if max_count == 0:
        return jnp.zeros((len(strategies),) + s.shape[:-2], out_dtype)

    selection = _selection_scores(s, pair)
    if max_count == 1:  # top-1 (ColBERT): a max/argmax reduction, much cheaper than a sort
        index = jnp.argmax(selection, axis=-1)[..., None]
        values = jnp.take_along_axis(selection, index, axis=-1)
    else:
        values, index = jax.lax.top_k(selection, max_count)  # [..., n, K]
    weight = jnp.broadcast_to(q_full[..., None], values.shape).astype(out_dtype)
    if u_q is not None:
        weight = weight * _masked_salience(u_q, q_full, q_full.shape)[..., None]
    if u_d is not None:
        u_d_rows = jnp.broadcast_to(
            _masked_salience(u_d, d_full, d_full.shape)[..., None, :], s.shape
        )
        weight = weight * jnp.take_along_axis(u_d_rows, index, axis=-1)
    length = jnp.sum(d_full, axis=-1)  # [...]
    rank = jnp.arange(max_count)
    scores = []
    for strategy in strategies:
        count = strategy.count(length)[..., None, None]  # [..., 1, 1]
        w = jnp.where(rank < count, weight, 0.0)
        selected = jnp.where(w != 0, values, 0.0)
        numerator = jnp.sum(selected * w, axis=(-2, -1))
        scores.append(normalized(numerator, jnp.sum(w, axis=(-2, -1))))
    return jnp.stack(scores)
