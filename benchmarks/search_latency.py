r"""Search latency and quality against the peers, on the same token vectors, in one run.

    .venv/bin/python benchmarks/search_latency.py                       # SciFact + CISI, zero-shot
    .venv/bin/python benchmarks/search_latency.py \
      --stores=scifact:trained:outputs/trained_scifact_index --peer_python=/work/peer-venv/bin/python

Systems, each searching the token vectors of one aligner_jax token store (exported once for the
peers): ``aligner_jax`` (the compressed centroid index, ``Searcher`` with its defaults, built here
and timed), ``exact`` (MaxSim brute force in NumPy over float32 vectors: the quality ceiling of
top-1 alignment), ``fast-plaid`` (PyPI ``fast-plaid``) and ``xtr-warp`` (PyPI ``xtr-warp-rs``),
both at their default settings, run through ``benchmarks/peers/run_peer.py`` in their own
virtualenv (``benchmarks/peers/setup_peer_venv.sh``: they pin torch 2.11). A peer that fails
is recorded as a row with its error message.

Batch 1 (one query at a time), after one untimed warm-up query, with 1 and 2 BLAS/torch threads;
the systems are interleaved (round r: every system at every thread count) and latencies pooled
over ``--rounds`` (the peers and exact, slow on a CPU, run ``--peer_rounds`` of them). A peer
whose build fails (or exceeds ``--peer_time_limit_s``) is recorded once with its error. Query encoding at batch 1 is timed separately. Writes
``benchmarks/results/search_latency.{json,md,png}`` (``--replot`` redraws the .md and .png from
the .json); the JSON is ``{"rows": [...], "query_encoding":
[...], "machine": ...}`` with one row per (system, setting, model, dataset, threads).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import resource
import subprocess
import time
from pathlib import Path

import numpy as np
import threadpoolctl
from absl import app, flags, logging

from aligner_jax.common import cli, fileio
from aligner_jax.data import beir
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import Encoder, EncodingConfig
from aligner_jax.evaluation import metrics, plotting
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import indexer
from aligner_jax.indexing import token_store as ts
from aligner_jax.retrieval import searcher as search_lib

REPO = Path(__file__).resolve().parents[1]
SYSTEMS = (
    "aligner_jax", "aligner_jax-xtr", "aligner_jax-nosal", "exact", "fast-plaid", "xtr-warp"
)  # fmt: skip
#: Our variants: the row's system and setting (the JSON's ``system`` is one of the four engines).
OURS = {
    "aligner_jax": ("aligner_jax", "default"),
    "aligner_jax-xtr": ("aligner_jax", "xtr scorer (f_XTR', WARP-style)"),
    "aligner_jax-nosal": ("aligner_jax", "salience off (ColBERT sum of maxima)"),
}

_STORES = flags.DEFINE_list(
    "stores",
    [
        "scifact:zero_shot:outputs/zero_shot_scifact/index",
        "cisi:zero_shot:outputs/zero_shot_cisi/index",
    ],
    "DATASET:MODEL:INDEX_DIR; a missing zero_shot store is built with models/minilm_identity.gin.",
)
_DATA_ROOT = flags.DEFINE_string(
    "data_root", "../shared/data/beir", "BEIR folders by dataset name."
)
_SYSTEMS = flags.DEFINE_list("systems", list(SYSTEMS), f"Any of {SYSTEMS}.")
_THREADS = flags.DEFINE_list("threads", ["2", "1"], "Thread counts (peers build at the first).")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Interleaved rounds (latencies pooled).")
_K = flags.DEFINE_integer("k", 100, "Documents per query.")
_MAX_QUERIES = flags.DEFINE_integer("max_queries", None, "Only the first N queries.")
_PEER_ROUNDS = flags.DEFINE_integer("peer_rounds", 1, "Rounds of the peers and exact (slow).")
_PEER_PYTHON = flags.DEFINE_string("peer_python", "/work/peer-venv/bin/python", "Peers' Python.")
_PEER_TIME_LIMIT = flags.DEFINE_float("peer_time_limit_s", 2400, "Per peer run.")
_WORK_DIR = flags.DEFINE_string("work_dir", "/tmp/aligner_search_latency", "Exports, peer indexes.")
_REUSE_INDEX = flags.DEFINE_bool(
    "reuse_index",
    False,
    "Load our search index if it has the default settings, and the peers' finished indexes "
    "(each build's recorded time is reported).",
)
_MERGE = flags.DEFINE_list(
    "merge", [], "Only combine these result JSONs (separate runs) into --out."
)
_OUT = flags.DEFINE_string("out", str(REPO / "benchmarks/results/search_latency"), "Output prefix.")
_REPLOT = flags.DEFINE_bool("replot", False, "Only redraw --out's .md and .png from its .json.")


def _resolve(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() or p.exists() else REPO / p


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _encoder(index_dir: Path) -> Encoder:
    spec = json.loads((index_dir / indexer.ENCODER_FILE).read_text())
    return search_lib.whole_query_encoder(loading.encoder_from_spec(spec))


def _ensure_store(dataset: beir.BeirDataset, model: str, index_dir: Path) -> None:
    if (index_dir / ts.MANIFEST).exists():
        return
    if model != "zero_shot":
        raise app.UsageError(f"{index_dir}: no store; build it with aligner-index first")
    cli.parse_gin(["models/minilm_identity.gin"])
    encoder = Encoder(loading.load_encoder(), EncodingConfig())
    corpus = Path(dataset.path) / "corpus.jsonl"
    info = {"path": str(Path(dataset.path).resolve()), "sha256": fileio.sha256_file(corpus)}
    indexer.build_token_store(dataset.corpus.values(), encoder, index_dir, corpus_info=info)


def _export(store: ts.TokenStore, qids, encoded, out: Path) -> Path:
    """The peers' input folder: the store's vectors and our encoded queries."""
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "done").exists():
        np.save(out / "doc_vectors.npy", np.asarray(store.vectors(), np.float16))
        np.save(out / "doc_offsets.npy", store.offsets.astype(np.int64))
        (out / "doc_ids.json").write_text(json.dumps(store.doc_ids))
    np.save(
        out / "query_vectors.npy", np.concatenate([e.vectors for e in encoded]).astype(np.float16)
    )
    q_off = np.concatenate([[0], np.cumsum([len(e.vectors) for e in encoded])]).astype(np.int64)
    np.save(out / "query_offsets.npy", q_off)
    (out / "query_ids.json").write_text(json.dumps(list(qids)))
    (out / "done").write_text("ok")
    return out


def _timed_queries(fn, items) -> tuple[dict, list[float]]:
    fn(*items[0])  # warm-up, untimed
    results, latency = {}, []
    for qid, e in items:
        t = time.perf_counter()
        results[qid] = fn(qid, e)
        latency.append(1000.0 * (time.perf_counter() - t))
    return results, latency


class ExactMaxSim:
    """Top-1 alignment (sum of max, normalised by the number of query tokens) over every token."""

    def __init__(self, store: ts.TokenStore, k: int):
        self.vectors = np.asarray(store.vectors(), np.float32)
        self.starts = store.offsets[:-1]
        self.ids = store.doc_ids
        self.k = k

    def __call__(self, qid, e) -> dict[str, float]:
        best = np.maximum.reduceat(e.vectors @ self.vectors.T, self.starts, axis=1)
        scores = best.mean(0)
        top = np.argpartition(-scores, self.k - 1)[: self.k]
        return {self.ids[i]: float(scores[i]) for i in top}


def _peer(system, vectors, work, threads, k, max_queries, reuse) -> dict:
    out = work / f"{system}-t{threads}-{time.time_ns()}.json"
    cmd = [
        _PEER_PYTHON.value, str(REPO / "benchmarks/peers/run_peer.py"), f"--system={system}",
        f"--vectors={vectors}", f"--work_dir={work / system}", f"--threads={threads}",
        f"--k={k}", f"--out={out}", f"--time_limit_s={_PEER_TIME_LIMIT.value}",
    ]  # fmt: skip
    if reuse:
        cmd.append("--reuse_index")
    if max_queries:
        cmd.append(f"--max_queries={max_queries}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if not out.exists():
        return {"error": f"run_peer.py exited {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    return json.loads(out.read_text())


def _row(system, setting, model, dataset, threads, qrels, results, latency, **extra) -> dict:
    # A peer stopped by its time limit answered only some queries: its metrics are over those
    # (``num_queries`` says how many), not over every judged query with zeros for the rest.
    answered = {q: judged for q, judged in qrels.items() if q in results}
    ev = metrics.evaluate_run(answered, results, k_values=(10, 100)) if results else None
    return {
        "system": system,
        "setting": setting,
        "model": model,
        "dataset": dataset,
        "ndcg@10": ev.aggregate["ndcg@10"] if ev else None,
        "recall@100": ev.aggregate["recall@100"] if ev else None,
        "p50_ms": float(np.percentile(latency, 50)) if latency else None,
        "p90_ms": float(np.percentile(latency, 90)) if latency else None,
        "threads": threads,
        "num_queries": len(results),
        **extra,
    }


def bench_store(dataset_name: str, model: str, index_dir: Path, rows: list, encodings: list):
    dataset = beir.load_beir(_resolve(_DATA_ROOT.value) / dataset_name)
    _ensure_store(dataset, model, index_dir)
    store = ts.TokenStore(index_dir)
    encoder = _encoder(index_dir)
    qids = [q for q in dataset.queries if q in dataset.qrels][: _MAX_QUERIES.value]
    encoder.encode([dataset.queries[qids[0]]], "query")  # compile
    enc_ms, encoded = [], []
    for q in qids:
        t = time.perf_counter()
        encoded.append(encoder.encode([dataset.queries[q]], "query")[0])
        enc_ms.append(1000.0 * (time.perf_counter() - t))
    encodings.append(
        {"dataset": dataset_name, "model": model, "p50_ms": float(np.percentile(enc_ms, 50)),
         "p90_ms": float(np.percentile(enc_ms, 90)), "batch": 1}
    )  # fmt: skip
    items = list(zip(qids, encoded, strict=True))
    systems = _SYSTEMS.value
    work = _resolve(_WORK_DIR.value) / f"{dataset_name}-{model}"
    vectors = (
        _export(store, qids, encoded, work / "vectors")
        if {"fast-plaid", "xtr-warp"} & set(systems)
        else None
    )
    built = {}
    if set(OURS) & set(systems):
        index = None
        if _REUSE_INDEX.value and ci.CentroidIndex.exists(index_dir):
            index = ci.CentroidIndex.load(store)
            if index.meta["config"] != dataclasses.asdict(ci.CentroidIndexConfig()):
                index = None  # built with other settings: rebuild
        if index is None:
            index = ci.CentroidIndex.build(store)
        # the build's own measurement (k-means + compression + inverted file), recorded in its meta
        built["aligner_jax"] = (index.meta["updates"][0]["seconds"], index.nbytes())
        searcher = search_lib.Searcher(
            store, search_lib.SearchConfig(backend="centroid", top_k=_K.value), centroid_index=index
        )

        xtr_searcher = search_lib.Searcher(
            store,
            search_lib.SearchConfig(backend="centroid", refine="xtr", top_k=_K.value),
            centroid_index=index,
        )
        built["aligner_jax-xtr"] = built["aligner_jax-nosal"] = built["aligner_jax"]
        nosal_searcher = search_lib.Searcher(
            store,
            search_lib.SearchConfig(backend="centroid", top_k=_K.value, salience=False),
            centroid_index=index,
        )

        def ours(qid, e):
            return searcher.run([qid], [e], show_progress=False).results["top_k:1"][qid]

        def ours_xtr(qid, e):  # f_XTR' on the compressed index, WARP-style
            return xtr_searcher.run([qid], [e], show_progress=False).results["xtr"][qid]

        def ours_nosal(qid, e):  # u^q = u^d = 1: the peers' and exact's scoring
            return nosal_searcher.run([qid], [e], show_progress=False).results["top_k:1"][qid]

        fns = {"aligner_jax": ours, "aligner_jax-xtr": ours_xtr, "aligner_jax-nosal": ours_nosal}

    exact = ExactMaxSim(store, _K.value) if "exact" in systems else None
    pooled: dict = {}
    failed: set[str] = set()
    for r in range(_ROUNDS.value):
        for threads in [int(t) for t in _THREADS.value]:
            for system in systems:
                logging.info(
                    "%s/%s round %d: %s with %d threads", dataset_name, model, r, system, threads
                )
                key = (system, threads)
                if system == "exact" and r >= _PEER_ROUNDS.value:
                    continue
                if system in OURS or system == "exact":
                    fn = exact if system == "exact" else fns[system]
                    with threadpoolctl.threadpool_limits(threads):
                        res, lat = _timed_queries(fn, items)
                    entry = pooled.setdefault(key, {"results": res, "latency": [], "extra": {}})
                    entry["latency"] += lat
                    continue
                if r >= _PEER_ROUNDS.value or system in failed:
                    continue
                first = system not in built
                reuse = _REUSE_INDEX.value or not first  # a finished build records itself
                out = _peer(system, vectors, work, threads, _K.value, _MAX_QUERIES.value, reuse)
                if first:
                    built[system] = (out.get("build_s"), out.get("index_bytes"))
                    if out.get("error") and out.get("build_s") is None:
                        failed.add(system)  # no index: the other thread counts would rebuild
                        entry = pooled.setdefault(key, {"results": {}, "latency": [], "extra": {}})
                        entry["extra"] = {
                            "error": out["error"],
                            "peak_rss_bytes": out.get("peak_rss_bytes"),
                        }
                        continue
                res = {q: {d: s for d, s in v} for q, v in (out.get("results") or {}).items()}
                entry = pooled.setdefault(key, {"results": res, "latency": [], "extra": {}})
                entry["latency"] += out.get("latency_ms") or []
                entry["extra"] = {
                    "error": out.get("error"),
                    "peak_rss_bytes": out.get("peak_rss_bytes"),
                    "params": out.get("params"),
                }
    qrels = {q: dataset.qrels[q] for q in qids}  # the queries searched (all, or --max_queries)
    for (system, threads), entry in pooled.items():
        build_s, index_bytes = built.get(system, (None, None))
        if system == "exact":
            build_s, index_bytes = 0.0, store.num_tokens * store.dim * 2
        extra = {"peak_rss_bytes": _peak_rss(), "error": None, **entry["extra"]}
        name, setting = OURS.get(system, (system, "default"))
        rows.append(
            _row(name, setting, model, dataset_name, threads, qrels, entry["results"], entry["latency"],
                 build_s=build_s, index_bytes=index_bytes,
                 bytes_per_token=(index_bytes / store.num_tokens) if index_bytes else None,
                 num_tokens=store.num_tokens, dim=store.dim, **extra)
        )  # fmt: skip


def markdown(payload: dict) -> str:
    lines = [
        "# Search latency against the peers (batch 1, CPU)",
        "",
        f"Machine: {payload['machine']}. Same token vectors for every system; query encoding "
        "excluded (below). nDCG@10 / R@100 ×100; p50/p90 ms per query.",
        "",
        "| dataset | model | system | setting | threads | nDCG@10 | R@100 | p50 ms | p90 ms | build s | bytes/token | error |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda x, f: "—" if x is None else format(x, f)  # noqa: E731
    for r in payload["rows"]:
        lines.append(
            f"| {r['dataset']} | {r['model']} | {r['system']} | {r.get('setting', '')} | {r['threads']} | "
            f"{fmt(r['ndcg@10'] and 100 * r['ndcg@10'], '.1f')} | "
            f"{fmt(r['recall@100'] and 100 * r['recall@100'], '.1f')} | {fmt(r['p50_ms'], '.1f')} | "
            f"{fmt(r['p90_ms'], '.1f')} | {fmt(r['build_s'], '.1f')} | "
            f"{fmt(r['bytes_per_token'], '.0f')} | {(r.get('error') or '')[:120]} |"
        )
    lines += ["", "Query encoding (batch 1):", ""]
    for e in payload["query_encoding"]:
        lines.append(
            f"- {e['dataset']}/{e['model']}: p50 {e['p50_ms']:.1f} ms, p90 {e['p90_ms']:.1f} ms"
        )
    return "\n".join(lines) + "\n"


_NOTE_MARKS = "*†‡§¶"


def _notes(rows: list[dict]) -> dict[str, str]:
    """A footnote mark for each run note ('default (quiet re-run)' → 'quiet re-run')."""
    notes = dict.fromkeys(_note(r["setting"]) for r in rows)
    notes.pop("", None)
    return {note: _NOTE_MARKS[i % len(_NOTE_MARKS)] for i, note in enumerate(notes)}


def _label(row: dict, notes: dict[str, str]) -> str:
    """'system ×threads', with the footnote mark of the run's note if it has one."""
    return f"{row['system']} ×{row['threads']}" + notes.get(_note(row["setting"]), "")


