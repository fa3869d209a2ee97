r"""Incremental updates against a full rebuild, measured in one run (issue 10, item 4).

    .venv/bin/python benchmarks/incremental.py --dataset_dir=/work/shared/data/beir/scifact

With the zero-shot default model (``aligner-index``'s defaults: ``models/minilm_identity.gin``
and ``index/default.gin``, as ``make demo``), each step a fresh ``python -m aligner_jax.index``
process, timed from start to exit (model loading included, the same for every step) and by
the job's own summary:

1. index the first ``--base_fraction`` of the corpus documents (store + search index);
2. ``--add`` the rest (encoding, assignment to the existing centroids, inverted file, manifest);
3. ``--delete`` ``--delete_count`` ids (half of them among the added documents);
4. a full rebuild of every document from scratch in another folder (store + search index);
5. the test queries (encoded once, the same vectors for every index) in exhaustive mode
   (``Searcher.load(mode="exhaustive")``: every document refined with the float store) on the
   updated index after the deletions and on the rebuild, whose rankings less the deleted ids
   must equal them (a document's exhaustive score does not depend on the others): identical
   rankings and scores expected (max |Δscore|, queries whose top-``--k`` differ); nDCG@10 of
   both in centroid mode (the updated index before the deletions) and exhaustive mode (the
   rebuild's run less the deleted ids, as the updated index's); no deleted id returned;
6. add time / rebuild time, and the centroid drift the index records (``CentroidIndex.drift``:
   the mean max centroid score of build-time tokens outside the k-means sample minus that of
   the added tokens),
   beside the same score of the added tokens against the rebuild's centroids.

Writes ``benchmarks/results/incremental.{json,md,png}``; the load average is sampled before
and after every step (a busy machine slows every step, not the ratio alone). Each timed step is
recorded in ``--work_dir``/steps.json; ``--resume`` keeps the steps done and goes on after them.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
from absl import app, flags, logging

from aligner_jax.common import fileio
from aligner_jax.data import beir
from aligner_jax.encoding import loading
from aligner_jax.evaluation import metrics, plotting
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import indexer, kmeans
from aligner_jax.indexing import token_store as ts
from aligner_jax.retrieval import searcher as search_lib

REPO = Path(__file__).resolve().parents[1]

# The flags, defined when the script runs (not on import: tests import several benchmarks, whose
# flags share names).
F = types.SimpleNamespace()


def define_flags() -> None:
    F.dataset_dir = flags.DEFINE_string(
        "dataset_dir", "/work/shared/data/beir/scifact", "A BEIR folder (read, never copied)."
    )
    F.work_dir = flags.DEFINE_string(
        "work_dir", "/tmp/incremental_bench", "Scratch folder (emptied first)."
    )
    F.base_fraction = flags.DEFINE_float("base_fraction", 0.9, "Documents indexed before the add.")
    F.delete_count = flags.DEFINE_integer("delete_count", 50, "Documents deleted after the add.")
    F.k = flags.DEFINE_integer("k", 100, "Documents compared per query.")
    F.max_queries = flags.DEFINE_integer("max_queries", None, "Only the first N test queries.")
    F.exhaustive_queries = flags.DEFINE_integer(
        "exhaustive_queries", None, "Exhaustive mode on the first N of them only (slow on a CPU)."
    )
    F.seed = flags.DEFINE_integer("seed", 0, "Choice of the deleted documents.")
    F.resume = flags.DEFINE_bool(
        "resume", False, "Keep --work_dir and the steps it records as done (steps.json)."
    )
    F.gin_bindings = flags.DEFINE_multi_string(
        "index_gin_bindings", [], "Extra --gin.X=Y of every indexing process (tests: shard sizes)."
    )
    F.out = flags.DEFINE_string(
        "out", str(REPO / "benchmarks/results/incremental"), "Output prefix."
    )
    F.replot = flags.DEFINE_bool(
        "replot", False, "Only redraw --out's .md and .png from its .json."
    )


# -- pure helpers (tests/test_benchmarks.py) ----------------------------------------------------
def split_lines(lines: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """The first ``round(fraction · n)`` non-empty lines and the rest (file order)."""
    lines = [line for line in lines if line.strip()]
    cut = min(max(round(fraction * len(lines)), 1), len(lines) - 1)
    return lines[:cut], lines[cut:]


def pick_deletions(base_ids: list[str], added_ids: list[str], count: int, seed: int) -> list[str]:
    """``count`` ids, half (rounded down) among the added documents, the rest among the base."""
    rng = random.Random(seed)
    from_added = min(count // 2, len(added_ids))
    picks = rng.sample(added_ids, from_added) + rng.sample(base_ids, count - from_added)
    return sorted(picks)


def compare_rankings(a: dict, b: dict, k: int) -> dict:
    """Two runs ``{qid: {doc: score}}`` (top ``k`` each): the number of queries whose ranked
    top-``k`` and top-10 id lists differ, and the max |Δscore| over the documents both rank."""
    differ = differ10 = 0
    max_delta = 0.0
    for qid in sorted(set(a) | set(b)):
        ra = sorted(a.get(qid, {}).items(), key=lambda x: -x[1])[:k]
        rb = sorted(b.get(qid, {}).items(), key=lambda x: -x[1])[:k]
        differ += [d for d, _ in ra] != [d for d, _ in rb]
        differ10 += [d for d, _ in ra[:10]] != [d for d, _ in rb[:10]]
        sb = dict(rb)
        for d, s in ra:
            if d in sb:
                max_delta = max(max_delta, abs(float(s) - float(sb[d])))
    return {
        "queries": len(set(a) | set(b)),
        "queries_top_k_differ": differ,
        "queries_top_10_differ": differ10,
        "max_abs_score_delta": max_delta,
    }


def without(run: dict, deleted: set[str], k: int) -> dict:
    """A run ``{qid: {doc: score}}`` less the ``deleted`` documents, top ``k`` per query."""
    return {
        qid: dict(
            sorted(((d, s) for d, s in r.items() if d not in deleted), key=lambda x: -x[1])[:k]
        )
        for qid, r in run.items()
    }


def check_deletions(before: dict, after: dict, deleted: set[str], k: int) -> dict:
    """After ``--delete``: no deleted id in ``after``, and each query's ranked list equals the
    ``before`` one (top ``k``, taken before the deletions) less the deleted ids, as a prefix."""
    returned = sum(len(deleted & set(r)) for r in after.values())
    mismatched = 0
    for qid, r in after.items():
        expect = [
            d for d, _ in sorted(before[qid].items(), key=lambda x: -x[1])[:k] if d not in deleted
        ]
        got = [d for d, _ in sorted(r.items(), key=lambda x: -x[1])]
        n = min(len(got), len(expect))
        mismatched += got[:n] != expect[:n]
    return {"deleted_returned": returned, "queries_not_prefix": mismatched, "queries": len(after)}


def ratios(steps: dict) -> dict:
    """add / rebuild and delete / rebuild, by process wall time and by the jobs' own times."""
    rebuild_wall = steps["rebuild"]["wall_s"]
    rebuild_job = steps["rebuild"]["job_s"]
    return {
        "add_over_rebuild_wall": steps["add"]["wall_s"] / rebuild_wall,
        "add_over_rebuild_job": steps["add"]["job_s"] / rebuild_job,
        "delete_over_rebuild_wall": steps["delete"]["wall_s"] / rebuild_wall,
    }


