r"""Issue 23's latency ratio, p50 at N× SciFact over p50 at 1×, measured in one process,
interleaved per query.

``benchmarks/scale.py`` times each scale in its own process, minutes apart; the machine is
shared and its speed drifts, so the ratio of two such rows moved between 3.07× and 3.93× at
k = 10 in two runs of the same code (stop 70). Here both searchers are loaded at once (the
stores ``scale.py --keep_stores`` left in ``--work_dir``, each with its search index, and the
queries it encoded), and every query is searched on both, at each k, alternating which goes
first query by query: one untimed pass, then ``--rounds`` timed ones. Reported per k: p50 / p99
of each, the ratio of the p50s, and a 95 % interval of that ratio from a bootstrap over queries
(each query's median over rounds; the same resampled queries for both scales).

  .venv/bin/python benchmarks/scale.py --model=trained --scales=1,100 --bits=4 \
      --keep_stores --work_dir=/work/scale_work      # the stores and their indexes
  .venv/bin/python benchmarks/scale_ratio.py --work_dir=/work/scale_work/trained --scales=1,100

Writes ``OUTPUT_DIR/NAME.{json,md,png}``.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

# first: the package sets OpenBLAS's environment, which counts only before NumPy loads
importlib.import_module("aligner_jax")

import numpy as np  # noqa: E402
import threadpoolctl  # noqa: E402
from absl import app, flags  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import scale  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("work_dir", None, "scale.py's work folder of one model (x1, x100, ...).")
    flags.DEFINE_list(
        "scales",
        ["1", "100"],
        "The base scale, then the scales compared with it: folders x<scale> of --work_dir (a "
        "name that is not a number, e.g. 100c, compares another index of a store).",
    )
    flags.DEFINE_list("ks", ["10", "100"], "Documents requested.")
    flags.DEFINE_integer("rounds", 2, "Timed rounds after one untimed.")
    flags.DEFINE_integer("threads", 2, "BLAS threads of the search.")
    flags.DEFINE_integer("resamples", 2000, "Bootstrap resamples of the queries.")
    flags.DEFINE_string("output_dir", "benchmarks/results", "Where the results go.")
    flags.DEFINE_string("output_name", "scale_ratio", "File name of the results, without suffix.")


def interleaved(queries, searchers: dict, k: int, rounds: int) -> dict[str, np.ndarray]:
    """``{scale: [queries, rounds] ms}``: every query on every searcher, the order rotated
    query by query and round by round; one untimed pass first."""
    names = list(searchers)
    ms = {name: np.zeros((len(queries), rounds)) for name in names}
    for r in range(rounds + 1):
        for i, (_, q, u) in enumerate(queries):
            shift = (i + r) % len(names)
            for name in names[shift:] + names[:shift]:
                t = time.perf_counter()
                searchers[name].search(q, u, np.arange(len(q)), k)
                if r:
                    ms[name][i, r - 1] = 1000.0 * (time.perf_counter() - t)
    return ms


def scale_label(name: str) -> float | str:
    """A ``--scales`` entry as rows record it: the scale (``"100"`` → 100.0), or the folder
    name as given when it is not a number (``"100c"``: another index of a store)."""
    try:
        return float(name)
    except ValueError:
        return name


def ratio_interval(base: np.ndarray, other: np.ndarray, resamples: int, seed: int = 0) -> list:
    """95 % percentile interval of p50(other) / p50(base) over bootstrap resamples of the
    queries (per-query medians over rounds; the same queries for both)."""
    b, o = np.median(base, axis=1), np.median(other, axis=1)
    idx = np.random.default_rng(seed).integers(0, len(b), size=(resamples, len(b)))
    ratios = np.median(o[idx], axis=1) / np.median(b[idx], axis=1)
    return [round(float(x), 3) for x in np.percentile(ratios, [2.5, 97.5])]


def markdown(report: dict) -> str:
    lines = [
        "# p50 at N× SciFact over p50 at 1×, interleaved per query (issue 23)",
        "",
        f"`{report['command']}`",
        "",
        f"{report['machine']}; {report['threads']} threads; {report['queries']} queries; "
        f"{report['rounds']} timed rounds after one untimed; load average before "
        f"{report['loadavg_before']}, after {report['loadavg_after']}.",
        "",
        f"| k | scale | tokens | p50 / p99 ms | p50 ratio to {report['rows'][0]['scale']}× | "
        "95 % interval |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['k']} | {row['scale']}× | {row['tokens']:,} | {row['p50_ms']:.2f} / "
            f"{row['p99_ms']:.2f} | {row.get('ratio', 1.0):.2f}× | "
            f"{row.get('ratio_ci95') or '—'} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path, samples: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({row["k"] for row in report["rows"]})
    fig, axes = plt.subplots(1, len(ks), figsize=(5 * len(ks), 4), squeeze=False)
    for ax, k in zip(axes[0], ks, strict=True):
        names = [n for n in samples if n.startswith(f"k={k} ")]
        ax.boxplot([samples[n].ravel() for n in names], showfliers=False)
        ax.set_xticks(range(1, len(names) + 1), [n.split(" ", 1)[1] for n in names])
        ax.set_ylabel("ms per query")
        ax.set_title(f"k = {k}")
    fig.suptitle("Search latency by scale, interleaved per query")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv) -> None:
    del argv
    from aligner_jax.common import fileio

    work = Path(FLAGS.work_dir)
    scales = list(FLAGS.scales)
    dirs = {s: work / f"x{s}" for s in scales}
    missing = [str(d) for d in dirs.values() if not (d / "manifest.json").exists()]
    if missing:
        raise app.UsageError(
            f"--work_dir: no store at {', '.join(missing)} (grow it with benchmarks/scale.py "
            "--keep_stores)"
        )
    queries_npz = work / "queries.npz"
    if not queries_npz.exists():
        raise app.UsageError(f"--work_dir: {queries_npz} does not exist (scale.py writes it)")
    queries = scale._queries(queries_npz)
    before = [round(x, 2) for x in os.getloadavg()]
    rows, samples = [], {}
    with threadpoolctl.threadpool_limits(FLAGS.threads):
        searchers = {s: scale.load_searcher(d) for s, d in dirs.items()}  # defaults
        for k in (int(k) for k in FLAGS.ks):
            ms = interleaved(queries, searchers, k, FLAGS.rounds)
            base = ms[scales[0]]
            for s in scales:
                row = {
                    "k": k,
                    "scale": scale_label(s),
                    "tokens": searchers[s].store.num_tokens,
                    "p50_ms": round(float(np.percentile(ms[s], 50)), 3),
                    "p99_ms": round(float(np.percentile(ms[s], 99)), 3),
                }
                if s != scales[0]:
                    row["ratio"] = round(row["p50_ms"] / float(np.percentile(base, 50)), 3)
                    row["ratio_ci95"] = ratio_interval(base, ms[s], FLAGS.resamples)
                rows.append(row)
                samples[f"k={k} {s}×"] = ms[s]
                print(json.dumps(row))
    report = {
        "command": " ".join(["benchmarks/scale_ratio.py", *sys.argv[1:]]),
        "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
        "threads": FLAGS.threads,
        "queries": len(queries),
        "rounds": FLAGS.rounds,
        "loadavg_before": before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "work_dir": str(work),
        "rows": rows,
    }
    out = Path(FLAGS.output_dir) / FLAGS.output_name
    out.parent.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_text(out.with_suffix(".json"), json.dumps(report, indent=1) + "\n")
    fileio.atomic_write_text(out.with_suffix(".md"), markdown(report))
    plot(report, out.with_suffix(".png"), samples)
    print(f"wrote {out}.json, .md, .png")


if __name__ == "__main__":
    define_flags()
    flags.mark_flag_as_required("work_dir")
    app.run(main)
