"""The documents of an index: each one's title, text and metadata, for hits and filters.

``documents.sqlite`` (SQLite, stdlib) beside the token store holds one table::

    documents(shard INTEGER, slot INTEGER,   -- the document's place in the store
              doc_id TEXT,                   -- its id
              title TEXT,                    -- NULL with IndexingConfig.store_text = False
              text BLOB,                     -- zlib-compressed UTF-8, NULL likewise
              metadata TEXT,                 -- a JSON object (always kept: filters read it)
              PRIMARY KEY (shard, slot))

Rows are keyed by (shard, row in shard), not by store position: a shard's rows are replaced in
one transaction when the shard is (re)encoded, so a re-run never duplicates them, and rows of a
shard the manifest does not list (an interrupted ``--add``) are never read. The store position
of a row is the number of documents of the shards before it plus its row (``DocumentTable``
maps them with the store's manifest).

Metadata of a BEIR record: every key besides ``_id``, ``title`` and ``text``; a ``metadata``
object (BEIR's own field) is merged into the top level, so ``{"metadata": {"year": 2015}}`` and
``{"year": 2015}`` both give ``{"year": 2015}``.

Filters (``compile_filter``) are JSON-style conditions on metadata fields, compiled to SQL over
``json_extract``: ``{"year": 2015}`` (equality), ``{"source": {"in": ["a", "b"]}}`` (membership),
``{"year": {"gte": 2010, "lt": 2020}}`` (ranges: ``gt``, ``gte``, ``lt``, ``lte``; also ``eq``,
``ne``), several fields at once (all must hold), a dotted name for a nested field (``"venue.name"``;
``\\.`` for a dot inside a key), and ``doc_id`` / ``title`` for the document's id and title (text:
an integer id names the document added under it, as in ``delete``; a range on them compares text and
takes a string). As in Qdrant: a field holding a list matches when one of its elements satisfies the
field's whole condition (``{"tags": "a"}`` keeps ``["a", "b"]``; ``{"years": {"gte": 2015, "lt":
2020}}`` keeps ``[2016]``, not ``[2010, 2025]``); ``ne`` keeps a document none of whose values
equals, also one without the field or with null; null means a missing or null field (``{"source":
null}``, also inside ``in``); booleans, numbers and strings never match each other (true is not 1,
2015 not "2015"). The result is a boolean mask over store positions, which search applies during
candidate generation. A table keeps the masks of its recent filters (``MASK_CACHE_BYTES``;
Elasticsearch's filter cache): a filter repeated on the same index snapshot costs no SQL (its
shards' rows never change; an update is a new snapshot).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import sqlite3
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aligner_jax.common import doc_ids, errors, fileio
from aligner_jax.common.errors import ConfigError, IndexIntegrityError
from aligner_jax.data import beir

FILE = "documents.sqlite"
MASK_CACHE_BYTES = 64 << 20  # masks of recent filters kept per table (one byte per document)
MASK_CACHE_ENTRIES = 256  # and at most this many filters,
MASK_CACHE_KEY_BYTES = 64 << 10  # each of parameters under this many characters
BUSY_TIMEOUT_S = 60.0  # several indexing processes of one job may write at once
_SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    shard INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    doc_id TEXT NOT NULL,
    title TEXT,
    text BLOB,
    metadata TEXT NOT NULL,
    PRIMARY KEY (shard, slot)
);
CREATE INDEX IF NOT EXISTS documents_doc_id ON documents (doc_id);
"""
RANGE_OPERATORS = {"eq": "=", "ne": "!=", "gt": ">", "gte": ">=", "lt": "<", "lte": "<="}
OPERATORS = tuple(RANGE_OPERATORS) + ("in",)
COLUMNS = ("doc_id", "title")  # filtered as columns; every other field is a metadata key


def fetch_sql(num_pairs: int) -> str:
    """The rows of ``num_pairs`` (shard, slot) pairs, each found through the primary key: the
    pairs are a table joined to ``documents`` (a row-value ``IN (VALUES ...)`` makes SQLite scan
    the whole table for every search)."""
    marks = ", ".join("(?, ?)" for _ in range(num_pairs))
    return (
        f"WITH wanted(shard, slot) AS (VALUES {marks}) "
        "SELECT d.shard, d.slot, d.doc_id, d.title, d.text, d.metadata "
        "FROM wanted CROSS JOIN documents AS d ON d.shard = wanted.shard AND d.slot = wanted.slot"
    )


