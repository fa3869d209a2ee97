r"""Scaling benchmark of the token index on synthetic token vectors (no encoder).

For each corpus size (default 1M, 4M and 16M tokens of 128-d vectors) this writes a synthetic
token store (clustered unit vectors in float16, ~200-token documents, 500-document shards), then,
in a fresh subprocess per size so that peak RSS is that size's own, builds the ScaNN token index
over all shards, measures its bytes, the search time per query (32 query tokens, k′ neighbours
each) and the candidate recall against exact brute-force search (the fraction of the documents
exact search makes candidates that ScaNN also makes candidates).

  .venv/bin/python benchmarks/scaling.py                      # 1M, 4M, 16M tokens
  .venv/bin/python benchmarks/scaling.py --sizes=1000000 --workdir=/tmp/scaling

Writes benchmarks/results/scaling.{json,md} and scaling.png (cost against corpus size).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DIM = 128
DOC_TOKENS = 200
SHARD_DOCS = 500
CLUSTERS = 4096


def make_store(directory: Path, num_tokens: int, seed: int = 0) -> None:
    """Writes a synthetic store of ``num_tokens`` clustered unit vectors, shard by shard."""
    from aligner_jax import token_store as ts

    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(CLUSTERS, DIM)).astype(np.float32)
    centers /= np.linalg.norm(centers, axis=1, keepdims=True)
    directory.mkdir(parents=True, exist_ok=True)
    num_docs = num_tokens // DOC_TOKENS
    entries = []
    for shard, start in enumerate(range(0, num_docs, SHARD_DOCS)):
        docs = []
        for d in range(start, min(start + SHARD_DOCS, num_docs)):
            topic = rng.integers(0, CLUSTERS, size=8)  # a document mixes a few topics
            assign = topic[rng.integers(0, 8, size=DOC_TOKENS)]
            v = centers[assign] + 0.35 * rng.normal(size=(DOC_TOKENS, DIM)).astype(np.float32)
            v /= np.linalg.norm(v, axis=1, keepdims=True)
            docs.append(
                ts.EncodedDocument(
                    doc_id=f"doc{d}",
                    vectors=v.astype(np.float16),
                    salience=np.ones(DOC_TOKENS, np.float32),
                    token_ids=np.zeros(DOC_TOKENS, np.int32),
                )
            )
        entries.append(ts.write_shard(directory, shard, docs, DIM))
    ts.write_manifest(
        directory,
        {
            "model": {"name": "synthetic", "fingerprint": f"synthetic-{num_tokens}", "dim": DIM},
            "counts": {
                "num_docs": num_docs,
                "num_tokens": sum(e["num_tokens"] for e in entries),
                "num_shards": len(entries),
            },
            "shards": entries,
        },
    )
    np.save(directory / "centers.npy", centers)


def measure(directory: Path, k_prime: int, num_queries: int, seed: int = 1) -> dict:
    """Runs in its own process: build, size, search time and candidate recall; peak RSS."""
    from aligner_jax import token_index as ti
    from aligner_jax import token_store as ts

    store = ts.TokenStore(directory)
    t0 = time.perf_counter()
    index = ti.TokenIndex.build(store, "scann", k_prime=k_prime)
    build_s = time.perf_counter() - t0
    index_bytes = index.nbytes()
    rng = np.random.default_rng(seed)
    centers = np.load(directory / "centers.npy")
    queries = []
    for _ in range(num_queries):
        q = centers[rng.integers(0, CLUSTERS, size=32)] + 0.35 * rng.normal(size=(32, DIM))
        queries.append((q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32))
    index.search(queries[0], k_prime)  # warm-up
    times, found = [], []
    for q in queries:
        t = time.perf_counter()
        _, docs, _ = index.search(q, k_prime)
        times.append(1000 * (time.perf_counter() - t))
        found.append(set(np.unique(docs[docs >= 0]).tolist()))
    exact = ti.TokenIndex.build(store, "exact")
    recalls = []
    exact_q = min(num_queries, 10)
    for q, got in zip(queries[:exact_q], found[:exact_q], strict=True):
        _, docs, _ = exact.search(q, k_prime)
        truth = set(np.unique(docs[docs >= 0]).tolist())
        recalls.append(len(truth & got) / max(len(truth), 1))
    return {
        "num_tokens": store.num_tokens,
        "num_docs": store.num_docs,
        "num_parts": index.num_parts,
        "build_s": build_s,
        "index_bytes": index_bytes,
        "store_bytes": store.nbytes(),
        "search_ms_per_query_p50": float(np.median(times)),
        "search_ms_per_query_p90": float(np.percentile(times, 90)),
        "candidate_recall": float(np.mean(recalls)),
        "recall_queries": exact_q,
        "k_prime": k_prime,
        "query_tokens": 32,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["num_tokens"] / 1e6 for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    axes[0].plot(n, [r["build_s"] for r in rows], "o-", label="build (s)")
    axes[0].plot(n, [r["peak_rss_gib"] for r in rows], "s-", label="peak RSS (GiB)")
    axes[0].plot(n, [r["index_bytes"] / 2**30 for r in rows], "^-", label="index (GiB)")
    axes[1].plot(n, [r["search_ms_per_query_p50"] for r in rows], "o-", label="search ms/query")
    axes[2].plot(n, [100 * r["candidate_recall"] for r in rows], "o-", label="candidate recall %")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("corpus size (M tokens, 128-d)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    fig.suptitle("ScaNN token index: cost against corpus size (synthetic token vectors)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000000,4000000,16000000")
    parser.add_argument("--k_prime", type=int, default=1000)
    parser.add_argument("--num_queries", type=int, default=50)
    parser.add_argument("--workdir", default="/tmp/aligner_scaling")
    parser.add_argument("--output", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one size, in-process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure), args.k_prime, args.num_queries)))
        return
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        directory = Path(args.workdir) / f"store_{size}"
        if not (directory / "manifest.json").exists():
            shutil.rmtree(directory, ignore_errors=True)
            t = time.perf_counter()
            make_store(directory, size)
            print(f"{size:>10} tokens: synthetic store written in {time.perf_counter() - t:.0f}s")
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                f"--measure={directory}",
                f"--k_prime={args.k_prime}",
                f"--num_queries={args.num_queries}",
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            sys.exit(f"measurement of {size} tokens failed:\n{proc.stderr[-3000:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{row['num_tokens']:>10} tokens: build {row['build_s']:.1f}s, peak RSS "
            f"{row['peak_rss_gib']:.2f} GiB, index {row['index_bytes'] / 2**30:.2f} GiB, search "
            f"{row['search_ms_per_query_p50']:.1f} ms/query, candidate recall "
            f"{100 * row['candidate_recall']:.1f}%",
            flush=True,
        )
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        f"# Token index scaling (synthetic 128-d token vectors, ScaNN, k′={args.k_prime}, "
        "32 query tokens)",
        "",
        "| tokens | parts | build s | peak RSS GiB | index GiB | search ms/query p50 | candidate recall |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['num_tokens']:,} | {r['num_parts']} | {r['build_s']:.1f} | "
            f"{r['peak_rss_gib']:.2f} | {r['index_bytes'] / 2**30:.2f} | "
            f"{r['search_ms_per_query_p50']:.1f} | {100 * r['candidate_recall']:.1f}% |"
        )
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        grow = b["num_tokens"] / a["num_tokens"]
        lines += [
            "",
            f"From {a['num_tokens']:,} to {b['num_tokens']:,} tokens (×{grow:.0f}): build ×"
            f"{b['build_s'] / a['build_s']:.1f}, search ×"
            f"{b['search_ms_per_query_p50'] / a['search_ms_per_query_p50']:.1f}, peak RSS ×"
            f"{b['peak_rss_gib'] / a['peak_rss_gib']:.1f}.",
        ]
    (out / "scaling.md").write_text("\n".join(lines) + "\n")
    plot(rows, out / "scaling.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
