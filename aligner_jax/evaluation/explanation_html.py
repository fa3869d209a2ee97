"""Rendering an :class:`~aligner_jax.evaluation.explanation.Explanation` (paper §4.4, Table 4
and Table 5) as a self-contained HTML page, and as a short text summary for the terminal."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from pathlib import Path

from aligner_jax.common import fileio
from aligner_jax.evaluation.explanation import Explanation, TokenizedText, Word

# Colours of the linked query words (cycled), readable on a white or pale yellow background.
LINK_COLORS = (
    "#1f5fbf",
    "#c62828",
    "#2e7d32",
    "#7b1fa2",
    "#ef6c00",
    "#00838f",
    "#6d4c41",
    "#ad1457",
)
# Salience background: rgba(255, 193, 7, alpha) with alpha = MAX_SALIENCE_ALPHA · intensity.
SALIENCE_RGB = (255, 193, 7)
MAX_SALIENCE_ALPHA = 0.85


def salience_color(intensity: float) -> str:
    """The background colour of a word with relative salience ``intensity`` in [0, 1].

    ``rgba(255, 193, 7, α)`` with α = ``MAX_SALIENCE_ALPHA`` · intensity: transparent at 0, a
    strong amber at 1. Values outside [0, 1] are clipped; NaN is an error.
    """
    intensity = float(intensity)
    if math.isnan(intensity):
        raise ValueError("salience_color: the salience intensity is NaN.")
    alpha = MAX_SALIENCE_ALPHA * min(max(intensity, 0.0), 1.0)
    r, g, b = SALIENCE_RGB
    return f"rgba({r}, {g}, {b}, {alpha:.3f})"


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def _fmt(x: float) -> str:
    return f"{x:.4f}"


CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 60em; color: #222; line-height: 1.5; padding: 0 1em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-family: ui-monospace, Menlo, Consolas, monospace; }
.text { border: 1px solid #ddd; border-radius: 4px; padding: 0.7em 0.9em; line-height: 2.0;
        white-space: pre-wrap; }
.w { border-radius: 3px; padding: 0.1em 0.05em; }
.w.top { box-shadow: inset 0 -3px 0 #b07900; }
.w.linked { font-weight: bold; }
.w.special { color: #999; font-size: 0.75em; font-family: ui-monospace, Menlo, monospace; }
.notenc { color: #aaa; }
.w.unstored { color: #999; text-decoration: line-through dotted #999; }
sup.rank { font-size: 0.7em; font-weight: bold; margin-left: 0.05em; }
.swatch { display: inline-block; width: 0.9em; height: 0.9em; border-radius: 2px;
          vertical-align: middle; margin-right: 0.3em; }
.note { background: #fff8e1; border-left: 4px solid #ffb300; padding: 0.4em 0.8em; }
.legend { color: #555; font-size: 0.9em; }
.score { font-size: 1.2em; font-weight: bold; }
"""


def _word_links(ex: Explanation) -> tuple[dict[int, str], dict[int, list[tuple[str, int]]]]:
    """Colours of the linked query words and ``(colour, rank)`` marks of the document words."""
    query_color, doc_marks = {}, {}
    for slot, k in enumerate(ex.top_query_words):
        color = LINK_COLORS[slot % len(LINK_COLORS)]
        query_color[k] = color
        for a in ex.word_alignments(k):
            doc_marks.setdefault(a.doc_word, []).append((color, a.rank))
    return query_color, doc_marks


def _render_text(
    side: TokenizedText,
    words: Sequence[Word],
    colors: dict[int, str],
    marks: dict[int, list[tuple[str, int]]],
    show_ranks: bool,
    kind: str,
    unstored: frozenset[int] = frozenset(),
) -> str:
    """The text with one ``<span>`` per word (original spelling, gaps kept); the words whose
    every piece is in ``unstored`` (positions an index does not store) are struck through."""
    real_u = [w.salience for w in words]
    top = max(real_u) if real_u else 0.0
    out, cursor, trailing = [], 0, []
    for index, word in enumerate(words):
        intensity = word.salience / top if top > 0 else 0.0
        classes = ["w"]
        if word.special:
            classes.append("special")
        if word.highlighted:
            classes.append("top")
        dropped = bool(unstored) and unstored.issuperset(word.positions)
        if dropped:
            classes.append("unstored")
        style = [f"background-color: {salience_color(intensity)}"]
        color = colors.get(index) or (marks[index][0][0] if index in marks else None)
        if color:
            classes.append("linked")
            style.append(f"color: {color}")
        title = f"u = {word.salience:.4f}"
        if len(word.pieces) > 1:
            title += " · pieces: " + " ".join(word.pieces)
        if word.highlighted:
            title += f" · in the top β^{kind[0]}"
        if dropped:
            title += " · not stored by the index (salience 0): aligned to nothing"
        sup = ""
        if index in marks and show_ranks:
            sup = "".join(
                f'<sup class="rank" style="color: {c}">({rank})</sup>' for c, rank in marks[index]
            )
        span = (
            f'<span class="{" ".join(classes)}" style="{"; ".join(style)}" '
            f'data-u="{word.salience:.6g}" title="{_esc(title)}">{_esc(word.text)}</span>{sup}'
        )
        if word.span is None:
            # Special tokens: [CLS] before the text, [SEP] after it.
            if word.positions[0] == 0:
                out.append(span + " ")
            else:
                trailing.append(" " + span)
            continue
        start, end = word.span
        out.append(_esc(side.text[cursor:start]))
        out.append(span)
        cursor = end
    tail = side.text[cursor:]
    if side.truncated:
        out.append(
            f'<span class="notenc" title="not encoded: beyond the {side.max_length}-token '
            f'limit">{_esc(tail)}</span>'
        )
    else:
        out.append(_esc(tail))
    out.extend(trailing)
    return "".join(out)


