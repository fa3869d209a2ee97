"""The served index of ``aligner-serve``: immutable snapshots, the batching search thread and the
serialised writer (no HTTP here: ``http_app`` is the API over it).

Every request is answered by one :class:`Snapshot` (a loaded ``Searcher``). Writes are serialised
(one at a time in this process; ``aligner_jax.Index``, the code of ``aligner-index --add/--delete``,
holds the index directory's writer lock, so ``aligner-index`` cannot write at the same moment),
applied to the index directory, and published by loading a new ``Searcher`` and swapping the
snapshot reference in one assignment. Searches that started on the old snapshot finish on it
(updates never modify a file in place: they write new files and rename them), so a search never
sees half an update.

Searches go through one batching thread: the queries waiting when it becomes free are encoded
together (``Searcher.search_batch``, grouped by page and filter), which keeps the throughput up
under concurrent clients on a CPU; each batch runs on one snapshot.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging

from aligner_jax.common import errors
from aligner_jax.data import beir
from aligner_jax.encoding.encoder import Encoder, EncodingConfig
from aligner_jax.retrieval import index_api
from aligner_jax.retrieval import searcher as search_lib


@dataclasses.dataclass(frozen=True)
class ServeLimits:
    """Bounds on what one request may ask (answered with a 4xx naming the bound).

    Attributes:
      max_request_bytes: body size of a search / explain / delete request.
      max_write_bytes: body size of ``POST /documents``.
      max_query_chars: characters of a query.
      max_k: hits per search.
      max_offset: the deepest page start (``offset``).
      max_documents: documents (or ids) per write request.
      max_batch: queries a search thread encodes together.
      search_threads: threads taking batches from the queue (each batch on one snapshot).
    """

    max_request_bytes: int = 64 * 1024
    max_write_bytes: int = 32 * 1024 * 1024
    max_query_chars: int = 2000
    max_k: int = 1000
    max_offset: int = 10_000
    max_documents: int = 10_000
    max_batch: int = 32
    search_threads: int = 1

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value < 1:
                raise errors.ConfigError(f"--{field.name}={value!r}: must be an int >= 1")


class ApiError(Exception):
    """A request the client must change: answered with ``status`` and ``{"detail": message}``."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


class DocumentTexts:
    """Title, text and metadata of the indexed documents, by id.

    Read from the corpus file the index's manifest names (``manifest["corpus"]["path"]``) plus
    the documents added through the server; an index whose corpus moved answers hits without
    text."""

    def __init__(self, records: dict[str, tuple[str, str, dict]]):
        self._records = records

    @classmethod
    def from_manifest(cls, manifest: dict) -> DocumentTexts:
        path = Path(manifest.get("corpus", {}).get("path", ""))
        path = path / "corpus.jsonl" if path.is_dir() else path
        records = {}
        if path.is_file():
            for doc in beir.iter_corpus(path, check_duplicates=False):
                records[doc.doc_id] = (doc.title, doc.text, dict(doc.metadata or {}))
        return cls(records)

    def get(self, doc_id: str) -> tuple[str, str, dict]:
        return self._records.get(doc_id, ("", "", {}))

    def with_changes(
        self, added: Sequence[Mapping[str, Any]] = (), deleted: Sequence[str] = ()
    ) -> DocumentTexts:
        """A new lookup (the old one is left as it is, for the old snapshot)."""
        records = dict(self._records)
        for doc in added:
            records[doc["id"]] = (
                doc.get("title", ""),
                doc["text"],
                dict(doc.get("metadata") or {}),
            )
        for doc_id in deleted:
            records.pop(doc_id, None)
        return DocumentTexts(records)


