r"""End-to-end query latency after ``Searcher.load``, with no compilation (issue 27 item 4).

  .venv/bin/python benchmarks/e2e_latency.py \
      [--index_dir=outputs/zero_shot_scifact/index] [--dataset_dir=../shared/data/beir/scifact] \
      [--gin.CentroidSearchConfig.residual_candidates=True ...]

Opens the index with ``Searcher.load`` (which compiles every shape a single query takes:
``retrieval.refine.warm_up``; its cost is measured) and then, one query at a time, over the
split's queries, ``--rounds`` times, at ``--threads`` BLAS threads (the machine's 2 cores run
XLA):

  * end to end: ``searcher.search(text, k=--k)`` (tokenize, encode, centroid search, hits);
  * encoding alone: ``searcher.encoder.encode([text], "query")``;
  * search alone: ``searcher.search_vectors`` of the query encoded before timing (k=--k);
  * rerank: ``searcher.rerank`` of ``--rerank_candidates`` documents per query (the query's own
    top documents, found before timing), the query encoded before timing; also over the rounds
    after the first alone: the first round reads each candidate's float vectors from the
    memory-mapped token store for the first time, which a search without float refinement
    (a model without saliences) never did — on a cold page cache, reads from disk (stop 62: the
    zero-shot SciFact store's first reranks took 370 / 168 / 100 ms after its vector files were
    dropped from the page cache, 39 / 22 / 22 ms with them cached).

``--gin.CentroidSearchConfig.*`` bindings (or ``--gin_file``) set the fast mode's search rules (an
operating point ``search_latency.py`` chose, say); the report records the rules used.
``--mode``: ``fast`` (the compressed centroid index, on the host CPU), ``exhaustive`` (every
document refined, one device) or ``device`` (``Searcher.load(..., mode="device")``: the exact
search with the documents resident on the accelerators of a mesh — on a GPU host, the whole
query path on the GPU; stop 38's run named it ``--mode=mesh``).

These four run one after the other for each query, as a caller would run them; then, after the
rounds, one more pass encodes every query back to back with nothing in between ("encoding, back
to back"): a gap between the two encoding rows is what a search costs the encoding after it
(stop 44: OpenBLAS's workers spinning after the search's BLAS calls, ~4.5 ms at p50, until the
package set ``OPENBLAS_THREAD_TIMEOUT``).

Every XLA compilation during the timed loops is counted with JAX's monitoring hooks
(``aligner_jax.common.compilations``; a persistent-cache hit counts too); the goal is 0. Writes
``benchmarks/results/--output_name.{json,md,png}`` with p50/p90/p99 (ms), the warm-up cost and
the machine's load average before and after.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pathlib
import platform
import sys
import time
from collections.abc import Sequence

from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# first: the package sets OpenBLAS's environment, which counts only before NumPy loads
importlib.import_module("aligner_jax")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import threadpoolctl  # noqa: E402

from aligner_jax.common import cli, compilations, fileio  # noqa: E402
from aligner_jax.data import beir  # noqa: E402
from aligner_jax.evaluation import plotting  # noqa: E402
from aligner_jax.retrieval import refine  # noqa: E402
from aligner_jax.retrieval import searcher as search_lib  # noqa: E402

_INDEX_DIR = flags.DEFINE_string(
    "index_dir", str(REPO / "outputs" / "zero_shot_scifact" / "index"), "Index to search."
)
_DATASET_DIR = flags.DEFINE_string(
    "dataset_dir", str(REPO.parent / "shared" / "data" / "beir" / "scifact"), "BEIR folder."
)
_SPLIT = flags.DEFINE_string("split", "test", "Queries of this qrels split.")
_THREADS = flags.DEFINE_integer("threads", 2, "BLAS threads (threadpoolctl).", lower_bound=1)
_K = flags.DEFINE_integer("k", 10, "Documents per search.", lower_bound=1)
_RERANK = flags.DEFINE_integer("rerank_candidates", 100, "Documents per rerank.", lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Passes over the queries.", lower_bound=1)
_MODE = flags.DEFINE_enum(
    "mode",
    "fast",
    ["fast", "exhaustive", "device"],
    "Searcher.load mode (device: exact, on devices).",
)
_OUTPUT_NAME = flags.DEFINE_string("output_name", "e2e_latency", "benchmarks/results/NAME.*")


def percentiles(ms: Sequence[float]) -> dict:
    a = np.asarray(ms, np.float64)
    return {
        "n": int(a.size),
        "p50_ms": round(float(np.percentile(a, 50)), 3),
        "p90_ms": round(float(np.percentile(a, 90)), 3),
        "p99_ms": round(float(np.percentile(a, 99)), 3),
        "max_ms": round(float(a.max()), 3),
    }


def token_percentiles(counts: Sequence[int]) -> dict:
    """``percentiles`` of a count (query tokens), its keys without the ``_ms`` of a time."""
    return {k.removesuffix("_ms"): v for k, v in percentiles(counts).items()}


def timed(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return 1000.0 * (time.perf_counter() - start)


def load_with_warm_up(index_dir: str, mode: str = "fast") -> tuple[search_lib.Searcher, dict]:
    """``Searcher.load``, recording what its warm-up did and what compiling cost."""
    infos: list[dict] = []
    original = refine.warm_up

    def recording(*args, **kwargs):
        infos.append(original(*args, **kwargs))
        return infos[-1]

    refine.warm_up = recording
    try:
        with compilations.counting() as counter:
            start = time.perf_counter()
            searcher = search_lib.Searcher.load(index_dir, mode=mode)
            load_s = time.perf_counter() - start
    finally:
        refine.warm_up = original
    (info,) = infos
    return searcher, {
        "load_s": round(load_s, 3),
        "warm_up_s": round(info["seconds"], 3),
        "query_buckets": info["query_buckets"],
        "refine_shapes": info["refine_shapes"],
        "compilations_at_load": counter.count,
        "compile_s_at_load": round(counter.seconds, 3),
    }


def measure(searcher, queries: dict[str, str], k: int, rerank_n: int, rounds: int) -> dict:
    texts = list(queries.values())
    qids = list(queries)
    encoded = searcher.encoder.encode(texts, "query")
    candidates = {
        qid: [hit[0] for hit in searcher.search(text, k=rerank_n)]
        for qid, text in zip(qids, texts, strict=True)
    }
    e2e, encode, search, rerank = [], [], [], []
    with compilations.counting() as counter:
        for _ in range(rounds):
            for qid, text, enc in zip(qids, texts, encoded, strict=True):
                e2e.append(timed(searcher.search, text, k=k))
                encode.append(timed(searcher.encoder.encode, [text], "query"))
                search.append(
                    timed(searcher.search_vectors, enc.vectors, k=k, salience=enc.salience)
                )
                rerank.append(
                    timed(searcher.rerank, [qid], [enc], candidates, show_progress=False, k=k)
                )
        back_to_back = [timed(searcher.encoder.encode, [text], "query") for text in texts]
    return {
        "end_to_end": percentiles(e2e),
        "encode": percentiles(encode),
        "search": percentiles(search),
        "encode_back_to_back": percentiles(back_to_back),
        "rerank": {**percentiles(rerank), "candidates": rerank_n},
        "rerank_after_first_round": (
            {**percentiles(rerank[len(qids) :]), "candidates": rerank_n} if rounds > 1 else None
        ),
        "compilations_after_load": counter.count,
        "query_tokens": token_percentiles([len(e.token_ids) for e in encoded]),
        "by_query_tokens": by_query_tokens(
            [len(e.token_ids) for e in encoded] * rounds,
            {"end_to_end": e2e, "encode": encode, "search": search},
            searcher.encoder.config.bucket_lengths(searcher.encoder.maxlen("query"), "query"),
        ),
        "_samples": {
            "end_to_end": e2e,
            "encode": encode,
            "search": search,
            "encode_back_to_back": back_to_back,
            "rerank": rerank,
        },
    }


def by_query_tokens(lengths: Sequence[int], samples: dict, buckets: Sequence[int]) -> dict:
    """Percentiles of each of ``samples`` (name → ms, one per query and round, in the order of
    ``lengths``) per query length bucket of the encoder (where the tail comes from)."""
    lengths = np.asarray(lengths)
    out, low = {}, 1
    for high in buckets:
        chosen = np.flatnonzero((lengths >= low) & (lengths <= high))
        if len(chosen):
            out[f"{low}-{high}"] = {
                "samples": len(chosen),
                **{name: percentiles(np.asarray(ms)[chosen]) for name, ms in samples.items()},
            }
        low = high + 1
    return out


def markdown(report: dict) -> str:
    w, m = report["warm_up"], report["measured"]
    lines = [
        "# End-to-end latency after `Searcher.load` (no compilation)",
        "",
        f"`{report['command']}`",
        "",
        f"{report['dataset']} ({report['queries']} {report['split']} queries × {report['rounds']} "
        f"rounds), index `{report['index_dir']}`, mode `{report.get('mode', 'fast')}` on "
        f"{', '.join(sorted(set(report.get('devices', ['cpu']))))}, {report['threads']} threads; "
        f"{report['machine']}"
        f"; load average before {report['loadavg_before']}, after {report['loadavg_after']}; "
        f"nice {report['nice']}; OPENBLAS_THREAD_TIMEOUT "
        f"{report.get('openblas_thread_timeout')}.",
        "",
        f"Load {w['load_s']} s, of which warm-up {w['warm_up_s']} s: query buckets "
        f"{w['query_buckets']} and {w['refine_shapes']} refinement shapes "
        f"({w['compilations_at_load']} XLA compilations, {w['compile_s_at_load']} s compiling). "
        f"**Compilations after load: {m['compilations_after_load']}.**",
        "",
        "| what | n | p50 ms | p90 ms | p99 ms | max ms | goal |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    goals = {"end_to_end": "p99 ≤ 30 ms", "rerank": "p99 ≤ 50 ms"}
    names = {
        "end_to_end": f"end to end (encode + search, k={report['k']})",
        "encode": "query encoding alone",
        "search": f"search alone (the encoded query, k={report['k']})",
        "encode_back_to_back": "query encoding, back to back (after the rounds, one pass)",
        "rerank": f"rerank of {m['rerank']['candidates']} candidates",
        "rerank_after_first_round": "rerank, the rounds after the first (the store's pages read)",
    }
    for key, name in names.items():
        r = m.get(key)
        if r is None:  # a report written before this row existed
            continue
        lines.append(
            f"| {name} | {r['n']} | {r['p50_ms']} | {r['p90_ms']} | {r['p99_ms']} | "
            f"{r['max_ms']} | {goals.get(key, '')} |"
        )
    by_length = m.get("by_query_tokens")
    if by_length:
        lines += [
            "",
            "By query length (the encoder's buckets), p50 / p99 ms:",
            "",
            "| query tokens | samples | end to end | encoding | search alone |",
            "| --- | --- | --- | --- | --- |",
        ]
        for bucket, r in by_length.items():
            cells = " | ".join(
                f"{r[name]['p50_ms']} / {r[name]['p99_ms']}"
                for name in ("end_to_end", "encode", "search")
            )
            lines.append(f"| {bucket} | {r['samples']} | {cells} |")
    return "\n".join(lines) + "\n"


def plot(samples: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, ms in samples.items():
        a = np.sort(np.asarray(ms))
        ax.plot(a, np.arange(1, a.size + 1) / a.size, label=name.replace("_", " "))
    ax.set_xscale("log")
    plotting.plain_log_axis(ax.xaxis)
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel("fraction of queries")
    ax.axhline(0.99, color="grey", lw=0.5, ls=":")
    ax.legend()
    ax.set_title("After Searcher.load: latency CDF (0 compilations)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _stages(searcher, k: int) -> dict | None:
    """The fast mode's (probes, interaction, refined documents) at ``k`` (the automatic rules
    follow k), or None in the other modes."""
    if searcher.centroid is None:
        return None
    counts = searcher.centroid.counts(k)
    return dict(zip(("probes", "interaction_docs", "refine_docs"), counts, strict=True))


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    # the search rules' gin bindings; a bad one is one error line, no traceback
    cli.call_or_exit("e2e_latency.py", cli.parse_gin_flags)
    loadavg_before = [round(x, 2) for x in os.getloadavg()]
    dataset = beir.load_beir(_DATASET_DIR.value, split=_SPLIT.value)
    with threadpoolctl.threadpool_limits(_THREADS.value):
        searcher, warm = load_with_warm_up(_INDEX_DIR.value, _MODE.value)
        measured = measure(searcher, dataset.queries, _K.value, _RERANK.value, _ROUNDS.value)
    samples = measured.pop("_samples")
    report = {
        "command": " ".join(["benchmarks/e2e_latency.py", *sys.argv[1:]]),
        "dataset": dataset.name,
        "split": _SPLIT.value,
        "queries": len(dataset.queries),
        "rounds": _ROUNDS.value,
        "index_dir": _INDEX_DIR.value,
        "threads": _THREADS.value,
        "mode": _MODE.value,
        "devices": [str(d.device_kind) for d in jax.devices()],
        "k": _K.value,
        "search_config": (
            dataclasses.asdict(searcher.centroid.config) if searcher.centroid is not None else None
        ),
        "stages": _stages(searcher, _K.value),
        "warm_up": warm,
        "measured": measured,
        "machine": f"{os.cpu_count()} CPUs, {platform.platform()}, jax {jax.__version__}",
        "openblas_thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT"),  # see aligner_jax
        "nice": os.nice(0),  # < 0: run ahead of the machine's other jobs (a shared machine)
        "loadavg_before": loadavg_before,
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    out = REPO / "benchmarks" / "results" / _OUTPUT_NAME.value
    fileio.atomic_write_json(out.with_suffix(".json"), report, sort_keys=False)
    fileio.atomic_write_text(out.with_suffix(".md"), markdown(report))
    plot(samples, out.with_suffix(".png"))
    print(markdown(report))
    print(f"wrote {out}.json, .md, .png")


if __name__ == "__main__":
    cli.run(main)
