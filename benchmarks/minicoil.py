r"""miniCOIL beside BM25 (same tokenisation) on BEIR collections: quality, fitting cost, size, latency.

    .venv/bin/python benchmarks/minicoil.py                                  # SciFact + CISI, dims 4/8/16
    .venv/bin/python benchmarks/minicoil.py --datasets=cisi --dims=4 --name=minicoil_cisi

Per collection: BM25 (bm25s lucene, k1=1.2, b=0.75, the miniCOIL tokenisation) and, per meaning
vector size, miniCOIL with meaning models fitted on the corpus itself (no labels; one encoder pass
shared by the sizes, ``MiniCoilIndex.build_dims``). Reports nDCG@10 / Recall@100 (pytrec_eval,
test split, top 1000, ``same_text`` identical-id rule), fitting cost (words, sentences, seconds,
words/s), validation triplet accuracy, sparse index bytes and per-query latency p50 (one query
per call, encoder included, after a warm-up). Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import gin
import numpy as np
from absl import app, flags, logging

from aligner_jax.common import cli, fileio
from aligner_jax.data import beir, bm25
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import Encoder
from aligner_jax.evaluation import metrics
from aligner_jax.lexical import minicoil

REPO = Path(__file__).resolve().parents[1]

_DATA_ROOT = flags.DEFINE_string(
    "data_root",
    str(REPO.parent / "shared" / "data" / "beir"),
    "Folder holding the BEIR collections.",
)
_DATASETS = flags.DEFINE_list("datasets", ["scifact", "cisi"], "Collections under --data_root.")
_DIMS = flags.DEFINE_list("dims", ["4", "8", "16"], "Meaning vector sizes.")
_GIN = flags.DEFINE_multi_string("gin_binding", [], "Extra gin bindings (MiniCoilConfig.*).")
_LATENCY_QUERIES = flags.DEFINE_integer("latency_queries", 100, "Queries timed one by one.")
_NAME = flags.DEFINE_string("name", "minicoil", "Output name: benchmarks/results/<name>.{json,md}.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", str(REPO / "benchmarks" / "results"), "Output.")
_TOP_K = 1000


def _latency(search, queries: dict[str, str], n: int) -> float:
    items = list(queries.items())[:n]
    search(dict(items[:1]), _TOP_K)  # warm-up (compilation)
    times = []
    for qid, text in items:
        start = time.perf_counter()
        search({qid: text}, _TOP_K)
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1000.0)


def _evaluate(dataset, results):
    identical = beir.IdenticalIds.of(dataset.queries, dataset.corpus, dataset.qrels, "same_text")
    evaluation = metrics.evaluate_run(dataset.qrels, identical.apply(results), k_values=(10, 100))
    return {k: evaluation.aggregate[k] for k in ("ndcg@10", "recall@100", "mrr@10")}


def _bm25_bytes(index: bm25.BM25Index) -> int:
    scores = index._retriever.scores
    return int(sum(scores[k].nbytes for k in ("data", "indices", "indptr")))


def run_dataset(name: str, dims: list[int], encoder: Encoder) -> dict:
    dataset = beir.load_beir(Path(_DATA_ROOT.value) / name, "test", "error")
    doc_ids = list(dataset.corpus)
    texts = [beir.document_text(d) for d in dataset.corpus.values()]
    config = minicoil.MiniCoilConfig()
    out = {"dataset": name, "num_documents": len(doc_ids), "num_queries": len(dataset.qrels)}

    start = time.perf_counter()
    index = bm25.BM25Index.build(doc_ids, texts, k1=config.k1, b=config.b)
    bm25_index_s = time.perf_counter() - start
    bm25_results = index.search(dataset.queries, _TOP_K)
    out["bm25"] = {
        "k1": config.k1,
        "b": config.b,
        "metrics": _evaluate(dataset, bm25_results),
        "index_seconds": bm25_index_s,
        "index_bytes": _bm25_bytes(index),
        "latency_p50_ms": _latency(index.search, dataset.queries, _LATENCY_QUERIES.value),
    }
    logging.info("%s BM25: %s", name, out["bm25"]["metrics"])

    start = time.perf_counter()
    indexes = minicoil.MiniCoilIndex.build_dims(doc_ids, texts, encoder, config, dims)
    build_s = time.perf_counter() - start
    out["minicoil_build_seconds_all_dims"] = build_s
    out["minicoil"] = {}
    for dim, mc in indexes.items():
        start = time.perf_counter()
        results = mc.search(dataset.queries, _TOP_K)
        search_s = time.perf_counter() - start
        fit = mc.report.get("fit", {})
        row = {
            "metrics": _evaluate(dataset, results),
            "search_seconds_all_queries": search_s,
            "latency_p50_ms": _latency(mc.search, dataset.queries, _LATENCY_QUERIES.value),
            "index_bytes": mc.nbytes(),
            "num_cells": mc.report["num_cells"],
            "words": mc.report["num_words"],
            "words_with_model": mc.report["num_words_with_model"],
            "fit": fit,
            "timings": mc.report["timings"],
        }
        out["minicoil"][str(dim)] = row
        logging.info("%s miniCOIL dim %d: %s", name, dim, row["metrics"])
    return out


_MEANING_TEXT = {
    "nonnegative": "(1 + cos) / 2 of the two meaning vectors (`MiniCoilConfig.meaning`; no match is "
    "a penalty)",
    "cosine": "the cosine of the two meaning vectors (the article's formula)",
}


def _markdown(report: dict) -> str:
    lines = [
        "# miniCOIL vs BM25 (same tokenisation, k1=1.2, b=0.75)",
        "",
        f"Machine: {report['machine']} (shared and busy: timings are indicative; BM25 and miniCOIL "
        "were timed in the same run). Encoder: zero-shot bundled all-MiniLM-L6-v2 token vectors; "
        "teacher: " + report["teacher"] + ". Meaning models fitted on each corpus (no labels). "
        "Meaning: " + _MEANING_TEXT.get(report["config"].get("meaning", "cosine"), "?") + ".",
    ]
    for ds in report["datasets"]:
        lines += [
            "",
            "| collection | system | nDCG@10 | R@100 | val. triplet acc. (input space) | words "
            "w/ model | sentences + snippets | fit s (words/s) | index bytes | p50 ms/query |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        b = ds["bm25"]
        lines.append(
            f"| {ds['dataset']} | BM25 | {100 * b['metrics']['ndcg@10']:.1f} | "
            f"{100 * b['metrics']['recall@100']:.1f} | — | — | — | — | {b['index_bytes']:,} | "
            f"{b['latency_p50_ms']:.2f} |"
        )
        for dim, row in ds["minicoil"].items():
            f = row["fit"]
            acc = f.get("validation_triplet_accuracy")
            inp = f.get("validation_input_space_accuracy")
            lines.append(
                f"| {ds['dataset']} | miniCOIL {dim}d | {100 * row['metrics']['ndcg@10']:.1f} | "
                f"{100 * row['metrics']['recall@100']:.1f} | "
                f"{100 * acc:.1f} % ({100 * inp:.1f} %) | {row['words_with_model']:,} | "
                f"{f.get('sentences', 0):,} + {f.get('snippets', 0):,} | "
                f"{f.get('seconds', 0):.1f} ({f.get('words_per_s') or 0:,.0f}) | "
                f"{row['index_bytes']:,} | {row['latency_p50_ms']:.2f} |"
            )
        t = next(iter(ds["minicoil"].values()))["timings"]
        f = next(iter(ds["minicoil"].values()))["fit"]
        lines.append("")
        lines.append(
            f"{ds['dataset']}: shared preparation — analysis {t['analyse_s']:.1f} s, encoder pass "
            f"over {f.get('corpus_sentences', 0):,} sentences {t['encode_corpus_s']:.0f} s, teacher "
            f"{f.get('teacher_s', 0):.0f} s, snippets {f.get('snippets_s', 0):.0f} s; all sizes "
            f"{ds['minicoil_build_seconds_all_dims']:.0f} s."
        )
    return "\n".join(lines) + "\n"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    cli.parse_gin(["models/minilm_identity.gin"], _GIN.value)
    dims = [int(d) for d in _DIMS.value]
    encoder = Encoder(loading.load_encoder())
    report = {
        "machine": f"{platform.node()} ({platform.processor() or platform.machine()}), CPU",
        "command": "benchmarks/minicoil.py " + " ".join(argv[1:]),
        "teacher": minicoil.MiniCoilConfig().teacher,  # as bound by --gin_binding
        "gin_bindings": list(_GIN.value),
        "config": {
            k: v for k, v in vars(minicoil.MiniCoilConfig()).items() if not k.startswith("_")
        },
        "datasets": [],
    }
    out = Path(_OUTPUT_DIR.value)
    for name in _DATASETS.value:  # written after each collection (a long run keeps its part)
        report["datasets"].append(run_dataset(name, dims, encoder))
        fileio.atomic_write_json(out / f"{_NAME.value}.json", report, sort_keys=False)
        fileio.atomic_write_text(out / f"{_NAME.value}.md", _markdown(report))
    print(_markdown(report))
    gin.clear_config()


if __name__ == "__main__":
    app.run(main)