@dataclasses.dataclass(frozen=True)
class IndexDocument:
    """A document to index with its metadata (``beir.Document``'s fields plus ``metadata``)."""

    doc_id: str
    title: str
    text: str
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)


#: The metadata object of a corpus record (see the module docstring).
metadata_of = beir.record_metadata


def _metadata(doc) -> dict[str, Any]:
    """A document's metadata: its ``metadata`` attribute (``beir.Document`` or ``IndexDocument``)
    or nothing."""
    meta = getattr(doc, "metadata", None)
    return dict(meta) if meta else {}


def _connect(path: Path, read_only: bool = False) -> sqlite3.Connection:
    if read_only:
        db = sqlite3.connect(
            f"file:{path}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False
        )
        try:
            db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except sqlite3.OperationalError:
            # A writer killed mid-transaction left a hot journal, which only a connection that
            # may write rolls back (SQLite does it on its first read); then read-only again.
            db.close()
            try:
                sqlite3.connect(path, timeout=BUSY_TIMEOUT_S).execute(
                    "SELECT count(*) FROM sqlite_master"
                ).connection.close()
            except sqlite3.OperationalError as e:
                raise IndexIntegrityError(
                    f"{path}: a write that failed left {path.name}-journal, which only a process "
                    f"allowed to write in {path.parent} can undo ({e}): run the next "
                    "aligner-index --add there, or search it once as a user who may write there "
                    f"(aligner-search --index_dir={path.parent} --query=test)"
                ) from None
            return _connect(path, read_only=True)
    else:
        db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S)
        db.executescript(_SCHEMA)
    return db


def write_shard(
    directory: str | Path, shard_index: int, docs: Sequence, store_text: bool = True
) -> None:
    """Replaces shard ``shard_index``'s rows by ``docs`` (objects with ``doc_id``, ``title``,
    ``text`` and optionally ``metadata``), in one transaction."""
    rows = []
    for row, doc in enumerate(docs):
        meta = json.dumps(_metadata(doc), ensure_ascii=False, allow_nan=False, default=str)
        title = doc.title if store_text else None
        text = zlib.compress(doc.text.encode("utf-8")) if store_text else None
        rows.append((shard_index, row, doc.doc_id, title, text, meta))
    path = Path(directory) / FILE
    try:
        db = _connect(path)
        try:
            with db:  # one transaction: the old rows of the shard go, the new ones come
                db.execute("DELETE FROM documents WHERE shard = ?", (shard_index,))
                db.executemany("INSERT INTO documents VALUES (?, ?, ?, ?, ?, ?)", rows)
        finally:
            db.close()
    except sqlite3.OperationalError as e:
        raise _write_error(path, e) from e


def _write_error(path: Path, error: sqlite3.OperationalError) -> Exception:
    """SQLite's refusal of a write as the one-line error of a storage that cannot take it, when
    it is one (a full disk, a file-size limit, a read-only folder); else the error itself."""
    text = str(error)
    for words, code in (("disk is full", errno.ENOSPC), ("readonly", errno.EROFS)):
        if words in text:
            undone = "its partial transaction is undone (by the next writer at the latest) and "
            return fileio.storage_error(path, code, undone)
    if "disk I/O error" in text:
        return errors.OutputWriteError(
            f"{path}: not written (SQLite: disk I/O error, e.g. a full disk or a file-size "
            "limit, ulimit -f); its transaction is rolled back by the next writer and the files "
            "completed before it are kept: free space or raise the limit and re-run"
        )
    return error


def shard_is_written(directory: str | Path, shard_index: int, doc_ids: Sequence[str]) -> bool:
    """Whether the rows of shard ``shard_index`` hold exactly ``doc_ids`` in order."""
    path = Path(directory) / FILE
    if not path.exists():
        return False
    db = _connect(path)  # the writer's check: it may roll back what a killed writer left
    try:
        got = db.execute(
            "SELECT doc_id FROM documents WHERE shard = ? ORDER BY slot", (shard_index,)
        ).fetchall()
    finally:
        db.close()
    return [g[0] for g in got] == list(doc_ids)


def ensure_shard(
    directory: str | Path, shard_index: int, docs: Sequence, store_text: bool = True
) -> bool:
    """Writes the rows of a shard written earlier without them (an index built before the
    documents table existed, or a job killed between the two writes); returns whether it
    wrote."""
    if shard_is_written(directory, shard_index, [d.doc_id for d in docs]):
        return False
    write_shard(directory, shard_index, docs, store_text)
    return True


