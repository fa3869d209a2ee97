"""Pruning sweeps (paper §4.3, Figures 6–7): β^d × β^q, plus alignment strategies.

For every document pruning ratio β^d a token index is built from the top β^d of each document's
tokens by salience; for every query pruning ratio β^q the top β^q of each query's tokens search
it; candidates are refined with the full stored token vectors (§3.2). Each point records
nDCG@10, Recall@100, the token index's bytes and the search time per query. With ``strategies``
the unpruned configuration is also re-scored with every alignment strategy (one refinement).

Results go to ``OUTPUT_DIR/sweep.json`` and ``sweep.md`` and two PNGs in the style of
Figures 6–7: nDCG@10 against β^d per β^q, and nDCG@10 against index bytes and against search
milliseconds; :func:`replot` redraws the table and plots from a saved ``sweep.json``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import gin
import numpy as np
from absl import logging

from aligner_jax.common import checks, fileio, progress
from aligner_jax.common.errors import ConfigError, MissingPathError
from aligner_jax.core import pruning, scoring
from aligner_jax.data import beir
from aligner_jax.encoding.encoder import EncodingConfig
from aligner_jax.evaluation import adaptation as adaptation_lib
from aligner_jax.evaluation import beir_eval, metrics, plotting
from aligner_jax.indexing import ann as ti
from aligner_jax.retrieval import searcher as search_lib

PAPER_BETA_D = (1.0, 0.4, 0.2, 0.1, 0.05)
PAPER_BETA_Q = (1.0, 0.5, 0.3, 0.1)


PRUNED_BY = pruning.PRUNED_BY  # how the sweep's β keeps tokens, by whether there are saliences


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
    for name, values in (("beta_d", beta_d), ("beta_q", beta_q)):  # before any encoding
        if isinstance(values, str) or not isinstance(values, tuple | list) or not values:
            raise ConfigError(
                f"--gin.sweep.{name}={values!r}: expected a non-empty tuple of ratios"
            )
        for value in values:
            checks.number(f"sweep.{name}", value, 0.0, 1.0, low_open=True)
    for name in (alignment, *strategies):
        scoring.AlignmentStrategy.parse(name)
    if strategies and (1.0 not in beta_d or 1.0 not in beta_q):
        logging.warning(
            "sweep: the strategy comparison runs at beta_d = beta_q = 1.0, which the grid lacks: "
            "sweep.json's 'strategies' stays empty"
        )
    run = beir_eval.prepare(dataset_dir, output_dir, split, index_dir, encoding_config)
    output, dataset, store = run.output, run.dataset, run.store
    bundle, qids, encoded = run.encoder.bundle, run.qids, run.queries
    identical = beir.IdenticalIds.of(
        dataset.queries, dataset.corpus, dataset.qrels, ignore_identical_ids
    )

    rule = PRUNED_BY[store.has_saliences]
    if not store.has_saliences:
        logging.warning("the model has no saliences (every u = 1): the sweep %s", rule)
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
        "pruned_by": rule,
        "alignment": alignment,
        "identical_ids": identical.as_dict(),
        "refinement_store_bytes": store.nbytes(),
        "truncation": run.truncation,
        "points": points,
        "strategies": strategy_scores,
    }
    output.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_json(output / "sweep.json", report, sort_keys=False)
    fileio.atomic_write_text(output / "sweep.md", markdown(report))
    if plot:
        plot_sweep(report, output)
    return report


def _truncation_line(truncation: dict | None) -> list[str]:
    """What was cut, as in aligner-eval's summary (absent from sweep.json of older versions)."""
    if not truncation:
        return []
    return [
        f"Truncated: {truncation['queries_truncated']} queries at {truncation['query_maxlen']} "
        f"tokens, {truncation['docs_truncated']} documents at {truncation['doc_maxlen']} tokens."
    ]


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
        f"refinement store {report['refinement_store_bytes'] / 2**20:.1f} MiB (all tokens). "
        f"β {report.get('pruned_by', PRUNED_BY[True])}.",
        *_truncation_line(report.get("truncation")),
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


