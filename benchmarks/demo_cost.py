r"""What ``make demo`` costs from scratch: wall time and peak memory, by phase.

  .venv/bin/python benchmarks/demo_cost.py [--data=../shared/data/beir/scifact] \
      [--output_dir=benchmarks/results] [--name=demo_cost]
  .venv/bin/python benchmarks/demo_cost.py --replot   # redraw .md / .png from the .json

Runs ``make demo DATA=--data OUT=<an empty temporary folder>`` in a fresh process, so that the
corpus is encoded and the search index built (nothing reused), under GNU time
(``scale.run_child``: the peak resident memory of the largest process of the job, measured from
outside; 2 BLAS threads, the machine's cores). The demo's own ``metrics.json`` gives its phases:
corpus encoding and index build; the rest of the wall time is start-up, loading, the queries,
the evaluation and writing. Writes ``--name.{json,md,png}`` (the PNG: wall seconds by phase) in
``--output_dir`` and deletes the temporary folder (``--keep`` keeps it).
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

from absl import app, flags

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from aligner_jax.common import fileio  # noqa: E402
from aligner_jax.evaluation import plotting  # noqa: E402
from benchmarks import scale  # noqa: E402

FLAGS = flags.FLAGS
PHASES = ("corpus encoding", "index build", "start-up, queries, evaluation, writing")


def phases(timing: dict, wall_s: float) -> dict[str, float]:
    """Wall seconds by phase from the demo's ``metrics.json`` ``timing`` block; the rest of
    ``wall_s`` is the last phase. A reused index (nothing encoded or built) is refused: it
    would not be the demo's cost."""
    if timing.get("index_reused"):
        raise ValueError("the demo reused an existing index: its cost is not measured")
    encode, build = float(timing["encode_corpus_s"]), float(timing["index_build_s"])
    return dict(zip(PHASES, (encode, build, max(wall_s - encode - build, 0.0)), strict=True))


def report(metrics: dict, child: dict, command: list[str], load: tuple, data: str) -> dict:
    """The JSON written: the child's wall time and peak RSS, the phases and the demo's figures."""
    return {
        "command": " ".join(command),
        "data": data,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
        "load_avg_before": [round(x, 2) for x in load[0]],
        "load_avg_after": [round(x, 2) for x in load[1]],
        "wall_s": child["wall_s"],
        "peak_rss_gib": child["peak_rss_gib"],
        "phases_s": phases(metrics["timing"], child["wall_s"]),
        "num_docs": metrics["num_docs"],
        "num_tokens": metrics["num_tokens"],
        "ndcg@10": metrics["metrics"]["ndcg@10"],
        "recall@100": metrics["metrics"]["recall@100"],
        "search_ms_per_query_p50": metrics["timing"]["search_ms_per_query_p50"],
    }


def markdown(r: dict) -> str:
    rows = "\n".join(f"| {name} | {s:.1f} |" for name, s in r["phases_s"].items())
    return (
        "# What `make demo` costs from scratch (`benchmarks/demo_cost.py`)\n\n"
        f"`{r['command']}` on {r['machine']}, {r['date']}; load average before "
        f"{r['load_avg_before']}, after {r['load_avg_after']}. {r['num_docs']:,} documents, "
        f"{r['num_tokens']:,} tokens; nDCG@10 {100 * r['ndcg@10']:.1f}, R@100 "
        f"{100 * r['recall@100']:.1f}.\n\n"
        f"**Wall time {r['wall_s']:.0f} s, peak RSS {r['peak_rss_gib']:.2f} GiB** (the largest "
        "process of the job, from outside: GNU time).\n\n"
        "| phase | wall s |\n|---|---|\n" + rows + "\n"
    )


def plot(r: dict, path: Path) -> None:
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(10, 2.2))
    left = 0.0
    for name, seconds in r["phases_s"].items():
        ax.barh([0], [seconds], left=left, label=f"{name}: {seconds:.0f} s")
        left += seconds
    ax.set_yticks([])
    ax.set_xlabel("wall seconds")
    ax.set_title(
        f"make demo from scratch: {r['wall_s']:.0f} s, peak RSS {r['peak_rss_gib']:.2f} GiB"
    )
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(result: dict, stem: Path) -> None:
    """``stem``.md and .png from ``result`` (the JSON), and the Markdown printed."""
    text = markdown(result)
    fileio.atomic_write_text(stem.with_suffix(".md"), text)
    plot(result, stem.with_suffix(".png"))
    print(text)


def define_flags() -> None:
    """The command line (defined by ``__main__`` only: tests import this module beside others)."""
    flags.DEFINE_string("data", str(REPO.parent / "shared/data/beir/scifact"), "BEIR folder.")
    flags.DEFINE_string("output_dir", str(REPO / "benchmarks/results"), "Results folder.")
    flags.DEFINE_string("name", "demo_cost", "Results file stem.")
    flags.DEFINE_bool("keep", False, "Keep the demo's output folder (its path is printed).")
    flags.DEFINE_bool("replot", False, "Only redraw --name's .md and .png from its .json.")


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    stem = Path(FLAGS.output_dir) / FLAGS.name
    if FLAGS.replot:
        result = fileio.read_json(stem.with_suffix(".json"), fix="run without --replot")
        write(result, stem)
        return
    data = Path(FLAGS.data)
    if not (data / "corpus.jsonl").exists():
        raise app.UsageError(f"--data={data}: no corpus.jsonl there (a BEIR folder is needed)")
    out_dir = Path(tempfile.mkdtemp(prefix="demo_cost_"))
    command = ["make", "demo", f"DATA={data}", f"OUT={out_dir}"]
    before = os.getloadavg()
    child = scale.run_child(command, threads=2, log=out_dir / "demo.log")
    after = os.getloadavg()
    demo_dir = out_dir / f"zero_shot_{data.name}"
    metrics = fileio.read_json(demo_dir / "metrics.json", fix="see " + str(out_dir / "demo.log"))
    result = report(metrics, child, command, (before, after), str(data))
    stem.parent.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_json(stem.with_suffix(".json"), result)
    write(result, stem)
    if FLAGS.keep:
        print(f"kept {out_dir}")
    else:
        shutil.rmtree(out_dir)
    print(f"wrote {stem}.json, .md, .png")


if __name__ == "__main__":
    define_flags()
    app.run(main)