def _piece_label(words: Sequence[Word], word_index: int, position: int, tokens) -> str:
    word = words[word_index]
    if len(word.pieces) > 1:
        return f"{_esc(word.text)} <small>({_esc(tokens[position])})</small>"
    return _esc(word.text)


def render_html(ex: Explanation) -> str:
    """A self-contained HTML page (inline CSS, no scripts or external assets) for ``ex``."""
    return (
        "\n".join(
            [
                "<!DOCTYPE html>",
                '<html lang="en"><head><meta charset="utf-8">',
                f"<title>ALIGNER explanation: {_esc(ex.query.text[:80])}</title>",
                f"<style>{CSS}</style></head><body>",
                "<h1>ALIGNER: pairwise alignment and unary salience</h1>",
                render_fragment(ex),
                "</body></html>",
            ]
        )
        + "\n"
    )


def render_fragment(ex: Explanation, id_prefix: str = "") -> str:
    """The body of :func:`render_html` (settings, texts, alignment tables) as an HTML fragment
    styled by ``CSS``; ``id_prefix`` keeps element ids unique when a page holds several (the
    search page of ``aligner-serve``; escaped here: it holds a document id)."""
    id_prefix = _esc(id_prefix)
    query_color, doc_marks = _word_links(ex)
    unstored = frozenset(ex.unstored_doc_positions)
    n, m = ex.similarity.shape
    parts = [
        "<table>",
        f"<tr><th>model</th><td>{_esc(ex.model_name)}</td></tr>",
        f"<tr><th>alignment Ã</th><td>{_esc(ex.alignment)}</td></tr>",
        f'<tr><th>sim(Q, D) (Eq. 1–2)</th><td class="score">{ex.score:.6f}</td></tr>',
        f"<tr><th>tokens</th><td>query n = {n}, document m = {m}"
        + (f" (truncated to {ex.doc.max_length})" if ex.doc.truncated else "")
        + "</td></tr>",
        f"<tr><th>highlighted</th><td>top β<sup>q</sup> = {ex.beta_q:.0%} of query tokens, "
        f"top β<sup>d</sup> = {ex.beta_d:.0%} of document tokens by salience</td></tr>",
        "</table>",
    ]
    if ex.uniform_salience:
        u = float(ex.query_encoded.salience[0]) if n else 0.0
        parts.append(
            f'<p class="note">Every token has the same salience (u = {u:.4g}): this model has no '
            "trained salience heads, so the colours and the top-β marks carry no information "
            "(ties go to the earlier tokens); the linked query words are those with the most "
            "similar aligned document tokens.</p>"
        )
    parts += [
        '<p class="legend">Background intensity: a word\'s unary salience u (max over its word '
        "pieces) relative to the most salient word of its text. Underlined: in the top β. "
        "Coloured bold: the most salient query words and the document words they align with"
        + ", with the alignment rank as superscript (1), (2), … (Table 5). [CLS]/[SEP] are greyed; they still count in the score. Hover a word for u."
        + (
            " Struck through: not stored by the index (salience 0), so aligned to nothing."
            if unstored
            else ""
        )
        + "</p>",
        "<h2>Query</h2>",
        f'<div class="text" id="{id_prefix}query">'
        f"{_render_text(ex.query, ex.query_words, query_color, {}, False, 'query')}</div>",
        "<h2>Document</h2>",
        f'<div class="text" id="{id_prefix}document">'
        f"{_render_text(ex.doc, ex.doc_words, {}, doc_marks, True, 'doc', unstored)}</div>",
    ]

    parts += [
        f"<h2>Alignments of the {len(ex.top_query_words)} most salient query words</h2>",
        f'<table id="{id_prefix}top-alignments"><tr><th>query word</th><th>u<sup>q</sup></th>'
        "<th>rank</th><th>document word</th><th>S<sub>ij</sub></th><th>u<sub>j</sub>"
        "<sup>d</sup></th></tr>",
    ]
    for k in ex.top_query_words:
        word = ex.query_words[k]
        color = query_color[k]
        rows = ex.word_alignments(k)
        label = _piece_label(ex.query_words, k, word.representative, ex.query.tokens)
        head = (
            f'<td rowspan="{max(len(rows), 1)}"><span class="swatch" '
            f'style="background: {color}"></span><b style="color: {color}">{label}</b></td>'
            f'<td class="num" rowspan="{max(len(rows), 1)}">{_fmt(word.salience)}</td>'
        )
        if not rows:
            parts.append(
                f"<tr>{head}<td colspan='4'>(not aligned under {_esc(ex.alignment)})</td></tr>"
            )
        for r, a in enumerate(rows):
            doc_label = _piece_label(ex.doc_words, a.doc_word, a.doc_position, ex.doc.tokens)
            parts.append(
                f"<tr>{head if r == 0 else ''}<td class='num'>{a.rank}</td>"
                f"<td style='color: {color}'>{doc_label}</td>"
                f"<td class='num'>{_fmt(a.similarity)}</td>"
                f"<td class='num'>{_fmt(a.doc_salience)}</td></tr>"
            )
    parts.append("</table>")

    total = sum(a.weight for a in ex.alignments)
    parts += [
        f"<details><summary>All {len(ex.alignments)} token alignments (nonzero Ã<sub>ij</sub>"
        f" of {_esc(ex.alignment)}); "
        "sim(Q, D) = Σ S<sub>ij</sub>A<sub>ij</sub> / Σ A<sub>ij</sub> over these rows</summary>",
        f'<table id="{id_prefix}all-alignments"><tr><th>query token</th><th>document token</th>'
        "<th>rank</th><th>S<sub>ij</sub></th><th>Ã<sub>ij</sub></th><th>u<sup>q</sup>"
        "<sub>i</sub></th><th>u<sup>d</sup><sub>j</sub></th><th>A<sub>ij</sub></th></tr>",
    ]
    for a in ex.alignments:
        q_label = _piece_label(ex.query_words, a.query_word, a.query_position, ex.query.tokens)
        d_label = _piece_label(ex.doc_words, a.doc_word, a.doc_position, ex.doc.tokens)
        parts.append(
            f"<tr><td>{q_label}</td><td>{d_label}</td><td class='num'>{a.rank}</td>"
            f"<td class='num'>{_fmt(a.similarity)}</td><td class='num'>{_fmt(a.pairwise)}</td>"
            f"<td class='num'>{_fmt(a.query_salience)}</td>"
            f"<td class='num'>{_fmt(a.doc_salience)}</td><td class='num'>{_fmt(a.weight)}</td>"
            "</tr>"
        )
    parts += [
        f"<tr><th colspan='7'>Σ A<sub>ij</sub></th><td class='num'>{_fmt(total)}</td></tr>",
        "</table></details>",
    ]
    return "\n".join(parts)


