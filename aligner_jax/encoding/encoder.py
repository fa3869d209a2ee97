"""Batch encoding of texts with a jitted ALIGNER encoder, in length buckets, with progress (a
caller's :class:`aligner_jax.common.progress.Progress`, counting texts and tokens).

Texts are tokenised (no padding), grouped by length into a few bucket lengths, and encoded in
fixed-shape batches (one XLA compilation per bucket). Only real tokens come back: each text yields
``EncodedText(token_ids [m], vectors [m, D], salience [m])``.

Documents are padded to multiples of 32 tokens (little padding over a corpus); queries to 16,
32, 48, 64, then 128, 256, ... up to the budget: a handful of shapes, all compiled by
:meth:`Encoder.warm_up` when a searcher loads, so no query compiles afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import gin
import jax
import numpy as np

from aligner_jax.common import checks, progress
from aligner_jax.common.errors import ConfigError
from aligner_jax.encoding import batching, tokenization
from aligner_jax.models import aligner as aligner_lib
from aligner_jax.models import partitioning

# Query bucket lengths: every QUERY_STEP tokens up to QUERY_FINE_UPTO, then doubling.
QUERY_STEP, QUERY_FINE_UPTO = 16, 64


@gin.configurable
@dataclasses.dataclass(frozen=True)
class EncodingConfig:
    """How texts are batched for the encoder (see ``tokenization.length_buckets``).

    Attributes:
      bucket_multiple: bucket lengths are multiples of this (and the max length).
      max_tokens_per_batch: padded tokens (rows × bucket length) per batch. Small batches are
        fastest on CPU (cache-resident activations: 1024 measured best on 2 cores, see
        benchmarks/encoder_throughput.py); use several thousand on accelerators.
      concurrent_batches: batches in flight at once (None: one per CPU core on CPU, else 1;
        XLA:CPU runs each fused op on one thread, so two batches use two cores).
    """

    bucket_multiple: int = tokenization.DEFAULT_BUCKET_STEP
    max_tokens_per_batch: int = 1024
    concurrent_batches: int | None = None

    def __post_init__(self):
        name = type(self).__name__
        checks.integer(f"{name}.bucket_multiple", self.bucket_multiple, minimum=1)
        checks.integer(f"{name}.max_tokens_per_batch", self.max_tokens_per_batch, minimum=1)
        checks.integer(
            f"{name}.concurrent_batches", self.concurrent_batches, minimum=1, allow_none=True
        )

    def bucket_lengths(self, maxlen: int, kind: str = aligner_lib.DOC) -> tuple[int, ...]:
        """The padded lengths texts of ``kind`` are encoded at (``maxlen`` is always the last).

        Documents: multiples of ``bucket_multiple``. Queries: multiples of 16 up to 64 tokens
        (where almost every query falls: a query pays at most 15 padding tokens), then powers
        of two (128, 256, 512): seven shapes for BERT's 512, all compiled at load
        (:meth:`Encoder.warm_up`).
        """
        if kind != aligner_lib.QUERY:
            return tokenization.default_bucket_boundaries(maxlen, self.bucket_multiple)
        bounds = [b for b in range(QUERY_STEP, QUERY_FINE_UPTO + 1, QUERY_STEP) if b < maxlen]
        b = 2 * QUERY_FINE_UPTO
        while b < maxlen:
            bounds.append(b)
            b *= 2
        return tuple(bounds + [maxlen])


@dataclasses.dataclass
class EncodedText:
    token_ids: np.ndarray  # [m] int32
    vectors: np.ndarray  # [m, D] float32
    salience: np.ndarray  # [m] float32


@dataclasses.dataclass
class EncoderBundle:
    """A ready-to-use encoder: config, flax module, (unboxed) params and tokenizer."""

    config: aligner_lib.AlignerConfig
    params: Any
    tokenizer: Any
    name: str
    # How load_encoder made it (backbone_weights, checkpoint, tokenizer, seed): see ``spec``.
    source: dict | None = None
    _fingerprint: str | None = None

    @property
    def module(self) -> aligner_lib.AlignerEncoder:
        return aligner_lib.AlignerEncoder(self.config)

    def fingerprint(self) -> str:
        """sha256 over every parameter's bytes and the settings that shape document vectors.

        Two bundles with the same fingerprint encode documents identically, so a token store
        built by one can be searched by the other (query-side settings such as
        ``query_maxlen`` or ``alpha_q`` may differ).
        """
        if self._fingerprint is None:
            cfg = self.config
            doc_side = (
                repr(cfg.backbone),
                cfg.projection,
                cfg.projection_dim if cfg.projection == "dense" else None,
                cfg.salience,
                (cfg.alpha_d, cfg.epsilon, cfg.lp_iters, cfg.lp_init)
                if cfg.salience == "lp"
                else None,
                cfg.doc_maxlen,
                cfg.dtype,
            )
            digest = hashlib.sha256(repr(doc_side).encode())
            leaves = jax.tree_util.tree_flatten_with_path(self.params)[0]
            for path, leaf in leaves:
                digest.update(jax.tree_util.keystr(path).encode())
                digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def spec(self) -> dict:
        """What ``loading.encoder_from_spec`` needs to rebuild this encoder in another process:
        the architecture (``AlignerConfig`` with its backbone config) and ``source``."""
        cfg = dataclasses.asdict(self.config)
        cfg["backbone"] = {
            "type": type(self.config.backbone).__name__,
            **dataclasses.asdict(self.config.backbone),
        }
        return {"name": self.name, "source": self.source, "config": cfg, "info": self.info()}

    def info(self) -> dict:
        cfg = self.config
        return {
            "name": self.name,
            "fingerprint": self.fingerprint(),
            "projection": cfg.projection,
            "dim": cfg.output_dim,
            "salience": cfg.salience,
            "query_maxlen": cfg.query_maxlen,
            "doc_maxlen": cfg.doc_maxlen,
            "backbone": type(cfg.backbone).__name__,
        }


@functools.cache
def _jitted_forward(config: aligner_lib.AlignerConfig):
    """The jitted ``(params, ids, mask, kind) -> (vectors, salience)`` of an architecture, one
    per ``AlignerConfig`` and shared by all its encoders: a searcher loaded again (or an index's
    model loaded twice) reuses what the first compiled."""
    module = aligner_lib.AlignerEncoder(config)

    def forward(params, ids, mask, kind):
        return module.apply({"params": params}, ids, mask, kind, True)

    return jax.jit(forward, static_argnums=(3,))


class Encoder:
    """Encodes texts into real-token vectors and saliences with a jitted, bucketed forward pass."""

    def __init__(
        self,
        bundle: EncoderBundle,
        config: EncodingConfig | None = None,
        mesh: jax.sharding.Mesh | None = None,
        query_maxlen: int | None = None,
    ):
        """``query_maxlen`` overrides the model's query length (training's, e.g. 64): search
        and evaluation encode whole queries, up to the backbone's maximum."""
        if query_maxlen is not None:
            limit = aligner_lib.backbone_max_length(bundle.config.backbone)
            if isinstance(query_maxlen, bool) or not 1 <= query_maxlen <= limit:
                raise ConfigError(
                    f"--query_maxlen={query_maxlen}: must be in [1, {limit}] (the backbone's "
                    "maximum input length)"
                )
        self.query_maxlen = query_maxlen
        self.bundle = bundle
        self.config = config or EncodingConfig()
        self.mesh = mesh
        self._data_parallel = 1
        params = bundle.params
        if mesh is not None:
            self._data_parallel = mesh.shape[partitioning.DATA_AXIS]
            self._batch_sharding = partitioning.batch_sharding(mesh)
            params = jax.device_put(params, partitioning.replicated(mesh))
        else:  # once: NumPy leaves would be transferred again by every call (106 for MiniLM)
            params = jax.device_put(params)
        self._params = params
        self._forward = _jitted_forward(bundle.config)

    @property
    def dim(self) -> int:
        return self.bundle.config.output_dim

    def maxlen(self, kind: str) -> int:
        """Token budget of a query or a document (texts are cut to it)."""
        if kind == aligner_lib.QUERY and self.query_maxlen is not None:
            return self.query_maxlen
        return self.bundle.config.maxlen(kind)

    def tokenize(self, texts: Sequence[str], kind: str) -> list[np.ndarray]:
        return self.bundle.tokenizer.encode_batch(list(texts), self.maxlen(kind))

    def count_truncated(
        self, texts: Sequence[str], token_ids: Sequence[np.ndarray], kind: str
    ) -> int:
        """How many of ``texts`` (``token_ids``: their :meth:`tokenize`) were cut, exactly: a
        text of exactly the budget is whole. Only the texts that reach the budget are
        tokenized again, with one token more."""
        maxlen = self.maxlen(kind)
        at_budget = [t for t, ids in zip(texts, token_ids, strict=True) if len(ids) >= maxlen]
        if not at_budget:
            return 0
        longer = self.bundle.tokenizer.encode_batch(at_budget, maxlen + 1)
        return int(sum(len(ids) > maxlen for ids in longer))

    def encode(
        self, texts: Sequence[str], kind: str, bar: progress.Progress | None = None
    ) -> list[EncodedText]:
        """Encodes ``texts`` (in order), counting them and their tokens on ``bar``."""
        ids = self.tokenize(texts, kind)
        out: list[EncodedText | None] = [None] * len(ids)
        for index, encoded in self.encode_token_ids(ids, kind, bar=bar):
            out[index] = encoded
        return out  # type: ignore[return-value]

    def encode_token_ids(
        self, token_ids: Sequence[np.ndarray], kind: str, bar: progress.Progress | None = None
    ) -> Iterator[tuple[int, EncodedText]]:
        """Yields ``(position, EncodedText)`` batch by batch (length buckets, not input order);
        each batch's texts and tokens are counted on ``bar`` (its rate starts after the first,
        compiling, batch).

        Batches come from ``tokenization.length_buckets`` and run through
        ``batching.iter_encoded_batches`` (several batches in flight on CPU, where XLA runs
        each fused op on one thread).
        """
        cfg = self.config
        lengths = np.array([len(t) for t in token_ids], dtype=np.int64)
        if len(lengths) and lengths.min() == 0:
            raise ConfigError("encode: a text produced no tokens (empty tokenisation)")

        def encode_fn(params, ids, mask):
            return self._run(params, ids, mask, kind)

        for indices, outputs in batching.iter_encoded_batches(
            encode_fn,
            self._params,
            token_ids,
            boundaries=cfg.bucket_lengths(self.maxlen(kind), kind),
            max_tokens_per_batch=cfg.max_tokens_per_batch,
            concurrent_batches=cfg.concurrent_batches,
        ):
            for i, (vectors, salience) in zip(indices, outputs, strict=True):
                yield (
                    int(i),
                    EncodedText(
                        token_ids=np.asarray(token_ids[i], dtype=np.int32),
                        vectors=vectors,
                        salience=salience,
                    ),
                )
            if bar is not None:
                bar.update(len(indices), tokens=int(lengths[indices].sum()))

    def warm_up(self, kind: str = aligner_lib.QUERY) -> tuple[int, ...]:
        """Compiles the encoder for one text of every bucket length of ``kind`` (the shapes a
        text encoded alone can take), through the same path as :meth:`encode_token_ids`, the
        buckets in parallel; returns the bucket lengths. After it, encoding a single text of
        any length compiles nothing (a batch of several texts may take other row counts)."""
        lengths = self.config.bucket_lengths(self.maxlen(kind), kind)
        texts = [np.zeros(length, np.int32) for length in lengths]  # id 0 (padding) everywhere
        for _ in self.encode_token_ids(texts, kind):
            pass
        return lengths

    def _run(self, params, ids: np.ndarray, mask: np.ndarray, kind: str):
        rows = ids.shape[0]
        pad = (-rows) % self._data_parallel
        if pad:  # the batch must split evenly over the mesh's data axis
            ids = np.concatenate([ids, np.zeros((pad, ids.shape[1]), ids.dtype)])
            mask = np.concatenate([mask, np.zeros((pad, mask.shape[1]), mask.dtype)])
        ids_j, mask_j = jax.device_put(ids), jax.device_put(mask)  # no compiled conversion
        if self.mesh is not None:
            ids_j = jax.device_put(ids_j, self._batch_sharding)
            mask_j = jax.device_put(mask_j, self._batch_sharding)
        vectors, salience = self._forward(params, ids_j, mask_j, kind)
        return np.asarray(vectors)[:rows], np.asarray(salience)[:rows]
