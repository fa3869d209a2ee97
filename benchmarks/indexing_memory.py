r"""Peak memory of the indexing job does not grow with the corpus (issue: bounded-memory indexing).

Indexes a BEIR corpus and the same corpus doubled (every document twice, the copies under new
ids) with the same shard and batch sizes, each in a fresh ``aligner-index`` process, and compares
the processes' peak resident memory (ru_maxrss). Also checks that an index killed twice at random
points and resumed has the same checksums as an uninterrupted one (``--kill_test``).

  .venv/bin/python benchmarks/indexing_memory.py --dataset_dir=../shared/data/beir/scifact

Writes benchmarks/results/indexing_memory.{json,md}.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

REPO = Path(__file__).resolve().parent.parent


def index_cmd(corpus: Path, index_dir: Path, gin_files, bindings) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "aligner_jax.index",
        f"--corpus={corpus}",
        f"--index_dir={index_dir}",
    ]
    cmd += [f"--gin_file={g}" for g in gin_files] + [f"--gin_bindings={b}" for b in bindings]
    return cmd


def run_indexing(cmd: list[str]) -> dict:
    """Runs one indexing process to completion; returns its summary and its own peak RSS."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's rusage, not all children's
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode:
        sys.exit(f"indexing failed:\n{stderr[-3000:]}")
    summary = json.loads(stdout.strip().splitlines()[-1])
    summary["wall_s"] = time.perf_counter() - start
    summary["peak_rss_mib"] = usage.ru_maxrss / 1024
    return summary


def doubled_corpus(corpus: Path, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(corpus) as src, open(out, "w") as dst:
        lines = [line for line in src if line.strip()]
        dst.writelines(lines)
        for line in lines:
            record = json.loads(line)
            record["_id"] = f"{record['_id']}__copy"
            dst.write(json.dumps(record) + "\n")
    return out


def checksums(index_dir: Path) -> dict:
    manifest = json.loads((index_dir / "manifest.json").read_text())
    return {m["path"]: m["sha256"] for s in manifest["shards"] for m in s["files"].values()}


def kill_test(corpus: Path, workdir: Path, gin_files, bindings, kills: int = 2) -> dict:
    """Indexes once uninterrupted and once killed ``kills`` times; compares checksums."""
    ref = workdir / "uninterrupted"
    run_indexing(index_cmd(corpus, ref, gin_files, bindings))
    target = workdir / "killed"
    rng = random.Random(0)
    points = []
    for _ in range(kills):
        proc = subprocess.Popen(
            index_cmd(corpus, target, gin_files, bindings),
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        delay = rng.uniform(20, 90)  # seconds: after model load, inside some shard
        deadline = time.time() + delay
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        points.append(
            {
                "after_s": round(delay, 1),
                "complete_shards": len(list(target.glob("shard-?????.json"))),
            }
        )
    run_indexing(index_cmd(corpus, target, gin_files, bindings))
    same = checksums(ref) == checksums(target)
    return {"kills": points, "identical_checksums": same, "files": len(checksums(ref))}


FLAGS = flags.FLAGS
flags.DEFINE_string(
    "dataset_dir", str(REPO.parent / "shared/data/beir/scifact"), "A BEIR folder (its corpus)."
)
flags.DEFINE_string("workdir", "/tmp/aligner_indexing_memory", "Scratch folder (deleted first).")
flags.DEFINE_multi_string("gin_file", None, "Gin files of the indexing runs (default: zero-shot).")
flags.DEFINE_multi_string("gin_bindings", [], "Extra gin bindings of the indexing runs.")
flags.DEFINE_bool("kill_test", False, "Also kill and resume an indexing run.")
flags.DEFINE_string("output", str(REPO / "benchmarks" / "results"), "Output folder.")


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    args = FLAGS
    gin_files = args.gin_file or ["models/minilm_identity.gin", "index/default.gin"]
    bindings = ["IndexingConfig.shard_size = 500", *args.gin_bindings]
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    corpus = Path(args.dataset_dir) / "corpus.jsonl"
    single = run_indexing(index_cmd(corpus, work / "single", gin_files, bindings))
    print(f"corpus ×1: {single['num_docs']} docs, peak RSS {single['peak_rss_mib']:.0f} MiB")
    double = run_indexing(
        index_cmd(
            doubled_corpus(corpus, work / "doubled.jsonl"), work / "double", gin_files, bindings
        )
    )
    print(f"corpus ×2: {double['num_docs']} docs, peak RSS {double['peak_rss_mib']:.0f} MiB")
    ratio = double["peak_rss_mib"] / single["peak_rss_mib"]
    report = {"gin_files": gin_files, "bindings": bindings, "single": single, "double": double}
    report["rss_ratio"] = ratio
    if args.kill_test:
        report["kill_test"] = kill_test(corpus, work / "kill", gin_files, bindings)
        print(f"kill test: {report['kill_test']}")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "indexing_memory.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        "# Indexing peak memory against corpus size (shard 500 docs, same batch sizes)",
        "",
        "| corpus | documents | tokens | peak RSS MiB | wall s |",
        "|---|---|---|---|---|",
        f"| ×1 | {single['num_docs']} | {single['num_tokens']} | {single['peak_rss_mib']:.0f} | "
        f"{single['wall_s']:.0f} |",
        f"| ×2 (duplicated) | {double['num_docs']} | {double['num_tokens']} | "
        f"{double['peak_rss_mib']:.0f} | {double['wall_s']:.0f} |",
        "",
        f"Peak RSS ratio ×2/×1: {ratio:.3f}.",
    ]
    if args.kill_test:
        k = report["kill_test"]
        lines.append(
            f"Killed {len(k['kills'])} times ({k['kills']}) and resumed: checksums of all "
            f"{k['files']} shard files identical to an uninterrupted run: {k['identical_checksums']}."
        )
    (out / "indexing_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    app.run(main)
