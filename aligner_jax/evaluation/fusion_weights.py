"""Few-shot choice of the hybrid's fusion weight (the §4.1 protocol applied to ``w``).

For each fusion method (RRF, min–max score fusion) and each ALIGNER weight ``w`` of the grid
(``HybridConfig.weights``: 0 = the lexical stage alone over the union, 1 = ALIGNER alone), the
hybrid's candidates are re-fused and scored per query; then, as for alignment strategies
(:func:`adaptation.select_on_folds`), each fold of 8 labelled queries picks the ``w`` with the
best mean nDCG@10 and is scored on the remaining queries: mean ± std over folds, beside the fixed
label-free default (``HybridConfig.weight``) and the oracle. No second search: fusion is NumPy.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping

from aligner_jax.evaluation import adaptation as adaptation_lib
from aligner_jax.evaluation import metrics
from aligner_jax.retrieval import fusion
from aligner_jax.retrieval import hybrid as hybrid_lib

Results = dict[str, dict[str, float]]


def per_query_table(
    run: hybrid_lib.HybridRun,
    qrels: Mapping[str, Mapping[str, int]],
    method: str,
    weights,
    rrf_k: int,
    k: int,
    metric: str = "ndcg@10",
    k_values=(10, 100),
    apply: Callable[[Results], Results] = lambda r: r,
) -> dict[str, dict[str, float]]:
    """``table[weight_name][qid]`` = the query's ``metric`` with that fusion weight (``apply``:
    the evaluation's identical-id rule, applied to every ranking it scores)."""
    table = {}
    for w in weights:
        results = apply(run.fused(w, method, rrf_k, k))
        ev = metrics.evaluate_run(qrels, results, k_values=k_values)
        table[hybrid_lib.weight_name(method, w)] = {
            q: ev.per_query.get(q, {}).get(metric, 0.0) for q in qrels
        }
    return table


def choose_weights(
    run: hybrid_lib.HybridRun,
    qrels: Mapping[str, Mapping[str, int]],
    config: hybrid_lib.HybridConfig,
    adaptation: adaptation_lib.AdaptationConfig,
    k: int,
    k_values=(10, 100),
    apply: Callable[[Results], Results] = lambda r: r,
) -> dict[str, adaptation_lib.AdaptationResult]:
    """The few-shot protocol per fusion method; the default is ``config.weight``."""
    weights = list(dict.fromkeys([*config.weights, config.weight]))
    out = {}
    for method in fusion.FUSIONS:
        table = per_query_table(
            run, qrels, method, weights, config.rrf_k, k, adaptation.metric, k_values, apply
        )
        out[method] = adaptation_lib.select_on_folds(
            table,
            [hybrid_lib.weight_name(method, w) for w in weights],
            hybrid_lib.weight_name(method, config.weight),
            fold_size=adaptation.fold_size,
            seed=adaptation.seed,
            metric=adaptation.metric,
        )
    return out


def markdown_table(dataset: str, results: Mapping[str, adaptation_lib.AdaptationResult]) -> str:
    """One row per fusion method: the metric at each weight, default, adapted ± std, oracle."""
    first = next(iter(results.values()))
    weights = [name.split("=", 1)[1] for name in first.per_strategy]
    header = ["dataset", "fusion"] + [f"w={w}" for w in weights]
    header += ["default", "few-shot (±std)", "oracle"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for method, r in results.items():
        cells = adaptation_lib.result_cells(r, lambda name: name.split(":", 1)[1])
        lines.append("| " + " | ".join([dataset, method, *cells]) + " |")
    lines.append("")
    lines.append(
        f"{first.metric} ×100; w = ALIGNER's weight (1 − w: the lexical stage), fused over the "
        f"candidate union. Few-shot: on each of {first.num_folds} folds of {first.fold_size} "
        "labelled queries the best w is chosen and scored on the remaining queries; mean ± std "
        "over folds. Oracle: the best w on all queries."
    )
    return "\n".join(lines) + "\n"


def files(dataset: str, split: str, config: hybrid_lib.HybridConfig, results) -> dict[str, str]:
    """``fusion_adaptation.json`` and ``.md``."""
    payload = {
        "dataset": dataset,
        "split": split,
        "config": dataclasses.asdict(config),
        "methods": {m: r.as_dict() for m, r in results.items()},
    }
    return {
        "fusion_adaptation.json": json.dumps(payload, indent=1) + "\n",
        "fusion_adaptation.md": markdown_table(dataset, results),
    }
