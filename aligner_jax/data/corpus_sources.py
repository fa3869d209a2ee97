"""Corpus streams for the indexing job: a BEIR ``corpus.jsonl``, a seqio task or a TFDS dataset.

``--corpus`` takes one of

  ``path/to/corpus.jsonl``   a BEIR corpus, streamed line by line (file:line errors);
  ``seqio:TASK_NAME``        the raw source of a registered seqio task (no preprocessors);
  ``tfds:NAME[/CONFIG]:VERSION``  a TFDS dataset (through ``seqio.TfdsDataSource``),

with ``--corpus_split`` choosing the split of the last two. Records are read in a fixed order
(``shuffle=False``), so a resumed or multi-host job sees the same shards. Which features hold the
id, title and text is set by :class:`CorpusFeatures` (gin). Register a task for ``seqio:`` with
a gin ``import my_project.tasks`` line (in a ``--gin_file``, or
``--gin_bindings='import my_project.tasks'``) of the module that adds it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import gin
import numpy as np

from aligner_jax.common import doc_ids, errors
from aligner_jax.common.errors import ConfigError
from aligner_jax.data import beir

SEQIO_PREFIX = "seqio:"
TFDS_PREFIX = "tfds:"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CorpusFeatures:
    """Feature names of a seqio/TFDS corpus. ``title_key`` may be absent from the dataset."""

    id_key: str = "_id"
    text_key: str = "text"
    title_key: str = "title"


def _decode(value, where: str, key: str, as_id: bool = False) -> str:
    """A feature's string; ``as_id``: a document id (``doc_ids.clean``: the rule of every
    corpus, so a bytes/str id is stripped and an integer one is its digits)."""
    if isinstance(value, np.ndarray):
        if value.ndim != 0:
            raise ConfigError(f"{where}: feature {key!r} must be a scalar, got shape {value.shape}")
        value = value.item()
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise errors.BeirFormatError(
                f"{where}: feature {key!r} is not valid UTF-8 ({e})"
            ) from e
    if not as_id:
        return str(value)
    try:
        return doc_ids.clean(value)
    except ValueError as reason:
        raise errors.BeirFormatError(f"{where}: the id (feature {key!r}) {reason}") from None


def _dataset(spec: str, split: str):
    import seqio  # noqa: PLC0415  (imports TensorFlow: only for seqio:/tfds: corpora)

    if spec.startswith(SEQIO_PREFIX):
        name = spec[len(SEQIO_PREFIX) :]
        try:
            task = seqio.get_mixture_or_task(name)
        except ValueError as e:
            raise ConfigError(
                f"--corpus={spec}: no seqio task or mixture named {name!r} is registered "
                "(import the module that registers it, e.g. a gin `import` line)"
            ) from e
        if not isinstance(task, seqio.Task):
            raise ConfigError(f"--corpus={spec}: {name!r} is a mixture; name one of its tasks")
        source = task.source
    else:
        name = spec[len(TFDS_PREFIX) :]
        if ":" not in name.strip(":"):  # seqio refuses a name without a version in a traceback
            raise ConfigError(
                f"--corpus={spec}: give a TFDS dataset with its version, tfds:NAME[/CONFIG]:VERSION "
                "(e.g. tfds:wiki40b/en:1.3.0)"
            )
        try:
            source = seqio.TfdsDataSource(tfds_name=name)
            source.splits  # noqa: B018 - reads the dataset's info: an unknown one fails here
        except (ValueError, KeyError) as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConfigError(f"--corpus={spec}: not a TFDS dataset it can read ({reason})") from e
    if split not in source.splits:
        raise ConfigError(
            f"--corpus_split={split}: {spec} has splits {sorted(source.splits)}, not {split!r}"
        )
    return source.get_dataset(split=split, shuffle=False)


def iter_dataset_documents(
    spec: str, split: str, features: CorpusFeatures | None = None
) -> Iterator[beir.Document]:
    """Streams the documents of a seqio task's source or a TFDS dataset in a fixed order.

    The source, split and feature names are checked here, before the first record is read.
    """
    features = features or CorpusFeatures()
    dataset = _dataset(spec, split)
    available = set(dataset.element_spec)
    for key, binding in ((features.id_key, "id_key"), (features.text_key, "text_key")):
        if key not in available:
            raise ConfigError(
                f"--corpus={spec} ({split}): no feature {key!r}; it has {sorted(available)}. "
                f"Set --gin.CorpusFeatures.{binding}=\"'...'\""
            )
    return _documents(dataset, f"{spec} ({split})", features, features.title_key in available)


def _documents(dataset, name: str, features: CorpusFeatures, has_title: bool):
    seen: dict[str, int] = {}
    for index, record in enumerate(dataset.as_numpy_iterator()):
        where = f"{name} record {index}"
        doc_id = _decode(record[features.id_key], where, features.id_key, as_id=True)
        if doc_id in seen:
            raise errors.BeirFormatError(
                f"{where}: duplicate document id {doc_id!r} (first at record {seen[doc_id]})"
            )
        seen[doc_id] = index
        title = _decode(record[features.title_key], where, features.title_key) if has_title else ""
        text = _decode(record[features.text_key], where, features.text_key)
        yield beir.Document(doc_id=doc_id, title=title, text=text)


def open_corpus(spec: str, split: str = "train") -> tuple[Iterator[beir.Document], dict]:
    """The document stream named by ``--corpus`` and its fingerprint (kept in the index config).

    A JSONL file is fingerprinted by size and sha256, and every record is read and checked once
    (its count is the job's progress total); a seqio/TFDS source by its name, split and feature
    names (its records are not read up front: that would run its pipeline twice). A corpus
    without any document is refused here, naming it, before anything is written.
    """
    if spec.startswith((SEQIO_PREFIX, TFDS_PREFIX)):
        features = CorpusFeatures()
        info = {"source": spec, "split": split, "features": dataclasses.asdict(features)}
        documents = iter_dataset_documents(spec, split, features)
        return _non_empty(documents, f"--corpus={spec} (split {split!r})"), info
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(
            f"--corpus={spec}: no such file (a BEIR corpus.jsonl, seqio:TASK or tfds:NAME)"
        )
    info = {"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": file_sha256(path)}
    # Every record is checked before anything is encoded: a bad line near the end of a large
    # corpus is one FILE:LINE error, not hours of shards its fixed file can no longer resume.
    records = sum(1 for _ in beir.iter_corpus(path))
    return _Counted(_non_empty(beir.iter_corpus(path), f"--corpus={spec}"), records), info


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 22) -> str:
    """The hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


class _Counted:
    """An iterator with a length: the documents of a corpus whose records were counted."""

    def __init__(self, documents: Iterator[beir.Document], count: int):
        self._documents, self._count = documents, count

    def __iter__(self):
        return self._documents

    def __next__(self) -> beir.Document:
        return next(self._documents)

    def __len__(self) -> int:
        return self._count


def _non_empty(documents: Iterator[beir.Document], name: str) -> Iterator[beir.Document]:
    """``documents`` unchanged, after checking (by reading the first) that there is one."""
    first = next(documents, None)
    if first is None:
        raise errors.BeirFormatError(
            f"{name}: the corpus holds no documents; give a corpus with at least one "
            '{"_id": ..., "title": ..., "text": ...} record'
        )
    return itertools.chain([first], documents)
