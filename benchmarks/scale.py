r"""Scale benchmark of the default search index (issue 23): SciFact grown s-fold with distractors.

For each scale s this writes a token store holding SciFact's real documents (the token store of
``--model``, unchanged, with its qrels) plus (s − 1)·N distractor documents whose tokens are real
token vectors drawn at random from the real documents, jittered at the scale of a residual and
re-normalised (lengths drawn from the real documents' lengths), through the project's public
writer (``TokenStoreWriter``). Then, each in a fresh process whose peak RSS is read from outside
(``os.wait4``'s rusage of the child):

  * **build**: ``aligner-index --index_dir=DIR --search_index`` (the default index; ``--bits``:
    the default residual bits and 2);
  * **search**: loads the store and its index (``load_s``, RSS after load from the kernel's
    ``VmRSS``), runs the fixed sample of test queries (encoded beforehand, once, in another
    process: query encoding is excluded) through the project's ``CentroidSearcher`` with its
    default settings, one query at a time, ``--threads`` BLAS threads, twice (the first round
    warms the caches; the second is timed: p50 / p99);
  * **exhaustive**: the same scoring (top-1 alignment, Eq. 1–2 with the model's saliences, or
    ColBERT's sum of maxima for a model without) over every stored float vector, streamed shard
    by shard: the ceiling the search is compared with (top-10 overlap, nDCG@10, Recall@100).

The jitter σ per dimension is the root mean square of the residual (token − its centroid) of the
1× index, per dimension: distractor tokens sit about as far from real tokens as real tokens sit
from their centroids.

  .venv/bin/python benchmarks/scale.py --model=trained --scales=1,10,30,100
  .venv/bin/python benchmarks/scale.py --model=zero_shot --scales=1,10,30 --bits=4,2
  .venv/bin/python benchmarks/scale.py --replot   # redraw .md / .png from scale.json

Writes ``OUTPUT_DIR/scale.json`` (rows merged with earlier runs by model, bits and scale),
``scale.md`` and ``scale.png``. Large stores live under ``--work_dir`` and are deleted after
each scale is measured (``--keep_stores`` keeps them).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# first: the package sets OpenBLAS's environment, which counts only before NumPy loads
importlib.import_module("aligner_jax")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DISTRACTOR = "distractor"  # the ids of distractor documents: DISTRACTOR-i
SOURCES = {
    "zero_shot": "outputs/zero_shot_scifact/index",
    "trained": "outputs/trained_scifact/index",
}


# -- stores ---------------------------------------------------------------------------------------
def residual_sigma(store_dir: Path, sample: int = 200_000, seed: int = 0) -> float:
    """Per-dimension RMS of the residuals of ``store_dir``'s search index (decoded)."""
    from aligner_jax.indexing import centroid_index as ci
    from aligner_jax.indexing import token_store as ts

    store = ts.TokenStore(store_dir)
    index = ci.CentroidIndex.load(store)
    sample = min(sample, store.num_tokens)
    rows = np.sort(np.random.default_rng(seed).choice(store.num_tokens, sample, replace=False))
    vectors = store.take("vectors", rows).astype(np.float32)
    codes = np.asarray(index.codes[rows], np.int64)
    residual = vectors - index.centroids[codes]
    return float(np.sqrt(np.mean(residual**2)))


def make_store(source_dir: Path, out: Path, scale: float, sigma: float, seed: int = 0) -> dict:
    """Writes the s-fold store (real documents first, then distractors) with the project's
    writer; copies ``encoder.json`` so that queries use the source's model."""
    from aligner_jax.indexing import token_store as ts

    source = ts.TokenStore(source_dir)
    if out.exists():
        shutil.rmtree(out)
    real = source_arrays(source)
    vectors, salience, token_ids = real
    shard_size = int(source.manifest["indexing"]["shard_size"])
    extra = int(round((scale - 1) * source.num_docs))
    start = time.perf_counter()
    with ts.TokenStoreWriter(out, source.manifest["model"], shard_size=shard_size) as writer:
        for i in range(source.num_docs):
            lo, hi = source.offsets[i], source.offsets[i + 1]
            writer.add(source.doc_ids[i], vectors[lo:hi], salience[lo:hi], token_ids[lo:hi])
        for doc in distractors(source, real, extra, sigma, seed, DISTRACTOR, shard_size):
            writer.add(doc.doc_id, doc.vectors, doc.salience, doc.token_ids)
    shutil.copy(source_dir / "encoder.json", out / "encoder.json")
    store = writer.store
    return {
        "tokens": store.num_tokens,
        "docs": store.num_docs,
        "write_s": time.perf_counter() - start,
        "store_bytes": store.nbytes(),
    }


def source_arrays(source) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The real store's vectors (float16), saliences and token ids, read whole (1.2M tokens)."""
    return (
        np.asarray(source.vectors()),
        np.asarray(source.salience()),
        np.asarray(source.token_ids()),
    )


