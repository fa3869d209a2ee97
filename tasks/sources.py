"""In-memory example tables and the seqio data source that serves them deterministically.

Every retrieval task builds (once per process and configuration) a ``RetrievalExamples`` table:
a pool of unique texts and, per example, the pool indices of its query, its positive and its
``N`` negatives. ``RetrievalSource`` turns the table into a ``tf.data.Dataset`` of text examples
``{"query": str, "positive": str, "negatives": [N] str}`` with two int32 features that let the
loss leave false negatives out (``AlignerModel.loss_fn``):

* ``doc_keys [1+N]``: a content key of the positive and of each negative (``text_keys``: equal
  texts, equal keys, whichever task they come from);
* ``relevant_keys [MAX_RELEVANT]``: the keys of every text the table pairs with this example's
  query as a positive (its own positive included), padded with 0. A query with more is cut to
  ``MAX_RELEVANT`` (counted as ``relevant_keys_cut`` in the table's stats).

* ``shuffle=False``: table order.
* ``shuffle=True``: each epoch is a uniformly random permutation of the whole table, drawn with
  ``numpy.random.default_rng`` from a per-epoch key produced by
  ``tf.data.Dataset.random(seed, rerandomize_each_iteration=True)``. A fresh dataset built with
  the same ``seed`` therefore yields exactly the same examples in the same order, epoch after
  epoch (seqio repeats the source for ``num_epochs=None``), and different epochs use different
  permutations. Memory is one int64 permutation of the table per epoch.

So ``Task.get_dataset(..., shuffle=True, seed=s)`` is reproducible: a restarted job that skips
the batches it already consumed sees exactly the batches it would have seen. (As with any
seeded ``tf.data`` shuffle, iterating the *same* dataset object twice continues the seed
sequence; build a fresh dataset to restart.)

Sharding (``shard_info``) keeps examples ``index, index + num_shards, …`` of the table, before
shuffling, so hosts read disjoint examples.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
import zlib
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import numpy as np
import seqio
import tensorflow as tf
from absl import logging

from aligner_jax.common.errors import ConfigError

# Relevant documents per query the loss can tell apart from negatives (``relevant_keys``).
MAX_RELEVANT = 32


@dataclasses.dataclass(frozen=True)
class RetrievalExamples:
    """Training examples as indices into a pool of unique texts.

    Attributes:
      texts: the text pool (unique strings).
      query: ``[n]`` int64, pool index of each example's query.
      positive: ``[n]`` int64, pool index of its relevant document.
      negatives: ``[n, N]`` int64, pool indices of its ``N`` negatives (``N`` may be 0).
      stats: counts gathered while building (reported in logs and the one-line summary).
    """

    texts: tuple[str, ...]
    query: np.ndarray
    positive: np.ndarray
    negatives: np.ndarray
    stats: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        n = self.query.shape[0]
        if self.query.shape != (n,) or self.positive.shape != (n,):
            raise ValueError(
                f"RetrievalExamples: query {self.query.shape} and positive "
                f"{self.positive.shape} must both be [n]."
            )
        if self.negatives.ndim != 2 or self.negatives.shape[0] != n:
            raise ValueError(
                f"RetrievalExamples: negatives has shape {self.negatives.shape}; expected [n={n}, N]."
            )
        for name in ("query", "positive", "negatives"):
            values = getattr(self, name)
            if values.size and (values.min() < 0 or values.max() >= len(self.texts)):
                raise ValueError(
                    f"RetrievalExamples: {name} indexes outside the pool of {len(self.texts)} texts."
                )

    def __len__(self) -> int:
        return int(self.query.shape[0])

    @property
    def num_negatives(self) -> int:
        return int(self.negatives.shape[1])

    def relevant(self) -> tuple[np.ndarray, np.ndarray]:
        """``(splits, values)``: the pool indices of the positives the table pairs with each
        query text, as CSR rows over the pool (row ``t`` for the text of pool index ``t``)."""
        return self._relevant

    @functools.cached_property
    def _relevant(self) -> tuple[np.ndarray, np.ndarray]:
        size = max(len(self.texts), 1)
        pairs = np.unique(self.query * size + self.positive)  # sorted by query, then positive
        queries, positives = np.divmod(pairs, size)
        counts = np.bincount(queries, minlength=len(self.texts))
        splits = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return splits, positives.astype(np.int64)

    def example(self, i: int) -> dict[str, object]:
        """Example ``i`` as texts: ``{"query": str, "positive": str, "negatives": [str]}``."""
        return {
            "query": self.texts[self.query[i]],
            "positive": self.texts[self.positive[i]],
            "negatives": [self.texts[j] for j in self.negatives[i]],
        }


class TextPool:
    """Assigns each distinct text one pool index (insertion order); used by the builders."""

    def __init__(self):
        self._index: dict[str, int] = {}

    def add(self, text: str) -> int:
        index = self._index.get(text)
        if index is None:
            index = len(self._index)
            self._index[text] = index
        return index

    def __len__(self) -> int:
        return len(self._index)

    def texts(self) -> tuple[str, ...]:
        return tuple(self._index)


def make_examples(
    pool: TextPool,
    query: Sequence[int],
    positive: Sequence[int],
    negatives: Sequence[Sequence[int]],
    num_negatives: int,
    stats: dict[str, float] | None = None,
) -> RetrievalExamples:
    """Packs per-example pool indices into a ``RetrievalExamples`` (``negatives`` rows of N)."""
    n = len(query)
    neg = np.asarray(negatives, dtype=np.int64).reshape(n, num_negatives)
    return RetrievalExamples(
        texts=pool.texts(),
        query=np.asarray(query, dtype=np.int64).reshape(n),
        positive=np.asarray(positive, dtype=np.int64).reshape(n),
        negatives=neg,
        stats=dict(stats or {}),
    )


def text_keys(texts: Sequence[str]) -> np.ndarray:
    """int32 content keys in ``[1, 2³¹)`` (CRC-32 of the UTF-8 text): equal texts, equal keys.

    0 is the padding of ``relevant_keys``. Two given texts share a key with probability about
    2⁻³¹ (a pool of n texts holds about n²/2³² such pairs: ~18k among MS MARCO's 8.8M); a
    collision matters only when both texts meet in one batch, where it leaves one negative out
    of one row's softmax.
    """
    keys = np.fromiter(
        (zlib.crc32(t.encode("utf-8")) & 0x7FFF_FFFF for t in texts), np.int64, len(texts)
    )
    return np.maximum(keys, 1).astype(np.int32)


def file_fingerprint(paths: Sequence[str | os.PathLike]) -> tuple[tuple[str, int, int], ...]:
    """``(absolute path, size, mtime_ns)`` of each existing file: part of the cache keys."""
    out = []
    for path in paths:
        p = Path(path)
        if p.is_file():
            st = p.stat()
            out.append((str(p.resolve()), st.st_size, st.st_mtime_ns))
    return tuple(out)


_EXAMPLES_CACHE: dict[Hashable, RetrievalExamples] = {}
_CACHE_LOCK = threading.Lock()


def clear_examples_cache() -> None:
    """Forgets every example table built in this process."""
    with _CACHE_LOCK:
        _EXAMPLES_CACHE.clear()


def _permutation(size: int, key: np.int64) -> np.ndarray:
    seed = int(key) & 0xFFFF_FFFF_FFFF_FFFF
    return np.random.default_rng(seed).permutation(size).astype(np.int64)


def examples_dataset(
    examples: RetrievalExamples,
    shuffle: bool,
    seed: int | None,
    shard_info: seqio.ShardInfo | None = None,
) -> tf.data.Dataset:
    """The text dataset of a table (see the module docstring for order and determinism)."""
    rows = np.arange(len(examples), dtype=np.int64)
    if shard_info is not None and shard_info.num_shards > 1:
        rows = rows[shard_info.index :: shard_info.num_shards]
    if rows.size == 0:
        raise ConfigError(
            f"The example table has {len(examples)} examples: nothing for shard "
            f"{shard_info.index if shard_info else 0} of "
            f"{shard_info.num_shards if shard_info else 1}."
        )
    pool = tf.constant(np.asarray(examples.texts, dtype=object), dtype=tf.string)
    content = text_keys(examples.texts)
    splits, values = examples.relevant()
    relevant = tf.RaggedTensor.from_row_splits(tf.constant(content[values]), tf.constant(splits))
    content = tf.constant(content)
    query = tf.constant(examples.query[rows])
    positive = tf.constant(examples.positive[rows])
    negatives = tf.constant(examples.negatives[rows].reshape(rows.size, examples.num_negatives))
    size = int(rows.size)

    if shuffle:
        keys = tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).take(1)

        def epoch(key):
            order = tf.numpy_function(
                lambda k: _permutation(size, k), [key], tf.int64, stateful=False
            )
            order.set_shape([size])
            return tf.data.Dataset.from_tensor_slices(order)

        order = keys.flat_map(epoch)
    else:
        order = tf.data.Dataset.range(size)

    def lookup(i):
        documents = tf.concat([positive[i][None], negatives[i]], axis=0)
        own = content[positive[i]]
        others = relevant[query[i]]
        # The row's own positive first, so that a query with more than MAX_RELEVANT keeps it.
        mine = tf.concat([own[None], tf.boolean_mask(others, others != own)], 0)[:MAX_RELEVANT]
        return {
            "query": tf.gather(pool, query[i]),
            "positive": tf.gather(pool, positive[i]),
            "negatives": tf.gather(pool, negatives[i]),
            "doc_keys": tf.gather(content, documents),
            "relevant_keys": tf.ensure_shape(
                tf.pad(mine, [[0, MAX_RELEVANT - tf.shape(mine)[0]]]), [MAX_RELEVANT]
            ),
        }

    return order.map(lookup, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


class RetrievalSource(seqio.DataSource):
    """A seqio ``DataSource`` over a ``RetrievalExamples`` table built on first use.

    Args:
      name: the task name (for logs and errors).
      config_fn: returns the source configuration (a hashable, usually a frozen dataclass);
        called at ``get_dataset`` time, i.e. after gin bindings are parsed.
      build_fn: ``build_fn(config, split) -> RetrievalExamples``.
      fingerprint_fn: ``fingerprint_fn(config, split) -> hashable`` of the input files (size and
        modification time), so an edited file is re-read.
      splits: the seqio splits the source accepts.
    """

    def __init__(
        self,
        name: str,
        config_fn: Callable[[], Hashable],
        build_fn: Callable[[Hashable, str], RetrievalExamples],
        fingerprint_fn: Callable[[Hashable, str], Hashable],
        splits: Sequence[str] = ("train",),
    ):
        super().__init__(splits=splits, num_input_examples=None, caching_permitted=True)
        self._name = name
        self._config_fn = config_fn
        self._build_fn = build_fn
        self._fingerprint_fn = fingerprint_fn

    @property
    def supports_arbitrary_sharding(self) -> bool:
        return True

    def list_shards(self, split: str) -> Sequence[str]:
        return [split]

    def config(self) -> Hashable:
        """The source configuration under the current gin bindings (cheap: reads no data)."""
        return self._config_fn()

    def examples(self, split: str = "train") -> RetrievalExamples:
        """The (cached) example table of ``split`` under the current gin configuration."""
        if split not in self.splits:
            raise ConfigError(
                f"Task {self._name!r} has no split {split!r}; available: {list(self.splits)}."
            )
        config = self._config_fn()
        key = (self._name, config, split, self._fingerprint_fn(config, split))
        with _CACHE_LOCK:
            cached = _EXAMPLES_CACHE.get(key)
        if cached is not None:
            return cached
        start = time.perf_counter()
        examples = self._build_fn(config, split)
        seconds = time.perf_counter() - start
        if len(examples) == 0:
            raise ConfigError(
                f"Task {self._name!r} (split {split!r}) produced no examples from {config}; "
                "check the data files and bindings (see the warnings above)."
            )
        splits, _ = examples.relevant()
        cut = int(np.maximum(np.diff(splits) - MAX_RELEVANT, 0).sum())
        if cut:
            examples.stats["relevant_keys_cut"] = cut
            logging.warning(
                "%s[%s]: %d relevant documents of queries with more than %d are not told apart "
                "from in-batch negatives (sources.MAX_RELEVANT)",
                self._name,
                split,
                cut,
                MAX_RELEVANT,
            )
        stats = ", ".join(f"{k}={v:g}" for k, v in examples.stats.items())
        logging.info(
            "%s[%s]: %d examples, %d negatives each, %d unique texts, built in %.1f s (%s)",
            self._name,
            split,
            len(examples),
            examples.num_negatives,
            len(examples.texts),
            seconds,
            stats,
        )
        with _CACHE_LOCK:
            _EXAMPLES_CACHE[key] = examples
        return examples

    def get_dataset(
        self,
        split: str = "train",
        shuffle: bool = True,
        seed: int | None = None,
        shard_info: seqio.ShardInfo | None = None,
        *,
        sequence_length: dict[str, int] | None = None,
        use_cached: bool = False,
        num_epochs: int | None = 1,
    ) -> tf.data.Dataset:
        del sequence_length, use_cached, num_epochs  # seqio applies them after the source.
        return examples_dataset(self.examples(split), shuffle, seed, shard_info)

    def __repr__(self) -> str:
        return f"RetrievalSource(name={self._name!r}, splits={list(self.splits)})"