def format_summary(ex: Explanation, top_alignments: int = 4) -> str:
    """A short plain-text summary: model, strategy, score and the linked words' alignments."""
    n, m = ex.similarity.shape
    lines = [
        f"model      {ex.model_name}",
        f"alignment  {ex.alignment}",
        f"score      sim(Q, D) = {ex.score:.6f}  (query n={n} tokens, document m={m} tokens"
        + (", truncated" if ex.doc.truncated else "")
        + (
            f"; {ex.unstored_doc_tokens} of salience 0 not stored by the index, aligned to nothing"
            if ex.unstored_doc_tokens
            else ""
        )
        + ")",
    ]
    if ex.uniform_salience:
        lines.append(
            "salience   uniform (no trained salience heads): the words shown are those with "
            "the most similar alignments"
        )
    for k in ex.top_query_words:
        word = ex.query_words[k]
        rows = ex.word_alignments(k)
        shown = ", ".join(
            f"{ex.doc_words[a.doc_word].text!r}({a.rank}) S={a.similarity:.3f}"
            for a in rows[:top_alignments]
        )
        more = f", … {len(rows) - top_alignments} more" if len(rows) > top_alignments else ""
        lines.append(f"  {word.text!r} (u={word.salience:.3f}) -> {shown or 'not aligned'}{more}")
    return "\n".join(lines)


def write_html(ex: Explanation, output: str | Path) -> Path:
    """Writes ``render_html(ex)`` to ``output`` (creating its folder) and returns the path."""
    output = Path(output)
    if output.is_dir():
        raise IsADirectoryError(f"{output} is a folder; give a file name such as x.html.")
    output.parent.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_text(output, render_html(ex))
    return output
