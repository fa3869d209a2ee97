r"""Scaling benchmark of the token index on synthetic token vectors (no encoder).

For each corpus size (default 1M, 4M and 16M tokens of 128-d vectors) this writes a synthetic
token store (clustered unit vectors in float16, ~200-token documents, 500-document shards), then,
in a fresh subprocess per size so that peak RSS is that size's own, builds the ScaNN token index
over all shards, measures its bytes, the search time per query (32 query tokens, k′ neighbours
each) and the candidate recall against exact brute-force search (the fraction of the documents
exact search makes candidates that ScaNN also makes candidates).

  .venv/bin/python benchmarks/scaling.py                      # 1M, 4M, 16M tokens
  .venv/bin/python benchmarks/scaling.py --sizes=1000000 --workdir=/tmp/scaling
  # the recall / cost knobs of ScannConfig, written under another name:
  .venv/bin/python benchmarks/scaling.py --sizes=4000000 --reorder_factor=8 --name=scaling_4m_r8

Synthetic tokens are a random unit centre (one of 4096) plus N(0, σ²) noise per dimension,
normalised; σ = ``--noise``. The default 0.074 is calibrated on real tokens: ``--calibrate=STORE``
fits 4096 k-means centroids to a token store and reports the held-out mean cosine of a token to
its nearest centroid (0.77 for the trained SciFact store) and the σ giving the same cosine to the
centre. ``--noise=0.35`` (cosine 0.25) is a near-isotropic stress case.

  .venv/bin/python benchmarks/scaling.py --calibrate=outputs/eval_s400_exh/index

Writes benchmarks/results/NAME.{json,md} and, for several sizes, NAME.png (cost against corpus
size); NAME is ``--name`` (default ``scaling``).
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from absl import app, flags

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DIM = 128
DOC_TOKENS = 200
SHARD_DOCS = 500
CLUSTERS = 4096
DEFAULT_NOISE = 0.074


def make_store(directory: Path, num_tokens: int, noise: float, seed: int = 0) -> None:
    """Writes a synthetic store of ``num_tokens`` clustered unit vectors, shard by shard."""
    from aligner_jax.indexing import token_store as ts

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
            v = centers[assign] + noise * rng.normal(size=(DOC_TOKENS, DIM)).astype(np.float32)
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
            "model": {
                "name": "synthetic",
                "fingerprint": f"synthetic-{num_tokens}-{noise}",
                "dim": DIM,
            },
            "counts": {
                "num_docs": num_docs,
                "num_tokens": sum(e["num_tokens"] for e in entries),
                "num_shards": len(entries),
            },
            "shards": entries,
        },
    )
    np.save(directory / "centers.npy", centers)


def measure(
    directory: Path, k_prime: int, num_queries: int, scann: dict, noise: float, seed: int = 1
) -> dict:
    """Runs in its own process: build, size, search time and candidate recall; peak RSS."""
    from aligner_jax.indexing import ann as ti
    from aligner_jax.indexing import token_store as ts

    store = ts.TokenStore(directory)
    t0 = time.perf_counter()
    index = ti.TokenIndex.build(
        store, "scann", k_prime=k_prime, scann_config=ti.ScannConfig(**scann)
    )
    build_s = time.perf_counter() - t0
    index_bytes = index.nbytes()
    rng = np.random.default_rng(seed)
    centers = np.load(directory / "centers.npy")
    queries = []
    for _ in range(num_queries):
        q = centers[rng.integers(0, CLUSTERS, size=32)] + noise * rng.normal(size=(32, DIM))
        queries.append((q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32))
    index.search(queries[0], k_prime)  # warm-up
    times, found, found_rows = [], [], []
    for q in queries:
        t = time.perf_counter()
        _, docs, rows = index.search(q, k_prime)
        times.append(1000 * (time.perf_counter() - t))
        found.append(set(np.unique(docs[docs >= 0]).tolist()))
        found_rows.append(rows)
    exact = ti.TokenIndex.build(store, "exact")
    recalls, top10 = [], []
    exact_q = min(num_queries, 10)
    for i, q in enumerate(queries[:exact_q]):
        scores, docs, rows = exact.search(q, k_prime)
        truth = set(np.unique(docs[docs >= 0]).tolist())
        recalls.append(len(truth & found[i]) / max(len(truth), 1))
        # Token recall 10@k′: each query token's 10 nearest tokens among ScaNN's k′.
        nearest = np.take_along_axis(rows, np.argsort(-scores, axis=1)[:, :10], axis=1)
        top10 += [len(set(nearest[t]) & set(found_rows[i][t])) / 10 for t in range(len(nearest))]
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
        "token_recall_10": float(np.mean(top10)),
        "recall_queries": exact_q,
        "k_prime": k_prime,
        "scann_config": scann,
        "noise": noise,
        "cos_to_centre": cos_to_centre(noise),
        "query_tokens": 32,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def cos_to_centre(noise: float) -> float:
    """Expected cosine of a synthetic token to its unit centre: 1 / sqrt(1 + DIM σ²)."""
    return float(1.0 / np.sqrt(1.0 + DIM * noise**2))


def calibrate(directory: Path, sample: int = 120_000, held_out: int = 50_000, seed: int = 0):
    """How clustered a real token store is: k-means (CLUSTERS centroids, spherical, 8 rounds)
    on a sample, then the mean cosine of held-out tokens to their nearest centroid, and the σ of
    the synthetic generator whose tokens have that cosine to their centre."""
    from aligner_jax.indexing import token_store as ts

    vectors = ts.TokenStore(directory).vectors().astype(np.float32)
    rng = np.random.default_rng(seed)
    train = vectors[rng.choice(len(vectors), min(sample, len(vectors)), replace=False)]
    centroids = train[rng.choice(len(train), CLUSTERS, replace=False)].copy()

    def nearest(x):
        best, score = np.empty(len(x), np.int64), np.empty(len(x), np.float32)
        for i in range(0, len(x), 20_000):
            s = x[i : i + 20_000] @ centroids.T
            best[i : i + 20_000], score[i : i + 20_000] = s.argmax(1), s.max(1)
        return best, score

    for _ in range(8):
        best, _ = nearest(train)
        sums = np.zeros_like(centroids)
        np.add.at(sums, best, train)
        used = np.bincount(best, minlength=CLUSTERS) > 0
        centroids[used] = sums[used] / np.linalg.norm(sums[used], axis=1, keepdims=True)
    test = vectors[rng.choice(len(vectors), min(held_out, len(vectors)), replace=False)]
    cos = float(nearest(test)[1].mean())
    return {
        "store": str(directory),
        "tokens": len(vectors),
        "dim": int(vectors.shape[1]),
        "centroids": CLUSTERS,
        "held_out_mean_cos_to_nearest_centroid": cos,
        "matching_noise": float(np.sqrt((1.0 / cos**2 - 1.0) / vectors.shape[1])),
    }


def _describe(scann: dict) -> str:
    from aligner_jax.indexing import ann as ti

    config = ti.ScannConfig(**scann)
    searched = (
        f"{config.num_leaves_to_search} of them"
        if config.num_leaves_to_search is not None
        else f"{config.leaves_to_search_fraction:g} of them"
    )
    return (
        f"leaves = √tokens per part, search {searched}, "
        f"reorder {config.reorder_factor:g} × k′ exactly" + (" (defaults)" if not scann else "")
    )


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
    axes[2].plot(n, [100 * r["token_recall_10"] for r in rows], "s-", label="token recall 10@k′ %")
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


FLAGS = flags.FLAGS
flags.DEFINE_string("sizes", "1000000,4000000,16000000", "Corpus sizes in tokens, comma-separated.")
flags.DEFINE_integer("k_prime", 1000, "Token neighbours per query token.")
flags.DEFINE_integer("num_queries", 50, "Queries per size.")
flags.DEFINE_string("workdir", "/tmp/aligner_scaling", "Where the synthetic stores go.")
flags.DEFINE_string("output", str(REPO / "benchmarks" / "results"), "Output folder.")
flags.DEFINE_float("leaves_to_search_fraction", None, "ScannConfig.leaves_to_search_fraction.")
flags.DEFINE_float("reorder_factor", None, "ScannConfig.reorder_factor.")
flags.DEFINE_integer("num_leaves_to_search", None, "ScannConfig.num_leaves_to_search.")
flags.DEFINE_string("name", "scaling", "Output file stem.")
flags.DEFINE_float("noise", DEFAULT_NOISE, "σ of token noise.")
flags.DEFINE_string("calibrate", None, "A token store: print its clustering statistics.")
flags.DEFINE_string("measure", None, "Internal: measure one size in-process.")


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    args = FLAGS
    scann = {
        k: v
        for k, v in (
            ("leaves_to_search_fraction", args.leaves_to_search_fraction),
            ("reorder_factor", args.reorder_factor),
            ("num_leaves_to_search", args.num_leaves_to_search),
        )
        if v is not None
    }
    if args.measure:
        print(
            json.dumps(
                measure(Path(args.measure), args.k_prime, args.num_queries, scann, args.noise)
            )
        )
        return
    if args.calibrate:
        print(json.dumps(calibrate(Path(args.calibrate)), indent=1))
        return
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        directory = Path(args.workdir) / f"store_{size}_noise{args.noise:g}"
        if not (directory / "manifest.json").exists():
            shutil.rmtree(directory, ignore_errors=True)
            t = time.perf_counter()
            make_store(directory, size, args.noise)
            print(f"{size:>10} tokens: synthetic store written in {time.perf_counter() - t:.0f}s")
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                f"--measure={directory}",
                f"--k_prime={args.k_prime}",
                f"--num_queries={args.num_queries}",
                f"--noise={args.noise}",
                *[f"--{k}={v}" for k, v in scann.items()],
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
            f"{100 * row['candidate_recall']:.1f}%, token recall 10@k′ "
            f"{100 * row['token_recall_10']:.1f}%",
            flush=True,
        )
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        f"# Token index scaling (synthetic 128-d token vectors, ScaNN, k′={args.k_prime}, "
        "32 query tokens)",
        "",
        f"ScannConfig: {_describe(scann)}. Tokens: σ = {args.noise:g} (cosine to their centre "
        f"≈ {cos_to_centre(args.noise):.2f}).",
        "",
        "| tokens | parts | build s | peak RSS GiB | index GiB | search ms/query p50 | "
        "candidate recall | token recall 10@k′ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['num_tokens']:,} | {r['num_parts']} | {r['build_s']:.1f} | "
            f"{r['peak_rss_gib']:.2f} | {r['index_bytes'] / 2**30:.2f} | "
            f"{r['search_ms_per_query_p50']:.1f} | {100 * r['candidate_recall']:.1f}% | "
            f"{100 * r['token_recall_10']:.1f}% |"
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
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    if len(rows) > 1:
        plot(rows, out / f"{args.name}.png")
    print("\n".join(lines))


if __name__ == "__main__":
    app.run(main)
