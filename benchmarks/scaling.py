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


def synthetic_centres(rng: np.random.Generator) -> np.ndarray:
    """CLUSTERS random unit centres (the first draw of the store's generator)."""
    centers = rng.normal(size=(CLUSTERS, DIM)).astype(np.float32)
    return centers / np.linalg.norm(centers, axis=1, keepdims=True)


def synthetic_document(
    rng: np.random.Generator, centers: np.ndarray, noise: float
) -> tuple[np.ndarray, np.ndarray]:
    """One document's DOC_TOKENS unit vectors (float32) and each token's centre index."""
    topic = rng.integers(0, CLUSTERS, size=8)  # a document mixes a few topics
    assign = topic[rng.integers(0, 8, size=DOC_TOKENS)]
    v = centers[assign] + noise * rng.normal(size=(DOC_TOKENS, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True), assign


def synthetic_queries(
    centers: np.ndarray, num_queries: int, noise: float, seed: int = 1
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``num_queries`` queries of 32 unit token vectors (float32) and their tokens' centres."""
    rng = np.random.default_rng(seed)
    queries, assigns = [], []
    for _ in range(num_queries):
        assign = rng.integers(0, CLUSTERS, size=32)
        q = centers[assign] + noise * rng.normal(size=(32, DIM))
        queries.append((q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32))
        assigns.append(assign)
    return queries, assigns


def make_store(directory: Path, num_tokens: int, noise: float, seed: int = 0) -> None:
    """Writes a synthetic store of ``num_tokens`` clustered unit vectors, shard by shard."""
    from aligner_jax.indexing import token_store as ts

    rng = np.random.default_rng(seed)
    centers = synthetic_centres(rng)
    directory.mkdir(parents=True, exist_ok=True)
    num_docs = num_tokens // DOC_TOKENS
    entries = []
    for shard, start in enumerate(range(0, num_docs, SHARD_DOCS)):
        docs = []
        for d in range(start, min(start + SHARD_DOCS, num_docs)):
            v, _ = synthetic_document(rng, centers, noise)
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
    queries, _ = synthetic_queries(np.load(directory / "centers.npy"), num_queries, noise, seed)
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


def markdown(rows: list[dict]) -> str:
    """NAME.md: the table of ``rows`` (NAME.json); lines whose fields the rows lack are left out."""
    first = rows[0]
    lines = [
        f"# Token index scaling (synthetic 128-d token vectors, ScaNN, k′={first['k_prime']}, "
        f"{first['query_tokens']} query tokens)",
        "",
    ]
    if "scann_config" in first and "noise" in first:
        lines += [
            f"ScannConfig: {_describe(first['scann_config'])}. Tokens: σ = {first['noise']:g} "
            f"(cosine to their centre ≈ {cos_to_centre(first['noise']):.2f}).",
            "",
        ]
    token_recall = all("token_recall_10" in r for r in rows)
    lines += [
        "| tokens | parts | build s | peak RSS GiB | index GiB | search ms/query p50 | "
        "candidate recall |" + (" token recall 10@k′ |" if token_recall else ""),
        "|---|---|---|---|---|---|---|" + ("---|" if token_recall else ""),
    ]
    for r in rows:
        lines.append(
            f"| {r['num_tokens']:,} | {r['num_parts']} | {r['build_s']:.1f} | "
            f"{r['peak_rss_gib']:.2f} | {r['index_bytes'] / 2**30:.2f} | "
            f"{r['search_ms_per_query_p50']:.1f} | {100 * r['candidate_recall']:.1f}% |"
            + (f" {100 * r['token_recall_10']:.1f}% |" if token_recall else "")
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
    return "\n".join(lines) + "\n"


def _millions(num_tokens: int) -> str:
    return f"{num_tokens / 1e6:g}M"


def recall_dips(rows: list[dict]) -> list[int]:
    """Indices of the sizes whose candidate recall is below both neighbours'."""
    r = [row["candidate_recall"] for row in rows]
    return [i for i in range(1, len(r) - 1) if r[i] < r[i - 1] and r[i] < r[i + 1]]


def dip_caption(rows: list[dict], candidates: list[dict] | None) -> str:
    """What the data says about each candidate-recall dip: the two recalls at the dip and, from
    ``scaling_candidates.py``'s exact lists of the same corpora, what the lists are made of."""
    lines = []
    for i in recall_dips(rows):
        r = rows[i]
        line = (
            f"Dip at {_millions(r['num_tokens'])}: ScaNN misses "
            f"{100 * (1 - r['candidate_recall']):.0f}% of exact search's candidate documents"
        )
        if "token_recall_10" in r:
            line += (
                f", yet finds {100 * r['token_recall_10']:.1f}% of each query token's 10 nearest"
            )
        lines.append(line + ".")
    if lines and candidates:
        lines.append(
            f"Exact k′={candidates[0]['k_prime']} lists of the same corpora "
            "(scaling_candidates.json), per query token and per query:"
        )
        for c in candidates:
            lines.append(
                f"  {_millions(c['num_tokens'])}: its centre has {c['own_centre_tokens']:,.0f} "
                f"tokens, {100 * (1 - c['own_share_of_list']):.0f}% of its list are other centres' "
                f"tokens; {c['candidate_docs']:,.0f} candidate documents "
                f"({100 * c['candidate_share_of_corpus']:.0f}% of the corpus), "
                f"{100 * c['other_only_share']:.0f}% of them reached only through other centres."
            )
        by_size = {c["num_tokens"]: c for c in candidates}
        for i in recall_dips(rows):
            c = by_size.get(rows[i]["num_tokens"])
            if c and 0 < c["own_share_of_list"] < 1:
                lines.append(
                    f"At {_millions(c['num_tokens'])} a list ends just past its centre's "
                    f"{c['own_centre_tokens']:,.0f} tokens, and {100 * c['other_only_share']:.0f}%"
                    " of the candidate documents come only from the other centres' tokens at "
                    "its far end."
                )
    return "\n".join(lines)


NEAR_ISOTROPIC_COS = 0.5  # tokens farther than this from their centre have no cluster structure


def _knobs(scann: dict) -> str:
    """A ScannConfig change in words, e.g. "searching 30% of the leaves"."""
    words = []
    if "leaves_to_search_fraction" in scann:
        words.append(f"searching {100 * scann['leaves_to_search_fraction']:g}% of the leaves")
    if "reorder_factor" in scann:
        words.append(f"reordering {scann['reorder_factor']:g}·k′")
    if "num_leaves_to_search" in scann:
        words.append(f"searching {scann['num_leaves_to_search']} leaves")
    return " and ".join(words)


def isotropic_caption(rows: list[dict], tradeoff: list[dict] | None = None) -> str:
    """Why candidate recall falls with size on near-isotropic tokens (``--noise=0.35``): no
    cluster structure for ScaNN's leaves to follow, a fixed share of them searched; with
    ``tradeoff`` (NAME_*_tradeoff.json: one size, other ScannConfigs), what more search buys."""
    from aligner_jax.indexing import ann as ti

    first, last = rows[0], rows[-1]
    if "noise" not in first or cos_to_centre(first["noise"]) >= NEAR_ISOTROPIC_COS:
        return ""
    if last["candidate_recall"] >= first["candidate_recall"]:
        return ""
    config = ti.ScannConfig(**first.get("scann_config", {}))
    searched = (
        f"a fixed {config.num_leaves_to_search} of its leaves"
        if config.num_leaves_to_search is not None
        else f"a fixed {100 * config.leaves_to_search_fraction:g}% of its leaves"
    )
    recalls = " → ".join(
        f"{_millions(r['num_tokens'])} {100 * r['candidate_recall']:.1f}%" for r in rows
    )
    lines = [
        f"Candidate recall falls with corpus size ({recalls}): these tokens are nearly isotropic "
        f"(σ = {first['noise']:g}, cosine {cos_to_centre(first['noise']):.2f} to their centre), "
        "with no",
        "cluster structure for ScaNN's k-means leaves to follow: the hardest case for partitioned "
        f"search. Every part searches {searched}, and a query token's",
        "nearest tokens are spread over many leaves: those in leaves not searched are missed.",
    ]
    base = next((t for t in tradeoff or () if not t.get("scann_config")), None)
    others = [t for t in tradeoff or () if t.get("scann_config")]
    if base and others:
        lines[-1] += (
            f" At {_millions(base['num_tokens'])} ({100 * base['candidate_recall']:.1f}% with "
            "these defaults), other ScannConfigs give:"
        )
        gains = "; ".join(
            f"{_knobs(t['scann_config'])}: {100 * t['candidate_recall']:.1f}%" for t in others
        )
        lines.append(f"{gains}. More leaves help, more reordering barely.")
    lines.append(
        "Tokens clustered like real ones (σ = 0.074, calibrated on SciFact's; scaling.png) do "
        "not lose recall this way."
    )
    return "\n".join(lines)


def plot(
    rows: list[dict],
    path: Path,
    candidates: list[dict] | None = None,
    tradeoff: list[dict] | None = None,
) -> None:
    """Writes :func:`figure` as NAME.png."""
    from aligner_jax.evaluation import plotting

    plotting.save(figure(rows, candidates, tradeoff), path)


def figure(
    rows: list[dict], candidates: list[dict] | None = None, tradeoff: list[dict] | None = None
):
    """Build time (s), search time (ms), memory (GiB) and recall (%) against the corpus size,
    each on its own axes, every point labelled with its value; candidate-recall dips are marked
    and explained in the caption (:func:`dip_caption`), as is the fall of recall with size on
    near-isotropic tokens (:func:`isotropic_caption`)."""
    from aligner_jax.evaluation import plotting

    plt = plotting.pyplot()
    n = [r["num_tokens"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.6), sharex=True)
    (build_ax, search_ax), (memory_ax, recall_ax) = axes
    panels = [
        (build_ax, "index build time (s)", True, [("build", [r["build_s"] for r in rows], "{:.0f} s")]),
        (search_ax, "search time per query (ms)", True, [
            ("p50", [r["search_ms_per_query_p50"] for r in rows], "{:.0f} ms"),
            ("p90", [r["search_ms_per_query_p90"] for r in rows], "{:.0f} ms"),
        ]),
        (memory_ax, "memory (GiB)", True, [
            ("peak RSS (build + search)", [r["peak_rss_gib"] for r in rows], "{:.1f}"),
            ("token index", [r["index_bytes"] / 2**30 for r in rows], "{:.2f}"),
        ]),
        (recall_ax, "recall (%)", False, [
            ("candidate recall (documents)", [100 * r["candidate_recall"] for r in rows], "{:.1f}%"),
        ] + ([("token recall 10@k′", [100 * r["token_recall_10"] for r in rows], "{:.1f}%")]
             if all("token_recall_10" in r for r in rows) else [])),
    ]  # fmt: skip
    for ax, ylabel, log, series in panels:
        for i, (label, values, _) in enumerate(series):
            style = dict(plotting.series_style(i), markersize=6, linewidth=1.8)
            ax.plot(n, values, label=label, **style)
        ax.set_xscale("log")
        if log:
            ax.set_yscale("log")
            plotting.plain_log_axis(ax.yaxis)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left" if log else "lower left")
    ticks = [
        _millions(r["num_tokens"]) + (f"\n{r['num_parts']} parts" if r["num_parts"] > 1 else "")
        for r in rows
    ]
    for ax in axes[1]:
        plotting.log_ticks(ax.xaxis, n, ticks)
        ax.set_xlabel("corpus size (tokens of 128 dimensions, log scale)")
    for ax in (build_ax, search_ax, memory_ax):
        ax.margins(y=0.25)
    lo = min(min(v) for _, v, _ in panels[3][3])
    recall_ax.set_ylim(lo - 0.4 * (100 - lo), 100 + 0.1 * (100 - lo))
    r0 = rows[0]
    sigma = f"σ = {r0['noise']:g}, " if "noise" in r0 else ""
    fig.suptitle(
        f"ScaNN token index against corpus size (synthetic token vectors, {sigma}"
        f"k′={r0['k_prime']}, {r0['query_tokens']} query tokens)",
        fontsize=11,
    )
    caption = "\n".join(
        c for c in (dip_caption(rows, candidates), isotropic_caption(rows, tradeoff)) if c
    )
    bottom = (0.024 * (caption.count("\n") + 1) + 0.01) if caption else 0.0
    if caption:
        fig.text(0.01, 0.01, caption, fontsize=8, va="bottom", ha="left")
    fig.tight_layout(rect=(0, bottom, 1, 1))
    for i in recall_dips(rows):
        recall_ax.annotate(
            "dip: explained below",
            (n[i], 100 * rows[i]["candidate_recall"]),
            xytext=(30, -22),
            textcoords="offset points",
            ha="left",
            fontsize=8,
            arrowprops={"arrowstyle": "->", "lw": 0.8},
        )
    if isotropic_caption(rows, tradeoff):
        recall_ax.annotate(
            "falls with size: explained below",
            (n[-1], 100 * rows[-1]["candidate_recall"]),
            xytext=(-200, -30),
            textcoords="offset points",
            ha="left",
            fontsize=8,
            arrowprops={"arrowstyle": "->", "lw": 0.8},
        )
    for ax, _, _, series in panels:
        for i, (_, values, fmt) in enumerate(series):
            plotting.annotate_points(ax, n, values, [fmt.format(v) for v in values], color=f"C{i}")
    return fig


def write_results(out: Path, name: str) -> None:
    """NAME.md and, for several sizes, NAME.png from NAME.json in ``out`` (``--replot`` alone
    redraws them from a saved NAME.json); the PNG's caption uses scaling_candidates.json there
    when it describes the same corpora (same σ and k′)."""
    from aligner_jax.common import fileio

    rows = json.loads((out / f"{name}.json").read_text())
    text = markdown(rows)
    fileio.atomic_write_text(out / f"{name}.md", text)
    if len(rows) > 1:
        path = out / "scaling_candidates.json"
        candidates = json.loads(path.read_text()) if path.exists() else None
        if candidates and not all(
            c["noise"] == rows[0].get("noise") and c["k_prime"] == rows[0]["k_prime"]
            for c in candidates
        ):
            candidates = None
        tradeoff = None  # one size measured with other ScannConfigs (NAME_*_tradeoff.json)
        for path in sorted(out.glob(f"{name}_*_tradeoff.json")):
            tradeoff = json.loads(path.read_text())
        plot(rows, out / f"{name}.png", candidates, tradeoff)
    print(text)


def define_flags() -> None:
    """The command line (absl flags), defined only when this file runs as a script:
    scaling_candidates.py and the tests import it and define flags of the same names."""
    flags.DEFINE_string(
        "sizes", "1000000,4000000,16000000", "Corpus sizes (tokens), comma-separated."
    )
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
    flags.DEFINE_bool("replot", False, "Redraw NAME.md/png from NAME.json.")


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    args = flags.FLAGS
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
    if args.replot:
        write_results(Path(args.output), args.name)
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
    write_results(out, args.name)


if __name__ == "__main__":
    define_flags()
    app.run(main)
