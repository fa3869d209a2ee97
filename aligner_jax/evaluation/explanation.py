"""Explaining one query–document score: unary saliences and pairwise alignments (paper §4.4).

ALIGNER's score factorises into pairwise alignment and unary salience (Eq. 2,
A = Ã ⊙ (u^q ⊗ u^d)), both of which can be read off a single query–document pair. This module
renders them the way Table 4 and Appendix A.3 Table 5 of the paper do:

  * every token's unary salience u (Eq. 3) as the background intensity of its word;
  * the top β^q of query tokens and the top β^d of document tokens by salience marked, as the
    pruning of §3.2 would keep them (``ceil(β·n)`` tokens, ties to the earlier token, exactly like
    ``core.pruning``);
  * the ``num_aligned`` most salient query words, each in its own colour, linked to the document
    words its pairwise alignment Ã selects (top-k: ranks ``(1)…(k)`` as superscripts, Table 5);
    among equally salient words (a model without salience heads has u = 1 everywhere) the ones
    with the most similar aligned document tokens are shown;
  * a table of the alignments and the overall score sim(Q, D) of Eq. 1–2.

Word pieces are merged into words for reading (``tokenization.merge_wordpieces``); a word's
salience is the max over its pieces, and a word's alignments are those of its most salient piece
(its *representative* token; the earlier piece on ties). Special tokens ([CLS], [SEP]) are shown
greyed; they are never chosen as highlighted query words but still take part in the score, as
they do in the model. The complete list of token-level alignments (every nonzero Ã_ij) is in
``Explanation.alignments``; it reproduces the score exactly.

Python use (no files)::

    bundle = loading.load_encoder()          # after parsing e.g. models/minilm_identity.gin
    ex = explain.explain(bundle, "what is a fathom", "a fathom is six feet", alignment="top_k:4")
    html_text = explain.render_html(ex)

The command line is ``aligner-explain`` (``aligner_jax/explain_main.py``).
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from aligner_jax.common import errors
from aligner_jax.core import pruning, scoring
from aligner_jax.data import beir
from aligner_jax.encoding import tokenization
from aligner_jax.encoding.encoder import EncodedText, Encoder, EncoderBundle

DEFAULT_ALIGNMENT = "top_k:1"
DEFAULT_BETA_Q = 0.5  # Table 4: the top 50% of query tokens are highlighted
DEFAULT_BETA_D = 0.2  # Table 4: the top 20% of document tokens are highlighted
DEFAULT_NUM_ALIGNED = 3  # Table 4: the three most salient query tokens
# Entries of a soft pairwise alignment (``differentiable``) at or below this count as zero when
# listing alignments; hard strategies (top-k, top-p, ...) are exactly 0 or 1.
MIN_LISTED_ALIGNMENT = 1e-6
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


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TokenizedText:
    """A text as the encoder sees it: ids ``[CLS] … [SEP]`` (truncated) with character offsets.

    Attributes:
      text: the original text.
      token_ids: ``[n]`` int32 ids.
      offsets: ``[n, 2]`` character spans ``text[start:end]``; special tokens have empty spans.
      tokens: the ``n`` WordPiece strings.
      max_length: the token budget the text was truncated to.
    """

    text: str
    token_ids: np.ndarray
    offsets: np.ndarray
    tokens: tuple[str, ...]
    max_length: int

    @property
    def special(self) -> np.ndarray:
        """``[n]`` bool: special tokens ([CLS], [SEP]), i.e. those covering no characters."""
        return self.offsets[:, 0] == self.offsets[:, 1]

    @property
    def truncated(self) -> bool:
        """True when the text had more tokens than ``max_length`` (its tail is not encoded)."""
        if len(self.token_ids) < self.max_length:
            return False
        real = np.flatnonzero(~self.special)
        end = int(self.offsets[real[-1], 1]) if len(real) else 0
        return bool(self.text[end:].strip())


def tokenize_text(tokenizer: tokenization.Tokenizer, text: str, max_length: int) -> TokenizedText:
    """Tokenises ``text`` exactly as the encoder does, keeping the character offsets."""
    ids, offsets = tokenizer.encode_with_offsets(text, max_length)
    return TokenizedText(
        text=text,
        token_ids=ids,
        offsets=offsets,
        tokens=tuple(tokenizer.ids_to_tokens(ids)),
        max_length=int(max_length),
    )


@dataclasses.dataclass(frozen=True)
class Word:
    """A word for display: merged word pieces (or one special token).

    Attributes:
      text: the word as written in the original text (case and accents kept); the token itself
        (e.g. ``[CLS]``) for special tokens.
      pieces: its WordPiece tokens, e.g. ``('token', '##ization')``.
      positions: their token positions.
      span: ``(start, end)`` characters in the original text; ``None`` for special tokens.
      salience: max of the pieces' unary saliences u (Eq. 3).
      representative: the position of its most salient piece (the earlier one on ties), whose
        alignments are shown for the word.
      special: a special token ([CLS], [SEP]).
      highlighted: at least one piece is among the top β of its text's tokens by salience.
    """

    text: str
    pieces: tuple[str, ...]
    positions: tuple[int, ...]
    span: tuple[int, int] | None
    salience: float
    representative: int
    special: bool
    highlighted: bool


@dataclasses.dataclass(frozen=True)
class Alignment:
    """One nonzero entry of the pairwise alignment Ã (token level, with the words it joins).

    Attributes:
      query_word, doc_word: indices into ``Explanation.query_words`` / ``doc_words``.
      query_position, doc_position: token positions i and j.
      rank: 1-based rank of S_ij among the document tokens aligned with query token i (by
        decreasing similarity; Table 5's superscripts for top-k).
      similarity: S_ij = q_iᵀd_j (§2.2).
      pairwise: Ã_ij (1 for hard strategies).
      query_salience, doc_salience: u^q_i and u^d_j.
      weight: A_ij = Ã_ij · u^q_i · u^d_j (Eq. 2).
    """

    query_word: int
    doc_word: int
    query_position: int
    doc_position: int
    rank: int
    similarity: float
    pairwise: float
    query_salience: float
    doc_salience: float
    weight: float


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Everything shown for one query–document pair (see the module docstring).

    Attributes:
      model_name: ``EncoderBundle.name``.
      alignment: the canonical spelling of the alignment strategy.
      beta_q, beta_d, num_aligned: the display settings.
      query, doc: the tokenised texts.
      query_encoded, doc_encoded: token ids, vectors and saliences from the encoder.
      query_words, doc_words: merged words in text order.
      similarity: ``[n, m]`` S = q dᵀ.
      alignments: every nonzero Ã_ij (``> MIN_LISTED_ALIGNMENT``), by query position, then rank.
      top_query_words: indices into ``query_words`` of the ``num_aligned`` most salient non-special
        words (decreasing salience; on equal salience, the word whose representative token has
        the most similar aligned document token first, then the earlier word).
      score: sim(Q, D) of Eq. 1–2 under ``alignment`` (``scoring.alignment_scores``).
      uniform_salience: every token has the same salience (e.g. a model without salience heads,
        u = 1), so the salience colours and top-β marks carry no information.
    """

    model_name: str
    alignment: str
    beta_q: float
    beta_d: float
    num_aligned: int
    query: TokenizedText
    doc: TokenizedText
    query_encoded: EncodedText
    doc_encoded: EncodedText
    query_words: tuple[Word, ...]
    doc_words: tuple[Word, ...]
    similarity: np.ndarray
    alignments: tuple[Alignment, ...]
    top_query_words: tuple[int, ...]
    score: float
    uniform_salience: bool

    def word_alignments(self, query_word: int) -> list[Alignment]:
        """The alignments of a query word's representative token, by rank."""
        position = self.query_words[query_word].representative
        return [a for a in self.alignments if a.query_position == position]


# ---------------------------------------------------------------------------------------------
# Computation
# ---------------------------------------------------------------------------------------------


def _check_ratio(name: str, value: float) -> float:
    if not isinstance(value, int | float) or not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name}={value!r} (flag --{name}): must be a fraction in (0, 1].")
    return float(value)