def distractors(source, real, count: int, sigma: float, seed: int, prefix: str, batch: int):
    """``count`` distractor documents (``EncodedDocument``, ids ``PREFIX-i``): lengths drawn from
    the real documents', tokens real token vectors drawn at random, jittered by ``sigma`` per
    dimension and re-normalised, with the drawn tokens' saliences and ids; ``batch`` at a
    time."""
    from aligner_jax.common import progress
    from aligner_jax.indexing import token_store as ts

    vectors, salience, token_ids = real
    rng = np.random.default_rng(seed)
    bar = progress.Progress(count, f"{prefix} documents", "doc")
    for first in range(0, count, batch):
        n = min(batch, count - first)
        m = rng.choice(source.doc_lengths, n)
        rows = rng.integers(0, source.num_tokens, int(m.sum()))
        v = vectors[rows].astype(np.float32)
        noise = rng.standard_normal(size=v.shape, dtype=np.float32)  # float32: 2x faster
        noise *= sigma
        v += noise
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        v = v.astype(np.float16)
        cuts = np.concatenate([[0], np.cumsum(m)])
        for j in range(n):
            r = rows[cuts[j] : cuts[j + 1]]
            yield ts.EncodedDocument(
                f"{prefix}-{first + j}", v[cuts[j] : cuts[j + 1]], salience[r], token_ids[r]
            )
        bar.update(n)
    bar.close()


# -- children (fresh processes, peak RSS from outside) --------------------------------------------
GNU_TIME = Path("/usr/bin/time")
# where GNU time is missing: a small Python parent reports its child's peak in GNU time's words
_RUSAGE = (
    "import resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
    "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss; "
    "open(sys.argv[1], 'w').write(f'Maximum resident set size (kbytes): {peak}\\n'); "
    "sys.exit(rc)"
)


def run_child(cmd: list[str], threads: int, log: Path, platform: str = "cpu") -> dict:
    """Runs ``cmd`` in a fresh process with ``threads`` BLAS threads on JAX backend
    ``platform``; wall seconds, the child's peak RSS and its stdout's last JSON line. The peak
    is GNU time's (``/usr/bin/time -v``, the child of a small process; a small Python parent
    where GNU time is missing): a child forked straight from this (large) process would report
    this process's peak, which Linux carries into the child's ``ru_maxrss`` across exec."""
    env = dict(os.environ, JAX_PLATFORMS=platform)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    report = log.with_suffix(".time")
    if GNU_TIME.exists():
        timed = [str(GNU_TIME), "-v", "-o", str(report)] + cmd
    else:
        timed = [sys.executable, "-c", _RUSAGE, str(report)] + cmd
    start = time.perf_counter()
    with log.open("ab") as f:
        f.write(f"\n$ {' '.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.run(timed, stdout=subprocess.PIPE, stderr=f, env=env, cwd=REPO)
        f.write(proc.stdout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]}... exited {proc.returncode}: see {log}")
    peak_kib = next(
        int(line.split(":")[1])
        for line in report.read_text().splitlines()
        if "Maximum resident set size" in line
    )
    last = [line for line in proc.stdout.decode().splitlines() if line.startswith("{")]
    result = json.loads(last[-1]) if last else {}
    result.update(wall_s=wall, peak_rss_gib=peak_kib / 2**20)
    return result


def encode_queries(
    source_dir: Path, dataset_dir: Path, num_queries: int, out: Path, split: str = "test"
) -> None:
    """(child) Encodes a fixed sample of the queries of ``split`` (those with qrels there) with
    the store's own model."""
    from aligner_jax.data import beir
    from aligner_jax.encoding import loading
    from aligner_jax.indexing import token_store as ts
    from aligner_jax.retrieval import searcher as searcher_lib

    qrels = beir.load_qrels(dataset_dir / "qrels" / f"{split}.tsv")
    queries = beir.load_queries(dataset_dir / "queries.jsonl")
    ids = sorted(q for q in qrels if q in queries)
    rng = np.random.default_rng(0)
    ids = sorted(rng.choice(ids, min(num_queries, len(ids)), replace=False).tolist())
    spec = ts.read_json(source_dir / "encoder.json")
    encoder = searcher_lib.whole_query_encoder(loading.encoder_from_spec(spec))
    encoded = encoder.encode([queries[q] for q in ids], "query")
    lengths = [len(e.token_ids) for e in encoded]
    np.savez(
        out,
        ids=np.array(ids),
        offsets=np.concatenate([[0], np.cumsum(lengths)]),
        vectors=np.concatenate([e.vectors for e in encoded]).astype(np.float32),
        salience=np.concatenate([e.salience for e in encoded]).astype(np.float32),
    )
    print(json.dumps({"queries": len(ids)}))