def fill_missing(
    directory: str | Path, manifest: Mapping[str, Any], corpus: Mapping[str, Any]
) -> int:
    """Writes the rows of every shard of the store (its ``manifest``) that lacks them, its
    documents looked up by id in ``corpus`` (``{doc_id: Document}``): an index built before
    documents were stored gets them from its corpus. Returns how many shards were written."""
    directory = Path(directory)
    store_text = manifest.get("indexing", {}).get("store_text", True)
    written = 0
    for shard in manifest["shards"]:
        ids = fileio.read_json(directory / shard["files"]["doc_ids"]["path"])
        missing = [d for d in ids if d not in corpus]
        if missing:
            raise ConfigError(
                f"{directory}: shard {shard['name']} holds document {missing[0]!r}, which the "
                "corpus does not; give the corpus this index was built from"
            )
        written += ensure_shard(directory, shard["index"], [corpus[d] for d in ids], store_text)
    return written


def copy_shard(directory: str | Path, shard_index: int, sources: Sequence[tuple[int, int]]) -> None:
    """Writes shard ``shard_index``'s rows as copies of the rows ``sources`` (``(shard, slot)``
    pairs, in the new shard's order), in one transaction that first drops what the shard held
    (``updates.vacuum``: the documents that stay, moved to new shards). A source without a row
    (an ``add_encoded`` shard of an index without a table) is skipped."""
    path = Path(directory) / FILE
    try:
        db = _connect(path)
        try:
            with db:
                db.execute("DELETE FROM documents WHERE shard = ?", (shard_index,))
                db.executemany(
                    "INSERT INTO documents SELECT ?, ?, doc_id, title, text, metadata "
                    "FROM documents WHERE shard = ? AND slot = ?",
                    [(shard_index, slot, *src) for slot, src in enumerate(sources)],
                )
        finally:
            db.close()
    except sqlite3.OperationalError as e:
        raise _write_error(path, e) from e


def drop_unlisted(directory: str | Path, shards: Sequence[int]) -> int:
    """Deletes the rows of every shard not in ``shards`` (the committed manifest's) and gives
    their pages back to the file system (SQLite's ``VACUUM``); returns the rows deleted. Call
    it holding the writer lock: the rows of shards an earlier vacuum replaced, or an
    interrupted add wrote, are never read by the committed generation."""
    path = Path(directory) / FILE
    if not path.exists():
        return 0
    try:
        db = _connect(path)
        try:
            with db:
                db.execute("CREATE TEMP TABLE listed (shard INTEGER PRIMARY KEY)")
                db.executemany("INSERT INTO listed VALUES (?)", [(int(s),) for s in shards])
                deleted = db.execute(
                    "DELETE FROM documents WHERE shard NOT IN (SELECT shard FROM listed)"
                ).rowcount
            if deleted:
                db.execute("VACUUM")
        finally:
            db.close()
    except sqlite3.OperationalError as e:
        raise _write_error(path, e) from e
    return int(deleted)


# -- filters ------------------------------------------------------------------------------------
def _json_path(field: str) -> str:
    """SQLite's JSON path of a dotted field name; ``\\.`` is a dot inside a key
    (``"doi\\.org"`` is the key ``doi.org``, ``"venue.name"`` the nested field)."""
    parts = [p.replace("\0", ".") for p in field.replace("\\.", "\0").split(".")]
    if not all(parts):
        raise ConfigError(f"filter: field {field!r} has an empty part (write e.g. 'venue.name')")
    if any('"' in p for p in parts):  # SQLite's JSON paths cannot name such a key
        raise ConfigError(f"filter: field {field!r}: a key holding '\"' cannot be filtered on")
    return "$" + "".join(f'."{p}"' for p in parts)


def _check_value(field: str, op: str, value) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"filter: {field!r} {op} {value!r}: give a finite number")
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        raise ConfigError(
            f"filter: {field!r} {op} {value}: beyond 64-bit integers (what metadata can hold)"
        )
    if value is not None and not isinstance(value, (str, int, float, bool)):
        raise ConfigError(
            f"filter: {field!r} {op} {value!r}: expected a string, number, boolean or null "
            f"(a list goes in {{'in': [...]}})"
        )


