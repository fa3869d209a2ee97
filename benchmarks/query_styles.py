r"""Do the search rules hold for queries unlike the ones they were chosen on? A label-free check.

The default search's rules were chosen on SciFact's train queries (``tune_search.py``): short
scientific claims, in the corpus's own domain. Users send other queries (keywords, titles,
sentences, another field's questions), and no judgements exist for them; agreement with
exhaustive search over the same vectors needs none. For each index and each query set this
measures, for each ``--settings`` of ``CentroidSearchConfig``:

  * top-10 overlap at k = 10 and top-100 overlap at k = 100 with exhaustive search (Eq. 1–2, the
    index's own scoring: ``Searcher.load(..., mode="exhaustive")``), the mean and the worst query;
  * search p50 (ms, query encoding excluded, ``--threads`` BLAS threads, batch 1);
  * with ``--attribute`` (default), where the search lost each exhaustive top-10 document it
    did not return: never reached by stage 2, reached but not refined, or refined and ranked
    out (``misses``).

Query sets (fixed seeds; from the BEIR folders under ``--data_root``): ``NAME-queries`` (up to
``--num_queries`` of the collection's queries), ``NAME-titles`` (document titles of ≥ 3 words) and
``NAME-sentences`` (one sentence of ≥ 8 words from each of random documents), for each NAME in
``--collections``: each index meets its own collection's sets and the other collections' ones.

  .venv/bin/python benchmarks/query_styles.py \
      --indexes=scifact:outputs/zero_shot_scifact/index,cisi:outputs/zero_shot_cisi/index \
      --settings='{}' --settings='{"probe_docs": 2560}'

Writes ``--out``.json / .md / .png (default ``benchmarks/results/query_styles``). Exhaustive
rankings are cached under ``--work_dir`` (they do not depend on the settings).
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import re
import sys
import time
from pathlib import Path

# first: the package sets OpenBLAS's environment, which counts only before NumPy loads
importlib.import_module("aligner_jax")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def define_flags() -> None:
    """The flags (defined when run as a script: tests import this module beside others)."""
    flags.DEFINE_list(
        "indexes",
        ["scifact:outputs/zero_shot_scifact/index", "cisi:outputs/zero_shot_cisi/index"],
        "COLLECTION:INDEX_DIR of each index measured.",
    )
    flags.DEFINE_list("collections", ["scifact", "cisi"], "Where query sets come from.")
    flags.DEFINE_string("data_root", "../shared/data/beir", "BEIR folders by name.")
    flags.DEFINE_multi_string(
        "settings", ["{}"], "CentroidSearchConfig fields as JSON ({}: the defaults); repeatable."
    )
    flags.DEFINE_integer("num_queries", 150, "Queries per set (at most).")
    flags.DEFINE_integer("threads", 2, "BLAS threads.")
    flags.DEFINE_bool("attribute", True, "Say where the missed top-10 documents were lost.")
    flags.DEFINE_string("work_dir", "/tmp/aligner_query_styles", "Exhaustive rankings.")
    flags.DEFINE_string("out", str(REPO / "benchmarks/results/query_styles"), "Output prefix.")


MIN_TITLE_WORDS, MIN_SENTENCE_WORDS = 3, 8


def query_sets(data_root: Path, name: str, n: int) -> dict[str, list[str]]:
    """The three query sets of one collection (fixed seeds)."""
    from aligner_jax.data import beir

    queries = [text for _, text in beir.iter_queries(data_root / name / "queries.jsonl")]
    rng = np.random.default_rng(1)
    own = [queries[i] for i in rng.choice(len(queries), min(n, len(queries)), replace=False)]
    corpus = list(beir.iter_corpus(data_root / name / "corpus.jsonl", check_duplicates=False))
    rng = np.random.default_rng(0)
    titles = [d.title for d in corpus if d.title and len(d.title.split()) >= MIN_TITLE_WORDS]
    titles = [titles[i] for i in rng.choice(len(titles), min(n, len(titles)), replace=False)]
    sentences = []
    for i in rng.permutation(len(corpus)):
        found = [
            s.strip()
            for s in re.split(r"(?<=[.!?])\s+", corpus[i].text)
            if len(s.split()) >= MIN_SENTENCE_WORDS
        ]
        if found:
            sentences.append(found[rng.integers(len(found))])
        if len(sentences) >= n:
            break
    return {f"{name}-queries": own, f"{name}-titles": titles, f"{name}-sentences": sentences}


def exhaustive_rankings(open_exhaustive, name: str, encoded, cache: Path, threads: int):
    """The exhaustive top 100 of each encoded query (cached: they depend on nothing else);
    ``open_exhaustive()`` gives the exhaustive searcher, opened only when the cache misses."""
    import threadpoolctl

    if cache.exists():
        return json.loads(cache.read_text())["rankings"]
    exhaustive = open_exhaustive()
    with threadpoolctl.threadpool_limits(threads):
        ranked = [
            [h.doc_id for h in exhaustive.search_vectors(e.vectors, 100, salience=e.salience)]
            for e in encoded
        ]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"queries": name, "rankings": ranked}))
    return ranked


def measure(searcher, encoded, exhaustive: list[list[str]], threads: int = 2) -> dict:
    """Overlaps at k = 10 and 100 (mean, worst query) and p50 ms, one query at a time."""
    import threadpoolctl

    row = {}
    with threadpoolctl.threadpool_limits(threads):
        for k in (10, 100):
            times, overlap = [], []
            for e, exact in zip(encoded, exhaustive, strict=True):
                t0 = time.perf_counter()
                hits = searcher.search_vectors(e.vectors, k, salience=e.salience)
                times.append(1000 * (time.perf_counter() - t0))
                overlap.append(len({h.doc_id for h in hits[:k]} & set(exact[:k])) / k)
            row[f"top{k}_overlap"] = float(np.mean(overlap))
            row[f"worst_top{k}_overlap"] = float(np.min(overlap))
            row[f"p50_ms_k{k}"] = float(np.percentile(times, 50))
    return row


STAGES = ("unreached", "unrefined", "outranked")


def misses(searcher, encoded, exhaustive: list[list[str]], k: int = 10, threads: int = 2) -> dict:
    """Where the search lost the documents of the exhaustive top k it did not return, each a
    share of all k·queries of them: never reached by stage 2 (``unreached``: candidate
    generation), reached but not among the refined documents (``unrefined``: stage 2's order),
    or refined and ranked out (``outranked``: stage 4's compressed scores). Stage 2's
    candidates and stage 4's documents are recorded by wrapping the centroid searcher's
    methods for the duration (the last ``refine`` of a search is stage 4's)."""
    import threadpoolctl

    centroid, ids, seen = searcher.centroid, searcher.store.doc_ids, {}
    wrapped = ("candidates", "residual_candidates", "refine")

    def recorded(name: str):
        method = getattr(centroid, name)

        def call(*args, **kwargs):
            seen[name] = args, method(*args, **kwargs)  # the last call of each name wins
            return seen[name][1]

        return call

    for name in wrapped:
        setattr(centroid, name, recorded(name))
    counts = dict.fromkeys(STAGES, 0)
    try:
        with threadpoolctl.threadpool_limits(threads):
            for e, exact in zip(encoded, exhaustive, strict=True):
                seen.clear()
                got = {h.doc_id for h in searcher.search_vectors(e.vectors, k, salience=e.salience)}
                stage2 = seen.get("residual_candidates", seen.get("candidates"))[1][0]
                reached = {ids[int(d)] for d in stage2}
                refined = {ids[int(d)] for d in seen["refine"][0][2]}  # stage 4's documents
                for d in exact[:k]:
                    if d not in got:
                        stage = "unreached" if d not in reached else "unrefined"
                        counts["outranked" if d in refined else stage] += 1
    finally:
        for name in wrapped:
            delattr(centroid, name)  # the class's methods again
    total = k * max(len(exhaustive), 1)
    return {f"missed_{stage}": counts[stage] / total for stage in STAGES}


def markdown(result: dict) -> str:
    lines = [
        "# The search rules on queries of other styles (label-free: agreement with exhaustive "
        "search)\n",
        f"`{result['command']}`; {result['threads']} threads, load {result['load_start']:.1f} → "
        f"{result['load_end']:.1f}.\n",
        "| index | query set | queries | query tokens | settings | top-10 overlap (worst) | "
        "top-100 overlap (worst) | missed at k=10: unreached / unrefined / outranked | "
        "p50 ms k=10 | p50 ms k=100 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        missed = (
            " / ".join(f"{r[f'missed_{s}']:.3f}" for s in STAGES)
            if "missed_unreached" in r
            else "—"
        )
        lines.append(
            f"| {r['index']} | {r['queries']} | {r['num_queries']} | {r['query_tokens']:.1f} | "
            f"{json.dumps(r['settings'])} | {r['top10_overlap']:.3f} ({r['worst_top10_overlap']:.1f})"
            f" | {r['top100_overlap']:.3f} ({r['worst_top100_overlap']:.2f}) | {missed} | "
            f"{r['p50_ms_k10']:.1f} | {r['p50_ms_k100']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    from aligner_jax.evaluation import plotting

    plt = plotting.pyplot()
    settings = sorted({json.dumps(r["settings"]) for r in result["rows"]})
    cells = sorted({(r["index"], r["queries"]) for r in result["rows"]})
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cells)), 5.5))
    fig.subplots_adjust(bottom=0.32)
    width = 0.8 / len(settings)
    for i, s in enumerate(settings):
        ys = [
            next(
                r["top10_overlap"]
                for r in result["rows"]
                if (r["index"], r["queries"]) == c and json.dumps(r["settings"]) == s
            )
            for c in cells
        ]
        ax.bar(np.arange(len(cells)) + i * width, ys, width, label=s, color=f"C{i}")
    ax.axhline(0.95, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(np.arange(len(cells)) + 0.4 - width / 2)
    ax.set_xticklabels([f"{a} index\n{b}" for a, b in cells], rotation=60, ha="right", fontsize=7)
    low = min(r["top10_overlap"] for r in result["rows"])
    ax.set_ylim(min(0.8, math.floor(10 * low) / 10), 1.0)  # every bar shows
    ax.set_ylabel("top-10 overlap with exhaustive (k = 10)")
    ax.legend(fontsize=7, loc="lower left")
    plotting.save(fig, path)


def main(argv) -> None:
    del argv
    from aligner_jax.common import fileio
    from aligner_jax.retrieval import centroid_search as cs
    from aligner_jax.retrieval.searcher import Searcher

    data_root = (REPO / flags.FLAGS.data_root).resolve()
    sets = {}
    for name in flags.FLAGS.collections:
        sets.update(query_sets(data_root, name, flags.FLAGS.num_queries))
    settings = [json.loads(s) for s in flags.FLAGS.settings]
    load_start, rows = os.getloadavg()[0], []
    for spec in flags.FLAGS.indexes:
        collection, index_dir = spec.split(":", 1)
        default = Searcher.load(index_dir)
        exhaustive = functools.cache(
            lambda d=index_dir, e=default.encoder: Searcher.load(d, mode="exhaustive", encoder=e)
        )
        searchers = [
            Searcher.load(
                index_dir, encoder=default.encoder, centroid_config=cs.CentroidSearchConfig(**s)
            )
            for s in settings
        ]
        for qname, texts in sets.items():
            encoded = default.encoder.encode(texts, "query")
            cache = (
                Path(flags.FLAGS.work_dir) / f"{Path(index_dir).resolve().parent.name}_{qname}.json"
            )
            exact = exhaustive_rankings(exhaustive, qname, encoded, cache, flags.FLAGS.threads)
            for setting, searcher in zip(settings, searchers, strict=True):
                row = {"index": collection, "index_dir": index_dir, "queries": qname,
                       "num_queries": len(texts), "settings": setting,
                       "query_tokens": float(np.mean([len(e.vectors) for e in encoded])),
                       **measure(searcher, encoded, exact, flags.FLAGS.threads)}  # fmt: skip
                if flags.FLAGS.attribute:
                    row |= misses(searcher, encoded, exact, 10, flags.FLAGS.threads)
                print(json.dumps(row), flush=True)
                rows.append(row)
    result = {
        "command": "benchmarks/query_styles.py " + " ".join(sys.argv[1:]),
        "threads": flags.FLAGS.threads,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "rows": rows,
    }
    out = Path(flags.FLAGS.out)
    fileio.atomic_write_json(out.with_suffix(".json"), result, sort_keys=False)
    fileio.atomic_write_text(out.with_suffix(".md"), markdown(result))
    plot(result, out.with_suffix(".png"))
    print(markdown(result))
    print(f"wrote {out}.json / .md / .png")


if __name__ == "__main__":
    define_flags()
    app.run(main)