def _queries(path: Path):
    z = np.load(path)
    o = z["offsets"]
    return [
        (str(q), z["vectors"][o[i] : o[i + 1]], z["salience"][o[i] : o[i + 1]])
        for i, q in enumerate(z["ids"])
    ]


def _rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def speed_probe(repeats: int = 9, seed: int = 0) -> dict:
    """The machine's speed just now, in ms (medians of ``repeats``): ``matmul``, a product the
    size of stage 1's centroid scores (16,384 × 128 float32 centroids against 32 query tokens)
    at the process's BLAS threads; ``stream``, a sum over 256 MiB, memory-bound. The machine is
    shared and its speed drifts between runs (a row's p50 was 91.8 ms at stop 80 and 25.0 ms
    at stop 81, both quiet, with the same code and index): rows measured apart compare only
    where their probes agree; comparisons that matter are interleaved in one process
    (``scale_ratio.py``, ``query_path_ab.py``)."""
    rng = np.random.default_rng(seed)
    centroids = rng.standard_normal((16_384, 128), np.float32)
    queries = rng.standard_normal((32, 128), np.float32)
    block = np.ones(1 << 26, np.float32)  # 256 MiB

    def median_ms(fn) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(1000.0 * (time.perf_counter() - t))
        return round(float(np.median(times)), 3)

    return {
        "matmul": median_ms(lambda: centroids @ queries.T),
        "stream": median_ms(lambda: float(block.sum())),
    }


def k10_path(rankings: Path) -> Path:
    """Where a search child writes the rankings of its k = 10 round."""
    return rankings.with_name(rankings.stem + "_k10.json")


def load_searcher(index_dir: Path, config: dict | None = None):
    """The project's ``CentroidSearcher`` over a store and its search index, ``config`` the
    ``CentroidSearchConfig`` fields overridden; the token lists mapped, or built in memory, at
    load (as ``Searcher.load`` does)."""
    from aligner_jax.indexing import centroid_index as ci
    from aligner_jax.indexing import token_store as ts
    from aligner_jax.retrieval import centroid_search as cs

    store = ts.TokenStore(index_dir)
    searcher = cs.CentroidSearcher(
        store, ci.CentroidIndex.load(store), cs.CentroidSearchConfig(**(config or {}))
    )
    if searcher.config.residual_candidates:
        searcher.token_lists()
    return searcher


def search_child(index_dir: Path, queries_path: Path, out: Path, k: int = 100) -> None:
    """(child) Loads the index, searches every query twice at ``k`` (the second round timed,
    its rankings saved), then once more at k = 10 (timed: the latency of a top-10 search;
    its rankings saved beside, ``k10_path``)."""

    queries = _queries(queries_path)
    load_avg = os.getloadavg()[0]
    start = time.perf_counter()
    searcher = load_searcher(index_dir, overrides())
    store, index = searcher.store, searcher.index
    load_s = time.perf_counter() - start
    rss_after_load = _rss_gib()
    probe_before = speed_probe()
    times, times_10, rankings, rankings_10 = [], [], {}, {}
    for timed, k_round in ((None, k), (times, k), (times_10, 10)):  # a warm-up round first
        for qid, q, u in queries:
            t0 = time.perf_counter()
            (ranking,), _ = searcher.search(q, u, np.arange(len(q)), k_round)
            if timed is not None:
                timed.append(1000 * (time.perf_counter() - t0))
            (rankings if k_round == k else rankings_10)[qid] = [
                store.doc_ids[int(d)] for d in ranking[0]
            ]
    fileio_json(out, rankings)
    fileio_json(k10_path(out), rankings_10)
    print(
        json.dumps(
            {
                "load_s": load_s,
                "rss_after_load_gib": rss_after_load,
                "p50_ms": float(np.percentile(times, 50)),
                "p99_ms": float(np.percentile(times, 99)),
                "p50_ms_k10": float(np.percentile(times_10, 50)),
                "p99_ms_k10": float(np.percentile(times_10, 99)),
                "machine_load": load_avg,
                "speed_probe_ms": {"before": probe_before, "after": speed_probe()},
                "probes": searcher.probes,
                "interaction_docs": searcher.interaction_docs,
                "refine_docs": searcher.refine_docs,
                "num_centroids": index.num_centroids,
                "index_bytes": index.nbytes(),
                "search_config": dataclasses.asdict(searcher.config),
            }
        )
    )


