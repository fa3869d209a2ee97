r"""What a metadata filter costs at scale: its SQL over ``documents.sqlite``, first run and
repeated (the table's mask cache, ``documents.MASK_CACHE_BYTES``).

    .venv/bin/python benchmarks/filter_cost.py --docs=100000,1000000

For each size, a synthetic ``documents.sqlite`` (no text: ``IndexingConfig.store_text=False``;
metadata ``{"year": int, "tags": [two of 20], "source": "a" | "b" | null}``, seeded) is written
in shards of 50,000 through the project's writer (``documents.write_shard``). Each filter is then
timed as a search would pay it (``DocumentTable.mask``): first on a fresh table (the SQL, a
full scan of the metadata JSON; median of --repeats fresh tables), then repeated on one table
(the kept mask). Latency of the rest of the search is not included (``filtered_search.py``
measures it on SciFact). Writes ``<output>/<name>.{json,md,png}`` (``benchmarks/results``); the tables stay
under --work_dir (delete them after).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from absl import app, flags

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import result_files  # noqa: E402

from aligner_jax.indexing import documents  # noqa: E402

_DOCS = flags.DEFINE_list("docs", ["100000", "1000000"], "Table sizes (documents).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timings per filter and mode (median kept).")
_WORK_DIR = flags.DEFINE_string("work_dir", "/tmp/filter_cost", "Where the tables are written.")
_OUTPUT = flags.DEFINE_string("output", str(REPO / "benchmarks" / "results"), "Results folder.")
_NAME = flags.DEFINE_string("name", "filter_cost", "Result files <output>/<name>.*")

SHARD = 50_000
FILTERS = {
    "range": {"year": {"gte": 2015}},
    "list element": {"tags": "t1"},
    "list range": {"tags": {"gte": "t5", "lt": "t7"}},
    "ne (keeps null)": {"source": {"ne": "a"}},
    "in (10 values)": {"year": {"in": list(range(2000, 2010))}},
    "two fields": {"year": {"gte": 2015}, "source": "b"},
}


def table(num_docs: int) -> tuple[Path, list[dict]]:
    """The synthetic documents table of ``num_docs`` (written once per work_dir)."""
    folder = Path(_WORK_DIR.value) / str(num_docs)
    shards = [
        {"index": s // SHARD, "num_docs": min(SHARD, num_docs - s)}
        for s in range(0, num_docs, SHARD)
    ]
    if not (folder / documents.FILE).exists():
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        for shard in shards:
            start = shard["index"] * SHARD
            rows = [
                documents.IndexDocument(
                    f"d{i}",
                    "",
                    "",
                    {
                        "year": int(1990 + rng.integers(35)),
                        "tags": [f"t{rng.integers(20)}", f"t{rng.integers(20)}"],
                        "source": ["a", "b", None][i % 3],
                    },
                )
                for i in range(start, start + shard["num_docs"])
            ]
            documents.write_shard(folder, shard["index"], rows, store_text=False)
            print(f"{num_docs:,} documents: wrote shard {shard['index']}", flush=True)
    return folder, shards


def timed_mask_ms(table: documents.DocumentTable, filter: dict) -> float:
    start = time.perf_counter()
    table.mask(filter)
    return 1000 * (time.perf_counter() - start)


def measure(num_docs: int) -> list[dict]:
    folder, shards = table(num_docs)
    rows = []
    for name, filter in FILTERS.items():
        first = [
            timed_mask_ms(documents.DocumentTable(folder, shards), filter)
            for _ in range(_REPEATS.value)
        ]
        kept = documents.DocumentTable(folder, shards)
        passing = int(kept.mask(filter).sum())
        again = [timed_mask_ms(kept, filter) for _ in range(_REPEATS.value)]
        rows.append(
            {
                "docs": num_docs,
                "filter_name": name,
                "filter": filter,
                "passing_docs": passing,
                "first_ms": statistics.median(first),
                "repeated_ms": statistics.median(again),
                "machine_load": os.getloadavg()[0],
            }
        )
        print(rows[-1], flush=True)
    return rows


def markdown(results: dict) -> str:
    lines = [
        "# Metadata filter cost (`benchmarks/filter_cost.py`)",
        "",
        f"{results['machine']}; median of {results['repeats']} timings each; SQLite "
        f"{results['sqlite']}. First: a fresh table runs the filter's SQL; repeated: the same "
        "filter on the same table (its kept mask).",
        "",
        "| documents | filter | passing | first ms | repeated ms | load |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['docs']:,} | {r['filter_name']} `{r['filter']}` | {r['passing_docs']:,} | "
            f"{r['first_ms']:.1f} | {r['repeated_ms']:.3f} | {r['machine_load']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    from aligner_jax.evaluation import plotting

    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in FILTERS:
        rows = [r for r in results["rows"] if r["filter_name"] == name]
        ax.plot([r["docs"] for r in rows], [r["first_ms"] for r in rows], "o-", label=name)
    rows = results["rows"]
    ax.plot(
        sorted({r["docs"] for r in rows}),
        [
            max(r["repeated_ms"] for r in rows if r["docs"] == n)
            for n in sorted({r["docs"] for r in rows})
        ],
        "k--",
        label="repeated (any filter, max)",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("documents")
    ax.set_ylabel("ms per filter")
    ax.set_title("Metadata filter: SQL on first use, kept mask when repeated", fontsize=10)
    ax.legend(fontsize=7)
    plotting.save(fig, path)


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import sqlite3

    results = {
        "machine": result_files.machine(),
        "sqlite": sqlite3.sqlite_version,
        "repeats": _REPEATS.value,
        "rows": [row for n in _DOCS.value for row in measure(int(n))],
    }
    path = result_files.save(results, _NAME.value, markdown, plot, _OUTPUT.value)
    print(f"wrote {path}, .md, .png; tables under {_WORK_DIR.value}")


if __name__ == "__main__":
    app.run(main)
