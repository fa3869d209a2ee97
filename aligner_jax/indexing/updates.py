"""Incremental updates of an index: add documents, delete (tombstone) them, re-cluster.

``aligner-index --index_dir=DIR --add=corpus.jsonl`` encodes only the new documents (with the
model recorded in ``encoder.json``) into new shards after the last one, appends them to the
manifest, and compresses their tokens with the existing centroids (``CentroidIndex.update``).
``--delete=ID,ID,...`` (or ``@file`` with one id per line) adds tombstones to the manifest:
the documents stay on disk and are never returned. Each update is appended to the manifest's
``updates`` list. ``--compact`` re-clusters the search index over every stored token (new
centroids) when its drift (``CentroidIndex.drift``) exceeds ``DRIFT_LIMIT``, or always with
``--force_compact``; tombstoned documents stay in the store.
"""

from __future__ import annotations

import time
from pathlib import Path

from absl import logging

from aligner_jax.common import progress
from aligner_jax.common.errors import ConfigError
from aligner_jax.data import beir
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import Encoder, EncodingConfig
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import indexer
from aligner_jax.indexing import token_store as ts


def _record(op: str, **fields) -> dict:
    return {"op": op, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **fields}


def _refresh_search_index(directory: Path, op: str, **fields) -> None:
    store = ts.TokenStore(directory)
    if (directory / ci.SUBDIR / ci.META).exists():
        old = ci.CentroidIndex.load_unchecked(store)
        old.update(store, op, **fields)


def add_documents(index_dir: str, corpus: str, encoder: Encoder | None = None) -> dict:
    """Encodes the documents of ``corpus`` (a BEIR corpus.jsonl) into new shards."""
    directory = Path(index_dir)
    manifest = ts.read_manifest(directory)
    if encoder is None:
        spec = ts.read_json(directory / indexer.ENCODER_FILE)
        encoder = Encoder(loading.encoder_from_spec(spec), EncodingConfig())
    ts.check_model_matches(manifest, encoder.bundle.info(), directory)
    existing = set(ts.TokenStore(directory).doc_ids)
    docs = list(beir.iter_corpus(corpus))
    clash = [d.doc_id for d in docs if d.doc_id in existing]
    if clash:
        raise ConfigError(
            f"--add={corpus}: {len(clash)} document ids are already in {directory} "
            f"(e.g. {clash[:3]}); delete them first (--delete) or give new ids"
        )
    if not docs:
        raise ConfigError(f"--add={corpus}: no documents")
    config = indexer.IndexingConfig(**manifest["indexing"])
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
    manifest["shards"] = manifest["shards"] + [
        {k: v for k, v in e.items() if k != "stats"} for e in entries
    ]
    counts = manifest["counts"]
    counts["num_docs"] += len(docs)
    counts["num_tokens"] += sum(e["num_tokens"] for e in entries)
    counts["num_shards"] += len(entries)
    record = _record("add", source=str(Path(corpus).resolve()), num_docs=len(docs))
    manifest["updates"] = manifest.get("updates", []) + [record]
    ts.write_manifest(directory, manifest)
    encode_s = time.perf_counter() - start
    _refresh_search_index(directory, "add", num_docs=len(docs))
    summary = {
        "added_docs": len(docs),
        "new_shards": [e["name"] for e in entries],
        "encode_s": round(encode_s, 3),
        "seconds": round(time.perf_counter() - start, 3),
    }
    logging.info("aligner-index --add: %s", summary)
    return summary


def parse_ids(spec: str) -> list[str]:
    """``a,b,c`` or ``@file`` (one id per line)."""
    if spec.startswith("@"):
        path = Path(spec[1:])
        if not path.is_file():
            raise ConfigError(f"--delete={spec}: {path} is not a file")
        return [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return [x.strip() for x in spec.split(",") if x.strip()]


def delete_documents(index_dir: str, ids: list[str]) -> dict:
    """Tombstones ``ids`` (never returned by search; kept on disk)."""
    directory = Path(index_dir)
    manifest = ts.read_manifest(directory)
    known = set(ts.TokenStore(directory).doc_ids)
    unknown = [d for d in ids if d not in known]
    if unknown:
        raise ConfigError(
            f"--delete: {len(unknown)} ids are not in {directory} (e.g. {unknown[:3]}); "
            "nothing was deleted"
        )
    tombstones = sorted(set(manifest.get("tombstones", [])) | set(ids))
    manifest["tombstones"] = tombstones
    manifest["updates"] = manifest.get("updates", []) + [_record("delete", num_docs=len(ids))]
    ts.write_manifest(directory, manifest)
    _refresh_search_index(directory, "delete", num_docs=len(ids))
    return {"deleted_docs": len(ids), "tombstones": len(tombstones)}


def compact(index_dir: str, force: bool = False) -> dict:
    """Re-clusters the search index when its drift exceeds ``DRIFT_LIMIT`` (or ``force``: also
    (re)builds a missing, stale or older-format index with its recorded settings)."""
    directory = Path(index_dir)
    store = ts.TokenStore(directory)
    drift = None
    if not force:
        drift = ci.CentroidIndex.load_unchecked(store).drift()
        if drift <= ci.DRIFT_LIMIT:
            logging.info("--compact: drift %.4f <= %.4f, nothing to do", drift, ci.DRIFT_LIMIT)
            return {"drift": drift, "rebuilt": False}
    meta_path = directory / ci.SUBDIR / ci.META
    recorded = {}
    if meta_path.exists():
        fix = "delete it (--force_compact then uses the default settings)"
        recorded = ts.read_json(meta_path, fix).get("config", {})
    ci.CentroidIndex.build(store, ci.CentroidIndexConfig(**recorded))
    return {"drift": drift, "rebuilt": True}


def update_index(
    index_dir: str,
    add: str | None = None,
    delete: str | None = None,
    compact_index: bool = False,
    force_compact: bool = False,
) -> dict:
    """``aligner-index``'s update flags, in the order delete → add → compact, holding the index
    directory's writer lock (the indexing job's, process 0)."""
    summary = {}
    with indexer.writer_lock(index_dir):
        if delete:
            summary.update(delete_documents(index_dir, parse_ids(delete)))
        if add:
            summary.update(add_documents(index_dir, add))
        if compact_index or force_compact:
            summary.update(compact(index_dir, force_compact))
    return summary