def exhaustive_child(index_dir: Path, queries_path: Path, out: Path, k: int = 100) -> None:
    """(child) Top-``k`` by exhaustive scoring over every stored float vector, shard by shard:
    top-1 alignment with u^q and u^d (Eq. 1–2; every u = 1 for a model without saliences).
    Writes the rankings (``{qid: [doc id, ...]}``) to ``out`` and their scores beside it
    (``exhaustive_scores_path``).

    Scored by the searcher's exact scorer (``centroid_search.stored_top1_scores``, what
    ``Searcher.load(mode="exhaustive")`` runs on a CPU), shard by shard on one thread per BLAS
    thread the child was given (``OMP_NUM_THREADS``; the product and the compiled maxima
    release the GIL) and merged in shard order, so ties keep the lower document index whatever
    the threads."""
    import concurrent.futures

    import threadpoolctl

    from aligner_jax.common import progress
    from aligner_jax.indexing import token_store as ts
    from aligner_jax.retrieval import centroid_search

    store = ts.TokenStore(index_dir)
    salient = store.has_saliences
    items = _queries(queries_path)
    queries = [
        (np.asarray(q, np.float32), np.asarray(u if salient else np.ones(len(u)), np.float32))
        for _, q, u in items
    ]
    workers = int(os.environ.get("OMP_NUM_THREADS", "1"))
    starts = [first_doc for _, _, first_doc in store.shard_spans()] + [store.num_docs]

    def shard_top(s: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each query's top k of shard ``s`` (documents, scores), best first: Eq. 1–2 by the
        searcher's own exact scorer (``stored_top1_scores``)."""
        docs = np.arange(starts[s], starts[s + 1])
        scores = centroid_search.stored_top1_scores(store, docs, queries, salient).T
        alive = ~store.deleted[docs]
        docs, scores = docs[alive], scores[alive]
        tops = []
        for i in range(len(queries)):
            top = np.argsort(-scores[:, i], kind="stable")[:k]
            tops.append((docs[top], scores[top, i]))
        return tops

    best_docs = [np.zeros(0, np.int64) for _ in queries]
    best_scores = [np.zeros(0, np.float32) for _ in queries]
    bar = progress.Progress(store.num_shards, "exhaustive MaxSim", "shard")
    with (
        threadpoolctl.threadpool_limits(1),
        concurrent.futures.ThreadPoolExecutor(workers) as pool,
    ):
        for tops in pool.map(shard_top, range(store.num_shards)):  # in shard order
            for i, (docs, scores) in enumerate(tops):
                all_docs = np.concatenate([best_docs[i], docs])
                all_scores = np.concatenate([best_scores[i], scores])
                top = np.argsort(-all_scores, kind="stable")[:k]
                best_docs[i], best_scores[i] = all_docs[top], all_scores[top]
            bar.update(1)
    bar.close()
    rankings = {
        qid: [store.doc_ids[int(d)] for d in best_docs[i]] for i, (qid, _, _) in enumerate(items)
    }
    fileio_json(out, rankings)
    scores = {qid: best_scores[i].tolist() for i, (qid, _, _) in enumerate(items)}
    fileio_json(exhaustive_scores_path(out), scores)
    print(json.dumps({"queries": len(queries), "threads": workers}))


def exhaustive_scores_path(rankings: Path) -> Path:
    """Where an exhaustive child writes the scores of its rankings (``{qid: [score, ...]}``)."""
    return rankings.with_name(rankings.stem + ".scores.json")


def fileio_json(path: Path, obj) -> None:
    from aligner_jax.common import fileio

    fileio.atomic_write_json(path, obj)


# -- quality ----------------------------------------------------------------------------------------
def top10_overlap(found: dict, exact: dict, keep=None) -> float:
    """Mean share of exhaustive search's first 10 documents that ``found`` ranks in its first
    10, over the queries of ``found``; with ``keep`` (a predicate on doc ids) both lists are
    first restricted to the documents it keeps."""
    shares = []
    for q, docs in found.items():
        ours = [d for d in docs if keep is None or keep(d)][:10]
        ceiling = [d for d in exact[q] if keep is None or keep(d)][:10]
        if ceiling:
            shares.append(len(set(ours) & set(ceiling)) / len(ceiling))
    return float(np.mean(shares)) if shares else float("nan")


def is_real(doc_id: str) -> bool:
    """Whether a grown store's document is one of the collection's own (not a distractor)."""
    return not doc_id.startswith(DISTRACTOR + "-")


def quality(found: dict, exact: dict, qrels: dict, found_k10: dict | None = None) -> dict:
    """Top-10 overlap with exhaustive search, nDCG@10 and Recall@100 of both (in [0, 1]).

    Also how much of the gap the distractors make: the share of exhaustive search's top 10
    that are distractors, and the top-10 overlap over the collection's own documents only
    (each list without its distractors); with ``found_k10`` (the rankings of a k = 10 search),
    that search's top-10 overlap."""
    from aligner_jax.evaluation import metrics

    def run(rankings):
        return {
            q: {d: float(len(docs) - r) for r, d in enumerate(docs)} for q, docs in rankings.items()
        }

    judged = {q: qrels[q] for q in found}
    ours = metrics.evaluate_run(judged, run(found)).aggregate
    ceiling = metrics.evaluate_run(judged, run(exact)).aggregate
    share = [np.mean([not is_real(d) for d in exact[q][:10]]) for q in found]
    extra = {} if found_k10 is None else {"top10_overlap_k10": top10_overlap(found_k10, exact)}
    return {
        "top10_overlap": top10_overlap(found, exact),
        "top10_overlap_real": top10_overlap(found, exact, keep=is_real),
        "exhaustive_top10_distractors": float(np.mean(share)),
        **extra,
        "ndcg@10": ours["ndcg@10"],
        "ndcg@10_exhaustive": ceiling["ndcg@10"],
        "recall@100": ours["recall@100"],
        "recall@100_exhaustive": ceiling["recall@100"],
    }


# -- results ----------------------------------------------------------------------------------------
def quality_cells(r: dict) -> str:
    """A row's quality table cells: top-10 overlap (of the k = 100 search, then of the k = 10
    search), the distractors' share of the exhaustive top 10, the overlap over the collection's
    own documents, nDCG@10 (exhaustive) and R@100 (exhaustive) in points; "not measured" where
    the exhaustive reference (or, in older rows, the column) was not computed."""
    if r.get("top10_overlap") is None:
        return " | ".join(["not measured"] * 6)
    split = [
        "not measured" if r.get(key) is None else f"{r[key]:.{digits}f}"
        for key, digits in (
            ("top10_overlap_k10", 3),
            ("exhaustive_top10_distractors", 2),
            ("top10_overlap_real", 3),
        )
    ]
    return (
        f"{r['top10_overlap']:.3f} | {' | '.join(split)} | {100 * r['ndcg@10']:.1f} "
        f"({100 * r['ndcg@10_exhaustive']:.1f}) | {100 * r['recall@100']:.1f} "
        f"({100 * r['recall@100_exhaustive']:.1f})"
    )


def markdown(rows: list[dict]) -> str:
    """The rows' table; a "measured" column (when, with which search) where a row names it
    (rows gathered from several runs, as ``benchmarks/results/scale.json``)."""
    dated = any("measured" in r for r in rows)
    lines = [
        "# Scale: SciFact grown with distractor documents (issue 23)",
        "",
        "Written by `benchmarks/scale.py` (see its docstring for the method). Build and search "
        "each ran in a fresh process; peak RSS from outside (GNU `time -v` of the child). "
        "Search: 2 BLAS threads, batch 1, k = 100 (and k = 10 where shown), query encoding "
        "excluded, the project's "
        "default search settings. Quality against exhaustive MaxSim over the same float "
        "vectors, same 100 test queries: top-10 overlap of the k = 100 search's first 10 and of "
        "the k = 10 search; the share of distractors in the exhaustive top 10; the overlap over "
        "the collection's own documents (both lists without distractors). `load avg`: the "
        "1-minute load average when the search started (the machine has 2 cores: above 2, "
        "latencies are inflated by other jobs), and where recorded the machine's speed then "
        "(``speed_probe``: a centroid-score product and a 256 MiB sum, ms, before the timed "
        "rounds): rows whose probes differ ran on a machine going at another speed.",
        "",
        "| model | dim | bits | scale | search rules | tokens | build s | build peak RSS GiB | "
        "index B/token | load s | RSS after load GiB | search peak RSS GiB | p50 / p99 ms | "
        "p50 / p99 ms, k = 10 | top-10 overlap | top-10 overlap, k = 10 | distractors in exh. "
        "top 10 | top-10 overlap, own docs | nDCG@10 (exh.) | R@100 (exh.) | load avg |"
        + (" measured |" if dated else ""),
        "|" + "---|" * (21 + dated),
    ]
    for r in sorted(rows, key=row_key):
        k10 = "not measured"
        if r.get("p50_ms_k10") is not None:
            k10 = f"{r['p50_ms_k10']:.1f} / {r['p99_ms_k10']:.1f}"
        lines.append(
            f"| {r['model']} | {r['dim']} | {r['bits']} | {r['scale']:g}× | {rules(r)} | "
            f"{r['tokens'] / 1e6:.1f}M | {r['build_s']:.0f} | {r['build_peak_rss_gib']:.2f} | "
            f"{r['bytes_per_token']:.1f} | {r['load_s']:.2f} | {r['rss_after_load_gib']:.2f} | "
            f"{r['search_peak_rss_gib']:.2f} | {r['p50_ms']:.1f} / {r['p99_ms']:.1f} | "
            f"{k10} | {quality_cells(r)} | {load_cell(r)} |"
            + (f" {r.get('measured', '')} |" if dated else "")
        )
    return "\n".join(lines) + "\n"


def load_cell(r: dict) -> str:
    """The load average, and the speed probe taken before the timed rounds where the row has
    one (``speed_probe``)."""
    probe = (r.get("speed_probe_ms") or {}).get("before")
    cell = f"{r['machine_load']:.1f}"
    return cell + (f"; probe {probe['matmul']:.2f} / {probe['stream']:.1f} ms" if probe else "")


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib import ticker

    from aligner_jax.evaluation import plotting

    plt = plotting.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series = sorted({(r["model"], r["bits"], rules(r)) for r in rows})
    panels = (("p50_ms", axes[0]), ("p50_ms_k10", axes[1]), ("build_peak_rss_gib", axes[2]))
    for i, (model, bits, rule) in enumerate(series):
        pts = sorted(
            (r for r in rows if (r["model"], r["bits"], rules(r)) == (model, bits, rule)),
            key=lambda r: r["tokens"],
        )
        for key, ax in panels:
            shown = [r for r in pts if r.get(key) is not None]
            if shown:
                ax.plot([r["tokens"] for r in shown], [r[key] for r in shown],
                        label=f"{model}, {bits}-bit" + ("" if rule == "default" else f", {rule}"),
                        **plotting.series_style(i))  # fmt: skip
    loads = [r["machine_load"] for r in rows] or [0.0]
    on = f"load avg {min(loads):.1f}–{max(loads):.1f} on 2 cores"
    titles = (f"search p50 (ms), k = 100, {on}", "search p50 (ms), k = 10", "build peak RSS (GiB)")
    tokens = [r["tokens"] for r in rows] or [1]
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log")
        ax.set_xlim(min(tokens) / 3.2, max(tokens) * 3.2)  # a decade at least: 1-2-5 ticks
        ax.set_yscale("log")
        ax.margins(y=0.12)  # markers at the extremes stay whole inside the axes
        ax.set_xlabel("tokens")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        plotting.plain_log_axis(ax.xaxis)  # 1-2-5 ticks, labelled in millions (not 5e+07)
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v / 1e6:g}M"))
        if max(tokens) / min(tokens) > 100:  # 1-2-5 labels would overlap: decades only
            ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0,)))
    for ax in axes:  # plain numbers; finer where 1-2-5 would label one or two values
        low, high = ax.get_ylim()
        plotting.plain_log_axis(ax.yaxis, fine=high / low < 4)
    handles, labels = axes[0].get_legend_handles_labels()
    ncol = 2
    legend_rows = -(-len(labels) // ncol)
    fig.set_size_inches(15, 4.2 + 0.22 * legend_rows)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.22 * legend_rows / (4.2 + 0.22 * legend_rows) + 0.01, 1, 1))
    plotting.save(fig, path)


