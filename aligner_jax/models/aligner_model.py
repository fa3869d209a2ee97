"""The ALIGNER model class used by the trainer (t5x style: ``loss_fn`` and ``score_batch``).

The trainer knows nothing model-specific: it calls ``init_abstract``/``init`` for parameters,
``loss_fn(params, batch, dropout_rng)`` for training and ``score_batch(params, batch, mode)`` for
inference. A batch holds ``query_tokens [B, Lq]`` and ``doc_tokens [B, G, Ld]`` (G = 1 positive
followed by G−1 hard negatives; padding id 0, masks are ``tokens != 0``).

Objectives (``LossConfig.objective``):
  * ``aligner``: softmax cross-entropy over every document of the batch (in-batch negatives plus
    the hard negatives, paper §4.1) of sim(Q, D) (Eq. 1–2) under the training alignment (top-k,
    top-p or differentiable, Appendix A.2) with the unary saliences of Eq. 3–5 (or an ablation);
  * ``xtr``: the same cross-entropy over f_XTR (XTR Eq. 2: in-batch token top-k_train retrieval
    with its normaliser Z).

A document of the batch that is relevant to a row's query but is not that row's positive (the
same query with another positive, a positive shared by two queries, a document relevant to both)
is not a negative: with the batch's ``doc_keys [B, G]`` and ``relevant_keys [B, R]``
(``tasks.sources``) it is left out of that row's softmax (``false_negative_mask``) and counted in
the ``false_negatives`` metric, with ``LossConfig.mask_false_negatives=True`` (off by default:
over two training seeds it gained nothing measurable on SciFact or CISI; off, they are counted
and kept as negatives). A batch without them (saved by older versions) masks nothing.
With ``xtr`` the mask applies to the final scores only: XTR's in-batch token top-k_train and its
normaliser Z still see the masked documents' tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gin
import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

from aligner_jax.common import checks
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import salience as salience_lib
from aligner_jax.core import scoring, xtr
from aligner_jax.models import aligner as aligner_lib

OBJECTIVES = ("aligner", "xtr")
SCORE_MODES = ("encode_queries", "encode_documents", "similarity")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Training objective.

    Attributes:
      objective: ``aligner`` or ``xtr``.
      alignment: training alignment strategy (paper: ``top_k:1``), any
        ``scoring.AlignmentStrategy`` spelling, e.g. ``top_p:0.005`` or
        ``differentiable:k=1,epsilon=0.01``.
      temperature: softmax temperature τ (logits = sim / τ; sim is normalised to [-1, 1]).
      k_train: XTR's in-batch top-k_train.
      l1_weight: weight of the L1 salience penalty (the ``l1`` salience ablation).
      in_batch_negatives: also contrast against the other queries' documents.
      mask_false_negatives: leave documents of the batch that are relevant to a row's query out
        of its softmax (``false_negative_mask``). Off by default: on SciFact (200 steps, one
        seed) the masked model lost 4.3 nDCG@10 [95 % CI −7.3, −1.4], and CISI was unchanged
        (``benchmarks/results/false_negatives.md``). They are counted either way.
    """

    objective: str = "aligner"
    alignment: str = "top_k:1"
    temperature: float = 0.02
    k_train: int = 128
    l1_weight: float = 0.0
    in_batch_negatives: bool = True
    mask_false_negatives: bool = False

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ConfigError(
                f"LossConfig.objective={self.objective!r}: choose one of {OBJECTIVES}"
            )
        scoring.AlignmentStrategy.parse(self.alignment)  # validates the spelling
        checks.number("LossConfig.temperature", self.temperature, 0.0, low_open=True)
        checks.integer("LossConfig.k_train", self.k_train, minimum=1)
        checks.number("LossConfig.l1_weight", self.l1_weight, 0.0)


