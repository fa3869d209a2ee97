"""``msmarco_triples``: MS MARCO passage-ranking training triples (the paper's training data, §4.1).

Two standard file layouts are read (plain or ``.gz``):

* text triples, ``triples.train.small.tsv``: ``query<TAB>positive passage<TAB>negative passage``;
* id triples, ``qidpidtriples.train.full.2.tsv``: ``qid<TAB>positive pid<TAB>negative pid``,
  with the texts in ``collection.tsv`` (``pid<TAB>passage``) and ``queries.train.tsv``
  (``qid<TAB>query``). Only the passages the triples use are kept in memory.

Triples sharing a (query, positive) form a group whose distinct negatives are shuffled
(seeded by ``seed`` and the pair) and cut into examples of ``num_negatives``: a group with ``G``
negatives gives ``ceil(G / N)`` examples, the last one completed with negatives of the group's
earlier examples, so ``N = 1`` gives one example per distinct triple. Groups with fewer than
``N`` distinct negatives are dropped (counted in the logs). With ``N = 0`` each distinct
(query, positive) pair is one example. Examples follow the first appearance of their pair in
the triples file.

TFDS: tensorflow-datasets 4.9 has no ``ms_marco`` builder, so the task reads the files above.
Point the task at them with gin::

    --gin.msmarco_train_source.data_dir="'/data/msmarco'"          # finds the standard names
    --gin.msmarco_train_source.triples_file="'/data/msmarco/triples.train.small.tsv'"
    --gin.msmarco_train_source.max_triples=10000000                 # bound memory
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import gin
import numpy as np
from absl import logging

from aligner_jax.common.errors import ConfigError
from aligner_jax.tasks import bindings, sources

_BINDING = "msmarco_train_source"
TEXT_TRIPLES = "triples.train.small.tsv"
ID_TRIPLES = "qidpidtriples.train.full.2.tsv"
COLLECTION = "collection.tsv"
QUERIES = "queries.train.tsv"
TRIPLE_FORMATS = ("auto", "text", "ids")


@dataclasses.dataclass(frozen=True)
class MsMarcoConfig:
    """Resolved files and options of ``msmarco_triples`` (see ``msmarco_train_source``)."""

    triples_file: str
    triples_format: str  # "text" or "ids"
    collection_file: str | None = None
    queries_file: str | None = None
    num_negatives: int = 1
    max_triples: int | None = None
    seed: int = 0

    def input_files(self) -> list[str]:
        return [f for f in (self.triples_file, self.collection_file, self.queries_file) if f]


def _with_gz(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    return open(path, "rb")


def iter_tsv(path: Path, min_fields: int, max_split: int = -1) -> Iterator[tuple[int, list[str]]]:
    """``(line number, fields)`` of a UTF-8 TSV (blank lines skipped); clear errors per line."""
    with _open_text(path) as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                raise ConfigError(
                    f"{path}:{line_number}: invalid UTF-8; MS MARCO files are UTF-8."
                ) from None
            if not line.strip():
                continue
            fields = line.split("\t", max_split) if max_split >= 0 else line.split("\t")
            if len(fields) < min_fields:
                raise ConfigError(
                    f"{path}:{line_number}: expected {min_fields} tab-separated fields, found "
                    f"{len(fields)}: {line[:80]!r}."
                )
            yield line_number, fields


def _sniff_format(path: Path) -> str:
    for _, fields in iter_tsv(path, 1):
        if len(fields) == 3 and all(f.strip().isdigit() for f in fields):
            return "ids"
        return "text"
    raise ConfigError(f"{path}: the triples file is empty.")


@gin.configurable
def msmarco_train_source(
    data_dir: str | None = None,
    triples_file: str | None = None,
    triples_format: str = "auto",
    collection_file: str | None = None,
    queries_file: str | None = None,
    num_negatives: int = 1,
    max_triples: int | None = None,
    seed: int = 0,
) -> MsMarcoConfig:
    """Data location and options of ``msmarco_triples`` (gin-configurable).

    Args:
      data_dir: folder with the standard MS MARCO files; used to find ``triples.train.small.tsv``
        (preferred) or ``qidpidtriples.train.full.2.tsv`` (+ ``collection.tsv``,
        ``queries.train.tsv``) when ``triples_file`` is not set.
      triples_file: the triples file itself (text or id form).
      triples_format: "auto" (ids when the first line is three integers), "text" or "ids".
      collection_file / queries_file: texts for id triples; default: beside the triples file.
      num_negatives: negatives per example (≥ 0).
      max_triples: read at most this many triples (None: all) to bound memory and time.
      seed: seed of the per-group negative shuffle.
    """
    bindings.check_choice(f"{_BINDING}.triples_format", triples_format, TRIPLE_FORMATS)
    num_negatives = bindings.check_int(f"{_BINDING}.num_negatives", num_negatives, 0)
    max_triples = bindings.check_int(f"{_BINDING}.max_triples", max_triples, 1, allow_none=True)
    seed = bindings.check_int(f"{_BINDING}.seed", seed, 0)
    if triples_file:
        triples = bindings.require_file(
            f"{_BINDING}.triples_file", triples_file, f"/data/msmarco/{TEXT_TRIPLES}"
        )
    elif data_dir:
        folder = bindings.require_directory(f"{_BINDING}.data_dir", data_dir, "/data/msmarco")
        triples = _with_gz(folder, TEXT_TRIPLES) or _with_gz(folder, ID_TRIPLES)
        if triples is None:
            raise ConfigError(
                f"{_BINDING}.data_dir={data_dir!r}: {folder} holds neither {TEXT_TRIPLES} nor "
                f"{ID_TRIPLES} (plain or .gz); set {_BINDING}.triples_file to the triples file."
            )
    else:
        raise ConfigError(
            f"msmarco_triples needs its training triples: set the gin binding "
            f"{_BINDING}.data_dir (a folder with {TEXT_TRIPLES} or {ID_TRIPLES}), e.g. "
            f"{bindings.flag(_BINDING + '.data_dir', '/data/msmarco')}, or "
            f"{_BINDING}.triples_file."
        )
    fmt = _sniff_format(triples) if triples_format == "auto" else triples_format
    collection = queries = None
    if fmt == "ids":
        folder = triples.parent
        collection = (
            bindings.require_file(f"{_BINDING}.collection_file", collection_file, COLLECTION)
            if collection_file
            else _with_gz(folder, COLLECTION)
        )
        queries = (
            bindings.require_file(f"{_BINDING}.queries_file", queries_file, QUERIES)
            if queries_file
            else _with_gz(folder, QUERIES)
        )
        for binding, found, name in (
            ("collection_file", collection, COLLECTION),
            ("queries_file", queries, QUERIES),
        ):
            if found is None:
                raise ConfigError(
                    f"{triples} holds id triples, which need {name} for their texts; none "
                    f"beside it in {folder}: set the gin binding {_BINDING}.{binding}."
                )
    return MsMarcoConfig(
        triples_file=str(triples),
        triples_format=fmt,
        collection_file=str(collection) if collection else None,
        queries_file=str(queries) if queries else None,
        num_negatives=num_negatives,
        max_triples=max_triples,
        seed=seed,
    )


def fingerprint(config: MsMarcoConfig, split: str):
    del split
    return sources.file_fingerprint(config.input_files())


def _read_groups(
    config: MsMarcoConfig,
) -> tuple[dict[tuple[str, str], list[str]], int]:
    """``{(query key, positive key): [negative keys]}`` in first-appearance order, and #triples."""
    path = Path(config.triples_file)
    groups: dict[tuple[str, str], list[str]] = {}
    count = 0
    for line_number, fields in iter_tsv(path, 3):
        if config.max_triples is not None and count >= config.max_triples:
            break
        if len(fields) != 3:
            raise ConfigError(
                f"{path}:{line_number}: expected 3 tab-separated fields (query, positive, "
                f"negative), found {len(fields)}: {'<TAB>'.join(fields)[:80]!r}."
            )
        query, positive, negative = (f.strip() for f in fields)
        if config.triples_format == "ids" and not (
            query.isdigit() and positive.isdigit() and negative.isdigit()
        ):
            raise ConfigError(
                f"{path}:{line_number}: expected three integer ids (qid, pid, pid), found "
                f"{'<TAB>'.join(fields)[:80]!r}; set {_BINDING}.triples_format=\"'text'\" for "
                "text triples."
            )
        groups.setdefault((query, positive), []).append(negative)
        count += 1
    return groups, count


