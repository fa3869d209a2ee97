r"""BM25 baseline on a BEIR split: nDCG@10 / Recall@100 / MRR@10 (the ALIGNER §4.1 metrics).

    .venv/bin/python benchmarks/bm25_baseline.py                      # SciFact test
    .venv/bin/python benchmarks/bm25_baseline.py --dataset_dir=../shared/data/beir/cisi

Prints a one-screen summary and writes benchmarks/results/bm25_baseline_<dataset>.json.
Reference (SPEC.md, bm25s with stemming, SciFact test): nDCG@10 68.6, Recall@100 91.3.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import bm25s
from absl import app, flags

from aligner_jax.common import errors
from aligner_jax.data import beir, bm25
from aligner_jax.evaluation import metrics

REPO = Path(__file__).resolve().parents[1]

_DATASET_DIR = flags.DEFINE_string(
    "dataset_dir",
    "../shared/data/beir/scifact",
    "BEIR folder; a relative path is tried from the working directory, then from the repo root.",
)
_SPLIT = flags.DEFINE_string("split", "test", "qrels split to evaluate.")
_UNKNOWN_QRELS = flags.DEFINE_enum(
    "unknown_qrels", "error", beir.UNKNOWN_QRELS_MODES, "Judgments naming unknown ids."
)
_IDENTICAL = flags.DEFINE_enum(
    "ignore_identical_ids",
    "same_text",
    list(beir.IDENTICAL_ID_MODES),
    "The rule of aligner-eval for a document whose id is the query's id.",
)
_TOP_K = flags.DEFINE_integer("top_k", 1000, "Documents retrieved per query.")
_K_VALUES = flags.DEFINE_list("k_values", ["10", "100", "1000"], "Metric cut-offs.")
_K1 = flags.DEFINE_float("k1", 1.5, "BM25 k1.")
_B = flags.DEFINE_float("b", 0.75, "BM25 b.")
_STEMMER = flags.DEFINE_string("stemmer", "english", "PyStemmer language; empty for none.")
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", str(REPO / "benchmarks" / "results"), "Where to write the JSON result."
)


def _resolve(path: str) -> Path:
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate.resolve()
    return (REPO / candidate).resolve()


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        k_values = [int(k) for k in _K_VALUES.value]
    except ValueError:
        raise app.UsageError(f"--k_values={_K_VALUES.value}: expected integers.") from None
    dataset_dir = _resolve(_DATASET_DIR.value)

    start = time.perf_counter()
    try:
        dataset = beir.load_beir(dataset_dir, _SPLIT.value, _UNKNOWN_QRELS.value)
    except errors.BeirFormatError as e:
        print(f"error (--dataset_dir={_DATASET_DIR.value}): {e}", file=sys.stderr)
        sys.exit(2)
    load_s = time.perf_counter() - start

    start = time.perf_counter()
    index = bm25.BM25Index.build(
        list(dataset.corpus),
        [beir.document_text(doc) for doc in dataset.corpus.values()],
        k1=_K1.value,
        b=_B.value,
        stemmer_language=_STEMMER.value or None,
    )
    index_s = time.perf_counter() - start

    start = time.perf_counter()
    results = index.search(dataset.queries, k=_TOP_K.value)
    search_s = time.perf_counter() - start

    identical = beir.IdenticalIds.of(
        dataset.queries, dataset.corpus, dataset.qrels, _IDENTICAL.value
    )
    results = identical.apply(results)
    evaluation = metrics.evaluate_run(dataset.qrels, results, k_values=k_values)
    report = {
        "system": "bm25",
        "dataset": dataset.name,
        "dataset_dir": str(dataset_dir),
        "split": dataset.split,
        "metrics": evaluation.aggregate,
        "num_queries": evaluation.num_queries,
        "num_queries_without_results": evaluation.num_queries_without_results,
        "num_documents": dataset.stats.num_documents,
        "identical_ids": identical.as_dict(),
        "params": {
            "k1": _K1.value,
            "b": _B.value,
            "method": "lucene",
            "stemmer": _STEMMER.value or None,
            "stopwords": "en",
            "top_k": _TOP_K.value,
            "document_text": "title + ' ' + text",
        },
        "seconds": {"load": load_s, "index": index_s, "search": search_s},
        "docs_per_second_indexed": dataset.stats.num_documents / max(index_s, 1e-9),
        "queries_per_second": len(dataset.queries) / max(search_s, 1e-9),
        "versions": {"python": platform.python_version(), "bm25s": bm25s.__version__},
    }
    output_dir = Path(_OUTPUT_DIR.value)
    output_dir.mkdir(parents=True, exist_ok=True)
    output_path = output_dir / f"bm25_baseline_{dataset.name}.json"
    output_path.write_text(json.dumps(report, indent=2) + "\n")

    print(beir.format_stats(dataset))
    print(
        f"BM25 (k1={_K1.value}, b={_B.value}, stemmer={_STEMMER.value or 'none'}): "
        f"index {index_s:.2f} s ({report['docs_per_second_indexed']:,.0f} docs/s), "
        f"search {search_s:.2f} s ({report['queries_per_second']:,.0f} queries/s)"
    )
    print(f"{dataset.name}/{dataset.split}: {metrics.format_metrics(evaluation.aggregate)}")
    print(f"wrote {output_path}")


if __name__ == "__main__":
    app.run(main)
