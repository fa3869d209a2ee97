"""Explaining one query–document score: unary saliences and pairwise alignments (paper §4.4).

ALIGNER's score factorises into pairwise alignment and unary salience (Eq. 2,
A = Ã ⊙ (u^q ⊗ u^d)), both of which can be read off a single query–document pair. This module and
``explanation_html`` show them the way Table 4 and Appendix A.3 Table 5 of the paper do:

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
    ex = explanation.explain(bundle, "what is a fathom", "a fathom is six feet", alignment="top_k:4")
    html_text = explanation_html.render_html(ex)

This module computes (the data model and the numbers); ``explanation_html`` renders them. The
command line is ``aligner-explain`` (``aligner_jax/explain.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from aligner_jax.common import checks
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import pruning, scoring
from aligner_jax.data import beir
from aligner_jax.encoding import tokenization
from aligner_jax.encoding.encoder import EncodedText, Encoder, EncoderBundle
from aligner_jax.indexing.indexer import IndexingConfig, stored_rows

DEFAULT_ALIGNMENT = "top_k:1"
DEFAULT_BETA_Q = 0.5  # Table 4: the top 50% of query tokens are highlighted
DEFAULT_BETA_D = 0.2  # Table 4: the top 20% of document tokens are highlighted
DEFAULT_NUM_ALIGNED = 3  # Table 4: the three most salient query tokens
# aligner-explain takes the bindings aligner-eval uses for the alignment and the pruning fractions
# (Table 4's values when they are not bound).
GIN_SETTINGS = {
    "alignment": "evaluate.alignment",
    "beta_q": "SearchConfig.beta_q",
    "beta_d": "SearchConfig.beta_d",
}
# Entries of a soft pairwise alignment (``differentiable``) at or below this count as zero when
# listing alignments; hard strategies (top-k, top-p, ...) are exactly 0 or 1.
MIN_LISTED_ALIGNMENT = 1e-6


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
      unstored_doc_tokens: document tokens an index does not store (``doc_stored``), which
        align to nothing, as in the index's scores.
      unstored_doc_positions: their positions (the page marks their words).
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
    unstored_doc_tokens: int = 0
    unstored_doc_positions: tuple[int, ...] = ()

    def word_alignments(self, query_word: int) -> list[Alignment]:
        """The alignments of a query word's representative token, by rank."""
        position = self.query_words[query_word].representative
        return [a for a in self.alignments if a.query_position == position]


# ---------------------------------------------------------------------------------------------
# Computation
# ---------------------------------------------------------------------------------------------


def settings_from_gin() -> dict:
    """``alignment``, ``beta_q`` and ``beta_d`` from the parsed gin config (``GIN_SETTINGS``: the
    bindings of ``aligner-eval``), Table 4's defaults where unbound."""
    out = {"alignment": DEFAULT_ALIGNMENT, "beta_q": DEFAULT_BETA_Q, "beta_d": DEFAULT_BETA_D}
    for key, binding in GIN_SETTINGS.items():
        out[key] = checks.bound_value(binding, out[key])
    return out


def _check_ratio(name: str, value: float) -> float:
    if not isinstance(value, int | float) or not 0.0 < float(value) <= 1.0:
        raise ConfigError(
            f"{name}={value!r} (--gin.{GIN_SETTINGS[name]}): must be a fraction in (0, 1]."
        )
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
    doc_stored: np.ndarray | None = None,
) -> Explanation:
    """An ``Explanation`` from already encoded texts (no model needed; used by ``explain``).

    Args:
      query, doc: tokenised texts (``tokenize_text``).
      query_encoded, doc_encoded: their encodings (same token ids).
      alignment: a strategy spelling (``scoring.AlignmentStrategy.parse``), e.g. ``top_k:4``.
      beta_q, beta_d: fractions of query / document tokens marked as most salient (Table 4).
      num_aligned: how many of the most salient query words are linked to their alignments.
      model_name: shown on the page.
      doc_stored: the positions of the document tokens an index stores
        (``indexer.stored_rows``); None: every token.
    """
    strategy = scoring.AlignmentStrategy.parse(alignment)
    beta_q = _check_ratio("beta_q", beta_q)
    beta_d = _check_ratio("beta_d", beta_d)
    if not isinstance(num_aligned, int) or isinstance(num_aligned, bool) or num_aligned < 0:
        raise ConfigError(f"num_aligned={num_aligned!r} (flag --num_aligned): must be an int >= 0.")
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
    if doc_stored is not None:  # as the index scores it: tokens it does not store take no part
        d_mask = np.zeros(m, bool)
        d_mask[np.asarray(doc_stored, np.int64)] = True
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
        unstored_doc_tokens=int(m - d_mask.sum()),
        unstored_doc_positions=tuple(int(j) for j in np.flatnonzero(~d_mask)),
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
    stored: IndexingConfig | None = None,
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
      stored: the indexing settings whose stored tokens the score uses (an index leaves out
        tokens of salience 0 by default: ``indexer.stored_rows``); None: every token.

    Returns:
      An ``Explanation``; ``render_html`` turns it into a page.
    """
    strategy = scoring.AlignmentStrategy.parse(alignment)  # fail before encoding
    for name, text in (
        ("query_text (flag --query)", query_text),
        ("doc_text (flag --document)", doc_text),
    ):
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{name} is empty: give a non-empty text to explain.")
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
        doc_stored=None if stored is None else stored_rows(doc_encoded.salience, stored),
    )


# ---------------------------------------------------------------------------------------------
# BEIR input
# ---------------------------------------------------------------------------------------------


def pair_texts(
    query: str | None,
    document: str | None,
    dataset_dir: str | None = None,
    query_id: str | None = None,
    doc_id: str | None = None,
) -> tuple[str, str]:
    """The query and document texts of ``aligner-explain``: each given as a text or as an id of
    the BEIR folder ``dataset_dir``. Raises ``ConfigError`` naming the flag to fix."""
    for text_flag, text, id_flag, ident in (
        ("query", query, "query_id", query_id),
        ("document", document, "doc_id", doc_id),
    ):
        if (text is None) == (ident is None):
            raise ConfigError(
                f"give exactly one of --{text_flag} (a text) and --{id_flag} (an id with "
                "--dataset_dir)"
            )
    if (query_id is not None or doc_id is not None) and not dataset_dir:
        raise ConfigError("--query_id and --doc_id need --dataset_dir (a BEIR folder)")
    if dataset_dir and query_id is None and doc_id is None:
        raise ConfigError("--dataset_dir is only used with --query_id or --doc_id")
    if dataset_dir:
        by_id = beir.load_pair(dataset_dir, query_id, doc_id)
        query = by_id[0] if query_id is not None else query
        document = by_id[1] if doc_id is not None else document
    for flag, text in (("--query", query), ("--document", document)):
        if not text.strip():
            raise ConfigError(f"{flag}: the text is empty")
    return query, document
