"""Shared helpers for the result figures (pruning sweep, scaling, search latency).

Each figure kind is drawn in one place (``pruning_sweep``, ``benchmarks/scaling.py``,
``benchmarks/search_latency.py``); what they share lives here: the Agg backend, series styles
that keep identical series visible (each later series is drawn smaller and on top, with its own
marker and line style), point labels placed where they do not cover each other, log axes ticked
at the measured values, and atomic PNG writes. matplotlib is imported only when a figure is made.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from aligner_jax.common import fileio

# Drawn in this order, each on top of the previous one and smaller: a series hidden under an
# identical one still shows as a ring of another shape and colour around a thinner line.
SERIES_STYLES = (
    {"marker": "o", "linestyle": "-", "markersize": 12, "linewidth": 4.5},
    {"marker": "s", "linestyle": "--", "markersize": 8.5, "linewidth": 2.6},
    {"marker": "^", "linestyle": "-.", "markersize": 6.5, "linewidth": 1.6},
    {"marker": "D", "linestyle": ":", "markersize": 4, "linewidth": 1.4},
)


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib  # noqa: PLC0415 (reason: plotting only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (reason: after choosing the Agg backend)

    return plt


def series_style(i: int) -> dict:
    """Keyword arguments of ``Axes.plot`` for the ``i``-th of several series (see SERIES_STYLES):
    colour ``Ci``, hollow markers but the smallest, z-order rising with ``i``."""
    style = dict(SERIES_STYLES[i % len(SERIES_STYLES)])
    style.update(color=f"C{i}", zorder=2 + i, markeredgewidth=1.5)
    if i % len(SERIES_STYLES) < len(SERIES_STYLES) - 1:
        style["markerfacecolor"] = "none"
    return style


def percent(fraction: float) -> str:
    """0.05 -> '5%'."""
    return f"{100 * fraction:g}%"


def coinciding(series: Mapping[str, Mapping[float, float]], tol: float) -> list[list[str]]:
    """Groups (of ≥ 2) of series names whose values agree within ``tol`` at every x; each series
    maps x to y and series with different x sets never coincide. Groups keep the input order."""
    groups: list[list[str]] = []
    for name, values in series.items():
        for group in groups:
            other = series[group[0]]
            if set(other) == set(values) and all(abs(other[x] - values[x]) <= tol for x in values):
                group.append(name)
                break
        else:
            groups.append([name])
    return [g for g in groups if len(g) > 1]


def log_ticks(axis, values: Sequence[float], labels: Sequence[str]) -> None:
    """Ticks of a log ``axis`` (``ax.xaxis`` / ``ax.yaxis``) exactly at the measured ``values``."""
    from matplotlib.ticker import NullLocator  # noqa: PLC0415 (reason: plotting only)

    axis.set_ticks(list(values), list(labels))
    axis.set_minor_locator(NullLocator())


# Candidate label positions around a point, in points: near ones first, then farther; the text
# is aligned away from the point and joined to it by a thin leader line.
_RINGS = (10, 18, 28, 40)
_DIRECTIONS = ((1, 0.6), (1, -0.6), (-1, 0.6), (-1, -0.6), (0, 1), (0, -1), (1, 0), (-1, 0))
_LEADER = {"arrowstyle": "-", "lw": 0.5, "color": "0.55", "shrinkA": 1, "shrinkB": 2}


def _overlap(a, b) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def _along(xy, step: float = 4.0) -> list:
    """Points every ``step`` pixels along a polyline given in pixels (so labels avoid lines)."""
    out = []
    for (x0, y0), (x1, y1) in zip(xy[:-1], xy[1:], strict=True):
        n = max(1, int(math.hypot(x1 - x0, y1 - y0) / step))
        out += [(x0 + (x1 - x0) * t / n, y0 + (y1 - y0) * t / n) for t in range(n + 1)]
    return out


def _distance(box, xy) -> float:
    """Pixels from the point ``xy`` to the nearest point of ``box``."""
    dx = max(box.x0 - xy[0], 0.0, xy[0] - box.x1)
    dy = max(box.y0 - xy[1], 0.0, xy[1] - box.y1)
    return math.hypot(dx, dy)


def plain_log_axis(axis, fine: bool = False) -> None:
    """A log ``axis`` labelled 1, 2, 5, 10, 20, 50… in plain numbers (no 2×10¹); ``fine``: at
    every integer multiple of a power of ten (0.6, 0.7, 0.8, 0.9, 1…), for an axis spanning
    less than a decade, where 1-2-5 would label one value or none."""
    from matplotlib import ticker  # noqa: PLC0415 (reason: plotting only)

    subs = tuple(float(x) for x in range(1, 10)) if fine else (1.0, 2.0, 5.0)
    axis.set_major_locator(ticker.LogLocator(subs=subs))
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())


def annotate_points(
    ax,
    xs: Sequence[float],
    ys: Sequence[float],
    labels: Sequence[str],
    merge_px: float = 5.0,
    **text_kw,
) -> list:
    """Writes ``labels[i]`` beside the point (xs[i], ys[i]) in data coordinates, joined to it
    by a leader line, each where it covers no label already there, no marker or line of the axes and stays
    inside the axes (greedy: the first free spot of _RINGS × _DIRECTIONS, else the least
    covered one). Points drawn within ``merge_px`` pixels of an earlier one share its label
    ("5%, 40%"): one marker, one label. Call it after the axes' limits and the figure's layout
    are final. Returns the ``Annotation`` objects."""
    from matplotlib.text import Text  # noqa: PLC0415 (reason: plotting only)
    from matplotlib.transforms import Bbox  # noqa: PLC0415 (reason: plotting only)

    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer).padded(-3)  # clear of the spines
    pad = 4.0  # pixels around every marker
    taken = []
    marks = [
        ax.transData.transform(line.get_xydata())
        for line in ax.get_lines()
        if line.get_marker() not in (None, "None", "", " ")
    ]
    marks += [c.get_offset_transform().transform(c.get_offsets()) for c in ax.collections]
    line_marks = [_along(ax.transData.transform(line.get_xydata())) for line in ax.get_lines()
                  if line.get_linestyle() not in ("None", "", " ")]  # fmt: skip
    marks += line_marks
    centres = []  # markers only: a label nearer another marker than its own reads wrongly
    for k, points in enumerate(marks):
        for x, y in points:
            if math.isfinite(x) and math.isfinite(y):
                taken.append(Bbox.from_extents(x - pad, y - pad, x + pad, y + pad))
                if k < len(marks) - len(line_marks):
                    centres.append((x, y))
    taken += [Text.get_window_extent(t, renderer) for t in ax.texts]  # earlier labels
    text_kw.setdefault("fontsize", 7)
    groups: list[tuple[tuple[float, float], list[int]]] = []  # (first point in pixels, members)
    for i, xy in enumerate(ax.transData.transform(list(zip(xs, ys, strict=True)))):
        near = [g for g in groups if math.dist(g[0], xy) <= merge_px]
        if near:
            near[0][1].append(i)
        else:
            groups.append((tuple(xy), [i]))
    out = []
    for own, members in groups:
        x, y = xs[members[0]], ys[members[0]]
        others = [c for c in centres if math.dist(c, own) > merge_px]
        label = ", ".join(labels[i] for i in members)
        best = None
        for ring in _RINGS:
            for dx, dy in _DIRECTIONS:
                ha = "left" if dx > 0 else "right" if dx < 0 else "center"
                va = "bottom" if dy > 0 else "top" if dy < 0 else "center"
                ann = ax.annotate(
                    label,
                    (x, y),
                    xytext=(ring * dx, ring * dy),
                    textcoords="offset points",
                    ha=ha,
                    va=va,
                    arrowprops=_LEADER,
                    **text_kw,
                )
                ann.get_window_extent(renderer)  # places the text (and the leader line)
                box = Text.get_window_extent(ann, renderer)  # the text alone
                cost = sum(_overlap(box, t) for t in taken)
                inside = Bbox.intersection(box, frame)
                cost += box.width * box.height - (inside.width * inside.height if inside else 0)
                if others and min(_distance(box, c) for c in others) < _distance(box, own):
                    cost += box.width * box.height  # nearer another marker than its own
                if best is None or cost < best[0]:
                    if best is not None:
                        best[1].remove()
                    best = (cost, ann, box)
                else:
                    ann.remove()
                if cost == 0:
                    break
            if best[0] == 0:
                break
        _, ann, box = best
        taken.append(box)
        out.append(ann)
    return out


def save(fig, path: str | Path, dpi: int = 100) -> Path:
    """Writes ``fig`` as a PNG atomically and closes it."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    pyplot().close(fig)
    return fileio.atomic_write_bytes(path, buffer.getvalue())
