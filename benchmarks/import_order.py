r"""What importing NumPy before ``aligner_jax`` costs a search, with OpenBLAS held and not.

  .venv/bin/python benchmarks/import_order.py \
      [--index_dir=outputs/zero_shot_cisi/index] [--dataset_dir=../shared/data/beir/cisi] \
      [--k=10] [--threads=2] [--children=3] [--rounds=2] [--output_name=import_order]

OpenBLAS reads ``OPENBLAS_THREAD_TIMEOUT`` when it loads: ``import aligner_jax`` sets it, so that
the library's idle workers sleep, but a program that imported NumPy first has loaded it with
workers that spin ~0.1 s after each BLAS call (``aligner_jax/common/blas.py``). Since stop 93 a
search holds such a library at one thread while it runs and cuts its matrix products between its
own threads (``blas.one_thread_if_spinning``, ``blas.matmul``). Four variants, each in a fresh
child process, alternated round by round (the first of each round moves on by one):

  * ``package_first``: ``import aligner_jax`` before NumPy (the binaries' order);
  * ``package_first_free``: the same, the hold off (nothing to hold: a check of the harness);
  * ``numpy_first``: ``import numpy`` first, the hold on (the search of today);
  * ``numpy_first_free``: ``import numpy`` first, the hold off (the search before stop 93).

Each child loads the index with ``Searcher.load`` under ``--threads`` BLAS threads and runs
``e2e_latency.measure`` over the split's queries (one untimed pass for the rerank candidates,
then end to end, encoding alone, search alone and rerank per query; ``--rounds`` passes, the
flags of ``e2e_latency.py``); ``--children`` children per variant. Writes ``benchmarks/results/--output_name.{json,md,png}``: per variant the percentiles
of all its samples, the range of its per-child p50, and the load average around each child.
"""

from __future__ import annotations

import sys

if "--child_numpy_first" in sys.argv:  # what a child measures: before anything else
    import numpy  # noqa: F401

import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from collections.abc import Sequence  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

importlib.import_module("aligner_jax")  # the package's environment, where NumPy is not loaded

import e2e_latency  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from aligner_jax.common import cli  # noqa: E402

# e2e_latency's flags: --index_dir, --dataset_dir, --split, --threads, --k, --rerank_candidates,
# --rounds (passes over the queries in each child) and --output_name
_CHILDREN = flags.DEFINE_integer("children", 3, "Children per variant.", lower_bound=1)
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Folder of the results (default: ours).")
_VARIANTS = flags.DEFINE_list("variants", None, "Of VARIANTS, these only (default: all).")
_CHILD = flags.DEFINE_string("child", None, "Internal: a child's variant and its JSON path.")
flags.DEFINE_boolean("child_numpy_first", False, "Internal: NumPy was imported first.")
flags.FLAGS.set_default("output_name", "import_order")
flags.FLAGS.set_default("index_dir", "outputs/zero_shot_cisi/index")
flags.FLAGS.set_default("dataset_dir", "../shared/data/beir/cisi")

VARIANTS = ("package_first", "package_first_free", "numpy_first", "numpy_first_free")
ROWS = ("end_to_end", "encode", "search", "rerank")


def child(variant: str, out: str) -> None:
    """One variant's figures, written to ``out`` (JSON): ``e2e_latency.measure``'s samples,
    whether NumPy's OpenBLAS spins and whether the search held it."""
    import threadpoolctl

    from aligner_jax.common import blas
    from aligner_jax.data import beir

    f = flags.FLAGS
    dataset = beir.load_beir(f.dataset_dir, split=f.split)
    with threadpoolctl.threadpool_limits(f.threads):
        searcher, _ = e2e_latency.load_with_warm_up(f.index_dir)
        if variant.endswith("_free"):
            blas._spinning[:] = [[]]  # no library held: the search before stop 93
        held = len(blas._spinning_libraries())
        measured = e2e_latency.measure(
            searcher, dataset.queries, f.k, f.rerank_candidates, f.rounds
        )
    result = {
        "variant": variant,
        "spinning_openblas": len(blas.spinning_openblas()),
        "held_libraries": held,
        "compilations_after_load": measured["compilations_after_load"],
        "samples": {row: measured["_samples"][row] for row in ROWS},
    }
    pathlib.Path(out).write_text(json.dumps(result))


def run_child(variant: str, folder: pathlib.Path) -> dict:
    out = folder / f"{variant}.json"
    command = [sys.executable, __file__, f"--child={variant},{out}"]
    if variant.startswith("numpy_first"):
        command.append("--child_numpy_first")
    for name in (
        "index_dir",
        "dataset_dir",
        "split",
        "threads",
        "k",
        "rerank_candidates",
        "rounds",
    ):
        command.append(f"--{name}={flags.FLAGS[name].value}")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    before = os.getloadavg()[0]
    subprocess.run(command, check=True, env=env, cwd=REPO)
    result = json.loads(out.read_text())
    result["load_avg_1m"] = [round(before, 2), round(os.getloadavg()[0], 2)]
    return result


