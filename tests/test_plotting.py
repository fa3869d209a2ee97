"""The result figures read correctly: asserted on matplotlib objects (lines, labels), not pixels.

A small synthetic sweep whose β^q = 100 % and 50 % series are identical (as on SciFact) and whose
search times do not fall with β^d, listed in a shuffled order.
"""

from __future__ import annotations

import json
import random

import pytest
from fixtures import run_module
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from aligner_jax.common.errors import MissingPathError
from aligner_jax.evaluation import plotting, pruning_sweep

BETA_D = (1.0, 0.4, 0.1)
BETA_Q = (1.0, 0.5, 0.1)
NDCG = {1.0: {1.0: 0.70, 0.4: 0.70, 0.1: 0.69}, 0.1: {1.0: 0.68, 0.4: 0.66, 0.1: 0.60}}
NDCG[0.5] = dict(NDCG[1.0])  # identical to β^q = 100 %
SEARCH_MS = {1.0: 500.0, 0.4: 900.0, 0.1: 300.0}  # not monotone in β^d


def _report() -> dict:
    points = [
        {
            "beta_d": bd,
            "beta_q": bq,
            "ndcg@10": NDCG[bq][bd],
            "recall@100": 0.9,
            "token_index_bytes": int(bd * 2**30),
            "token_index_tokens": int(bd * 1e6),
            "search_ms_per_query_p50": SEARCH_MS[bd] * (1 + bq),
            "candidates_per_query_median": 100.0,
            "wall_s": 1.0,
        }
        for bd in BETA_D
        for bq in BETA_Q
    ]
    random.Random(0).shuffle(points)
    return {
        "dataset": "toy",
        "split": "test",
        "model": "m",
        "search": {"backend": "scann", "k_prime": 100},
        "alignment": "top_k:1",
        "refinement_store_bytes": 1,
        "points": points,
        "strategies": {},
    }


def _mathtext_only(text: str) -> None:
    """β^q / β^d are written as mathtext, never as a literal caret."""
    assert "^q" not in text.replace(r"$\beta^q$", "") and "^d" not in text.replace(r"$\beta^d$", "")


def test_ndcg_vs_beta_d_draws_one_distinct_line_per_beta_q_in_beta_d_order():
    fig = pruning_sweep.figure_ndcg_vs_beta_d(_report())
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert [ln.get_label() for ln in lines] == [
        r"$\beta^q$ = 100%",
        r"$\beta^q$ = 50%",
        r"$\beta^q$ = 10%",
    ]
    for line, bq in zip(lines, BETA_Q, strict=True):
        assert list(line.get_xdata()) == [10.0, 40.0, 100.0]  # increasing β^d (%)
        assert list(line.get_ydata()) == pytest.approx([100 * NDCG[bq][b] for b in (0.1, 0.4, 1)])
    # The identical 100 % and 50 % lines stay apart: own marker, line style, colour, size;
    # the later one is drawn on top and smaller, so the one below shows around it.
    styles = {(ln.get_marker(), ln.get_linestyle(), ln.get_color()) for ln in lines}
    assert len(styles) == 3
    assert lines[0].get_zorder() < lines[1].get_zorder() < lines[2].get_zorder()
    assert lines[0].get_markersize() > lines[1].get_markersize() > lines[2].get_markersize()
    assert lines[0].get_linewidth() > lines[1].get_linewidth()
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["10%", "40%", "100%"]
    assert ax.get_xlabel().startswith(r"$\beta^d$")
    # ...and the caption says that they coincide.
    (caption,) = [t.get_text() for t in fig.texts]
    assert caption.startswith(r"$\beta^q$ = 100%, 50%: the same nDCG@10")
    for text in [ax.get_xlabel(), ax.get_title(), caption] + [ln.get_label() for ln in lines]:
        _mathtext_only(text)
    plotting.pyplot().close(fig)