def _config_flag(flag: str, config_class) -> dict:
    """The JSON object of ``config_class`` fields that flag ``--<flag>`` holds."""
    text = getattr(FLAGS, flag)
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise app.UsageError(f"--{flag}={text!r}: not JSON ({e})") from None
    fields = {f.name for f in dataclasses.fields(config_class)}
    if not isinstance(given, dict) or set(given) - fields:
        raise app.UsageError(
            f"--{flag}={text!r}: expected an object of {config_class.__name__} fields "
            f"({', '.join(sorted(fields))})"
        )
    return given


def overrides() -> dict:
    """``--search_config``: the ``CentroidSearchConfig`` fields the search child overrides."""
    from aligner_jax.retrieval import centroid_search as cs

    return _config_flag("search_config", cs.CentroidSearchConfig)


def index_overrides() -> dict:
    """``--index_config``: the ``CentroidIndexConfig`` fields the build overrides."""
    from aligner_jax.indexing import centroid_index as ci

    return _config_flag("index_config", ci.CentroidIndexConfig)


def index_bindings(given: dict) -> list[str]:
    """``aligner-index`` gin flags setting every CentroidIndexConfig field: ``given``'s, the
    others to their defaults (a rebuild keeps an index's recorded settings unless told:
    ``centroid_index.recorded_config``)."""
    from aligner_jax.indexing import centroid_index as ci

    values = dataclasses.asdict(ci.CentroidIndexConfig()) | given
    return [f"--gin.CentroidIndexConfig.{k}={v!r}" for k, v in sorted(values.items())]


