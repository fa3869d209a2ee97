"""Teachers for miniCOIL: sentence encoders whose similarities define the meaning triplets.

A teacher is any callable ``texts -> [n, d]`` array of sentence embeddings (compared by cosine).
The default is the bundled all-MiniLM-L6-v2 used as sentence-transformers uses it: the mean of the
backbone's last hidden states over the real tokens, L2-normalised (max 256 tokens). The article's
teacher was mxbai-embed-large-v1; any stronger sentence encoder can be passed instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from aligner_jax.encoding import batching, tokenization
from aligner_jax.models import aligner as aligner_lib

Teacher = Callable[[Sequence[str]], np.ndarray]


class MeanPooledTeacher:
    """A BERT backbone's mean-pooled, L2-normalised sentence embedding (default: bundled MiniLM;
    else pass ``backbone_config``, ``params`` and ``tokenizer`` together)."""

    def __init__(
        self,
        backbone_config=None,
        params=None,
        tokenizer=None,
        max_length: int = 256,
        max_tokens_per_batch: int = tokenization.DEFAULT_MAX_TOKENS_PER_BATCH,
        log_every_s: float = 20.0,
    ):
        if backbone_config is None:
            backbone_config, params, tokenizer = batching.load_minilm()
        self.backbone_config, self.params, self.tokenizer = backbone_config, params, tokenizer
        self.max_length = max_length
        self.max_tokens_per_batch = max_tokens_per_batch
        self.log_every_s = log_every_s
        module = aligner_lib.build_backbone(self.backbone_config)

        def embed(params, ids, mask):
            hidden = module.apply({"params": params}, ids, mask, deterministic=True)
            w = mask[..., None].astype(hidden.dtype)
            mean = jnp.sum(hidden * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1.0)
            unit = mean / jnp.maximum(jnp.linalg.norm(mean, axis=-1, keepdims=True), 1e-12)
            return unit[:, None, :]  # one "token" per row for iter_encoded_batches

        self._embed = jax.jit(embed)

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        ids = self.tokenizer.encode_batch(list(texts), self.max_length)
        out: np.ndarray | None = None
        done, start, last = 0, time.perf_counter(), time.perf_counter()
        for indices, vectors in batching.iter_encoded_batches(
            self._embed,
            self.params,
            ids,
            boundaries=tokenization.default_bucket_boundaries(self.max_length),
            max_tokens_per_batch=self.max_tokens_per_batch,
        ):
            if out is None:
                out = np.zeros((len(ids), vectors[0].shape[-1]), np.float32)
            out[indices] = np.concatenate(vectors)
            done += len(indices)
            now = time.perf_counter()
            if now - last >= self.log_every_s:
                last = now
                rate = done / (now - start)
                logging.info(
                    "miniCOIL teacher: %d/%d sentences, %.0f sentences/s, ETA %.0f s",
                    done,
                    len(ids),
                    rate,
                    (len(ids) - done) / rate,
                )
        return out if out is not None else np.zeros((0, 0), np.float32)