def test_ndcg_vs_cost_joins_sizes_in_x_order_and_labels_unjoined_time_points():
    report = _report()
    fig = pruning_sweep.figure_ndcg_vs_cost(report)
    size_ax, *time_axes = [ax for ax in fig.axes if ax.get_lines()]
    assert len(time_axes) == len(BETA_Q)
    for line in size_ax.get_lines():
        xs = list(line.get_xdata())
        assert xs == sorted(xs) and len(xs) == len(BETA_D)  # joined in increasing index size
    (top,) = size_ax.child_axes  # β^d named above each index size
    assert top.get_xlabel().startswith(r"$\beta^d$")
    assert [t.get_text() for t in top.get_xticklabels()] == ["10%", "40%", "100%"]
    for time_ax, bq in zip(time_axes, BETA_Q, strict=True):
        (line,) = time_ax.get_lines()
        assert line.get_linestyle() == "None"  # times are not joined
        assert time_ax.get_title().startswith(pruning_sweep.beta_q_label(bq))
        points = {
            (p["search_ms_per_query_p50"], 100 * p["ndcg@10"]): plotting.percent(p["beta_d"])
            for p in report["points"]
            if p["beta_q"] == bq
        }
        labels = {tuple(a.xy): a.get_text() for a in time_ax.texts}
        assert labels == points  # every point labelled with its β^d, at the point
        _mathtext_only(time_ax.get_title())
    assert time_axes[0].get_shared_x_axes().joined(time_axes[0], time_axes[-1])
    # 3 panels in 2 columns: the two lowest of their columns (2nd and 3rd) carry the x axis.
    assert [bool(ax.get_xlabel()) for ax in time_axes] == [False, True, True]
    plotting.pyplot().close(fig)


def test_point_labels_avoid_each_other_and_merge_on_one_marker():
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(4, 3))
    xs, ys = [1.0, 1.25, 1.5, 5.0, 5.0], [1.0, 1.0, 1.0, 3.0, 3.0]
    ax.plot(xs, ys, "o", linestyle="none")
    ax.set_xlim(0, 6)
    ax.set_ylim(0, 4)
    fig.tight_layout()
    anns = plotting.annotate_points(ax, xs, ys, ["a", "b", "c", "d", "e"])
    assert [a.get_text() for a in anns] == ["a", "b", "c", "d, e"]  # d and e share a marker
    renderer = fig.canvas.get_renderer()
    boxes = [Text.get_window_extent(a, renderer) for a in anns]
    frame = ax.get_window_extent(renderer)
    for i, box in enumerate(boxes):
        assert Bbox.intersection(box, frame).width == pytest.approx(box.width)
        for other in boxes[i + 1 :]:
            assert not box.overlaps(other)
    assert all(a.arrow_patch is not None for a in anns)  # a leader line to each point
    plt.close(fig)


def test_coinciding_groups_series_equal_at_every_x():
    series = {
        "a": {1: 1.0, 2: 2.0},
        "b": {1: 1.01, 2: 1.99},
        "c": {1: 1.0, 2: 2.5},
        "d": {1: 1.0},
        "e": {1: 1.0, 2: 2.5},
    }
    assert plotting.coinciding(series, tol=0.05) == [["a", "b"], ["c", "e"]]
    assert plotting.coinciding(series, tol=0.001) == [["c", "e"]]


def test_replot_redraws_table_and_plots_from_sweep_json(tmp_path):
    with pytest.raises(MissingPathError, match="sweep.json"):
        pruning_sweep.replot(str(tmp_path))
    (tmp_path / "sweep.json").write_text(json.dumps(_report()))
    proc = run_module("aligner_jax.sweep", "--replot", f"--output_dir={tmp_path}", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "sweep.md").read_text() == pruning_sweep.markdown(_report())
    for png in ("toy_ndcg_vs_beta_d.png", "toy_ndcg_vs_cost.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("limits", "fine", "labels"),
    [
        ((0.6, 1.2), True, ["0.6", "0.7", "0.8", "0.9", "1"]),
        ((0.6, 1.2), False, ["1"]),  # 1-2-5 labels one value under a decade: why ``fine``
        ((3.0, 120.0), False, ["5", "10", "20", "50", "100"]),
    ],
)
def test_plain_log_axis_labels_plain_numbers_finer_under_a_decade(limits, fine, labels):
    plt = plotting.pyplot()
    fig, ax = plt.subplots()
    ax.set_yscale("log")
    ax.set_ylim(*limits)
    plotting.plain_log_axis(ax.yaxis, fine=fine)
    fig.canvas.draw()
    low, high = limits
    shown = [t.get_text() for t in ax.get_yticklabels() if low <= t.get_position()[1] <= high]
    assert shown == labels
    assert not [t for t in ax.yaxis.get_minorticklabels() if t.get_text()]
    plt.close(fig)
