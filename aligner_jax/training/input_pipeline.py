"""Training input pipeline: a seqio task → fixed-shape numpy batches, resumable exactly.

The task's examples are produced deterministically for a given seed (seqio shuffling with a fixed
seed, deterministic preprocessing), so the stream of batches is a pure function of
``DataConfig.identity()``. The pipeline position saved in checkpoints is the number of batches
consumed; a restarted job skips that many batches and continues with exactly the batches an
uninterrupted job would have seen. (For very large tasks, cache the task with seqio's cache tool so
that skipping reads cached records instead of re-running preprocessing.)

The stream is the same on every process of a multi-process job: each process reads every global
batch and places the rows of its own devices (``trainer``: ``jax.make_array_from_callback``). The
data order therefore does not depend on the number of processes: 2 processes x 1 device train on
exactly the batches of 1 process x 2 devices, and a checkpoint's position (global batches
consumed) resumes under any process count. The price is that each process runs the whole
pipeline (tokenizing what other processes' devices train on); for very large tasks cache the task
(seqio's cache tool) or replay saved batches.

``save_batches`` materialises the first N global batches of a pipeline into one ``.npz``; a run
with ``DataConfig.cached_batches`` pointing at it replays exactly those batches without seqio or
TensorFlow (e.g. to measure an accelerator host's step rate, or to debug one batch). The file
records the pipeline identity it was made from and is refused for any other.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import gin
import jax
import numpy as np

from aligner_jax.common import checks, fileio
from aligner_jax.common.errors import ConfigError

DEFAULT_FEATURE_LENGTHS = {"query": 64, "doc": 256}


# The configurables that point the registered tasks at their data (tasks/): a job resumed with
# other values of theirs would train on other examples than its checkpoint's batches count.
SOURCES = ("beir_train_source", "msmarco_train_source", "selfsup_train_source", "supervised_rate")
# The tokenizer of the tasks: recorded even when unbound (``{}``, the default WordPiece), so a
# resume can tell "unbound then" from a checkpoint written before stop 89 that did not record it.
VOCABULARY = "task_vocabulary"


def source_bindings() -> dict:
    """``{configurable: {parameter: value}}`` of the gin bindings of ``SOURCES`` (macros
    resolved; values as JSON keeps them), those bound at all, and of ``VOCABULARY``."""
    out = {}
    for name in SOURCES:
        try:
            bound = gin.get_bindings(name)
        except ValueError:  # not registered: the tasks were not imported (cached batches)
            continue
        if bound:
            out[name] = json.loads(json.dumps(bound, sort_keys=True, default=repr))
    try:
        out[VOCABULARY] = json.loads(json.dumps(gin.get_bindings(VOCABULARY), sort_keys=True))
    except ValueError:  # not registered: the tasks were not imported (cached batches)
        pass
    return out


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
    cached_batches: replay batches saved by ``save_batches`` from this ``.npz`` instead of running
      the seqio task (the file must have been made from the same pipeline; every process of a
      multi-process job reads it).
      Not part of ``identity()``: the replayed batches are the pipeline's own.
    """

    task: str = "beir_train_bm25"
    split: str = "train"
    batch_size: int = 32
    query_length: int = 64
    doc_length: int = 256
    seed: int = 0
    shuffle: bool = True
    cached_batches: str | None = None

    def __post_init__(self):
        checks.integer("DataConfig.batch_size", self.batch_size, minimum=1)
        checks.integer("DataConfig.query_length", self.query_length, minimum=1)
        checks.integer("DataConfig.doc_length", self.doc_length, minimum=1)
        checks.integer("DataConfig.seed", self.seed, minimum=0)

    def identity(self) -> dict:
        """What a resumed job must share with the checkpoint: these fields but
        ``cached_batches``, and the bindings of the tasks' data sources (``SOURCES``)."""
        identity = dataclasses.asdict(self)
        del identity["cached_batches"]
        identity["sources"] = source_bindings()
        return identity

    @property
    def feature_lengths(self) -> dict[str, int]:
        return {"query": self.query_length, "doc": self.doc_length}


def check_task(config: DataConfig) -> None:
    """Refuses, before any work, a task or mixture that is not registered, a split it lacks, a
    mixture of tasks with different numbers of negatives, or data bindings the pipeline cannot
    use (read from the bindings alone: no data is read). Nothing to check when batches are
    replayed."""
    if config.cached_batches:
        return
    import seqio  # noqa: PLC0415  (TensorFlow: only when the task runs)

    from aligner_jax import tasks  # noqa: F401, PLC0415  (importing registers the tasks)

    if config.task not in seqio.TaskRegistry.names() and config.task not in (
        seqio.MixtureRegistry.names()
    ):
        raise ConfigError(
            f"DataConfig.task={config.task!r} is not a registered seqio task or mixture "
            f"(registered tasks: {sorted(seqio.TaskRegistry.names())}; mixtures: "
            f"{sorted(seqio.MixtureRegistry.names())})"
        )
    splits = seqio.get_mixture_or_task(config.task).splits
    if config.split not in splits:
        raise ConfigError(
            f"DataConfig.split={config.split!r}: the task {config.task!r} has the split(s) "
            f"{sorted(splits)}"
        )
    _check_sources(config)


