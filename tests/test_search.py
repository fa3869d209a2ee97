"""Token index (exact / ScaNN), refinement and the searcher on synthetic token stores."""

from __future__ import annotations

import numpy as np
import pytest
from index_utils import random_documents, write_store

from aligner_jax.core import scoring, xtr
from aligner_jax.encoding.encoder import EncodedText
from aligner_jax.indexing import ann as ti
from aligner_jax.retrieval import refine as refine_lib
from aligner_jax.retrieval import searcher as search_lib

DIM = 16


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    docs = random_documents(40, DIM, seed=3, max_len=50)
    return write_store(tmp_path_factory.mktemp("store") / "idx", docs, DIM, shard_size=9)


def _queries(num, seed=0, length=6):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        n = int(rng.integers(2, length + 1))
        v = rng.normal(size=(n, DIM)).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        out.append(
            EncodedText(
                token_ids=rng.integers(5, 60, size=n).astype(np.int32),
                vectors=v,
                salience=rng.uniform(0.1, 1.0, size=n).astype(np.float32),
            )
        )
    return out


def _reference_scores(store, query: EncodedText, strategy):
    """Eq. 1-2 for every document with the scoring core (the definition), one batched call."""
    length = int(store.doc_lengths.max())
    v, d_mask, s, t = store.gather_padded(np.arange(store.num_docs), length)
    sim = scoring.similarity_matrix(query.vectors[None], v.astype(np.float32))
    n = len(query.token_ids)
    return np.asarray(
        scoring.alignment_scores(
            sim,
            np.ones((1, n), bool),
            d_mask,
            strategy,
            u_q=query.salience[None],
            u_d=s,
            q_ids=np.broadcast_to(query.token_ids, (store.num_docs, n)),
            d_ids=t,
        )
    )


def test_exact_token_search_matches_brute_force(store):
    index = ti.TokenIndex.build(store, "exact")
    q = _queries(1, seed=1)[0].vectors
    scores, docs, rows = index.search(q, k=25, exact_chunk=64)
    full = q @ store.vectors().astype(np.float32).T
    for i in range(len(q)):
        expected = np.sort(full[i])[::-1][:25]
        np.testing.assert_allclose(scores[i], expected, rtol=1e-3, atol=1e-3)
        np.testing.assert_array_equal(docs[i], index.row_docs[np.searchsorted(index.rows, rows[i])])
    # Asking for more than exists pads with -1 / -inf.
    s_all, d_all, _ = index.search(q[:1], k=store.num_tokens + 5)
    assert (d_all[0, store.num_tokens :] == -1).all()
    assert np.isneginf(s_all[0, store.num_tokens :]).all()


def test_scann_token_search_recall(store):
    index = ti.TokenIndex.build(
        store,
        "scann",
        k_prime=30,
        scann_config=ti.ScannConfig(num_leaves=8, num_leaves_to_search=4),
    )
    exact = ti.TokenIndex.build(store, "exact")
    q = np.concatenate([e.vectors for e in _queries(4, seed=2)])
    _, _, rows = index.search(q, k=30)
    _, _, rows_exact = exact.search(q, k=30)
    recall = np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(rows, rows_exact, strict=True)])
    assert recall > 0.8


@pytest.mark.parametrize(
    "spec", ["top_k:1", "top_k:3", "top_p:0.05", "colbert", "coil", "dpr", "mebert:4"]
)
def test_refiner_equals_definition(store, spec):
    strategy = scoring.AlignmentStrategy.parse(spec)
    queries = _queries(3, seed=4)
    refiner = refine_lib.Refiner(store, refine_lib.RefineConfig(length_multiple=16))
    qb = refine_lib.QueryBatch.from_encoded(queries, 8)
    cands = [np.arange(store.num_docs), np.array([5, 1, 30]), np.array([], np.int64)]
    got = refiner.score(qb, cands, [strategy])
    for q, c, g in zip(queries, cands, got, strict=True):
        ref = _reference_scores(store, q, strategy)[c]
        np.testing.assert_allclose(g[0], ref, rtol=1e-4, atol=1e-5)