@gin.configurable
class AlignerModel:
    """Shared encoder + projection + salience heads, with the training loss and inference modes."""

    def __init__(
        self, config: aligner_lib.AlignerConfig | None = None, loss: LossConfig | None = None
    ):
        checks.required("AlignerModel.config", config)
        self.config = config
        self.loss = loss or LossConfig()
        self.module = aligner_lib.AlignerEncoder(config)
        self.strategy = scoring.AlignmentStrategy.parse(self.loss.alignment)

    # -- parameters ----------------------------------------------------------------------------
    def init(self, rng: jax.Array):
        """Boxed (``nn.LogicallyPartitioned``) parameters."""
        return aligner_lib.init_boxed_params(self.config, rng)

    def init_abstract(self):
        return jax.eval_shape(self.init, jax.random.PRNGKey(0))

    # -- encoding --------------------------------------------------------------------------------
    def encode(self, params, tokens, kind: str, dropout_rng=None):
        deterministic = dropout_rng is None
        rngs = None if deterministic else {"dropout": dropout_rng}
        mask = tokens != 0
        vectors, salience = self.module.apply(
            {"params": params}, tokens, mask, kind, deterministic, rngs=rngs
        )
        return vectors, salience, mask

    # -- scoring ---------------------------------------------------------------------------------
    def batch_scores(self, q, q_mask, u_q, d, d_mask, u_d):
        """[B, C] training scores of every query against every in-batch document."""
        if self.loss.objective == "xtr":
            return xtr.xtr_train_scores(q, q_mask, d, d_mask, self.loss.k_train)
        s = scoring.cross_similarity(q, d)
        return scoring.alignment_scores(
            s, q_mask[:, None], d_mask[None], self.strategy, u_q=u_q[:, None], u_d=u_d[None]
        )

    def loss_fn(self, params, batch: dict[str, jax.Array], dropout_rng: jax.Array | None):
        """(loss, metrics) of a batch; cross-entropy against each query's positive document."""
        q_tokens = batch["query_tokens"]
        d_tokens = batch["doc_tokens"]
        b, g, ld = d_tokens.shape
        docs = d_tokens.reshape(b * g, ld)
        rq = rd = None
        if dropout_rng is not None:
            rq, rd = jax.random.split(dropout_rng)
        q, u_q, q_mask = self.encode(params, q_tokens, aligner_lib.QUERY, rq)
        d, u_d, d_mask = self.encode(params, docs, aligner_lib.DOC, rd)
        scores = self.batch_scores(q, q_mask, u_q, d, d_mask, u_d)  # [B, B·G]
        labels = jnp.arange(b) * g
        excluded = jnp.zeros(scores.shape, bool)
        if not self.loss.in_batch_negatives:
            excluded = (jnp.arange(b * g)[None, :] // g) != jnp.arange(b)[:, None]
        false_negatives = jnp.zeros(scores.shape, bool)
        if "relevant_keys" in batch:
            false_negatives = false_negative_mask(batch["doc_keys"], batch["relevant_keys"])
            false_negatives = false_negatives & ~excluded
        masked = excluded | false_negatives if self.loss.mask_false_negatives else excluded
        scores = jnp.where(masked, -1e9, scores)
        logits = scores.astype(jnp.float32) / self.loss.temperature
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        metrics = {
            "loss": loss,
            "false_negatives": jnp.sum(false_negatives) / b,
            "accuracy": jnp.mean(jnp.argmax(logits, axis=-1) == labels),
            "positive_score": jnp.mean(scores[jnp.arange(b), labels]),
        }
        if self.config.salience != "none":
            metrics["query_salience_nonzero"] = _nonzero_fraction(u_q, q_mask)
            metrics["doc_salience_nonzero"] = _nonzero_fraction(u_d, d_mask)
        if self.loss.l1_weight:
            penalty = jnp.mean(salience_lib.l1_penalty(u_q, q_mask)) + jnp.mean(
                salience_lib.l1_penalty(u_d, d_mask)
            )
            metrics["l1_penalty"] = penalty
            loss = loss + self.loss.l1_weight * penalty
        metrics["total_loss"] = loss
        return loss, metrics

    def score_batch(self, params, batch: dict[str, jax.Array], mode: str = "similarity"):
        """Inference: ``encode_queries`` / ``encode_documents`` → (vectors, salience, mask);
        ``similarity`` → [B, G] scores of each query against its own documents."""
        if mode not in SCORE_MODES:
            raise ConfigError(f"score_batch mode={mode!r}: choose one of {SCORE_MODES}")
        if mode == "encode_queries":
            return self.encode(params, batch["query_tokens"], aligner_lib.QUERY)
        if mode == "encode_documents":
            tokens = batch["doc_tokens"]
            return self.encode(params, tokens.reshape(-1, tokens.shape[-1]), aligner_lib.DOC)
        q, u_q, q_mask = self.encode(params, batch["query_tokens"], aligner_lib.QUERY)
        tokens = batch["doc_tokens"]
        b, g, ld = tokens.shape
        d, u_d, d_mask = self.encode(params, tokens.reshape(b * g, ld), aligner_lib.DOC)
        d, u_d, d_mask = (x.reshape((b, g) + x.shape[1:]) for x in (d, u_d, d_mask))
        s = scoring.similarity_matrix(q[:, None], d)  # [B, G, n, m]
        return scoring.alignment_scores(
            s, q_mask[:, None], d_mask, self.strategy, u_q=u_q[:, None], u_d=u_d
        )


def false_negative_mask(doc_keys: jax.Array, relevant_keys: jax.Array) -> jax.Array:
    """[B, B·G] True where batch document j is relevant to row i's query but is not row i's
    positive (column i·G): such a document must not be a negative of row i.

    ``doc_keys [B, G]`` content keys of each row's documents (positive first); ``relevant_keys
    [B, R]`` the keys of the documents relevant to each row's query, 0-padded (keys are ≥ 1).
    """
    b, g = doc_keys.shape
    columns = doc_keys.reshape(b * g)
    relevant = jnp.any(
        (relevant_keys[:, :, None] == columns[None, None, :]) & (relevant_keys[:, :, None] > 0),
        axis=1,
    )
    positive = jnp.arange(b * g)[None, :] == (jnp.arange(b) * g)[:, None]
    return relevant & ~positive


def _nonzero_fraction(u: jax.Array, mask: jax.Array) -> jax.Array:
    real = jnp.maximum(jnp.sum(mask), 1)
    return jnp.sum((u > 1e-6) & mask) / real


def unbox(tree: Any) -> Any:
    return nn.meta.unbox(tree)
