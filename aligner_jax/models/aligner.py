"""The ALIGNER encoder: one shared backbone, a projection to token vectors, unary salience heads.

For a tokenised text (query or document) the encoder returns

  * token vectors ``q_i`` / ``d_j``: the backbone's last hidden states, projected (``dense``: a
    learned ``embed → 128`` map, paper §4.1; ``identity``: the backbone's own vectors) and
    L2-normalised; exactly zero on padding;
  * unary saliences ``u_i = λ_i · ReLU(W·h_i + b)`` (Eq. 3), with separate heads for queries and
    documents and the sparsity gate λ of Eq. 4–5 (``lp``), or an ablation of §4.3 (``relu``,
    ``hard_topk``, ``l1``), or ``none`` (u = 1 on every real token: plain multi-vector retrieval,
    the zero-shot setting before any salience is trained). ``h_i`` is the backbone hidden state.

The backbone is any module with the call signature ``(input_ids, mask, deterministic=...) ->
hidden [B, L, H]``: :class:`~aligner_jax.models.bert.BertEncoder` or
:class:`~aligner_jax.models.t5.T5Encoder`, chosen by the type of ``AlignerConfig.backbone``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gin
import jax
import jax.numpy as jnp
from flax import linen as nn

from aligner_jax.common import checks
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import salience as salience_lib
from aligner_jax.models import bert, t5

PROJECTIONS = ("identity", "dense")
SALIENCE_METHODS = salience_lib.SALIENCE_METHODS
QUERY, DOC = "query", "doc"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class AlignerConfig:
    """Architecture of an ALIGNER encoder (bind in gin: ``AlignerConfig.projection = 'dense'``).

    Attributes:
      backbone: a ``BertConfig`` or ``T5Config``.
      projection: ``dense`` (learned, ``projection_dim``) or ``identity`` (backbone vectors).
      projection_dim: token vector size for ``dense`` (paper: 128).
      salience: ``lp`` (Eq. 3–5), ``relu``, ``hard_topk``, ``l1`` (ablations) or ``none``.
      alpha_q, alpha_d: sparsity ratios of the LP gate, k = ceil(α·m) (paper: 50%, 40%).
      epsilon: entropy weight ε of Eq. 4 (paper: 0.002).
      lp_iters: iterations of Eq. 5 applied after the solver's exact initialisation at the
        fixed point (see ``salience.entropic_top_k``; the paper's zero initialisation needs
        thousands of iterations at ε = 0.002 to reach Σλ = k).
      lp_init: ``exact`` (default), ``threshold`` (hard top-k threshold) or ``zero`` (the
        paper's a = b = 0) initialisation of the Eq. 5 iterations.
      query_maxlen, doc_maxlen: token budgets (defaults 64 and 256).
      dtype: activation (compute) dtype of the backbone, ``float32`` or ``bfloat16``;
        parameters stay float32 and token vectors / saliences are computed in float32.
    """

    backbone: Any = None
    projection: str = "dense"
    projection_dim: int = 128
    salience: str = "lp"
    alpha_q: float = 0.5
    alpha_d: float = 0.4
    epsilon: float = 0.002
    lp_iters: int = 2
    lp_init: str = "exact"
    query_maxlen: int = 64
    doc_maxlen: int = 256
    dtype: str = "float32"

    def __post_init__(self):
        if self.projection not in PROJECTIONS:
            raise ConfigError(
                f"AlignerConfig.projection={self.projection!r}: choose one of {PROJECTIONS}"
            )
        if self.salience not in SALIENCE_METHODS:
            raise ConfigError(
                f"AlignerConfig.salience={self.salience!r}: choose one of {SALIENCE_METHODS}"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"AlignerConfig.dtype={self.dtype!r}: choose 'float32' or 'bfloat16'")
        for name in ("alpha_q", "alpha_d"):
            checks.number(f"AlignerConfig.{name}", getattr(self, name), 0.0, 1.0, low_open=True)
        checks.integer("AlignerConfig.projection_dim", self.projection_dim, minimum=1)
        checks.number("AlignerConfig.epsilon", self.epsilon, 0.0, low_open=True)
        checks.integer("AlignerConfig.lp_iters", self.lp_iters, minimum=0)
        checks.choice("AlignerConfig.lp_init", self.lp_init, salience_lib.LP_INITS)
        checks.integer("AlignerConfig.query_maxlen", self.query_maxlen, minimum=1)
        checks.integer("AlignerConfig.doc_maxlen", self.doc_maxlen, minimum=1)

    @property
    def output_dim(self) -> int:
        if self.projection == "dense":
            return self.projection_dim
        return backbone_hidden_size(self.backbone)

    def maxlen(self, kind: str) -> int:
        return self.query_maxlen if kind == QUERY else self.doc_maxlen


def backbone_max_length(backbone_config) -> int:
    """The longest input the backbone takes: BERT's position table (512); T5's relative
    positions have no table, so its pre-training length, 512."""
    return int(getattr(backbone_config, "max_position_embeddings", 512))


def backbone_hidden_size(backbone_config) -> int:
    for attr in ("hidden_size", "emb_dim"):
        if hasattr(backbone_config, attr):
            return int(getattr(backbone_config, attr))
    raise TypeError(f"unknown backbone config {type(backbone_config).__name__}")


def build_backbone(backbone_config, dtype: str = "float32", name: str = "backbone") -> nn.Module:
    """The backbone module for a ``BertConfig`` or ``T5Config``, computing in ``dtype``."""
    if isinstance(backbone_config, bert.BertConfig):
        return bert.BertEncoder(backbone_config, dtype=jnp.dtype(dtype), name=name)
    if isinstance(backbone_config, t5.T5Config):
        if backbone_config.dtype != dtype:
            backbone_config = dataclasses.replace(backbone_config, dtype=dtype)
        return t5.T5Encoder(backbone_config, name=name)
    raise TypeError(
        f"AlignerConfig.backbone: expected a BertConfig or T5Config, got "
        f"{type(backbone_config).__name__} (bind BACKBONE in a gin model file)"
    )


def l2_normalize(x: jax.Array, mask: jax.Array, eps: float = 1e-12) -> jax.Array:
    """x / ||x|| on real tokens, 0 on padding; NaN-free gradients even for all-zero vectors."""
    x = jnp.where(mask[..., None], x.astype(jnp.float32), 0.0)
    sum_sq = jnp.sum(x * x, axis=-1, keepdims=True)
    # max() inside the sqrt: the gradient of sqrt at 0 is infinite (and 0 · inf = NaN).
    return x * jax.lax.rsqrt(jnp.maximum(sum_sq, eps * eps))


class SalienceHead(nn.Module):
    """s_i = ReLU(W·h_i + b): the pre-gate token score of Eq. 3."""

    @nn.compact
    def __call__(self, hidden: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", "salience")),
            (hidden.shape[-1], 1),
            jnp.float32,
        )
        # Start positive so every token is initially salient and gradients flow through ReLU.
        bias = self.param(
            "bias", nn.with_logical_partitioning(nn.initializers.ones, ("salience",)), (1,)
        )
        logits = jnp.einsum("...h,hs->...s", hidden.astype(jnp.float32), kernel) + bias
        return jax.nn.relu(logits[..., 0])


class AlignerEncoder(nn.Module):
    """Shared encoder → (token vectors [B, L, D] float32, unary salience u [B, L] float32)."""

    config: AlignerConfig

    def setup(self):
        cfg = self.config
        self.backbone = build_backbone(cfg.backbone, cfg.dtype)
        if cfg.projection == "dense":
            self.projection = nn.DenseGeneral(
                cfg.projection_dim,
                use_bias=False,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal"),
                    ("embed", "proj"),
                ),
                name="projection",
            )
        if cfg.salience != "none":
            self.query_salience = SalienceHead(name="query_salience")
            self.doc_salience = SalienceHead(name="doc_salience")

    def __call__(
        self, input_ids: jax.Array, mask: jax.Array, kind: str = DOC, deterministic: bool = True
    ) -> tuple[jax.Array, jax.Array]:
        if kind not in (QUERY, DOC):
            raise ValueError(f"kind={kind!r}: expected 'query' or 'doc'")
        cfg = self.config
        mask = mask.astype(bool)
        hidden = self.backbone(input_ids, mask, deterministic=deterministic)
        if cfg.projection == "dense":
            vectors = self.projection(hidden.astype(jnp.float32))
        else:
            vectors = hidden
        vectors = nn.with_logical_constraint(
            l2_normalize(vectors, mask), ("batch", "length", "proj")
        )
        if cfg.salience == "none":
            return vectors, mask.astype(jnp.float32)
        head = self.query_salience if kind == QUERY else self.doc_salience
        scores = head(hidden)
        alpha = cfg.alpha_q if kind == QUERY else cfg.alpha_d
        u = salience_lib.unary_salience(
            scores,
            mask,
            method=cfg.salience,
            alpha=alpha,
            epsilon=cfg.epsilon,
            num_iters=cfg.lp_iters,
            init=cfg.lp_init,
        )
        return vectors, jnp.where(mask, u, 0.0)

    def encode_both(self, q_ids, q_mask, d_ids, d_mask, deterministic: bool = True):
        """Encodes queries and documents (used by ``init`` so every head gets parameters)."""
        return (
            self(q_ids, q_mask, QUERY, deterministic),
            self(d_ids, d_mask, DOC, deterministic),
        )


def init_boxed_params(config: AlignerConfig, rng: jax.Array):
    """Freshly initialised parameters, boxed (``nn.LogicallyPartitioned``: logical axis names)."""
    module = AlignerEncoder(config)
    ids = jnp.ones((1, 4), jnp.int32)
    mask = jnp.ones((1, 4), bool)
    return module.init(rng, ids, mask, ids, mask, method=module.encode_both)["params"]


def _init_unboxed(config: AlignerConfig):
    return lambda rng: nn.meta.unbox(init_boxed_params(config, rng))


def init_params(config: AlignerConfig, seed: int = 0):
    """Freshly initialised (unboxed) parameters of an ALIGNER encoder."""
    return jax.jit(_init_unboxed(config))(jax.random.PRNGKey(seed))


def _one_layer(backbone_config):
    """The backbone with a single layer: the same output width, a far smaller program."""
    field = "num_hidden_layers" if isinstance(backbone_config, bert.BertConfig) else "num_layers"
    return dataclasses.replace(backbone_config, **{field: 1})


def init_head_params(config: AlignerConfig, seed: int = 0) -> dict:
    """Freshly initialised (unboxed) parameters of everything but the backbone: the projection
    and salience heads, for a backbone whose weights come from elsewhere.

    Equal to ``init_params(config, seed)`` without its ``backbone`` entry: Flax derives each
    submodule's random key from its own name, so the heads' values do not depend on the backbone.
    Only a one-layer backbone is traced and compiled (compiling the random initialisation of a
    whole backbone that pretrained weights then replace cost most of an encoder's load time).
    """
    shallow = dataclasses.replace(config, backbone=_one_layer(config.backbone))
    if set(abstract_params(shallow)) == {"backbone"}:  # no heads (identity projection, no salience)
        return {}
    return {k: v for k, v in init_params(shallow, seed).items() if k != "backbone"}


def abstract_params(config: AlignerConfig):
    """Shapes and dtypes of the (unboxed) parameters, without allocating them."""
    return jax.eval_shape(_init_unboxed(config), jax.random.PRNGKey(0))