def rules(r: dict) -> str:
    """A row's build and search rules: "default" or their overrides, e.g.
    ``token_lists=True, residual_candidates=True`` (build's first)."""
    parts = [
        f"{k}={v}"
        for given in (r.get("index_overrides") or {}, r.get("search_overrides") or {})
        for k, v in sorted(given.items())
    ]
    return ", ".join(parts) or "default"


def row_key(r: dict) -> tuple:
    return (r["model"], r["bits"], r["scale"], rules(r))


def write_results(out_dir: Path, new_rows: list[dict]) -> list[dict]:
    from aligner_jax.common import fileio

    path = out_dir / "scale.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    fresh = {row_key(r) for r in new_rows}
    rows = [r for r in rows if row_key(r) not in fresh] + new_rows
    fileio.atomic_write_json(path, {"rows": rows})
    fileio.atomic_write_text(out_dir / "scale.md", markdown(rows))
    plot(rows, out_dir / "scale.png")
    return rows


def _kept_build(out_dir: Path, store_dir: Path, scale: float, bits: int) -> dict | None:
    """(``--reuse_index``) The build figures scale.json holds for ``scale`` and ``bits`` when
    the store's search index was built with those bits; else None (rebuild)."""
    from aligner_jax.indexing import centroid_index as ci
    from aligner_jax.indexing import token_store as ts

    store = ts.TokenStore(store_dir)
    if not ci.CentroidIndex.exists(store_dir):
        return None
    config = ci.CentroidIndex.load(store).meta["config"]
    wanted = {"residual_bits": bits, "token_lists": None} | index_overrides()  # the rule, as given
    if any(config.get(k, False) != v for k, v in wanted.items()):
        return None
    path = out_dir / "scale.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    for r in rows:
        if (r["model"], r["bits"], r["scale"]) == (FLAGS.model, bits, scale):
            if r["tokens"] == store.num_tokens and (r.get("index_overrides") or {}) == (
                index_overrides()
            ):
                print(f"{store_dir}: {bits}-bit index reused, build figures of scale.json kept")
                return {"wall_s": r["build_s"], "peak_rss_gib": r["build_peak_rss_gib"]}
    return None


