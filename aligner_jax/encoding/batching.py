"""Running a BERT backbone over many token sequences: jitted encode functions, length-bucketed
batches, several batches in flight on CPU.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from aligner_jax.common.errors import ConfigError
from aligner_jax.encoding import tokenization
from aligner_jax.models.bert import BertConfig, BertEncoder
from aligner_jax.weights import bert_safetensors, minilm


def load_minilm(
    dtype: Any = jnp.float32,
) -> tuple[BertConfig, dict[str, Any], tokenization.Tokenizer]:
    """The bundled all-MiniLM-L6-v2: ``(config, params, tokenizer)``."""
    model_dir = minilm.minilm_model_dir()
    config, params = bert_safetensors.load_bert_from_safetensors(model_dir, dtype=dtype)
    return config, params, tokenization.Tokenizer(model_dir / "tokenizer.json")


def make_encode_fn(
    config: BertConfig, dtype: Any = jnp.float32
) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """A jitted ``(params, ids [B, L], mask [B, L]) -> hidden [B, L, H]`` inference function.

    Compiles once per input shape; use with ``tokenization.iter_padded_buckets`` to keep the
    number of shapes small.
    """
    model = BertEncoder(config, dtype=dtype)

    @jax.jit
    def encode(params, ids, mask):
        return model.apply({"params": params}, ids, mask, deterministic=True)

    return encode


def default_concurrent_batches(platform: str | None = None) -> int:
    """How many batches ``iter_encoded_batches`` keeps in flight by default.

    XLA:CPU runs each fused matmul of this encoder on one thread, so one batch at a time keeps
    about one core busy; running one batch per usable core in parallel uses them all. On
    accelerators one stream of batches suffices. ``platform``: where the batches run (default:
    JAX's default backend).
    """
    if (platform or jax.default_backend()) != "cpu":
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def iter_encoded_batches(
    encode_fn: Callable[[Any, jax.Array, jax.Array], jax.Array],
    params: Any,
    sequences: Sequence[np.ndarray],
    boundaries: Sequence[int] | None = None,
    max_tokens_per_batch: int = tokenization.DEFAULT_MAX_TOKENS_PER_BATCH,
    pad_id: int = 0,
    concurrent_batches: int | None = None,
) -> Iterator[tuple[np.ndarray, list[np.ndarray]]]:
    """Encodes unpadded token id arrays in length buckets, streaming the results.

    Yields ``(indices, vectors)`` per ``tokenization.length_buckets`` batch, in a deterministic
    order: ``vectors[r]`` is the ``[len(sequences[indices[r]]), H]`` float32 encoding (padding
    dropped). Up to ``concurrent_batches`` batches run at once (default
    ``default_concurrent_batches()``), at most twice that many are buffered.

    Args:
      encode_fn: ``make_encode_fn(config)`` or any jitted ``(params, ids, mask) -> [B, L, H]``
        (or a tuple of ``[B, L, ...]`` arrays: each sequence then gets a tuple of slices).
      params: its parameters.
      sequences: token id arrays (``Tokenizer.encode_batch``).
      boundaries: bucket lengths; multiples of 32 up to the longest sequence by default.
      max_tokens_per_batch: rows × padded length per batch.
      pad_id: id at padding positions.
      concurrent_batches: batches in flight at once.
    """
    if not sequences:
        return
    if boundaries is None:
        boundaries = tokenization.default_bucket_boundaries(max(len(s) for s in sequences))
    workers = default_concurrent_batches() if concurrent_batches is None else concurrent_batches
    if workers < 1:
        raise ConfigError(f"concurrent_batches={concurrent_batches} must be ≥ 1.")
    batches = tokenization.length_buckets(
        [len(s) for s in sequences], boundaries, max_tokens_per_batch
    )

    def encode_batch(batch: tokenization.BucketBatch) -> tuple[np.ndarray, list]:
        members = [sequences[i] for i in batch.indices]
        ids, mask = tokenization.pad_batch(members, batch.length, pad_id, batch_size=batch.rows)
        outputs = encode_fn(params, ids, mask)
        if isinstance(outputs, tuple):  # several per-token outputs, e.g. (vectors, salience)
            arrays = [np.asarray(o, dtype=np.float32) for o in outputs]
            # Copies, so no view pins the whole padded batch in memory.
            return batch.indices, [
                tuple(a[row, : len(m)].copy() for a in arrays) for row, m in enumerate(members)
            ]
        hidden = np.asarray(outputs, dtype=np.float32)
        return batch.indices, [hidden[row, : len(m)].copy() for row, m in enumerate(members)]

    if workers == 1 or len(batches) == 1:  # e.g. one query: no threads to start
        yield from map(encode_batch, batches)
        return
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="encode") as pool:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append(pool.submit(encode_batch, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def encode_sequences(
    encode_fn, params, sequences: Sequence[np.ndarray], **options
) -> list[np.ndarray]:
    """``iter_encoded_batches`` (same arguments) collected in input order: ``[len_i, H]`` float32
    per sequence."""
    out: list[np.ndarray | None] = [None] * len(sequences)
    for indices, vectors in iter_encoded_batches(encode_fn, params, sequences, **options):
        for i, v in zip(indices, vectors, strict=True):
            out[i] = v
    return out  # type: ignore[return-value]
