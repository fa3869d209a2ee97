"""miniCOIL: BM25 whose matches are weighted by how alike the two occurrences' meanings are.

The article's score (seed 002) of a document D for a query Q is

    score(D, Q) = Σ_{q_i ∈ Q ∩ D} IDF(q_i) · Importance^{q_i}_D · Meaning^{q_i × d_j}

with BM25's Lucene IDF and term-frequency importance (k1 = 1.2, b = 0.75, bm25s's ``lucene``
variant: ``tf / (tf + k1 · (1 − b + b · |D| / avgdl))``), the words of the BM25 baseline
(``lexical.words``), and Meaning computed from the cosine of the two occurrences' unit meaning
vectors m (``lexical.meaning``; a word occurring several times in D gets one vector: its model
applied to the mean contextual vector of its occurrences, as FastEmbed's miniCOIL does):

  * ``MiniCoilConfig.meaning = "nonnegative"`` (the default): Meaning = (1 + cos) / 2 ∈ [0, 1], the
    cosine mapped affinely onto [0, 1]: a shared word whose meanings agree counts as in BM25, one
    whose meanings are opposite counts nothing, and no exact match ever *lowers* a document's
    score (BM25's premise that a matched query word adds evidence, never subtracts it);
  * ``"cosine"``: Meaning = cos ∈ [−1, 1], the article's formula as written (a match whose
    meanings disagree is a penalty).

A word with no meaning model scores as plain BM25 (Meaning = 1). Note (1 + cos) / 2 scores are
exactly the mean of the ``cosine`` score and plain BM25's.

As a sparse vector (any inverted index can serve it): each word with a model owns ``dim``
consecutive cells holding ``Importance · m(d_j)`` (a unit vector scaled by the BM25 weight) — with
``nonnegative``, ``dim + 1`` cells holding ``Importance · [1, m(d_j)] / √2``, whose leading cell
carries the constant ½ of (1 + cos) / 2 — and a word without one owns one cell holding
``Importance``; the query side holds ``count · m(q_i)`` (``count · [1, m(q_i)] / √2``) or
``count`` (a query word counts once per occurrence, as in bm25s). Then

    score = query_matrix · diag(idf) · doc_matrixᵀ

Retrieval returns, like ``data.bm25.BM25Index.search``, only documents that share a word with the
query, best first (with ``cosine``, a shared word whose meanings disagree can make a score ≤ 0).

Meaning models are fitted on the corpus itself unless saved ones are given: words (stems of at
least ``min_word_length`` letters) found in at least ``min_sentences`` sentences get a model; each
trains on up to ``sentences_per_word`` of its sentences (and their snippets), 20 % held out for
validation, with triplets from the teacher's sentence similarities (``lexical.triplets``). No
labels are used.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import gin
import numpy as np
import scipy.sparse as sp
from absl import logging

from aligner_jax.common import checks, fileio, progress
from aligner_jax.common.errors import ConfigError, IndexIntegrityError, MissingPathError
from aligner_jax.data import bm25
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import Encoder
from aligner_jax.lexical import meaning, triplets, words
from aligner_jax.lexical.teacher import MeanPooledTeacher

FORMAT = "aligner_jax.minicoil/1"
DIMS = (4, 8, 16)
TEACHERS = ("minilm", "encoder")
MEANINGS = ("nonnegative", "cosine")
_DOC, _QUERY = "doc", "query"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MiniCoilConfig:
    """miniCOIL's scoring and meaning-model settings (gin: ``MiniCoilConfig.dim = 8``).

    Attributes:
      dim: meaning vector size: 4 (the article's), 8 or 16.
      meaning: how the two occurrences' cosine enters the score. ``nonnegative`` (default):
        (1 + cos) / 2 ∈ [0, 1], so an exact match is never a penalty, with one more cell per word
        with a model (``dim + 1``); ``cosine``: the article's cos ∈ [−1, 1] (``dim`` cells).
        Why: the per-word models are fitted on ≤ 32 sentences each (the article: 8,000) and
        order only ~65–75 % of held-out teacher triplets correctly; with ``cosine`` every shared
        word whose meaning vectors happen to point apart *subtracts* its BM25 weight, so the
        errors of weak models cost more than their right answers gain. The affine map onto
        [0, 1] is the one shift with no free parameter that keeps every match's contribution in
        [0, BM25's] (no penalty, no bonus above BM25), and it is expressible in the sparse
        representation (a constant leading cell), unlike ``max(cos, 0)``. Measured after the
        choice (test split, 4d, ``benchmarks/results/minicoil_nonneg.md``): SciFact 67.4 → 68.6
        nDCG@10 (BM25 67.9), CISI 41.2 → 40.7 (BM25 38.1). The article's own advantage of
        per-word models, "flexibly discover and adjust underperforming words", was tried as a
        label-free gate (a word keeps its model only when its validation triplet accuracy is
        significantly above chance, one-sided binomial p < 0.05, or at least the raw input
        vectors'): with ~15 validation triplets per word the test has little power, and the gate
        lowered SciFact (67.2) and CISI (39.2) at 4d, so it is not used.
      k1, b: BM25 parameters of the importance and of the fallback (article: 1.2, 0.75).
      margin: minimum teacher margin of a training triplet (article: 0.1; at least 0.1).
      min_sentences: a word gets a model when it occurs in at least this many sentences (50: a
        model of ``D·dim`` weights trained on fewer sentences memorises them; on SciFact, words in
        10–50 sentences cost 1.1 nDCG@10 against BM25's fallback, CISI was unchanged —
        ``benchmarks/results/minicoil_min50.md``; both with ``meaning="cosine"``, and 50 was
        read off those test figures. With the nonnegative meaning those words no longer cost:
        10 gives SciFact 69.2 and CISI 41.4 nDCG@10 at 4d against 68.6 / 40.7 with 50 — kept at
        50 all the same, not re-chosen on test figures a second time).
      max_words: at most this many models (the words in most sentences); None: no limit.
      min_word_length: words (stems) shorter than this get no model (article: 3).
      sentences_per_word: sentences sampled per word for training + validation.
      validation_fraction: share of each word's sentences held out (article: 20 %).
      triplets_per_word: training triplets per word (validation: a quarter of it).
      augment: add the article's snippet augmentation (word with 1–3 neighbours each side).
      augment_fraction: share of the training sentences that also get a snippet (1.0: all, as
        in the article; less saves encoder time, each snippet is one more short encoder input).
      input_rank: the encoder vectors are first reduced to their top ``input_rank`` principal
        directions (one shared linear map fitted on the training occurrences), so each word's
        layer has ``input_rank × dim`` parameters to fit from its few sentences; None: the full
        vectors (the article's layer, fitted there on 8000 sentences per word).
      steps: full-batch Adam steps (all words at once).
      learning_rate: Adam learning rate.
      weight_decay: decoupled weight decay of the per-word layers (AdamW).
      seed: sampling and initialisation seed.
      teacher: ``minilm`` (bundled all-MiniLM-L6-v2, mean-pooled; the default) or ``encoder``
        (no extra encoder pass: the mean of the sentence's word vectors from the corpus pass,
        i.e. the encoder's token vectors of its non-stop-words).
        ``MiniCoilIndex.build(teacher=...)`` takes any callable ``texts -> [n, d]`` instead.
    """

    dim: int = 4
    meaning: str = "nonnegative"
    k1: float = 1.2
    b: float = 0.75
    margin: float = 0.1
    min_sentences: int = 50
    max_words: int | None = None
    min_word_length: int = 3
    sentences_per_word: int = 32
    validation_fraction: float = 0.2
    triplets_per_word: int = 256
    augment: bool = True
    augment_fraction: float = 1.0
    input_rank: int | None = None
    steps: int = 150
    learning_rate: float = 1e-2
    weight_decay: float = 0.0
    seed: int = 0
    teacher: str = "minilm"

    def __post_init__(self):
        name = type(self).__name__
        checks.choice(f"{name}.dim", self.dim, DIMS)
        checks.choice(f"{name}.meaning", self.meaning, MEANINGS)
        checks.number(f"{name}.k1", self.k1, 0.0)
        checks.number(f"{name}.b", self.b, 0.0, 1.0)
        checks.number(f"{name}.margin", self.margin, 0.1, 2.0)
        checks.integer(f"{name}.min_sentences", self.min_sentences, minimum=4)
        checks.integer(f"{name}.max_words", self.max_words, minimum=1, allow_none=True)
        checks.integer(f"{name}.min_word_length", self.min_word_length, minimum=1)
        checks.integer(f"{name}.sentences_per_word", self.sentences_per_word, minimum=4)
        checks.number(f"{name}.validation_fraction", self.validation_fraction, 0.0, 0.5)
        checks.integer(f"{name}.triplets_per_word", self.triplets_per_word, minimum=4)
        checks.choice(f"{name}.augment", self.augment, (True, False))
        checks.number(f"{name}.augment_fraction", self.augment_fraction, 0.0, 1.0)
        checks.integer(f"{name}.steps", self.steps, minimum=0)
        checks.number(f"{name}.learning_rate", self.learning_rate, 0.0, low_open=True)
        checks.integer(f"{name}.input_rank", self.input_rank, minimum=1, allow_none=True)
        checks.number(f"{name}.weight_decay", self.weight_decay, 0.0)
        checks.integer(f"{name}.seed", self.seed, minimum=0)
        checks.choice(f"{name}.teacher", self.teacher, TEACHERS)


@dataclasses.dataclass
class _Corpus:
    """The analysed corpus: per sentence its words as ``(stem id, start, end)``."""

    stems: list[str]
    sentences: list[str]
    sentence_doc: np.ndarray  # [num_sentences]
    sentence_words: list[list[tuple[int, int, int]]]
    doc_tf: sp.csr_matrix  # [num_docs, num_stems] counts
    doc_len: np.ndarray  # [num_docs] analysed words


def _analyse(texts: Sequence[str], analyzer: words.Analyzer) -> _Corpus:
    stem_id: dict[str, int] = {}
    sentences, sentence_doc, sentence_words = [], [], []
    rows, cols = [], []
    for d, text in enumerate(texts):
        for start, end in words.sentence_spans(text):
            sentence = text[start:end]
            found = []
            for w in analyzer.analyze(sentence):
                sid = stem_id.setdefault(w.stem, len(stem_id))
                found.append((sid, w.start, w.end))
                rows.append(d)
                cols.append(sid)
            sentences.append(sentence)
            sentence_doc.append(d)
            sentence_words.append(found)
    doc_tf = sp.csr_matrix(
        (np.ones(len(rows), np.float32), (np.asarray(rows, np.int64), np.asarray(cols, np.int64))),
        shape=(len(texts), len(stem_id)),
    )
    doc_tf.sum_duplicates()
    return _Corpus(
        stems=list(stem_id),
        sentences=sentences,
        sentence_doc=np.asarray(sentence_doc, np.int64),
        sentence_words=sentence_words,
        doc_tf=doc_tf,
        doc_len=np.asarray(doc_tf.sum(axis=1)).ravel(),
    )


def _encode_spans(
    encoder: Encoder,
    texts: Sequence[str],
    spans: Sequence[Sequence[tuple[int, int]]],
    kind: str,
    desc: str | None = None,
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """Contextual vectors of character spans: yields ``(text index, span indices [k],
    vectors [k, D])``, each vector the mean of the encoder's vectors of the word-pieces covering
    the span. A text longer than the encoder's budget is encoded in windows (cut between words
    where possible); a span no piece covers is not yielded."""
    tokenizer = encoder.bundle.tokenizer
    if not hasattr(tokenizer, "encode_pieces_with_offsets"):
        raise ConfigError(
            "miniCOIL needs a WordPiece tokenizer with character offsets (load_encoder.tokenizer); "
            f"{type(tokenizer).__name__} has none"
        )
    width = encoder.maxlen(kind) - 2
    windows: list[np.ndarray] = []
    members: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
    for t, (ids, offsets) in enumerate(tokenizer.encode_pieces_with_offsets(list(texts))):
        if not len(spans[t]) or not len(ids):
            continue
        pieces = words.pieces_of_words(offsets, spans[t])
        first = np.array([p[0] if len(p) else -1 for p in pieces])
        last = np.array([p[-1] + 1 if len(p) else -1 for p in pieces])
        start = 0
        while start < len(ids):
            end = min(start + width, len(ids))
            if end < len(ids):  # back off to a cut between words (white space before `end`)
                for cut in range(end, max(start + 1, end - 32), -1):
                    if offsets[cut, 0] > offsets[cut - 1, 1]:
                        end = cut
                        break
            inside = np.flatnonzero((first >= start) & (first < end))
            if len(inside):
                window = np.concatenate(
                    [[tokenizer.cls_id], ids[start:end], [tokenizer.sep_id]]
                ).astype(np.int32)
                lo = first[inside] - start + 1
                hi = np.minimum(last[inside], end) - start + 1
                windows.append(window)
                members.append((t, inside, lo, hi))
            start = end
    bar = progress.Progress(len(windows), desc or "encoding", "window", enabled=desc is not None)
    for w, encoded in _with_closing(bar, encoder.encode_token_ids(windows, kind, bar=bar)):
        t, inside, lo, hi = members[w]
        cs = np.concatenate(
            [
                np.zeros((1, encoded.vectors.shape[1]), np.float32),
                np.cumsum(encoded.vectors, axis=0, dtype=np.float32),
            ]
        )
        yield t, inside, (cs[hi] - cs[lo]) / (hi - lo)[:, None]


_HALF_SQRT = float(np.sqrt(0.5))


def meaning_cells(m: np.ndarray, meaning_kind: str) -> np.ndarray:
    """The cells of a word with a model, before its BM25 weight or query count: ``m [n, dim]``
    (unit meaning vectors) for ``cosine``; ``[1, m] / √2`` (``[n, dim + 1]``) for
    ``nonnegative``, so that the product of a query's and a document's cells is
    ``(1 + cos) / 2``."""
    m = np.asarray(m, np.float32)
    if meaning_kind == "cosine":
        return m
    return _HALF_SQRT * np.concatenate([np.ones((len(m), 1), np.float32), m], axis=1)


def _with_closing(bar: progress.Progress, items: Iterator) -> Iterator:
    """``items``, then the bar closed (its summary line), also when the caller stops early."""
    with bar:
        yield from items


def _input_dim(encoder: Encoder) -> int:
    return int(encoder.dim)


class MiniCoilIndex:
    """miniCOIL over a corpus: sparse document vectors, idf, meaning models (see the module)."""

    def __init__(
        self,
        doc_ids: Sequence[str],
        stems: Sequence[str],
        cell_offset: np.ndarray,
        idf: np.ndarray,
        doc_matrix: sp.csr_matrix,
        doc_terms: sp.csr_matrix,
        models: meaning.MeaningModels,
        config: MiniCoilConfig,
        encoder: Encoder,
        analyzer: words.Analyzer,
        report: dict | None = None,
    ):
        self.doc_ids = list(doc_ids)
        self.stems = list(stems)
        self.stem_id = {s: i for i, s in enumerate(self.stems)}
        self.cell_offset = np.asarray(cell_offset, np.int64)  # [num_stems + 1]
        self.idf = np.asarray(idf, np.float32)  # [num_cells]
        self.doc_matrix = doc_matrix.tocsr()
        self.doc_terms = doc_terms.tocsr()  # [num_docs, num_stems] term counts
        self.models = models
        self.config = config
        self.encoder = encoder
        self.analyzer = analyzer
        self.report = report or {}
        model_index = models.index()
        self.model_of_stem = np.array([model_index.get(s, -1) for s in self.stems], np.int64)

    # ------------------------------------------------------------------ building

    @classmethod
    def build(
        cls,
        doc_ids: Sequence[str],
        texts: Sequence[str],
        encoder: Encoder,
        config: MiniCoilConfig | None = None,
        models_path: str | None = None,
        teacher: Callable[[Sequence[str]], np.ndarray] | None = None,
    ) -> MiniCoilIndex:
        """Indexes ``texts``; fits the meaning models on them (no labels) unless ``models_path``
        names a saved ``.safetensors`` of models for the same encoder. ``teacher``: any callable
        ``texts -> [n, d]`` sentence embeddings instead of ``config.teacher``."""
        config = config or MiniCoilConfig()
        return cls.build_dims(doc_ids, texts, encoder, config, (config.dim,), models_path, teacher)[
            config.dim
        ]

    @classmethod
    def build_dims(
        cls,
        doc_ids: Sequence[str],
        texts: Sequence[str],
        encoder: Encoder,
        config: MiniCoilConfig,
        dims: Sequence[int],
        models_path: str | None = None,
        teacher: Callable[[Sequence[str]], np.ndarray] | None = None,
    ) -> dict[int, MiniCoilIndex]:
        """``build`` for several meaning vector sizes sharing one analysis, one encoder pass, one
        teacher pass and the same triplets: ``{dim: index}`` (``config.dim`` is replaced)."""
        configs = {d: dataclasses.replace(config, dim=d) for d in dims}  # checks each dim
        doc_ids = [str(d) for d in doc_ids]
        texts = list(texts)
        if len(doc_ids) != len(texts):
            raise ValueError(f"MiniCoilIndex.build: {len(doc_ids)} doc_ids, {len(texts)} texts")
        if not doc_ids:
            raise ConfigError("MiniCoilIndex.build: the corpus is empty; nothing to index.")
        if len(set(doc_ids)) != len(doc_ids):
            raise ConfigError("MiniCoilIndex.build: duplicate doc ids; ids must be unique.")
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        analyzer = words.Analyzer()
        corpus = _analyse(texts, analyzer)
        timings["analyse_s"] = time.perf_counter() - t0
        rng = np.random.default_rng(config.seed)

        loaded = None
        if models_path is not None:
            loaded = meaning.MeaningModels.load(models_path, "models_path")
            if loaded.encoder_fingerprint != encoder.bundle.fingerprint():
                raise ConfigError(
                    f"models_path={models_path}: the meaning models were fitted on another "
                    "encoder's vectors (fingerprint differs); fit them again or pass that encoder"
                )
            if set(dims) != {loaded.dim}:
                raise ConfigError(
                    f"--gin.MiniCoilConfig.dim={config.dim!r}: the models in {models_path} have "
                    f"dim {loaded.dim}"
                )
            known = loaded.index()
            model_of = np.array([known.get(s, -1) for s in corpus.stems], np.int64)
            vocab = list(loaded.words)
            slots = None
        else:
            vocab, model_of = _choose_vocabulary(corpus, config)
            slots = _choose_slots(corpus, model_of, len(vocab), config, rng)

        # One pass of the encoder over every sentence: the documents' mean contextual vector per
        # (document, word with a model), and the training sentences' vectors.
        t0 = time.perf_counter()
        pairs, pair_sum, pair_count, slot_vectors, sentence_mean = _corpus_pass(
            encoder, corpus, model_of, slots, want_sentence_mean=config.teacher == "encoder"
        )
        timings["encode_corpus_s"] = time.perf_counter() - t0
        x = pair_sum / np.maximum(pair_count, 1)[:, None]
        del pair_sum
        _, pair_stem = pairs
        data = None
        if loaded is None:
            data = _training_data(
                encoder, corpus, vocab, slots, slot_vectors, sentence_mean, config, rng, teacher
            )
        out = {}
        for dim, cfg in configs.items():
            report: dict = {"timings": dict(timings)}
            models = loaded
            if models is None:
                models, fit_report = _fit(encoder, vocab, data, cfg)
                report["fit"] = fit_report
            t0 = time.perf_counter()
            m = models.apply(model_of[pair_stem], x)
            doc_matrix, cell_offset, idf, stats = _doc_matrix(
                corpus, model_of, models.dim, m, pairs, cfg
            )
            report.update(stats)
            out[dim] = cls(
                doc_ids,
                corpus.stems,
                cell_offset,
                idf,
                doc_matrix,
                corpus.doc_tf,
                models,
                cfg,
                encoder,
                analyzer,
                report,
            )
            report["timings"]["assemble_s"] = time.perf_counter() - t0
        return out

    # ------------------------------------------------------------------ querying

    def _query_parts(self, texts: Sequence[str]) -> tuple[sp.csr_matrix, sp.csr_matrix]:
        """``(query_matrix, query_terms)`` for ``texts``."""
        rows, cols, vals = [], [], []
        term_rows, term_cols = [], []
        spans: list[list[tuple[int, int]]] = []
        span_stems: list[list[int]] = []
        for q, text in enumerate(texts):
            found = [
                (self.stem_id.get(w.stem, -1), w.start, w.end) for w in self.analyzer.analyze(text)
            ]
            found = [f for f in found if f[0] >= 0]
            for sid, _, _ in found:
                term_rows.append(q)
                term_cols.append(sid)
            with_model = [f for f in found if self.model_of_stem[f[0]] >= 0]
            spans.append([(s, e) for _, s, e in with_model])
            span_stems.append([sid for sid, _, _ in with_model])
        terms = sp.csr_matrix(
            (np.ones(len(term_rows), np.float32), (term_rows, term_cols)),
            shape=(len(texts), len(self.stems)),
        )
        terms.sum_duplicates()
        # Mean contextual vector per (query, word with a model), over its occurrences.
        sums: dict[tuple[int, int], np.ndarray] = {}
        counts: dict[tuple[int, int], int] = {}
        for q, inside, vectors in _encode_spans(self.encoder, texts, spans, _QUERY):
            for j, v in zip(inside, vectors, strict=True):
                key = (q, span_stems[q][j])
                sums[key] = sums.get(key, 0.0) + v
                counts[key] = counts.get(key, 0) + 1
        coo = terms.tocoo()
        keys = []
        for q, sid, count in zip(coo.row, coo.col, coo.data, strict=True):
            if self.model_of_stem[sid] < 0:
                rows.append([q])
                cols.append([self.cell_offset[sid]])
                vals.append([count])
            else:
                keys.append((int(q), int(sid), float(count)))
        if keys:
            x = np.stack(
                [
                    sums[(q, s)] / counts[(q, s)]
                    if (q, s) in sums
                    else np.zeros(self.models.input_dim, np.float32)
                    for q, s, _ in keys
                ]
            )
            word = np.array([self.model_of_stem[s] for _, s, _ in keys], np.int64)
            m = meaning_cells(self.models.apply(word, x), self.config.meaning)
            width = m.shape[1]
            for (q, s, count), vec in zip(keys, m, strict=True):
                rows.append([q] * width)
                cols.append(list(range(self.cell_offset[s], self.cell_offset[s] + width)))
                vals.append(list(count * vec))
        flat = lambda parts, dtype: np.asarray([x for p in parts for x in p], dtype)  # noqa: E731
        matrix = sp.csr_matrix(
            (flat(vals, np.float32), (flat(rows, np.int64), flat(cols, np.int64))),
            shape=(len(texts), len(self.idf)),
        )
        return matrix, terms

    def query_matrix(self, texts: Sequence[str]) -> sp.csr_matrix:
        """Queries as sparse vectors over the cells, WITHOUT idf (``score = Q · diag(idf) · Dᵀ``)."""
        return self._query_parts(list(texts))[0]

    def scores(self, texts: Sequence[str]) -> tuple[np.ndarray, sp.csr_matrix]:
        """Dense ``[num_queries, num_docs]`` scores and the sparse match matrix (shared words)."""
        matrix, terms = self._query_parts(list(texts))
        scores = (matrix.multiply(self.idf[None, :]).tocsr() @ self.doc_matrix.T).toarray()
        matches = (terms @ self.doc_terms.T).tocsr()
        return scores, matches

    def search(self, queries: Mapping[str, str], k: int) -> dict[str, dict[str, float]]:
        """Top-``k`` documents per query, ``results[qid][doc_id] = score`` (BEIR interchange).

        As ``BM25Index.search``: only documents sharing at least one word with the query are
        returned (so a query may get fewer than ``k``); equal scores keep index order.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"MiniCoilIndex.search: k={k!r}, expected a positive integer.")
        query_ids = [str(q) for q in queries]
        scores, matches = self.scores(list(queries.values()))
        results: dict[str, dict[str, float]] = {}
        for row, qid in enumerate(query_ids):
            candidates = matches.indices[matches.indptr[row] : matches.indptr[row + 1]]
            candidates = np.sort(candidates)
            top = candidates[bm25.top_k_indices(scores[row, candidates], k)]
            results[qid] = {self.doc_ids[i]: float(scores[row, i]) for i in top}
        return results

    # ------------------------------------------------------------------ persistence

    def nbytes(self) -> int:
        """Bytes of the sparse document index (data + indices + indptr) and the idf."""
        m = self.doc_matrix
        return int(m.data.nbytes + m.indices.nbytes + m.indptr.nbytes + self.idf.nbytes)

    def save(self, path: str | Path) -> Path:
        """Writes the index folder atomically file by file, ``minicoil.json`` last (it holds every
        other file's sha256 and is the commit marker)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "minicoil.json").unlink(missing_ok=True)
        files = {}

        def write(name, fn):
            fileio.atomic_write(path / name, fn)
            files[name] = fileio.sha256_file(path / name)

        write("doc_matrix.npz", lambda f: sp.save_npz(f, self.doc_matrix))
        write("doc_terms.npz", lambda f: sp.save_npz(f, self.doc_terms))
        write("idf.npy", lambda f: np.save(f, self.idf, allow_pickle=False))
        write(meaning.FILE, lambda f: f.write(self.models.to_bytes()))
        manifest = {
            "format": FORMAT,
            "config": dataclasses.asdict(self.config),
            "doc_ids": self.doc_ids,
            "stems": self.stems,
            "cell_offset": self.cell_offset.tolist(),
            "analyzer": {
                "stemmer_language": self.analyzer.stemmer_language,
                "stopwords": self.analyzer.stopwords,
            },
            "encoder": self.encoder.bundle.spec(),
            "report": self.report,
            "files": files,
        }
        fileio.atomic_write_json(path / "minicoil.json", manifest, sort_keys=False)
        return path

    @classmethod
    def load(cls, path: str | Path, encoder: Encoder | None = None) -> MiniCoilIndex:
        """Loads a saved index, checking every file's sha256; the query encoder is rebuilt from
        the saved spec unless given (then its fingerprint must match)."""
        path = Path(path)
        manifest_path = path / "minicoil.json"
        if not manifest_path.is_file():
            raise MissingPathError(f"{path}: no miniCOIL index there (minicoil.json missing)")
        manifest = fileio.read_json(manifest_path)
        if manifest.get("format") != FORMAT:
            raise IndexIntegrityError(
                f"{manifest_path}: format {manifest.get('format')!r}, expected {FORMAT!r}"
            )
        for name, digest in manifest["files"].items():
            if not (path / name).is_file() or fileio.sha256_file(path / name) != digest:
                raise IndexIntegrityError(
                    f"{path / name}: missing or its sha256 does not match minicoil.json; "
                    "rebuild this index"
                )
        spec = manifest["encoder"]
        if encoder is None:
            encoder = Encoder(loading.encoder_from_spec(spec))
        if encoder.bundle.fingerprint() != spec["info"]["fingerprint"]:
            raise ConfigError(f"{path}: built with another encoder (fingerprint differs)")
        models = meaning.MeaningModels.from_bytes(
            (path / meaning.FILE).read_bytes(), str(path / meaning.FILE)
        )
        analyzer = words.Analyzer(**manifest["analyzer"])
        return cls(
            manifest["doc_ids"],
            manifest["stems"],
            np.asarray(manifest["cell_offset"], np.int64),
            np.load(path / "idf.npy", allow_pickle=False),
            sp.load_npz(path / "doc_matrix.npz"),
            sp.load_npz(path / "doc_terms.npz"),
            models,
            # an index saved before `meaning` existed was built with the article's cosine
            MiniCoilConfig(**{"meaning": "cosine", **manifest["config"]}),
            encoder,
            analyzer,
            manifest.get("report"),
        )


# ---------------------------------------------------------------------- fitting helpers


def _doc_matrix(corpus: _Corpus, model_of: np.ndarray, dim: int, m: np.ndarray, pairs, config):
    """The documents' sparse vectors (see the module docstring): a word with a model owns its
    ``meaning_cells`` (``dim`` or ``dim + 1``) scaled by ``Importance`` (``m``: the unit meaning
    vector of each (document, word) pair in ``pairs``), a word without one a single cell holding
    ``Importance``. Returns
    ``(doc_matrix, cell_offset, idf per cell, report fields)``."""
    pair_doc, pair_stem = pairs
    num_docs, num_stems = corpus.doc_tf.shape
    cells = dim + (config.meaning == "nonnegative")
    width = np.where(model_of >= 0, cells, 1)
    cell_offset = np.concatenate([[0], np.cumsum(width)]).astype(np.int64)
    df = np.bincount(corpus.doc_tf.indices, minlength=num_stems)
    idf_stem = bm25.lucene_idf(df, num_docs)
    idf = np.repeat(idf_stem, width).astype(np.float32)
    avgdl = float(corpus.doc_len.mean())
    coo = corpus.doc_tf.tocoo()
    importance = bm25.term_frequency_importance(
        coo.data.astype(np.float64), corpus.doc_len[coo.row], avgdl, config.k1, config.b
    )
    plain = model_of[coo.col] < 0
    rows = [coo.row[plain]]
    cols = [cell_offset[coo.col[plain]]]
    vals = [importance[plain]]
    # Words with a model: importance × its meaning cells (meaning_cells), in the word's cells.
    keys = pair_doc * num_stems + pair_stem
    order = np.argsort(keys)
    with_model = np.flatnonzero(~plain)
    wanted = coo.row[with_model].astype(np.int64) * num_stems + coo.col[with_model]
    pair_of = order[np.searchsorted(keys[order], wanted)]
    rows.append(np.repeat(coo.row[with_model], cells))
    cols.append((cell_offset[coo.col[with_model]][:, None] + np.arange(cells)).ravel())
    vals.append(
        (importance[with_model][:, None] * meaning_cells(m[pair_of], config.meaning)).ravel()
    )
    doc_matrix = sp.csr_matrix(
        (np.concatenate(vals).astype(np.float32), (np.concatenate(rows), np.concatenate(cols))),
        shape=(num_docs, int(cell_offset[-1])),
    )
    stats = dict(
        num_docs=num_docs,
        num_words=num_stems,
        num_words_with_model=int((model_of >= 0).sum()),
        num_cells=int(cell_offset[-1]),
        avgdl=avgdl,
    )
    return doc_matrix, cell_offset, idf, stats


def _choose_vocabulary(corpus: _Corpus, config: MiniCoilConfig) -> tuple[list[str], np.ndarray]:
    """Words that get a model (enough sentences, long enough), most frequent first."""
    num_stems = len(corpus.stems)
    rows = np.repeat(np.arange(len(corpus.sentences)), [len(w) for w in corpus.sentence_words])
    cols = np.asarray([sid for ws in corpus.sentence_words for sid, _, _ in ws], np.int64)
    pairs = np.unique(rows * num_stems + cols)
    sentence_count = np.bincount(pairs % num_stems, minlength=num_stems)
    long_enough = np.array([len(s) >= config.min_word_length for s in corpus.stems])
    eligible = np.flatnonzero((sentence_count >= config.min_sentences) & long_enough)
    eligible = eligible[np.lexsort((eligible, -sentence_count[eligible]))]
    if config.max_words is not None:
        eligible = eligible[: config.max_words]
    model_of = np.full(num_stems, -1, np.int64)
    model_of[eligible] = np.arange(len(eligible))
    return [corpus.stems[s] for s in eligible], model_of


def _choose_slots(corpus, model_of, num_words, config, rng) -> np.ndarray:
    """``[V, S]`` sentence index of each word's training slot (−1: none), sampled without
    replacement among the sentences containing the word."""
    per_word: list[list[int]] = [[] for _ in range(num_words)]
    for s, found in enumerate(corpus.sentence_words):
        seen = set()
        for sid, _, _ in found:
            v = model_of[sid]
            if v >= 0 and v not in seen:
                seen.add(v)
                per_word[v].append(s)
    size = config.sentences_per_word
    slots = np.full((num_words, size), -1, np.int64)
    for v, sentences in enumerate(per_word):
        chosen = rng.choice(len(sentences), size=min(size, len(sentences)), replace=False)
        slots[v, : len(chosen)] = np.sort(np.asarray(sentences)[chosen])
    return slots


def _corpus_pass(encoder, corpus, model_of, slots, want_sentence_mean: bool):
    """Encodes every sentence once. Returns ``((pair_doc, pair_stem), pair_sum [P, D],
    pair_count [P], slot_vectors [V, S, D] | None, sentence_mean [num_sentences, D] | None)``."""
    dim_in = _input_dim(encoder)
    pair_index: dict[tuple[int, int], int] = {}
    spans, span_pair = [], []
    slot_of_span: list[dict[int, tuple[int, int]]] = []
    slot_lookup: dict[tuple[int, int], int] = {}
    if slots is not None:
        for v, row in enumerate(slots):
            for j, s in enumerate(row):
                if s >= 0:
                    slot_lookup[(int(s), v)] = j
    for s, found in enumerate(corpus.sentence_words):
        doc = int(corpus.sentence_doc[s])
        sentence_spans, sentence_pairs, firsts = [], [], {}
        for sid, start, end in found:
            v = int(model_of[sid])
            if v < 0 and not want_sentence_mean:
                continue
            if v >= 0:
                key = (doc, sid)
                if key not in pair_index:
                    pair_index[key] = len(pair_index)
                j = slot_lookup.get((s, v))
                if j is not None and v not in {vv for vv, _ in firsts.values()}:
                    firsts[len(sentence_spans)] = (v, j)
                sentence_pairs.append(pair_index[key])
            else:
                sentence_pairs.append(-1)
            sentence_spans.append((start, end))
        spans.append(sentence_spans)
        span_pair.append(np.asarray(sentence_pairs, np.int64))
        slot_of_span.append(firsts)
    num_pairs = len(pair_index)
    pair_sum = np.zeros((num_pairs, dim_in), np.float32)
    pair_count = np.zeros(num_pairs, np.int64)
    slot_vectors = None
    if slots is not None:
        slot_vectors = np.zeros((*slots.shape, dim_in), np.float32)
    sentence_sum = (
        np.zeros((len(corpus.sentences), dim_in), np.float32) if want_sentence_mean else None
    )
    sentence_n = np.zeros(len(corpus.sentences), np.int64)
    for s, inside, vectors in _encode_spans(
        encoder, corpus.sentences, spans, _DOC, desc="miniCOIL: encoding sentences"
    ):
        p = span_pair[s][inside]
        ok = p >= 0
        np.add.at(pair_sum, p[ok], vectors[ok])
        np.add.at(pair_count, p[ok], 1)
        if sentence_sum is not None:
            sentence_sum[s] += vectors.sum(axis=0)
            sentence_n[s] += len(inside)
        for local, vec in zip(inside, vectors, strict=True):
            hit = slot_of_span[s].get(int(local))
            if hit is not None:
                slot_vectors[hit[0], hit[1]] = vec
    sentence_mean = None
    if sentence_sum is not None:
        sentence_mean = sentence_sum / np.maximum(sentence_n, 1)[:, None]
    pair_doc = np.array([d for d, _ in pair_index], np.int64)
    pair_stem = np.array([s for _, s in pair_index], np.int64)
    return (pair_doc, pair_stem), pair_sum, pair_count, slot_vectors, sentence_mean


def _training_data(
    encoder, corpus, vocab, slots, slot_vectors, sentence_mean, config, rng, teacher
) -> dict:
    """Teacher similarities, snippets and triplets (train / validation) of every word."""
    timings = {}
    num_words, size = slots.shape
    used = np.unique(slots[slots >= 0])
    t0 = time.perf_counter()
    if teacher is not None:
        embeddings = np.asarray(teacher([corpus.sentences[s] for s in used]), np.float32)
        teacher_name = getattr(teacher, "__name__", type(teacher).__name__)
    elif config.teacher == "encoder":
        embeddings = sentence_mean[used]
        teacher_name = "encoder mean-pooled token vectors"
    else:
        embeddings = MeanPooledTeacher()([corpus.sentences[s] for s in used])
        teacher_name = "all-MiniLM-L6-v2 mean-pooled"
    embeddings = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    timings["teacher_s"] = time.perf_counter() - t0
    row_of = np.full(len(corpus.sentences), -1, np.int64)
    row_of[used] = np.arange(len(used))

    # Augmentation: a snippet around the word in each slot's sentence.
    snippet_vectors = np.zeros_like(slot_vectors)
    has_snippet = np.zeros(slots.shape, bool)
    t0 = time.perf_counter()
    if config.augment:
        texts, spans, where = [], [], []
        model_stem = {i: w for i, w in enumerate(vocab)}
        stem_ids = {w: i for i, w in enumerate(corpus.stems)}
        for v in range(num_words):
            sid = stem_ids[model_stem[v]]
            for j in range(size):
                s = slots[v, j]
                if s < 0 or rng.random() >= config.augment_fraction:
                    continue
                sentence = corpus.sentences[s]
                start, end = next((a, b) for w, a, b in corpus.sentence_words[s] if w == sid)
                lo, hi = words.snippet_span(sentence, (start, end), rng)
                texts.append(sentence[lo:hi])
                spans.append([(start - lo, end - lo)])
                where.append((v, j))
        # Snippets are a few words long: buckets of 16 tokens waste less padding than 32.
        short = Encoder(
            encoder.bundle,
            dataclasses.replace(encoder.config, bucket_multiple=16),
            encoder.mesh,
            encoder.query_maxlen,
        )
        for t, _, vectors in _encode_spans(
            short, texts, spans, _DOC, desc="miniCOIL: encoding snippets"
        ):
            v, j = where[t]
            snippet_vectors[v, j] = vectors[0]
            has_snippet[v, j] = True
    timings["snippets_s"] = time.perf_counter() - t0

    # Triplets: per word, the teacher's similarities of its slots; train / validation split.
    t0 = time.perf_counter()
    sims, train_slots, val_slots = [], [], []
    for v in range(num_words):
        filled = np.flatnonzero(slots[v] >= 0)
        e = embeddings[row_of[slots[v, filled]]]
        sim = np.zeros((size, size), np.float32)
        sim[np.ix_(filled, filled)] = e @ e.T
        train, val = triplets.split_sentences(len(filled), config.validation_fraction, rng)
        sims.append(sim)
        train_slots.append(filled[train])
        val_slots.append(filled[val])
    width = 2 * size
    train_batch = triplets.build_batch(
        sims, train_slots, has_snippet, config.triplets_per_word, config.margin, rng, width
    )
    val_batch = triplets.build_batch(
        sims,
        val_slots,
        has_snippet,
        max(config.triplets_per_word // 4, 1),
        config.margin,
        rng,
        width,
    )
    examples = np.concatenate([slot_vectors, snippet_vectors], axis=1)
    validation = {**val_batch, "examples": examples}
    input_space = meaning.input_space_accuracy(validation)  # before any reduction
    reduction = None
    if config.input_rank is not None and config.input_rank < examples.shape[-1]:
        filled = np.concatenate([slots >= 0, has_snippet], axis=1)
        reduction = meaning.fit_reduction(examples[filled], config.input_rank)
        examples = meaning.reduce_inputs(examples, *reduction) * filled[..., None]
    timings["triplets_s"] = time.perf_counter() - t0
    return {
        "train": {**train_batch, "examples": examples},
        "validation": {**val_batch, "examples": examples},
        "reduction": reduction,
        "info": {
            **timings,
            "teacher": teacher_name,
            "sentences": int(len(used)),
            "snippets": int(has_snippet.sum()),
            "corpus_sentences": len(corpus.sentences),
            "validation_input_space_accuracy": input_space,
        },
    }


def _fit(encoder, vocab, data, config) -> tuple[meaning.MeaningModels, dict]:
    """The jitted all-words training of one meaning vector size."""
    params, report = meaning.fit(
        data["train"],
        dim=config.dim,
        steps=config.steps,
        learning_rate=config.learning_rate,
        seed=config.seed,
        validation=data["validation"],
        weight_decay=config.weight_decay,
    )
    report.update(data["info"])
    logging.info(
        "miniCOIL: %d word models (dim %d) on %d sentences + %d snippets; validation triplet "
        "accuracy %.3f (input space %.3f); training %.1f s, %.0f words/s",
        len(vocab),
        config.dim,
        report["sentences"],
        report["snippets"],
        report.get("validation_triplet_accuracy", float("nan")),
        report.get("validation_input_space_accuracy", float("nan")),
        report["seconds"],
        report["words_per_s"] or 0.0,
    )
    models = meaning.MeaningModels(
        words=list(vocab),
        weight=params["weight"],
        bias=params["bias"],
        encoder_fingerprint=encoder.bundle.fingerprint(),
        report=report,
        center=None if data["reduction"] is None else data["reduction"][0],
        basis=None if data["reduction"] is None else data["reduction"][1],
    )
    return models, report