# -- driver -----------------------------------------------------------------------------------------
FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_enum("model", "trained", list(SOURCES), "Which SciFact token store to grow.")
    flags.DEFINE_list("scales", ["1", "10", "30", "100"], "Scales (× SciFact's documents).")
    flags.DEFINE_list("bits", ["4", "2"], "Residual bits of the search indexes built.")
    flags.DEFINE_string("source_index", None, "The real store (default: SOURCES[model]).")
    flags.DEFINE_string("dataset_dir", "../shared/data/beir/scifact", "BEIR folder (qrels).")
    flags.DEFINE_string("output_dir", "benchmarks/results", "Where scale.{json,md,png} go.")
    flags.DEFINE_string("work_dir", "/work/scale_work", "Where the grown stores are written.")
    flags.DEFINE_integer("num_queries", 100, "Test queries (a fixed sample).")
    flags.DEFINE_integer("threads", 2, "BLAS threads of the search.")
    flags.DEFINE_bool("keep_stores", False, "Keep the grown stores after measuring.")
    flags.DEFINE_bool("reuse_stores", False, "Reuse grown stores kept by an earlier run.")
    flags.DEFINE_bool(
        "reuse_index",
        False,
        "Search a kept store's search index when it has the requested bits (after a change of "
        "the search rules only); its row keeps the build figures scale.json already holds.",
    )
    flags.DEFINE_string(
        "search_config",
        "{}",
        "CentroidSearchConfig fields the search overrides, as JSON (rows are kept per rules), "
        'e.g. \'{"residual_candidates": true, "probe_docs": 2560}\'.',
    )
    flags.DEFINE_string(
        "index_config",
        "{}",
        "CentroidIndexConfig fields the build overrides, as JSON (rows are kept per rules), "
        "e.g. '{\"token_lists\": true}'.",
    )
    flags.DEFINE_bool("replot", False, "Redraw scale.md / scale.png from scale.json only.")
    flags.DEFINE_enum("child", None, ["encode", "search", "exhaustive"], "(internal)")
    flags.DEFINE_string("index_dir", None, "(internal) the store of a child.")
    flags.DEFINE_string("queries_npz", None, "(internal) encoded queries.")
    flags.DEFINE_string("out", None, "(internal) the child's output file.")
    flags.DEFINE_string(
        "query_split", "test", "(internal) the qrels split an encode child samples."
    )


