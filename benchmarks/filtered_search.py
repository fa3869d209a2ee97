r"""Filtered search: latency cost and exactness of restricting a search to a subset (issue 25
item 2).

On a real index (SciFact zero-shot by default), for each test query (encoded once, untimed):

  * unfiltered search (the fast centroid path), the baseline;
  * the same search restricted to a random subset of the corpus holding 1 %, 10 % and 50 % of
    its documents (seeded), given as ``subset=`` ids; subsets of at most
    ``SearchConfig.filter_exact_docs`` documents are refined exhaustively (exact), larger ones
    restrict candidate generation;
  * the cost of compiling a metadata filter to its mask (``Searcher.allowed``: SQL over
    ``documents.sqlite``, ``{"doc_id": {"in": [...]}}`` of the 1 % subset), when the index has
    ``documents.sqlite``.

Exactness: each filtered top-10 is compared with the reference, the exhaustive ranking of the
whole corpus (every document refined with all its stored vectors, ``mode="exhaustive"``) cut to
the subset: ids in the same order, and overlap@10.

  .venv/bin/python benchmarks/filtered_search.py --index_dir=outputs/zero_shot_scifact/index \
    --dataset_dir=../shared/data/beir/scifact --num_queries=100

Prints a table and writes benchmarks/results/filtered_search.{json,md,png}.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
from absl import app, flags

from aligner_jax.data import beir
from aligner_jax.retrieval import searcher as search_lib

REPO = Path(__file__).resolve().parent.parent
_INDEX_DIR = flags.DEFINE_string(
    "index_dir", str(REPO / "outputs" / "zero_shot_scifact" / "index"), "A built index."
)
_DATASET_DIR = flags.DEFINE_string(
    "dataset_dir", str(REPO.parent / "shared" / "data" / "beir" / "scifact"), "Its BEIR folder."
)
_NUM_QUERIES = flags.DEFINE_integer("num_queries", 100, "Test queries searched (file order).")
_FRACTIONS = flags.DEFINE_list(
    "fractions", ["0.01", "0.05", "0.1", "0.5"], "Subset sizes (fractions of the corpus)."
)
_K = flags.DEFINE_integer("k", 10, "Hits per query.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the random subsets.")
_OUTPUT = flags.DEFINE_string(
    "output", str(REPO / "benchmarks" / "results" / "filtered_search"), "Output path stem."
)


def _ms(values: list[float]) -> dict:
    return {
        "p50": float(np.percentile(values, 50)),
        "p95": float(np.percentile(values, 95)),
        "mean": float(statistics.fmean(values)),
    }


def measure(index_dir: str, dataset_dir: str, num_queries: int, fractions, k: int, seed: int):
    load_before = os.getloadavg()
    fast = search_lib.Searcher.load(index_dir)
    exhaustive = search_lib.Searcher.load(index_dir, mode="exhaustive")
    dataset = beir.load_beir(dataset_dir, "test")
    texts = list(dataset.queries.values())[:num_queries]
    encoded = fast.encoder.encode(texts, "query")
    ids = fast.store.doc_ids
    n = fast.store.num_docs
    rng = np.random.default_rng(seed)
    subsets = {
        f: sorted(rng.choice(ids, size=max(1, round(f * n)), replace=False)) for f in fractions
    }

    def run(q, **kw):
        t0 = time.perf_counter()
        hits = fast.search_vectors(q.vectors, k=k, salience=q.salience, **kw)
        return hits, 1000.0 * (time.perf_counter() - t0)

    for q in encoded[:3]:  # warm-up (first-use allocations), untimed
        run(q)
        run(q, subset=subsets[fractions[0]])
    rows = {"none": {"latency": [], "same_ids": [], "overlap": [], "exact_path": []}}
    rows.update(
        {f: {"latency": [], "same_ids": [], "overlap": [], "exact_path": []} for f in fractions}
    )
    for i, q in enumerate(encoded):
        if i % 10 == 0:
            print(f"query {i}/{len(encoded)}", flush=True)
        hits, ms = run(q)
        rows["none"]["latency"].append(ms)
        full = exhaustive.search_vectors(q.vectors, k=n, salience=q.salience)
        want = [h.doc_id for h in full][:k]
        rows["none"]["same_ids"].append([h.doc_id for h in hits] == want)
        rows["none"]["overlap"].append(len({h.doc_id for h in hits} & set(want)) / k)
        for f in fractions:
            keep = set(subsets[f])
            want = [h.doc_id for h in full if h.doc_id in keep][:k]
            hits, ms = run(q, subset=subsets[f])
            got = [h.doc_id for h in hits]
            r = rows[f]
            r["latency"].append(ms)
            r["same_ids"].append(got == want)
            r["overlap"].append(len(set(got) & set(want)) / max(1, len(want)))
            r["exact_path"].append(bool(hits.exact))
    mask_ms = None
    if fast.documents is not None:
        flt = {"doc_id": {"in": list(subsets[fractions[0]])}}
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            fast.allowed(filter=flt)
            times.append(1000.0 * (time.perf_counter() - t0))
        mask_ms = _ms(times)
    summary = {
        str(f): {
            "docs": n if f == "none" else len(subsets[f]),
            "latency_ms": _ms(rows[f]["latency"]),
            "top_k_equal_exhaustive_restricted": float(np.mean(rows[f]["same_ids"])),
            "overlap_at_k": float(np.mean(rows[f]["overlap"])),
            "exact_path": float(np.mean(rows[f]["exact_path"])) if f != "none" else 0.0,
        }
        for f in ["none", *fractions]
    }
    return {
        "index_dir": str(index_dir),
        "dataset_dir": str(dataset_dir),
        "num_queries": len(encoded),
        "k": k,
        "filter_exact_docs": fast.config.filter_exact_docs,
        "query_encoding": "excluded (queries encoded once before timing)",
        "results": summary,
        "filter_mask_ms_smallest_subset_sql": mask_ms,
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
    }


def markdown(r: dict) -> str:
    lines = [
        "# Filtered search (issue 25 item 2)",
        "",
        f"`{r['index_dir']}`, {r['num_queries']} test queries of `{r['dataset_dir']}`, k={r['k']}; "
        f"query encoding excluded; subsets of at most {r['filter_exact_docs']} documents are "
        "refined exhaustively, larger ones restrict candidate generation. Reference: the "
        "exhaustive ranking of the whole corpus cut to the subset.",
        "",
        "| filter | documents | p50 ms | p95 ms | top-10 = reference | overlap@10 | exact path |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in r["results"].items():
        lat = row["latency_ms"]
        label = "none" if name == "none" else f"{float(name):.0%} random subset"
        lines.append(
            f"| {label} | {row['docs']} | {lat['p50']:.1f} | "
            f"{lat['p95']:.1f} | {row['top_k_equal_exhaustive_restricted']:.0%} | "
            f"{row['overlap_at_k']:.3f} | {row['exact_path']:.0%} |"
        )
    if r["filter_mask_ms_smallest_subset_sql"]:
        m = r["filter_mask_ms_smallest_subset_sql"]
        smallest = next(n for n in r["results"] if n != "none")
        lines += [
            "",
            f"Compiling a metadata filter to its mask (SQL over documents.sqlite, "
            f"`doc_id in` the {float(smallest):.0%} subset): p50 {m['p50']:.2f} ms, "
            f"p95 {m['p95']:.2f} ms.",
        ]
    lines += [
        "",
        f"Load average before / after: {r['machine']['loadavg_before']} / {r['machine']['loadavg_after']}.",
    ]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib  # heavy: only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(r["results"])
    labels = ["none" if n == "none" else f"{float(n):.0%}" for n in names]
    p50 = [r["results"][n]["latency_ms"]["p50"] for n in names]
    p95 = [r["results"][n]["latency_ms"]["p95"] for n in names]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(x - 0.2, p50, 0.4, label="p50")
    ax.bar(x + 0.2, p95, 0.4, label="p95")
    ax.set_xticks(x, labels)
    ax.set_xlabel("documents kept by the filter (random subset)")
    ax.set_ylabel("ms per query (encoding excluded)")
    load = r["machine"]["loadavg_before"][0]
    ax.set_title(f"Filtered search, {r['num_queries']} queries (load average {load:.0f})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv):
    del argv
    fractions = [float(f) for f in _FRACTIONS.value]
    r = measure(
        _INDEX_DIR.value, _DATASET_DIR.value, _NUM_QUERIES.value, fractions, _K.value, _SEED.value
    )
    out = Path(_OUTPUT.value)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(r, indent=2) + "\n")
    text = markdown(r)
    out.with_suffix(".md").write_text(text)
    plot(r, out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    app.run(main)