def merge_words(tokens_text: TokenizedText, salience: np.ndarray, beta: float) -> tuple[Word, ...]:
    """Merges word pieces into ``Word``s with max salience and the top-β mark."""
    salience = np.asarray(salience, dtype=np.float32)
    if len(salience) != len(tokens_text.token_ids):
        raise ValueError(
            f"{len(salience)} saliences for {len(tokens_text.token_ids)} tokens of "
            f"{tokens_text.text[:60]!r}: the encoding does not match the tokenisation."
        )
    kept = set(pruning.top_fraction(salience, beta).tolist())
    special = tokens_text.special
    words = []
    for token, positions in tokenization.merge_wordpieces(list(tokens_text.tokens)):
        is_special = len(positions) == 1 and bool(special[positions[0]])
        if is_special:
            text, span = token, None
        else:
            # Pieces after a special token never merge into it (merge_wordpieces only joins "##").
            start = int(tokens_text.offsets[positions[0], 0])
            end = int(tokens_text.offsets[positions[-1], 1])
            text, span = tokens_text.text[start:end], (start, end)
        pieces_salience = salience[positions]
        words.append(
            Word(
                text=text,
                pieces=tuple(tokens_text.tokens[p] for p in positions),
                positions=tuple(positions),
                span=span,
                salience=float(pieces_salience.max()),
                representative=int(positions[int(np.argmax(pieces_salience))]),
                special=is_special,
                highlighted=any(p in kept for p in positions),
            )
        )
    return tuple(words)