def _column_value(field: str, op: str, value):
    """A filter value on a text column (``COLUMNS``), as the column holds it: a ``doc_id`` to
    compare for (in)equality goes through ``doc_ids.clean`` (an integer names the document
    added under it, as in ``delete`` and ``subset``); a range compares text, so it takes a
    string; a title is text. Anything else is refused rather than left to SQLite's affinity,
    which matched ``7`` as ``"7"`` for ``eq`` but not inside ``in``, and ordered ``{"gte": 7}``
    as text."""
    if value is None:
        return None
    if field == "doc_id" and op in ("eq", "ne", "in"):
        try:
            return doc_ids.clean(value)
        except ValueError as e:
            raise ConfigError(f"filter: 'doc_id' {op} {value!r}: a document id {e}") from None
    if not isinstance(value, str):
        what = (
            "document ids are text and a range compares them as text"
            if field == "doc_id"
            else "a title is text"
        )
        raise ConfigError(
            f"filter: {field!r} {op} {value!r}: {what}; give a string (e.g. {str(value)!r})"
        )
    return value


def _sql_value(value):
    return int(value) if isinstance(value, bool) else value  # JSON true is 1 in SQLite


# A filter value's JSON kind → the JSON types it matches. Values of different kinds never match
# (Qdrant's rule: the boolean true is not the number 1, the number 2015 not the string "2015").
_JSON_TYPES = {bool: "('true', 'false')", float: "('integer', 'real')", str: "('text')"}


def _json_kind(value) -> type:
    return bool if isinstance(value, bool) else float if isinstance(value, int | float) else str


def _test(value_sql: str, type_sql: str | None, op: str, operand) -> tuple[str, list]:
    """``(sql, params)``: one value (``value_sql``, of JSON type ``type_sql``; ``None`` for a
    table column, compared as SQLite compares it) satisfies ``op``: an SQL comparison with one
    value, or ``IN`` a list (one parameter however long the list: SQLite limits their number)."""
    if op != "IN":
        sql = f"{value_sql} {op} ?"
        if type_sql is not None:
            sql = f"({type_sql} IN {_JSON_TYPES[_json_kind(operand)]} AND {sql})"
        return sql, [_sql_value(operand)]
    groups = {}
    for v in operand:
        groups.setdefault(None if type_sql is None else _json_kind(v), []).append(v)
    sql, params = [], []
    for kind, values in groups.items():
        member = f"{value_sql} IN (SELECT j.value FROM json_each(?) AS j)"
        sql.append(member if kind is None else f"({type_sql} IN {_JSON_TYPES[kind]} AND {member})")
        params.append(json.dumps([_sql_value(v) for v in values]))
    return ("(" + " OR ".join(sql) + ")" if sql else "0"), params


def _path_sql(field: str) -> str:
    """The SQL string literal of a metadata field's JSON path."""
    return "'" + _json_path(field).replace("'", "''") + "'"


def _some_value(field: str, predicates: list[tuple[str, Any]]) -> tuple[str, list]:
    """``(sql, params)``: the field's value, or one element of a list it holds, satisfies every
    ``(op, operand)`` of ``predicates`` — one element all of them (Qdrant's rule:
    ``{"years": {"gte": 2015, "lt": 2020}}`` keeps ``[2016]``, not ``[2010, 2025]``). Never NULL:
    a missing field satisfies nothing."""

    def holds(value_sql: str, type_sql: str | None) -> tuple[str, list]:
        tests = [_test(value_sql, type_sql, op, operand) for op, operand in predicates]
        return " AND ".join(sql for sql, _ in tests), [p for _, ps in tests for p in ps]

    if field in COLUMNS:
        sql, params = holds(field, None)
        return f"COALESCE(({sql}), 0)", params
    path = _path_sql(field)
    each, each_params = holds("e.value", "e.type")
    scalar, scalar_params = holds(f"json_extract(metadata, {path})", f"json_type(metadata, {path})")
    sql = (
        f"(CASE json_type(metadata, {path}) WHEN 'array' THEN EXISTS (SELECT 1 FROM "
        f"json_each(metadata, {path}) AS e WHERE {each}) ELSE COALESCE(({scalar}), 0) END)"
    )
    return sql, each_params + scalar_params


def _is_null(field: str) -> str:
    """The field is missing or null (a list is not)."""
    value = field if field in COLUMNS else f"json_extract(metadata, {_path_sql(field)})"
    return f"{value} IS NULL"