def markdown(payload: dict) -> str:
    s, r, q = payload["steps"], payload["ratios"], payload["quality"]
    lines = [
        "# Incremental add/delete against a full rebuild (one run)",
        "",
        f"Dataset {payload['dataset']} ({payload['num_docs']:,} documents), model "
        f"{payload['model']}; machine: {payload['machine']}; load average (1 min) "
        f"{payload['load_start']:.1f} at the start, {payload['load_end']:.1f} at the end "
        f"({payload['busy']}).",
        "",
        "| step | documents | process wall s | job s | of which encoding s | search index s | "
        "load before → after |",
        "|---|---|---|---|---|---|---|",
    ]
    fmt = lambda x: "—" if x is None else f"{x:.1f}"  # noqa: E731
    for name in ("base", "add", "delete", "rebuild"):
        st = s[name]
        lines.append(
            f"| {st['label']} | {st['num_docs']:,} | {st['wall_s']:.1f} | {fmt(st['job_s'])} | "
            f"{fmt(st.get('encode_s'))} | {fmt(st.get('search_index_s'))} | "
            f"{st['load_before']:.1f} → {st['load_after']:.1f} |"
        )
    notes = [f"{st['label']}: {st['note']}" for st in s.values() if st.get("note")]
    lines += [f"Note — {n}." for n in notes]
    lines += [
        "",
        f"**add / full rebuild: {100 * r['add_over_rebuild_wall']:.1f} %** of the process wall "
        f"time ({100 * r['add_over_rebuild_job']:.1f} % of the jobs' own times, model loading "
        f"excluded); target ≤ 15 %. delete / rebuild: {100 * r['delete_over_rebuild_wall']:.1f} %.",
        "",
    ]
    ex, fa = q["exhaustive_added_vs_rebuild"], q["fast_added_vs_rebuild"]
    m = q["metrics"]
    pct = lambda x: f"{100 * x:.2f}"  # noqa: E731
    lines += [
        f'Exhaustive mode (`Searcher.load(mode="exhaustive")`), {ex["queries"]} test queries, '
        f"top {payload['k']}: the updated index (after `--add` and `--delete`) against the "
        f"rebuild less the deleted ids: top-{payload['k']} lists differ for "
        f"{ex['queries_top_k_differ']} queries (top 10: {ex['queries_top_10_differ']}), "
        f"max |Δscore| {ex['max_abs_score_delta']:.3g}. Centroid mode (before the deletions), "
        f"{fa['queries']} queries: top-{payload['k']} lists differ for "
        f"{fa['queries_top_k_differ']} (top 10: {fa['queries_top_10_differ']}).",
        "",
        "| index | nDCG@10 centroid | R@100 centroid | nDCG@10 exhaustive | R@100 exhaustive |",
        "|---|---|---|---|---|",
        f"| updated (base + `--add`) | {pct(m['added']['fast']['ndcg@10'])} | "
        f"{pct(m['added']['fast']['recall@100'])} | "
        f"{pct(m['added']['exhaustive_less_deleted']['ndcg@10'])} ¹ | "
        f"{pct(m['added']['exhaustive_less_deleted']['recall@100'])} ¹ |",
        f"| full rebuild | {pct(m['rebuild']['fast']['ndcg@10'])} | "
        f"{pct(m['rebuild']['fast']['recall@100'])} | "
        f"{pct(m['rebuild']['exhaustive_less_deleted']['ndcg@10'])} ¹ "
        f"({pct(m['rebuild']['exhaustive']['ndcg@10'])}) | "
        f"{pct(m['rebuild']['exhaustive_less_deleted']['recall@100'])} ¹ "
        f"({pct(m['rebuild']['exhaustive']['recall@100'])}) |",
        "",
        f"¹ without the {payload['deleted']} deleted documents (in parentheses: the rebuild with "
        f"them); exhaustive figures over the first {payload['exhaustive_queries']} test queries.",
    ]
    d, dr = q["after_delete"], payload["drift"]
    lines += [
        "",
        f"After deleting {payload['deleted']} documents: deleted ids returned "
        f"{d['fast']['deleted_returned']} (centroid) / {d['exhaustive']['deleted_returned']} "
        f"(exhaustive).",
        "",
        f"Drift recorded by the add (`CentroidIndex.drift`): {dr['recorded']:.4f} = mean max "
        f"centroid score of the base index's tokens at build time ({dr['build_mean']:.4f}) − "
        f"that of the {dr['added_tokens']:,} added tokens ({dr['added_mean']:.4f}); "
        f"`--compact` re-clusters above {dr['limit']}. The added tokens against the rebuild's "
        f"centroids: {dr['added_mean_rebuild_centroids']:.4f} (the rebuild's own tokens: "
        f"{dr['rebuild_mean']:.4f}).",
    ]
    return "\n".join(lines) + "\n"


