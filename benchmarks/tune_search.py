r"""Chooses the centroid search's scale-free rules on tuning queries, never on test queries.

The candidate and refinement rules of ``retrieval/centroid_search.py`` (documents a query token
reaches through its probes, refined documents per requested document, interaction documents per
refined document) are swept on a token store with queries of a split that is *not* the test
split (SciFact's train queries; a fixed half of a collection's queries otherwise), and compared
with exhaustive MaxSim over the same vectors (``benchmarks/scale.py``'s children: the same
scoring, Eq. 1–2). The written rule picks the default:

  the cheapest setting (p50 at k = 100) whose mean top-10 overlap with exhaustive search at
  k = 10 is ≥ 0.95 and whose mean top-100 overlap at k = 100 is ≥ 0.95 (the share of the
  exhaustive top 100 it returns), and whose nDCG@10 and Recall@100 on the tuning queries' qrels
  are within 0.5 and 1 point of exhaustive search's.

A second rule picks the setting for k = 10 (``residual_probe_docs``: fewer documents reached
when fewer are requested): the cheapest setting (p50 at k = 10) whose top-10 overlap at k = 10
is ≥ 0.95 and whose nDCG@10 is within 0.5 point of exhaustive search's.

Overlap with exhaustive search needs no judgements, so the same rule applies to a store grown
with distractors (``--store`` = a store kept by ``scale.py --keep_stores``).

  .venv/bin/python benchmarks/tune_search.py --model=zero_shot --split=train
  .venv/bin/python benchmarks/tune_search.py --model=zero_shot --split=train \
      --store=/work/scale_work/zero_shot/x10 --tag=x10

Writes ``OUTPUT_DIR/tune_search_<model>_<tag>.json`` (every setting, the rule, the split and the
chosen point) and a Markdown table beside it.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import sys
import time
from pathlib import Path

# first: the package sets OpenBLAS's environment, which counts only before NumPy loads
importlib.import_module("aligner_jax")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import scale  # noqa: E402  (the children: encode, exhaustive)

RULE = (
    "cheapest p50 at k=100 with top-10 overlap >= 0.95 (k=10), top-100 overlap >= 0.95 "
    "(k=100), nDCG@10 within 0.5 and Recall@100 within 1 point of exhaustive"
)

RULE_K10 = (
    "cheapest p50 at k=10 with top-10 overlap >= 0.95 (k=10) and nDCG@10 within 0.5 of exhaustive"
)


DEFAULTED = ("refine_float_max",)  # "auto" = the config's default (None is not a value of these)


def sweep_child(store_dir: Path, queries_npz: Path, exact_path: Path, grid: dict, out: Path):
    """(child) Every setting of ``grid``: rankings at k = 10 and k = 100, p50 / p99 ms."""
    from aligner_jax.indexing import centroid_index as ci
    from aligner_jax.indexing import token_store as ts
    from aligner_jax.retrieval import centroid_search as cs

    queries = scale._queries(queries_npz)
    store = ts.TokenStore(store_dir)
    index = ci.CentroidIndex.load(store)
    rows = []
    names = list(grid)
    for values in itertools.product(*(grid[n] for n in names)):
        setting = dict(zip(names, values, strict=True))
        given = {n: v for n, v in setting.items() if v is not None or n not in DEFAULTED}
        searcher = cs.CentroidSearcher(store, index, cs.CentroidSearchConfig(**given))
        row = {"setting": setting, "load": os.getloadavg()[0]}
        for k in (10, 100):
            rankings, times, counts = {}, [], []
            for rnd in range(2):  # the first round warms caches and scratch buffers
                for qid, q, u in queries:
                    t0 = time.perf_counter()
                    (ranking,), stage = searcher.search(q, u, np.arange(len(q)), k)
                    if rnd:
                        times.append(1000 * (time.perf_counter() - t0))
                        counts.append((stage.candidates, stage.interaction, stage.refined))
                    rankings[qid] = [store.doc_ids[int(d)] for d in ranking[0]]
            row[f"k{k}"] = {
                "rankings": rankings,
                "p50_ms": float(np.percentile(times, 50)),
                "p99_ms": float(np.percentile(times, 99)),
                "stages": np.mean(counts, axis=0).tolist(),
            }
        row["probes"] = searcher.probes
        rows.append(row)
        print(f"setting {setting}: p50 {row['k10']['p50_ms']:.1f} / {row['k100']['p50_ms']:.1f} ms")
    out.write_text(json.dumps({"grid": grid, "rows": rows}))


def score(rows: list[dict], exact: dict, qrels: dict) -> list[dict]:
    """Quality of every setting against exhaustive search and the qrels (metrics in [0, 1])."""
    results = []
    for row in rows:
        ten, hundred = row["k10"]["rankings"], row["k100"]["rankings"]
        q10 = scale.quality(ten, exact, qrels)
        q100 = scale.quality(hundred, exact, qrels)
        overlap100 = [len(set(hundred[q][:100]) & set(exact[q][:100])) / 100 for q in hundred]
        results.append(
            {
                **row["setting"],
                "probes": row["probes"],
                "top10_overlap": q10["top10_overlap"],
                "top100_overlap": float(np.mean(overlap100)),
                "ndcg@10": q10["ndcg@10"],
                "ndcg@10_exhaustive": q10["ndcg@10_exhaustive"],
                "recall@100": q100["recall@100"],
                "recall@100_exhaustive": q100["recall@100_exhaustive"],
                "p50_ms_k10": row["k10"]["p50_ms"],
                "p99_ms_k10": row["k10"]["p99_ms"],
                "p50_ms_k100": row["k100"]["p50_ms"],
                "p99_ms_k100": row["k100"]["p99_ms"],
                "stages_k100": row["k100"]["stages"],
                "machine_load": row["load"],
            }
        )
    return results


def admissible_k10(r: dict) -> bool:
    return r["top10_overlap"] >= 0.95 and r["ndcg@10"] >= r["ndcg@10_exhaustive"] - 0.005


def admissible(r: dict) -> bool:
    return (
        admissible_k10(r)
        and r["top100_overlap"] >= 0.95
        and r["recall@100"] >= r["recall@100_exhaustive"] - 0.01
    )


def choose(rows: list[dict]) -> tuple[dict | None, dict | None]:
    """The rows the two rules pick: (at k = 100, at k = 10); None where no row qualifies."""
    ok = [r for r in rows if admissible(r)]
    ok10 = [r for r in rows if admissible_k10(r)]
    return (
        min(ok, key=lambda r: r["p50_ms_k100"]) if ok else None,
        min(ok10, key=lambda r: r["p50_ms_k10"]) if ok10 else None,
    )


def markdown(result: dict) -> str:
    head = (
        f"# Search rules tuned on {result['store']} ({result['split']} queries, "
        f"{result['queries']})\n\nRule: {result['rule']}. At k = 10: {result.get('rule_k10', RULE_K10)}.\n\n"
        "| probe_docs | refine_per_k | refine_docs | refine_float | refine_float_max | impute_depth | interaction_per_refine | residual interaction (per refined) | "
        "residual candidates (re-scored per refined, when reached below) | mean weight | "
        "centroid terms (docs) | light share | probes | "
        "top-10 overlap | top-100 overlap | nDCG@10 (exh.) | R@100 (exh.) | p50 k=10 | "
        "p50 k=100 | load |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in result["rows"]:
        mark = " **chosen**" if r is result.get("chosen_row") else ""
        mark10 = " **chosen at k=10**" if r is result.get("chosen_row_k10") else ""
        lines.append(
            f"| {r['probe_docs'] or 'auto'} | {r['refine_per_k']} | {r.get('refine_docs') or 'auto'} | "
            f"{_auto(r.get('refine_float', 0.0))} | {_auto(r.get('refine_float_max'))} | "
            f"{r.get('impute_depth', 1.0)} | "
            f"{r['interaction_per_refine']} | "
            f"{'yes (' + str(r.get('residual_per_refine')) + ')' if r.get('residual_interaction') else 'no'} | {'yes (' + str(r.get('rescore_per_refine', 0.0)) + ', reach < ' + str(r.get('rescore_below_reach', 1.0)) + ')' if r.get('residual_candidates') else 'no'} | {r.get('mean_weight', 0.0)} | {r.get('fill_docs', 0)} | {r.get('light_share', 0.0)} | {r['probes']} | {r['top10_overlap']:.3f} | {r['top100_overlap']:.3f} | "
            f"{100 * r['ndcg@10']:.1f} ({100 * r['ndcg@10_exhaustive']:.1f}) | "
            f"{100 * r['recall@100']:.1f} ({100 * r['recall@100_exhaustive']:.1f}) | "
            f"{r['p50_ms_k10']:.1f}{mark10} | {r['p50_ms_k100']:.1f}{mark} | {r['machine_load']:.1f} |"
        )
    return head + "\n".join(lines) + "\n"


def _auto(value) -> str:
    return "auto" if value is None else str(value)


def define_flags() -> None:
    flags.DEFINE_enum("model", "zero_shot", list(scale.SOURCES), "Which SciFact token store.")
    flags.DEFINE_string("store", None, "Token store to tune on (default: the model's 1x store).")
    flags.DEFINE_string("tag", "x1", "Name of the store in the output files.")
    flags.DEFINE_string("dataset_dir", "../shared/data/beir/scifact", "BEIR folder.")
    flags.DEFINE_string("split", "train", "Qrels split of the tuning queries (never test).")
    flags.DEFINE_integer("num_queries", 200, "Tuning queries (a fixed sample of the split).")
    flags.DEFINE_list(
        "probe_docs", ["320", "640", "1280"], "Documents a query token reaches (auto: the rule)."
    )
    flags.DEFINE_list("refine_per_k", ["1", "1.5", "2"], "Refined documents per requested one.")
    flags.DEFINE_list(
        "refine_docs", ["auto"], "Refined documents, fixed at every k (auto: the k-dependent rule)."
    )
    flags.DEFINE_list(
        "refine_float",
        ["0"],
        "Refined documents per requested one scored again from the store (auto: the default).",
    )
    flags.DEFINE_list(
        "refine_float_max", ["auto"], "Float re-scored documents at most (auto: the default)."
    )
    flags.DEFINE_list("interaction_per_refine", ["4"], "Interaction documents per refined one.")
    flags.DEFINE_list(
        "impute_depth", ["2"], "An unreached query token's imputed centroid, in probes + 1."
    )
    flags.DEFINE_list(
        "residual_interaction", ["true"], "Stage 3 scores best-centroid tokens with residuals."
    )
    flags.DEFINE_list("residual_per_refine", ["2"], "Residual-interaction docs per refined one.")
    flags.DEFINE_list(
        "residual_candidates", ["false"], "Stage 2 scores the probed tokens with residuals."
    )
    flags.DEFINE_list(
        "rescore_per_refine", ["0"], "With residual candidates: stage-2 docs re-scored per refined."
    )
    flags.DEFINE_list(
        "rescore_below_reach",
        ["1"],
        "... only for queries whose refined candidates were reached less.",
    )
    flags.DEFINE_list(
        "mean_weight", ["0.2"], "Weight of the documents' mean vectors in stage 2's estimate."
    )
    flags.DEFINE_list(
        "fill_docs", ["0"], "Stage 2's best documents whose imputed terms get centroid scores."
    )
    flags.DEFINE_list(
        "light_share", ["0.0001"], "Share of a query's weight its unprobed light tokens may hold."
    )
    flags.DEFINE_integer("threads", 2, "BLAS threads.")
    flags.DEFINE_string("work_dir", "/work/scale_work", "Encoded queries, exhaustive rankings.")
    flags.DEFINE_string("output_dir", "benchmarks/results", "Where the JSON and Markdown go.")
    flags.DEFINE_enum("child", None, ["sweep"], "(internal)")
    flags.DEFINE_string("out", None, "(internal)")


def main(argv) -> None:
    del argv
    FLAGS = flags.FLAGS
    if FLAGS.split == "test":
        raise app.UsageError("--split=test: the rules are chosen off the test queries")
    store = Path(FLAGS.store or REPO / scale.SOURCES[FLAGS.model]).resolve()
    work = Path(FLAGS.work_dir) / FLAGS.model
    work.mkdir(parents=True, exist_ok=True)
    queries_npz = work / f"queries_{FLAGS.split}.npz"
    exact_path = work / f"exhaustive_{FLAGS.split}_{FLAGS.tag}.json"
    grid = {
        "probe_docs": [None if v == "auto" else int(v) for v in FLAGS.probe_docs],
        "refine_per_k": [float(v) for v in FLAGS.refine_per_k],
        "refine_docs": [None if v == "auto" else int(v) for v in FLAGS.refine_docs],
        "refine_float": [None if v == "auto" else float(v) for v in FLAGS.refine_float],
        "refine_float_max": [None if v == "auto" else int(v) for v in FLAGS.refine_float_max],
        "interaction_per_refine": [int(v) for v in FLAGS.interaction_per_refine],
        "impute_depth": [float(v) for v in FLAGS.impute_depth],
        "residual_interaction": [v.lower() in ("1", "true") for v in FLAGS.residual_interaction],
        "residual_per_refine": [float(v) for v in FLAGS.residual_per_refine],
        "residual_candidates": [v.lower() in ("1", "true") for v in FLAGS.residual_candidates],
        "rescore_per_refine": [float(v) for v in FLAGS.rescore_per_refine],
        "rescore_below_reach": [float(v) for v in FLAGS.rescore_below_reach],
        "mean_weight": [float(v) for v in FLAGS.mean_weight],
        "fill_docs": [int(v) for v in FLAGS.fill_docs],
        "light_share": [float(v) for v in FLAGS.light_share],
    }
    if FLAGS.child == "sweep":
        return sweep_child(store, queries_npz, exact_path, grid, Path(FLAGS.out))
    from aligner_jax.common import fileio
    from aligner_jax.data import beir

    dataset = (REPO / FLAGS.dataset_dir).resolve()
    log = work / "tune.log"
    sc = [sys.executable, str(REPO / "benchmarks" / "scale.py")]
    source = (REPO / scale.SOURCES[FLAGS.model]).resolve()
    if not queries_npz.exists():
        scale.run_child(sc + ["--child=encode", f"--index_dir={source}", f"--dataset_dir={dataset}",
                              f"--num_queries={FLAGS.num_queries}", f"--query_split={FLAGS.split}",
                              f"--out={queries_npz}"], FLAGS.threads, log)  # fmt: skip
    if not exact_path.exists():
        scale.run_child(sc + ["--child=exhaustive", f"--index_dir={store}",
                              f"--queries_npz={queries_npz}", f"--out={exact_path}"], FLAGS.threads, log)  # fmt: skip
    swept = work / f"sweep_{FLAGS.split}_{FLAGS.tag}.json"
    me = [sys.executable, str(Path(__file__).resolve())]
    passed = [f"--{n}={','.join('auto' if v is None else str(v) for v in grid[n])}" for n in grid]
    if not swept.exists() or json.loads(swept.read_text()).get("grid") != grid:
        scale.run_child(me + ["--child=sweep", f"--model={FLAGS.model}", f"--store={store}",
                              f"--tag={FLAGS.tag}", f"--split={FLAGS.split}", f"--out={swept}",
                              f"--work_dir={FLAGS.work_dir}"] + passed, FLAGS.threads, log)  # fmt: skip
    qrels = beir.load_qrels(dataset / "qrels" / f"{FLAGS.split}.tsv")
    rows = score(json.loads(swept.read_text())["rows"], json.loads(exact_path.read_text()), qrels)
    chosen, chosen10 = choose(rows)
    result = {
        "store": str(store),
        "tag": FLAGS.tag,
        "model": FLAGS.model,
        "split": FLAGS.split,
        "queries": len(json.loads(exact_path.read_text())),
        "threads": FLAGS.threads,
        "rule": RULE,
        "chosen": None if chosen is None else {n: chosen[n] for n in grid},
        "rule_k10": RULE_K10,
        "chosen_k10": None if chosen10 is None else {n: chosen10[n] for n in grid},
        "rows": rows,
    }
    out_dir = (REPO / FLAGS.output_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    name = f"tune_search_{FLAGS.model}_{FLAGS.tag}"
    fileio.atomic_write_json(out_dir / f"{name}.json", result)
    text = markdown({**result, "chosen_row": chosen, "chosen_row_k10": chosen10})
    fileio.atomic_write_text(out_dir / f"{name}.md", text)
    print(text)
    print(f"wrote {out_dir / name}.json and .md; chosen: {result['chosen']}, "
          f"at k=10: {result['chosen_k10']}")  # fmt: skip


if __name__ == "__main__":
    define_flags()
    app.run(main)
