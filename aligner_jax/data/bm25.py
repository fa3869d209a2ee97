"""BM25 lexical retrieval (bm25s) for baselines and for mining hard negatives.

BM25 (Robertson & Zaragoza) scores a document d for a query q as

    score(q, d) = Σ_{t ∈ q} idf(t) · tf(t, d) / (tf(t, d) + k1 · (1 − b + b · |d| / avgdl))
    idf(t) = ln(1 + (N − df(t) + 0.5) / (df(t) + 0.5))

(the Lucene variant, bm25s `method="lucene"`; |d| and avgdl count tokens after analysis; a query
term is counted once per occurrence in the query). Text is
lower-cased, split on `\\b\\w\\w+\\b`, English stopwords removed and words stemmed with the
Snowball English stemmer (PyStemmer). Documents are indexed as `title + " " + text`
(`beir.document_text`).

It is the BEIR baseline of the ALIGNER paper's Table 2 and the source of the fixed hard negatives
of its training recipe (§4.1: MS MARCO "with fixed hard negatives"): `mine_hard_negatives` draws
them from the top BM25 documents that are not judged relevant.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import bm25s
import numpy as np
import Stemmer
from absl import logging

from aligner_jax.common.errors import ConfigError


def top_k_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the `k` largest scores, best first; equal scores keep index order.

    O(n) selection (argpartition) plus a sort of the k winners, so the result does not depend on
    the partition's arbitrary order at the boundary.
    """
    n = scores.shape[0]
    k = min(k, n)
    if k <= 0:
        return np.zeros((0,), dtype=np.int64)
    if k == n:
        candidates = np.arange(n)
    else:
        threshold = scores[np.argpartition(-scores, k - 1)[:k]].min()
        above = np.flatnonzero(scores > threshold)
        ties = np.flatnonzero(scores == threshold)[: k - above.size]
        candidates = np.concatenate([above, ties])
    order = np.lexsort((candidates, -scores[candidates]))
    return candidates[order]


def analyze(
    texts: Sequence[str], stemmer_language: str | None = "english", stopwords: str | None = "en"
) -> list[list[str]]:
    """The BM25 analysis of `texts` (lower-case, `\\b\\w\\w+\\b`, stopwords, stemming): the one
    tokenisation of every lexical scorer (BM25Index, its sparse vectors for other engines)."""
    stemmer = Stemmer.Stemmer(stemmer_language) if stemmer_language else None
    return bm25s.tokenize(
        list(texts),
        stopwords=stopwords or [],
        stemmer=stemmer,
        show_progress=False,
        return_ids=False,
    )


def lucene_idf(doc_freq: np.ndarray, num_docs: int) -> np.ndarray:
    """idf(t) = ln(1 + (N − df(t) + 0.5) / (df(t) + 0.5)) (the module docstring's; bm25s
    ``lucene``; also what Qdrant's IDF modifier applies)."""
    n = np.asarray(doc_freq, dtype=np.float64)
    return np.log1p((num_docs - n + 0.5) / (n + 0.5))


def term_frequency_importance(
    tf: np.ndarray, doc_length: np.ndarray, avgdl: float, k1: float, b: float
) -> np.ndarray:
    """BM25's term-frequency factor tf / (tf + k1 · (1 − b + b · |d| / avgdl)) (the module
    docstring's formula without the idf): what a document contributes per term, so that
    score(q, d) = Σ_{t ∈ q} idf(t) · importance(t, d)."""
    tf = np.asarray(tf, dtype=np.float64)
    norm = k1 * (1.0 - b + b * np.asarray(doc_length, dtype=np.float64) / avgdl)
    return tf / (tf + norm)