def _word_of_position(words: Sequence[Word], length: int) -> np.ndarray:
    out = np.full(length, -1, np.int64)
    for index, word in enumerate(words):
        out[list(word.positions)] = index
    return out


def explain_encoded(
    query: TokenizedText,
    doc: TokenizedText,
    query_encoded: EncodedText,
    doc_encoded: EncodedText,
    alignment: str | scoring.AlignmentStrategy = DEFAULT_ALIGNMENT,
    beta_q: float = DEFAULT_BETA_Q,
    beta_d: float = DEFAULT_BETA_D,
    num_aligned: int = DEFAULT_NUM_ALIGNED,
    model_name: str = "",
) -> Explanation:
    """An ``Explanation`` from already encoded texts (no model needed; used by ``explain``).

    Args:
      query, doc: tokenised texts (``tokenize_text``).
      query_encoded, doc_encoded: their encodings (same token ids).
      alignment: a strategy spelling (``scoring.AlignmentStrategy.parse``), e.g. ``top_k:4``.
      beta_q, beta_d: fractions of query / document tokens marked as most salient (Table 4).
      num_aligned: how many of the most salient query words are linked to their alignments.
      model_name: shown on the page.
    """
    strategy = scoring.AlignmentStrategy.parse(alignment)
    beta_q = _check_ratio("beta_q", beta_q)
    beta_d = _check_ratio("beta_d", beta_d)
    if not isinstance(num_aligned, int) or isinstance(num_aligned, bool) or num_aligned < 0:
        raise ValueError(f"num_aligned={num_aligned!r} (flag --num_aligned): must be an int >= 0.")
    for name, tok, enc in (("query", query, query_encoded), ("document", doc, doc_encoded)):
        if not np.array_equal(np.asarray(tok.token_ids), np.asarray(enc.token_ids)):
            raise ValueError(f"The {name} encoding's token ids differ from its tokenisation.")

    u_q = np.asarray(query_encoded.salience, np.float32)
    u_d = np.asarray(doc_encoded.salience, np.float32)
    q_vectors = np.asarray(query_encoded.vectors, np.float32)
    d_vectors = np.asarray(doc_encoded.vectors, np.float32)
    s = q_vectors @ d_vectors.T  # S_ij = q_iᵀ d_j (§2.2)
    n, m = s.shape
    q_mask, d_mask = np.ones(n, bool), np.ones(m, bool)
    q_ids = jnp.asarray(query.token_ids)
    d_ids = jnp.asarray(doc.token_ids)
    pairwise = np.asarray(
        scoring.pairwise_alignment(jnp.asarray(s), q_mask, d_mask, strategy, q_ids, d_ids)
    )
    score = float(
        scoring.alignment_scores(
            jnp.asarray(s),
            q_mask,
            d_mask,
            strategy,
            jnp.asarray(u_q),
            jnp.asarray(u_d),
            q_ids,
            d_ids,
        )
    )

    query_words = merge_words(query, u_q, beta_q)
    doc_words = merge_words(doc, u_d, beta_d)
    q_word_of = _word_of_position(query_words, n)
    d_word_of = _word_of_position(doc_words, m)
    alignments = []
    for i in range(n):
        aligned = np.flatnonzero(pairwise[i] > MIN_LISTED_ALIGNMENT)
        # By decreasing S_ij, earlier token first on ties (the order of lax.top_k).
        aligned = aligned[np.argsort(-s[i, aligned], kind="stable")]
        for rank, j in enumerate(aligned.tolist(), start=1):
            alignments.append(
                Alignment(
                    query_word=int(q_word_of[i]),
                    doc_word=int(d_word_of[j]),
                    query_position=i,
                    doc_position=j,
                    rank=rank,
                    similarity=float(s[i, j]),
                    pairwise=float(pairwise[i, j]),
                    query_salience=float(u_q[i]),
                    doc_salience=float(u_d[j]),
                    weight=float(pairwise[i, j] * u_q[i] * u_d[j]),
                )
            )
    # Most salient first; among equal saliences (e.g. u = 1 everywhere) the word whose
    # representative token has the strongest alignment, then the earlier word (stable sort).
    best_similarity = {}
    for a in alignments:
        if a.query_position == query_words[a.query_word].representative:
            best = best_similarity.get(a.query_word, -math.inf)
            best_similarity[a.query_word] = max(best, a.similarity)
    candidates = [k for k, w in enumerate(query_words) if not w.special]
    candidates.sort(key=lambda k: (-query_words[k].salience, -best_similarity.get(k, -math.inf)))
    all_u = np.concatenate([u_q, u_d])
    return Explanation(
        model_name=model_name,
        alignment=str(strategy),
        beta_q=beta_q,
        beta_d=beta_d,
        num_aligned=num_aligned,
        query=query,
        doc=doc,
        query_encoded=query_encoded,
        doc_encoded=doc_encoded,
        query_words=query_words,
        doc_words=doc_words,
        similarity=s,
        alignments=tuple(alignments),
        top_query_words=tuple(candidates[:num_aligned]),
        score=score,
        uniform_salience=bool(np.all(all_u == all_u[0])) if len(all_u) else True,
    )


