"""Pruning sweeps (paper §4.3, Figures 6–7): β^d × β^q, plus alignment strategies.

For every document pruning ratio β^d a token index is built from the top β^d of each document's
tokens by salience; for every query pruning ratio β^q the top β^q of each query's tokens search
it; candidates are refined with the full stored token vectors (§3.2). Each point records
nDCG@10, Recall@100, the token index's bytes and the search time per query. With ``strategies``
the unpruned configuration is also re-scored with every alignment strategy (one refinement).

Results go to ``OUTPUT_DIR/sweep.json`` and ``sweep.md`` and three PNG plots in the style of
Figures 6–7: nDCG@10 against β^d per β^q, and nDCG@10 against index bytes and against search
milliseconds.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import gin
import numpy as np
from absl import logging

from aligner_jax.common import fileio, progress
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import scoring
from aligner_jax.data import beir
from aligner_jax.encoding.encoder import EncodingConfig
from aligner_jax.evaluation import adaptation as adaptation_lib
from aligner_jax.evaluation import beir_eval, metrics
from aligner_jax.indexing import ann as ti
from aligner_jax.retrieval import searcher as search_lib

PAPER_BETA_D = (1.0, 0.4, 0.2, 0.1, 0.05)
PAPER_BETA_Q = (1.0, 0.5, 0.3, 0.1)


@gin.configurable
def sweep(
    dataset_dir: str,
    output_dir: str,
    split: str = "test",
    index_dir: str | None = None,
    beta_d: tuple[float, ...] = PAPER_BETA_D,
    beta_q: tuple[float, ...] = PAPER_BETA_Q,
    alignment: str = "top_k:1",
    strategies: tuple[str, ...] = adaptation_lib.PAPER_STRATEGIES,
    search_config: search_lib.SearchConfig | None = None,
    encoding_config: EncodingConfig | None = None,
    plot: bool = True,
    ignore_identical_ids: str = "same_text",
) -> dict:
    """Runs the β^d × β^q grid (and the strategy sweep); returns what sweep.json holds.

    ``ignore_identical_ids``: the rule of ``beir.IdenticalIds`` (as in ``aligner-eval``)."""
    search_config = search_config or search_lib.SearchConfig()
    if search_config.exhaustive:
        raise ConfigError("sweep: pruning acts on token search; set SearchConfig.k_prime > 0")
    run = beir_eval.prepare(dataset_dir, output_dir, split, index_dir, encoding_config)
    output, dataset, store = run.output, run.dataset, run.store
    bundle, qids, encoded = run.encoder.bundle, run.qids, run.queries
    identical = beir.IdenticalIds.of(
        dataset.queries, dataset.corpus, dataset.qrels, ignore_identical_ids
    )

    points = []
    strategy_scores = {}
    bar = progress.Progress(len(beta_d) * len(beta_q), "sweep (beta_d x beta_q)", "point")
    for bd in beta_d:
        index = ti.TokenIndex.build(
            store, search_config.backend, beta_d=bd, k_prime=search_config.k_prime
        )
        index_bytes = index.nbytes()
        for bq in beta_q:
            cfg = dataclasses.replace(search_config, beta_d=bd, beta_q=bq)
            names = [alignment]
            if strategies and bd == 1.0 and bq == 1.0:
                names += [s for s in strategies if s != alignment]
            t0 = time.perf_counter()
            searcher = search_lib.Searcher(store, cfg, index)
            out = searcher.run(qids, encoded, strategies=names, show_progress=False)
            wall = time.perf_counter() - t0
            results = {n: identical.apply(r) for n, r in out.results.items()}
            ev = metrics.evaluate_run(dataset.qrels, results[scoring.canonical_name(alignment)])
            point = {
                "beta_d": bd,
                "beta_q": bq,
                "ndcg@10": ev.aggregate["ndcg@10"],
                "recall@100": ev.aggregate["recall@100"],
                "token_index_bytes": index_bytes,
                "token_index_tokens": index.num_tokens,
                "search_ms_per_query_p50": beir_eval.percentile(out.search_ms, 50),
                "candidates_per_query_median": float(np.median(out.num_candidates)),
                "wall_s": wall,
            }
            points.append(point)
            logging.debug("sweep point %s", point)
            bar.write(
                f"beta_d={bd:<5} beta_q={bq:<5} nDCG@10={100 * point['ndcg@10']:.1f} "
                f"R@100={100 * point['recall@100']:.1f} index={index_bytes / 2**20:.1f} MiB "
                f"search={point['search_ms_per_query_p50']:.1f} ms/q"
            )
            bar.update(1)
            if len(names) > 1:
                for name in names:
                    evs = metrics.evaluate_run(dataset.qrels, results[scoring.canonical_name(name)])
                    strategy_scores[scoring.canonical_name(name)] = evs.aggregate["ndcg@10"]
        del index
    bar.close()
    report = {
        "dataset": dataset.name,
        "split": split,
        "model": bundle.name,
        "model_fingerprint": bundle.fingerprint(),
        "search": dataclasses.asdict(search_config),
        "alignment": alignment,
        "identical_ids": identical.as_dict(),
        "refinement_store_bytes": store.nbytes(),
        "points": points,
        "strategies": strategy_scores,
    }
    output.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_json(output / "sweep.json", report, sort_keys=False)
    fileio.atomic_write_text(output / "sweep.md", markdown(report))
    if plot:
        plot_sweep(report, output)
    return report


def markdown(report: dict) -> str:
    points = report["points"]
    bds = sorted({p["beta_d"] for p in points}, reverse=True)
    bqs = sorted({p["beta_q"] for p in points}, reverse=True)
    full = {(p["beta_d"], p["beta_q"]): p for p in points}
    base = full.get((1.0, 1.0))
    lines = [
        f"# Pruning sweep: {report['dataset']}/{report['split']} ({report['model']})",
        "",
        f"Token search: {report['search']['backend']}, k'={report['search']['k_prime']}; "
        f"refinement store {report['refinement_store_bytes'] / 2**20:.1f} MiB (all tokens).",
        "",
        "nDCG@10 ×100 (rows β^d, columns β^q):",
        "",
        "| β^d \\ β^q | "
        + " | ".join(f"{100 * q:g}%" for q in bqs)
        + " | token index | of unpruned |",
        "|---|" + "---|" * (len(bqs) + 2),
    ]
    for bd in bds:
        row = [f"{100 * bd:g}%"]
        for bq in bqs:
            p = full.get((bd, bq))
            row.append(f"{100 * p['ndcg@10']:.1f}" if p else "")
        any_p = next(p for p in points if p["beta_d"] == bd)
        row.append(f"{any_p['token_index_bytes'] / 2**20:.1f} MiB")
        row.append(
            f"{100 * any_p['token_index_bytes'] / base['token_index_bytes']:.0f}%" if base else ""
        )
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "| β^d | β^q | nDCG@10 | R@100 | search ms/q (p50) | candidates (median) |",
        "|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| {100 * p['beta_d']:g}% | {100 * p['beta_q']:g}% | {100 * p['ndcg@10']:.1f} | "
            f"{100 * p['recall@100']:.1f} | {p['search_ms_per_query_p50']:.1f} | "
            f"{p['candidates_per_query_median']:.0f} |"
        )
    if report["strategies"]:
        lines += ["", "Alignment strategies (unpruned), nDCG@10 ×100:", ""]
        lines.append("| " + " | ".join(report["strategies"]) + " |")
        lines.append("|" + "---|" * len(report["strategies"]))
        lines.append(
            "| " + " | ".join(f"{100 * v:.1f}" for v in report["strategies"].values()) + " |"
        )
    return "\n".join(lines) + "\n"


def plot_sweep(report: dict, output: Path) -> list[Path]:
    """Figure 6/7-style PNGs (small: 100 dpi)."""
    import matplotlib  # noqa: PLC0415  (plotting only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415  (after choosing the Agg backend)

    points = report["points"]
    name = report["dataset"]
    paths = []
    bqs = sorted({p["beta_q"] for p in points}, reverse=True)

    fig, ax = plt.subplots(figsize=(5, 3.6))
    for bq in bqs:
        ps = sorted((p for p in points if p["beta_q"] == bq), key=lambda p: p["beta_d"])
        ax.plot(
            [100 * p["beta_d"] for p in ps],
            [100 * p["ndcg@10"] for p in ps],
            marker="o",
            label=f"β^q={100 * bq:g}%",
        )
    ax.set_xscale("log")
    ax.set_xlabel("β^d: document tokens kept in the token index (%)")
    ax.set_ylabel("nDCG@10")
    ax.set_title(f"{name}: pruning by unary salience (k'={report['search']['k_prime']})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(output / f"{name}_ndcg_vs_beta_d.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for bq in bqs:
        ps = sorted((p for p in points if p["beta_q"] == bq), key=lambda p: p["beta_d"])
        axes[0].plot(
            [p["token_index_bytes"] / 2**20 for p in ps],
            [100 * p["ndcg@10"] for p in ps],
            marker="o",
            label=f"β^q={100 * bq:g}%",
        )
        axes[1].plot(
            [p["search_ms_per_query_p50"] for p in ps],
            [100 * p["ndcg@10"] for p in ps],
            marker="o",
            label=f"β^q={100 * bq:g}%",
        )
    axes[0].set_xlabel("token index size (MiB)")
    axes[1].set_xlabel("search time per query, p50 (ms)")
    for ax in axes:
        ax.set_ylabel("nDCG@10")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{name}: accuracy against index size and search time")
    fig.tight_layout()
    paths.append(output / f"{name}_ndcg_vs_cost.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
