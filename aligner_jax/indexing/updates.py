"""Incremental updates of an index: add documents, delete (tombstone) them, re-cluster.

``aligner-index --index_dir=DIR --add=corpus.jsonl`` encodes only the new documents (with the
model recorded in ``encoder.json``) into new shards after the last one, appends them to the
manifest, and compresses their tokens with the existing centroids (``CentroidIndex.update``).
``--delete=ID,ID,...`` (or ``@file`` with one id per line) lists their store positions in the
manifest's ``deleted`` (an id deleted and added again is a new document):
the documents stay on disk and are never returned until ``--vacuum`` writes the store again
without them (``vacuum``). Each update is appended to the manifest's
``updates`` list. ``--compact`` re-clusters the search index over every stored token (new
centroids) when its drift (``CentroidIndex.drift``) exceeds ``DRIFT_LIMIT``, or always with
``--force_compact``. ``--search_index`` (without
``--corpus``) rebuilds the search index of an existing store: the repair of a missing, stale,
damaged or other store's ``search_index/``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from absl import logging

from aligner_jax.common import errors, progress
from aligner_jax.common.errors import ConfigError
from aligner_jax.data import beir, corpus_sources
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import Encoder, EncodingConfig
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import documents as documents_lib
from aligner_jax.indexing import indexer
from aligner_jax.indexing import token_store as ts


@contextlib.contextmanager
def writing(index_dir: str | Path) -> Iterator[None]:
    """Holds the index directory's writer lock, after removing what a killed writer left
    (``collect_garbage``): every update, from ``aligner-index`` or ``aligner_jax.Index``."""
    with indexer.writer_lock(index_dir):
        if (Path(index_dir) / ts.MANIFEST).exists():
            ci.collect_garbage(Path(index_dir))
        yield


# Updates that change no document: a re-run replacement is recognised across them.
_MAINTENANCE = ("vacuum", "compact", "force_compact", "search_index")


def _record(op: str, **fields) -> dict:
    return {"op": op, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **fields}


def _commit(directory: Path, manifest: dict, op: str, **fields) -> None:
    """Publishes an update in one atomic rename of the manifest: the store's new manifest and,
    when the index has a search index, its next generation (written first, beside the current
    one: ``CentroidIndex.update``). A crash before the rename leaves the index as it was."""
    if not manifest.get("search_index"):
        ts.write_manifest(directory, manifest)
        ci.collect_garbage(directory)
        return
    pending = ts.TokenStore(directory, manifest=manifest)
    index = ci.CentroidIndex.load_unchecked(pending).update(pending, op, **fields)
    index.commit(pending, manifest)


def add_documents(
    index_dir: str,
    corpus,
    encoder: Encoder | None = None,
    manifest: dict | None = None,
    replaces: str | None = None,
) -> dict:
    """Encodes the documents of ``corpus`` (a BEIR corpus.jsonl, or documents given in Python
    by ``aligner_jax.Index.add``) into new shards, committed in one update. ``manifest``: the
    index's pending manifest to add to (``--delete`` of the same command: both in one commit),
    else the committed one. ``replaces``: the sha256 of the file of a replacement, recorded so
    that a re-run of it is refused as done."""
    from_file = isinstance(corpus, (str, os.PathLike))
    label = f"--add={corpus}" if from_file else "Index.add"
    if from_file and not Path(corpus).is_file():
        raise errors.MissingPathError(
            f"{label}: no such file; give a corpus.jsonl of the documents to add (one "
            '{"_id", "title", "text"} per line)'
        )
    directory = Path(index_dir)
    pending = manifest is not None
    manifest = manifest if pending else ts.read_manifest(directory)
    if encoder is None:
        spec = ts.read_json(directory / indexer.ENCODER_FILE)
        encoder = Encoder(loading.encoder_from_spec(spec), EncodingConfig())
    ts.check_model_matches(manifest, encoder.bundle.info(), directory)
    view = ts.TokenStore(directory, manifest=manifest) if pending else ts.TokenStore(directory)
    existing = view.live_positions()  # a deleted id may come back
    docs = list(beir.iter_corpus(corpus)) if from_file else list(corpus)
    clash = [d.doc_id for d in docs if d.doc_id in existing]
    if clash:
        raise ConfigError(
            f"{label}: {len(clash)} document ids are already in {directory} "
            f"(e.g. {clash[:3]}): nothing was {'added or deleted' if pending else 'added'} ("
            + (
                "was this add committed before? To replace documents, give --delete of their "
                "ids in the same command)"
                if from_file
                else "delete them first with Index.delete, or give new ids)"
            )
        )
    if not docs:
        raise ConfigError(f"{label}: no documents")
    indexer.warn_unapplied_settings(directory, manifest)
    config = indexer.IndexingConfig.recorded(manifest["indexing"])
    start = time.perf_counter()
    first = max(s["index"] for s in manifest["shards"]) + 1
    entries = []
    with progress.Progress(len(docs), "index --add: encode documents", "doc") as bar:
        for i in range(0, len(docs), config.shard_size):
            shard_index = first + i // config.shard_size
            shard = docs[i : i + config.shard_size]
            entries.append(
                indexer.encode_shard(directory, shard_index, shard, encoder, config, bar)
            )
    encode_s = time.perf_counter() - start
    source = str(Path(corpus).resolve()) if from_file else "python"
    extra = {"replaces": True, "sha256": replaces} if replaces else {}
    summary = _append(
        directory, manifest, entries, source, "delete+add" if pending else "add", **extra
    )
    summary.update(doc_maxlen=encoder.maxlen("doc"), encode_s=round(encode_s, 3))
    summary["seconds"] = round(time.perf_counter() - start, 3)
    logging.info("aligner-index --add: %s", summary)
    return summary


def _append(
    directory: Path, manifest: dict, entries: list[dict], source: str, op: str = "add", **record
) -> dict:
    """Commits the new shards ``entries`` (written after the manifest's last one): the
    manifest's shards, counts and update log, and the search index's next generation."""
    num_docs = sum(e["num_docs"] for e in entries)
    manifest["shards"] = manifest["shards"] + [
        {k: v for k, v in e.items() if k != "stats"} for e in entries
    ]
    counts = manifest["counts"]
    counts["num_docs"] += num_docs
    counts["num_tokens"] += sum(e["num_tokens"] for e in entries)
    counts["num_shards"] += len(entries)
    truncated = sum(e.get("stats", {}).get("truncated_docs", 0) for e in entries)
    stats = manifest.setdefault("stats", {})
    stats["truncated_docs"] = stats.get("truncated_docs", 0) + truncated
    record = _record("add", source=source, num_docs=num_docs, **record)
    manifest["updates"] = manifest.get("updates", []) + [record]
    start = time.perf_counter()
    _commit(directory, manifest, op, num_docs=num_docs)
    return {
        "added_docs": num_docs,
        "new_shards": [e["name"] for e in entries],
        "truncated_docs": truncated,
        "commit_s": round(time.perf_counter() - start, 3),
    }


def add_encoded(index_dir: str, documents: Iterable[ts.EncodedDocument]) -> dict:
    """Appends documents encoded elsewhere (``ts.EncodedDocument``: id, vectors ``[m, dim]``,
    saliences, token ids — what ``TokenStoreWriter`` takes) to an index, as ``--add`` does for
    a corpus: new shards of the index's shard size (one in memory at a time), then one commit
    with the search index's next generation. Hold the writer lock (``indexer.writer_lock``).
    Ids must be new; a clash is refused before anything is committed."""
    directory = Path(index_dir)
    manifest = ts.read_manifest(directory)
    existing = ts.TokenStore(directory).live_positions()
    shard_size = int(manifest.get("indexing", {}).get("shard_size", ts.SHARD_SIZE))
    dim = int(manifest["model"]["dim"])
    first = max(s["index"] for s in manifest["shards"]) + 1
    entries, shard, seen = [], [], set()
    for doc in documents:
        try:
            doc = ts.checked_document(doc.doc_id, doc.vectors, doc.salience, doc.token_ids, dim)
        except ConfigError as error:
            raise ConfigError(f"add_encoded: {error}; nothing was added") from None
        if doc.doc_id in existing or doc.doc_id in seen:
            raise ConfigError(
                f"add_encoded: document id {doc.doc_id!r} is already in {directory} (or given "
                "twice); nothing was added"
            )
        seen.add(doc.doc_id)
        shard.append(doc)
        if len(shard) == shard_size:
            entries.append(_write_encoded(directory, first + len(entries), shard, dim))
            shard = []
    if shard:
        entries.append(_write_encoded(directory, first + len(entries), shard, dim))
    if not entries:
        raise ConfigError(f"add_encoded: no documents for {directory}")
    summary = _append(directory, manifest, entries, "encoded")
    logging.info("add_encoded: %s", summary)
    return summary


def _write_encoded(directory: Path, shard_index: int, shard: list, dim: int) -> dict:
    """One shard of ``add_encoded``; in an index with a documents table, rows holding only the
    ids (no title, text or metadata: filters on ``doc_id`` and subsets find them)."""
    if (directory / documents_lib.FILE).exists():
        rows = [beir.Document(d.doc_id, "", "") for d in shard]
        documents_lib.write_shard(directory, shard_index, rows, store_text=False)
    return ts.write_shard(directory, shard_index, shard, dim)


def parse_ids(spec: str) -> list[str]:
    """``a,b,c`` or ``@file`` (one id per line); none is an error."""
    if spec.startswith("@"):
        path = Path(spec[1:])
        if not path.is_file():
            raise ConfigError(f"--delete={spec}: {path} is not a file")
        ids = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    else:
        ids = [x.strip() for x in spec.split(",") if x.strip()]
    if not ids:
        raise ConfigError(f"--delete={spec}: names no document id (give ID,ID,... or @FILE)")
    return ids


def delete_documents(index_dir: str, ids: list[str], where: str = "--delete") -> dict:
    """Deletes the live documents ``ids`` (never returned by search; kept on disk, their store
    positions listed in the manifest's ``deleted``): one commit. ``where`` names the caller
    (the flag or the function) in an error."""
    directory = Path(index_dir)
    manifest, summary = _mark_deleted(directory, ids, where)
    _commit(directory, manifest, "delete", num_docs=summary["deleted_docs"])
    return summary


def _refuse_committed_replacement(directory: Path, corpus: str, sha256: str) -> None:
    """A ``--delete`` + ``--add`` whose file (``sha256``) is the one the last committed
    replacement added (a re-run after a kill at the commit) is refused as done: applied again,
    it re-encoded the documents and left one more tombstone each time."""
    updates = ts.read_manifest(directory).get("updates", [])
    changes = [u for u in updates if u.get("op") not in _MAINTENANCE]
    last = changes[-1] if changes else {}
    if last.get("replaces") and last.get("sha256") == sha256:
        raise ConfigError(
            f"--delete with --add={corpus}: this replacement was committed already (at "
            f"{last.get('time')}, the index's last change of documents); nothing was done"
        )


def _mark_deleted(directory: Path, ids: list[str], where: str) -> tuple[dict, dict]:
    """The manifest with ``ids`` tombstoned (not committed) and the delete's summary."""
    manifest = ts.read_manifest(directory)
    live = ts.TokenStore(directory).live_positions()
    ids = list(dict.fromkeys(ids))  # an id named twice is deleted once
    unknown = [d for d in ids if d not in live]
    if unknown:
        raise ConfigError(
            f"{where}: {len(unknown)} ids are not in {directory} or were deleted already "
            f"(e.g. {unknown[:3]}); nothing was deleted"
        )
    deleted = sorted(set(manifest.get("deleted", [])) | {live[d] for d in ids})
    manifest["deleted"] = deleted
    manifest["updates"] = manifest.get("updates", []) + [_record("delete", num_docs=len(ids))]
    return manifest, {"deleted_docs": len(ids), "tombstones": len(deleted)}


recorded_config = ci.recorded_config  # the settings a rebuild keeps


def compact(index_dir: str, force: bool = False) -> dict:
    """Re-clusters the search index when its drift exceeds ``DRIFT_LIMIT`` (or ``force``: also
    (re)builds a missing, stale, damaged or older-format index with its recorded settings)."""
    directory = Path(index_dir)
    store = ts.TokenStore(directory)
    drift = None  # --force_compact repairs an index that may not load: not measured
    if not force:
        drift = ci.CentroidIndex.load_unchecked(store).drift()
        if drift <= ci.DRIFT_LIMIT:
            logging.info("--compact: drift %.4f <= %.4f, nothing to do", drift, ci.DRIFT_LIMIT)
            return {"drift": drift, "rebuilt": False}
    _rebuild(store, "force_compact" if force else "compact", drift=drift)
    return {"drift": drift, "rebuilt": True}


def _rebuild(store: ts.TokenStore, op: str, **fields) -> None:
    """A new search index with the recorded settings, committed with the update logged in the
    manifest (``updates``) as the adds and deletes are."""
    index = ci.CentroidIndex.build(store, recorded_config(store.directory), commit=False)
    manifest = dict(store.manifest)
    record = _record(op, num_centroids=index.num_centroids, **fields)
    manifest["updates"] = manifest.get("updates", []) + [record]
    index.commit(store, manifest)


def rebuild_search_index(index_dir: str) -> dict:
    """``aligner-index --index_dir=DIR --search_index``: builds the search index of an existing
    token store again (its recorded settings, else the defaults) — the repair of a missing,
    stale, damaged or other store's ``search_index/``."""
    start = time.perf_counter()
    _rebuild(ts.TokenStore(Path(index_dir)), "search_index")
    return {"search_index_rebuilt": True, "build_s": round(time.perf_counter() - start, 3)}


def vacuum(index_dir: str) -> dict:
    """``aligner-index --index_dir=DIR --vacuum``: the store written again without its deleted
    documents, in full shards of the index's shard size (an add's small shards merged), and its
    search index built again on it (re-clustered, as ``--force_compact``): one commit. The new
    shards are numbered after the last one (the manifest's ``first_shard``), so nothing the
    committed generation reads is touched before the commit; the replaced shard files are then
    removed. The documents table keeps the replaced shards' rows until the next vacuum (a
    searcher opened before this one still reads their contents). Without deletions, and with
    every shard but the last full, there is nothing to do (no commit)."""
    start = time.perf_counter()
    directory = Path(index_dir)
    store = ts.TokenStore(directory)
    manifest = store.manifest
    spans = store.shard_spans()
    rows_removed = documents_lib.drop_unlisted(directory, [s["index"] for s, _, _ in spans])
    shard_size = int(manifest.get("indexing", {}).get("shard_size", ts.SHARD_SIZE))
    live = np.flatnonzero(~store.deleted)
    summary = {"vacuumed": False, "table_rows_removed": rows_removed}
    if not store.deleted.any() and store.num_shards <= max(1, -(-len(live) // shard_size)):
        logging.info("--vacuum: %s has no deleted documents nor partial shards", directory)
        return summary
    if not len(live):
        raise ConfigError(
            f"--vacuum: every document of {directory} is deleted; nothing was done (index "
            "the documents you want in a new --index_dir)"
        )
    doc_starts = np.array([first_doc for _, _, first_doc in spans], np.int64)
    owner = np.searchsorted(doc_starts, live, side="right") - 1
    old_index = np.array([s["index"] for s, _, _ in spans], np.int64)[owner]
    old_slot = live - doc_starts[owner]
    first = max(s["index"] for s, _, _ in spans) + 1
    table = (directory / documents_lib.FILE).exists()
    entries = []
    with progress.Progress(len(live), "index --vacuum: copy documents", "doc") as bar:
        for lo in range(0, len(live), shard_size):
            shard = []
            for p in live[lo : lo + shard_size].tolist():
                vectors, salience, token_ids = store.document(p)
                shard.append(ts.EncodedDocument(store.doc_ids[p], vectors, salience, token_ids))
            index = first + len(entries)
            if table:
                sources = np.stack([old_index, old_slot], 1)[lo : lo + shard_size].tolist()
                documents_lib.copy_shard(directory, index, sources)
            entries.append(ts.write_shard(directory, index, shard, store.dim))
            store.close()  # unmaps the shards read (memory of one output shard at a time)
            bar.update(len(shard))
    new = {k: v for k, v in manifest.items() if k not in ("deleted", "tombstones")}
    new["shards"], new["first_shard"] = entries, first
    new["counts"] = {
        "num_docs": int(len(live)),
        "num_tokens": sum(e["num_tokens"] for e in entries),
        "num_shards": len(entries),
    }
    summary.update(
        vacuumed=True,
        removed_docs=int(store.deleted.sum()),
        live_docs=int(len(live)),
        shards_before=store.num_shards,
        shards_after=len(entries),
        store_bytes_before=store.nbytes(),
        store_bytes_after=sum(m["bytes"] for e in entries for m in e["files"].values()),
    )
    record = {k: summary[k] for k in ("removed_docs", "shards_before", "shards_after")}
    new["updates"] = manifest.get("updates", []) + [_record("vacuum", **record)]
    if manifest.get("search_index"):
        pending = ts.TokenStore(directory, manifest=new)
        index = ci.CentroidIndex.build(pending, recorded_config(directory), commit=False)
        index.commit(pending, new)
    else:
        ts.write_manifest(directory, new)
        ci.collect_garbage(directory)
    summary["seconds"] = round(time.perf_counter() - start, 3)
    logging.info("aligner-index --vacuum: %s", summary)
    return summary


def _delete_before_vacuum(directory: Path, ids: list[str]) -> list[str] | None:
    """The ids ``--delete`` with ``--vacuum`` still has to delete: none (the delete is skipped)
    when every one is deleted already but still stored (a re-run after the vacuum was
    interrupted: the vacuum goes on). A delete that would leave no document is refused before
    anything is done."""
    store = ts.TokenStore(directory)
    live, named = set(store.live_positions()), set(ids)
    if not live or (not named & live and named <= set(store.doc_ids)):
        # nothing live to delete (vacuum() refuses an index with no document left), or a re-run
        logging.info("--delete: every id is deleted already; going on to --vacuum")
        return None
    if live <= named:
        raise ConfigError(
            f"--delete with --vacuum: that deletes every document of {directory}, and a vacuum "
            "must keep one; nothing was done (index the documents you want in a new --index_dir)"
        )
    return ids


def interrupted(index_dir: str) -> str:
    """What a Ctrl-C during an update leaves (``aligner-index: interrupted: ...``)."""
    return (
        f"{index_dir} is as its last committed update left it (an update is published by one "
        "atomic rename, or not at all; an update in progress was dropped): re-run the same "
        "command to apply it (one that was already committed is refused as done)"
    )


def update_index(
    index_dir: str,
    add: str | None = None,
    delete: str | None = None,
    compact_index: bool = False,
    force_compact: bool = False,
    search_index: bool = False,
    vacuum_store: bool = False,
) -> dict:
    """``aligner-index``'s update flags, in the order delete → add → compact (or, with
    ``search_index``, a rebuild of the search index; with ``vacuum_store``, a vacuum), holding the index directory's writer lock
    (the indexing job's, process 0). Each is one transaction: its files are written beside the
    committed ones and published by one atomic rename of the manifest; a crash leaves the index
    as the last commit left it, and the next writer removes the leftovers first."""
    if not Path(index_dir).is_dir():
        raise errors.MissingPathError(
            f"--index_dir={index_dir}: not a folder; build an index there first with "
            f"aligner-index --corpus=CORPUS.jsonl --index_dir={index_dir}"
        )
    if search_index and (compact_index or force_compact):
        raise ConfigError(
            "--search_index (alone) rebuilds the search index; --compact re-clusters it: "
            "give one of them"
        )
    if vacuum_store and (search_index or compact_index or force_compact):
        raise ConfigError(
            "--vacuum rewrites the store and builds its search index again (re-clustered): "
            "give it without --search_index, --compact or --force_compact"
        )
    summary = {}
    ids = parse_ids(delete) if delete else None
    with writing(index_dir):
        if ids and vacuum_store and not add:
            ids = _delete_before_vacuum(Path(index_dir), ids)
        if ids and add:  # a replacement: one commit, never the delete without the add
            sha256 = corpus_sources.file_sha256(add) if Path(add).is_file() else None
            _refuse_committed_replacement(Path(index_dir), add, sha256)
            manifest, deleted = _mark_deleted(Path(index_dir), ids, "--delete")
            summary.update(deleted)
            summary.update(add_documents(index_dir, add, manifest=manifest, replaces=sha256))
        elif ids:
            summary.update(delete_documents(index_dir, ids))
        elif add:
            summary.update(add_documents(index_dir, add))
        if vacuum_store:
            summary.update(vacuum(index_dir))
        elif search_index:
            summary.update(rebuild_search_index(index_dir))
        elif compact_index or force_compact:
            summary.update(compact(index_dir, force_compact))
    return summary