def explain(
    bundle: EncoderBundle,
    query_text: str,
    doc_text: str,
    alignment: str | scoring.AlignmentStrategy = DEFAULT_ALIGNMENT,
    beta_q: float = DEFAULT_BETA_Q,
    beta_d: float = DEFAULT_BETA_D,
    num_aligned: int = DEFAULT_NUM_ALIGNED,
    encoder: Encoder | None = None,
) -> Explanation:
    """Encodes a query and a document with ``bundle`` and explains their score.

    Args:
      bundle: the encoder (``loading.load_encoder()``).
      query_text, doc_text: the texts (a BEIR document as ``beir.document_text(doc)``).
      alignment: the pairwise alignment strategy of the score, e.g. ``top_k:1`` (ColBERT) or
        ``top_k:4`` (Table 5).
      beta_q, beta_d: fractions of query / document tokens marked as most salient.
      num_aligned: how many of the most salient query words are linked to their alignments.
      encoder: an ``Encoder`` of ``bundle`` to reuse (its jitted functions) across calls.

    Returns:
      An ``Explanation``; ``render_html`` turns it into a page.
    """
    strategy = scoring.AlignmentStrategy.parse(alignment)  # fail before encoding
    for name, text in (
        ("query_text (flag --query)", query_text),
        ("doc_text (flag --document)", doc_text),
    ):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{name} is empty: give a non-empty text to explain.")
    encoder = encoder or Encoder(bundle)
    cfg = bundle.config
    query = tokenize_text(bundle.tokenizer, query_text, cfg.maxlen("query"))
    doc = tokenize_text(bundle.tokenizer, doc_text, cfg.maxlen("doc"))
    ((_, query_encoded),) = encoder.encode_token_ids([query.token_ids], "query")
    ((_, doc_encoded),) = encoder.encode_token_ids([doc.token_ids], "doc")
    return explain_encoded(
        query,
        doc,
        query_encoded,
        doc_encoded,
        alignment=strategy,
        beta_q=beta_q,
        beta_d=beta_d,
        num_aligned=num_aligned,
        model_name=bundle.name,
    )


