"""Few-shot alignment adaptation (paper §3.1 and the protocol of §4.1).

The test queries are split into folds of 8 (a seeded permutation, then consecutive chunks; a final
incomplete chunk is never used as a few-shot set). For each fold, the alignment strategy with the
best mean nDCG@10 on the fold's 8 queries is chosen among top-k, k ∈ {1, 2, 4, 6, 8}, and top-p,
p ∈ {0.5, 1, 1.5, 2}% (ties go to the earlier strategy in the list, i.e. to top-1); the remaining
queries are scored with it. We report the mean ± standard deviation of these per-fold scores
(one score per fold), beside the default strategy (top-1) and the oracle (the best single strategy
in hindsight), both measured as the adapted score is: on each fold's remaining queries, averaged
over the folds (when the folds cover every query, the plain mean over all of them; with few
queries the three are still compared on the same queries). Candidates are retrieved once and
re-scored with every strategy in one pass (see
:mod:`aligner_jax.retrieval.refine`), so adaptation costs one refinement.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import gin
import numpy as np

from aligner_jax.common import checks
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import scoring

PAPER_STRATEGIES = (
    "top_k:1",
    "top_k:2",
    "top_k:4",
    "top_k:6",
    "top_k:8",
    "top_p:0.005",
    "top_p:0.01",
    "top_p:0.015",
    "top_p:0.02",
)

#: Per-query metrics an evaluation reports (beir_eval's k values), any of which adaptation may use.
METRICS = tuple(f"{m}@{k}" for m in ("ndcg", "recall", "mrr") for k in (10, 100))


@gin.configurable
@dataclasses.dataclass(frozen=True)
class AdaptationConfig:
    """Attributes:
    strategies: candidate alignment strategies (paper: top-k 1,2,4,6,8 and top-p 0.5–2%).
    default: the training-time strategy reported as "default" (paper: top-1).
    fold_size: annotated queries per few-shot set (paper: 8).
    seed: seed of the permutation that assigns queries to folds.
    metric: per-query metric used to choose and to report.
    """

    strategies: tuple[str, ...] = PAPER_STRATEGIES
    default: str = "top_k:1"
    fold_size: int = 8
    seed: int = 0
    metric: str = "ndcg@10"

    def __post_init__(self):
        names = self.strategy_names
        if self.default_name not in names:
            raise ConfigError(
                f"AdaptationConfig.default={self.default!r} must be one of the strategies {names}"
            )
        checks.integer("AdaptationConfig.fold_size", self.fold_size, minimum=1)
        checks.integer("AdaptationConfig.seed", self.seed, minimum=0)
        checks.choice("AdaptationConfig.metric", self.metric, METRICS)

    @property
    def strategy_names(self) -> list[str]:
        return [scoring.canonical_name(s) for s in self.strategies]

    @property
    def default_name(self) -> str:
        return scoring.canonical_name(self.default)


@dataclasses.dataclass
class AdaptationResult:
    per_strategy: dict[str, float]  # mean metric over all queries
    default: float
    adapted_mean: float
    adapted_std: float
    oracle: float
    oracle_strategy: str
    fold_scores: list[float]
    fold_choices: list[str]
    num_folds: int
    num_queries: int
    metric: str
    fold_size: int

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["choice_counts"] = dict(Counter(self.fold_choices))
        return d


def check_enough_queries(num_queries: int, fold_size: int) -> None:
    """Few-shot selection scores each fold's choice on the other queries: it needs more than
    ``fold_size`` judged queries (checked before any search, and again on the per-query
    values)."""
    if num_queries <= fold_size:
        raise ConfigError(
            f"few-shot selection needs more than fold_size={fold_size} judged queries to score "
            f"the remaining ones; got {num_queries} (lower "
            "--gin.AdaptationConfig.fold_size or evaluate a larger split)"
        )


def make_folds(query_ids: Sequence[str], fold_size: int, seed: int) -> list[list[str]]:
    """Complete folds of ``fold_size`` queries from a seeded permutation of ``query_ids``."""
    order = list(query_ids)
    np.random.default_rng(seed).shuffle(order)
    count = len(order) // fold_size
    return [order[i * fold_size : (i + 1) * fold_size] for i in range(count)]


def few_shot_adaptation(
    per_query: Mapping[str, Mapping[str, float]], config: AdaptationConfig | None = None
) -> AdaptationResult:
    """Runs the §4.1 protocol on per-query metric values.

    Args:
      per_query: ``per_query[strategy][query_id]`` = the query's metric (e.g. nDCG@10) when
        ranked with that strategy; every strategy must cover the same queries.
      config: strategies, default, fold size, seed.
    """
    config = config or AdaptationConfig()
    return select_on_folds(
        per_query,
        config.strategy_names,
        config.default_name,
        fold_size=config.fold_size,
        seed=config.seed,
        metric=config.metric,
    )


def select_on_folds(
    per_query: Mapping[str, Mapping[str, float]],
    choices: Sequence[str],
    default: str,
    fold_size: int = 8,
    seed: int = 0,
    metric: str = "ndcg@10",
) -> AdaptationResult:
    """The §4.1 few-shot protocol for any finite set of ``choices`` (alignment strategies,
    fusion weights, ...): on each fold of ``fold_size`` labelled queries the choice with the best
    mean ``per_query[choice][qid]`` wins (ties: the earlier choice), and is scored on the
    remaining queries; mean ± std over folds, beside ``default`` and the oracle (and every
    choice's ``per_strategy`` value) measured on the same remaining queries, averaged over the
    folds."""
    names = list(choices)
    missing = [s for s in names if s not in per_query]
    if missing:
        raise ValueError(f"few-shot selection: no per-query values for {missing}")
    if default not in names:
        raise ValueError(f"few-shot selection: the default {default!r} is not among {names}")
    qids = sorted(per_query[names[0]])
    for s in names:
        if sorted(per_query[s]) != qids:
            raise ValueError(f"few-shot selection: {s} covers other queries")
    check_enough_queries(len(qids), fold_size)
    table = np.array([[per_query[s][q] for q in qids] for s in names])  # [S, Q]
    index = {q: i for i, q in enumerate(qids)}
    folds = make_folds(qids, fold_size, seed)
    scores, chosen, held_out = [], [], []
    for fold in folds:
        in_fold = np.zeros(len(qids), bool)
        in_fold[[index[q] for q in fold]] = True
        best = int(np.argmax(table[:, in_fold].mean(axis=1)))  # first maximum: earlier wins
        scores.append(float(table[best, ~in_fold].mean()))
        chosen.append(names[best])
        held_out.append(table[:, ~in_fold].mean(axis=1))
    # every choice scored where the adapted one is: a fold's remaining queries, over the folds
    means = np.mean(held_out, axis=0)
    oracle = int(np.argmax(means))
    return AdaptationResult(
        per_strategy={s: float(m) for s, m in zip(names, means, strict=True)},
        default=float(means[names.index(default)]),
        adapted_mean=float(np.mean(scores)),
        adapted_std=float(np.std(scores)),
        oracle=float(means[oracle]),
        oracle_strategy=names[oracle],
        fold_scores=scores,
        fold_choices=chosen,
        num_folds=len(folds),
        num_queries=len(qids),
        metric=metric,
        fold_size=fold_size,
    )


def _label(strategy: str) -> str:
    st = scoring.AlignmentStrategy.parse(strategy)
    if st.kind == "top_k":
        return f"k={st.k}"
    if st.kind == "top_p":
        return f"p={100 * st.p:g}%"
    return strategy


def result_cells(r: AdaptationResult, label: Callable[[str], str] = _label) -> list[str]:
    """Table cells of one result: the metric ×100 per choice (the best in bold), then default,
    adapted ± std and oracle (``label`` names its choice)."""
    best = max(r.per_strategy.values())
    cells = [
        f"**{100 * v:.1f}**" if v == best else f"{100 * v:.1f}" for v in r.per_strategy.values()
    ]
    return cells + [
        f"{100 * r.default:.1f}",
        f"{100 * r.adapted_mean:.1f} ± {100 * r.adapted_std:.1f}",
        f"{100 * r.oracle:.1f} ({label(r.oracle_strategy)})",
    ]


def markdown_table(rows: Mapping[str, AdaptationResult]) -> str:
    """A table in the style of the paper's Table 3 (+ default / adapted / oracle columns)."""
    first = next(iter(rows.values()))
    strategies = list(first.per_strategy)
    header = ["dataset"] + [_label(s) for s in strategies] + ["default", "adapted (±std)", "oracle"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, r in rows.items():
        lines.append("| " + " | ".join([name, *result_cells(r)]) + " |")
    lines.append("")
    lines.append(
        f"{first.metric} ×100. Adapted: on each fold of {first.fold_size} queries the strategy "
        "with the best fold score is chosen and applied to the remaining queries; mean ± std over "
        "the folds. Every column (oracle: the best single strategy in hindsight) is measured "
        "on the same remaining queries, averaged over the folds."
    )
    return "\n".join(lines) + "\n"