def test_refiner_multi_strategy_and_no_cache(store):
    strategies = [scoring.AlignmentStrategy.parse(s) for s in ("top_k:1", "top_k:2", "top_p:0.1")]
    queries = _queries(2, seed=5)
    qb = refine_lib.QueryBatch.from_encoded(queries, 8)
    cands = [np.arange(store.num_docs)] * 2
    cached = refine_lib.Refiner(store).score(qb, cands, strategies)
    uncached = refine_lib.Refiner(store, refine_lib.RefineConfig(cache_bytes=0)).score(
        qb, cands, strategies
    )
    for a, b, q in zip(cached, uncached, queries, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
        for s, strategy in enumerate(strategies):
            np.testing.assert_allclose(
                a[s], _reference_scores(store, q, strategy), rtol=1e-4, atol=1e-5
            )


def test_searcher_token_search_vs_exhaustive(store):
    queries = _queries(5, seed=6)
    ids = [f"q{i}" for i in range(5)]
    exhaustive = search_lib.Searcher(
        store, search_lib.SearchConfig(backend="exact", k_prime=0, top_k=10)
    ).run(ids, queries)
    assert all(c == store.num_docs for c in exhaustive.num_candidates)
    index = ti.TokenIndex.build(store, "exact")
    # With k' = all tokens every document is a candidate: identical rankings.
    full = search_lib.Searcher(
        store, search_lib.SearchConfig(backend="exact", k_prime=store.num_tokens, top_k=10), index
    ).run(ids, queries)
    for qid in ids:
        assert list(full.results["top_k:1"][qid]) == list(exhaustive.results["top_k:1"][qid])
    small = search_lib.Searcher(
        store, search_lib.SearchConfig(backend="exact", k_prime=3, top_k=10), index
    ).run(ids, queries)
    for qid, n in zip(ids, small.num_candidates, strict=True):
        assert 1 <= n <= 3 * 6
        # Every candidate's refined score equals its exhaustive score.
        for doc, score in small.results["top_k:1"][qid].items():
            assert score == pytest.approx(
                exhaustive_all(store, queries[ids.index(qid)])[doc], abs=1e-5
            )


def exhaustive_all(store, query):
    scores = _reference_scores(store, query, scoring.AlignmentStrategy.parse("top_k:1"))
    return dict(zip(store.doc_ids, scores, strict=True))


def test_query_pruning_and_xtr_refinement(store):
    q = _queries(1, seed=7, length=6)[0]
    keep = search_lib.prune_query_tokens(q, 0.5)
    assert len(keep) == int(np.ceil(0.5 * len(q.token_ids)))
    assert q.salience[keep].min() >= np.sort(q.salience)[::-1][len(keep) - 1]
    index = ti.TokenIndex.build(store, "exact")
    cfg = search_lib.SearchConfig(backend="exact", k_prime=20, refine="xtr", top_k=5)
    out = search_lib.Searcher(store, cfg, index).run(["q"], [q])
    scores, docs, _ = index.search(q.vectors, 20)
    cand, expected = xtr.xtr_inference_scores_numpy(scores, docs)
    best = dict(zip(cand, expected, strict=True))
    for doc_id, score in out.results["xtr"]["q"].items():
        assert score == pytest.approx(best[store.doc_ids.index(doc_id)], abs=1e-6)
    assert out.refine_ms and len(out.results["xtr"]["q"]) == 5


def test_search_config_errors():
    with pytest.raises(ValueError, match="SearchConfig.backend='faiss'"):
        search_lib.SearchConfig(backend="faiss")
    with pytest.raises(ValueError, match="beta_q"):
        search_lib.SearchConfig(beta_q=0.0)
    with pytest.raises(ValueError, match="k_prime > 0"):
        search_lib.SearchConfig(refine="xtr", k_prime=0)


def test_chunks_are_padded_to_a_power_of_two_not_a_full_chunk():
    sizes = [refine_lib.padded_chunk(n, 64) for n in (1, 8, 9, 33, 64, 100)]
    assert sizes == [8, 8, 16, 64, 64, 64]


def test_rerank_scores_exactly_the_given_candidates(store):
    queries = _queries(3, seed=9)
    ids = ["a", "b", "c"]
    searcher = search_lib.Searcher(store, search_lib.SearchConfig(backend="exact", k_prime=0))
    given = {"a": ["doc3", "doc1", "doc3"], "b": [f"doc{i}" for i in range(0, 20, 2)]}
    out = searcher.rerank(ids, queries, given, ("top_k:1", "top_k:2"), k=5)
    assert out.num_candidates == [2, 10, 0]  # duplicates once; "c" has no candidates
    assert (
        set(out.results["top_k:1"]["a"]) == {"doc1", "doc3"} and out.results["top_k:1"]["c"] == {}
    )
    assert len(out.results["top_k:2"]["b"]) == 5
    for qid, q in zip(ids[:2], queries[:2], strict=True):
        for doc, score in out.results["top_k:1"][qid].items():
            assert score == pytest.approx(exhaustive_all(store, q)[doc], abs=1e-5)
    with pytest.raises(search_lib.ConfigError, match="lists 1 document.*'nope'"):
        searcher.rerank(ids, queries, {"c": ["doc1", "nope"]})
    xtr_config = search_lib.SearchConfig(backend="exact", k_prime=5, refine="xtr")
    xtr_searcher = search_lib.Searcher(store, xtr_config, ti.TokenIndex.build(store, "exact"))
    with pytest.raises(search_lib.ConfigError, match="refine=\"'full'\""):
        xtr_searcher.rerank(ids, queries, given)


def test_latency_is_per_query_not_a_batch_average(store):
    """A query answered in a batch waits for the whole batch: its latency is the batch's time
    (the old code divided the batch's time among its queries, so latencies always summed to at
    most the run's time). Alone, they add up to the run's time; in batches of 2, to ~2x."""
    queries, ids = _queries(1, seed=9) * 4, [f"q{i}" for i in range(4)]  # one shape: one compile
    index = ti.TokenIndex.build(store, "exact")
    for batch in (1, 2):
        cfg = search_lib.SearchConfig(backend="exact", k_prime=20, top_k=5, query_batch_size=batch)
        searcher = search_lib.Searcher(store, cfg, index)
        searcher.run(ids[:batch], queries[:batch], show_progress=False)  # compile
        out = searcher.run(ids, queries, show_progress=False)
        ratio = sum(out.search_ms) / (1000.0 * out.wall_s)
        assert len(out.search_ms) == 4
        if batch == 1:
            assert ratio <= 1.0
        else:
            assert out.search_ms[0] == out.search_ms[1] and out.search_ms[2] == out.search_ms[3]
            assert ratio > 1.5, ratio