class BM25Index:
    """An in-memory BM25 index over `(doc_id, text)` pairs. Build with `BM25Index.build`."""

    def __init__(
        self,
        retriever: bm25s.BM25,
        doc_ids: Sequence[str],
        stemmer_language: str | None,
        stopwords: str | None,
    ):
        self._retriever = retriever
        self._doc_ids = list(doc_ids)
        self._stemmer_language = stemmer_language
        self._stopwords = stopwords

    @classmethod
    def build(
        cls,
        doc_ids: Sequence[str],
        texts: Sequence[str],
        k1: float = 1.5,
        b: float = 0.75,
        method: str = "lucene",
        stemmer_language: str | None = "english",
        stopwords: str | None = "en",
    ) -> BM25Index:
        """Tokenizes and indexes `texts` (aligned with `doc_ids`).

        Args:
          doc_ids: unique document ids, in the order of `texts`.
          texts: document texts (use `beir.document_text` for BEIR documents).
          k1, b, method: BM25 parameters and variant (bm25s).
          stemmer_language: a PyStemmer language, or None for no stemming.
          stopwords: a bm25s stopword list name ("en"), or None to keep all words.
        """
        doc_ids = [str(d) for d in doc_ids]
        texts = list(texts)
        if len(doc_ids) != len(texts):
            raise ValueError(
                f"BM25Index.build: {len(doc_ids)} doc_ids but {len(texts)} texts; they must align."
            )
        if not doc_ids:
            raise ConfigError("BM25Index.build: the corpus is empty; nothing to index.")
        if len(set(doc_ids)) != len(doc_ids):
            seen: set[str] = set()
            duplicate = next(d for d in doc_ids if d in seen or seen.add(d))
            raise ConfigError(
                f"BM25Index.build: duplicate doc_id {duplicate!r}; ids must be unique."
            )
        if stemmer_language and stemmer_language not in Stemmer.algorithms():
            raise ConfigError(
                f"stemmer_language={stemmer_language!r}: not a PyStemmer language; choose one of "
                f"{Stemmer.algorithms()} or None."
            )
        stemmer = Stemmer.Stemmer(stemmer_language) if stemmer_language else None
        tokens = bm25s.tokenize(
            texts, stopwords=stopwords or [], stemmer=stemmer, show_progress=False
        )
        if not tokens.vocab:
            raise ConfigError(
                f"BM25Index.build: none of the {len(texts)} documents has a word left after "
                f"lower-casing and removing stopwords ({stopwords or 'none'}): BM25 has nothing "
                "to index"
            )
        retriever = bm25s.BM25(k1=k1, b=b, method=method)
        retriever.index(tokens, show_progress=False)
        return cls(retriever, doc_ids, stemmer_language, stopwords)

    @property
    def doc_ids(self) -> list[str]:
        return list(self._doc_ids)

    @property
    def num_documents(self) -> int:
        return len(self._doc_ids)

    def tokenize(self, texts: Sequence[str]) -> list[list[str]]:
        """The index's analysis (lower-case, stopwords, stemming) applied to `texts`."""
        return analyze(texts, self._stemmer_language, self._stopwords)

    def score(self, query_tokens: Sequence[str]) -> np.ndarray:
        """BM25 scores of every document (index order) for one tokenized query."""
        query_tokens = list(query_tokens)
        if not query_tokens:
            return np.zeros((self.num_documents,), dtype=np.float32)
        token_ids = self._retriever.get_tokens_ids(query_tokens)
        if not token_ids:
            return np.zeros((self.num_documents,), dtype=np.float32)
        return np.asarray(self._retriever.get_scores_from_ids(token_ids))

    def search(self, queries: Mapping[str, str], k: int) -> dict[str, dict[str, float]]:
        """Top-`k` documents per query as `results[qid][doc_id] = score` (BEIR interchange).

        Only documents sharing at least one term with the query (score > 0) are returned, as
        with Lucene/Elasticsearch, so a query may get fewer than `k` (or no) results. Equal
        scores are ordered by index position.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"BM25Index.search: k={k!r}, expected a positive integer.")
        query_ids = [str(q) for q in queries]
        tokenized = self.tokenize(list(queries.values()))
        results: dict[str, dict[str, float]] = {}
        for qid, tokens in zip(query_ids, tokenized, strict=True):
            scores = self.score(tokens)
            top = top_k_indices(scores, k)
            top = top[scores[top] > 0]
            results[qid] = {self._doc_ids[i]: float(scores[i]) for i in top}
        return results


def mine_hard_negatives(
    index: BM25Index,
    queries: Mapping[str, str],
    positives: Mapping[str, set[str] | Sequence[str] | Mapping[str, int]],
    num_negatives: int,
    depth: int = 100,
    seed: int = 0,
    exclude_identical_ids: bool = True,
) -> dict[str, list[str]]:
    """Hard negatives per query: `num_negatives` documents drawn from the `depth` best BM25
    documents that are not positives, returned in BM25 rank order.

    The draw (uniform, without replacement) uses a generator seeded by `(seed, crc32(qid))`, so
    the result is the same for the same seed whatever the order or subset of queries. With
    `depth == num_negatives` the top non-positive documents are taken as they are. A query whose
    pool is smaller than `num_negatives` gets the whole pool (a warning counts them).

    Args:
      index: BM25 index over the corpus.
      queries: `{qid: text}`; every qid needs an entry in `positives`.
      positives: `{qid: relevant doc ids}` (a set, list, or a qrels dict whose keys are ids;
        pass only the documents judged relevant, e.g. score > 0).
      num_negatives: negatives per query.
      depth: size of the candidate pool (BM25 ranks after removing positives).
      seed: sampling seed.
      exclude_identical_ids: never return the document whose id equals the query id. This is
        deliberately broader than evaluation's rule (``beir.IdenticalIds``, which keeps that
        document in a ranking unless its text is the query's): removing a document from the
        negative pool can never mislabel it (judged positives are excluded anyway), whereas on
        ArguAna/Quora the same-id document is the query itself and would be a false negative.
    """
    if isinstance(num_negatives, bool) or not isinstance(num_negatives, int) or num_negatives < 1:
        raise ConfigError(f"num_negatives={num_negatives!r}: expected a positive integer.")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < num_negatives:
        raise ConfigError(
            f"depth={depth!r}: expected an integer >= num_negatives ({num_negatives})."
        )
    missing = [qid for qid in queries if qid not in positives]
    if missing:
        raise ValueError(
            f"mine_hard_negatives: {len(missing)} queries have no entry in positives "
            f"(first: {missing[:3]}); pass only queries with judged relevant documents."
        )
    pos_sets = {qid: {str(d) for d in positives[qid]} for qid in queries}
    max_excluded = max((len(p) for p in pos_sets.values()), default=0) + int(exclude_identical_ids)
    results = index.search(queries, k=depth + max_excluded)

    negatives: dict[str, list[str]] = {}
    short = 0
    for qid in queries:
        excluded = pos_sets[qid] | ({qid} if exclude_identical_ids else set())
        pool = [d for d in results[qid] if d not in excluded][:depth]
        if len(pool) <= num_negatives:
            chosen = pool
            short += len(pool) < num_negatives
        else:
            rng = np.random.default_rng([seed, zlib.crc32(qid.encode("utf-8"))])
            picks = np.sort(rng.choice(len(pool), size=num_negatives, replace=False))
            chosen = [pool[i] for i in picks]
        negatives[qid] = chosen
    if short:
        logging.warning(
            "mine_hard_negatives: %d of %d queries have fewer than %d BM25 candidates that are "
            "not positives (too few documents share a term with them).",
            short,
            len(queries),
            num_negatives,
        )
    return negatives
