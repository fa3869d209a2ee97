"""Lexical sparse vectors for an engine that applies the IDF itself (Qdrant's ``modifier: idf``).

A sparse vector of this module holds, per document, each term's weight *without* its IDF; the
query holds each term's count. The engine multiplies every matching dimension by

    idf(t) = ln(1 + (N − n(t) + 0.5) / (n(t) + 0.5))

(``bm25.lucene_idf``: N the points of the collection that hold this sparse vector, n(t) those with a
non-zero value at t), computed from the collection at query time, so added or deleted points
keep it right. That is the idf of our BM25 (``data.bm25``, Lucene variant), hence:

  * ``Bm25Vectors``: document values = BM25's term-frequency importance
    tf / (tf + k1 · (1 − b + b · |d| / avgdl)) (``bm25.term_frequency_importance``), query values
    = how often each term occurs in the query, over ``bm25.analyze``'s terms (the one analysis:
    stopwords, Snowball stems). Σ_t count_q(t) · idf(t) · importance(t, d) is exactly
    ``BM25Index.score`` (bm25s counts a repeated query term once per occurrence) when every
    document holds an indexed word: one that holds none is a point without this vector, which
    the engine's N leaves out and ours counts (the export counts and names them).
  * ``MiniCoilVectors``: miniCOIL's cells (``lexical.minicoil.MiniCoilIndex``: ``doc_matrix`` and
    ``query_matrix`` without the idf, ``idf`` per cell; score = q · diag(idf) · dᵀ). Every cell of
    a word is non-zero exactly where the word occurs, so the engine's idf of a cell is the word's
    BM25 idf; ``check_idf`` verifies that before an export.

The terms' column numbers (the vocabulary) are what a query needs besides the analysis; they are
kept in the publication record (``state``), never hashed (a hash collision would merge terms).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
import scipy.sparse as sp
from absl import logging

from aligner_jax.common.errors import ConfigError
from aligner_jax.data import bm25

KINDS = ("bm25", "minicoil", "none")


def row_vector(matrix: sp.csr_matrix, row: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, values) of one row of a csr matrix: a sparse vector of the engine."""
    lo, hi = matrix.indptr[row], matrix.indptr[row + 1]
    return matrix.indices[lo:hi].astype(np.int64), matrix.data[lo:hi].astype(np.float32)


class Bm25Vectors:
    """BM25 as sparse vectors: the vocabulary, BM25's k1/b and the analysis settings."""

    name = "bm25"

    def __init__(
        self,
        vocabulary: Sequence[str],
        k1: float,
        b: float,
        stemmer_language: str | None,
        stopwords: str | None,
        doc_matrix: sp.csr_matrix | None = None,
    ):
        self.vocabulary = list(vocabulary)
        self.column = {term: i for i, term in enumerate(self.vocabulary)}
        self.k1, self.b = float(k1), float(b)
        self.stemmer_language, self.stopwords = stemmer_language, stopwords
        self.doc_matrix = doc_matrix

    @classmethod
    def build(
        cls,
        texts: Sequence[str],
        k1: float = 1.5,
        b: float = 0.75,
        stemmer_language: str | None = "english",
        stopwords: str | None = "en",
    ) -> Bm25Vectors:
        """Document vectors of ``texts`` (the defaults are ``BM25Index.build``'s)."""
        if not texts:
            raise ConfigError("BM25 sparse vectors: no documents")
        tokens = bm25.analyze(texts, stemmer_language, stopwords)
        vocabulary = sorted({t for doc in tokens for t in doc})
        column = {t: i for i, t in enumerate(vocabulary)}
        lengths = np.array([len(doc) for doc in tokens], dtype=np.int64)
        avgdl = float(lengths.mean()) if lengths.sum() else 1.0
        indptr, indices, tfs = [0], [], []
        for doc in tokens:
            counts = collections.Counter(doc)
            cols = sorted(column[t] for t in counts)
            indices.extend(cols)
            tfs.extend(counts[vocabulary[c]] for c in cols)
            indptr.append(len(indices))
        row_lengths = np.repeat(lengths, np.diff(indptr))
        values = bm25.term_frequency_importance(np.array(tfs), row_lengths, avgdl, k1, b)
        matrix = sp.csr_matrix(
            (values.astype(np.float32), np.array(indices, dtype=np.int64), np.array(indptr)),
            shape=(len(tokens), max(len(vocabulary), 1)),
        )
        return cls(vocabulary, k1, b, stemmer_language, stopwords, matrix)

    def query_matrix(self, texts: Sequence[str]) -> sp.csr_matrix:
        """Query vectors: each known term's count in the query (unknown terms match nothing)."""
        indptr, indices, values = [0], [], []
        for doc in bm25.analyze(texts, self.stemmer_language, self.stopwords):
            counts = collections.Counter(self.column[t] for t in doc if t in self.column)
            for c in sorted(counts):
                indices.append(c)
                values.append(float(counts[c]))
            indptr.append(len(indices))
        return sp.csr_matrix(
            (np.array(values, np.float32), np.array(indices, np.int64), np.array(indptr)),
            shape=(len(indptr) - 1, max(len(self.vocabulary), 1)),
        )

    def state(self) -> dict:
        """What the query side needs (saved in the publication record)."""
        return {
            "kind": self.name,
            "k1": self.k1,
            "b": self.b,
            "stemmer_language": self.stemmer_language,
            "stopwords": self.stopwords,
            "vocabulary": self.vocabulary,
        }

    @classmethod
    def from_state(cls, state: dict) -> Bm25Vectors:
        return cls(
            state["vocabulary"], state["k1"], state["b"], state["stemmer_language"],
            state["stopwords"],
        )  # fmt: skip


class MiniCoilVectors:
    """miniCOIL's cells as sparse vectors (the ``MiniCoilIndex`` contract: ``doc_matrix``,
    ``idf``, ``query_matrix(texts)``; values without the idf)."""

    name = "minicoil"

    def __init__(self, index, doc_rows: np.ndarray | None = None):
        """``doc_rows``: the rows of ``index.doc_matrix`` exported (default: all)."""
        self.index = index
        self.doc_rows = doc_rows

    @property
    def doc_matrix(self) -> sp.csr_matrix:
        matrix = sp.csr_matrix(self.index.doc_matrix)
        return matrix if self.doc_rows is None else matrix[np.asarray(self.doc_rows, np.int64)]

    def query_matrix(self, texts: Sequence[str]) -> sp.csr_matrix:
        return sp.csr_matrix(self.index.query_matrix(list(texts)))

    def check_idf(self, atol: float = 1e-4) -> float:
        """Largest difference between miniCOIL's idf and the one the engine will apply (over the
        cells that occur); warns when it exceeds ``atol`` (the engine's ranking then differs)."""
        matrix = self.doc_matrix
        matrix.eliminate_zeros()  # a stored 0 is no posting for the engine
        doc_freq = np.bincount(matrix.indices, minlength=matrix.shape[1])
        used = doc_freq > 0
        points = int(np.count_nonzero(np.diff(matrix.indptr)))  # the engine's N: non-empty rows
        engine = bm25.lucene_idf(doc_freq[used], points)
        diff = float(np.abs(engine - np.asarray(self.index.idf, np.float64)[used]).max(initial=0))
        if diff > atol:
            logging.warning(
                "miniCOIL idf differs from the engine's IDF modifier by up to %.3g: Qdrant's "
                "miniCOIL scores will not equal MiniCoilIndex's",
                diff,
            )
        return diff

    def state(self) -> dict:
        return {"kind": self.name}