def _read_texts(path: Path, needed: set[str], what: str) -> dict[str, str]:
    texts: dict[str, str] = {}
    for _, fields in iter_tsv(path, 2, max_split=1):
        key = fields[0].strip()
        if key in needed:
            texts[key] = fields[1]
    missing = needed - texts.keys()
    if missing:
        example = sorted(missing, key=lambda x: (len(x), x))[:3]
        raise ConfigError(
            f"{path}: {len(missing)} {what} ids used by the triples are missing (e.g. "
            f"{example}); use the {what} file that matches the triples."
        )
    return texts


def build_msmarco_examples(config: MsMarcoConfig, split: str) -> sources.RetrievalExamples:
    """The example table of ``msmarco_triples`` (see the module docstring)."""
    del split
    groups, num_triples = _read_groups(config)
    if config.triples_format == "ids":
        qids = {q for q, _ in groups}
        pids = {p for _, p in groups} | {n for negs in groups.values() for n in negs}
        query_text = _read_texts(Path(config.queries_file), qids, "query")
        passage_text = _read_texts(Path(config.collection_file), pids, "passage")
    else:
        query_text = passage_text = None

    pool = sources.TextPool()
    n = config.num_negatives
    query_rows, positive_rows, negative_rows = [], [], []
    dropped = 0
    for (query, positive), negs in groups.items():
        distinct = [d for d in dict.fromkeys(negs) if d != positive]
        if len(distinct) < n:
            dropped += 1
            continue
        q = pool.add(query_text[query] if query_text is not None else query)
        p = pool.add(passage_text[positive] if passage_text is not None else positive)
        if n == 0:
            query_rows.append(q)
            positive_rows.append(p)
            negative_rows.append([])
            continue
        rng = np.random.default_rng([config.seed, zlib.crc32(f"{query}\t{positive}".encode())])
        order = [distinct[i] for i in rng.permutation(len(distinct))]
        neg_index = [pool.add(passage_text[d] if passage_text is not None else d) for d in order]
        for chunk in range(math.ceil(len(order) / n)):
            row = neg_index[chunk * n : (chunk + 1) * n]
            row = row + neg_index[: n - len(row)]  # complete the last chunk from earlier ones
            query_rows.append(q)
            positive_rows.append(p)
            negative_rows.append(row)
    if dropped:
        logging.warning(
            "msmarco_triples: dropped %d of %d (query, positive) groups with fewer than %d "
            "distinct negatives.",
            dropped,
            len(groups),
            n,
        )
    stats = {"triples": num_triples, "groups": len(groups), "dropped_groups": dropped}
    return sources.make_examples(pool, query_rows, positive_rows, negative_rows, n, stats)