def replot(output_dir: str) -> dict:
    """Rewrites ``sweep.md`` and the plots from ``OUTPUT_DIR/sweep.json`` (nothing is searched)."""
    output = Path(output_dir)
    path = output / "sweep.json"
    if not path.is_file():
        raise MissingPathError(f"{path}: no sweep.json to redraw; run the sweep first")
    try:
        report = json.loads(path.read_text())
        if not isinstance(report, dict) or not report.get("points"):
            raise ValueError("it holds no sweep points")
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path}: not a sweep's results ({e}); run the sweep again") from None
    fileio.atomic_write_text(output / "sweep.md", markdown(report))
    plot_sweep(report, output)
    return report


def beta_q_label(beta_q: float) -> str:
    return rf"$\beta^q$ = {plotting.percent(beta_q)}"


def _series(points: list[dict]) -> dict[float, list[dict]]:
    """One series per β^q (largest first), its points in increasing β^d."""
    bqs = sorted({p["beta_q"] for p in points}, reverse=True)
    return {
        bq: sorted((p for p in points if p["beta_q"] == bq), key=lambda p: p["beta_d"])
        for bq in bqs
    }


def _coinciding_note(series: dict[float, list[dict]]) -> str:
    """A caption line for β^q series with the same nDCG@10 (±0.05) at every β^d."""
    values = {bq: {p["beta_d"]: 100 * p["ndcg@10"] for p in ps} for bq, ps in series.items()}
    groups = [", ".join(map(plotting.percent, g)) for g in plotting.coinciding(values, tol=0.05)]
    return "\n".join(
        rf"$\beta^q$ = {names}: the same nDCG@10 (±0.05) at every $\beta^d$; their lines lie "
        "on top of each other."
        for names in groups
    )


def _caption(fig, text: str) -> float:
    """Writes ``text`` under the axes; returns the figure fraction it takes (for the layout)."""
    if not text:
        return 0.0
    fig.text(0.01, 0.01, text, fontsize=8, va="bottom", ha="left")
    return (0.045 * (text.count("\n") + 1) + 0.01) * 4.4 / fig.get_figheight()


def figure_ndcg_vs_beta_d(report: dict):
    """Figure 6 style: nDCG@10 against β^d (log), one line per β^q, points joined in β^d order."""
    plt = plotting.pyplot()
    series = _series(report["points"])
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, (bq, ps) in enumerate(series.items()):
        ax.plot(
            [100 * p["beta_d"] for p in ps],
            [100 * p["ndcg@10"] for p in ps],
            label=beta_q_label(bq),
            **plotting.series_style(i),
        )
    bds = sorted({p["beta_d"] for p in report["points"]})
    ax.set_xscale("log")
    plotting.log_ticks(ax.xaxis, [100 * b for b in bds], [plotting.percent(b) for b in bds])
    ax.set_xlabel(r"$\beta^d$: document tokens kept in the token index (log scale)")
    ax.set_ylabel("nDCG@10 (×100)")
    search = report["search"]
    pruned = (
        "unary salience"
        if report.get("pruned_by", PRUNED_BY[True]) == PRUNED_BY[True]
        else ("position (no saliences: first tokens kept)")
    )
    ax.set_title(
        f"{report['dataset']}: pruning by {pruned} ({search['backend']}, k′={search['k_prime']})",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, title="query tokens kept", title_fontsize=8)
    bottom = _caption(fig, _coinciding_note(series))
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return fig


