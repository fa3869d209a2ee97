"""Training input pipeline: a seqio task → fixed-shape numpy batches, resumable exactly.

The task's examples are produced deterministically for a given seed (seqio shuffling with a fixed
seed, deterministic preprocessing), so the stream of batches is a pure function of
``DataConfig.identity()``. The pipeline position saved in checkpoints is the number of batches
consumed; a restarted job skips that many batches and continues with exactly the batches an
uninterrupted job would have seen. (For very large tasks, cache the task with seqio's cache tool so
that skipping reads cached records instead of re-running preprocessing.)

On several processes each takes its shard of the examples (``seqio.ShardInfo``) and produces its
local slice of the global batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import gin
import jax
import numpy as np
import seqio

DEFAULT_FEATURE_LENGTHS = {"query": 64, "doc": 256}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Attributes:
    task: a registered seqio task or mixture name (see ``tasks/``).
    split: the task split to train on.
    batch_size: GLOBAL batch size (queries per step; each brings 1 + num_negatives documents).
    query_length, doc_length: feature lengths (paper: 64 and 256).
    seed: shuffling seed (the data order is a pure function of this config).
    shuffle: shuffle the examples (with ``seed``).
    """

    task: str = "beir_train_bm25"
    split: str = "train"
    batch_size: int = 32
    query_length: int = 64
    doc_length: int = 256
    seed: int = 0
    shuffle: bool = True

    def identity(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def feature_lengths(self) -> dict[str, int]:
        return {"query": self.query_length, "doc": self.doc_length}


def _local_batch_size(global_batch: int) -> int:
    count = jax.process_count()
    if global_batch % count:
        raise ValueError(
            f"DataConfig.batch_size={global_batch} must be divisible by the number of processes "
            f"({count})"
        )
    return global_batch // count


def train_batches(config: DataConfig, start_batch: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Yields this process's slice of every global batch, from batch ``start_batch`` on.

    Batches are dicts of numpy arrays: ``query_tokens [b, Lq]`` and ``doc_tokens [b, 1+N, Ld]``
    int32 (0 = padding), with b = ``batch_size / process_count``.
    """
    import tasks  # noqa: PLC0415  (importing registers the tasks)

    if config.task not in seqio.TaskRegistry.names() and config.task not in (
        seqio.MixtureRegistry.names()
    ):
        raise ValueError(
            f"DataConfig.task={config.task!r} is not a registered seqio task or mixture "
            f"(registered tasks: {sorted(seqio.TaskRegistry.names())})"
        )
    shard = None
    if jax.process_count() > 1:
        shard = seqio.ShardInfo(index=jax.process_index(), num_shards=jax.process_count())
    ds = seqio.get_dataset(
        config.task,
        config.feature_lengths,
        tasks.AlignerFeatureConverter(),
        dataset_split=config.split,
        shuffle=config.shuffle,
        seed=config.seed,
        num_epochs=None,
        shard_info=shard,
        verbose=False,
    )
    local = _local_batch_size(config.batch_size)
    ds = ds.batch(local, drop_remainder=True)
    if start_batch:
        ds = ds.skip(start_batch)
    return ds.as_numpy_iterator()
