#!/usr/bin/env python
"""Compare run_peer.py result JSONs with exact MaxSim computed in NumPy.

    python benchmarks/peers/check_exact.py --vectors DIR RESULT.json [RESULT.json ...] \
        [--at 10] [--chunk_tokens 2000000]

Exact MaxSim(q, d) = sum over query tokens of max over doc tokens of q_i . d_j
(float32 arithmetic on the float16 inputs).  Prints, per result file: mean
top-`at` overlap with the exact top-`at`, recall of the exact top-1, median
and p95 latency, build time, index bytes, and error (if any).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np


def exact_topk(vec_dir: str, at: int, chunk_tokens: int, max_queries=None):
    docs = np.load(os.path.join(vec_dir, "doc_vectors.npy"), mmap_mode="r")
    offs = np.load(os.path.join(vec_dir, "doc_offsets.npy"))
    doc_ids = json.load(open(os.path.join(vec_dir, "doc_ids.json")))
    qv = np.load(os.path.join(vec_dir, "query_vectors.npy")).astype(np.float32)
    qo = np.load(os.path.join(vec_dir, "query_offsets.npy"))
    qids = json.load(open(os.path.join(vec_dir, "query_ids.json")))
    if max_queries is not None:
        qids = qids[:max_queries]
    nq = len(qids)
    n = len(offs) - 1
    scores = np.zeros((nq, n), dtype=np.float32)
    # Process docs in token chunks aligned to doc boundaries.
    start_doc = 0
    while start_doc < n:
        end_doc = int(np.searchsorted(offs, offs[start_doc] + chunk_tokens, side="right")) - 1
        end_doc = max(end_doc, start_doc + 1)
        end_doc = min(end_doc, n)
        t0, t1 = int(offs[start_doc]), int(offs[end_doc])
        block = np.asarray(docs[t0:t1], dtype=np.float32)
        local = offs[start_doc : end_doc + 1] - t0
        for qi in range(nq):
            q = qv[qo[qi] : qo[qi + 1]]
            sim = q @ block.T  # [tq, tokens]
            mx = np.maximum.reduceat(sim, local[:-1], axis=1)  # [tq, docs]
            scores[qi, start_doc:end_doc] = mx.sum(axis=0)
        start_doc = end_doc
    out = {}
    for qi, qid in enumerate(qids):
        order = np.argsort(-scores[qi], kind="stable")[:at]
        out[qid] = [(doc_ids[j], float(scores[qi, j])) for j in order]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--vectors", required=True)
    ap.add_argument("--at", type=int, default=10)
    ap.add_argument("--chunk_tokens", type=int, default=500_000)
    ap.add_argument("results", nargs="+")
    args = ap.parse_args(argv)

    loaded = [json.load(open(p)) for p in args.results]
    max_q = max((len(r.get("results") or {}) for r in loaded), default=0)
    exact = exact_topk(args.vectors, args.at, args.chunk_tokens, max_queries=max_q or None)
    for path, r in zip(args.results, loaded, strict=False):
        lat = np.asarray(r.get("latency_ms") or [], dtype=np.float64)
        res = r.get("results") or {}
        overlaps, top1 = [], []
        for qid, hits in res.items():
            if qid not in exact:
                continue
            want = [d for d, _ in exact[qid]]
            got = [d for d, _ in hits[: args.at]]
            overlaps.append(len(set(want) & set(got)) / len(want))
            top1.append(want[0] in got)
        line = {
            "file": os.path.basename(path),
            "system": r.get("system"),
            "setting": r.get("setting"),
            f"top{args.at}_overlap": round(float(np.mean(overlaps)), 4) if overlaps else None,
            "exact_top1_in_topk": round(float(np.mean(top1)), 4) if top1 else None,
            "queries": len(res),
            "median_ms": round(float(np.median(lat)), 3) if lat.size else None,
            "p95_ms": round(float(np.percentile(lat, 95)), 3) if lat.size else None,
            "build_s": None if r.get("build_s") is None else round(r["build_s"], 2),
            "index_bytes": r.get("index_bytes"),
            "peak_rss_mb": round(r["peak_rss_bytes"] / 2**20, 1)
            if r.get("peak_rss_bytes")
            else None,
            "error": r.get("error"),
        }
        print(json.dumps(line))


if __name__ == "__main__":
    main()