def _note(setting: str) -> str:
    """A run's note: 'default (quiet re-run)' → 'quiet re-run', 'default' → '', others as is."""
    note = setting.removeprefix("default").strip()
    return note[1:-1] if note.startswith("(") and note.endswith(")") else note


def _first_line(text: str, width: int) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= width else line[: width - 1] + "…"


def figure(payload: dict):
    """One panel per (dataset, model): nDCG@10 against p50 latency (log), every system's point
    labelled ('system ×threads', a footnote mark for a run's note; filled: the most threads,
    hollow: fewer), a y range of at least 2 nDCG points (so equal systems look equal), and the
    systems without a result named with their error."""
    plt = plotting.pyplot()
    groups = sorted({(r["dataset"], r["model"]) for r in payload["rows"]})
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.8), squeeze=False)
    markers = {"aligner_jax": "o", "exact": "s", "fast-plaid": "^", "xtr-warp": "D"}
    colors = {s: f"C{i}" for i, s in enumerate(SYSTEMS)}
    panels = []
    for ax, (dataset, model) in zip(axes[0], groups, strict=True):
        rows = [r for r in payload["rows"] if (r["dataset"], r["model"]) == (dataset, model)]
        done = [r for r in rows if r["p50_ms"] is not None]
        top_threads = max((r["threads"] for r in rows), default=0)
        for r in done:
            color = colors.get(r["system"], "k")
            ax.plot(r["p50_ms"], 100 * r["ndcg@10"], linestyle="none",
                    marker=markers.get(r["system"], "x"), color=color, markersize=8,
                    markerfacecolor=color if r["threads"] == top_threads else "none")  # fmt: skip
        ax.set_xscale("log")
        plotting.plain_log_axis(ax.xaxis)
        ys = [100 * r["ndcg@10"] for r in done] or [0.0]
        mid, half = (max(ys) + min(ys)) / 2, max(1.0, 0.6 * (max(ys) - min(ys)))
        ax.set_ylim(mid - half, mid + half)
        ax.margins(x=0.15)
        xs = [r["p50_ms"] for r in done]
        if xs and max(xs) < 5 * min(xs):  # at least a decade and a half: ticks, honest spread
            centre = (max(xs) * min(xs)) ** 0.5
            ax.set_xlim(centre / 5.6, centre * 5.6)
        ax.set_xlabel("p50 ms per query (batch 1, log scale)")
        ax.set_ylabel("nDCG@10 (×100)")
        ax.set_title(f"{dataset} / {model}", fontsize=10)
        ax.grid(True, alpha=0.3)
        notes = _notes(rows)
        lines = [f"{mark} {note}" for note, mark in notes.items()]
        lines += [
            f"no result: {_label(r, notes)}: {_first_line(r.get('error') or '', 100)}"
            for r in rows
            if r["p50_ms"] is None
        ]
        if lines:
            ax.text(0.01, 0.01, "\n".join(lines), transform=ax.transAxes, fontsize=6.5, va="bottom")
        panels.append((ax, done, notes))

    fig.suptitle(f"Search latency and quality (k={payload.get('k', '?')})", fontsize=11)
    fig.tight_layout()
    for ax, done, notes in panels:
        plotting.annotate_points(
            ax,
            [r["p50_ms"] for r in done],
            [100 * r["ndcg@10"] for r in done],
            [_label(r, notes) for r in done],
        )
    return fig


