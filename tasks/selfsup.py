"""``selfsup_pseudo_queries``: self-supervised training pairs from any corpus (no labels).

For domain adaptation on a corpus without queries (any BEIR-style ``corpus.jsonl``), every
document gives one pseudo-query and a positive:

* with a non-empty title (and ``use_titles``): query = the title, positive = the text;
* otherwise, inverse cloze (Lee et al., 2019): the text is split into sentences, one sentence
  (drawn with a generator seeded by ``seed`` and the document id) is the query and the other
  sentences, in order, are the positive. Documents with fewer than two sentences are skipped.

Negatives are other documents' texts (``text`` without title, like the positives, so the title
cannot give the positive away): the top-``depth`` BM25 documents for the pseudo-query
(``negatives='bm25'``, BM25 over the texts, the source document excluded, topped up at random
when the pool is short) or uniformly random documents (``negatives='random'``). Everything is
deterministic given ``seed``. BM25 mining scores every pseudo-query against the corpus, which is
quadratic: bound large corpora with ``max_documents``.

    --gin.selfsup_train_source.dataset_dir="'/data/beir/cisi'"     # or .corpus_file
    --gin.selfsup_train_source.negatives="'random'"
"""

from __future__ import annotations

import dataclasses
import re

import gin
from absl import logging

from aligner_jax.common.errors import ConfigError
from aligner_jax.data import beir, bm25
from aligner_jax.tasks import bindings, negatives, sources

_BINDING = "selfsup_train_source"
NEGATIVE_KINDS = ("bm25", "random")
_STREAM_SENTENCE = 2
# A sentence ends at . ! or ? (optionally followed by one closing quote or bracket) before
# whitespace; good enough for pseudo-queries, no language model needed.
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"')\]]))\s+")


@dataclasses.dataclass(frozen=True)
class SelfSupConfig:
    """Corpus and options of ``selfsup_pseudo_queries`` (see ``selfsup_train_source``)."""

    corpus_file: str
    num_negatives: int = 1
    negatives: str = "bm25"
    depth: int = 100
    seed: int = 0
    max_documents: int | None = None
    use_titles: bool = True


@gin.configurable
def selfsup_train_source(
    dataset_dir: str | None = None,
    corpus_file: str | None = None,
    num_negatives: int = 1,
    negatives: str = "bm25",
    depth: int = 100,
    seed: int = 0,
    max_documents: int | None = None,
    use_titles: bool = True,
) -> SelfSupConfig:
    """Corpus location and options of ``selfsup_pseudo_queries`` (gin-configurable).

    Args:
      dataset_dir: a folder holding ``corpus.jsonl`` (e.g. a BEIR dataset; no qrels needed).
      corpus_file: a ``corpus.jsonl`` ({"_id", "title", "text"} per line) instead.
      num_negatives: negatives per example (≥ 0).
      negatives: "bm25" (hard negatives for the pseudo-query) or "random".
      depth: BM25 candidate pool (≥ num_negatives).
      seed: seed of the sentence choice and of the negatives.
      max_documents: use only the first documents of the corpus (None: all).
      use_titles: title → text pairs for titled documents (False: inverse cloze for all).
    """
    num_negatives = bindings.check_int(f"{_BINDING}.num_negatives", num_negatives, 0)
    bindings.check_choice(f"{_BINDING}.negatives", negatives, NEGATIVE_KINDS)
    depth = bindings.check_int(f"{_BINDING}.depth", depth, max(1, num_negatives))
    seed = bindings.check_int(f"{_BINDING}.seed", seed, 0)
    max_documents = bindings.check_int(
        f"{_BINDING}.max_documents", max_documents, 1, allow_none=True
    )
    if corpus_file:
        path = bindings.require_file(
            f"{_BINDING}.corpus_file", corpus_file, "/data/beir/cisi/corpus.jsonl"
        )
    elif dataset_dir:
        folder = bindings.require_directory(
            f"{_BINDING}.dataset_dir", dataset_dir, "/data/beir/cisi"
        )
        path = folder / "corpus.jsonl"
        if not path.is_file():
            raise ConfigError(
                f"{_BINDING}.dataset_dir={dataset_dir!r}: {path} does not exist; the folder "
                f"needs a corpus.jsonl (or set {_BINDING}.corpus_file)."
            )
    else:
        raise ConfigError(
            "selfsup_pseudo_queries needs a corpus: set the gin binding "
            f"{_BINDING}.dataset_dir (a folder with corpus.jsonl), e.g. "
            f"{bindings.flag(_BINDING + '.dataset_dir', '/data/beir/cisi')}, or "
            f"{_BINDING}.corpus_file."
        )
    return SelfSupConfig(
        corpus_file=str(path),
        num_negatives=num_negatives,
        negatives=negatives,
        depth=depth,
        seed=seed,
        max_documents=max_documents,
        use_titles=bool(use_titles),
    )