def _check_sources(config: DataConfig) -> None:
    """Each retrieval source's bindings (read without reading data), a mixture's numbers of
    negatives, and the feature lengths against the vocabulary's framing tokens."""
    import seqio  # noqa: PLC0415  (TensorFlow: only when the task runs)

    from aligner_jax import tasks  # noqa: PLC0415  (TensorFlow, as above)

    task_or_mixture = seqio.get_mixture_or_task(config.task)
    members = getattr(task_or_mixture, "tasks", [task_or_mixture])
    counts = {
        task.name: getattr(task.source.config(), "num_negatives", None)
        for task in members
        if isinstance(task.source, tasks.sources.RetrievalSource)
    }
    if len(set(counts.values())) > 1:
        raise ConfigError(
            f"DataConfig.task={config.task!r} mixes tasks with different numbers of negatives "
            f"per example ({', '.join(f'{k}: {v}' for k, v in counts.items())}); every batch "
            "row holds the same number of documents: bind the same num_negatives for each "
            "source (selfsup_train_source.num_negatives, beir_train_source.num_negatives, …)"
        )
    for task in members:
        vocabulary = task.output_features["query"].vocabulary
        tasks.features.check_feature_lengths(
            vocabulary, config.feature_lengths, counts.get(task.name)
        )


def _dataset(config: DataConfig):
    """The shuffled, endlessly repeated, converted (unbatched) dataset of ``config``."""
    import seqio  # noqa: PLC0415  (TensorFlow: only when the task runs)

    from aligner_jax import tasks  # noqa: PLC0415  (TensorFlow, as above)

    return seqio.get_dataset(
        config.task,
        config.feature_lengths,
        tasks.AlignerFeatureConverter(),
        dataset_split=config.split,
        shuffle=config.shuffle,
        seed=config.seed,
        num_epochs=None,
        verbose=False,
    )


def train_batches(config: DataConfig, start_batch: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """Yields every global batch, from batch ``start_batch`` on (the same on every process).

    Batches are dicts of numpy arrays: ``query_tokens [b, Lq]`` and ``doc_tokens [b, 1+N, Ld]``
    int32 (0 = padding), with b = ``batch_size``, and the documents' content keys ``doc_keys
    [b, 1+N]`` and ``relevant_keys [b, R]`` that tell false negatives apart (``tasks.sources``).
    """
    if config.cached_batches:
        return _replay_batches(config, start_batch)
    check_task(config)
    ds = _dataset(config).batch(config.batch_size, drop_remainder=True)
    if start_batch:
        ds = ds.skip(start_batch)
    return ds.as_numpy_iterator()


TOKEN_KEYS = ("query_tokens", "doc_tokens")
# Saved and replayed when the batches have them (files saved before stop 89 do not).
OPTIONAL_KEYS = ("doc_keys", "relevant_keys")


def save_batches(config: DataConfig, num_batches: int, path: str | os.PathLike) -> Path:
    """Writes the first ``num_batches`` batches of ``config``'s pipeline to ``path`` (``.npz``).

    One process only (the file holds global batches). Written atomically (`fileio.atomic_write`),
    so an interrupted call leaves no partial file.
    """
    if jax.process_count() != 1:
        raise ConfigError("save_batches runs on one process (it writes global batches)")
    if num_batches < 1:
        raise ConfigError(f"save_batches: num_batches={num_batches} must be at least 1")
    source = dataclasses.replace(config, cached_batches=None)
    stream = train_batches(source)
    batches = [next(stream) for _ in range(num_batches)]
    keys = TOKEN_KEYS + tuple(k for k in OPTIONAL_KEYS if k in batches[0])
    arrays = {k: np.stack([b[k] for b in batches]) for k in keys}
    identity = np.array(json.dumps(source.identity()))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return fileio.atomic_write(path, lambda f: np.savez_compressed(f, identity=identity, **arrays))


def _replay_batches(config: DataConfig, start_batch: int) -> Iterator[dict[str, np.ndarray]]:
    path = Path(config.cached_batches)
    if not path.is_file():
        raise FileNotFoundError(f"DataConfig.cached_batches: {path} does not exist")
    try:
        with np.load(path) as f:
            saved = json.loads(str(f["identity"]))
            keys = TOKEN_KEYS + tuple(k for k in OPTIONAL_KEYS if k in f.files)
            arrays = {k: f[k] for k in keys}
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(
            f"DataConfig.cached_batches: {path} is not a saved batch file ({e})"
        ) from e
    want = config.identity()
    saved.pop("sources", None)  # the saving host's task bindings: this one may have no tasks
    want.pop("sources")
    if saved != want:
        diff = {k: (saved.get(k), want.get(k)) for k in want if saved.get(k) != want.get(k)}
        raise ConfigError(
            f"DataConfig.cached_batches: {path} was saved from another pipeline; differing "
            f"fields (saved, now): {diff}"
        )
    return _replay(path, arrays, start_batch)


def _replay(path: Path, arrays: dict[str, np.ndarray], start_batch: int):
    count = len(arrays["query_tokens"])
    for index in range(start_batch, count):
        yield {k: v[index] for k, v in arrays.items()}
    raise ConfigError(
        f"DataConfig.cached_batches: {path} holds {count} batches and the run needs more (from "
        f"batch {max(start_batch, count)}); save more with input_pipeline.save_batches"
    )
