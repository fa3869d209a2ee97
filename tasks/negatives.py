"""Negatives for the training tasks: BM25 hard negatives topped up with random documents.

``bm25_negatives`` wraps ``aligner_jax.data.bm25.mine_hard_negatives`` (``N`` documents drawn from
the top-``depth`` BM25 documents that are not positives, in BM25 rank order) and guarantees
exactly ``N`` per query: a query whose BM25 pool is too small (few documents share a term with
it) is topped up with random documents that are neither positives nor already chosen.
``random_negatives`` draws all ``N`` that way. Every draw uses a generator seeded by
``(seed, crc32(query id), stream)``, so the result depends only on the seed and the query, not
on the order or subset of queries.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from aligner_jax.common.errors import ConfigError
from aligner_jax.data import bm25

# Independent generator streams for the different draws of one query.
_STREAM_RANDOM_FILL = 1


def query_rng(seed: int, query_id: str, stream: int) -> np.random.Generator:
    """The generator of one query's draws (see the module docstring)."""
    return np.random.default_rng([int(seed), zlib.crc32(query_id.encode("utf-8")), stream])


def draw_random_documents(
    doc_ids: Sequence[str],
    doc_id_set: frozenset[str] | set[str],
    excluded: set[str],
    count: int,
    rng: np.random.Generator,
    what: str,
) -> list[str]:
    """``count`` distinct documents of ``doc_ids`` not in ``excluded``, uniformly at random.

    ``doc_id_set`` is ``set(doc_ids)`` (computed once by the caller). Raises ValueError (naming
    ``what``) when fewer than ``count`` documents are eligible.
    """
    if count <= 0:
        return []
    num_excluded = len(doc_id_set & excluded)
    available = len(doc_ids) - num_excluded
    if available < count:
        raise ConfigError(
            f"{what}: needs {count} negative documents but only {available} of the "
            f"{len(doc_ids)} documents are neither relevant nor already chosen; lower "
            "num_negatives or use a larger corpus."
        )
    if 2 * available < len(doc_ids):
        eligible = [d for d in doc_ids if d not in excluded]
        picks = rng.choice(len(eligible), size=count, replace=False)
        return [eligible[i] for i in picks]
    chosen: list[str] = []
    taken = set(excluded)
    while len(chosen) < count:
        for i in rng.integers(0, len(doc_ids), size=2 * (count - len(chosen))):
            d = doc_ids[int(i)]
            if d not in taken:
                taken.add(d)
                chosen.append(d)
                if len(chosen) == count:
                    break
    return chosen


def random_negatives(
    doc_ids: Sequence[str],
    positives: Mapping[str, Sequence[str] | set[str]],
    num_negatives: int,
    seed: int,
    exclude_identical_ids: bool = True,
) -> dict[str, list[str]]:
    """``num_negatives`` random non-positive documents per query id of ``positives``."""
    doc_ids = [str(d) for d in doc_ids]
    doc_id_set = frozenset(doc_ids)
    out = {}
    for qid, pos in positives.items():
        excluded = {str(d) for d in pos} | ({qid} if exclude_identical_ids else set())
        out[qid] = draw_random_documents(
            doc_ids,
            doc_id_set,
            excluded,
            num_negatives,
            query_rng(seed, qid, _STREAM_RANDOM_FILL),
            f"random negatives of query {qid!r}",
        )
    return out


def bm25_negatives(
    index: bm25.BM25Index,
    queries: Mapping[str, str],
    positives: Mapping[str, Sequence[str] | set[str]],
    num_negatives: int,
    depth: int,
    seed: int,
    exclude_identical_ids: bool = True,
) -> tuple[dict[str, list[str]], int]:
    """Exactly ``num_negatives`` BM25 hard negatives per query, topped up at random if needed.

    Returns ``(negatives, topped_up)``: ``negatives[qid]`` lists the BM25 picks (rank order)
    followed by any random top-up; ``topped_up`` counts the queries that needed one.
    """
    if num_negatives == 0:
        return {qid: [] for qid in queries}, 0
    mined = bm25.mine_hard_negatives(
        index,
        queries,
        positives,
        num_negatives=num_negatives,
        depth=depth,
        seed=seed,
        exclude_identical_ids=exclude_identical_ids,
    )
    doc_ids = index.doc_ids
    doc_id_set = frozenset(doc_ids)
    topped_up = 0
    for qid in queries:
        chosen = mined[qid]
        missing = num_negatives - len(chosen)
        if missing > 0:
            topped_up += 1
            excluded = (
                {str(d) for d in positives[qid]}
                | set(chosen)
                | ({qid} if exclude_identical_ids else set())
            )
            chosen = chosen + draw_random_documents(
                doc_ids,
                doc_id_set,
                excluded,
                missing,
                query_rng(seed, qid, _STREAM_RANDOM_FILL),
                f"BM25 negatives of query {qid!r}",
            )
            mined[qid] = chosen
    return mined, topped_up