def _field_clauses(field: str, condition: Mapping[str, Any]) -> list[tuple[str, list]]:
    """The ``(sql, params)`` that must all hold for one field's condition."""
    positive, clauses, null_in = [], [], False
    for op, value in condition.items():
        if op == "in":
            if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
                raise ConfigError(f"filter: {field!r} in {value!r}: expected a list of values")
            values = list(value)
            for v in values:
                _check_value(field, "in", v)
            if field in COLUMNS:
                values = [_column_value(field, "in", v) for v in values]
            null_in = any(v is None for v in values)
            positive.append(("IN", [v for v in values if v is not None]))
        elif op in RANGE_OPERATORS:
            _check_value(field, op, value)
            if field in COLUMNS:
                value = _column_value(field, op, value)
            if value is None:
                if op not in ("eq", "ne"):
                    raise ConfigError(f"filter: {field!r} {op} null: null is not ordered")
                clauses.append((("NOT " if op == "ne" else "") + _is_null(field), []))
            elif op == "ne":  # a missing field, null, or a list none of whose elements equals
                sql, params = _some_value(field, [("=", value)])
                clauses.append((f"NOT {sql}", params))
            else:
                positive.append((RANGE_OPERATORS[op], value))
        else:
            raise ConfigError(
                f"filter: {field!r} has an unknown operator {op!r}; use one of {OPERATORS}"
            )
    if positive:
        sql, params = _some_value(field, positive)
        if null_in and len(positive) == 1:  # {"in": [..., null]}: also a missing or null field
            sql = f"({sql} OR {_is_null(field)})"
        clauses.append((sql, params))
    return clauses


def compile_filter(filter: Mapping[str, Any]) -> tuple[str, list]:
    """``(where clause, parameters)`` of a filter (see the module docstring). A malformed filter
    is a ``ConfigError`` naming the field and the operators that exist."""
    if not isinstance(filter, Mapping):
        raise ConfigError(
            f"filter={filter!r}: expected a dict of field conditions, e.g. "
            '{"year": {"gte": 2015}, "source": {"in": ["a", "b"]}}'
        )
    clauses = []
    for field, condition in filter.items():
        if not isinstance(field, str) or not field:
            raise ConfigError(f"filter: field names are non-empty strings, got {field!r}")
        _json_path(field)  # a malformed name is refused whatever its condition
        if not isinstance(condition, Mapping):
            condition = {"eq": condition}
        if not condition:
            raise ConfigError(f"filter: {field!r} has an empty condition; use one of {OPERATORS}")
        clauses += _field_clauses(field, condition)
    where = " AND ".join(sql for sql, _ in clauses) or "1"
    return where, [p for _, params in clauses for p in params]