def _fallback_texts(searcher: search_lib.Searcher) -> DocumentTexts | None:
    """Texts from the corpus file, for an index built before ``documents.sqlite`` existed."""
    if searcher.documents is not None:
        return None
    return DocumentTexts.from_manifest(searcher.store.manifest)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One consistent state of the index: what a request is answered from."""

    searcher: search_lib.Searcher
    documents: DocumentTexts | None  # only for an index without documents.sqlite
    generation: int
    loaded_at: float

    def hit(self, hit: search_lib.Hit) -> dict[str, Any]:
        """The response form of a hit; title, text and metadata from ``documents.sqlite``, or
        from the corpus file for an index without it."""
        title, text, metadata = hit.title, hit.text, dict(hit.metadata or {})
        if text is None and self.documents is not None:
            title, text, metadata = self.documents.get(hit.doc_id)
        return {
            "doc_id": hit.doc_id,
            "score": float(hit.score),
            "rank": int(hit.rank),
            "title": title or "",
            "text": text or "",
            "metadata": metadata,
        }

    def document(self, doc_id: str) -> tuple[str, str]:
        """``(title, text)`` of one live document (``("", "")`` when unknown or without text)."""
        position = self.searcher.doc_positions.get(doc_id)
        if position is None or self.searcher.store.deleted[position]:
            return "", ""
        table = self.searcher.documents
        row = table.fetch([position])[0] if table is not None else None
        if row is not None and row.get("text") is not None:
            return row.get("title") or "", row["text"]
        title, text, _ = self.documents.get(doc_id) if self.documents else ("", "", {})
        return title, text

    @property
    def num_docs(self) -> int:
        store = self.searcher.store
        return int(store.num_docs - store.deleted.sum())


@dataclasses.dataclass
class _Pending:
    text: str
    k: int
    offset: int
    filter: dict | None
    future: concurrent.futures.Future
    depth: int | None = None

    @property
    def group(self) -> tuple:
        """Queries of one group are searched together (same page, depth and filter)."""
        filter = json.dumps(self.filter, sort_keys=True, default=str)
        return self.k, self.offset, self.depth, filter


class IndexService:
    """The served index: the current snapshot, the batching search threads and the writer.

    Args:
      index_dir: the index folder (``aligner-index`` / ``aligner-eval``).
      loader: ``loader(index_dir, encoder)`` → a ``Searcher`` (``encoder`` is ``None`` the first
        time, then the first searcher's, so a reload does not load the model again).
      limits: request bounds.
      warm_batches: compile the batched shapes at start, and again for each new snapshot before
        it answers (``Searcher.warm_batches``: after it nothing compiles while serving; the
        binary does; tests need not).
      refresh_s: every so many seconds, look for changes another process committed to the index
        directory and serve them (:meth:`refresh`); 0: never.
    """

    def __init__(
        self,
        index_dir: str | Path,
        loader: Callable[[str, Encoder | None], search_lib.Searcher] | None = None,
        limits: ServeLimits | None = None,
        warm_batches: bool = False,
        refresh_s: float = 0.0,
    ):
        self.index_dir = str(index_dir)
        self.limits = limits or ServeLimits()
        self._loader = loader or (lambda d, enc: search_lib.Searcher.load(d, encoder=enc))
        searcher = self._loader(self.index_dir, None)
        self._snapshot = Snapshot(searcher, _fallback_texts(searcher), 0, time.time())
        self._index: index_api.Index | None = None
        self._write_lock = threading.Lock()
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._latencies: collections.deque[float] = collections.deque(maxlen=10_000)
        self._counts = collections.Counter()
        self._started = time.time()
        self._warm = warm_batches
        if warm_batches:
            self._warm_batches(searcher)
        self._workers = [
            threading.Thread(target=self._search_loop, name=f"search-{i}", daemon=True)
            for i in range(self.limits.search_threads)
        ]
        for worker in self._workers:
            worker.start()
        self._closed = threading.Event()
        if refresh_s > 0:
            threading.Thread(
                target=self._refresh_loop, args=(refresh_s,), name="refresh", daemon=True
            ).start()

    def _warm_batches(self, searcher: search_lib.Searcher) -> None:
        """Compiles the batches the batching thread forms (2, 4, 8, ... rows) at the two
        shortest query lengths, where nearly all queries fall (``Searcher.warm_batches``; a
        longer query is then searched alone, in shapes ``Searcher.load`` compiled)."""
        start = time.perf_counter()
        shapes = searcher.warm_batches(self.limits.max_batch)
        logging.info(
            "aligner-serve: %d batched query shapes compiled in %.1f s",
            shapes,
            time.perf_counter() - start,
        )

    # -- reading -----------------------------------------------------------------------------------
    @property
    def snapshot(self) -> Snapshot:
        """The snapshot new requests are answered from (one reference read: never half-swapped)."""
        return self._snapshot

    def submit(
        self,
        text: str,
        k: int = 10,
        offset: int = 0,
        filter: dict | None = None,
        depth: int | None = None,
    ) -> concurrent.futures.Future:
        """Queues a search (``Searcher.search``'s arguments); the future gives
        ``(snapshot, SearchResults)``."""
        pending = _Pending(text, k, offset, filter, concurrent.futures.Future(), depth)
        self._queue.put(pending)
        return pending.future

    def _search_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                self._queue.put(None)  # for the other search threads
                return
            batch = [first]
            while len(batch) < self.limits.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                batch.append(item)
            # a request cancelled while queued (its client gone, a timeout) is not searched
            batch = [p for p in batch if p.future.set_running_or_notify_cancel()]
            try:
                self._run_batch(batch)
            except Exception as e:  # noqa: BLE001 - the thread must outlive any one batch
                logging.exception("aligner-serve: a search batch failed")
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(e)

    def _run_batch(self, batch: list[_Pending]) -> None:
        if not batch:
            return
        snapshot = self._snapshot  # the whole batch runs on one snapshot
        self._counts["batches"] += 1
        self._counts["batched_queries"] += len(batch)
        groups: dict[tuple, list[_Pending]] = {}
        for p in batch:
            groups.setdefault(p.group, []).append(p)
        for group in groups.values():
            self._run_group(snapshot, group)

    def _run_group(self, snapshot: Snapshot, group: list[_Pending], retry: bool = True) -> None:
        first = group[0]
        try:
            results = snapshot.searcher.search_batch(
                [p.text for p in group],
                k=first.k,
                offset=first.offset,
                filter=first.filter,
                depth=first.depth,
            )
        except errors.SnapshotGoneError as gone:  # the index was vacuumed: search its commit
            failure: Exception = gone
            if retry:
                try:
                    self.refresh()
                    return self._run_group(self._snapshot, group, retry=False)
                except Exception as e:  # noqa: BLE001 - the group's answer, as for any failure
                    failure = e
            for p in group:
                p.future.set_exception(failure)
            return
        except Exception as e:  # noqa: BLE001 - one bad query must not fail its group: run alone
            if len(group) > 1:
                for p in group:
                    self._run_group(snapshot, [p])
            else:
                first.future.set_exception(e)
            return
        for p, hits in zip(group, results, strict=True):
            p.future.set_result((snapshot, hits))

    def record(self, took_ms: float, ok: bool) -> None:
        self._counts["searches" if ok else "failed_searches"] += 1
        if ok:
            self._latencies.append(took_ms)

    def close(self) -> None:
        """Stops the search threads (each passes the stop mark on to the next) and the
        refreshes."""
        self._closed.set()
        self._queue.put(None)
        for worker in self._workers:
            worker.join(timeout=10)

    # -- writing -------------------------------------------------------------------------------
    def _writer(self, snapshot: Snapshot) -> index_api.Index:
        """The index opened for writing (``aligner_jax.Index``), with the served model."""
        if self._index is None:
            encoder = Encoder(snapshot.searcher.query_encoder().bundle, EncodingConfig())
            self._index = index_api.Index.open(self.index_dir, encoder=encoder)
        return self._index

    def add(self, documents: Sequence[Mapping[str, Any]]) -> dict:
        """Encodes and adds ``documents`` (``{"id", "text", "title", "metadata"}`` each; one
        transaction of ``Index.add``), then publishes a new snapshot."""
        with self._write_lock:
            old = self._latest()  # ids another process committed meanwhile clash too
            known = old.searcher.store.live_positions()  # a deleted id may be added again
            clash = [d["id"] for d in documents if d["id"] in known]
            if clash:
                raise ApiError(
                    409,
                    f"documents: {len(clash)} ids are already in the index (e.g. {clash[:3]}); "
                    "DELETE /documents them first or use new ids",
                )
            summary = self._writer(old).add(list(documents))
            self._publish_committed(old, added=documents)
        self._counts["added_documents"] += len(documents)
        return {"added": summary["added_docs"], "generation": self._snapshot.generation}

    def delete(self, ids: Sequence[str]) -> dict:
        """Deletes ``ids`` (one transaction of ``Index.delete``), then publishes a new
        snapshot."""
        with self._write_lock:
            old = self._latest()
            store = old.searcher.store
            live = {d for d, dead in zip(store.doc_ids, store.deleted, strict=True) if not dead}
            unknown = [d for d in ids if d not in live]
            if unknown:
                raise ApiError(
                    404,
                    f"ids: {len(unknown)} are not live documents of the index (e.g. "
                    f"{unknown[:3]}); nothing was deleted",
                )
            self._writer(old).delete(list(ids))
            self._publish_committed(old, deleted=ids)
        self._counts["deleted_documents"] += len(ids)
        return {"deleted": len(ids), "generation": self._snapshot.generation}

    def _publish_committed(self, old: Snapshot, **changes) -> None:
        """:meth:`_publish` after a write committed: a failure to load the new state is logged
        and counted, not answered as a failed write (it is done; a retry would clash), and the
        next refresh serves it."""
        try:
            self._publish(old, **changes)
        except Exception:  # noqa: BLE001 - the write stands whatever loading it does
            self._counts["publish_errors"] += 1
            logging.exception("aligner-serve: a committed write is not served yet (next refresh)")

    def _publish(self, old: Snapshot, added=(), deleted=()) -> None:
        """Loads the index as the write left it and makes it the snapshot of new requests."""
        searcher = self._loader(self.index_dir, old.searcher.encoder)
        if self._warm:  # before it answers anything
            self._warm_batches(searcher)
        documents = old.documents.with_changes(added, deleted) if old.documents else None
        self._snapshot = Snapshot(searcher, documents, old.generation + 1, time.time())

    def refresh(self) -> bool:
        """Moves to the newest committed state of the index directory when another process
        (``aligner-index --add/--delete/--compact``, ``aligner_jax.Index``) changed it
        (``Searcher.refresh``); returns whether a new snapshot was published."""
        with self._write_lock:
            old = self._snapshot
            return self._latest() is not old

    def _latest(self) -> Snapshot:
        """The snapshot of the newest committed state (published when it is new); called under
        the write lock."""
        old = self._snapshot
        searcher = old.searcher.refresh()
        if searcher is old.searcher:
            return old
        if self._warm:
            self._warm_batches(searcher)
        self._snapshot = Snapshot(searcher, old.documents, old.generation + 1, time.time())
        self._counts["refreshes"] += 1
        return self._snapshot

    def _refresh_loop(self, every_s: float) -> None:
        while not self._closed.wait(every_s):
            try:
                self.refresh()
            except errors.USER_ERRORS as e:  # e.g. a writer mid-transaction: next time
                logging.warning("aligner-serve: index not refreshed: %s", e)
            except Exception:  # noqa: BLE001 - a bug is logged, and the next refresh still runs
                self._counts["refresh_errors"] += 1
                logging.exception("aligner-serve: index not refreshed")

    # -- stats -----------------------------------------------------------------------------------
    def stats(self) -> dict:
        snap = self._snapshot
        store = snap.searcher.store
        lat = np.asarray(self._latencies, np.float64)
        pct = {f"p{q}": round(float(np.percentile(lat, q)), 3) for q in (50, 95, 99) if len(lat)}
        return {
            "index_dir": self.index_dir,
            "generation": snap.generation,
            "snapshot_loaded_at": snap.loaded_at,
            "num_docs": snap.num_docs,
            "num_deleted": int(store.deleted.sum()),
            "num_tokens": int(store.num_tokens),
            "model": store.manifest.get("model", {}),
            "backend": "exhaustive" if snap.searcher.config.exhaustive else "centroid",
            "alignment": str(snap.searcher.alignment),
            "uptime_s": round(time.time() - self._started, 3),
            "pid": os.getpid(),  # which process answered (aligner-serve --workers)
            "counts": dict(self._counts),
            "search_latency_ms": pct,
            "limits": dataclasses.asdict(self.limits),
        }