def main(argv) -> None:
    del argv
    out_dir = (REPO / FLAGS.output_dir).resolve()
    if FLAGS.child == "encode":
        return encode_queries(
            Path(FLAGS.index_dir),
            Path(FLAGS.dataset_dir),
            FLAGS.num_queries,
            Path(FLAGS.out),
            FLAGS.query_split,
        )
    if FLAGS.child == "search":
        return search_child(Path(FLAGS.index_dir), Path(FLAGS.queries_npz), Path(FLAGS.out))
    if FLAGS.child == "exhaustive":
        return exhaustive_child(Path(FLAGS.index_dir), Path(FLAGS.queries_npz), Path(FLAGS.out))
    if FLAGS.replot:
        write_results(out_dir, [])
        return
    overrides(), index_overrides()  # a bad --search_config / --index_config stops here
    from aligner_jax.data import beir

    source = (REPO / (FLAGS.source_index or SOURCES[FLAGS.model])).resolve()
    dataset = (REPO / FLAGS.dataset_dir).resolve()
    work = Path(FLAGS.work_dir) / FLAGS.model
    work.mkdir(parents=True, exist_ok=True)
    log = work / "children.log"
    me = [sys.executable, str(Path(__file__).resolve())]
    queries_npz = work / "queries.npz"
    if not queries_npz.exists():
        run_child(me + ["--child=encode", f"--index_dir={source}", f"--dataset_dir={dataset}",
                        f"--num_queries={FLAGS.num_queries}", f"--out={queries_npz}"], 2, log)  # fmt: skip
    qrels = beir.load_qrels(dataset / "qrels" / "test.tsv")
    sigma = None
    for scale in sorted(float(s) for s in FLAGS.scales):
        store_dir = work / f"x{scale:g}"
        if sigma is None:
            one = work / "x1"
            from aligner_jax.indexing import centroid_index as ci

            if not (one / "manifest.json").exists() or not ci.CentroidIndex.exists(one):
                make_store(source, one, 1.0, 0.0)
                run_child([sys.executable, "-m", "aligner_jax.index", f"--index_dir={one}", "--search_index"], 2, log)  # fmt: skip
            sigma = residual_sigma(one)
            print(f"jitter sigma per dimension: {sigma:.4f}", flush=True)
        reuse = (scale == 1.0 or FLAGS.reuse_stores) and (store_dir / "manifest.json").exists()
        if not reuse:
            made = make_store(source, store_dir, scale, sigma, seed=int(scale))
        else:
            from aligner_jax.indexing import token_store as ts

            st = ts.TokenStore(store_dir)
            made = {"tokens": st.num_tokens, "docs": st.num_docs}
        print(f"x{scale:g}: {made}", flush=True)
        rows, found, found_10 = [], {}, {}
        for bits in FLAGS.bits:  # builds and searches first: the exhaustive reference is slowest
            build = _kept_build(out_dir, store_dir, scale, int(bits)) if FLAGS.reuse_index else None
            build = build or run_child([sys.executable, "-m", "aligner_jax.index", f"--index_dir={store_dir}", "--search_index",
                               *index_bindings(index_overrides() | {"residual_bits": int(bits)})], 2, log)  # fmt: skip
            found_path = store_dir / f"search_{bits}.json"
            search = run_child(me + ["--child=search", f"--index_dir={store_dir}", f"--queries_npz={queries_npz}", f"--out={found_path}", f"--search_config={FLAGS.search_config}"], FLAGS.threads, log)  # fmt: skip
            found[bits] = json.loads(found_path.read_text())
            found_10[bits] = json.loads(k10_path(found_path).read_text())
            row = {
                "model": FLAGS.model,
                "dim": int(json.loads((store_dir / "manifest.json").read_text())["model"]["dim"]),
                "bits": int(bits),
                "scale": scale,
                "tokens": made["tokens"],
                "docs": made["docs"],
                "build_s": build["wall_s"],
                "build_peak_rss_gib": build["peak_rss_gib"],
                "index_bytes": search["index_bytes"],
                "bytes_per_token": search["index_bytes"] / made["tokens"],
                "load_s": search["load_s"],
                "rss_after_load_gib": search["rss_after_load_gib"],
                "search_peak_rss_gib": search["peak_rss_gib"],
                "p50_ms": search["p50_ms"],
                "p99_ms": search["p99_ms"],
                "p50_ms_k10": search["p50_ms_k10"],
                "p99_ms_k10": search["p99_ms_k10"],
                "threads": FLAGS.threads,
                "machine_load": search["machine_load"],
                "speed_probe_ms": search["speed_probe_ms"],
                "num_centroids": search["num_centroids"],
                "probes": search["probes"],
                "refine_docs": search["refine_docs"],
                "interaction_docs": search["interaction_docs"],
                "jitter_sigma": sigma,
                "search_config": search.get("search_config"),
                "search_overrides": overrides(),
                "index_overrides": index_overrides(),
                "queries": len(found[bits]),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        exact_path = store_dir / "exhaustive.json"
        if made.get("write_s") is not None or not exact_path.exists():  # a new store
            run_child(me + ["--child=exhaustive", f"--index_dir={store_dir}", f"--queries_npz={queries_npz}", f"--out={exact_path}"], 2, log)  # fmt: skip
        exact = json.loads(exact_path.read_text())
        for row, bits in zip(rows, FLAGS.bits, strict=True):
            row.update(quality(found[bits], exact, qrels, found_10[bits]))
        write_results(out_dir, rows)
        if not FLAGS.keep_stores and scale != 1.0:
            shutil.rmtree(store_dir)
    print(f"wrote {out_dir / 'scale.json'}, scale.md, scale.png")


if __name__ == "__main__":
    define_flags()
    app.run(main)