class DocumentTable:
    """Read access to ``documents.sqlite`` for the documents of one token store: contents of
    given store positions, and the mask of a filter (recent ones cached). One connection per
    thread (searchers are shared by server threads)."""

    def __init__(self, directory: str | Path, shards: Sequence[Mapping[str, Any]]):
        """``shards``: the store manifest's entries (``index``, ``num_docs``) in store order."""
        self.path = Path(directory) / FILE
        if not self.path.exists():
            raise IndexIntegrityError(
                f"{self.path} does not exist: this index keeps no document contents (built "
                "before they were stored); re-run the command that built it to add them "
                "(aligner-index with the same --corpus and --index_dir, or aligner-eval with the "
                "same --dataset_dir and --index_dir)"
            )
        indices = np.array([s["index"] for s in shards], np.int64)
        counts = np.array([s["num_docs"] for s in shards], np.int64)
        self.num_docs = int(counts.sum())
        self._start = np.full(int(indices.max()) + 1 if len(indices) else 0, -1, np.int64)
        self._start[indices] = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self._shard_starts = self._start[indices]
        self._shard_indices = indices
        self._local = threading.local()
        self._masks: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._masks_lock = threading.Lock()
        self._masks_kept = min(MASK_CACHE_ENTRIES, MASK_CACHE_BYTES // max(1, self.num_docs))
        self._anchor = self._shard_with_rows()

    def _shard_with_rows(self) -> int | None:
        """One of the store's shards that has rows in the table (None: none has)."""
        if not len(self._shard_indices):
            return None
        marks = ", ".join("?" * len(self._shard_indices))
        query = f"SELECT shard FROM documents WHERE shard IN ({marks}) LIMIT 1"
        row = self._db().execute(query, self._shard_indices.tolist()).fetchone()
        return None if row is None else int(row[0])

    def _check_snapshot(self) -> None:
        """Raises ``SnapshotGoneError`` once the rows of this store's shards were deleted (a
        second ``--vacuum`` after the one that replaced them): its answers would lack them."""
        if self._anchor is None:
            return
        query = "SELECT 1 FROM documents WHERE shard = ? LIMIT 1"
        if self._db().execute(query, (self._anchor,)).fetchone() is None:
            raise errors.SnapshotGoneError(
                f"{self.path}: the rows of this index snapshot's documents were removed by "
                "aligner-index --vacuum after it was opened; load the index again (searcher = "
                "searcher.refresh(), or Searcher.load)"
            )

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = _connect(self.path, read_only=True)
        return db

    def _positions(self, shards: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Store positions of (shard, row) pairs; -1 for shards the store does not list."""
        known = shards < len(self._start)
        start = np.where(known, self._start[np.where(known, shards, 0)], -1)
        return np.where(start >= 0, start + rows, -1)

    def fetch(self, positions: Sequence[int]) -> list[dict[str, Any] | None]:
        """``{"doc_id", "title", "text", "metadata"}`` of each store position (None for a
        position without a row). ``title``/``text`` are None in an index without text."""
        positions = np.asarray(positions, np.int64)
        if not len(positions):
            return []
        which = np.searchsorted(self._shard_starts, positions, side="right") - 1
        shards, rows = self._shard_indices[which], positions - self._shard_starts[which]
        pairs = list(zip(shards.tolist(), rows.tolist(), strict=True))
        found = {}
        for lo in range(0, len(pairs), 400):  # SQLite's parameter limit
            chunk = pairs[lo : lo + 400]
            cursor = self._db().execute(fetch_sql(len(chunk)), [v for pair in chunk for v in pair])
            for shard, row, doc_id, title, text, meta in cursor:
                found[(shard, row)] = {
                    "doc_id": doc_id,
                    "title": title,
                    "text": None if text is None else zlib.decompress(text).decode("utf-8"),
                    "metadata": json.loads(meta),
                }
        if len(found) < len(set(pairs)):  # a row is missing
            self._check_snapshot()
        return [found.get(pair) for pair in pairs]

    def mask(self, filter: Mapping[str, Any]) -> np.ndarray:
        """Boolean ``[num_docs]`` (read-only): the store positions whose document passes
        ``filter``. The masks of the most recent filters are kept (as many as fit in
        ``MASK_CACHE_BYTES``, at most ``MASK_CACHE_ENTRIES``): a repeated filter is not run
        again."""
        where, params = compile_filter(filter)
        key = (where, *params)
        with self._masks_lock:
            if key in self._masks:
                self._masks.move_to_end(key)
                return self._masks[key]
        out = self._run_filter(filter, where, params)
        out.setflags(write=False)
        if sum(len(p) for p in params if isinstance(p, str)) > MASK_CACHE_KEY_BYTES:
            return out
        with self._masks_lock:
            self._masks[key] = out
            while len(self._masks) > self._masks_kept:
                self._masks.popitem(last=False)
        return out

    def _run_filter(self, filter: Mapping[str, Any], where: str, params: list) -> np.ndarray:
        try:
            rows = self._db().execute(f"SELECT shard, slot FROM documents WHERE {where}", params)
            pairs = np.array(rows.fetchall(), np.int64).reshape(-1, 2)
        except sqlite3.OperationalError as e:
            shown = repr(dict(filter))
            shown = shown if len(shown) <= 200 else f"{shown[:200]}… ({len(shown):,} characters)"
            raise ConfigError(f"filter={shown}: {e}") from None
        self._check_snapshot()
        positions = self._positions(pairs[:, 0], pairs[:, 1])
        out = np.zeros(self.num_docs, bool)
        out[positions[(positions >= 0) & (positions < self.num_docs)]] = True
        return out

    def count(self) -> int:
        """Rows of the store's shards."""
        marks = ", ".join("?" * len(self._shard_indices))
        query = f"SELECT COUNT(*) FROM documents WHERE shard IN ({marks})"
        return int(self._db().execute(query, self._shard_indices.tolist()).fetchone()[0])
