"""BEIR datasets: streaming readers, validated loading, download and a `stats` command.

A BEIR folder (Thakur et al., 2021; the evaluation format of ALIGNER §4.1) holds

    corpus.jsonl        one {"_id", "title", "text"} object per line (extra keys are ignored)
    queries.jsonl       one {"_id", "text"} object per line
    qrels/<split>.tsv   header `query-id<TAB>corpus-id<TAB>score`, then one judgment per line

Every reader here streams the file as bytes and decodes it line by line, so a bad line is reported
with its file and line number (`BeirFormatError`) instead of surfacing later as a crash deep in
indexing or evaluation. `iter_corpus` keeps only the ids in memory, for corpora larger than RAM.

Conventions follow the BEIR toolkit: numeric `_id`s become strings, a missing title is "", the
text a model sees is `title + " " + text` (`document_text`), and `load_beir` keeps only the
queries that have judgments in the requested split.

Command line (``aligner_jax/beir.py``, the ``aligner-beir`` binary):

    python -m aligner_jax.beir --download=scifact --to=data/beir
    python -m aligner_jax.beir --dataset_dir=../shared/data/beir/scifact --split=test
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from absl import logging

from aligner_jax.common import doc_ids
from aligner_jax.common.errors import BeirDownloadError, BeirFormatError, ConfigError

BEIR_URL_TEMPLATE = "https://public.ukp.informatik.tu-darmstadt.de/thakur/BEIR/datasets/{name}.zip"
QRELS_HEADER = ("query-id", "corpus-id", "score")
UNKNOWN_QRELS_MODES = ("error", "skip")

_LAYOUT_HELP = (
    "A BEIR folder must contain corpus.jsonl ({'_id', 'title', 'text'} per line), "
    "queries.jsonl ({'_id', 'text'} per line) and qrels/<split>.tsv "
    "(header 'query-id<TAB>corpus-id<TAB>score')."
)


@dataclasses.dataclass(frozen=True)
class Document:
    """One corpus entry. `title` is "" when the record has none; `metadata` holds the record's
    other fields (`record_metadata`)."""

    doc_id: str
    title: str
    text: str
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)


def record_metadata(record: Mapping[str, Any]) -> dict[str, Any]:
    """A corpus record's metadata: every key besides `_id`, `title` and `text`, with BEIR's own
    `metadata` object merged into the top level (`{"metadata": {"year": 2015}}` and
    `{"year": 2015}` both give `{"year": 2015}`)."""
    meta = {k: v for k, v in record.items() if k not in ("_id", "title", "text", "metadata")}
    nested = record.get("metadata")
    if isinstance(nested, Mapping):
        meta.update(nested)
    elif nested is not None:
        meta["metadata"] = nested
    return meta


@dataclasses.dataclass
class DatasetStats:
    """Counts gathered while loading a BEIR split (what was kept, dropped, skipped)."""

    num_documents: int = 0
    empty_documents: int = 0  # title and text both empty or whitespace: kept, counted here.
    mean_document_words: float = 0.0  # whitespace words of document_text(doc)
    max_document_words: int = 0
    num_queries_in_file: int = 0
    num_queries: int = 0  # queries kept: those with at least one judgment in the split
    queries_without_qrels: int = 0  # dropped (BEIR convention)
    mean_query_words: float = 0.0
    max_query_words: int = 0
    num_qrels: int = 0  # (query, document) judgments kept
    num_relevant_qrels: int = 0  # ... of which score > 0
    duplicate_qrels: int = 0  # repeated (query, document, score) lines, counted once
    negative_qrels: int = 0  # judgments with a score < 0: kept as 0 (judged, not relevant)
    unknown_query_qrels: int = 0  # judgment lines naming a query absent from queries.jsonl
    unknown_document_qrels: int = 0  # judgment lines naming a document absent from corpus.jsonl
    skipped_qrels: int = 0  # lines dropped with unknown_qrels="skip"
    blank_lines: int = 0  # empty lines in any of the three files, ignored

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class BeirDataset:
    """A loaded BEIR split.

    `corpus` keeps file order; `queries` keeps file order and holds only the queries judged in
    `qrels` (BEIR convention); `qrels[qid][doc_id] = relevance`.
    """

    name: str
    split: str
    path: Path
    corpus: dict[str, Document]
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]
    stats: DatasetStats


def document_text(doc: Document) -> str:
    """The text encoded for a document: `title + " " + text` when the title is non-empty (the
    BEIR / sentence-transformers convention), else `text`."""
    if doc.title.strip():
        return f"{doc.title} {doc.text}"
    return doc.text


# --------------------------------------------------------------------------------------------
# Query ids that are also document ids.

#: How a document whose id is the query's id is treated in a ranking (``--ignore_identical_ids``).
IDENTICAL_ID_MODES = ("same_text", "always", "never")


def _same_text(query: str, doc: Document) -> bool:
    def norm(text: str) -> str:
        return " ".join(text.split()).casefold()

    q = norm(query)
    return bool(q) and q in (norm(doc.text), norm(document_text(doc)))


@dataclasses.dataclass(frozen=True)
class IdenticalIds:
    """The one rule for ``results[qid][qid]``, applied to the run files, metrics and adaptation alike.

    BEIR drops the document whose id is the query's id from every ranking, because in ArguAna
    and Quora a query *is* a document and retrieving it says nothing. Where ids merely collide
    (CISI: every query id is also a document id, and 7 such documents are judged relevant) that
    silently removes judged documents. Modes: ``same_text`` (default: drop it only when the
    document's text, or title + text, is the query's text, whitespace and case ignored),
    ``always`` (BEIR's rule), ``never``.
    """

    mode: str
    drop: frozenset[str]  # query ids whose same-id document is removed from their ranking
    query_ids_in_corpus: int
    dropped_judged_relevant: int  # ... of the dropped ones, judged relevant (score > 0)
    kept_judged_relevant: int  # colliding ids kept as results, judged relevant

    @classmethod
    def of(
        cls,
        queries: Mapping[str, str],
        corpus: Mapping[str, Document],
        qrels: Mapping[str, Mapping[str, int]],
        mode: str = "same_text",
    ) -> IdenticalIds:
        if mode not in IDENTICAL_ID_MODES:
            raise ConfigError(
                f"--ignore_identical_ids={mode}: choose one of {list(IDENTICAL_ID_MODES)}"
            )
        colliding = [q for q in queries if q in corpus]
        if mode == "always":
            drop = frozenset(colliding)
        elif mode == "never":
            drop = frozenset()
        else:
            drop = frozenset(q for q in colliding if _same_text(queries[q], corpus[q]))

        def relevant(q: str) -> bool:
            return qrels.get(q, {}).get(q, 0) > 0

        return cls(
            mode=mode,
            drop=drop,
            query_ids_in_corpus=len(colliding),
            dropped_judged_relevant=sum(relevant(q) for q in drop),
            kept_judged_relevant=sum(relevant(q) for q in colliding if q not in drop),
        )

    def apply(self, results: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
        """``results`` without ``results[q][q]`` for every query id in ``drop``."""
        return {
            q: {d: s for d, s in docs.items() if not (d == q and q in self.drop)}
            for q, docs in results.items()
        }

    def describe(self) -> str:
        """One line for logs and summaries."""
        if not self.query_ids_in_corpus:
            return f"no query id is a document id (--ignore_identical_ids={self.mode})"
        kept = self.query_ids_in_corpus - len(self.drop)
        return (
            f"{self.query_ids_in_corpus} query ids are also document ids "
            f"(--ignore_identical_ids={self.mode}): {len(self.drop)} dropped from their own "
            f"ranking ({self.dropped_judged_relevant} judged relevant), {kept} kept "
            f"({self.kept_judged_relevant} judged relevant)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "query_ids_in_corpus": self.query_ids_in_corpus,
            "dropped": len(self.drop),
            "dropped_judged_relevant": self.dropped_judged_relevant,
            "kept_judged_relevant": self.kept_judged_relevant,
            "description": self.describe(),
        }


# --------------------------------------------------------------------------------------------
# Line readers.


def _require_file(path: Path, what: str) -> None:
    if path.is_file():
        return
    if path.exists():
        raise BeirFormatError(f"{path}: expected {what} to be a file, found a directory.")
    # a BEIR folder's file: its layout; any other file (--queries=FILE.jsonl): no folder rules
    layout = path.name in ("corpus.jsonl", "queries.jsonl") or what == "qrels file"
    raise BeirFormatError(f"{path}: {what} not found." + (f" {_LAYOUT_HELP}" if layout else ""))


def iter_decoded_lines(path: Path, error=BeirFormatError) -> Iterator[tuple[int, str]]:
    """Yields (1-based line number, decoded line without its line ending) for a UTF-8 file
    (a byte-order mark is skipped); a line that is not UTF-8 raises ``error`` naming it."""
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if line_number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # UTF-8 byte-order mark
            if line_number == 1 and raw.startswith(
                (b"\x1f\x8b", b"BZh", b"\xfd7zXZ", b"PK\x03\x04")
            ):
                raise error(
                    f"{path}: a compressed file (gzip, bzip2, xz or zip), not text; decompress "
                    "it first (e.g. gunzip) and give the .jsonl/.tsv it holds"
                )
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(
                    f"{path}:{line_number}: invalid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                    f"{e.start + 1}). The file must be UTF-8; re-encode it, e.g. "
                    f"`iconv -f latin1 -t utf-8`, or fix that line."
                ) from None
            yield line_number, line.rstrip("\r\n")


class _NotJson(ValueError):
    """``NaN``, ``Infinity`` or ``-Infinity``: accepted by Python's parser, not by JSON."""


def _reject_constant(name: str):
    raise _NotJson(name)


CORPUS_EXAMPLE = '{"_id": "d1", "title": "", "text": "..."}'
QUERY_EXAMPLE = '{"_id": "q1", "text": "..."}'


def iter_jsonl_records(
    path: str | os.PathLike, example: str = CORPUS_EXAMPLE
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Streams `(line_number, record)` from a JSON-lines file; blank lines are skipped.

    Raises BeirFormatError naming the file and line for invalid UTF-8, malformed JSON and
    records that are not JSON objects (``example``: the record the message shows).
    """
    path = Path(path)
    _require_file(path, path.name)
    for line_number, line in iter_decoded_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line, parse_constant=_reject_constant)
        except _NotJson as e:
            raise BeirFormatError(
                f"{path}:{line_number}: {e} is not JSON (Python writes it for a float that is "
                "not a number); write null or a number"
            ) from None
        except json.JSONDecodeError as e:
            raise BeirFormatError(
                f"{path}:{line_number}: malformed JSON at column {e.colno}: {e.msg}. Each line "
                f"must hold one complete JSON object, e.g. {example}."
            ) from None
        if not isinstance(record, dict):
            raise BeirFormatError(
                f"{path}:{line_number}: expected a JSON object per line, found "
                f"{type(record).__name__} {_preview(record)}. Wrap the record as "
                f'{{"_id": ..., "text": ...}}.'
            )
        yield line_number, record


def _count_blank_lines(path: Path) -> int:
    count = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                count += 1
    return count


def _preview(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _record_id(path: Path, line_number: int, record: dict[str, Any]) -> str:
    if "_id" not in record:
        raise BeirFormatError(
            f'{path}:{line_number}: record has no "_id" field (keys: {sorted(record)}). Every '
            f'line needs a unique non-empty string "_id".'
        )
    try:
        doc_id = doc_ids.clean(record["_id"])
    except ValueError as reason:
        raise BeirFormatError(
            f'{path}:{line_number}: "_id" {reason}. Every line needs a unique non-empty string '
            '"_id".'
        ) from None
    _check_no_lone_surrogate(path, line_number, "_id", doc_id)
    return doc_id


def is_blank(text: str) -> bool:
    """No visible character: only whitespace, control or format characters (a zero-width
    space, NUL): a query of them has nothing to search with."""
    return not any(c.isprintable() and not c.isspace() for c in text)


def _record_text(
    path: Path,
    line_number: int,
    record: dict[str, Any],
    key: str,
    required: bool,
    empty_allowed: bool = True,
) -> str:
    if key not in record or (record[key] is None and not required):
        if required:
            allowed = " (an empty string is allowed)" if empty_allowed else ""
            raise BeirFormatError(
                f'{path}:{line_number}: record has no "{key}" field (keys: {sorted(record)}). '
                f'Add "{key}": "..."{allowed}.'
            )
        return ""
    value = record[key]
    if not isinstance(value, str):
        raise BeirFormatError(
            f'{path}:{line_number}: "{key}" must be a string, found {type(value).__name__} '
            f"{_preview(value)}. Write it as a JSON string."
        )
    _check_no_lone_surrogate(path, line_number, key, value)
    return value


def _check_no_lone_surrogate(path: Path, line_number: int, key: str, value: str) -> None:
    surrogate = _LONE_SURROGATE.search(value)
    if surrogate:
        raise BeirFormatError(
            f'{path}:{line_number}: "{key}" contains the lone surrogate escape '
            f"\\u{ord(surrogate.group()):04x} at character {surrogate.start()}, which is not a "
            "Unicode character (valid JSON, invalid text); remove it or write the full pair."
        )


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_duplicate(
    path: Path, line_number: int, item_id: str, seen: dict[str, int], kind: str
) -> None:
    first = seen.get(item_id)
    if first is not None:
        raise BeirFormatError(
            f"{path}:{line_number}: duplicate {kind} id {item_id!r}, first defined on line "
            f"{first} ({path}:{first}). Ids must be unique; remove or rename one of the two."
        )
    seen[item_id] = line_number


def iter_corpus(path: str | os.PathLike, check_duplicates: bool = True) -> Iterator[Document]:
    """Streams the `Document`s of a corpus.jsonl in file order (for corpora larger than memory).

    Only the ids seen so far are kept (to report duplicates with both line numbers); pass
    `check_duplicates=False` to keep nothing.
    """
    path = Path(path)
    seen: dict[str, int] = {}
    for line_number, record in iter_jsonl_records(path):
        doc_id = _record_id(path, line_number, record)
        if check_duplicates:
            _check_duplicate(path, line_number, doc_id, seen, "document")
        title = _record_text(path, line_number, record, "title", required=False)
        text = _record_text(path, line_number, record, "text", required=True)
        yield Document(doc_id=doc_id, title=title, text=text, metadata=record_metadata(record))


def load_corpus(path: str | os.PathLike) -> dict[str, Document]:
    """Reads a whole corpus.jsonl into `{doc_id: Document}` (file order). Empty file -> error."""
    path = Path(path)
    corpus = {doc.doc_id: doc for doc in iter_corpus(path)}
    if not corpus:
        raise BeirFormatError(
            f"{path}: the corpus is empty (no records). Add one "
            f'{{"_id": ..., "title": ..., "text": ...}} object per line.'
        )
    return corpus


def iter_queries(path: str | os.PathLike) -> Iterator[tuple[str, str]]:
    """Streams `(query_id, text)` from a queries.jsonl in file order.

    A record with a non-empty ``title`` (a corpus.jsonl given as the queries; an empty one, as
    in Hugging Face's BeIR query exports, is allowed) and a query whose text is empty or
    whitespace (nothing to search with) are refused, naming the file and line.
    """
    path = Path(path)
    seen: dict[str, int] = {}
    for line_number, record in iter_jsonl_records(path, QUERY_EXAMPLE):
        query_id = _record_id(path, line_number, record)
        _check_duplicate(path, line_number, query_id, seen, "query")
        title = record.get("title")
        if isinstance(title, str) and title.strip():
            raise BeirFormatError(
                f'{path}:{line_number}: record has a "title": this is a corpus file '
                f"(corpus.jsonl), not queries. Give a queries.jsonl, one "
                f'{{"_id": ..., "text": ...}} object per line.'
            )
        text = _record_text(path, line_number, record, "text", True, empty_allowed=False)
        if is_blank(text):
            raise BeirFormatError(
                f"{path}:{line_number}: query {query_id!r} has an empty text (nothing to search "
                f"with). Give it a text or remove the line."
            )
        yield query_id, text


def load_queries(path: str | os.PathLike) -> dict[str, str]:
    """Reads a queries.jsonl into `{query_id: text}` (file order). Empty file -> error."""
    path = Path(path)
    queries = dict(iter_queries(path))
    if not queries:
        raise BeirFormatError(
            f"{path}: the query set is empty (no records). Add one "
            f'{{"_id": ..., "text": ...}} object per line.'
        )
    return queries


def check_not_a_corpus(
    path: str | os.PathLike, query_ids: Iterable[str], doc_ids: Iterable[str], corpus: str
) -> None:
    """Refuses a queries file whose ids cover every document id of ``corpus`` (and are more
    than one): the corpus itself given as the queries, every document becoming a query. Queries
    that share some ids with documents (ArguAna, Quora) pass."""
    docs = set(doc_ids)
    if len(docs) > 1 and docs <= set(query_ids):
        raise BeirFormatError(
            f"{path}: its ids include every one of the {len(docs):,} document ids of {corpus}: "
            f"this is the corpus, not queries. Give the queries file (queries.jsonl)."
        )


@dataclasses.dataclass(frozen=True)
class _QrelRow:
    line_number: int
    query_id: str
    doc_id: str
    score: int


def _iter_qrels_rows(path: Path) -> Iterator[_QrelRow]:
    """Validated qrels lines (header checked, 3 tab-separated columns, integer score)."""
    _require_file(path, "qrels file")
    header_seen = False
    for line_number, line in iter_decoded_lines(path):
        if not line.strip():
            continue
        columns = [c.strip() for c in line.split("\t")]
        if not header_seen:
            header_seen = True
            if tuple(c.lower() for c in columns) != QRELS_HEADER:
                raise BeirFormatError(
                    f"{path}:{line_number}: expected the header line "
                    f"'query-id<TAB>corpus-id<TAB>score', found {line[:80]!r}. Add that header as "
                    f"the first line (columns must be separated by tabs)."
                )
            continue
        if len(columns) != 3:
            hint = (
                " This looks like a TREC qrels line (query 0 doc score); convert it to "
                "query-id<TAB>corpus-id<TAB>score."
                if len(line.split()) == 4
                else ""
            )
            raise BeirFormatError(
                f"{path}:{line_number}: expected 3 tab-separated columns "
                f"(query-id, corpus-id, score), found {len(columns)}: {line[:80]!r}.{hint}"
            )
        query_id, doc_id, score_text = columns
        if not query_id or not doc_id:
            raise BeirFormatError(
                f"{path}:{line_number}: empty query-id or corpus-id in {line[:80]!r}."
            )
        try:
            score = int(score_text)
        except ValueError:
            raise BeirFormatError(
                f"{path}:{line_number}: score {score_text!r} is not an integer. BEIR relevance "
                f"scores are integers (0 = not relevant, 1, 2, ... = graded relevance)."
            ) from None
        yield _QrelRow(line_number, query_id, doc_id, score)
    if not header_seen:
        raise BeirFormatError(
            f"{path}: the qrels file is empty. It needs the header "
            f"'query-id<TAB>corpus-id<TAB>score' and at least one judgment line."
        )


def _collect_qrels(
    path: Path, rows: Iterator[_QrelRow], stats: DatasetStats | None = None
) -> dict[str, dict[str, int]]:
    qrels: dict[str, dict[str, int]] = {}
    lines: dict[tuple[str, str], int] = {}
    negative: list[int] = []
    for row in rows:
        key = (row.query_id, row.doc_id)
        judged = qrels.setdefault(row.query_id, {})
        if row.doc_id in judged:
            if judged[row.doc_id] != row.score:
                raise BeirFormatError(
                    f"{path}:{row.line_number}: query {row.query_id!r} and document "
                    f"{row.doc_id!r} are judged {row.score} here but {judged[row.doc_id]} on "
                    f"line {lines[key]} ({path}:{lines[key]}). Keep one of the two lines."
                )
            if stats is not None:
                stats.duplicate_qrels += 1
            continue
        if row.score < 0:
            negative.append(row.line_number)
        judged[row.doc_id] = max(row.score, 0)
        lines[key] = row.line_number
    if negative:
        logging.warning(
            "%s: %d judgment(s) with a negative score (first on line %d) are treated as score 0: "
            "judged, not relevant",
            path,
            len(negative),
            negative[0],
        )
        if stats is not None:
            stats.negative_qrels = len(negative)
    if not qrels:
        raise BeirFormatError(
            f"{path}: the qrels file has a header but no judgments. Add lines "
            f"'query-id<TAB>corpus-id<TAB>score'."
        )
    return qrels


def load_qrels(path: str | os.PathLike) -> dict[str, dict[str, int]]:
    """Reads a qrels TSV into `{query_id: {doc_id: score}}`.

    Repeated identical lines are counted once; the same pair judged with two different scores is
    an error naming both lines.
    """
    path = Path(path)
    return _collect_qrels(path, _iter_qrels_rows(path))


# --------------------------------------------------------------------------------------------
# Whole dataset.


def _available_splits(dataset_dir: Path) -> list[str]:
    qrels_dir = dataset_dir / "qrels"
    if not qrels_dir.is_dir():
        return []
    return sorted(p.stem for p in qrels_dir.glob("*.tsv"))


def _word_stats(texts: list[str]) -> tuple[float, int]:
    if not texts:
        return 0.0, 0
    lengths = [len(t.split()) for t in texts]
    return sum(lengths) / len(lengths), max(lengths)


def load_beir(
    dataset_dir: str | os.PathLike,
    split: str = "test",
    unknown_qrels: str = "error",
    skip_flag: str = "--unknown_qrels=skip",
) -> BeirDataset:
    """Loads and validates one split of a BEIR folder.

    Args:
      dataset_dir: folder with corpus.jsonl, queries.jsonl and qrels/<split>.tsv.
      split: qrels split to evaluate on (file name without .tsv).
      unknown_qrels: what to do with judgments naming a query or document that is not in the
        files: "error" (default; the message names the first offending line and the count) or
        "skip" (drop them and count them in `stats`).
      skip_flag: how the caller's user asks for "skip" (the error names it).

    Returns:
      A `BeirDataset` whose `queries` are the queries judged in the split (BEIR convention).
    """
    if unknown_qrels not in UNKNOWN_QRELS_MODES:
        raise ConfigError(
            f"unknown_qrels={unknown_qrels!r} (flag --unknown_qrels): expected one of "
            f"{list(UNKNOWN_QRELS_MODES)}."
        )
    dataset_dir = Path(dataset_dir)
    if not dataset_dir.is_dir():
        raise BeirFormatError(
            f"{dataset_dir}: dataset folder not found. {_LAYOUT_HELP} Download one with "
            f"`python -m aligner_jax.beir --download=NAME --to=DIR`."
        )
    corpus_path = dataset_dir / "corpus.jsonl"
    queries_path = dataset_dir / "queries.jsonl"
    qrels_path = dataset_dir / "qrels" / f"{split}.tsv"
    missing = [p.name for p in (corpus_path, queries_path) if not p.is_file()]
    if not qrels_path.is_file():
        missing.append(f"qrels/{split}.tsv")
    if missing:
        splits = _available_splits(dataset_dir)
        split_hint = f" Splits present in qrels/: {splits}." if splits else ""
        raise BeirFormatError(
            f"{dataset_dir}: missing {', '.join(missing)}. {_LAYOUT_HELP}{split_hint}"
        )

    stats = DatasetStats()
    corpus = load_corpus(corpus_path)
    all_queries = load_queries(queries_path)
    check_not_a_corpus(queries_path, all_queries, corpus, str(corpus_path))
    stats.blank_lines = sum(_count_blank_lines(p) for p in (corpus_path, queries_path, qrels_path))

    known: list[_QrelRow] = []
    unknown_query_lines: list[int] = []
    unknown_doc_lines: list[int] = []
    for row in _iter_qrels_rows(qrels_path):
        if row.query_id not in all_queries:
            unknown_query_lines.append(row.line_number)
        if row.doc_id not in corpus:
            unknown_doc_lines.append(row.line_number)
        if row.query_id in all_queries and row.doc_id in corpus:
            known.append(row)
    stats.unknown_query_qrels = len(unknown_query_lines)
    stats.unknown_document_qrels = len(unknown_doc_lines)
    if unknown_query_lines or unknown_doc_lines:
        first = min(unknown_query_lines[:1] + unknown_doc_lines[:1])
        num_lines = len(set(unknown_query_lines) | set(unknown_doc_lines))
        if unknown_qrels == "error":
            what = "query" if unknown_query_lines[:1] == [first] else "document"
            raise BeirFormatError(
                f"{qrels_path}:{first}: judgment names an unknown {what}; {num_lines} judgment "
                f"line(s) are affected ({len(unknown_query_lines)} name queries absent from "
                f"{queries_path.name}, {len(unknown_doc_lines)} name documents absent from "
                f"{corpus_path.name}). Fix the files, or pass {skip_flag} to drop and count them."
            )
        stats.skipped_qrels = num_lines
    if not known:
        raise BeirFormatError(
            f"{qrels_path}: no judgment is left after skipping {stats.skipped_qrels} line(s) "
            f"naming unknown queries or documents; check that the ids match {queries_path.name} "
            f"and {corpus_path.name}."
            if stats.skipped_qrels
            else f"{qrels_path}: holds no judgment (a header at most); give the split's "
            "(query-id, corpus-id, score) lines."
        )
    qrels = _collect_qrels(qrels_path, iter(known), stats)
    queries = {qid: text for qid, text in all_queries.items() if qid in qrels}
    if not queries:
        raise BeirFormatError(
            f"{qrels_path}: none of the {len(all_queries)} queries of {queries_path} has a "
            f"judgment in this split; check that the ids in both files match."
        )

    stats.num_documents = len(corpus)
    texts = [document_text(d) for d in corpus.values()]
    stats.empty_documents = sum(1 for t in texts if not t.strip())
    stats.mean_document_words, stats.max_document_words = _word_stats(texts)
    stats.num_queries_in_file = len(all_queries)
    stats.num_queries = len(queries)
    stats.queries_without_qrels = len(all_queries) - len(queries)
    stats.mean_query_words, stats.max_query_words = _word_stats(list(queries.values()))
    stats.num_qrels = sum(len(j) for j in qrels.values())
    stats.num_relevant_qrels = sum(1 for j in qrels.values() for s in j.values() if s > 0)
    if stats.num_qrels and not stats.num_relevant_qrels:
        logging.warning(
            "%s: none of its %d judgments has a score above 0: every metric will be 0",
            qrels_path, stats.num_qrels,
        )  # fmt: skip
    return BeirDataset(
        name=dataset_dir.resolve().name,
        split=split,
        path=dataset_dir,
        corpus=corpus,
        queries=queries,
        qrels=qrels,
        stats=stats,
    )


# --------------------------------------------------------------------------------------------
# Download.


def load_pair(
    dataset_dir: str | Path, query_id: str | None, doc_id: str | None
) -> tuple[str | None, str | None]:
    """Query text and document text (``title + " " + text``) by id from a BEIR folder.

    Either id may be None (that text then comes from elsewhere). Raises ``BeirFormatError``
    naming the id and the file when an id is absent (or the file is missing or malformed).
    """
    dataset_dir = Path(dataset_dir)
    if not dataset_dir.is_dir():
        raise BeirFormatError(
            f"--dataset_dir={dataset_dir}: not a folder; give a BEIR folder with corpus.jsonl "
            "and queries.jsonl."
        )
    query_text = doc_text = None
    if query_id is not None:
        path = dataset_dir / "queries.jsonl"
        queries = load_queries(path)
        if query_id not in queries:
            examples = ", ".join(repr(q) for q in list(queries)[:5])
            raise BeirFormatError(
                f"--query_id={query_id!r}: no query with this id in {path} ({len(queries)} "
                f"queries; the first ids are {examples})."
            )
        query_text = queries[query_id]
    if doc_id is not None:
        path = dataset_dir / "corpus.jsonl"
        count, first = 0, []
        for doc in iter_corpus(path, check_duplicates=False):
            if doc.doc_id == doc_id:
                doc_text = document_text(doc)
                break
            count += 1
            if len(first) < 5:
                first.append(repr(doc.doc_id))
        else:
            raise BeirFormatError(
                f"--doc_id={doc_id!r}: no document with this id in {path} ({count} documents; "
                f"the first ids are {', '.join(first)})."
            )
    return query_text, doc_text


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _safe_extract(archive: zipfile.ZipFile, to_dir: Path) -> None:
    root = to_dir.resolve()
    for member in archive.namelist():
        target = (root / member).resolve()
        if target != root and root not in target.parents:
            raise BeirDownloadError(f"archive member {member!r} would unpack outside {root}.")
    archive.extractall(root)


def download_dataset(
    name: str,
    to_dir: str | os.PathLike,
    url_template: str = BEIR_URL_TEMPLATE,
    timeout_s: float = 60.0,
) -> Path:
    """Downloads the official BEIR zip for `name` and unpacks it as `to_dir/name`.

    An already present `to_dir/name/corpus.jsonl` is kept as is. Network and archive failures
    raise `BeirDownloadError` with what to do instead.
    """
    if not _NAME_RE.match(name):
        raise ConfigError(f"dataset name {name!r}: expected a BEIR name such as 'scifact'.")
    to_dir = Path(to_dir)
    target = to_dir / name
    if (target / "corpus.jsonl").is_file():
        return target
    url = url_template.format(name=name)
    to_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=".zip.part", dir=to_dir)
    tmp_path = Path(tmp_name)
    try:
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout_s) as r:
                shutil.copyfileobj(r, out, length=1 << 20)
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise BeirDownloadError(
                f"could not download {url}: {reason}. This machine may have no network access: "
                f"download {name}.zip elsewhere and unzip it into {to_dir}, or point "
                f"--dataset_dir at an existing BEIR folder."
            ) from e
        try:
            with zipfile.ZipFile(tmp_path) as archive:
                _safe_extract(archive, to_dir)
        except zipfile.BadZipFile as e:
            raise BeirDownloadError(f"{url} did not return a valid zip archive: {e}.") from e
    finally:
        tmp_path.unlink(missing_ok=True)
    if not (target / "corpus.jsonl").is_file():
        raise BeirDownloadError(
            f"{url} unpacked into {to_dir} but {target / 'corpus.jsonl'} is missing; the "
            f"archive does not have the BEIR layout."
        )
    return target


# --------------------------------------------------------------------------------------------
# Command line.


def format_stats(dataset: BeirDataset) -> str:
    """A one-screen summary of a loaded split."""
    s = dataset.stats
    lines = [
        f"dataset {dataset.name} ({dataset.path}), split {dataset.split}",
        f"  documents        {s.num_documents:,} (empty: {s.empty_documents:,}; words mean "
        f"{s.mean_document_words:.1f}, max {s.max_document_words:,})",
        f"  queries          {s.num_queries:,} judged of {s.num_queries_in_file:,} in file "
        f"(dropped without qrels: {s.queries_without_qrels:,}; "
        f"words mean {s.mean_query_words:.1f}, max {s.max_query_words:,})",
        f"  qrels            {s.num_qrels:,} pairs ({s.num_relevant_qrels:,} with score > 0; "
        f"{s.num_qrels / max(s.num_queries, 1):.2f} per query; duplicates: {s.duplicate_qrels:,})",
        f"  skipped qrels    {s.skipped_qrels:,} (unknown queries: {s.unknown_query_qrels:,}, "
        f"unknown documents: {s.unknown_document_qrels:,})",
    ]
    return "\n".join(lines)
