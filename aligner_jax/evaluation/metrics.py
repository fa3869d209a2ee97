"""Retrieval metrics of the ALIGNER evaluation protocol (§4.1): nDCG@10, Recall@100, MRR@10.

The numbers come from `pytrec_eval` (trec_eval's C code), as in the BEIR toolkit; nothing here
re-implements a metric. Inputs use the BEIR interchange format:

    qrels[query_id][doc_id] = relevance (int)      results[query_id][doc_id] = score (float)

Conventions, chosen to match BEIR and stated once here:

* Ranking: documents are ranked by score descending; equal scores are ordered by doc id
  descending (trec_eval's tie rule). `top_k_results` uses the same rule, so truncating a run never
  disagrees with how trec_eval ranks it.
* nDCG@k (`ndcg_cut.k`): trec_eval's nDCG with linear gains, `DCG = Σ_{r≤k} rel_r / log2(r + 1)`,
  divided by the DCG of the ideal ordering of the judged documents.
* Recall@k (`recall.k`): relevant documents (relevance ≥ `relevance_level`) in the top k divided by
  all relevant documents of the query.
* MRR@k (`recip_rank` on the run truncated to its top k per query, as BEIR does): 1 / rank of the
  first relevant document within the top k, 0 if there is none.
* Every query of `qrels` is evaluated. A query with no results (absent from `results`, or an empty
  dict) scores 0 on every metric and still counts in the mean, so a retriever cannot raise its
  score by skipping hard queries (BEIR would silently average over the answered queries only;
  `num_queries_without_results` reports how many there were). Queries in `results` that have no
  judgments are ignored and counted in `num_unjudged_queries`.
* The run is evaluated as given: nothing is dropped here, so trec_eval on the run file written
  from the same `results` gives the same numbers. BEIR's `ignore_identical_ids` (drop
  `results[qid][qid]`) is applied before, once, by `data.beir.IdenticalIds` (its default drops
  the document only when its text is the query's text).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pytrec_eval

from aligner_jax.common.errors import ConfigError
from aligner_jax.data import runs

Qrels = Mapping[str, Mapping[str, int]]
Results = Mapping[str, Mapping[str, float]]

METRIC_NAMES = ("ndcg", "recall", "mrr")


@dataclasses.dataclass
class RunEvaluation:
    """Aggregate (mean over the evaluated queries) and per-query metrics of one run.

    Keys look like "ndcg@10", "recall@100", "mrr@10"; values are in [0, 1].
    """

    aggregate: dict[str, float]
    per_query: dict[str, dict[str, float]]
    num_queries: int
    num_queries_without_results: int
    num_unjudged_queries: int

    def __getitem__(self, key: str) -> float:
        return self.aggregate[key]

    def as_dict(self) -> dict:
        return {
            **self.aggregate,
            "num_queries": self.num_queries,
            "num_queries_without_results": self.num_queries_without_results,
            "num_unjudged_queries": self.num_unjudged_queries,
        }


ranked = runs.ranked  # (doc_id, score) best first, in trec_eval's order (one copy: data.runs)


def top_k_results(results: Results, k: int) -> dict[str, dict[str, float]]:
    """Keeps each query's `k` best-scored documents (ties: larger doc id first, as trec_eval).

    Returns a new dict; the input is not modified. Queries with no documents map to {}.
    """
    k = _check_k(k, "k")
    out: dict[str, dict[str, float]] = {}
    for qid, scored in results.items():
        out[str(qid)] = dict(ranked(scored)[:k])
    return out


def _check_k(k, name: str) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"{name}={k!r}: expected a positive integer cut-off.")
    return k


def _normalise_results(results: Results) -> dict[str, dict[str, float]]:
    run: dict[str, dict[str, float]] = {}
    for qid, scored in results.items():
        qid = str(qid)
        docs: dict[str, float] = {}
        for doc_id, score in scored.items():
            doc_id = str(doc_id)
            value = float(score)
            if math.isnan(value):
                raise ValueError(
                    f"results[{qid!r}][{doc_id!r}] is NaN; the retriever produced an invalid "
                    f"score (check the model outputs for NaNs)."
                )
            docs[doc_id] = value
        run[qid] = docs
    return run


def _normalise_qrels(qrels: Qrels) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for qid, judged in qrels.items():
        if judged:
            out[str(qid)] = {str(d): int(r) for d, r in judged.items()}
    if not out:
        raise ConfigError("qrels is empty: there is no judged query to evaluate.")
    return out


def evaluate_run(
    qrels: Qrels,
    results: Results,
    k_values: Sequence[int] = (10, 100),
    metrics: Iterable[str] = METRIC_NAMES,
    relevance_level: int = 1,
) -> RunEvaluation:
    """Evaluates a run with pytrec_eval: nDCG@k, Recall@k and MRR@k for every k in `k_values`.

    Args:
      qrels: `qrels[qid][doc_id] = relevance`; queries with an empty dict are not evaluated.
      results: `results[qid][doc_id] = score` (higher is better), e.g. the top 1000 per query.
      k_values: cut-offs; each metric is reported at each of them.
      metrics: any of "ndcg", "recall", "mrr".
      relevance_level: minimum relevance counted as relevant by Recall and MRR.

    Returns:
      `RunEvaluation` with `aggregate["ndcg@10"]` etc. (mean over all judged queries; see the
      module docstring for queries without results) and `per_query[qid]["ndcg@10"]`.
    """
    k_values = sorted({_check_k(k, "k_values entry") for k in k_values})
    if not k_values:
        raise ConfigError("k_values is empty: give at least one cut-off, e.g. (10, 100).")
    metrics = tuple(dict.fromkeys(metrics))
    unknown = [m for m in metrics if m not in METRIC_NAMES]
    if unknown or not metrics:
        raise ConfigError(
            f"metrics={list(metrics)}: expected a non-empty subset of {METRIC_NAMES}."
        )

    judged = _normalise_qrels(qrels)
    run = _normalise_results(results)
    unjudged = sum(1 for qid in run if qid not in judged)
    without_results = sum(1 for qid in judged if not run.get(qid))
    # pytrec_eval evaluates only queries present in the run; an empty ranking scores 0.
    run = {qid: run.get(qid, {}) for qid in judged}

    per_query: dict[str, dict[str, float]] = {qid: {} for qid in judged}
    cuts = ",".join(str(k) for k in k_values)
    trec_measures = {"ndcg": f"ndcg_cut.{cuts}", "recall": f"recall.{cuts}"}
    trec_names = {"ndcg": "ndcg_cut_{k}", "recall": "recall_{k}"}
    wanted = [trec_measures[m] for m in metrics if m in trec_measures]
    if wanted:
        evaluator = pytrec_eval.RelevanceEvaluator(
            judged, set(wanted), relevance_level=relevance_level
        )
        for qid, values in evaluator.evaluate(run).items():
            for metric in metrics:
                if metric in trec_names:
                    for k in k_values:
                        per_query[qid][f"{metric}@{k}"] = values[trec_names[metric].format(k=k)]
    if "mrr" in metrics:
        evaluator = pytrec_eval.RelevanceEvaluator(
            judged, {"recip_rank"}, relevance_level=relevance_level
        )
        for k in k_values:
            for qid, values in evaluator.evaluate(top_k_results(run, k)).items():
                per_query[qid][f"mrr@{k}"] = values["recip_rank"]

    names = [f"{m}@{k}" for m in metrics for k in k_values]
    for qid, values in per_query.items():
        missing = [n for n in names if n not in values]
        if missing:
            raise RuntimeError(f"pytrec_eval returned no {missing} for query {qid!r}.")
    # fsum: exactly rounded, so the mean does not depend on the order of the queries.
    aggregate = {
        name: math.fsum(values[name] for values in per_query.values()) / len(per_query)
        for name in names
    }
    return RunEvaluation(
        aggregate=aggregate,
        per_query=per_query,
        num_queries=len(per_query),
        num_queries_without_results=without_results,
        num_unjudged_queries=unjudged,
    )


def format_metrics(aggregate: Mapping[str, float], precision: int = 1) -> str:
    """One line such as "ndcg@10 68.6 | recall@100 91.3 | mrr@10 64.0" (values in percent)."""
    return " | ".join(f"{name} {100.0 * value:.{precision}f}" for name, value in aggregate.items())


def paired_bootstrap(
    x: Sequence[float], y: Sequence[float], resamples: int = 1000, seed: int = 0
) -> list[float] | None:
    """95 % percentile interval of mean(x − y) over ``resamples`` bootstrap resamples of the
    pairs (the same resampled queries for both runs: a query-level offset shared by the two
    does not widen it); None without pairs. ``x[i]``, ``y[i]``: one query's metric in each."""
    d = np.asarray(x, np.float64) - np.asarray(y, np.float64)
    if not len(d):
        return None
    idx = np.random.default_rng(seed).integers(0, len(d), size=(resamples, len(d)))
    lo, hi = np.percentile(d[idx].mean(axis=1), [2.5, 97.5])
    return [float(lo), float(hi)]