def plot(payload: dict, path: Path) -> None:
    plotting.save(figure(payload), path, dpi=120)


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    for s in _SYSTEMS.value:
        if s not in SYSTEMS:
            raise app.UsageError(f"--systems: {s!r} is not one of {SYSTEMS}")
    if _REPLOT.value:
        out = _resolve(_OUT.value)
        payload = json.loads(out.with_suffix(".json").read_text())
        fileio.atomic_write_text(out.with_suffix(".md"), markdown(payload))
        plot(payload, out.with_suffix(".png"))
        print(f"wrote {out}.md, .png")
        return
    rows, encodings = [], []
    if _MERGE.value:
        parts = [json.loads(_resolve(p).read_text()) for p in _MERGE.value]
        rows = [r for p in parts for r in p["rows"]]
        encodings = [e for p in parts for e in p["query_encoding"]]
    for spec in [] if _MERGE.value else _STORES.value:
        try:
            dataset_name, model, index_dir = spec.split(":", 2)
        except ValueError:
            raise app.UsageError(f"--stores={spec!r}: expected DATASET:MODEL:INDEX_DIR") from None
        bench_store(dataset_name, model, _resolve(index_dir), rows, encodings)
    payload = {
        "rows": rows,
        "query_encoding": encodings,
        "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.platform()}",
        "rounds": _ROUNDS.value,
        "k": _K.value,
    }
    out = _resolve(_OUT.value)
    out.parent.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_json(out.with_suffix(".json"), payload, sort_keys=False)
    fileio.atomic_write_text(out.with_suffix(".md"), markdown(payload))
    plot(payload, out.with_suffix(".png"))
    print(markdown(payload))
    print(f"wrote {out}.json, .md, .png")


if __name__ == "__main__":
    app.run(main)
