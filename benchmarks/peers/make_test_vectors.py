#!/usr/bin/env python
"""Write a small synthetic vector folder in the run_peer.py input format (NumPy only).

    python benchmarks/peers/make_test_vectors.py --out /tmp/peer_small \
        [--docs 300 --doc_tokens 50 --dim 128 --queries 20 --query_tokens 16 \
         --mode clustered --seed 0]

mode=random:    every token is an independent random unit vector (no structure;
                MaxSim differences between documents are tiny, a hard case for
                any IVF/centroid-pruned engine).
mode=clustered: tokens are noisy copies of a few hundred "topic" centroids, and
                each query is built from noisy copies of tokens of one target
                document (closer to real late-interaction data).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--docs", type=int, default=300)
    ap.add_argument("--doc_tokens", type=int, default=50, help="mean tokens per doc")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--queries", type=int, default=20)
    ap.add_argument("--query_tokens", type=int, default=16)
    ap.add_argument("--mode", choices=["random", "clustered"], default="clustered")
    ap.add_argument("--topics", type=int, default=256)
    ap.add_argument("--noise", type=float, default=0.35)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    lens = rng.integers(max(1, args.doc_tokens // 2), args.doc_tokens * 3 // 2 + 1, size=args.docs)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    total = int(offsets[-1])
    d = args.dim

    if args.mode == "random":
        docs = _unit(rng.standard_normal((total, d)))
    else:
        topics = _unit(rng.standard_normal((args.topics, d)))
        assign = rng.integers(0, args.topics, size=total)
        docs = _unit(topics[assign] + args.noise * rng.standard_normal((total, d)) / np.sqrt(d) * 4)

    q_lens = np.full(args.queries, args.query_tokens)
    q_offsets = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    if args.mode == "random":
        queries = _unit(rng.standard_normal((int(q_offsets[-1]), d)))
        targets = [None] * args.queries
    else:
        rows = []
        targets = []
        for _ in range(args.queries):
            t = int(rng.integers(0, args.docs))
            targets.append(t)
            src = rng.integers(offsets[t], offsets[t + 1], size=args.query_tokens)
            rows.append(
                _unit(
                    docs[src]
                    + args.noise * rng.standard_normal((args.query_tokens, d)) / np.sqrt(d) * 4
                )
            )
        queries = np.concatenate(rows)

    os.makedirs(args.out, exist_ok=True)
    np.save(os.path.join(args.out, "doc_vectors.npy"), docs.astype(np.float16))
    np.save(os.path.join(args.out, "doc_offsets.npy"), offsets)
    with open(os.path.join(args.out, "doc_ids.json"), "w") as f:
        json.dump([f"d{i}" for i in range(args.docs)], f)
    np.save(os.path.join(args.out, "query_vectors.npy"), queries.astype(np.float16))
    np.save(os.path.join(args.out, "query_offsets.npy"), q_offsets)
    with open(os.path.join(args.out, "query_ids.json"), "w") as f:
        json.dump([f"q{i}" for i in range(args.queries)], f)
    with open(os.path.join(args.out, "targets.json"), "w") as f:
        json.dump(targets, f)
    print(f"wrote {args.out}: {args.docs} docs, {total} tokens, {args.queries} queries, dim {d}")


if __name__ == "__main__":
    main()
