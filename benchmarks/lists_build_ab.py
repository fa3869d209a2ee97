r"""The token lists by position built at load, against the code they replaced, in fresh processes.

  .venv/bin/python benchmarks/lists_build_ab.py --index_dir=/work/scale_work/trained/x100 \
      [--rounds=3] [--output_name=lists_build_ab]

An index whose token lists are neither written nor small enough to copy
(``centroid_index.LISTS_IN_MEMORY_MAX``) gets them built by position when a search loads it
(``inverted_lists.token_rows_in_memory``): what load time is made of at scale (issue 23's
"load ≤ 5 s"). Three versions, the predecessor kept here verbatim in behaviour:

  * ``current`` (stop 74): each segment's codes read in runs of whole shards
    (``LOAD_BLOCK_TOKENS``), twice — one pass counts (``np.bincount``), one places each
    document's tokens (``_place_rows``), split by centroid between the ``--threads`` (2) the
    children run with; β^d's selection made once per shard and kept as a byte per token
    between the passes; the documents taken from the store's offsets.
  * ``one_thread``: the same, its placing pass in one thread.
  * ``stop73``: every shard read twice through ``_shard_tokens`` (its saliences and vectors
    mapped, β^d's selection made, each token's document found by ``searchsorted``), once to
    count and once to place, the index's codes released after every shard.

Each round starts one child per version, rotating which goes first; a child opens the store
and its search index, builds the lists once and reports the seconds (load of the store and the
index excluded); its peak RSS is measured from outside (``scale.run_child``). A last child
builds ``current`` and ``stop73`` and checks that every array is identical. The machine's load
average is recorded per child. Writes ``benchmarks/results/NAME.{json,md,png}``.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import platform
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np
from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from aligner_jax.common import fileio  # noqa: E402
from aligner_jax.indexing import inverted_lists as lists_lib  # noqa: E402

FLAGS = flags.FLAGS
VERSIONS = ("current", "one_thread", "stop73")


def stop73_token_rows_in_memory(store, codes, residuals, num_centroids: int, beta_d: float):
    """``inverted_lists.token_rows_in_memory`` as stop 73 left it (verbatim in behaviour)."""
    spans = store.shard_spans()
    token_starts = np.array([span[1] for span in spans], np.int64)
    doc_dtype = np.int32 if store.num_docs < 2**31 else np.int64
    out = []
    for k, segment in enumerate(residuals.arrays):
        start, stop = int(residuals.starts[k]), int(residuals.starts[k + 1])
        shards = range(*np.searchsorted(token_starts, [start, stop]).tolist())
        offsets = lists_lib._token_offsets(store, codes, shards, beta_d, num_centroids)
        size = int(offsets[-1])
        docs_out = np.empty(size, doc_dtype)
        rows_out = np.empty(size, np.int32 if stop - start < 2**31 else np.int64)
        cursor = offsets[:-1].copy()
        for i in shards:
            rows, cents, docs = lists_lib._shard_tokens(store, codes, spans[i], i, beta_d)
            first = spans[i][1] - start  # the shard's first row in the segment
            if lists_lib.numba is not None:
                _stop73_place_rows(cursor, cents, rows, first, docs, docs_out, rows_out)
            else:
                slots = lists_lib.run_slots(cursor, cents)
                docs_out[slots] = docs
                rows_out[slots] = rows + first
            codes.release()
        out.append(lists_lib.TokenLists(offsets, docs_out, np.asarray(segment), rows_out))
    return out


def _stop73_place_rows(cursor, cents, rows, first, docs, docs_out, rows_out):
    for t in range(len(cents)):
        c = cents[t]
        slot = cursor[c]
        cursor[c] = slot + 1
        docs_out[slot] = docs[t]
        rows_out[slot] = rows[t] + first


if lists_lib.numba is not None:
    _stop73_place_rows = lists_lib.numba.njit(cache=True, nogil=True)(_stop73_place_rows)

BUILDERS = {
    "current": lists_lib.token_rows_in_memory,
    "one_thread": functools.partial(lists_lib.token_rows_in_memory, threads=1),
    "stop73": stop73_token_rows_in_memory,
}


def _open(index_dir: str):
    from aligner_jax.indexing import centroid_index as ci
    from aligner_jax.indexing import token_store as ts

    store = ts.TokenStore(index_dir)
    index = ci.CentroidIndex.load(store)
    beta_d = index.meta["config"]["beta_d"]
    if any(g.get("order") == "clusters" for g in index.meta["segments"]):
        raise app.UsageError(  # stop 73's code places rows, not the positions of stop 75's
            f"--index_dir={index_dir}: its residuals are grouped by centroid (stop 75's "
            "cluster_order); compare the builds on an index in store order "
            "(--gin.CentroidIndexConfig.cluster_order=False)"
        )
    return store, (store, index.codes, index.residuals, index.num_centroids, beta_d)


def child(version: str, index_dir: str) -> None:
    """(child) Builds the lists by position once with ``version`` (``check``: both, compared);
    prints one JSON line."""
    store, args = _open(index_dir)
    if version == "check":
        got, want = (BUILDERS[v](*args) for v in ("current", "stop73"))
        same = len(got) == len(want) and all(
            np.array_equal(getattr(a, f), getattr(b, f))
            for a, b in zip(got, want, strict=True)
            for f in ("offsets", "docs", "rows")
        )
        print(json.dumps({"identical": bool(same), "segments": len(got)}))
        return
    start = time.perf_counter()
    lists = BUILDERS[version](*args)
    seconds = time.perf_counter() - start
    kept = sum(len(x.rows) for x in lists)
    print(json.dumps({"seconds": seconds, "kept_tokens": kept, "tokens": store.num_tokens,
                      "shards": len(store.shard_spans()), "segments": len(lists),
                      "lists_mb": sum(x.nbytes for x in lists) / 1e6}))  # fmt: skip


def markdown(report: dict) -> str:
    s = report["summary"]
    lines = [
        f"# Token lists by position built at load: {report['index_dir']}",
        "",
        f"{s['tokens']:,} tokens in {s['shards']:,} store shards, {s['kept_tokens']:,} kept; "
        f"{report['rounds']} interleaved rounds, fresh process per build; identical arrays: "
        f"{report['identical']}.",
        "",
        "| version | median s | min s | max s | peak RSS GiB (median) |",
        "|---|---|---|---|---|",
    ]
    for v in VERSIONS:
        lines.append(
            f"| {v} | {s[v]['median_s']:.2f} | {s[v]['min_s']:.2f} | {s[v]['max_s']:.2f} | "
            f"{s[v]['peak_rss_gib']:.2f} |"
        )
    lines += [
        "",
        f"stop73 / current (medians): **{s['speedup']:.2f}×**; one_thread / current: "
        f"{s['threads_speedup']:.2f}×",
        "",
    ]
    lines += ["| round | version | s | peak RSS GiB | load avg |", "|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(
            f"| {r['round']} | {r['version']} | {r['seconds']:.2f} | {r['peak_rss_gib']:.2f} | "
            f"{r['machine_load']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2.4))
    for i, v in enumerate(VERSIONS):
        seconds = [r["seconds"] for r in report["rows"] if r["version"] == v]
        ax.plot(seconds, [i] * len(seconds), "o", color=("tab:blue", "tab:cyan", "tab:gray")[i])
    ax.set_yticks(range(len(VERSIONS)), VERSIONS)
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds to build the lists by position (one dot per round)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def define_flags() -> None:
    flags.DEFINE_string("index_dir", None, "A token store with its search index.")
    flags.DEFINE_integer("rounds", 3, "Interleaved rounds (one child per version).", lower_bound=1)
    flags.DEFINE_string("output_name", "lists_build_ab", "benchmarks/results/NAME.*")
    flags.DEFINE_enum("child", None, list(VERSIONS) + ["check"], "(internal) run one build.")


def main(argv: Sequence[str]) -> None:
    import scale

    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.index_dir or not (pathlib.Path(FLAGS.index_dir) / "manifest.json").exists():
        raise app.UsageError(f"--index_dir={FLAGS.index_dir}: not a token store")
    if FLAGS.child:
        child(FLAGS.child, FLAGS.index_dir)
        return
    out = REPO / "benchmarks" / "results" / FLAGS.output_name
    log = pathlib.Path(tempfile.gettempdir()) / f"{out.name}.children.log"  # not a result
    base = [sys.executable, str(pathlib.Path(__file__).resolve()), f"--index_dir={FLAGS.index_dir}"]
    rows = []
    for r in range(FLAGS.rounds):
        for version in VERSIONS[r % len(VERSIONS) :] + VERSIONS[: r % len(VERSIONS)]:
            load = os.getloadavg()[0]
            result = scale.run_child(base + [f"--child={version}"], 2, log)
            rows.append({"round": r, "version": version, "machine_load": load, **result})
            print(rows[-1], flush=True)
    check = scale.run_child(base + ["--child=check"], 2, log)
    summary = {k: rows[0][k] for k in ("tokens", "shards", "kept_tokens", "segments")}
    for v in VERSIONS:
        seconds = [r["seconds"] for r in rows if r["version"] == v]
        summary[v] = {
            "median_s": float(np.median(seconds)),
            "min_s": min(seconds),
            "max_s": max(seconds),
            "peak_rss_gib": float(
                np.median([r["peak_rss_gib"] for r in rows if r["version"] == v])
            ),
        }
    summary["speedup"] = summary["stop73"]["median_s"] / summary["current"]["median_s"]
    summary["threads_speedup"] = summary["one_thread"]["median_s"] / summary["current"]["median_s"]
    report = {
        "command": " ".join(["benchmarks/lists_build_ab.py", *sys.argv[1:]]),
        "index_dir": FLAGS.index_dir,
        "rounds": FLAGS.rounds,
        "identical": check["identical"],
        "summary": summary,
        "rows": rows,
        "machine": f"{os.cpu_count()} CPUs, {platform.platform()}",
    }
    fileio.atomic_write_json(out.with_suffix(".json"), report, sort_keys=False)
    fileio.atomic_write_text(out.with_suffix(".md"), markdown(report))
    plot(report, out.with_suffix(".png"))
    print(markdown(report))
    print(f"wrote {out}.json, .md, .png (children's logs: {log})")


if __name__ == "__main__":
    define_flags()
    app.run(main)
