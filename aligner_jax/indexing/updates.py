"""Incremental updates of an index: add documents, delete (tombstone) them, re-cluster.

``aligner-index --index_dir=DIR --add=corpus.jsonl`` encodes only the new documents (with the
model recorded in ``encoder.json``) into new shards after the last one, appends them to the
manifest, and compresses their tokens with the existing centroids (``CentroidIndex.update``).
``--delete=ID,ID,...`` (or ``@file`` with one id per line) adds tombstones to the manifest:
the documents stay on disk and are never returned. Each update is appended to the manifest's
``updates`` list. ``--compact`` re-clusters the search index over every stored token (new
centroids) when its drift (``CentroidIndex.drift``) exceeds ``DRIFT_LIMIT``, or always with
``--force_compact``; tombstoned documents stay in the store. ``--search_index`` (without
``--corpus``) rebuilds the search index of an existing store: the repair of a missing, stale,
damaged or other store's ``search_index/``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from absl import logging

from aligner_jax.common import errors, progress
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


def add_documents(index_dir: str, corpus, encoder: Encoder | None = None) -> dict:
    """Encodes the documents of ``corpus`` (a BEIR corpus.jsonl, or documents given in Python
    by ``aligner_jax.Index.add``) into new shards."""
    from_file = isinstance(corpus, (str, os.PathLike))
    label = f"--add={corpus}" if from_file else "Index.add"
    directory = Path(index_dir)
    manifest = ts.read_manifest(directory)
    if encoder is None:
        spec = ts.read_json(directory / indexer.ENCODER_FILE)
        encoder = Encoder(loading.encoder_from_spec(spec), EncodingConfig())
    ts.check_model_matches(manifest, encoder.bundle.info(), directory)
    existing = set(ts.TokenStore(directory).doc_ids)
    docs = list(beir.iter_corpus(corpus)) if from_file else list(corpus)
    clash = [d.doc_id for d in docs if d.doc_id in existing]
    if clash:
        raise ConfigError(
            f"{label}: {len(clash)} document ids are already in {directory} "
            f"(e.g. {clash[:3]}); delete them first (--delete) or give new ids"
        )
    if not docs:
        raise ConfigError(f"{label}: no documents")
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
    truncated = sum(e.get("stats", {}).get("truncated_docs", 0) for e in entries)
    stats = manifest.setdefault("stats", {})
    stats["truncated_docs"] = stats.get("truncated_docs", 0) + truncated
    source = str(Path(corpus).resolve()) if from_file else "python"
    record = _record("add", source=source, num_docs=len(docs))
    manifest["updates"] = manifest.get("updates", []) + [record]
    ts.write_manifest(directory, manifest)
    encode_s = time.perf_counter() - start
    _refresh_search_index(directory, "add", num_docs=len(docs))
    summary = {
        "added_docs": len(docs),
        "new_shards": [e["name"] for e in entries],
        "truncated_docs": truncated,
        "doc_maxlen": encoder.maxlen("doc"),
        "encode_s": round(encode_s, 3),
        "seconds": round(time.perf_counter() - start, 3),
    }
    logging.info("aligner-index --add: %s", summary)
    return summary


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


def recorded_config(directory: Path) -> ci.CentroidIndexConfig:
    """The ``CentroidIndexConfig`` recorded in ``directory``'s search index, or the defaults
    (gin's) when there is none or it cannot be read (damaged, another version): the settings a
    rebuild keeps."""
    path = directory / ci.SUBDIR / ci.META
    if not path.exists():
        return ci.CentroidIndexConfig()
    try:
        return ci.CentroidIndexConfig(**json.loads(path.read_text())["config"])
    except (ValueError, TypeError, KeyError) as e:  # invalid JSON, no or other settings
        logging.warning("%s: settings not readable (%r); rebuilding with the defaults", path, e)
        return ci.CentroidIndexConfig()


def compact(index_dir: str, force: bool = False) -> dict:
    """Re-clusters the search index when its drift exceeds ``DRIFT_LIMIT`` (or ``force``: also
    (re)builds a missing, stale, damaged or older-format index with its recorded settings)."""
    directory = Path(index_dir)
    store = ts.TokenStore(directory)
    drift = None
    if not force:
        drift = ci.CentroidIndex.load_unchecked(store).drift()
        if drift <= ci.DRIFT_LIMIT:
            logging.info("--compact: drift %.4f <= %.4f, nothing to do", drift, ci.DRIFT_LIMIT)
            return {"drift": drift, "rebuilt": False}
    ci.CentroidIndex.build(store, recorded_config(directory))
    return {"drift": drift, "rebuilt": True}


def rebuild_search_index(index_dir: str) -> dict:
    """``aligner-index --index_dir=DIR --search_index``: builds the search index of an existing
    token store again (its recorded settings, else the defaults) — the repair of a missing,
    stale, damaged or other store's ``search_index/``."""
    directory = Path(index_dir)
    start = time.perf_counter()
    ci.CentroidIndex.build(ts.TokenStore(directory), recorded_config(directory))
    return {"search_index_rebuilt": True, "build_s": round(time.perf_counter() - start, 3)}


def interrupted(index_dir: str) -> str:
    """What a Ctrl-C during an update leaves (``aligner-index: interrupted: ...``)."""
    return (
        f"the update of {index_dir} may be partly written: re-run the same command (if it is "
        f"refused as done already, rebuild the search index: aligner-index "
        f"--index_dir={index_dir} --search_index)"
    )


def update_index(
    index_dir: str,
    add: str | None = None,
    delete: str | None = None,
    compact_index: bool = False,
    force_compact: bool = False,
    search_index: bool = False,
) -> dict:
    """``aligner-index``'s update flags, in the order delete → add → compact (or, with
    ``search_index``, a rebuild of the search index), holding the index directory's writer lock
    (the indexing job's, process 0)."""
    if not Path(index_dir).is_dir():
        raise errors.MissingPathError(
            f"--index_dir={index_dir}: not a folder; build an index there first with "
            f"aligner-index --corpus=CORPUS.jsonl --index_dir={index_dir}"
        )
    summary = {}
    with indexer.writer_lock(index_dir):
        if delete:
            summary.update(delete_documents(index_dir, parse_ids(delete)))
        if add:
            summary.update(add_documents(index_dir, add))
        if search_index:
            summary.update(rebuild_search_index(index_dir))
        elif compact_index or force_compact:
            summary.update(compact(index_dir, force_compact))
    return summary