def summary(children: list[dict]) -> dict:
    """Per variant and row: the percentiles of every sample and the range of the children's
    p50; per variant the ratio of its search p50 to ``package_first``'s."""
    out = {}
    for variant in VARIANTS:
        mine = [c for c in children if c["variant"] == variant]
        if not mine:
            continue
        rows = {}
        for row in ROWS:
            every = [ms for c in mine for ms in c["samples"][row]]
            p50s = [float(np.percentile(c["samples"][row], 50)) for c in mine]
            rows[row] = e2e_latency.percentiles(every) | {"p50_range_ms": [min(p50s), max(p50s)]}
        out[variant] = {
            "children": len(mine),
            "spinning_openblas": sorted({c["spinning_openblas"] for c in mine}),
            "held_libraries": sorted({c["held_libraries"] for c in mine}),
            "compilations_after_load": sum(c["compilations_after_load"] for c in mine),
            "load_avg_1m": [c["load_avg_1m"] for c in mine],
            **rows,
        }
    base = out.get("package_first")
    for variant in out.values():
        if base:
            variant["search_p50_vs_package_first"] = round(
                variant["search"]["p50_ms"] / base["search"]["p50_ms"], 3
            )
    return out


def _present(results: dict) -> list[str]:
    """The variants measured, in ``VARIANTS``' order (a JSON file keeps its keys sorted)."""
    return [v for v in VARIANTS if v in results["variants"]]


def markdown(results: dict) -> str:
    lines = [
        "# NumPy imported before `aligner_jax`: search and end-to-end latency",
        "",
        f"`{results['command']}`",
        "",
        f"{results['dataset_dir']} ({results['queries']} {results['split']} queries), index "
        f"`{results['index_dir']}`, k = {results['k']}, {results['threads']} threads; "
        f"{results['children']} children per variant × {results['rounds_per_child']} passes, "
        f"alternated; {results['machine']}.",
        "",
        "| variant | OpenBLAS spins / held | search p50 (children's range) / p99 ms | ratio "
        "| end to end p50 / p99 | encoding p50 / p99 | rerank p50 / p99 | load (1 min) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for variant in _present(results):
        r = results["variants"][variant]
        lo, hi = r["search"]["p50_range_ms"]
        loads = [x for pair in r["load_avg_1m"] for x in pair]
        lines.append(
            f"| {variant} | {r['spinning_openblas']} / {r['held_libraries']} | "
            f"{r['search']['p50_ms']} ({lo:.2f}–{hi:.2f}) / {r['search']['p99_ms']} | "
            f"{r.get('search_p50_vs_package_first', '')} | "
            + " | ".join(
                f"{r[row]['p50_ms']} / {r[row]['p99_ms']}"
                for row in ("end_to_end", "encode", "rerank")
            )
            + f" | {min(loads):.2f}–{max(loads):.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: pathlib.Path) -> None:
    from aligner_jax.evaluation import plotting

    plt = plotting.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = _present(results)
    for ax, row in zip(axes, ("search", "end_to_end"), strict=True):
        for i, name in enumerate(names):
            r = results["variants"][name][row]
            lo, hi = r["p50_range_ms"]
            ax.bar(i, r["p50_ms"], color=plotting.series_style(i)["color"])
            below, above = max(r["p50_ms"] - lo, 0.0), max(hi - r["p50_ms"], 0.0)  # rounding
            ax.errorbar(i, r["p50_ms"], yerr=[[below], [above]], color="k")
        ax.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=7)
        ax.set_ylabel(f"{row.replace('_', ' ')} p50 ms (children's range)")
    fig.suptitle(
        f"{pathlib.Path(results['dataset_dir']).name}, k = {results['k']}, "
        f"{results['threads']} threads: NumPy imported first, OpenBLAS held or free"
    )
    fig.tight_layout()
    plotting.save(fig, path)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CHILD.value:
        variant, out = _CHILD.value.split(",", 1)
        child(variant, out)
        return
    import result_files

    from aligner_jax.data import beir

    variants = tuple(_VARIANTS.value or VARIANTS)
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise app.UsageError(f"--variants: {unknown} not of {list(VARIANTS)}")
    f = flags.FLAGS
    queries = len(beir.load_beir(f.dataset_dir, split=f.split).queries)
    children = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(_CHILDREN.value):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for variant in order:
                print(f"round {r + 1}/{_CHILDREN.value}: {variant}", flush=True)
                children.append(run_child(variant, pathlib.Path(tmp)))
    results = {
        "command": " ".join(["benchmarks/import_order.py", *sys.argv[1:]]),
        "index_dir": f.index_dir,
        "dataset_dir": f.dataset_dir,
        "split": f.split,
        "queries": queries,
        "k": f.k,
        "threads": f.threads,
        "children": _CHILDREN.value,
        "rounds_per_child": f.rounds,
        "machine": result_files.machine(),
        "variants": summary(children),
    }
    folder = _OUTPUT_DIR.value or result_files.RESULTS
    path = result_files.save(results, f.output_name, markdown, plot, folder)
    print(f"wrote {path.with_suffix('')}.json, .md, .png")


if __name__ == "__main__":
    cli.run(main)