def fingerprint(config: SelfSupConfig, split: str):
    del split
    return sources.file_fingerprint([config.corpus_file])


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` (split after . ! ? followed by whitespace); empty ones dropped."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def pseudo_query(doc: beir.Document, seed: int, use_titles: bool) -> tuple[str, str] | None:
    """``(pseudo-query, positive)`` of one document, or None when it gives no pair."""
    text = doc.text.strip()
    if not text:
        return None
    if use_titles and doc.title.strip():
        return doc.title.strip(), text
    sentences = split_sentences(text)
    if len(sentences) < 2:
        return None
    rng = negatives.query_rng(seed, doc.doc_id, _STREAM_SENTENCE)
    chosen = int(rng.integers(len(sentences)))
    rest = " ".join(s for i, s in enumerate(sentences) if i != chosen)
    return sentences[chosen], rest


def build_selfsup_examples(config: SelfSupConfig, split: str) -> sources.RetrievalExamples:
    """The example table of ``selfsup_pseudo_queries`` (see the module docstring)."""
    del split
    docs: list[beir.Document] = []
    for doc in beir.iter_corpus(config.corpus_file):
        if config.max_documents is not None and len(docs) >= config.max_documents:
            break
        docs.append(doc)
    candidates = {d.doc_id: d.text.strip() for d in docs if d.text.strip()}
    pairs: dict[str, tuple[str, str]] = {}
    for doc in docs:
        pair = pseudo_query(doc, config.seed, config.use_titles)
        if pair is not None:
            pairs[doc.doc_id] = pair
    skipped = len(docs) - len(pairs)
    if skipped:
        logging.info(
            "selfsup_pseudo_queries: %d of %d documents give no pair (empty text, or no title "
            "and a single sentence).",
            skipped,
            len(docs),
        )
    if not pairs:
        raise ConfigError(
            f"{config.corpus_file}: no document gives a pseudo-query (every one has an empty "
            "text, or no title and a single sentence)."
        )
    positives = {doc_id: [doc_id] for doc_id in pairs}
    topped_up = 0
    if config.num_negatives == 0:
        mined = {doc_id: [] for doc_id in pairs}
    elif config.negatives == "bm25":
        doc_ids = list(candidates)
        index = bm25.BM25Index.build(doc_ids, [candidates[d] for d in doc_ids])
        mined, topped_up = negatives.bm25_negatives(
            index,
            {doc_id: query for doc_id, (query, _) in pairs.items()},
            positives,
            num_negatives=config.num_negatives,
            depth=config.depth,
            seed=config.seed,
        )
    else:
        mined = negatives.random_negatives(
            list(candidates), positives, config.num_negatives, config.seed
        )

    pool = sources.TextPool()
    query_rows, positive_rows, negative_rows = [], [], []
    for doc_id, (query, positive) in pairs.items():
        query_rows.append(pool.add(query))
        positive_rows.append(pool.add(positive))
        negative_rows.append([pool.add(candidates[d]) for d in mined[doc_id]])
    titled = sum(1 for d in docs if d.doc_id in pairs and config.use_titles and d.title.strip())
    stats = {
        "documents": len(docs),
        "title_pairs": titled,
        "inverse_cloze_pairs": len(pairs) - titled,
        "skipped_documents": skipped,
        "topped_up_queries": topped_up,
    }
    return sources.make_examples(
        pool, query_rows, positive_rows, negative_rows, config.num_negatives, stats
    )
