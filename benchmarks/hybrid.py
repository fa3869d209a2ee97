r"""Hybrid retrieval (issue 12 item 2): BM25 alone, ALIGNER alone, and their fusion, per collection.

    .venv/bin/python benchmarks/hybrid.py                       # SciFact + CISI test, zero-shot
    .venv/bin/python benchmarks/hybrid.py --collections=cisi \
      --gin_file=models/minilm.gin --gin.load_encoder.checkpoint="'outputs/scifact_minilm'" \
      --index_root=outputs/trained_stores --name=hybrid_trained    # another model

Every system runs through ``aligner-eval``'s library (``beir_eval.evaluate``) in this process,
one after the other on the same token store (``--index_root/zero_shot_<collection>/index``):
``eval/bm25.gin``; ``eval/zero_shot.gin`` (ALIGNER alone); ``eval/hybrid.gin`` with RRF at
ALIGNER weight 0.6, then ``eval/hybrid.gin`` as it is (min-max score fusion, weight 0.7), both
with ``--adapt`` (the few-shot weight). Both defaults were chosen on SciFact's train queries
(``hybrid_scifact_train_fusion.md``). Writes ``benchmarks/results/<name>.json`` and ``.md``;
each run's folder (metrics.json, run file, fusion_adaptation.md) under ``--output_dir``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import gin
from absl import app, flags

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import result_files  # noqa: E402

from aligner_jax.common import cli  # noqa: E402
from aligner_jax.evaluation import beir_eval  # noqa: E402

_COLLECTIONS = flags.DEFINE_list("collections", ["scifact", "cisi"], "BEIR folders to measure.")
_DATA_ROOT = flags.DEFINE_string("data_root", str(REPO.parent / "shared/data/beir"), "BEIR root.")
_INDEX_ROOT = flags.DEFINE_string(
    "index_root",
    str(REPO / "outputs"),
    "Token stores: INDEX_ROOT/zero_shot_<collection>/index (reused, built when missing).",
)
_OUTPUT_DIR = flags.DEFINE_string("output_dir", str(REPO / "outputs/hybrid_bench"), "Run folders.")
_NAME = flags.DEFINE_string("name", "hybrid", "Result files benchmarks/results/<name>.{json,md}.")
_MODEL_GIN = flags.DEFINE_multi_string("model_gin", [], "Extra gin files after each eval file.")
_BINDINGS = flags.DEFINE_multi_string("binding", [], "Extra gin bindings for ALIGNER runs.")
_REUSE = flags.DEFINE_bool("reuse", False, "Read a run's metrics.json when its folder has one.")

# The hybrids' defaults were chosen on SciFact's train queries (gin/eval/hybrid.gin): score
# fusion w=0.7 (eval/hybrid.gin) and RRF's best there, w=0.6. The RRF run goes first: it compiles
# the refinement kernels, so the default's latency is measured warm.
SYSTEMS = (
    ("bm25", ["eval/bm25.gin"], [], False),
    ("aligner", ["eval/zero_shot.gin"], [], False),
    (
        "hybrid_rrf",
        ["eval/hybrid.gin"],
        ["HybridConfig.fusion = 'rrf'", "HybridConfig.weight = 0.6"],
        True,
    ),
    ("hybrid_score", ["eval/hybrid.gin"], [], True),
)


def run_system(collection: str, system: str, files, bindings, adapt: bool) -> dict:
    done = Path(_OUTPUT_DIR.value) / collection / system / "metrics.json"
    if _REUSE.value and done.exists():
        return json.loads(done.read_text())
    gin.clear_config()
    neural = system != "bm25"
    cli.parse_gin(
        list(files) + (_MODEL_GIN.value if neural else []),
        list(bindings) + (_BINDINGS.value if neural else []),
    )
    return beir_eval.evaluate(
        dataset_dir=str(Path(_DATA_ROOT.value) / collection),
        output_dir=str(Path(_OUTPUT_DIR.value) / collection / system),
        index_dir=str(Path(_INDEX_ROOT.value) / f"zero_shot_{collection}" / "index"),
        adapt=adapt,
    )


def row(report: dict) -> dict:
    t = report["timing"]
    out = {
        "ndcg@10": report["metrics"]["ndcg@10"],
        "recall@100": report["metrics"]["recall@100"],
        "mrr@10": report["metrics"]["mrr@10"],
        "search_ms_per_query_p50": t["search_ms_per_query_p50"],
        "search_ms_per_query_p90": t["search_ms_per_query_p90"],
        "query_encode_ms_per_query": t.get("query_encode_ms_per_query", 0.0),
    }
    first = report.get("first_stage", {})
    if first.get("kind") == "hybrid":
        out["ms_per_query_p50_parts"] = first["ms_per_query_p50"]
        out["union_candidates_median"] = first["union_candidates_median"]
        out["fusion"] = first["hybrid"]["fusion"]
        out["weight"] = first["hybrid"]["weight"]
    if "adaptation" in report and "rrf" in report["adaptation"]:
        out["few_shot"] = report["adaptation"][out["fusion"]]
    return out


def markdown(results: dict) -> str:
    lines = [
        "| collection | system | nDCG@10 | R@100 | MRR@10 | search p50 ms/query | (p90) |",
        "|---|---|---|---|---|---|---|",
    ]
    for collection, systems in results["collections"].items():
        for system, r in systems.items():
            lines.append(
                f"| {collection} | {system} | {100 * r['ndcg@10']:.1f} | "
                f"{100 * r['recall@100']:.1f} | {100 * r['mrr@10']:.1f} | "
                f"{r['search_ms_per_query_p50']:.1f} | {r['search_ms_per_query_p90']:.1f} |"
            )
    lines += ["", "Few-shot ALIGNER weight (folds of 8 labelled queries, nDCG@10 ×100):", ""]
    lines += [
        "| collection | fusion | fixed default | few-shot (mean ± std over folds) | "
        "oracle (w) | folds' choices |",
        "|---|---|---|---|---|---|",
    ]
    for collection, systems in results["collections"].items():
        hybrids = [s for s in systems.values() if "few_shot" in s]
        for method, weight, a in ((s["fusion"], s["weight"], s["few_shot"]) for s in hybrids):
            choices = ", ".join(
                f"{k.split('=')[1]}×{v}" for k, v in sorted(a["choice_counts"].items())
            )
            lines.append(
                f"| {collection} | {method} | {100 * a['default']:.1f} (w={weight}) | "
                f"{100 * a['adapted_mean']:.1f} ± {100 * a['adapted_std']:.1f} | "
                f"{100 * a['oracle']:.1f} ({a['oracle_strategy'].split('=')[1]}) | {choices} |"
            )
    lines += [
        "",
        "Hybrid search p50 per part (ms/query): ALIGNER first stage / lexical / union "
        "refinement / fusion:",
        "",
    ]
    for collection, systems in results["collections"].items():
        for system in ("hybrid_rrf", "hybrid_score"):
            p = systems.get(system, {}).get("ms_per_query_p50_parts")
            if p:
                lines.append(
                    f"- {collection} {system}: {p['aligner']:.1f} / {p['lexical']:.2f} / "
                    f"{p['rerank']:.1f} / {p['fusion']:.2f} (union median "
                    f"{systems[system]['union_candidates_median']:.0f} documents)"
                )
    return "\n".join(lines) + "\n"


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    results = {
        "machine": result_files.machine(", shared with other jobs"),
        "model_gin": _MODEL_GIN.value,
        "bindings": _BINDINGS.value,
        "collections": {},
    }
    for collection in _COLLECTIONS.value:
        results["collections"][collection] = {}
        for system, files, bindings, adapt in SYSTEMS:
            report = run_system(collection, system, files, bindings, adapt)
            results["collections"][collection][system] = row(report)
    result_files.save(results, _NAME.value, markdown)


if __name__ == "__main__":
    app.run(main)