def figure(payload: dict):
    """Bars: process wall time of each step, split into the job's encoding, search index and
    the rest (process start, model loading, writing)."""
    plt = plotting.pyplot()
    names = ("base", "add", "delete", "rebuild")
    steps = [payload["steps"][n] for n in names]
    enc = np.array([st.get("encode_s") or 0.0 for st in steps])
    idx = np.array([st.get("search_index_s") or 0.0 for st in steps])
    rest = np.array([st["wall_s"] for st in steps]) - enc - idx
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    x = np.arange(len(steps))
    ax.bar(x, enc, label="encoding", color="C0")
    ax.bar(x, idx, bottom=enc, label="search index", color="C1")
    ax.bar(x, np.maximum(rest, 0), bottom=enc + idx, label="other (start, model, I/O)", color="C7")
    for i, st in enumerate(steps):
        ax.text(i, st["wall_s"], f"{st['wall_s']:.0f} s", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(x, [f"{st['label']}\n{st['num_docs']:,} docs" for st in steps], fontsize=8)
    ax.set_ylabel("seconds (process wall time)")
    r = payload["ratios"]
    ax.set_title(
        f"{payload['dataset']}: add = {100 * r['add_over_rebuild_wall']:.1f} % of a full rebuild "
        f"(load {payload['load_start']:.1f}→{payload['load_end']:.1f})",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    ax.margins(y=0.12)
    fig.tight_layout()
    return fig


# -- the run ------------------------------------------------------------------------------------
def _load() -> float:
    return os.getloadavg()[0]


def _index_process(label: str, *args: str) -> dict:
    """One ``python -m aligner_jax.index`` process (its progress on our stderr); its JSON summary,
    wall time and the load average before and after."""
    cmd = [sys.executable, "-m", "aligner_jax.index", *args]
    cmd += [f"--gin.{b}" for b in F.gin_bindings.value]
    logging.info("%s: %s", label, " ".join(cmd[1:]))
    load_before = _load()
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{label} failed (exit {proc.returncode}); its output is above")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    logging.info("%s: %.1f s (load %.1f → %.1f) %s", label, wall, load_before, _load(), summary)
    return {"wall_s": wall, "load_before": load_before, "load_after": _load(), "summary": summary}


def _search_index_meta(index_dir: Path) -> dict:
    return json.loads(ci.published_meta(index_dir).read_text())


def _build_step(label: str, corpus: Path, index_dir: Path) -> dict:
    step = _index_process(label, f"--corpus={corpus}", f"--index_dir={index_dir}")
    build = _search_index_meta(index_dir)["updates"][0]
    step.update(
        label=label,
        num_docs=step["summary"]["num_docs"],
        encode_s=step["summary"]["encode_seconds"],
        search_index_s=build["seconds"],
        kmeans_s=build["kmeans_s"],
        job_s=step["summary"]["encode_seconds"] + build["seconds"],
    )
    return step


def _run(searcher, qids, encoded, k) -> dict:
    return searcher.run(qids, encoded, show_progress=False, k=k).results["top_k:1"]


def _mode_run(index_dir: Path, mode: str, encoder, qids, encoded, k) -> dict:
    start = time.perf_counter()
    searcher = search_lib.Searcher.load(str(index_dir), mode=mode, encoder=encoder)
    run = _run(searcher, qids, encoded, k)
    logging.info(
        "%s %s: %d queries in %.1f s", index_dir.name, mode, len(qids), time.perf_counter() - start
    )
    return run


def _metrics(qrels: dict, run: dict) -> dict:
    ev = metrics.evaluate_run({q: qrels[q] for q in run}, run)
    return {m: ev.aggregate[m] for m in ("ndcg@10", "recall@100")}


def _drift(grown: Path, rebuilt: Path, base_shards: int) -> dict:
    """The recorded drift, and the added tokens' mean max centroid score against the
    rebuild's centroids (a fresh clustering that saw them)."""
    meta = _search_index_meta(grown)
    add = next(u for u in meta["updates"] if u["op"] == "add")
    store = ts.TokenStore(grown)
    shards = store.manifest["shards"]
    start = sum(s["num_tokens"] for s in shards if s["index"] < base_shards)  # first added token
    added = np.asarray(store.vectors(start), np.float32)
    centroids = np.asarray(ci.CentroidIndex.load(ts.TokenStore(rebuilt)).centroids)
    _, best = kmeans.assign(added, centroids)
    rebuild_meta = _search_index_meta(rebuilt)
    return {
        "recorded": ci.CentroidIndex.load_unchecked(store).drift(),
        "build_mean": meta["mean_centroid_score"],
        "added_mean": add["mean_centroid_score"],
        "added_tokens": add["new_tokens"],
        "limit": ci.DRIFT_LIMIT,
        "added_mean_rebuild_centroids": float(best.mean()),
        "rebuild_mean": rebuild_meta["mean_centroid_score"],
        "num_centroids_base": meta["num_centroids"],
        "num_centroids_rebuild": rebuild_meta["num_centroids"],
    }


def bench() -> dict:
    dataset_dir = Path(F.dataset_dir.value).resolve()
    work = Path(F.work_dir.value)
    done_path = work / "steps.json"
    if not F.resume.value:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    steps = json.loads(done_path.read_text()) if done_path.exists() else {}
    if steps:
        logging.info("--resume: steps done before: %s", list(steps))
    load_start = steps["base"]["load_before"] if "base" in steps else _load()
    logging.info("load average at the start: %s", os.getloadavg())
    corpus = dataset_dir / "corpus.jsonl"
    base_lines, added_lines = split_lines(corpus.read_text().splitlines(), F.base_fraction.value)
    ids = lambda lines: [json.loads(line)["_id"] for line in lines]  # noqa: E731
    deleted = pick_deletions(ids(base_lines), ids(added_lines), F.delete_count.value, F.seed.value)
    grown, rebuilt = work / "grown", work / "rebuilt"

    def record(name: str, step: dict) -> None:
        steps[name] = step
        fileio.atomic_write_json(done_path, steps, sort_keys=False)

    if "base" not in steps:
        (work / "base.jsonl").write_text("\n".join(base_lines) + "\n")
        (work / "added.jsonl").write_text("\n".join(added_lines) + "\n")
        shutil.rmtree(grown, ignore_errors=True)
        record("base", _build_step("base index (first part)", work / "base.jsonl", grown))
    base_shards = steps["base"]["summary"]["num_shards"]
    if "add" not in steps:
        add = _index_process("add", f"--index_dir={grown}", f"--add={work / 'added.jsonl'}")
        add.update(
            label="--add (the rest)",
            num_docs=add["summary"]["added_docs"],
            job_s=add["summary"]["seconds"],
            encode_s=add["summary"]["encode_s"],
            search_index_s=add["summary"]["seconds"] - add["summary"]["encode_s"],
        )
        record("add", add)

    dataset = beir.load_beir(dataset_dir)
    qids = [q for q in dataset.queries if q in dataset.qrels][: F.max_queries.value]
    spec = json.loads((grown / indexer.ENCODER_FILE).read_text())
    encoder = search_lib.whole_query_encoder(loading.encoder_from_spec(spec))
    encoded = encoder.encode([dataset.queries[q] for q in qids], "query")
    k, gone = F.k.value, set(deleted)
    n_ex = len(qids) if F.exhaustive_queries.value is None else F.exhaustive_queries.value
    # centroid mode on the updated index before the deletions (the rebuild's comparison)
    grown_fast = _mode_run(grown, "fast", encoder, qids, encoded, k)

    if "delete" not in steps:
        (work / "deleted.txt").write_text("\n".join(deleted) + "\n")
        delete = _index_process(
            "delete", f"--index_dir={grown}", f"--delete=@{work / 'deleted.txt'}"
        )
        delete.update(label="--delete", num_docs=len(deleted), job_s=None)
        record("delete", delete)
    after = {"fast": _mode_run(grown, "fast", encoder, qids, encoded, k)}
    after["exhaustive"] = _mode_run(grown, "exhaustive", encoder, qids[:n_ex], encoded[:n_ex], k)

    if "rebuild" not in steps:
        shutil.rmtree(rebuilt, ignore_errors=True)
        record("rebuild", _build_step("full rebuild", corpus, rebuilt))
    load_end = _load()
    logging.info("load average at the end of the timed steps: %s", os.getloadavg())
    rebuild_fast = _mode_run(rebuilt, "fast", encoder, qids, encoded, k)
    # k + |deleted| documents: the rebuild's top k less the deleted ids is complete
    rebuild_ex = _mode_run(
        rebuilt, "exhaustive", encoder, qids[:n_ex], encoded[:n_ex], k + len(deleted)
    )
    qrels = dataset.qrels
    payload = {
        "dataset": dataset_dir.name,
        "model": "zero-shot (models/minilm_identity.gin, aligner-index defaults)",
        "num_docs": len(base_lines) + len(added_lines),
        "base_docs": len(base_lines),
        "added_docs": len(added_lines),
        "deleted": len(deleted),
        "k": k,
        "queries": len(qids),
        "exhaustive_queries": n_ex,
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs",
        "load_start": load_start,
        "load_end": load_end,
        "busy": "busy: other jobs ran" if max(load_start, load_end) > 2.5 else "quiet",
        "steps": {n: {k_: v for k_, v in st.items() if k_ != "summary"} for n, st in steps.items()},
        "summaries": {n: st["summary"] for n, st in steps.items()},
        "quality": {
            "exhaustive_added_vs_rebuild": compare_rankings(
                after["exhaustive"], without(rebuild_ex, gone, k), k
            ),
            "fast_added_vs_rebuild": compare_rankings(grown_fast, rebuild_fast, k),
            "metrics": {
                "added": {
                    "fast": _metrics(qrels, grown_fast),
                    # the rebuild's exhaustive run less the deleted ids is the updated index's
                    "exhaustive_less_deleted": _metrics(qrels, after["exhaustive"]),
                },
                "rebuild": {
                    "fast": _metrics(qrels, rebuild_fast),
                    "exhaustive_less_deleted": _metrics(qrels, without(rebuild_ex, gone, k)),
                    "exhaustive": _metrics(qrels, without(rebuild_ex, set(), k)),
                },
            },
            "after_delete": {
                "fast": check_deletions(grown_fast, after["fast"], gone, k),
                "exhaustive": check_deletions(rebuild_ex, after["exhaustive"], gone, k),
            },
        },
        "drift": _drift(grown, rebuilt, base_shards),
    }
    payload["ratios"] = ratios(payload["steps"])
    return payload


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    out = Path(F.out.value)
    if F.replot.value:
        payload = json.loads(out.with_suffix(".json").read_text())
    else:
        payload = bench()
        out.parent.mkdir(parents=True, exist_ok=True)
        fileio.atomic_write_json(out.with_suffix(".json"), payload, sort_keys=False)
    fileio.atomic_write_text(out.with_suffix(".md"), markdown(payload))
    plotting.save(figure(payload), out.with_suffix(".png"), dpi=120)
    print(markdown(payload))
    print(f"wrote {out}.json, .md, .png")


if __name__ == "__main__":
    define_flags()
    app.run(main)
