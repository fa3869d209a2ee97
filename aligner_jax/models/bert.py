"""A BERT encoder in Flax linen, numerically matching Hugging Face's ``BertModel``.

The ALIGNER paper (§2.2, §4.1) encodes queries and documents with one shared Transformer encoder
and takes its last-layer token vectors ``q_i`` and ``d_j`` as the inputs of the similarity matrix
``S[i, j] = q_i · d_j`` (Eq. 1). This module is that encoder for BERT-family checkpoints (the
bundled all-MiniLM-L6-v2); the projection to 128 dimensions and L2 normalisation live with the
retrieval model, not here.

Layout follows the original BERT (post-LayerNorm):

  h_0     = LayerNorm(E_word[x] + E_pos[0..L-1] + E_type[t])
  a_l     = LayerNorm(h_{l-1} + W_o · MultiHeadAttention(h_{l-1}, mask))
  h_l     = LayerNorm(a_l + W_2 · GELU(W_1 · a_l))

with exact (erf) GELU, dropout after the embeddings, on attention probabilities and after both
residual branches (active only when ``deterministic=False``). Padding is excluded from attention
as keys, and the returned hidden states are zero at padding positions, so padding never takes part
in anything downstream.

Every parameter carries logical axis names (see ``aligner_jax/partitioning.py``); the main
activations are constrained with ``nn.with_logical_constraint`` so the same code shards on a TPU
mesh and runs unchanged on one CPU device.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from aligner_jax.common.errors import ConfigError

Dtype = Any

# Logit bias of padding keys: exp(-1e9 - max) underflows to exactly 0, yet it is finite (filler
# rows that are all padding stay NaN-free) and representable in bfloat16.
_MASK_BIAS = -1e9


def _gelu_erf(x: jax.Array) -> jax.Array:
    """Exact GELU ``x · Φ(x) = x/2 · (1 + erf(x/√2))``, the formula Hugging Face BERT uses.

    ``jax.nn.gelu(approximate=False)`` computes the same function through ``erfc``, which XLA:CPU
    lowers to a branchy piecewise approximation in a separate pass (a few % slower end to end).
    """
    return x * (0.5 * (1.0 + jax.lax.erf(x * jnp.asarray(0.7071067811865476, x.dtype))))


# Activations that HF BERT configs name, mapped to JAX. "gelu" is the exact erf form.
_ACTIVATIONS = {
    "gelu": _gelu_erf,
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Architecture hyper-parameters, with the names of a Hugging Face ``config.json``."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    initializer_range: float = 0.02

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"BertConfig: hidden_size={self.hidden_size} must be divisible by "
                f"num_attention_heads={self.num_attention_heads}."
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ConfigError(
                f"BertConfig: hidden_act={self.hidden_act!r} is not supported; use one of "
                f"{sorted(_ACTIVATIONS)}."
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            rate = getattr(self, name)
            if not 0.0 <= rate < 1.0:
                raise ConfigError(f"BertConfig: {name}={rate} must be in [0, 1).")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_config(
        cls, hf_config: Mapping[str, Any], source: str = "config.json"
    ) -> BertConfig:
        """Builds the config from a Hugging Face BERT ``config.json`` dict.

        Unknown keys (``architectures``, ``transformers_version``, ...) are ignored. Settings this
        implementation cannot honour raise a ValueError naming ``source``.
        """
        model_type = hf_config.get("model_type", "bert")
        if model_type != "bert":
            raise ConfigError(
                f"{source}: model_type={model_type!r} is not supported; "
                "aligner_jax.models.bert implements model_type 'bert' only."
            )
        position_type = hf_config.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ConfigError(
                f"{source}: position_embedding_type={position_type!r} is not supported "
                "(only 'absolute')."
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in hf_config.items() if k in fields and v is not None}
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{source}: {e}") from e

    def to_hf_config(self) -> dict[str, Any]:
        """The inverse of ``from_hf_config`` (what ``config.json`` would hold)."""
        return {"model_type": "bert", **dataclasses.asdict(self)}


def _dense_init(config: BertConfig, axes: tuple[str, str]):
    return nn.with_logical_partitioning(
        nn.initializers.normal(stddev=config.initializer_range), axes
    )


def _zeros(axes: tuple[str, ...]):
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def _ones(axes: tuple[str, ...]):
    return nn.with_logical_partitioning(nn.initializers.ones_init(), axes)


class _LayerNorm(nn.LayerNorm):
    """LayerNorm over ``embed`` with logically partitioned scale and bias."""

    scale_init: Any = _ones(("embed",))
    bias_init: Any = _zeros(("embed",))


def _dense(config: BertConfig, features: int, axes: tuple[str, str], dtype, param_dtype, name):
    return nn.Dense(
        features,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=_dense_init(config, axes),
        bias_init=_zeros(axes[1:]),
        name=name,
    )


def _output_and_residual(module: nn.Module, h, x, axes: tuple[str, str], deterministic: bool):
    """BERT's ``*Output`` block of a sub-layer: LayerNorm(x + Dropout(Dense(h))), post-LN.

    Called inside ``module``'s compact ``__call__``: the layers it makes are that module's
    ``output`` and ``LayerNorm`` (the Hugging Face names)."""
    cfg = module.config
    h = _dense(cfg, cfg.hidden_size, axes, module.dtype, module.param_dtype, "output")(h)
    h = nn.Dropout(cfg.hidden_dropout_prob)(h, deterministic=deterministic)
    out = _LayerNorm(
        epsilon=cfg.layer_norm_eps,
        dtype=module.dtype,
        param_dtype=module.param_dtype,
        name="LayerNorm",
    )(h + x)
    return nn.with_logical_constraint(out, ("batch", "length", "embed"))


class _BertModule(nn.Module):
    """The attributes every BERT sub-module carries: its config and compute / parameter dtypes."""

    config: BertConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32


class BertEmbeddings(_BertModule):
    """Word + absolute position + token type embeddings, LayerNorm, dropout."""

    @nn.compact
    def __call__(self, input_ids, token_type_ids, deterministic: bool):
        cfg = self.config
        length = input_ids.shape[1]
        if length > cfg.max_position_embeddings:
            raise ConfigError(
                f"Sequence length {length} exceeds max_position_embeddings="
                f"{cfg.max_position_embeddings} of the BERT config; truncate inputs (e.g. "
                "Tokenizer.encode_batch(..., max_length=...)) to at most that length."
            )

        # Tables are looked up in their parameter dtype and the rows cast afterwards: the same
        # values, but the backward pass scatter-adds into a float32 table. A bfloat16 scatter-add
        # has no native atomic on GPUs: it made this backbone's forward + backward 5x slower in
        # bf16 than in f32 on an H100 (benchmarks/results/README.md, "GPU").
        def embed(name, num, axes):
            return nn.Embed(
                num,
                cfg.hidden_size,
                dtype=self.param_dtype,
                param_dtype=self.param_dtype,
                embedding_init=nn.with_logical_partitioning(
                    nn.initializers.normal(stddev=cfg.initializer_range), axes
                ),
                name=name,
            )

        words = embed("word_embeddings", cfg.vocab_size, ("vocab", "embed"))(input_ids)
        words = words.astype(self.dtype)
        position_table = embed(
            "position_embeddings", cfg.max_position_embeddings, ("abspos_buckets", "embed")
        ).embedding
        types = embed("token_type_embeddings", cfg.type_vocab_size, ("token_type", "embed"))(
            token_type_ids
        ).astype(self.dtype)
        positions = jnp.asarray(position_table[:length], self.dtype)[None]
        x = words + positions + types
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
        x = _LayerNorm(
            epsilon=cfg.layer_norm_eps,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="LayerNorm",
        )(x)
        return nn.Dropout(cfg.hidden_dropout_prob)(x, deterministic=deterministic)


class BertSelfAttention(_BertModule):
    """Multi-head self-attention with output projection, residual and LayerNorm.

    ``softmax(q·kᵀ / sqrt(D) + mask) V`` per head, computed in a CPU-friendly form with the same
    result (parity with Hugging Face ≤ 1e-5):

    * heads are laid out ``[B, heads, L, D]`` so both attention matmuls are plain batched GEMMs;
    * the ``1/sqrt(D)`` scale is applied to the queries, not to the ``[L, L]`` logits;
    * padding keys are masked inside the ``q·kᵀ`` matmul: queries get an extra feature 1 and keys
      the extra feature ``key_bias`` (0 on real keys, a large negative number on padding), so
      ``[q, 1]·[k, bias] = q·k + bias`` and no ``[B, heads, L, L]`` bias is materialised;
    * the softmax normalisation divides the ``[L, D]`` context instead of the ``[L, L]``
      probabilities (D ≪ L) when dropout is off.
    """

    @nn.compact
    def __call__(self, x, key_bias, deterministic: bool):
        cfg = self.config
        hidden, heads, head_dim = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        batch, length = x.shape[:2]

        def heads_first(name):
            y = _dense(cfg, hidden, ("embed", "joined_kv"), self.dtype, self.param_dtype, name)(x)
            y = y.reshape(batch, length, heads, head_dim).transpose(0, 2, 1, 3)
            return nn.with_logical_constraint(y, ("batch", "heads", "length", "kv"))

        query = heads_first("query") * jnp.asarray(head_dim**-0.5, self.dtype)
        key = heads_first("key")
        value = heads_first("value")

        ones = jnp.ones((batch, heads, length, 1), self.dtype)
        bias_feature = jnp.broadcast_to(
            key_bias.astype(self.dtype)[:, None, :, None], (batch, heads, length, 1)
        )
        logits = jnp.einsum(
            "bhqd,bhkd->bhqk",
            jnp.concatenate([query, ones], axis=-1),
            jnp.concatenate([key, bias_feature], axis=-1),
            preferred_element_type=jnp.float32,
        )
        logits = nn.with_logical_constraint(logits, ("batch", "heads", "length", None))
        logits_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
        unnormalized = jnp.exp(logits - logits_max)
        denominator = jnp.sum(unnormalized, axis=-1, keepdims=True)
        if not deterministic and cfg.attention_probs_dropout_prob > 0.0:
            # Dropout acts on the normalised probabilities, as in BERT.
            probs = nn.Dropout(cfg.attention_probs_dropout_prob)(
                unnormalized / denominator, deterministic=False
            )
            context = jnp.einsum("bhqk,bhkd->bhqd", probs.astype(self.dtype), value)
        else:
            context = jnp.einsum(
                "bhqk,bhkd->bhqd", unnormalized.astype(self.dtype), value
            ) / denominator.astype(self.dtype)
        context = context.transpose(0, 2, 1, 3).reshape(batch, length, hidden)
        context = nn.with_logical_constraint(context, ("batch", "length", "joined_kv"))

        return _output_and_residual(self, context, x, ("joined_kv", "embed"), deterministic)


class BertLayer(_BertModule):
    """One Transformer block: self-attention, then the feed-forward network (post-LN)."""

    @nn.compact
    def __call__(self, x, key_bias, deterministic: bool):
        cfg = self.config
        x = BertSelfAttention(cfg, self.dtype, self.param_dtype, name="attention")(
            x, key_bias, deterministic
        )
        h = _dense(
            cfg,
            cfg.intermediate_size,
            ("embed", "mlp"),
            self.dtype,
            self.param_dtype,
            "intermediate",
        )(x)
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        h = _ACTIVATIONS[cfg.hidden_act](h)
        return _output_and_residual(self, h, x, ("mlp", "embed"), deterministic)


class BertEncoder(_BertModule):
    """The BERT encoder: token ids → last-layer hidden states (the token vectors of ALIGNER §2.2).

    Attributes:
      config: architecture (``BertConfig.from_hf_config`` for a Hugging Face checkpoint).
      dtype: computation dtype (float32 on CPU/GPU; bfloat16 on TPU). Softmax and LayerNorm
        statistics are always computed in float32.
      param_dtype: dtype the parameters are created in.

    Parameter tree (Hugging Face names; kernels are ``[in, out]``)::

      embeddings/{word_embeddings,position_embeddings,token_type_embeddings}/embedding
      embeddings/LayerNorm/{scale,bias}
      layer_{i}/attention/{query,key,value,output}/{kernel,bias}, layer_{i}/attention/LayerNorm
      layer_{i}/{intermediate,output}/{kernel,bias}, layer_{i}/LayerNorm/{scale,bias}
    """

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        mask: jax.Array,
        token_type_ids: jax.Array | None = None,
        deterministic: bool = True,
    ) -> jax.Array:
        """Encodes a right-padded batch.

        Args:
          input_ids: ``[B, L]`` int32 token ids.
          mask: ``[B, L]`` bool, True on real tokens. Positions are ``0..L-1`` for every row, so
            pad on the right to match Hugging Face.
          token_type_ids: ``[B, L]`` int32 segment ids; zeros when None.
          deterministic: disables dropout when True; otherwise needs a ``'dropout'`` rng.

        Returns:
          ``[B, L, hidden_size]`` last-layer hidden states in ``dtype``, zero at padding.
        """
        if input_ids.ndim != 2 or mask.shape != input_ids.shape:
            raise ValueError(
                f"BertEncoder expects input_ids [B, L] and mask of the same shape; got "
                f"input_ids {input_ids.shape} and mask {mask.shape}."
            )
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        mask = mask.astype(jnp.bool_)
        x = BertEmbeddings(self.config, self.dtype, self.param_dtype, name="embeddings")(
            input_ids, token_type_ids, deterministic
        )
        # Additive key bias: 0 on real keys, _MASK_BIAS on padding.
        key_bias = jnp.where(mask, 0.0, _MASK_BIAS).astype(jnp.float32)
        for i in range(self.config.num_hidden_layers):
            x = BertLayer(self.config, self.dtype, self.param_dtype, name=f"layer_{i}")(
                x, key_bias, deterministic
            )
        x = jnp.where(mask[..., None], x, jnp.zeros((), x.dtype))
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))