def figure_ndcg_vs_cost(report: dict):
    """Figure 7 style. Left: nDCG@10 against the token index size (log), one line per β^q joined
    in increasing size (= increasing β^d), β^d named on the top axis. Right, one small panel per
    β^q on shared axes: nDCG@10 against the search time per query, each point labelled with its
    β^d and not joined (a time is one measurement per point and need not fall with β^d)."""
    plt = plotting.pyplot()
    series = _series(report["points"])
    cols = min(len(series), 2)
    rows = -(-len(series) // cols)
    fig = plt.figure(figsize=(6 + 3.8 * cols, 2.2 + 2.3 * rows))
    grid = fig.add_gridspec(rows, 1 + cols, width_ratios=[1.6] + [1] * cols)
    size_ax = fig.add_subplot(grid[:, 0])
    time_axes = []
    for k in range(len(series)):
        share = time_axes[0] if time_axes else None
        time_axes.append(fig.add_subplot(grid[k // cols, 1 + k % cols], sharex=share, sharey=share))
    for i, ((bq, ps), time_ax) in enumerate(zip(series.items(), time_axes, strict=True)):
        style = plotting.series_style(i)
        by_size = sorted(ps, key=lambda p: p["token_index_bytes"])
        size_ax.plot(
            [p["token_index_bytes"] / 2**20 for p in by_size],
            [100 * p["ndcg@10"] for p in by_size],
            label=beta_q_label(bq),
            **style,
        )
        time_ax.plot(
            [p["search_ms_per_query_p50"] for p in ps],
            [100 * p["ndcg@10"] for p in ps],
            label=beta_q_label(bq),
            **dict(style, linestyle="none", markersize=7, zorder=3),
        )
        time_ax.set_title(beta_q_label(bq) + r"; point labels: $\beta^d$", fontsize=9)
        time_ax.grid(True, alpha=0.3)
        lowest = i + cols >= len(series)  # no panel below it: it shows the x axis
        if lowest:
            time_ax.set_xlabel("search ms per query (p50)", fontsize=9)
        time_ax.tick_params(labelsize=8, labelbottom=lowest)
    sizes = {p["beta_d"]: p["token_index_bytes"] / 2**20 for p in report["points"]}
    size_ax.set_xscale("log")
    plotting.log_ticks(size_ax.xaxis, list(sizes.values()), [f"{m:.0f}" for m in sizes.values()])
    top = size_ax.secondary_xaxis("top")
    plotting.log_ticks(top.xaxis, list(sizes.values()), [plotting.percent(b) for b in sizes])
    top.set_xlabel(r"$\beta^d$ (document tokens kept)", fontsize=9)
    size_ax.set_xlabel("token index size (MiB, log scale)")
    size_ax.set_ylabel("nDCG@10 (×100)")
    size_ax.grid(True, alpha=0.3)
    size_ax.legend(fontsize=8, title="query tokens kept", title_fontsize=8)
    ys = [100 * p["ndcg@10"] for p in report["points"]]
    xs = [p["search_ms_per_query_p50"] for p in report["points"]]
    y_pad, x_pad = 0.12 * (max(ys) - min(ys) or 1), 0.12 * (max(xs) - min(xs) or 1)
    time_axes[0].set_ylim(min(ys) - y_pad, max(ys) + y_pad)
    time_axes[0].set_xlim(min(xs) - x_pad, max(xs) + x_pad)
    search = report["search"]
    fig.suptitle(
        f"{report['dataset']}: accuracy against index size and search time "
        f"({search['backend']}, k′={search['k_prime']})",
        fontsize=11,
    )
    bottom = _caption(fig, _coinciding_note(series))
    fig.tight_layout(rect=(0, bottom, 1, 1))
    for i, (ps, time_ax) in enumerate(zip(series.values(), time_axes, strict=True)):
        plotting.annotate_points(
            time_ax,
            [p["search_ms_per_query_p50"] for p in ps],
            [100 * p["ndcg@10"] for p in ps],
            [plotting.percent(p["beta_d"]) for p in ps],
            color=f"C{i}",
        )
    return fig


def plot_sweep(report: dict, output: Path) -> list[Path]:
    """The two PNGs of :func:`figure_ndcg_vs_beta_d` and :func:`figure_ndcg_vs_cost`."""
    name = report["dataset"]
    return [
        plotting.save(figure_ndcg_vs_beta_d(report), output / f"{name}_ndcg_vs_beta_d.png"),
        plotting.save(figure_ndcg_vs_cost(report), output / f"{name}_ndcg_vs_cost.png"),
    ]
