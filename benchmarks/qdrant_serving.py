r"""Serving on Qdrant (issue 12, item 3): export cost, and Qdrant's answers beside ours.

    .venv/bin/python benchmarks/qdrant_serving.py --dataset=cisi \
      --index_dir=outputs/zero_shot_cisi/index
    .venv/bin/python benchmarks/qdrant_serving.py --dataset=scifact \
      --index_dir=outputs/zero_shot_scifact/index

Exports the token store (read-only) to an embedded ``qdrant_edge`` shard under ``outputs/qdrant/``
with ``aligner-publish``'s exporter (BM25 sparse vectors, float32 multivector; timed; size on
disk), then runs the dataset's test queries, one at a time and interleaved (query i: every
system in turn, the order rotating), through:

  ``aligner_jax exhaustive``  ``Searcher`` refining every document, top-1 alignment (the exact
                              scores Qdrant's MaxSim must reproduce)
  ``aligner_jax centroid``    ``Searcher`` with the compressed centroid index (its default)
  ``qdrant multivector``      MaxSim over every point (no HNSW: exact)
  ``qdrant fusion``           BM25 and multivector prefetches (100 each), RRF (k = 60)
  ``qdrant rerank``           BM25 top-100 re-scored by MaxSim
  ``qdrant sparse``           BM25 through the IDF modifier
  ``bm25s``                   ``data.bm25.BM25Index`` (the reference of the sparse side)

Queries are encoded once beforehand (encoding time excluded, reported apart). k = 100, batch 1,
one untimed warm-up per system. nDCG@10 / R@100 from pytrec_eval (``evaluation.metrics``).
Results are merged by dataset into ``benchmarks/results/qdrant.{json,md}``.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import numpy as np
from absl import app, flags, logging

from aligner_jax.common import fileio
from aligner_jax.data import beir, bm25
from aligner_jax.evaluation import metrics
from aligner_jax.indexing import token_store as ts
from aligner_jax.retrieval import searcher as search_lib
from aligner_jax.serving import exporter, querying, targets

REPO = Path(__file__).resolve().parents[1]
_DATASET = flags.DEFINE_string("dataset", "scifact", "BEIR dataset name (under --data_root).")
_DATA_ROOT = flags.DEFINE_string("data_root", "../shared/data/beir", "BEIR folders.")
_INDEX_DIR = flags.DEFINE_string("index_dir", None, "The token store to serve (read only).")
_QDRANT_PATH = flags.DEFINE_string("qdrant_path", None, "Shard folder (outputs/qdrant/DATASET).")
_REUSE = flags.DEFINE_boolean("reuse_export", False, "Reuse a complete earlier export.")
_K = flags.DEFINE_integer("k", 100, "Documents per query.")
_MAX_QUERIES = flags.DEFINE_integer("max_queries", 0, "First N test queries (0: all).")
_SYSTEMS = flags.DEFINE_list("systems", None, "A subset of SYSTEMS (default: all).")
_WRITE_EVERY = flags.DEFINE_integer("write_every", 10, "Write the results every N queries.")
_OUT = flags.DEFINE_string("out", str(REPO / "benchmarks/results/qdrant"), "Results stem.")

SYSTEMS = (
    "aligner_jax exhaustive",
    "aligner_jax centroid",
    "qdrant multivector",
    "qdrant fusion",
    "qdrant rerank",
    "qdrant sparse",
    "bm25s",
)


def disk_bytes(path: Path) -> dict:
    files = [p for p in path.rglob("*") if p.is_file()]
    return {
        "allocated": sum(p.stat().st_blocks * 512 for p in files),
        "apparent": sum(p.stat().st_size for p in files),
    }


def main(argv):
    del argv
    dataset = _DATASET.value
    data = beir.load_beir(Path(_DATA_ROOT.value) / dataset, "test")
    qids = list(data.queries)[: _MAX_QUERIES.value or None]
    texts = [data.queries[q] for q in qids]
    store = ts.TokenStore(_INDEX_DIR.value)
    path = Path(_QDRANT_PATH.value or REPO / "outputs/qdrant" / dataset)
    reused = _REUSE.value and (path / exporter.RECORD).is_file()
    if reused:
        record = exporter.read_record(path / exporter.RECORD)
    else:
        record = exporter.publish_embedded(store, path, overwrite=True)
    size = disk_bytes(path)
    logging.info("export: %s, %s", record["seconds"], size)

    exhaustive = search_lib.Searcher.load(_INDEX_DIR.value, mode="exhaustive")
    fast = search_lib.Searcher.load(_INDEX_DIR.value, encoder=exhaustive.encoder)
    t0 = time.perf_counter()
    encoded = exhaustive.encoder.encode(texts, "query")
    encode_s = time.perf_counter() - t0
    target = targets.EdgeTarget(path)
    qdrant = {
        mode: querying.QdrantSearcher(
            target,
            exhaustive.encoder,
            querying.sparse_vectors(record),
            querying.QueryConfig(mode=mode),
        )
        for mode in targets.MODES
    }
    target.open("bm25")
    live = [d for d, gone in zip(store.doc_ids, store.deleted, strict=True) if not gone]
    corpus = exporter.store_documents(store, set(live))
    reference = bm25.BM25Index.build(live, [beir.document_text(corpus[d]) for d in live])
    k = _K.value

    def run(system, i):
        q, text = encoded[i], texts[i]
        if system.startswith("aligner_jax"):
            searcher = exhaustive if system.endswith("exhaustive") else fast
            out = searcher.run(["q"], [q], ("top_k:1",), show_progress=False, k=k)
            return list(out.results["top_k:1"]["q"].items())
        if system == "bm25s":
            return list(reference.search({"q": text}, k)["q"].items())
        searcher = qdrant[system.split()[1]]
        return [(h.payload["doc_id"], h.score) for h in searcher.search_encoded([q], [text], k)[0]]

    systems = tuple(_SYSTEMS.value or SYSTEMS)
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise app.UsageError(f"--systems: unknown {sorted(unknown)}; choose from {SYSTEMS}")
    for system in systems:  # warm-up (compilation, page cache)
        run(system, 0)
    results = {s: {} for s in systems}
    latency = {s: [] for s in systems}
    start = time.perf_counter()
    for i, qid in enumerate(qids):
        order = systems[i % len(systems) :] + systems[: i % len(systems)]
        for system in order:
            t = time.perf_counter()
            ranked = run(system, i)
            latency[system].append(1000.0 * (time.perf_counter() - t))
            results[system][qid] = dict(ranked)
        done = i + 1
        if done % _WRITE_EVERY.value == 0 or done == len(qids):
            rate = done / (time.perf_counter() - start)
            logging.info(
                "%d/%d queries, ETA %.0fs; p50 ms %s",
                done,
                len(qids),
                (len(qids) - done) / rate,
                {s: round(float(np.median(latency[s])), 1) for s in systems},
            )
            entry = summarise(qids[:done], results, latency, data, record, store, size)
            entry.update(
                export_reused=bool(reused),
                query_encoding_ms_per_query_batched=round(1000 * encode_s / len(qids), 2),
                queries_planned=len(qids),
            )
            write(dataset, entry, done == len(qids))
    target.close()


def summarise(qids, results, latency, data, record, store, size) -> dict:
    """Quality, agreement and latency over the queries ``qids`` run so far."""

    def top10(system, qid):
        return list(results[system][qid])[:10]

    def agree(a, b):
        if a not in results or b not in results:
            return None
        return f"{sum(top10(a, q) == top10(b, q) for q in qids)}/{len(qids)}"

    score_diff = None
    if {"qdrant multivector", "aligner_jax exhaustive"} <= results.keys():
        score_diff = max(
            abs(s - results["aligner_jax exhaustive"][q][d])
            for q in qids
            for d, s in list(results["qdrant multivector"][q].items())[:10]
        )
    rows = []
    for system in results:
        judged = {q: data.qrels[q] for q in qids}  # the queries run so far
        ev = metrics.evaluate_run(judged, {q: results[system][q] for q in qids})
        times = latency[system][: len(qids)]
        rows.append(
            {
                "system": system,
                "ndcg@10": round(100 * ev["ndcg@10"], 2),
                "recall@100": round(100 * ev["recall@100"], 2),
                "p50_ms": round(float(np.percentile(times, 50)), 2),
                "p90_ms": round(float(np.percentile(times, 90)), 2),
            }
        )
    return {
        "dataset": data.name,
        "index_dir": record["index_dir"],
        "num_docs": record["num_points"],
        "num_tokens": store.num_tokens,
        "dim": store.dim,
        "num_queries": len(qids),
        "k": _K.value,
        "export_s": record["seconds"],
        "disk_bytes": size,
        "store_bytes": store.nbytes(),
        "top10_equal_qdrant_multivector_vs_exhaustive": agree(
            "qdrant multivector", "aligner_jax exhaustive"
        ),
        "max_top10_score_diff_multivector": score_diff,
        "top10_equal_qdrant_sparse_vs_bm25s": agree("qdrant sparse", "bm25s"),
        "rows": rows,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_1m": os.getloadavg()[0],
            "note": "2 cores shared with other engineers' jobs (busy); systems interleaved",
        },
    }


def write(dataset: str, entry: dict, final: bool) -> None:
    out = Path(_OUT.value)
    merged = {}
    if out.with_suffix(".json").exists():
        merged = json.loads(out.with_suffix(".json").read_text())
    merged[dataset] = entry
    fileio.atomic_write_json(out.with_suffix(".json"), merged)
    fileio.atomic_write_text(out.with_suffix(".md"), markdown(merged))
    if final:
        print(markdown({dataset: entry}))


def agreement(e: dict) -> str:
    """How often Qdrant's MaxSim top-10 was the exhaustive searcher's (this pass or an earlier
    one recorded under ``exhaustive_check``)."""
    check = e.get("exhaustive_check") or {
        "top10_equal": e["top10_equal_qdrant_multivector_vs_exhaustive"],
        "max_score_diff": e["max_top10_score_diff_multivector"],
        "note": "",
    }
    if check["top10_equal"] is None:
        return "The exhaustive searcher was not run."
    return (
        f"Qdrant multivector top-10 = the exhaustive top-1 searcher's top-10 on "
        f"{check['top10_equal']} queries{check['note']} (max score difference "
        f"{check['max_score_diff']:.2g})."
    )


def markdown(merged: dict) -> str:
    lines = ["# Serving on Qdrant (embedded qdrant_edge shard), batch 1, k=100", ""]
    for dataset, e in merged.items():
        mb = e["disk_bytes"]["allocated"] / 1e6
        lines += [
            f"## {dataset}: {e['num_docs']} documents, {e['num_tokens']} tokens × {e['dim']}, "
            f"{e['num_queries']} of {e.get('queries_planned', e['num_queries'])} test queries",
            "",
            f"Export {e['export_s']['total']:.1f} s (BM25 vectors {e['export_s']['sparse']:.1f} s); "
            f"shard {mb:.0f} MB on disk (store: {e['store_bytes'] / 1e6:.0f} MB float16). "
            f"{agreement(e)} Qdrant BM25 top-10 = bm25s on "
            f"{e['top10_equal_qdrant_sparse_vs_bm25s']}. Query encoding (batched) "
            f"{e['query_encoding_ms_per_query_batched']} ms/query, excluded below. "
            f"Load average (1 min) at the last write: {e['machine']['load_avg_1m']:.1f} (2 cores).",
            "",
            "| system | nDCG@10 | R@100 | p50 ms | p90 ms |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['system']} | {r['ndcg@10']:.1f} | {r['recall@100']:.1f} | {r['p50_ms']:.1f} "
            f"| {r['p90_ms']:.1f} |"
            for r in e["rows"]
        ]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    flags.mark_flag_as_required("index_dir")
    app.run(main)
