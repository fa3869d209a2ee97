r"""Indexing as 2 processes (``launch/local_processes.sh 2 index``) against 1 process: the same
corpus, model and settings (``aligner-index``'s defaults: the zero-shot MiniLM of ``make demo``).

Runs the two one after the other (never together), each process under GNU ``time -v`` (its peak
resident memory, "Maximum resident set size"), and records the load average before and after
each run (on a shared machine the wall times follow the load). Then compares the two indexes:
their published search-index metadata without timings (every file's sha256, the settings and
counts) and the top 10 of every test query searched with ``Searcher.load`` (the centroid index,
``make demo``'s search).

  nice -n 19 .venv/bin/python benchmarks/multiprocess_index.py \
    --dataset_dir=../shared/data/beir/cisi

Writes benchmarks/results/multiprocess_index.{json,md}; removes its scratch indexes unless
``--keep``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from absl import app, flags

REPO = Path(__file__).resolve().parent.parent
FLAGS = flags.FLAGS
flags.DEFINE_string("dataset_dir", "../shared/data/beir/cisi", "BEIR folder (corpus, test).")
flags.DEFINE_multi_string("index_flag", [], "Extra aligner-index flags (both runs).")
flags.DEFINE_string("workdir", "/tmp/aligner_multiprocess_index", "Scratch folder (emptied).")
flags.DEFINE_bool("keep", False, "Keep the two indexes in --workdir.")
flags.DEFINE_string("output", str(REPO / "benchmarks" / "results"), "Results folder.")
flags.DEFINE_string("name", "multiprocess_index", "Base name of the result files.")

ONE, TWO = "1 process", "2 processes"
# Each rank's python under GNU time (the launcher runs $PYTHON -m aligner_jax.index ...)
WRAPPER = """#!/bin/bash
rank=0
for a in "$@"; do case $a in --process_id=*) rank=${a#--process_id=};; esac; done
exec /usr/bin/time -v -o "%s/time.$rank.txt" "%s" "$@"
"""


def peak_rss_mib(path: Path) -> float:
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", path.read_text())
    if not match:
        sys.exit(f"{path}: no 'Maximum resident set size' line (GNU time -v)")
    return int(match.group(1)) / 1024


def run(cmd: list[str], env: dict, log_path: Path) -> dict:
    """Runs ``cmd`` to completion; its wall time and the load average around it."""
    before = os.getloadavg()
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{' '.join(cmd[:6])} failed ({proc.returncode}); see {log_path}")
    return {"wall_s": wall, "load_before": before, "load_after": os.getloadavg()}


def summaries(log_path: Path) -> list[dict]:
    """The JSON summary line each process printed (``[rank] {...}`` under the launcher), in
    rank order (the order of the lines is the order the processes finished)."""
    out = []
    for line in log_path.read_text().splitlines():
        rank = re.match(r"^\[(\d+)\] ", line)
        line = line[rank.end() :] if rank else line
        if line.startswith('{"directory"'):
            out.append((int(rank.group(1)) if rank else 0, json.loads(line)))
    return [summary for _, summary in sorted(out, key=lambda pair: pair[0])]


def search_index_meta(index_dir: Path) -> dict:
    manifest = json.loads((index_dir / "manifest.json").read_text())
    return json.loads((index_dir / manifest["search_index"]["meta"]).read_text())


def without_timings(meta: dict) -> dict:
    meta = json.loads(json.dumps(meta))
    for update in meta["updates"]:
        for timing in ("time", "seconds", "kmeans_s"):
            update.pop(timing, None)
    return meta


def top10(index_dirs: list[Path], queries: dict[str, str]) -> list[dict[str, list]]:
    from aligner_jax.retrieval.searcher import Searcher  # noqa: PLC0415

    encoder, tops = None, []
    for index_dir in index_dirs:
        searcher = Searcher.load(str(index_dir), encoder=encoder)
        encoder = searcher.encoder  # compiled once
        pages = searcher.search_batch(list(queries.values()), k=10)
        tops.append(
            {q: [list(hit) for hit in page] for q, page in zip(queries, pages, strict=True)}
        )
    return tops


def test_queries(dataset_dir: Path) -> dict[str, str]:
    judged = {
        line.split("\t")[0]
        for line in (dataset_dir / "qrels" / "test.tsv").read_text().splitlines()[1:]
    }
    rows = map(json.loads, (dataset_dir / "queries.jsonl").read_text().splitlines())
    return {q["_id"]: q["text"] for q in rows if q["_id"] in judged}


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    data = Path(FLAGS.dataset_dir).resolve()
    corpus = data / "corpus.jsonl"
    if not corpus.exists():
        raise app.UsageError(f"--dataset_dir={FLAGS.dataset_dir}: no corpus.jsonl there")
    work = Path(FLAGS.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3")
    index_flags = [f"--dataset_dir={data}", *FLAGS.index_flag]  # = --corpus=DATA/corpus.jsonl
    runs = {}

    one_dir = work / "one"
    (work / "one_time").mkdir()
    runs[ONE] = run(
        ["/usr/bin/time", "-v", "-o", str(work / "one_time" / "time.0.txt"), sys.executable,
         "-m", "aligner_jax.index", *index_flags, f"--index_dir={one_dir}"],
        env, work / "one.log",
    )  # fmt: skip
    runs[ONE]["peak_rss_mib"] = [peak_rss_mib(work / "one_time" / "time.0.txt")]

    two_dir = work / "two"
    (work / "two_time").mkdir()
    wrapper = work / "python_under_time"
    wrapper.write_text(WRAPPER % (work / "two_time", sys.executable))
    wrapper.chmod(0o755)
    runs[TWO] = run(
        ["bash", str(REPO / "launch" / "local_processes.sh"), "2", "index", *index_flags,
         f"--index_dir={two_dir}"],
        dict(env, PYTHON=str(wrapper)), work / "two.log",
    )  # fmt: skip
    runs[TWO]["peak_rss_mib"] = [peak_rss_mib(work / "two_time" / f"time.{r}.txt") for r in (0, 1)]

    for name, index_dir, log in ((ONE, one_dir, "one.log"), (TWO, two_dir, "two.log")):
        meta = search_index_meta(index_dir)
        build = meta["updates"][0]
        runs[name].update(
            encode_s=[s["encode_seconds"] for s in summaries(work / log)],
            search_index_s=build["seconds"],
            kmeans_s=build["kmeans_s"],
        )
    metas = [search_index_meta(d) for d in (one_dir, two_dir)]
    queries = test_queries(data)
    tops = top10([one_dir, two_dir], queries)
    same = [q for q in queries if tops[0][q] == tops[1][q]]
    same_ids = [q for q in queries if [d for d, _ in tops[0][q]] == [d for d, _ in tops[1][q]]]
    overlap = sum(
        len({d for d, _ in tops[0][q]} & {d for d, _ in tops[1][q]}) / max(len(tops[0][q]), 1)
        for q in queries
    ) / len(queries)
    report = {
        "dataset_dir": FLAGS.dataset_dir,
        "index_flags": FLAGS.index_flag,
        "cpu_count": os.cpu_count(),
        "nice": os.nice(0),
        "num_docs": metas[0]["updates"][0]["num_docs"],
        "num_tokens": metas[0]["updates"][0]["num_tokens"],
        "num_centroids": metas[0]["num_centroids"],
        "search_index_equal": without_timings(metas[0]) == without_timings(metas[1]),
        "queries": len(queries),
        "top10_equal_with_scores": len(same),
        "top10_equal_ids": len(same_ids),
        "top10_overlap": overlap,
        "runs": runs,
    }
    out = Path(FLAGS.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{FLAGS.name}.json").write_text(json.dumps(report, indent=1) + "\n")

    def loads(r: dict) -> str:
        return f"{r['load_before'][0]:.1f} → {r['load_after'][0]:.1f}"

    lines = [
        f"# Indexing: 2 processes vs 1 process ({data.name}, aligner-index defaults)",
        "",
        f"`{data.name}`: {report['num_docs']} documents, {report['num_tokens']} tokens, "
        f"{report['num_centroids']} centroids; {os.cpu_count()} CPU cores shared with other "
        f"jobs; each run alone, at nice {report['nice']}. Peak RSS: GNU `time -v` of each "
        "process; wall: the whole command (start-up, encoding, search index).",
        "",
        "| run | wall s | load avg (1 min) before → after | peak RSS MiB per process | "
        "encoding s per process | search index s (k-means s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        rss = " / ".join(f"{x:.0f}" for x in r["peak_rss_mib"])
        enc = " / ".join(f"{x:.0f}" for x in r["encode_s"])
        lines.append(
            f"| {name} | {r['wall_s']:.0f} | {loads(r)} | {rss} | {enc} | "
            f"{r['search_index_s']:.0f} ({r['kmeans_s']:.0f}) |"
        )
    lines += [
        "",
        f"Search index files equal (sha256 of every file, settings, counts): "
        f"{report['search_index_equal']}. Top 10 of the {len(queries)} test queries equal (ids "
        f"and scores): {len(same)}/{len(queries)}; ids alone {len(same_ids)}/{len(queries)}; "
        f"mean overlap {overlap:.3f}.",
    ]
    (out / f"{FLAGS.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not FLAGS.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
