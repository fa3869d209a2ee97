"""The T5 version 1.1 encoder (encoder stack only), in Flax linen.

ALIGNER initialises its shared query/document encoder from T5 v1.1 (paper §4.1). This module is
the encoder half of t5x's minimal T5 network, written so that a T5X checkpoint maps onto it almost
1:1 (see :mod:`aligner_jax.weights.t5x_import`). Parameter tree (``params`` collection)::

  token_embedder/embedding                               [vocab, embed]
  encoder/relpos_bias/rel_embedding                      [heads, relpos_buckets]  (shared)
  encoder/layers_{i}/pre_attention_layer_norm/scale      [embed]
  encoder/layers_{i}/attention/{query,key,value}/kernel  [embed, joined_kv]
  encoder/layers_{i}/attention/out/kernel                [joined_kv, embed]
  encoder/layers_{i}/pre_mlp_layer_norm/scale            [embed]
  encoder/layers_{i}/mlp/{wi_0,wi_1}/kernel              [embed, mlp]
  encoder/layers_{i}/mlp/wo/kernel                       [mlp, embed]
  encoder/encoder_norm/scale                             [embed]

What makes it T5 v1.1 rather than BERT:

* RMS layer norm ("T5 LayerNorm"): ``y = x / sqrt(mean(x²) + 1e-6) * scale``; no mean
  subtraction, no bias. Pre-norm residual blocks and a final norm.
* Attention logits are NOT scaled by ``1/sqrt(head_dim)``; T5 folds that factor into the
  initialiser of the query kernel.
* No absolute positions: a learned bias per (head, relative-position bucket) is added to the
  attention logits. Buckets are bidirectional (32 buckets, max distance 128), see
  :func:`relative_position_bucket`, and one table is shared by all layers.
* Gated-GELU feed-forward: ``wo(gelu_tanh(x·wi_0) ⊙ (x·wi_1))``.
* No biases anywhere.

Every parameter carries logical axis names (``nn.with_logical_partitioning``) and the main
activations are constrained with ``nn.with_logical_constraint``; the names are those of
:mod:`aligner_jax.models.partitioning`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import gin
import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from aligner_jax.common.errors import ConfigError

Array = jax.Array

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Named feed-forward activations. "gelu" is the tanh approximation, as in T5 v1.1 (HF "gelu_new",
# flax ``nn.gelu`` default); "linear" is the identity (the ungated branch of a gated unit).
_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu": functools.partial(nn.gelu, approximate=True),
    "gelu_exact": functools.partial(nn.gelu, approximate=False),
    "relu": nn.relu,
    "silu": nn.silu,
    "linear": lambda x: x,
}

# Attention-logit bias of masked (padding) keys; logits are float32 so this is safe.
_MASKED_LOGIT = -1e10

BATCH_LENGTH_EMBED = ("batch", "length", "embed")
BATCH_LENGTH_HEADS_KV = ("batch", "length", "heads", "kv")
BATCH_LENGTH_MLP = ("batch", "length", "mlp")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class T5Config:
    """Hyper-parameters of a T5 v1.1 encoder (defaults: T5 v1.1 base).

    Attributes:
      vocab_size: rows of the token embedding (T5's SentencePiece vocabulary padded to 32128).
      emb_dim: model width ``d_model``.
      num_heads: attention heads.
      num_layers: encoder layers.
      head_dim: per-head width; ``num_heads * head_dim`` need not equal ``emb_dim``.
      mlp_dim: feed-forward inner width ``d_ff``.
      dropout_rate: dropout after the embedding, on attention weights, inside the MLP, on each
        residual branch and after the final norm; active only when ``deterministic=False``.
      dtype: compute dtype, ``"float32"`` or ``"bfloat16"``. Norm statistics, attention logits
        and softmax are always float32.
      param_dtype: storage dtype of the parameters (``"float32"``).
      relative_attention_num_buckets: relative-position buckets (both directions together).
      relative_attention_max_distance: distance from which all positions share the last bucket.
      mlp_activations: one activation per input projection ``wi_{i}``; their outputs are
        multiplied. ``("gelu", "linear")`` is T5 v1.1's gated GELU. With one activation the
        single projection is named ``wi`` (T5 v1.0 style).
      remat: recompute each layer's activations in the backward pass (``nn.remat``) to save
        accelerator memory on large models; the parameter tree is unchanged.
      layer_norm_epsilon: ε of every RMS layer norm (T5: 1e-6; Hugging Face
        ``config.json`` ``layer_norm_epsilon``).
    """

    vocab_size: int = 32128
    emb_dim: int = 768
    num_heads: int = 12
    num_layers: int = 12
    head_dim: int = 64
    mlp_dim: int = 2048
    dropout_rate: float = 0.1
    dtype: str = "float32"
    param_dtype: str = "float32"
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    mlp_activations: tuple[str, ...] = ("gelu", "linear")
    remat: bool = False
    layer_norm_epsilon: float = 1e-6

    def __post_init__(self):
        for name in (
            "vocab_size",
            "emb_dim",
            "num_heads",
            "num_layers",
            "head_dim",
            "mlp_dim",
            "relative_attention_max_distance",
        ):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"T5Config.{name} must be a positive integer, got {value!r}.")
        buckets = self.relative_attention_num_buckets
        if not isinstance(buckets, (int, np.integer)) or buckets < 4 or buckets % 2:
            raise ConfigError(
                "T5Config.relative_attention_num_buckets must be an even integer >= 4 "
                f"(half per direction), got {buckets!r}."
            )
        if not 0.0 < float(self.layer_norm_epsilon) < 1.0:
            raise ConfigError(
                f"T5Config.layer_norm_epsilon must be in (0, 1), got {self.layer_norm_epsilon!r}."
            )
        if not 0.0 <= float(self.dropout_rate) < 1.0:
            raise ConfigError(
                f"T5Config.dropout_rate must be in [0, 1), got {self.dropout_rate!r}."
            )
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ConfigError(
                    f"T5Config.{name}={getattr(self, name)!r} is not supported; use one of "
                    f"{sorted(_DTYPES)} (e.g. --gin.T5Config.{name}=\"'bfloat16'\")."
                )
        activations = self.mlp_activations
        if isinstance(activations, str):
            activations = (activations,)
        activations = tuple(activations)
        if not activations or any(a not in _ACTIVATIONS for a in activations):
            raise ConfigError(
                f"T5Config.mlp_activations={self.mlp_activations!r}: each entry must be one of "
                f"{sorted(_ACTIVATIONS)}, e.g. ('gelu', 'linear') for T5 v1.1."
            )
        object.__setattr__(self, "mlp_activations", activations)

    @property
    def compute_dtype(self) -> jnp.dtype:
        """``dtype`` as a jnp dtype."""
        return _DTYPES[self.dtype]

    @property
    def params_dtype(self) -> jnp.dtype:
        """``param_dtype`` as a jnp dtype."""
        return _DTYPES[self.param_dtype]

    @property
    def joined_kv_dim(self) -> int:
        """Width of the concatenated heads, ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    def mlp_input_names(self) -> tuple[str, ...]:
        """Names of the MLP input projections: ``wi_0, wi_1, ...`` (or ``wi`` if only one)."""
        if len(self.mlp_activations) == 1:
            return ("wi",)
        return tuple(f"wi_{i}" for i in range(len(self.mlp_activations)))


def relative_position_bucket(
    relative_position: np.ndarray,
    bidirectional: bool = True,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> np.ndarray:
    """T5's bucket of each relative position ``key_position - query_position``.

    Bidirectional: half of the buckets are for keys at or before the query, half for keys after
    it (offset by ``num_buckets // 2``). Within a half, the first ``num_buckets // 4`` distances
    get a bucket each; larger distances are binned logarithmically up to ``max_distance``, from
    which all distances share the last bucket of their half. As in t5x, a float32 epsilon is added
    inside the logarithm so exact powers of two land in the bucket they start.

    Computed with numpy on static positions (a program constant under ``jit``).

    Args:
      relative_position: integer array of ``key_position - query_position``.
      bidirectional: if False, only non-positive positions (keys at or before the query) are
        distinguished and all positive ones map to bucket 0 (causal attention).
      num_buckets: total number of buckets.
      max_distance: distance from which positions share the last bucket.

    Returns:
      int32 array, same shape, values in ``[0, num_buckets)``.
    """
    distance = -np.asarray(relative_position, dtype=np.int64)  # query - key
    bucket = np.zeros_like(distance, dtype=np.int32)
    if bidirectional:
        num_buckets //= 2
        bucket += (distance < 0).astype(np.int32) * num_buckets
        distance = np.abs(distance)
    else:
        distance = np.maximum(distance, 0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    log_ratio = np.log(distance.astype(np.float32) / max_exact + np.finfo(np.float32).eps) / np.log(
        max_distance / max_exact
    )
    large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(np.int32)
    large = np.minimum(large, num_buckets - 1)
    bucket += np.where(is_small, distance, large).astype(np.int32)
    return bucket


def _param(module: nn.Module, name: str, init, shape, axes, dtype) -> Array:
    """A parameter boxed with its logical axis names."""
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class T5LayerNorm(nn.Module):
    """T5 (RMS) layer norm: no mean subtraction, no bias; statistics in float32."""

    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    epsilon: float = 1e-6

    @nn.compact
    def __call__(self, x: Array) -> Array:
        x32 = jnp.asarray(x, jnp.float32)
        mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        y = jnp.asarray(x32 * jax.lax.rsqrt(mean_square + self.epsilon), self.dtype)
        scale = _param(
            self, "scale", nn.initializers.ones, (x.shape[-1],), ("embed",), self.param_dtype
        )
        return y * jnp.asarray(scale, self.dtype)


class T5Dense(nn.Module):
    """A bias-free linear map over the last axis with a 2-D ``kernel`` [in, features]."""

    features: int
    kernel_axes: tuple[str, str]
    kernel_init: Callable = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        kernel = _param(
            self,
            "kernel",
            self.kernel_init,
            (x.shape[-1], self.features),
            self.kernel_axes,
            self.param_dtype,
        )
        x = jnp.asarray(x, self.dtype)
        return jax.lax.dot_general(
            x, jnp.asarray(kernel, self.dtype), (((x.ndim - 1,), (0,)), ((), ()))
        )


class T5Embed(nn.Module):
    """Token embedding table ``embedding`` [vocab, embed], initialised N(0, 1) as in T5."""

    vocab_size: int
    features: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, input_ids: Array) -> Array:
        embedding = _param(
            self,
            "embedding",
            nn.initializers.normal(stddev=1.0),
            (self.vocab_size, self.features),
            ("vocab", "embed"),
            self.param_dtype,
        )
        # Look up in the table's dtype, then cast (see BertEmbeddings: float32 scatter-add in
        # the backward pass, fast on GPUs).
        x = jnp.asarray(jnp.take(embedding, input_ids, axis=0), self.dtype)
        return nn.with_logical_constraint(x, BATCH_LENGTH_EMBED)


class RelativePositionBias(nn.Module):
    """Learned attention-logit bias per (head, relative-position bucket): ``rel_embedding``."""

    num_heads: int
    num_buckets: int = 32
    max_distance: int = 128
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, query_length: int, key_length: int) -> Array:
        """Returns the float32 bias ``[1, heads, query_length, key_length]``."""
        relative_position = np.arange(key_length)[None, :] - np.arange(query_length)[:, None]
        buckets = relative_position_bucket(
            relative_position,
            bidirectional=True,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        table = _param(
            self,
            "rel_embedding",
            nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
            (self.num_heads, self.num_buckets),
            ("heads", "relpos_buckets"),
            self.param_dtype,
        )
        bias = jnp.take(jnp.asarray(table, jnp.float32), jnp.asarray(buckets), axis=1)
        return bias[None]


class T5SelfAttention(nn.Module):
    """Multi-head self-attention without the ``1/sqrt(head_dim)`` logit scaling (T5)."""

    config: T5Config

    @nn.compact
    def __call__(
        self, x: Array, key_bias: Array, position_bias: Array, deterministic: bool
    ) -> Array:
        """Attends ``x`` [B, L, E] to itself.

        Args:
          x: normalised inputs [B, L, E].
          key_bias: float32 [B, 1, 1, L]: 0 for real keys, a large negative value for padding.
          position_bias: float32 [1, H, L, L] relative position bias.
          deterministic: disables attention dropout.
        """
        cfg = self.config
        batch, length, _ = x.shape
        fan_in_normal = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
        depth_scaling = float(np.sqrt(cfg.head_dim))

        def query_init(key, shape, dtype=jnp.float32):
            # T5 folds the attention temperature 1/sqrt(head_dim) into the query kernel.
            return fan_in_normal(key, shape, dtype) / jnp.asarray(depth_scaling, dtype)

        def project(name: str, init) -> Array:
            y = T5Dense(
                cfg.joined_kv_dim,
                ("embed", "joined_kv"),
                kernel_init=init,
                dtype=cfg.compute_dtype,
                param_dtype=cfg.params_dtype,
                name=name,
            )(x)
            y = y.reshape(batch, length, cfg.num_heads, cfg.head_dim)
            return nn.with_logical_constraint(y, BATCH_LENGTH_HEADS_KV)

        query = project("query", query_init)
        key = project("key", fan_in_normal)
        value = project("value", fan_in_normal)

        logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
        logits = logits + position_bias + key_bias
        weights = jax.nn.softmax(logits, axis=-1).astype(cfg.compute_dtype)
        # As t5x: one dropout mask shared along the query axis.
        weights = nn.Dropout(rate=cfg.dropout_rate, broadcast_dims=(-2,))(
            weights, deterministic=deterministic
        )
        context = jnp.einsum("bhqk,bkhd->bqhd", weights, value)
        context = nn.with_logical_constraint(context, BATCH_LENGTH_HEADS_KV)
        context = context.reshape(batch, length, cfg.joined_kv_dim)
        return T5Dense(
            x.shape[-1],
            ("joined_kv", "embed"),
            kernel_init=fan_in_normal,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.params_dtype,
            name="out",
        )(context)


class T5MlpBlock(nn.Module):
    """Gated feed-forward: ``wo(Π_i act_i(x·wi_i))`` (gated GELU for T5 v1.1)."""

    config: T5Config

    @nn.compact
    def __call__(self, x: Array, deterministic: bool) -> Array:
        cfg = self.config
        hidden = None
        for name, activation in zip(cfg.mlp_input_names(), cfg.mlp_activations, strict=True):
            h = T5Dense(
                cfg.mlp_dim,
                ("embed", "mlp"),
                dtype=cfg.compute_dtype,
                param_dtype=cfg.params_dtype,
                name=name,
            )(x)
            h = _ACTIVATIONS[activation](h)
            hidden = h if hidden is None else hidden * h
        hidden = nn.Dropout(rate=cfg.dropout_rate, broadcast_dims=(-2,))(
            hidden, deterministic=deterministic
        )
        hidden = nn.with_logical_constraint(hidden, BATCH_LENGTH_MLP)
        return T5Dense(
            x.shape[-1],
            ("mlp", "embed"),
            dtype=cfg.compute_dtype,
            param_dtype=cfg.params_dtype,
            name="wo",
        )(hidden)


class T5EncoderLayer(nn.Module):
    """Pre-norm residual block: self-attention, then gated feed-forward."""

    config: T5Config

    @nn.compact
    def __call__(
        self, x: Array, key_bias: Array, position_bias: Array, deterministic: bool
    ) -> Array:
        cfg = self.config
        norm = functools.partial(
            T5LayerNorm,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.params_dtype,
            epsilon=cfg.layer_norm_epsilon,
        )
        residual_dropout = functools.partial(
            nn.Dropout, rate=cfg.dropout_rate, broadcast_dims=(-2,)
        )
        y = norm(name="pre_attention_layer_norm")(x)
        y = T5SelfAttention(cfg, name="attention")(y, key_bias, position_bias, deterministic)
        x = x + residual_dropout()(y, deterministic=deterministic)
        x = nn.with_logical_constraint(x, BATCH_LENGTH_EMBED)

        y = norm(name="pre_mlp_layer_norm")(x)
        y = T5MlpBlock(cfg, name="mlp")(y, deterministic)
        x = x + residual_dropout()(y, deterministic=deterministic)
        return nn.with_logical_constraint(x, BATCH_LENGTH_EMBED)


class T5EncoderStack(nn.Module):
    """Embedding dropout, ``num_layers`` layers sharing one relative bias table, final norm."""

    config: T5Config

    @nn.compact
    def __call__(self, x: Array, mask: Array, deterministic: bool) -> Array:
        cfg = self.config
        length = x.shape[1]
        position_bias = RelativePositionBias(
            num_heads=cfg.num_heads,
            num_buckets=cfg.relative_attention_num_buckets,
            max_distance=cfg.relative_attention_max_distance,
            param_dtype=cfg.params_dtype,
            name="relpos_bias",
        )(length, length)
        key_bias = jnp.where(mask, 0.0, _MASKED_LOGIT).astype(jnp.float32)[:, None, None, :]

        x = nn.Dropout(rate=cfg.dropout_rate, broadcast_dims=(-2,))(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x.astype(cfg.compute_dtype), BATCH_LENGTH_EMBED)
        layer_cls = T5EncoderLayer
        if cfg.remat:
            # Argument 0 is the module itself; 4 is ``deterministic`` (a Python bool).
            layer_cls = nn.remat(T5EncoderLayer, static_argnums=(4,))
        for i in range(cfg.num_layers):
            x = layer_cls(cfg, name=f"layers_{i}")(x, key_bias, position_bias, deterministic)
        x = T5LayerNorm(
            dtype=cfg.compute_dtype,
            param_dtype=cfg.params_dtype,
            epsilon=cfg.layer_norm_epsilon,
            name="encoder_norm",
        )(x)
        x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=deterministic)
        return nn.with_logical_constraint(x, BATCH_LENGTH_EMBED)


class T5Encoder(nn.Module):
    """T5 v1.1 encoder: token ids -> contextual token vectors ``[B, L, emb_dim]``.

    Same call signature as ``aligner_jax.models.bert.BertEncoder`` so ALIGNER can use either as
    its backbone. Padding (``mask == False``) is excluded as an attention key everywhere, and the
    outputs at padded positions are set to zero.

    Dropout needs an rng named ``dropout`` when ``deterministic=False``.
    """

    config: T5Config

    @nn.compact
    def __call__(
        self,
        input_ids: Array,
        mask: Array,
        token_type_ids: Array | None = None,
        deterministic: bool = True,
    ) -> Array:
        """Encodes a batch.

        Args:
          input_ids: int32 [B, L] token ids (must be < ``config.vocab_size``).
          mask: bool [B, L], True for real tokens.
          token_type_ids: accepted for interface parity with BERT and ignored (T5 has none).
          deterministic: disables dropout when True.

        Returns:
          [B, L, emb_dim] in ``config.dtype``; zero at padded positions.
        """
        del token_type_ids
        cfg = self.config
        if input_ids.ndim != 2 or mask.shape != input_ids.shape:
            raise ValueError(
                "T5Encoder expects input_ids [batch, length] and a mask of the same shape; got "
                f"input_ids {input_ids.shape} and mask {mask.shape}."
            )
        mask = mask.astype(jnp.bool_)
        x = T5Embed(
            cfg.vocab_size,
            cfg.emb_dim,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.params_dtype,
            name="token_embedder",
        )(input_ids.astype(jnp.int32))
        x = T5EncoderStack(cfg, name="encoder")(x, mask, deterministic)
        return x * mask[..., None].astype(x.dtype)


def init_t5_encoder(config: T5Config, rng: Array, batch_size: int = 1, length: int = 8) -> dict:
    """t5x-style initial variables (``{"params": ...}``, logically-boxed) for ``config``."""
    model = T5Encoder(config)
    ids = jnp.ones((batch_size, length), jnp.int32)
    return model.init(rng, ids, jnp.ones((batch_size, length), jnp.bool_))


def abstract_params(config: T5Config) -> dict:
    """Shapes/dtypes of the (unboxed) parameter tree, without allocating anything."""
    variables = jax.eval_shape(
        functools.partial(init_t5_encoder, config, batch_size=1, length=2), jax.random.key(0)
    )
    return nn.unbox(variables)["params"]


def params_logical_axes(config: T5Config) -> dict:
    """The logical ``PartitionSpec`` of every parameter (same tree as the params)."""
    variables = jax.eval_shape(
        functools.partial(init_t5_encoder, config, batch_size=1, length=2), jax.random.key(0)
    )
    return nn.get_partition_spec(variables)["params"]


__all__ = [
    "T5Config",
    "T5Encoder",
    "T5EncoderLayer",
    "T5EncoderStack",
    "T5LayerNorm",
    "RelativePositionBias",
    "relative_position_bucket",
    "init_t5_encoder",
    "abstract_params",
    "params_logical_axes",
]
