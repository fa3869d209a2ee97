#!/usr/bin/env python
"""Export an aligner_jax token store to the run_peer.py input format (NumPy only).

    python benchmarks/peers/export_store.py --index_dir outputs/zero_shot_scifact/index \
        --out /tmp/scifact_vectors [--max_docs 1000] \
        [--pseudo_queries 50 --query_tokens 16]

Reads the store's ``manifest.json`` (shard order from its ``shards`` list; falls
back to sorted ``shard-*.vectors.npy``) and concatenates, in order:

    shard-XXXXX.vectors.npy   float16 [T, D]  -> doc_vectors.npy
    shard-XXXXX.offsets.npy   int64 [n+1]     -> doc_offsets.npy (re-based)
    shard-XXXXX.doc_ids.json  list[str]       -> doc_ids.json

Vectors are copied as stored (no salience weighting is applied; the
``*.salience.npy`` / ``*.token_ids.npy`` files are ignored).  It does not
import aligner_jax.

Queries are normally supplied by the main benchmark.  For a self-contained
trial, ``--pseudo_queries N`` also writes query files whose queries are the
first ``--query_tokens`` token vectors of N documents spread evenly over the
WHOLE store (so with ``--max_docs`` some source documents lie outside the
exported set and the query is not trivially its own best match).
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import numpy as np


def shard_names(index_dir: str) -> list[str]:
    manifest = os.path.join(index_dir, "manifest.json")
    if os.path.exists(manifest):
        with open(manifest) as f:
            m = json.load(f)
        shards = m.get("shards") or []
        names = []
        for s in sorted(shards, key=lambda s: s.get("index", 0)):
            name = s.get("name")
            if name is None:
                path = s["files"]["vectors"]["path"]
                name = os.path.basename(path)[: -len(".vectors.npy")]
            names.append(name)
        if names:
            return names
    paths = sorted(glob.glob(os.path.join(index_dir, "shard-*.vectors.npy")))
    return [os.path.basename(p)[: -len(".vectors.npy")] for p in paths]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--index_dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max_docs", type=int, default=None)
    ap.add_argument("--pseudo_queries", type=int, default=0)
    ap.add_argument("--query_tokens", type=int, default=16)
    args = ap.parse_args(argv)

    names = shard_names(args.index_dir)
    if not names:
        raise SystemExit(f"no shards found in {args.index_dir}")

    vec_parts, off_parts, ids = [], [], []
    all_shards = []  # (vectors mmap, offsets) for pseudo queries over the whole store
    base = 0
    n_docs = 0
    for name in names:
        v = np.load(os.path.join(args.index_dir, f"{name}.vectors.npy"), mmap_mode="r")
        o = np.load(os.path.join(args.index_dir, f"{name}.offsets.npy")).astype(np.int64)
        with open(os.path.join(args.index_dir, f"{name}.doc_ids.json")) as f:
            d = [str(x) for x in json.load(f)]
        if len(d) != len(o) - 1 or int(o[-1]) != v.shape[0]:
            raise SystemExit(
                f"{name}: inconsistent shard ({len(d)} ids, {len(o) - 1} docs, {v.shape[0]} rows)"
            )
        all_shards.append((v, o))
        if args.max_docs is not None and n_docs >= args.max_docs:
            continue
        take = len(d) if args.max_docs is None else min(len(d), args.max_docs - n_docs)
        rows = int(o[take])
        vec_parts.append(np.asarray(v[:rows], dtype=np.float16))
        off_parts.append(o[1 : take + 1] + base)
        ids.extend(d[:take])
        base += rows
        n_docs += take

    offsets = np.concatenate([np.zeros(1, np.int64)] + off_parts)
    vectors = np.concatenate(vec_parts)
    os.makedirs(args.out, exist_ok=True)
    np.save(os.path.join(args.out, "doc_vectors.npy"), vectors)
    np.save(os.path.join(args.out, "doc_offsets.npy"), offsets)
    with open(os.path.join(args.out, "doc_ids.json"), "w") as f:
        json.dump(ids, f)
    print(f"wrote {args.out}: {len(ids)} docs, {vectors.shape[0]} tokens, dim {vectors.shape[1]}")

    if args.pseudo_queries > 0:
        total_docs = sum(len(o) - 1 for _, o in all_shards)
        picks = np.linspace(0, total_docs - 1, args.pseudo_queries).astype(np.int64)
        q_rows, q_off, q_ids = [], [0], []
        starts = np.cumsum([0] + [len(o) - 1 for _, o in all_shards])
        for p in picks:
            s = int(np.searchsorted(starts, p, side="right")) - 1
            v, o = all_shards[s]
            local = int(p - starts[s])
            a, b = int(o[local]), int(o[local + 1])
            b = min(b, a + args.query_tokens)
            q_rows.append(np.asarray(v[a:b], dtype=np.float16))
            q_off.append(q_off[-1] + (b - a))
            q_ids.append(f"pq{int(p)}")
        np.save(os.path.join(args.out, "query_vectors.npy"), np.concatenate(q_rows))
        np.save(os.path.join(args.out, "query_offsets.npy"), np.asarray(q_off, np.int64))
        with open(os.path.join(args.out, "query_ids.json"), "w") as f:
            json.dump(q_ids, f)
        print(f"wrote {len(q_ids)} pseudo queries of <= {args.query_tokens} tokens")


if __name__ == "__main__":
    main()