# ---------------------------------------------------------------------------------------------
# BEIR input
# ---------------------------------------------------------------------------------------------


def load_pair(
    dataset_dir: str | Path, query_id: str | None, doc_id: str | None
) -> tuple[str | None, str | None]:
    """Query text and document text (``title + " " + text``) by id from a BEIR folder.

    Either id may be None (that text then comes from elsewhere). Raises ``errors.BeirFormatError``
    naming the id and the file when an id is absent (or the file is missing or malformed).
    """
    dataset_dir = Path(dataset_dir)
    if not dataset_dir.is_dir():
        raise errors.BeirFormatError(
            f"--dataset_dir={dataset_dir}: not a folder; give a BEIR folder with corpus.jsonl "
            "and queries.jsonl."
        )
    query_text = doc_text = None
    if query_id is not None:
        path = dataset_dir / "queries.jsonl"
        queries = beir.load_queries(path)
        if query_id not in queries:
            examples = ", ".join(repr(q) for q in list(queries)[:5])
            raise errors.BeirFormatError(
                f"--query_id={query_id!r}: no query with this id in {path} ({len(queries)} "
                f"queries; the first ids are {examples})."
            )
        query_text = queries[query_id]
    if doc_id is not None:
        path = dataset_dir / "corpus.jsonl"
        count, first = 0, []
        for doc in beir.iter_corpus(path, check_duplicates=False):
            if doc.doc_id == doc_id:
                doc_text = beir.document_text(doc)
                break
            count += 1
            if len(first) < 5:
                first.append(repr(doc.doc_id))
        else:
            raise errors.BeirFormatError(
                f"--doc_id={doc_id!r}: no document with this id in {path} ({count} documents; "
                f"the first ids are {', '.join(first)})."
            )
    return query_text, doc_text


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


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


_CSS = """
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
) -> str:
    """The text with one ``<span>`` per word (original spelling, gaps kept)."""
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
    query_color, doc_marks = _word_links(ex)
    n, m = ex.similarity.shape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>ALIGNER explanation: {_esc(ex.query.text[:80])}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>ALIGNER: pairwise alignment and unary salience</h1>",
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
        + ", with the alignment rank as superscript (1), (2), … (Table 5). [CLS]/[SEP] are greyed; they still count in the score. Hover a word for u.</p>",
        "<h2>Query</h2>",
        f'<div class="text" id="query">'
        f"{_render_text(ex.query, ex.query_words, query_color, {}, False, 'query')}</div>",
        "<h2>Document</h2>",
        f'<div class="text" id="document">'
        f"{_render_text(ex.doc, ex.doc_words, {}, doc_marks, True, 'doc')}</div>",
    ]

    parts += [
        f"<h2>Alignments of the {len(ex.top_query_words)} most salient query words</h2>",
        '<table id="top-alignments"><tr><th>query word</th><th>u<sup>q</sup></th>'
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
        '<table id="all-alignments"><tr><th>query token</th><th>document token</th>'
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
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def format_summary(ex: Explanation, top_alignments: int = 4) -> str:
    """A short plain-text summary: model, strategy, score and the linked words' alignments."""
    n, m = ex.similarity.shape
    lines = [
        f"model      {ex.model_name}",
        f"alignment  {ex.alignment}",
        f"score      sim(Q, D) = {ex.score:.6f}  (query n={n} tokens, document m={m} tokens"
        + (", truncated" if ex.doc.truncated else "")
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
        raise IsADirectoryError(f"--output={output} is a folder; give a file name such as x.html.")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(render_html(ex), encoding="utf-8")
    return output
