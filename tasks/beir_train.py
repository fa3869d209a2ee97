"""``beir_train_bm25``: (query, relevant document, BM25 hard negatives) from a BEIR folder.

One example per (query, relevant document) pair of ``qrels/<split>.tsv`` (relevance > 0), in
queries.jsonl order and then qrels order. Each query gets ``num_negatives`` hard negatives mined
with BM25 (``aligner_jax.data.bm25``, over ``title + " " + text`` of the whole corpus): drawn from
the top-``depth`` BM25 documents that are not judged relevant for that query (the paper's "fixed
hard negatives", §4.1), deterministic given ``seed``; the query's pairs share them. A query with
too few BM25 candidates is topped up with random non-relevant documents (counted in the logs).

Point the registered task at a dataset with gin::

    --gin.beir_train_source.dataset_dir="'/data/beir/scifact'"
    --gin.beir_train_source.num_negatives=4

Mined negatives are cached in memory per process; set ``beir_train_source.cache_file`` to also
keep them in a JSON file (reused when the dataset files and the mining bindings are unchanged).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import gin
from absl import logging

from aligner_jax.common.errors import ConfigError
from aligner_jax.data import beir, bm25
from aligner_jax.tasks import bindings, negatives, sources

_BINDING = "beir_train_source"
_CACHE_FORMAT = "aligner_jax.beir_train_bm25.negatives.v1"


@dataclasses.dataclass(frozen=True)
class BeirTrainConfig:
    """Where and how ``beir_train_bm25`` reads and mines (see ``beir_train_source``)."""

    dataset_dir: str
    qrels_split: str | None = None
    num_negatives: int = 1
    depth: int = 100
    seed: int = 0
    exclude_identical_ids: bool = True
    unknown_qrels: str = "error"
    cache_file: str | None = None

    def qrels_file(self, split: str) -> Path:
        return Path(self.dataset_dir) / "qrels" / f"{self.qrels_split or split}.tsv"

    def input_files(self, split: str) -> list[Path]:
        folder = Path(self.dataset_dir)
        return [folder / "corpus.jsonl", folder / "queries.jsonl", self.qrels_file(split)]


@gin.configurable
def beir_train_source(
    dataset_dir: str | None = None,
    qrels_split: str | None = None,
    num_negatives: int = 1,
    depth: int = 100,
    seed: int = 0,
    exclude_identical_ids: bool = True,
    unknown_qrels: str = "error",
    cache_file: str | None = None,
) -> BeirTrainConfig:
    """Data location and mining options of ``beir_train_bm25`` (gin-configurable).

    Args:
      dataset_dir: a BEIR folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv). Required.
      qrels_split: the qrels file to train on; None: the seqio split asked for ("train").
      num_negatives: hard negatives per example (≥ 0).
      depth: BM25 candidate pool per query (≥ num_negatives).
      seed: mining seed (the draw from the pool and any random top-up).
      exclude_identical_ids: never use the document whose id equals the query id (BEIR's
        convention for datasets where queries are documents, e.g. ArguAna, Quora).
      unknown_qrels: "error" or "skip" judgments naming unknown queries/documents.
      cache_file: optional JSON file keeping the mined negatives between processes.
    """
    num_negatives = bindings.check_int(f"{_BINDING}.num_negatives", num_negatives, 0)
    depth = bindings.check_int(f"{_BINDING}.depth", depth, max(1, num_negatives))
    seed = bindings.check_int(f"{_BINDING}.seed", seed, 0)
    bindings.check_choice(f"{_BINDING}.unknown_qrels", unknown_qrels, beir.UNKNOWN_QRELS_MODES)
    if qrels_split is not None and (not isinstance(qrels_split, str) or not qrels_split):
        raise ConfigError(f"{_BINDING}.qrels_split={qrels_split!r}: expected a split name or None.")
    folder = bindings.require_directory(
        f"{_BINDING}.dataset_dir", dataset_dir, "/data/beir/scifact"
    )
    return BeirTrainConfig(
        dataset_dir=str(folder),
        qrels_split=qrels_split,
        num_negatives=num_negatives,
        depth=depth,
        seed=seed,
        exclude_identical_ids=bool(exclude_identical_ids),
        unknown_qrels=unknown_qrels,
        cache_file=os.fspath(cache_file) if cache_file else None,
    )


def fingerprint(config: BeirTrainConfig, split: str):
    return sources.file_fingerprint(config.input_files(split))


def _cache_key(config: BeirTrainConfig, split: str) -> dict:
    return {
        "format": _CACHE_FORMAT,
        "files": [list(f) for f in fingerprint(config, split)],
        "qrels_split": config.qrels_split or split,
        "num_negatives": config.num_negatives,
        "depth": config.depth,
        "seed": config.seed,
        "exclude_identical_ids": config.exclude_identical_ids,
        "unknown_qrels": config.unknown_qrels,
    }


def _read_cache(path: Path, key: dict) -> dict[str, list[str]] | None:
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            payload = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        logging.warning("%s: unreadable negatives cache (%s); mining again.", path, e)
        return None
    if not isinstance(payload, dict) or payload.get("key") != key:
        logging.info("%s: cached negatives are for other data or bindings; mining again.", path)
        return None
    return {str(q): [str(d) for d in docs] for q, docs in payload["negatives"].items()}


def _write_cache(path: Path, key: dict, mined: dict[str, list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"key": key, "negatives": mined}, f)
    os.replace(tmp, path)


def build_beir_train_examples(config: BeirTrainConfig, split: str) -> sources.RetrievalExamples:
    """The example table of ``beir_train_bm25`` (see the module docstring)."""
    qrels_split = config.qrels_split or split
    skip = bindings.flag(f"{_BINDING}.unknown_qrels", "skip")
    dataset = beir.load_beir(config.dataset_dir, qrels_split, config.unknown_qrels, skip)
    positives: dict[str, list[str]] = {}
    for qid in dataset.queries:
        relevant = [d for d, score in dataset.qrels.get(qid, {}).items() if score > 0]
        if relevant:
            positives[qid] = relevant
    if not positives:
        raise ConfigError(
            f"{config.qrels_file(split)}: no judgment with relevance > 0 for a known query; "
            "beir_train_bm25 needs relevant (query, document) pairs."
        )
    queries = {qid: dataset.queries[qid] for qid in positives}

    start = time.perf_counter()
    key = _cache_key(config, split)
    cache_path = Path(config.cache_file) if config.cache_file else None
    mined = _read_cache(cache_path, key) if cache_path is not None else None
    topped_up = 0
    from_cache = mined is not None
    if mined is None:
        if config.num_negatives > 0:
            doc_ids = list(dataset.corpus)
            index = bm25.BM25Index.build(
                doc_ids, [beir.document_text(dataset.corpus[d]) for d in doc_ids]
            )
        else:
            index = None
        mined, topped_up = negatives.bm25_negatives(
            index,
            queries,
            positives,
            num_negatives=config.num_negatives,
            depth=config.depth,
            seed=config.seed,
            exclude_identical_ids=config.exclude_identical_ids,
        )
        if cache_path is not None:
            _write_cache(cache_path, key, mined)
    mining_seconds = time.perf_counter() - start
    if topped_up:
        logging.warning(
            "beir_train_bm25: %d of %d queries had fewer than %d non-relevant BM25 candidates "
            "and were topped up with random documents.",
            topped_up,
            len(queries),
            config.num_negatives,
        )

    pool = sources.TextPool()
    doc_index: dict[str, int] = {}

    def doc(doc_id: str) -> int:
        index = doc_index.get(doc_id)
        if index is None:
            index = pool.add(beir.document_text(dataset.corpus[doc_id]))
            doc_index[doc_id] = index
        return index

    query_rows, positive_rows, negative_rows = [], [], []
    for qid, text in queries.items():
        negs = mined.get(qid)
        if negs is None or len(negs) != config.num_negatives:
            raise ConfigError(
                f"{cache_path}: the cached negatives of query {qid!r} do not match "
                f"num_negatives={config.num_negatives}; delete the cache file."
            )
        q = pool.add(text)
        neg_rows = [doc(d) for d in negs]
        for doc_id in positives[qid]:
            query_rows.append(q)
            positive_rows.append(doc(doc_id))
            negative_rows.append(neg_rows)
    stats = {
        "queries": len(queries),
        "relevant_pairs": len(query_rows),
        "documents": len(dataset.corpus),
        "topped_up_queries": topped_up,
        "mining_seconds": round(mining_seconds, 3),
        "negatives_from_cache_file": int(from_cache),
    }
    return sources.make_examples(
        pool, query_rows, positive_rows, negative_rows, config.num_negatives, stats
    )
