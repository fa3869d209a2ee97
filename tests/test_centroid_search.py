"""The compressed search index (k-means, residual codec, persistence) and its four-stage search."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import weakref

import numpy as np
import pytest
from index_utils import mapped_rss_kib, random_documents, write_store

from aligner_jax.common import errors, scratch
from aligner_jax.core import scoring
from aligner_jax.encoding.encoder import EncodedText
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import codec as codec_lib
from aligner_jax.indexing import inverted_lists as lists_lib
from aligner_jax.indexing import kmeans
from aligner_jax.indexing import token_store as ts
from aligner_jax.retrieval import centroid_search as cs
from aligner_jax.retrieval import gather_max, probe_scores, probe_select
from aligner_jax.retrieval import searcher as search_lib

DIM = 16


def _unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    docs = random_documents(60, DIM, seed=5, max_len=30)
    return write_store(tmp_path_factory.mktemp("cstore") / "idx", docs, DIM, shard_size=11)


@pytest.fixture(scope="module")
def index(store):
    return ci.CentroidIndex.build(store, ci.CentroidIndexConfig(residual_bits=8))


def _query(seed, n=5):
    rng = np.random.default_rng(seed)
    return EncodedText(
        token_ids=rng.integers(5, 60, size=n).astype(np.int32),
        vectors=_unit(rng.normal(size=(n, DIM))),
        salience=rng.uniform(0.2, 1.0, size=n).astype(np.float32),
    )


def _float_top1(store, q, salience=True):
    """Eq. 1–2 top-1 scores of every document with the scoring core (float vectors; every
    u^d = 1 without ``salience``)."""
    length = int(store.doc_lengths.max())
    v, d_mask, s, _ = store.gather_padded(np.arange(store.num_docs), length)
    s = s if salience else np.ones_like(s)
    sim = scoring.similarity_matrix(q.vectors[None], v.astype(np.float32))
    n = len(q.token_ids)
    return np.asarray(
        scoring.alignment_scores(
            sim, np.ones((1, n), bool), d_mask, "top_k:1", u_q=q.salience[None], u_d=s
        )
    )


@pytest.mark.parametrize("bits", codec_lib.BITS)
def test_residual_scores_equal_decoded_dot_products(bits):
    rng = np.random.default_rng(bits)
    r = rng.normal(scale=0.1, size=(300, 13)).astype(np.float32)  # 13: padded to the planes
    codec = codec_lib.ResidualCodec.fit(r, bits)
    packed = codec.encode(r)
    assert packed.shape == (300, codec.bytes_per_token) and packed.dtype == np.uint8
    q = rng.normal(size=(4, 13)).astype(np.float32)
    np.testing.assert_allclose(
        codec.residual_scores(q, packed), q @ codec.decode(packed).T, rtol=1e-4, atol=1e-4
    )
    np.testing.assert_allclose(  # the token-major layout of stage 4: the same scores, transposed
        codec.residual_scores(q, packed, token_major=True),
        codec.decode(packed) @ q.T,
        rtol=1e-4,
        atol=1e-4,
    )
    inside = (r >= codec.lower) & (r < codec.lower + codec.step * (1 << bits))
    err = np.abs(codec.decode(packed) - r)
    assert np.all(err[inside] <= np.broadcast_to(codec.step / 2 + 1e-6, r.shape)[inside])


@pytest.mark.parametrize("bits", codec_lib.BITS)
def test_residual_scores_in_chunks_add_in_place_and_reuse_scratch(bits, monkeypatch):
    """Tokens spanning several chunks (the last one short) give the decoded dot products;
    ``add_to`` adds them in place; a second, smaller call reuses the same scratch buffers."""
    monkeypatch.setattr(codec_lib, "CHUNK", 64)
    rng = np.random.default_rng(10 + bits)
    r = rng.normal(scale=0.1, size=(200, 21)).astype(np.float32)  # 200 = 3 * 64 + 8
    codec = codec_lib.ResidualCodec.fit(r, bits)
    packed = codec.encode(r)
    q = rng.normal(size=(5, 21)).astype(np.float32)
    base = rng.normal(size=(200, 5)).astype(np.float32)
    target = base.copy()
    returned = codec.residual_scores(q, packed, token_major=True, add_to=target)
    assert returned is target
    np.testing.assert_allclose(target, base + codec.decode(packed) @ q.T, rtol=1e-4, atol=1e-4)
    first = scratch.buffer("codec.float", (1,), np.float32)
    small = codec.residual_scores(q[:2], packed[:30])
    np.testing.assert_allclose(small, q[:2] @ codec.decode(packed[:30]).T, rtol=1e-4, atol=1e-4)
    assert np.shares_memory(first, scratch.buffer("codec.float", (1,), np.float32))


def test_kmeans_assigns_by_max_dot_product_and_improves_monotonically():
    rng = np.random.default_rng(0)
    centres = _unit(rng.normal(size=(8, DIM)))
    labels = np.repeat(np.arange(8), 50)
    points = _unit(centres[labels] + 0.05 * rng.normal(size=(400, DIM)))
    objective = []
    for iterations in (1, 2, 4, 8):
        centroids = kmeans.fit(points, 8, iterations=iterations, seed=1)
        codes, best = kmeans.assign(points, centroids)
        np.testing.assert_array_equal(codes, np.argmax(points @ centroids.T, axis=1))
        np.testing.assert_allclose(np.linalg.norm(centroids, axis=1), 1.0, rtol=1e-5)
        objective.append(float(best.mean()))
    assert all(b >= a - 1e-6 for a, b in zip(objective, objective[1:], strict=False))
    assert objective[-1] > 0.9  # tight clusters: most points sit next to their centroid
    assert kmeans.default_num_centroids(1_242_251) == 16384  # PLAID's 16·√T, a power of two
    assert kmeans.default_num_centroids(1_242_251, dim=128, max_product=1 << 22) == 16384
    assert kmeans.default_num_centroids(1_242_251, dim=384, max_product=1 << 22) == 8192
    assert kmeans.default_num_centroids(219_115, dim=384, max_product=1 << 22) == 4096
    assert kmeans.default_num_centroids(1) == 1


def test_centroid_count_follows_the_size_caps(store, tmp_path):
    """16·√T centroids, unless the float32 table would exceed centroid_bytes_per_token per
    token (the table's share of the index) or C·D the product cap."""
    tokens = store.num_tokens
    plaid = 2 ** int(np.log2(16 * tokens**0.5))
    built = {}
    for name, config in {
        "plaid": ci.CentroidIndexConfig(kmeans_iterations=1, centroid_bytes_per_token=1e6),
        "table": ci.CentroidIndexConfig(kmeans_iterations=1),  # 16 bytes per token
        "product": ci.CentroidIndexConfig(
            kmeans_iterations=1, centroid_bytes_per_token=1e6, max_centroid_product=64 * DIM
        ),
    }.items():
        copy = tmp_path / name
        shutil.copytree(store.directory, copy, ignore=shutil.ignore_patterns(ci.SUBDIR))
        built[name] = ci.CentroidIndex.build(ts.TokenStore(copy), config).num_centroids
    table_cap = 16 * tokens / 4 / DIM  # float32 entries per token → centroids
    assert built["plaid"] == plaid
    assert built["table"] == 2 ** int(np.log2(table_cap)) < plaid
    assert built["product"] == 64 < plaid


def test_kmeans_reseeds_empty_clusters():
    """More centroids than distinct points: empty clusters are re-seeded (this raised a
    read-only-array ValueError before), every centroid stays a unit vector."""
    rng = np.random.default_rng(1)
    distinct = _unit(rng.normal(size=(5, DIM)))
    points = np.repeat(distinct, 6, axis=0)
    centroids = kmeans.fit(points, 12, iterations=3)
    assert centroids.shape == (12, DIM)
    np.testing.assert_allclose(np.linalg.norm(centroids, axis=1), 1.0, rtol=1e-5)
    _, best = kmeans.assign(points, centroids)
    np.testing.assert_allclose(best, 1.0, rtol=1e-5)  # every point has its own centroid


def test_index_persists_and_loads_identically(store, index):
    loaded = ci.CentroidIndex.load(store, verify_checksums=True)
    np.testing.assert_array_equal(loaded.codes, index.codes)
    np.testing.assert_array_equal(loaded.residuals, index.residuals)
    for c in range(index.num_centroids):
        np.testing.assert_array_equal(loaded.lists.inverted_list(c), index.lists.inverted_list(c))
    assert len(loaded.codes) == store.num_tokens
    # every kept token's document is in its centroid's inverted list
    doc_of = np.searchsorted(store.offsets, np.arange(store.num_tokens), side="right") - 1
    for row in range(0, store.num_tokens, 37):
        c = loaded.codes[row]
        assert doc_of[row] in loaded.lists.inverted_list(c)


def test_corrupted_or_stale_index_is_refused(store, index, tmp_path):
    import shutil

    copy = tmp_path / "idx"
    shutil.copytree(store.directory, copy)
    from aligner_jax.indexing import token_store as ts

    other = ts.TokenStore(copy)
    residuals = copy / ci.SUBDIR / "segment-00001.residuals.npy"
    with residuals.open("ab") as f:
        f.write(b"\0")
    with pytest.raises(errors.IndexIntegrityError, match="segment-00001.residuals.npy"):
        ci.CentroidIndex.load(other)
    residuals.write_bytes(residuals.read_bytes()[:-1])
    ci.CentroidIndex.load(other)  # intact again: verified once, recorded
    raw = bytearray(residuals.read_bytes())
    raw[-1] ^= 0xFF
    residuals.write_bytes(bytes(raw))
    # flipped bytes (same size) are caught by default: the record no longer matches the file
    with pytest.raises(errors.IndexIntegrityError, match="segment-00001.residuals.npy: sha256"):
        ci.CentroidIndex.load(other)
    with pytest.raises(errors.IndexIntegrityError, match="sha256"):
        ci.CentroidIndex.load(other, verify_checksums=True)
    raw[-1] ^= 0xFF
    residuals.write_bytes(bytes(raw))
    meta = ci.published_meta(copy)
    data = json.loads(meta.read_text())
    data["updates"] = []  # metadata edited: no longer the file the manifest published
    meta.write_text(json.dumps(data))
    with pytest.raises(errors.IndexIntegrityError, match="is not the file .* published"):
        ci.CentroidIndex.load(other)


@pytest.mark.parametrize("bits,tolerance", [(8, 0.005), (4, 0.03)])
def test_all_stages_wide_open_equal_float_scores_within_tolerance(tmp_path, bits, tolerance):
    """With every centroid probed and every document refined, stage 4 is Eq. 1–2 top-1 on
    compressed vectors: within ``tolerance`` of the float scores (uniform saliences; with
    learned saliences a near-tie can select another token and weight it differently)."""
    docs = random_documents(60, DIM, seed=5, max_len=30)
    for d in docs:
        d.salience = np.ones_like(d.salience)
    store = write_store(tmp_path / "idx", docs, DIM, shard_size=11)
    index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(residual_bits=bits))
    searcher = cs.CentroidSearcher(
        store,
        index,
        cs.CentroidSearchConfig(
            probes=index.num_centroids,
            interaction_docs=store.num_docs,
            refine_docs=store.num_docs,
        ),
    )
    for seed in range(4):
        q = dataclasses.replace(_query(seed), salience=np.ones(5, np.float32))
        (ranking,), counts = searcher.search(q.vectors, q.salience, np.arange(5), k=store.num_docs)
        docs, scores = ranking
        assert counts.refined == store.num_docs and len(docs) == store.num_docs
        reference = _float_top1(store, q)
        np.testing.assert_allclose(scores, reference[docs], atol=tolerance)
        assert reference[docs[0]] >= reference.max() - 2 * tolerance


@pytest.mark.parametrize("salience", [True, False])
@pytest.mark.parametrize(
    "five",
    [dict(refine_float=0.5, refine_float_min=0), dict(refine_float=2.0, refine_float_max=5)],
    ids=["half_of_k", "capped"],
)
def test_float_refinement_scores_the_best_refined_documents_with_eq2_exactly(
    tmp_path, store, salience, five
):
    """``refine_float``: the best ⌈refine_float·k⌉ documents of the compressed refinement,
    clipped to [``refine_float_min``, ``refine_float_max``] (here 5 of k = 10 either way), are
    scored again from the float store — Eq. 1–2 with the learned u^d, as exhaustive search —
    and ranked above the other refined documents (which keep their compressed scores)."""
    index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(residual_bits=2))
    wide = dict(probes=index.num_centroids, interaction_docs=60, refine_docs=60)
    compressed = cs.CentroidSearcher(
        store, index, cs.CentroidSearchConfig(**wide, refine_float=0.0), salience
    )
    floated = cs.CentroidSearcher(
        store,
        index,
        cs.CentroidSearchConfig(**wide, **five),
        salience,
    )
    k, differs = 10, 0
    for seed in range(6):
        q = _query(seed)
        if not salience:
            q = dataclasses.replace(q, salience=np.ones(5, np.float32))
        reference = _float_top1(store, q, salience)
        (mine,), _ = compressed.search(q.vectors, q.salience, np.arange(5), k=k)
        ((docs, scores),), _ = floated.search(q.vectors, q.salience, np.arange(5), k=k)
        assert len(docs) == k and np.all(np.diff(scores) <= 0)
        # the 5 best by compressed score, re-scored exactly and ordered by that score
        assert set(docs[:5]) == set(mine[0][:5])
        np.testing.assert_allclose(scores[:5], reference[docs[:5]], rtol=1e-5, atol=1e-5)
        # then the compressed ranking's other documents, in its order
        np.testing.assert_array_equal(docs[5:], mine[0][5:])
        differs += not np.allclose(mine[1][:5], reference[mine[0][:5]], atol=1e-3)
    assert differs  # 2-bit scores are not the float ones: the test would see a no-op
    with pytest.raises(errors.ConfigError, match="refine_float"):
        cs.CentroidSearchConfig(refine_float=-1.0)
    with pytest.raises(errors.ConfigError, match="refine_float_min"):
        cs.CentroidSearchConfig(refine_float_min=-1)
    with pytest.raises(errors.ConfigError, match="refine_float_max"):
        cs.CentroidSearchConfig(refine_float_max=0)


@pytest.mark.parametrize("salience", [True, False])
@pytest.mark.parametrize("k", [10, 20])
def test_float_refinement_is_on_by_default_for_models_with_saliences(store, salience, k):
    """The default ``refine_float`` (None): a model with saliences has the best
    max(3·k, ``refine_float_min``) refined documents scored from the float store, Eq. 1–2
    exactly (a k = 10 search ranks its top 10 out of 30 exact scores, a k = 20 search its top 20
    out of all 60 refined: which documents make the top k is decided by exact scores); one
    without keeps the compressed scores."""
    index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(residual_bits=2))
    wide = dict(probes=index.num_centroids, interaction_docs=60, refine_docs=60)
    default = cs.CentroidSearcher(store, index, cs.CentroidSearchConfig(**wide), salience)
    assert default.config.refine_float == (cs.REFINE_FLOAT if salience else 0.0)
    compressed = cs.CentroidSearcher(
        store, index, cs.CentroidSearchConfig(**wide, refine_float=0.0), salience
    )
    m = min(max(math.ceil(cs.REFINE_FLOAT * k), 30), 60)
    rescored = []  # how many documents each search scores from the float store
    refine_stored = default.refine_stored
    default.refine_stored = lambda q, docs, u: (
        rescored.append(len(docs)) or refine_stored(q, docs, u)
    )
    for seed in range(4):
        q = _query(seed)
        reference = _float_top1(store, q, salience)
        ((docs, scores),), _ = default.search(q.vectors, q.salience, np.arange(5), k=k)
        (mine,), _ = compressed.search(q.vectors, q.salience, np.arange(5), k=m)
        if not salience:
            np.testing.assert_array_equal(docs, mine[0][:k])
            continue
        # the top k of the compressed ranking's best m, by their exact scores
        exact = reference[mine[0]]
        best = mine[0][np.argsort(-exact, kind="stable")[:k]]
        assert set(docs) == set(best)
        np.testing.assert_allclose(scores, reference[docs], rtol=1e-5, atol=1e-5)
    assert rescored == ([m] * 4 if salience else [])


@pytest.mark.parametrize("margin", [None, 0.15])
def test_default_stages_rank_like_exhaustive_on_planted_queries(store, index, margin):
    """Queries copied from a document's tokens find that document first with the defaults."""
    searcher = cs.CentroidSearcher(store, index, cs.CentroidSearchConfig(refine_margin=margin))
    for d in (0, 17, 42):
        v, s, t = store.document(d)
        q = EncodedText(
            t[:6], _unit(np.asarray(v[:6], np.float32)), np.ones(len(t[:6]), np.float32)
        )
        (ranking,), _ = searcher.search(q.vectors, q.salience, np.arange(len(t[:6])), k=10)
        assert ranking[0][0] == d
        assert np.all(np.diff(ranking[1]) <= 0)  # ranked by score, blocks shifted below


def test_searcher_centroid_backend_other_strategies_refine_from_float_store(store, index):
    """Every strategy beside others, top-1 included, scores the refined documents exactly
    (float store, Refiner): ``aligner-eval --adapt`` compares them on one footing (top-1 came
    from compressed vectors, the others from float ones); the run keeps top-1 as it ranks
    alone (``run_results``: --adapt once moved the headline metrics)."""
    cfg = search_lib.SearchConfig(backend="centroid", top_k=5)
    wide = cs.CentroidSearchConfig(probes=index.num_centroids, refine_docs=store.num_docs)
    searcher = search_lib.Searcher(store, cfg, centroid_index=index, centroid_config=wide)
    q = _query(9)
    out = searcher.run(["q"], [q], strategies=("top_k:2", "top_k:1"))
    exhaustive = search_lib.Searcher(
        store, search_lib.SearchConfig(backend="exact", k_prime=0, top_k=5)
    )
    ref = exhaustive.run(["q"], [q], strategies=("top_k:2", "top_k:1"))
    for strategy in ("top_k:2", "top_k:1"):
        assert list(out.results[strategy]["q"]) == list(ref.results[strategy]["q"])
        np.testing.assert_allclose(
            list(out.results[strategy]["q"].values()),
            list(ref.results[strategy]["q"].values()),
            rtol=1e-5,
        )
    run, alone = out.run("top_k:1")["q"], searcher.run(["q"], [q]).results["top_k:1"]["q"]
    assert list(run) == list(alone)
    np.testing.assert_allclose(list(run.values()), list(alone.values()), rtol=1e-5)


def test_k_past_every_live_document_ranks_them_exactly(store, index):
    """Probes that reach every document left the fallback off: k >= the live documents gave
    them all in the fast order (compressed scores, exact False) though WORKSPACE promises the
    exact ranking."""
    config = search_lib.SearchConfig(backend="centroid", top_k=5, filter_exact_docs=0)
    reach_all = cs.CentroidSearchConfig(probes=index.num_centroids, refine_docs=4)
    searcher = search_lib.Searcher(store, config, centroid_index=index, centroid_config=reach_all)
    exhaustive = search_lib.Searcher(
        store, search_lib.SearchConfig(backend="exact", k_prime=0, top_k=5)
    )
    q = _query(11)
    k = store.num_docs
    out = searcher.run(["q"], [q], k=k, show_progress=False)
    ref = exhaustive.run(["q"], [q], k=k, show_progress=False).results["top_k:1"]["q"]
    got = out.results["top_k:1"]["q"]
    assert out.exact == [True] and list(got) == list(ref)
    np.testing.assert_allclose(list(got.values()), list(ref.values()), rtol=1e-5)


def test_top1_ranks_alike_alone_and_beside_other_strategies(tmp_path):
    """A model without saliences: top-1 alone is scored from the compressed index; beside
    other strategies (``aligner-eval --adapt``) it once came from the float store, and the
    headline metrics moved when --adapt was added."""
    docs = random_documents(80, DIM, seed=8, max_len=30)
    model = {"name": "plain", "fingerprint": "p", "dim": DIM, "salience": "none"}
    with ts.TokenStoreWriter(tmp_path / "plain", model, shard_size=20) as writer:
        for d in docs:
            writer.add(d.doc_id, d.vectors, None, d.token_ids)
    plain = writer.store
    index = ci.CentroidIndex.build(plain, ci.CentroidIndexConfig(num_centroids=8, residual_bits=2))
    config = search_lib.SearchConfig(backend="centroid", top_k=10, filter_exact_docs=0)
    searcher = search_lib.Searcher(plain, config, centroid_index=index)  # the compressed path
    exhaustive = search_lib.Searcher(
        plain, search_lib.SearchConfig(backend="exact", k_prime=0, top_k=80)
    )
    for seed in range(3):
        q = _query(seed)
        both = searcher.run(["q"], [q], strategies=("top_k:2", "top_k:1"))
        assert both.run("top_k:1")["q"] == searcher.run(["q"], [q]).results["top_k:1"]["q"]
        # the adaptation's top-1 column: float scores, as every other strategy's (it was the
        # compressed search's, so "adapted beats default" partly measured the float store)
        exact = exhaustive.run(["q"], [q]).results["top_k:1"]["q"]
        column = both.results["top_k:1"]["q"]
        refined = [d for d in column if d in exact][:5]
        np.testing.assert_allclose([column[d] for d in refined], [exact[d] for d in refined],
                                   rtol=1e-5)  # fmt: skip


def test_tombstoned_documents_are_never_returned(store, index):
    store.deleted[[3, 4]] = True
    try:
        searcher = cs.CentroidSearcher(store, index)
        v, _, t = store.document(3)
        q = _unit(np.asarray(v[:4], np.float32))
        (ranking,), _ = searcher.search(q, np.ones(len(q), np.float32), np.arange(len(q)), 60)
        assert 3 not in ranking[0] and 4 not in ranking[0]
    finally:
        store.deleted[:] = False


def test_config_ranges_are_checked():
    with pytest.raises(errors.ConfigError, match="CentroidSearchConfig.probes"):
        cs.CentroidSearchConfig(probes=0)
    with pytest.raises(errors.ConfigError, match="residual_bits"):
        ci.CentroidIndexConfig(residual_bits=3)
    with pytest.raises(errors.ConfigError, match="CentroidSearchConfig.mean_weight"):
        cs.CentroidSearchConfig(mean_weight=-0.1)
    with pytest.raises(errors.ConfigError, match="CentroidSearchConfig.mean_docs"):
        cs.CentroidSearchConfig(mean_docs=0)
    with pytest.raises(errors.ConfigError, match="CentroidIndexConfig.doc_means"):
        ci.CentroidIndexConfig(doc_means="yes")
    # probes follow the built index's list lengths (a query token reaches ~640 documents),
    # between 2 and 32; refinement follows k (3 refined per requested) above a floor in √N
    resolved = cs.CentroidSearchConfig().resolved
    assert resolved(5183, 16384, 40.0) == (16, 216, 54)
    assert resolved(5183, 16384, 80.0, k=100) == (8, 1200, 300)
    assert resolved(5183, 16384, 80.0, k=1000) == (8, 2048, 512)  # at most 512 refined
    assert resolved(518_300, 65536, 950.0, k=10) == (2, 512, 128)  # 100x SciFact: long lists
    assert resolved(1460, 4096, 80.0) == (8, 160, 40)
    assert resolved(100, 64, 10.0) == (32, 160, 40)
    assert resolved(100, 4, 10.0) == (4, 160, 40)  # never more probes than centroids
    # the scale-free rules are knobs of their own
    custom = cs.CentroidSearchConfig(probe_docs=160, refine_per_k=1.5, interaction_per_refine=2)
    assert custom.resolved(5183, 16384, 40.0, k=100) == (4, 300, 150)
    assert cs.CentroidSearchConfig(probes=3, refine_docs=7).resolved(100, 64, 10.0, 50) == (
        3,
        28,
        7,
    )


def test_residual_candidates_are_on_by_default_with_lists_by_position_past_the_copy_limit(
    store, index, tmp_path, monkeypatch
):
    """``residual_candidates=None`` (the default) turns them on for every index: it reads the
    token lists the index maps, else a copy built at load while it takes at most
    ``LISTS_IN_MEMORY_MAX`` bytes, else the lists by position (documents and rows: 8 bytes per
    kept token, residuals read from the index's map), which rank exactly as the copy does;
    the automatic ``probe_docs`` follows (2,560 at k ≥ 100); given values stay."""
    default = cs.CentroidSearchConfig()
    assert default.residual_candidates is None and default.probe_docs is None
    need = cs.lists_in_memory_bytes(index, store.num_tokens)
    assert need == store.num_tokens * (4 + index.codec.bytes_per_token)  # β^d = 1
    on = cs.CentroidSearcher(store, index)
    assert on.config.residual_candidates is True and on.config.probe_docs is None
    assert on.config.documents_per_probe(100) == on.config.documents_per_probe() == 2560
    (copied,) = on.token_lists()
    assert copied.rows is None and copied.nbytes == need + copied.offsets.nbytes
    monkeypatch.setattr(ci, "LISTS_IN_MEMORY_MAX", need - 1)
    far = cs.CentroidSearcher(store, index)
    assert far.config == on.config
    (by_position,) = far.token_lists()
    assert by_position.rows.dtype == np.int32 and by_position.residuals.base is not None
    assert by_position.nbytes == store.num_tokens * 8 + by_position.offsets.nbytes
    np.testing.assert_array_equal(by_position.offsets, copied.offsets)
    np.testing.assert_array_equal(by_position.docs, copied.docs)
    np.testing.assert_array_equal(
        by_position.residual_rows(np.arange(len(by_position.rows))), copied.residuals
    )
    for seed in range(3):
        q = _query(seed)
        for k in (10, 100):
            (want,), counts = on.search(q.vectors, q.salience, np.arange(5), k=k)
            (got,), far_counts = far.search(q.vectors, q.salience, np.arange(5), k=k)
            assert counts.interaction == counts.refined  # stage 3 skipped: the residual path ran
            assert far_counts == counts
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
    off = cs.CentroidSearcher(store, index, cs.CentroidSearchConfig(residual_candidates=False))
    assert off.config.residual_candidates is False
    assert off.config.documents_per_probe(10) == off.config.documents_per_probe(100) == 640
    q = _query(3)
    _, counts = off.search(q.vectors, q.salience, np.arange(5), k=10)
    assert counts.interaction > counts.refined  # the centroid interaction ran
    given = cs.CentroidSearchConfig(residual_candidates=True, probe_docs=100, refine_float=0.0)
    assert cs.CentroidSearcher(store, index, given).config == given
    # an index that holds its token lists maps them, whatever their size
    small = write_store(tmp_path / "idx", random_documents(40, 16, seed=2, max_len=20), 16, 9)
    mapped = ci.CentroidIndex.build(
        small, ci.CentroidIndexConfig(num_centroids=8, token_lists=True)
    )
    (lists,) = cs.CentroidSearcher(small, mapped).token_lists()
    assert lists.rows is None and isinstance(lists.docs.base, np.memmap)
    # resolved() on a config not yet decided reads an automatic probe_docs as 640
    assert default.resolved(5183, 16384, 80.0) == (8, 216, 54)
    assert cs.CentroidSearchConfig(residual_candidates=True).resolved(5183, 16384, 80.0)[0] == 32


def test_residual_probe_docs_follow_the_requested_k(store, index, monkeypatch):
    """With residual candidates a query token reaches 2,560 documents at k ≥ 100, half as many
    for each tenfold fewer requested (1,280 at k = 10), never fewer than 640; the search probes
    accordingly (fewer clusters, fewer candidates at k = 10), and a given ``probe_docs`` or
    ``probes`` stays whatever k."""
    rule = cs.residual_probe_docs
    assert [rule(k) for k in (None, 1000, 100, 10, 1, 0)] == [2560, 2560, 2560, 1280, 640, 640]
    assert 1280 < rule(30) < 2560 and rule(30) < rule(50) < rule(99) < 2560
    on = cs.CentroidSearchConfig(residual_candidates=True)
    assert on.resolved(5183, 16384, 80.0, k=100)[0] == 32
    assert on.resolved(5183, 16384, 80.0, k=10)[0] == 16
    assert on.resolved(5183, 16384, 80.0)[0] == 32  # k unknown: the deepest search's probes
    off = cs.CentroidSearchConfig(residual_candidates=False)
    assert off.resolved(5183, 16384, 80.0, k=10)[0] == off.resolved(5183, 16384, 80.0, k=100)[0]
    given = cs.CentroidSearchConfig(residual_candidates=True, probe_docs=2560)
    assert given.resolved(5183, 16384, 80.0, k=10)[0] == 32
    # the small index's lists are short: scaled so that k = 100 probes 8 clusters, k = 1 two
    searcher = cs.CentroidSearcher(store, index, on)
    monkeypatch.setattr(cs, "RESIDUAL_PROBE_DOCS", round(8 * searcher.list_docs))
    monkeypatch.setattr(cs, "PROBE_DOCS", round(2 * searcher.list_docs))
    resolved = [on.resolved(store.num_docs, index.num_centroids, searcher.list_docs, k)[0]
                for k in (100, 1)]  # fmt: skip
    assert resolved == [8, 2]
    q = _query(3)
    _, wide = searcher.search(q.vectors, q.salience, np.arange(5), k=100)
    _, narrow = searcher.search(q.vectors, q.salience, np.arange(5), k=1)
    assert narrow.candidates < wide.candidates


def test_the_automatic_reach_is_a_share_of_a_large_collection_at_k_100():
    """Past ``REACH_DOCS`` documents a query token reaches N / REACH_DOCS times as many
    documents at k ≥ 100 (a fixed share of the collection), √(N / REACH_DOCS) times at
    k ≤ 10, in between an exponent interpolated in log k (the probes follow, up to
    ``MAX_PROBES``); smaller collections and a given ``probe_docs`` or ``probes`` are
    unchanged."""
    ref = cs.REACH_DOCS
    assert cs.reach_factor(5183) == cs.reach_factor(ref) == cs.reach_factor(ref, 10) == 1.0
    assert cs.reach_factor(4 * ref) == cs.reach_factor(4 * ref, 100) == pytest.approx(4.0)
    assert cs.reach_factor(4 * ref, 1000) == pytest.approx(4.0)
    assert cs.reach_factor(4 * ref, 10) == cs.reach_factor(4 * ref, 1) == pytest.approx(2.0)
    assert cs.reach_factor(4 * ref, 30) == pytest.approx(4 ** (0.5 + 0.5 * np.log10(3)))
    on = cs.CentroidSearchConfig(residual_candidates=True)
    assert on.resolved(ref, 65536, 1280.0, k=100)[0] == 2
    assert on.resolved(4 * ref, 65536, 1280.0, k=100)[0] == 8  # 2,560 · 4 documents
    assert on.resolved(4 * ref, 65536, 1280.0)[0] == 8  # k not known: the deepest search's
    assert on.resolved(16 * ref, 65536, 1280.0, k=100)[0] == cs.MAX_PROBES  # 32, capped
    assert on.resolved(16 * ref, 65536, 1280.0, k=10)[0] == 4  # 1,280 · √16 documents
    off = cs.CentroidSearchConfig(residual_candidates=False)
    assert off.resolved(4 * ref, 65536, 320.0)[0] == 8  # 640 · 4 documents
    given = cs.CentroidSearchConfig(residual_candidates=True, probe_docs=2560)
    assert given.resolved(16 * ref, 65536, 1280.0, k=100)[0] == 2
    assert cs.CentroidSearchConfig(probes=3).resolved(16 * ref, 65536, 1280.0)[0] == 3


def test_short_queries_reach_as_many_documents_as_a_reference_query(store, index, monkeypatch):
    """``query_tokens_ref``: a query of n < ref probing tokens reaches ref / n times as many
    documents per token (the probes of a ref-token query in all), up to ``MAX_PROBES``; longer
    queries and given probes are unchanged; off (None) by default."""
    ref = cs.CentroidSearchConfig(residual_candidates=True, query_tokens_ref=24)
    plain = cs.CentroidSearchConfig(residual_candidates=True)
    assert plain.query_tokens_ref is None
    assert plain.resolved(5183, 16384, 80.0, k=10, n=6)[0] == 16
    assert ref.resolved(5183, 16384, 80.0, k=10, n=24)[0] == 16
    assert ref.resolved(5183, 16384, 80.0, k=10, n=40)[0] == 16
    assert ref.resolved(5183, 16384, 80.0, k=10, n=0)[0] == 16  # n not known
    assert ref.resolved(5183, 16384, 80.0, k=10, n=16)[0] == 24  # 1,280 · 24 / 16 / 80
    assert ref.resolved(5183, 16384, 80.0, k=10, n=6)[0] == cs.MAX_PROBES
    given = dataclasses.replace(ref, probes=5)
    assert given.resolved(5183, 16384, 80.0, k=10, n=6)[0] == 5
    with pytest.raises(errors.ConfigError, match="query_tokens_ref"):
        cs.CentroidSearchConfig(query_tokens_ref=0)
    # on the small index: a 2-token query probes more clusters with the reference on
    monkeypatch.setattr(
        cs, "RESIDUAL_PROBE_DOCS", round(2 * cs.CentroidSearcher(store, index, plain).list_docs)
    )
    q = _query(3)
    counts = [
        cs.CentroidSearcher(store, index, config).search(
            q.vectors, q.salience, np.arange(2), k=100
        )[1]
        for config in (plain, dataclasses.replace(ref, query_tokens_ref=8))
    ]
    assert counts[0].candidates < counts[1].candidates


@pytest.mark.parametrize("beta_d", [1.0, 0.5])
def test_token_lists_hold_each_centroids_kept_tokens_in_store_order(store, beta_d):
    """Built shard by shard (the store has 6 shards), the lists equal one stable sort of every
    kept token's code, with 32-bit documents, and carry those tokens' residuals."""
    index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(residual_bits=4, beta_d=beta_d))
    (lists,) = cs.CentroidSearcher(store, index).token_lists()
    kept = ci.kept_rows(store, beta_d)
    codes = np.asarray(index.codes, np.int64)[kept]
    rows = kept[np.argsort(codes, kind="stable")]
    assert lists.docs.dtype == np.int32
    assert len(kept) < store.num_tokens or beta_d == 1.0
    np.testing.assert_array_equal(
        lists.offsets, np.r_[0, np.cumsum(np.bincount(codes, minlength=index.num_centroids))]
    )
    np.testing.assert_array_equal(lists.docs, np.searchsorted(store.offsets, rows, "right") - 1)
    np.testing.assert_array_equal(lists.residuals, np.asarray(index.residuals)[rows])
    # by position: the same offsets and documents, each entry's row of the (one) segment
    (by_position,) = cs.CentroidSearcher(store, index)._build_token_lists(by_position=True)
    np.testing.assert_array_equal(by_position.offsets, lists.offsets)
    np.testing.assert_array_equal(by_position.docs, lists.docs)
    np.testing.assert_array_equal(by_position.rows, rows)
    assert by_position.rows.dtype == np.int32
    np.testing.assert_array_equal(by_position.residual_rows(np.arange(len(rows))), lists.residuals)


@pytest.mark.parametrize("beta_d", [1.0, 0.5])
def test_persisted_token_lists_equal_those_built_at_load_and_are_mapped(
    tmp_path, monkeypatch, beta_d
):
    """``CentroidIndexConfig.token_lists``: the build writes the lists a searcher would build
    in memory, the same bytes whatever the block size it fills them by (20 entries per block
    here: many passes), and a searcher maps them instead of building them."""
    store = write_store(tmp_path / "idx", random_documents(90, 16, seed=5, max_len=30), 16, 9)
    config = ci.CentroidIndexConfig(num_centroids=16, cells=4, beta_d=beta_d, token_lists=True)
    whole = ci.CentroidIndex.build(store, config)
    monkeypatch.setattr(lists_lib, "TOKEN_BLOCK_BYTES", 20 * (whole.codec.bytes_per_token + 4))
    built = ci.CentroidIndex.build(store, config)
    assert whole.meta["num_centroids"] == 16 and built.meta["generation"] == 2
    searcher = cs.CentroidSearcher(store, ci.CentroidIndex.load(ts.TokenStore(store.directory)))
    (mapped,) = searcher.token_lists()
    (reference,) = searcher._build_token_lists()
    assert mapped.rows is None and reference.rows is None
    for got, want in zip(mapped[:3], reference[:3], strict=True):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype
    for array in (mapped.docs, mapped.residuals):
        assert isinstance(array.base, np.memmap)  # a view of the file's map, not a copy
    kinds = {k for g in built.meta["lists"] for k in g["tables"]}
    assert set(lists_lib.TOKEN_LISTS) <= kinds
    assert not ci.CentroidIndex.build(
        store, ci.CentroidIndexConfig(num_centroids=16)
    ).lists.has_token_lists


def test_default_token_lists_are_written_where_a_search_could_not_hold_them(tmp_path, monkeypatch):
    """``CentroidIndexConfig.token_lists=None`` (the default) writes them when their copy in
    memory would exceed ``LISTS_IN_MEMORY_MAX`` (where the search would otherwise run without
    residual candidates), except at 2 bits; the decision is recorded (the rule stays the
    config's), the search then maps them, and an add writes them for the added documents."""
    from aligner_jax.indexing import updates

    docs = random_documents(60, 16, seed=4, max_len=20)
    store = write_store(tmp_path / "idx", docs[:50], 16, 9)
    kept = store.num_tokens
    assert ci.token_lists_bytes(kept, 16, 4) == kept * (4 + 8)
    assert ci.token_lists_bytes(kept, 384, 2) == kept * (4 + 96)
    rule = ci.CentroidIndexConfig()
    assert rule.token_lists is None
    assert not ci.writes_token_lists(rule, kept, 16)  # small: a search builds them at load
    monkeypatch.setattr(ci, "LISTS_IN_MEMORY_MAX", kept * 12 - 1)
    assert ci.writes_token_lists(rule, kept, 16)
    assert not ci.writes_token_lists(ci.CentroidIndexConfig(residual_bits=2), kept, 16)
    assert not ci.writes_token_lists(ci.CentroidIndexConfig(token_lists=False), kept, 16)
    monkeypatch.setattr(ci, "LISTS_IN_MEMORY_MAX", kept * 12)
    assert not ci.writes_token_lists(rule, kept, 16)
    assert ci.writes_token_lists(ci.CentroidIndexConfig(token_lists=True), kept, 16)

    monkeypatch.setattr(ci, "LISTS_IN_MEMORY_MAX", 0)  # every index "too large to copy"
    index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(num_centroids=8))
    assert index.lists.has_token_lists
    assert index.meta["token_lists"] is True and index.meta["config"]["token_lists"] is None
    searcher = cs.CentroidSearcher(store, index)
    assert searcher.config.residual_candidates is True  # mapped, though nothing may be copied
    updates.add_encoded(store.directory, docs[50:])
    grown = ts.TokenStore(store.directory)
    added = ci.CentroidIndex.load(grown)
    assert added.lists.has_token_lists
    assert ci.recorded_config(store.directory).token_lists is None  # a rebuild decides again
    compact = ci.CentroidIndex.build(
        grown, ci.CentroidIndexConfig(num_centroids=8, residual_bits=2)
    )
    assert not compact.lists.has_token_lists and compact.meta["token_lists"] is False
    # nothing may be copied: grouped by centroid, the segment's residuals are its lists'
    assert compact.meta["segments"][0]["order"] == "clusters"
    (by_position,) = cs.CentroidSearcher(grown, compact).token_lists()
    assert by_position.rows is None
    unordered = ci.CentroidIndex.build(
        grown, ci.CentroidIndexConfig(num_centroids=8, residual_bits=2, cluster_order=False)
    )
    (by_position,) = cs.CentroidSearcher(grown, unordered).token_lists()
    assert by_position.rows is not None
    with pytest.raises(errors.ConfigError, match="token_lists"):
        ci.CentroidIndexConfig(token_lists="yes")


def test_an_index_grouped_by_centroid_reads_and_ranks_as_in_store_order(tmp_path, monkeypatch):
    """``cluster_order``: the segment's residual file holds the store-order residuals in the
    stable order of their codes; every read through the index (rows, spans, the whole) gives
    them in store order; a search's lists read them as runs (no rows) and hand the index its
    position map; searches rank as on the same index in store order, before and after an
    ``--add`` (whose segment stays in store order)."""
    from aligner_jax.indexing import updates

    docs = random_documents(90, DIM, seed=12, max_len=30)
    config = {"num_centroids": 16, "residual_bits": 2}
    indexes = {}
    for order in (False, True):
        store = write_store(tmp_path / str(order), docs[:70], DIM, 9)
        built = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(**config, cluster_order=order))
        indexes[order] = (store, built)
    (store, plain), (_, grouped) = indexes[False], indexes[True]
    assert grouped.meta["segments"][0]["order"] == "clusters"
    assert "order" not in plain.meta["segments"][0]
    assert grouped.meta["config"]["cluster_order"] is True
    codes = np.asarray(plain.codes)
    np.testing.assert_array_equal(np.asarray(grouped.codes), codes)
    want = np.asarray(plain.residuals)
    (raw,) = grouped.residuals.arrays
    np.testing.assert_array_equal(raw, want[np.argsort(codes, kind="stable")])
    assert not np.array_equal(raw, want)
    np.testing.assert_array_equal(np.asarray(grouped.residuals), want)
    rows = np.random.default_rng(0).integers(0, len(want), 50)
    np.testing.assert_array_equal(grouped.residuals[rows], want[rows])
    np.testing.assert_array_equal(grouped.residuals.span(7, 61), want[7:61])

    monkeypatch.setattr(ci, "LISTS_IN_MEMORY_MAX", 0)  # the plain index's lists by position
    for grown in (False, True):
        searchers = {}
        for order in (False, True):
            store = ts.TokenStore(tmp_path / str(order))
            searchers[order] = cs.CentroidSearcher(store, ci.CentroidIndex.load(store))
        lists = {order: s.token_lists() for order, s in searchers.items()}
        assert lists[True][0].rows is None and lists[False][0].rows is not None
        np.testing.assert_array_equal(lists[True][0].docs, lists[False][0].docs)
        np.testing.assert_array_equal(
            np.asarray(lists[True][0].residuals), want[np.asarray(lists[False][0].rows)]
        )
        positions = searchers[True].index.residuals._positions[0]  # handed over by the lists
        np.testing.assert_array_equal(positions, ci.cluster_positions(codes))
        if grown:
            assert [len(lst) for lst in lists.values()] == [2, 2]  # the added segment's lists
            assert lists[True][1].rows is not None  # in store order
        for seed in range(6):
            q = _query(40 + seed, n=6)
            for k in (10, 100):
                (a,), _ = searchers[False].search(q.vectors, q.salience, np.arange(6), k)
                (b,), _ = searchers[True].search(q.vectors, q.salience, np.arange(6), k)
                np.testing.assert_array_equal(a[0], b[0])
                np.testing.assert_array_equal(a[1], b[1])
        if not grown:
            for order in (False, True):
                updates.add_encoded(tmp_path / str(order), docs[70:])
    with pytest.raises(errors.ConfigError, match="cluster_order=True needs beta_d=1.0"):
        ci.CentroidIndexConfig(cluster_order=True, beta_d=0.5)
    with pytest.raises(errors.ConfigError, match="token_lists"):
        ci.CentroidIndexConfig(cluster_order=True, token_lists=True)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps")
def test_token_lists_leave_no_index_pages_resident(tmp_path):
    """Building the lists reads every kept token's residual through the index's map; those
    pages are released after (the lists hold their own copy), not left counted in RSS."""
    store = write_store(tmp_path / "idx", random_documents(400, 64, seed=3, max_len=60), 64)
    index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(residual_bits=8))
    (mapped,) = index.residuals.arrays
    assert mapped.nbytes > 500_000
    (lists,) = cs.CentroidSearcher(store, index).token_lists()
    assert mapped_rss_kib(mapped) < 64  # the old build left every page: ~mapped.nbytes / 1024
    codes = np.asarray(index.codes, np.int64)
    rows = np.argsort(codes, kind="stable")
    np.testing.assert_array_equal(lists.residuals, np.asarray(index.residuals)[rows])


def _decoded(store, index):
    return index.centroids[np.asarray(index.codes, np.int64)] + index.codec.decode(
        np.asarray(index.residuals)
    )


def _imputed_means(store, index, qk, probes, w, depth: float = 1.0) -> dict[int, float]:
    """The reference of WARP-style scoring, one document at a time: each query token's best
    decoded token in its ``probes`` best centroids' lists, else its ⌈depth·(probes + 1)⌉-th
    centroid's score (depth 1: its first unprobed one); the w-weighted mean, for every
    document some query token reached."""
    s = qk @ index.centroids.T
    order = np.argsort(-s, axis=1)
    missing = s[np.arange(len(qk)), order[:, math.ceil(depth * (probes + 1)) - 1]]
    sims = qk @ _decoded(store, index).T
    doc_of = np.repeat(np.arange(store.num_docs), store.doc_lengths)
    expected = {}
    for d in range(store.num_docs):
        per_token, hit = [], False
        for i in range(len(qk)):
            mine = (doc_of == d) & np.isin(index.codes, order[i, :probes])
            hit |= bool(mine.any())
            per_token.append(sims[i, mine].max() if mine.any() else missing[i])
        if hit:
            expected[d] = float(w @ np.array(per_token) / w.sum())
    return expected


def test_xtr_probing_every_centroid_is_mean_of_token_maxima_over_decoded_vectors(store, index):
    searcher = cs.CentroidSearcher(
        store, index, cs.CentroidSearchConfig(xtr_probes=index.num_centroids)
    )
    q = _query(11, n=6)
    rows = np.arange(6)
    (docs, scores), reached = searcher.xtr(q.vectors, rows, k=store.num_docs)
    assert reached == store.num_docs and len(docs) == store.num_docs
    sims = q.vectors @ _decoded(store, index).T  # [n, T]
    starts = store.offsets[:-1]
    expected = np.maximum.reduceat(sims, starts, axis=1).mean(axis=0)
    np.testing.assert_allclose(scores, expected[docs], rtol=1e-5, atol=1e-5)
    assert np.all(np.diff(scores) <= 1e-7)  # best first


def test_xtr_imputes_unreached_tokens_with_the_first_unprobed_centroid_score(
    store, index, compiled
):
    probes = 3
    searcher = cs.CentroidSearcher(store, index, cs.CentroidSearchConfig(xtr_probes=probes))
    q = _query(12, n=4)
    rows = np.array([0, 2, 3])  # token 1 pruned (β^q)
    (docs, scores), reached = searcher.xtr(q.vectors, rows, k=1000)
    expected = _imputed_means(store, index, q.vectors[rows], probes, np.ones(3, np.float32))
    assert reached == len(expected) and set(docs.tolist()) == set(expected)
    for d, x in zip(docs, scores, strict=True):
        assert x == pytest.approx(expected[int(d)], abs=1e-5)


def test_searcher_runs_xtr_on_the_centroid_backend(store, index):
    cfg = search_lib.SearchConfig(backend="centroid", refine="xtr", top_k=7)
    searcher = search_lib.Searcher(store, cfg, centroid_index=index)
    q = _query(13, n=5)
    out = searcher.run(["q"], [q])
    assert list(out.results) == ["xtr"] and len(out.results["xtr"]["q"]) == 7
    (docs, scores), _ = searcher.centroid.xtr(q.vectors, np.arange(5), 7)
    assert list(out.results["xtr"]["q"]) == [store.doc_ids[int(d)] for d in docs]
    assert len(out.search_ms) == 1 and len(out.costs) == 1


def test_salience_off_scores_colbert_sum_of_maxima_on_every_path(store, index):
    """``SearchConfig.salience=False``: u^q = u^d = 1 in Eq. 2, so top-1 alignment is the mean of
    each query token's best dot product (ColBERT's sum of maxima / n) on the exhaustive, the
    centroid (compressed, every document refined) and the rerank paths alike; with saliences
    on, the learned u^q, u^d of the fixture change the scores."""
    q = _query(3)
    length = int(store.doc_lengths.max())
    v, d_mask, _, _ = store.gather_padded(np.arange(store.num_docs), length)
    sims = np.einsum("nd,cmd->cnm", q.vectors, v.astype(np.float32))
    maxsim = np.where(d_mask[:, None, :], sims, -np.inf).max(-1).mean(-1)
    expected = np.argsort(-maxsim, kind="stable")[:10]

    def top(searcher):
        ranked = searcher.run(["q"], [q], show_progress=False, k=10).results["top_k:1"]["q"]
        return [store.doc_ids.index(d) for d in ranked], np.array(list(ranked.values()))

    exact = search_lib.SearchConfig(backend="exact", k_prime=0, top_k=10, salience=False)
    docs, scores = top(search_lib.Searcher(store, exact))
    assert docs == list(expected)
    np.testing.assert_allclose(scores, maxsim[expected], rtol=1e-5)
    gated, gated_scores = top(search_lib.Searcher(store, dataclasses.replace(exact, salience=True)))
    assert not np.allclose(gated_scores, maxsim[gated], rtol=1e-3)  # saliences do weigh in

    wide = cs.CentroidSearchConfig(
        probes=index.num_centroids, interaction_docs=store.num_docs, refine_docs=store.num_docs
    )
    fast = search_lib.SearchConfig(backend="centroid", top_k=10, salience=False)
    docs, scores = top(search_lib.Searcher(store, fast, centroid_index=index, centroid_config=wide))
    np.testing.assert_allclose(scores, maxsim[docs], atol=0.01)  # 8-bit residuals
    reranked = search_lib.Searcher(store, exact).rerank(
        ["q"], [q], {"q": list(store.doc_ids)}, show_progress=False, k=10
    )
    assert [store.doc_ids.index(d) for d in reranked.results["top_k:1"]["q"]] == list(expected)
    with pytest.raises(errors.ConfigError, match="beta_q=0.5 ranks query tokens by salience"):
        search_lib.SearchConfig(salience=False, beta_q=0.5)


def test_interaction_keeps_exactly_the_tokens_of_each_documents_best_centroids(
    store, index, compiled
):
    """Stage 3 marks a stored token iff its centroid is its document's best for some query
    token of weight > 0 (brute force over the tokens' codes), compiled and with NumPy."""
    searcher = cs.CentroidSearcher(store, index)
    q = _query(3)
    weights = np.array([1.0, 0.0, 0.5, 0.2, 1.0], np.float32)  # token 1 does not count
    s_t = np.ascontiguousarray(q.vectors @ index.centroids.T).T
    docs = np.array([4, 0, 31, 17])
    score = searcher.interaction(s_t, docs, weights)
    keep = searcher.best_centroid_tokens(s_t, docs, weights)
    expected_keep, expected_score = [], []
    for d in docs:
        codes = np.asarray(index.codes[np.arange(store.offsets[d], store.offsets[d + 1])])
        sims = s_t[codes]  # [tokens, n]
        best = sims.max(axis=0)
        expected_score.append(best @ weights / weights.sum())
        expected_keep.append((sims[:, weights > 0] == best[weights > 0]).any(axis=1))
    np.testing.assert_allclose(score, expected_score, rtol=1e-6)
    np.testing.assert_array_equal(keep, np.concatenate(expected_keep))
    assert 0 < keep.sum() < len(keep)


def test_refinement_given_the_best_centroid_scores_keeps_the_best_centroid_tokens(store, index):
    """The search's residual interaction (``refine(best_centroids=...)``, which finds the kept
    tokens from the centroid scores it gathers) scores exactly the tokens of
    ``best_centroid_tokens`` (checked against brute force above)."""
    searcher = cs.CentroidSearcher(store, index)
    q = _query(5)
    weights = np.array([0.7, 0.0, 1.0, 0.3, 0.9], np.float32)
    s_t = np.ascontiguousarray(q.vectors @ index.centroids.T).T
    docs = np.array([9, 2, 30, 14, 0])
    best = searcher._interaction(s_t, docs, weights)[1]
    keep = searcher.best_centroid_tokens(s_t, docs, weights)
    assert 0 < keep.sum() < len(keep)
    np.testing.assert_array_equal(
        searcher.refine(q.vectors, s_t, docs, weights, best_centroids=best),
        searcher.refine(q.vectors, s_t, docs, weights, keep=keep),
    )


@pytest.mark.parametrize("columns", [1000, 4096, 70_001])
def test_top_columns_selects_each_rows_largest_entries(columns):
    """The block-maxima selection returns, for every row, w distinct columns holding the w
    largest values (ties included: integer-valued scores), for blocks that do and do not
    divide the row."""
    rng = np.random.default_rng(columns)
    for s in (
        rng.normal(size=(7, columns)).astype(np.float32),
        rng.integers(0, 50, size=(7, columns)).astype(np.float32),
    ):
        for w in (1, 2, 3, 9, 33):
            top = cs.top_columns(s, w)
            assert top.shape == (7, w)
            assert all(len(set(row)) == w for row in top.tolist())
            expected = -np.sort(-s, axis=1)[:, :w]
            got = -np.sort(-np.take_along_axis(s, top, axis=1), axis=1)
            np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("centroids", [5, 64, 3000])
def test_probed_selects_each_tokens_best_centroids_from_the_transposed_scores(centroids):
    """``probed`` on Sᵀ ``[C, n]`` (the layout the search computes): for each query token of
    ``rows`` (a subset, out of order), its p best centroids best first, their scores and the
    ⌈depth·(p + 1)⌉-th best as the imputed score — the reference being a stable sort of the
    token's whole row of S, so that ties (integer-valued scores) go to the lower centroid.
    The NumPy path (no numba) selects the same scores. NaN and −∞ are never probed: the
    compiled pass hands such a token to the NumPy path."""
    rng = np.random.default_rng(centroids)
    for s_t in (
        rng.normal(size=(centroids, 9)).astype(np.float32),
        rng.integers(0, 6, size=(centroids, 9)).astype(np.float32),
    ):
        rows = np.array([7, 0, 3, 8])
        for p, depth in ((1, 1.0), (3, 2.0), (centroids, 1.0), (2, 50.0)):
            width = min(max(math.ceil(depth * (p + 1)), p + 1), centroids)
            top, scores, imputed = cs.probed(s_t, p, depth, rows)
            order = np.argsort(-s_t.T[rows], axis=1, kind="stable")[:, :width]
            p_ = min(p, centroids)
            np.testing.assert_array_equal(top, order[:, :p_])
            np.testing.assert_array_equal(scores, np.take_along_axis(s_t.T[rows], top, 1))
            last = np.take_along_axis(s_t.T[rows], order[:, -1:], 1)[:, 0]
            np.testing.assert_array_equal(imputed, last if width > p else last - 1.0)
            with pytest.MonkeyPatch.context() as m:
                m.setattr(probe_select, "numba", None)  # the NumPy path
                _, numpy_scores, numpy_imputed = cs.probed(s_t, p, depth, rows)
            np.testing.assert_array_equal(numpy_scores, scores)
            np.testing.assert_array_equal(numpy_imputed, imputed)
    s_t = rng.normal(size=(centroids, 3)).astype(np.float32)
    s_t[1:, 1] = np.nan  # token 1 has one real score: its other "best" must not be NaN
    s_t[0, 2] = -np.inf
    assert probe_select.select(s_t, np.array([1]), 2) is None
    top, scores, _ = cs.probed(s_t, 1, 1.0, np.array([0, 2]))
    assert top[1, 0] != 0 and np.isfinite(scores).all()


def test_best_selects_the_largest_scores_by_threshold_and_falls_back_on_a_bad_sample():
    """``_best`` returns m distinct indices holding the m largest scores — through the sampled
    threshold (many scores, few wanted), and through the full partition when the sample's
    threshold lets fewer than m through: here the strided sample holds only large scores, so
    its threshold passes 383 of the 1,000 wanted. Of the scores tied at the m-th, the lowest
    indices are taken (not the partition's choice), also when the m-th is the threshold
    itself and no partition runs. ``_top`` orders them, best first."""
    rng = np.random.default_rng(3)
    n = 10_000
    cases = [
        (rng.normal(size=n).astype(np.float32), (1, 10, 128, 1000, 1250)),
        (rng.integers(0, 40, size=n).astype(np.float32), (10, 300)),  # ties at the m-th
        # the threshold itself tied (a third of the sample is 2): no score above it
        (rng.integers(0, 3, size=n).astype(np.float32), (300, 1250)),
        (np.where(rng.random(n) < 0.9, -np.inf, rng.normal(size=n)).astype(np.float32), (50,)),
    ]
    step = n // cs.SELECT_SAMPLE
    rigged = np.full(n, 0.5, np.float32) + rng.random(n).astype(np.float32) * 1e-3
    rigged[::step] = 1.0 + np.arange(len(rigged[::step]), dtype=np.float32) * 1e-4
    cases.append((rigged, (1000,)))
    for scores, ms in cases:
        for m in ms:
            best = cs._best(scores, m)
            assert len(best) == m == len(set(best.tolist()))
            expected = -np.sort(-scores)[:m]
            np.testing.assert_array_equal(-np.sort(-scores[best]), expected)
            top = cs._top(scores, m)
            np.testing.assert_array_equal(scores[top], expected)
            # ties at the m-th score go to the lowest indices, and the indices ascend
            np.testing.assert_array_equal(best, np.sort(np.argsort(-scores, kind="stable")[:m]))
            np.testing.assert_array_equal(top, np.argsort(-scores, kind="stable")[:m])
    np.testing.assert_array_equal(np.sort(cs._best(rigged, 1000)), np.arange(6000, n, 4))
    np.testing.assert_array_equal(cs._best(np.ones(5, np.float32), 9), np.arange(5))
    with_nan = np.array([0.5, np.nan, 0.9, np.nan, 0.1, 0.7], np.float32)
    np.testing.assert_array_equal(np.sort(cs._best(with_nan, 3)), [0, 2, 5])


def test_residual_interaction_is_a_lower_bound_equal_to_refinement_on_every_token(store, index):
    """Scoring only the kept tokens with residuals never exceeds full refinement (max over a
    subset; uniform saliences), equals it with every token kept, and the search that uses it
    still ranks like exhaustive search on planted queries."""
    searcher = cs.CentroidSearcher(store, index, salience=False)
    q = _query(7)
    u = np.ones(5, np.float32)
    s_t = np.ascontiguousarray(q.vectors @ index.centroids.T).T
    docs = np.arange(store.num_docs)
    keep = searcher.best_centroid_tokens(s_t, docs, u)
    full = searcher.refine(q.vectors, s_t, docs, u)
    partial = searcher.refine(q.vectors, s_t, docs, u, keep=keep)
    assert np.all(partial <= full + 1e-6) and np.any(partial < full - 1e-4)
    np.testing.assert_allclose(
        searcher.refine(q.vectors, s_t, docs, u, keep=np.ones(len(keep), bool)), full, rtol=1e-6
    )
    for flag in (True, False):
        ranker = cs.CentroidSearcher(
            store, index, cs.CentroidSearchConfig(residual_interaction=flag)
        )
        for d in (5, 23):
            v, _, t = store.document(d)
            planted = _unit(np.asarray(v[:6], np.float32))
            (ranking,), _ = ranker.search(planted, np.ones(len(planted)), np.arange(len(t[:6])), 10)
            assert ranking[0][0] == d


def test_query_tokens_of_weight_zero_take_no_part(store, index):
    """A token with u^q = 0 adds nothing to any score (Eq. 2), so it is neither probed nor
    scored: the ranking (every document it reaches, k = all) equals the query without it —
    before, the documents only it reached were appended as candidates."""
    searcher = cs.CentroidSearcher(store, index)
    q = _query(11, n=8)
    u = q.salience.copy()
    u[[1, 4, 6]] = 0.0
    live = u > 0
    k = store.num_docs
    ((docs, scores),), counts = searcher.search(q.vectors, u, np.arange(8), k)
    ((docs_live, scores_live),), counts_live = searcher.search(
        q.vectors[live], u[live], np.arange(int(live.sum())), k
    )
    np.testing.assert_array_equal(docs, docs_live)
    np.testing.assert_allclose(scores, scores_live, rtol=1e-6)
    assert counts == counts_live
    # probe rows given as a subset keep their meaning: rows 0 and 4 (weight 0) → row 0 alone
    ((docs_sub, _),), _ = searcher.search(q.vectors, u, np.array([0, 4]), k)
    ((docs_one, _),), _ = searcher.search(q.vectors[live], u[live], np.array([0]), k)
    np.testing.assert_array_equal(docs_sub, docs_one)


def test_every_refined_document_from_float_vectors_skips_the_compressed_pass(store, index):
    """When the float refinement re-scores every refined document (here 12 refined, at least
    30 re-scored), the compressed stage 4 that would only order them for it does not run: the
    same ranking, by Eq. 1–2's exact scores."""
    config = cs.CentroidSearchConfig(refine_docs=12, interaction_docs=40, refine_float=2.0)
    searcher = cs.CentroidSearcher(store, index, config)
    q = _query(17, n=6)
    stage4 = []
    refine = searcher.refine
    searcher.refine = lambda q_, s_t, docs, u_q, keep=None, best_centroids=None: (
        stage4.append(keep is None and best_centroids is None)
        or refine(q_, s_t, docs, u_q, keep=keep, best_centroids=best_centroids)
    )
    ((docs, scores),), counts = searcher.search(q.vectors, q.salience, np.arange(6), 10)
    assert counts.refined == 12 and not any(stage4)
    whole = _float_top1(store, q)
    np.testing.assert_allclose(scores, whole[docs], rtol=1e-5, atol=1e-6)
    assert list(docs) == sorted(docs, key=lambda d: -whole[d])[:10]


@pytest.mark.parametrize("k", [20, 100])
def test_the_default_rescores_every_refined_document_from_float_vectors(store, index, k):
    """By default (stop 79) a model with saliences re-scores every refined document from the
    float store, 3·k of them up to ``REFINE_FLOAT_MAX`` (2·k before, after a compressed pass
    over all 3·k that only chose them): no compressed stage-4 pass, and the ranking is the
    refined documents' by Eq. 1–2's exact scores."""
    config = cs.CentroidSearchConfig(interaction_docs=200)
    searcher = cs.CentroidSearcher(store, index, config)
    assert searcher.config.refine_float == cs.REFINE_PER_K
    q = _query(23, n=6)
    stage4, rescored = [], []
    refine, refine_stored = searcher.refine, searcher.refine_stored
    searcher.refine = lambda q_, s_t, docs, u_q, keep=None, best_centroids=None: (
        stage4.append(keep is None and best_centroids is None)
        or refine(q_, s_t, docs, u_q, keep=keep, best_centroids=best_centroids)
    )
    searcher.refine_stored = lambda q_, docs, u_q: (
        rescored.append(len(docs)) or refine_stored(q_, docs, u_q)
    )
    ((docs, scores),), counts = searcher.search(q.vectors, q.salience, np.arange(6), k)
    assert counts.refined == min(math.ceil(cs.REFINE_PER_K * k), store.num_docs)
    assert rescored == [counts.refined] and not any(stage4)
    whole = _float_top1(store, q)
    np.testing.assert_allclose(scores, whole[docs], rtol=1e-5, atol=1e-6)


def test_weighed_tokens_leave_out_the_lightest_tokens_up_to_their_share():
    """The tokens left out are the lightest whose weights together are at most the share of
    the query's (weight 0 always; ties by position); a query of no weight keeps none."""
    u = np.array([0.5, 1e-9, 0.0, 0.3, 2e-5, 1.0], np.float32)
    np.testing.assert_array_equal(cs.weighed_tokens(u, 1e-4), [1, 0, 0, 1, 0, 1])
    np.testing.assert_array_equal(cs.weighed_tokens(u, 0.0), [1, 1, 0, 1, 1, 1])
    # 0.3 is 16.7 % of the weight: out at 0.2, not at 0.16
    np.testing.assert_array_equal(cs.weighed_tokens(u, 0.2), [1, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(cs.weighed_tokens(u, 0.16), [1, 0, 0, 1, 0, 1])
    np.testing.assert_array_equal(cs.weighed_tokens(np.ones(3), 0.4), [0, 1, 1])
    assert not cs.weighed_tokens(np.zeros(4), 1e-4).any()
    with pytest.raises(errors.ConfigError, match="light_share"):
        cs.CentroidSearchConfig(light_share=0.6)


def test_light_query_tokens_are_not_probed_but_count_in_the_float_refinement(store, index):
    """Query tokens whose weights together are next to nothing (a trained model gives a third
    of a query's tokens u^q ≤ 10⁻³ of its largest) are left out of stages 2–4's compressed
    scoring: the same documents reached and refined as the query without them. The float
    refinement (Eq. 1–2 exactly) still counts them: its scores equal exhaustive search's for
    the whole query."""
    few = dict(probes=1, refine_float_min=10)  # a token reaches a few of the 60 documents
    searcher = cs.CentroidSearcher(store, index, cs.CentroidSearchConfig(**few))
    q = _query(13, n=8)
    u = q.salience.copy()
    u[[2, 5]] = 1e-7  # together 10⁻⁷ of the weight and less: light
    heavy = np.ones(8, bool)
    heavy[[2, 5]] = False
    k = 10
    ((docs, scores),), counts = searcher.search(q.vectors, u, np.arange(8), k)
    ((docs_h, _),), counts_h = searcher.search(q.vectors[heavy], u[heavy], np.arange(6), k)
    assert counts == counts_h
    assert set(docs) == set(docs_h)
    whole = _float_top1(store, dataclasses.replace(q, salience=u))
    np.testing.assert_allclose(scores, whole[docs], rtol=1e-5, atol=1e-6)
    # the light tokens reach other documents: probed, they would have been candidates
    everything = cs.CentroidSearcher(store, index, cs.CentroidSearchConfig(**few, light_share=0))
    (_,), counts_all = everything.search(q.vectors, u, np.arange(8), k)
    assert counts_all.candidates > counts.candidates


@pytest.mark.parametrize("n", [1, 7, 57])
def test_segment_max_is_the_maximum_of_each_run_of_rows(n, monkeypatch):
    monkeypatch.setattr(cs, "SEGMENT_ROWS", 64)  # many blocks, and runs longer than a block
    rng = np.random.default_rng(n)
    lengths = np.concatenate([rng.integers(1, 20, 40), [150], rng.integers(1, 70, 30)])
    values = rng.standard_normal((int(lengths.sum()), n)).astype(np.float32)
    got = cs.segment_max(values, lengths)
    ends = np.cumsum(lengths)
    expected = np.stack([values[e - m : e].max(axis=0) for e, m in zip(ends, lengths, strict=True)])
    assert got.shape == (len(lengths), n) and got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


def test_segment_max_gives_minus_infinity_for_an_empty_run():
    values = np.arange(12, dtype=np.float32).reshape(6, 2)
    got = cs.segment_max(values, np.array([0, 2, 0, 4, 0]))
    np.testing.assert_array_equal(
        got, [[-np.inf, -np.inf], [2, 3], [-np.inf, -np.inf], [10, 11], [-np.inf, -np.inf]]
    )
    assert cs.segment_max(values[:0], np.zeros(0, np.int64)).shape == (0, 2)


def test_segment_max_selects_the_largest_value_among_the_rows_at_the_maximum(monkeypatch):
    monkeypatch.setattr(cs, "SEGMENT_ROWS", 8)
    rng = np.random.default_rng(3)
    lengths = np.array([3, 1, 12, 5, 0, 4])
    values = rng.integers(0, 3, (lengths.sum(), 4)).astype(np.float32)  # many ties
    salience = rng.random(lengths.sum()).astype(np.float32)
    best, selected = cs.segment_max(values, lengths, at_max=salience)
    np.testing.assert_array_equal(best, cs.segment_max(values, lengths))
    ends = np.cumsum(lengths)
    for d, (e, m) in enumerate(zip(ends, lengths, strict=True)):
        for i in range(4):
            if m == 0:
                assert selected[d, i] == -np.inf
                continue
            col = values[e - m : e, i]
            assert selected[d, i] == salience[e - m : e][col == col.max()].max()


@pytest.fixture(params=[True, False], ids=["numba", "numpy"])
def compiled(request, monkeypatch):
    """Runs a test with the compiled passes (``probe_scores``, ``gather_max``) and with their
    NumPy paths."""
    if request.param:
        assert probe_scores.available(), "numba is a dependency (requirements.txt)"
    else:
        monkeypatch.setattr(probe_scores, "numba", None)
        monkeypatch.setattr(probe_select, "numba", None)
        monkeypatch.setattr(gather_max, "numba", None)
    return request.param


def _residual_candidates(searcher, q, rows):
    s_t = searcher.index.centroids @ q.vectors.T
    cands, approx = searcher.residual_candidates(q.vectors, s_t, rows, q.salience)
    return dict(zip(cands.tolist(), approx.tolist(), strict=True))


def test_residual_candidates_probing_every_centroid_score_each_tokens_best_decoded_match(
    store, index, compiled
):
    """Stage 2 with residuals, every centroid probed: Σ_i u_i max_j q_i·(c_j + r̂_j) / Σ u_i."""
    cfg = cs.CentroidSearchConfig(probes=index.num_centroids, residual_candidates=True)
    searcher = cs.CentroidSearcher(store, index, cfg)
    q = _query(21, n=6)
    found = _residual_candidates(searcher, q, np.arange(6))
    sims = q.vectors @ _decoded(store, index).T  # [n, T]
    best = np.maximum.reduceat(sims, store.offsets[:-1], axis=1)  # [n, docs]
    expected = (q.salience @ best) / q.salience.sum()
    assert sorted(found) == list(range(store.num_docs))
    np.testing.assert_allclose([found[d] for d in range(store.num_docs)], expected, atol=1e-5)


@pytest.mark.parametrize("depth", [None, 1.0, 1.5])
def test_residual_candidates_impute_unreached_tokens_with_a_deeper_centroid(
    store, index, compiled, depth
):
    """An unreached query token counts its ⌈depth·(probes + 1)⌉-th centroid's score: the
    default depth 2 (the 8th of 3 probes), 1 (WARPSELECT's first unprobed one), 1.5 (the 6th)."""
    probes = 3
    extra = {} if depth is None else {"impute_depth": depth}
    cfg = cs.CentroidSearchConfig(probes=probes, residual_candidates=True, **extra)
    assert cfg.impute_depth == (depth or 2.0)
    searcher = cs.CentroidSearcher(store, index, cfg)
    q = _query(22, n=4)
    rows = np.array([0, 2, 3])  # token 1 pruned (β^q): it takes no part in stage 2
    found = _residual_candidates(searcher, q, rows)
    expected = _imputed_means(
        store, index, q.vectors[rows], probes, q.salience[rows], cfg.impute_depth
    )
    assert set(found) == set(expected)
    for d, x in found.items():
        assert x == pytest.approx(expected[d], abs=1e-5)


def test_residual_candidates_skip_deleted_documents_and_leave_the_scratch_as_found(
    store, index, compiled
):
    """Deleted documents are never candidates; the per-thread scratch is left as found (−∞
    floor, zero sums, nothing seen), so the next query starts clean and scores the same."""
    cfg = cs.CentroidSearchConfig(probes=3, residual_candidates=True)
    searcher = cs.CentroidSearcher(store, index, cfg)
    q = _query(24, n=5)
    first = _residual_candidates(searcher, q, np.arange(5))
    _, acc, seen = searcher._buffers()
    assert not seen.any() and not acc.any()
    assert np.isneginf(searcher._floor()).all()
    dead = sorted(first)[:3]
    alive = np.ones(store.num_docs, bool)
    alive[dead] = False
    s_t = index.centroids @ q.vectors.T
    cands, approx = searcher.residual_candidates(q.vectors, s_t, np.arange(5), q.salience, alive)
    assert set(cands.tolist()) == set(first) - set(dead)
    for d, x in zip(cands.tolist(), approx.tolist(), strict=True):
        assert x == pytest.approx(first[d], abs=1e-6)
    assert _residual_candidates(searcher, q, np.arange(5)) == pytest.approx(first, abs=1e-6)


def test_residual_candidates_search_refines_the_best_and_ranks_like_wide_open_refinement(
    store, index
):
    """Every document refined: the ranking is the compressed refinement's (stage 4) of all."""
    n_docs = store.num_docs
    wide = cs.CentroidSearchConfig(
        probes=index.num_centroids, interaction_docs=n_docs, refine_docs=n_docs
    )
    q = _query(23, n=5)
    rows = np.arange(5)
    (want,), _ = cs.CentroidSearcher(store, index, wide).search(q.vectors, q.salience, rows, 10)
    cfg = dataclasses.replace(wide, residual_candidates=True)
    (got,), counts = cs.CentroidSearcher(store, index, cfg).search(q.vectors, q.salience, rows, 10)
    assert counts.refined == n_docs and counts.candidates == n_docs
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], atol=1e-6)
    # fewer refined: the refined block comes first, the rest in stage-2 order below it
    few = dataclasses.replace(cfg, refine_docs=3)
    (part,), counts = cs.CentroidSearcher(store, index, few).search(q.vectors, q.salience, rows, 10)
    assert counts.refined == 3 and len(part[0]) == 10 and np.all(np.diff(part[1]) <= 0)


def test_residual_candidates_score_on_as_many_threads_as_blas_may_use(store, index, monkeypatch):
    """The compiled stage 2 takes its thread count from the BLAS limit of the moment
    (``--threads``, ``threadpool_limits``), and 2 threads reach the same documents with the same
    scores (up to float rounding) as 1."""
    import threadpoolctl

    calls = []
    accumulate = probe_scores.accumulate

    def recording(*args, threads=1, rows=None):
        calls.append(threads)
        return accumulate(*args, threads=threads, rows=rows)

    monkeypatch.setattr(probe_scores, "accumulate", recording)
    searcher = cs.CentroidSearcher(store, index, cs.CentroidSearchConfig(residual_candidates=True))
    q = _query(5, n=6)
    found = {}
    for threads in (1, 2):
        with threadpoolctl.threadpool_limits(threads, user_api="blas"):
            found[threads] = _residual_candidates(searcher, q, np.arange(6))
    assert calls == [1, 2]
    assert found[1].keys() == found[2].keys() and len(found[1]) > 1
    np.testing.assert_allclose(
        [found[2][d] for d in found[1]], list(found[1].values()), rtol=1e-6, atol=1e-6
    )


class _SpinningLibrary:
    """A stand-in for a loaded OpenBLAS whose idle workers spin (``blas._spinning_libraries``):
    records every thread count it is given."""

    def __init__(self, num_threads):
        self.num_threads = num_threads
        self.given = []

    def set_num_threads(self, num_threads):
        self.given.append(num_threads)
        self.num_threads = num_threads


def test_a_query_holds_spinning_openblas_at_one_thread_and_keeps_its_own_threads(
    store, index, monkeypatch
):
    """Where NumPy's OpenBLAS spins (NumPy imported first), a search holds it at one thread
    while it runs and gives its count back after; stage 2 still takes the BLAS limit of before
    (2 threads here), the matrix products are cut between those threads, and the rankings are
    those of a search with nothing held."""
    import threadpoolctl

    from aligner_jax.common import blas

    searcher = cs.CentroidSearcher(store, index, cs.CentroidSearchConfig(residual_candidates=True))
    q = _query(7, n=6)
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        (want,), _ = searcher.search(q.vectors, q.salience, np.arange(6), 10)
    library = _SpinningLibrary(2)
    seen, products = [], []
    accumulate, matmul = probe_scores.accumulate, np.matmul

    def recording(*args, threads=1, rows=None):
        seen.append((threads, library.num_threads))
        return accumulate(*args, threads=threads, rows=rows)

    def product(a, b, out=None):
        products.append(len(a))
        return matmul(a, b, out=out)

    monkeypatch.setattr(blas, "_spinning", [[library]])
    monkeypatch.setattr(blas, "MATMUL_PART_ROWS", 1)
    monkeypatch.setattr(blas.np, "matmul", product)
    monkeypatch.setattr(probe_scores, "accumulate", recording)
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        (got,), _ = searcher.search(q.vectors, q.salience, np.arange(6), 10)
    assert seen == [(2, 1)]  # stage 2 on 2 threads while the library holds one
    assert library.given == [1, 2] and library.num_threads == 2
    halves = np.diff(np.linspace(0, index.num_centroids, 3).astype(int))
    assert sorted(products[:2]) == sorted(halves)  # Sᵀ, cut between the 2 threads
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-6)


def test_searcher_runs_and_reranks_hold_spinning_openblas_and_give_it_back(
    store, index, monkeypatch
):
    """``Searcher.run`` (every search) and ``Searcher.rerank`` hold a spinning OpenBLAS at one
    thread while they run (a rerank's float products too, which wake its workers as a search's
    do), give the count back after, and rank as with nothing held: exhaustive search through
    the host's top-1 pass, its float products cut between 2 threads."""
    import threadpoolctl

    from aligner_jax.common import blas

    exhaustive = search_lib.Searcher(
        store, search_lib.SearchConfig(backend="exact", k_prime=0, top_k=5)
    )
    q = _query(11)
    docs = {"q": [str(d) for d in store.doc_ids[:20]]}
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        want = (exhaustive.run(["q"], [q]), exhaustive.rerank(["q"], [q], docs, k=5))
    library = _SpinningLibrary(2)
    seen = []
    matmul = blas.matmul

    def product(a, b, out):
        seen.append((blas.threads(), library.num_threads))
        return matmul(a, b, out)

    monkeypatch.setattr(blas, "_spinning", [[library]])
    monkeypatch.setattr(blas, "matmul", product)
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        got = (exhaustive.run(["q"], [q]), exhaustive.rerank(["q"], [q], docs, k=5))
    assert seen and set(seen) == {(2, 1)}
    assert library.given == [1, 2, 1, 2] and library.num_threads == 2
    for g, w in zip(got, want, strict=True):
        assert list(g.results["top_k:1"]["q"]) == list(w.results["top_k:1"]["q"])
        np.testing.assert_allclose(
            list(g.results["top_k:1"]["q"].values()),
            list(w.results["top_k:1"]["q"].values()),
            rtol=1e-6,
        )


def _planted_soft_match_store(directory, monkeypatch):
    """A store and index where stage 2 cannot tell the best document from its distractors.

    Query tokens e0..e3. 40 distractors hold e0 (and junk); the relevant document R, last,
    holds a token at 0.98 of e0 and, for e1..e3, tokens at 0.7 (soft matches) in centroids of
    their own, while each e_i's best centroid (one probe) holds a decoy at 0.95 that R lacks:
    stage 2 reaches R and the distractors through e0 only and imputes the rest alike, so R
    ranks below every distractor there; exact MaxSim puts R first (0.77 against 0.25)."""
    dim, rng = 16, np.random.default_rng(0)
    e = np.eye(dim, dtype=np.float32)
    decoy = [_unit(0.95 * e[i] + 0.31 * e[4 + i]) for i in (1, 2, 3)]
    soft = [_unit(0.7 * e[i] + 0.714 * e[8 + i]) for i in (1, 2, 3)]
    near_e0 = _unit(e[0] + 0.2 * e[13])
    centroids = np.stack([e[0], *decoy, *soft, e[15]])

    def doc(name, rows):
        v = _unit(np.stack(rows) + rng.normal(scale=1e-3, size=(len(rows), dim)))
        return ts.EncodedDocument(
            doc_id=name, vectors=v.astype(np.float16), salience=np.ones(len(v), np.float32),
            token_ids=np.arange(5, 5 + len(v), dtype=np.int32),
        )  # fmt: skip

    docs = [doc(f"distractor{i}", [e[0], e[15], e[15]]) for i in range(40)]
    docs += [doc(f"decoy{i}", [d, e[15]]) for i, d in enumerate(decoy)]
    docs.append(doc("relevant", [near_e0, *soft, e[15]]))
    store = write_store(directory, docs, dim, shard_size=9)
    monkeypatch.setattr(
        ci.kmeans, "fit_two_level", lambda *a, **k: (centroids, _unit(centroids.mean(0)[None]))
    )
    index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(residual_bits=8, cells=1))
    np.testing.assert_allclose(index.centroids, centroids, atol=1e-6)
    query = EncodedText(
        token_ids=np.arange(5, 9, dtype=np.int32), vectors=e[:4].copy(),
        salience=np.ones(4, np.float32),
    )  # fmt: skip
    return store, index, query


def test_rescoring_stage_2s_best_refines_a_document_its_estimate_ranks_low(tmp_path, monkeypatch):
    """With residual candidates, ``rescore_per_refine`` re-scores stage 2's best documents by
    the residual interaction (their tokens in each one's best centroid per query token) before
    the best ``refine_docs`` of them are refined: a document whose matches stage 2 only
    imputed is refined and ranked first; without it, it stays below the refined distractors
    (the documents' mean vectors off: with them, stage 2 alone ranks it first, below)."""
    store, index, q = _planted_soft_match_store(tmp_path / "idx", monkeypatch)
    relevant = store.doc_ids.index("relevant")
    exact = np.ravel(_float_top1(store, q))
    assert int(np.argmax(exact)) == relevant and exact[relevant] > 0.75
    base = cs.CentroidSearchConfig(
        probes=1, refine_docs=3, residual_candidates=True, refine_float=0.0, mean_weight=0.0
    )
    rows = np.arange(4)
    ranks = {}
    for rescore in (0.0, 20.0):
        cfg = dataclasses.replace(base, rescore_per_refine=rescore)
        searcher = cs.CentroidSearcher(store, index, cfg)
        (ranking,), counts = searcher.search(q.vectors, q.salience, rows, 100)
        assert counts.candidates == store.num_docs and counts.refined == 3
        assert counts.interaction == (3 if rescore == 0 else store.num_docs)
        assert np.all(np.diff(ranking[1]) <= 0) and len(ranking[0]) == store.num_docs
        ranks[rescore] = ranking[0].tolist().index(relevant) if relevant in ranking[0] else None
    assert ranks[20.0] == 0
    assert ranks[0.0] > 3  # below the refined distractors and ranked among the rest
    # the documents' mean vectors (stage 2's estimate + mean_weight · q̄·m_d) tell it apart too
    means = dataclasses.replace(base, rescore_per_refine=0.0, mean_weight=cs.MEAN_WEIGHT)
    searcher = cs.CentroidSearcher(store, index, means)
    (ranking,), counts = searcher.search(q.vectors, q.salience, rows, 100)
    assert counts.interaction == 3 and ranking[0][0] == relevant
    # and so do its best centroid scores in place of the imputed terms (``fill_docs``)
    filled = dataclasses.replace(base, rescore_per_refine=0.0, fill_docs=store.num_docs)
    searcher = cs.CentroidSearcher(store, index, filled)
    (ranking,), counts = searcher.search(q.vectors, q.salience, rows, 100)
    assert counts.interaction == 3 and ranking[0][0] == relevant


def test_rescoring_waits_for_a_query_whose_refined_candidates_stage_2_mostly_imputed(
    tmp_path, monkeypatch
):
    """``rescore_below_reach``: the re-scoring runs only when the share of the query's weight
    that stage 2 reached in its would-be refined documents is below it. Here they are
    distractors reached by 1 of 4 query tokens (0.25; the documents' mean vectors off, which
    would put the relevant one among them)."""
    store, index, q = _planted_soft_match_store(tmp_path / "idx", monkeypatch)
    relevant = store.doc_ids.index("relevant")
    base = cs.CentroidSearchConfig(
        probes=1,
        refine_docs=3,
        residual_candidates=True,
        refine_float=0.0,
        rescore_per_refine=20,
        mean_weight=0.0,
    )
    searcher = cs.CentroidSearcher(store, index, base)
    s_t = np.ascontiguousarray(index.centroids @ q.vectors.T)
    distractors = np.array([store.doc_ids.index(f"distractor{i}") for i in range(3)])
    share = searcher.reached_share(s_t, np.arange(4), 1, distractors, q.salience)
    assert share == pytest.approx(0.25)
    both = np.append(distractors[:1], relevant)  # the relevant one is reached by e0 too
    assert searcher.reached_share(s_t, np.arange(4), 1, both, q.salience) == pytest.approx(0.25)
    assert searcher.reached_share(s_t, np.arange(4), 2, both, q.salience) == pytest.approx(0.625)
    for reach, rescored in ((0.3, True), (0.2, False), (1.0, True), (0.0, False)):
        cfg = dataclasses.replace(base, rescore_below_reach=reach)
        searcher = cs.CentroidSearcher(store, index, cfg)
        (ranking,), counts = searcher.search(q.vectors, q.salience, np.arange(4), 100)
        assert counts.interaction == (store.num_docs if rescored else 3), reach
        assert (ranking[0][0] == relevant) == rescored, reach


def test_reached_share_counts_the_query_tokens_whose_probed_clusters_hold_a_document_token(
    store, index
):
    """Brute force over the documents' codes: token i reaches a document when one of its
    tokens' centroids is among i's ``probes`` best; weighted by u^q, mean over documents."""
    searcher = cs.CentroidSearcher(store, index)
    q = _query(9, n=6)
    rows = np.array([0, 2, 3, 5])
    s_t = np.ascontiguousarray(index.centroids @ q.vectors.T)
    docs = np.array([3, 11, 40, 7, 25])
    for probes in (1, 3, 8):
        top = np.argsort(-s_t.T[rows], axis=1)[:, :probes]
        w = q.salience[rows]
        expected = []
        for d in docs:
            codes = set(np.asarray(index.codes[store.offsets[d] : store.offsets[d + 1]]).tolist())
            hit = np.array([bool(codes & set(t.tolist())) for t in top])
            expected.append(hit @ w / w.sum())
        got = searcher.reached_share(s_t, rows, probes, docs, q.salience)
        assert got == pytest.approx(np.mean(expected), abs=1e-6)
        probe = cs.probed(s_t, probes, 2.0, rows)  # what the search passes: the same share
        assert searcher.reached_share(s_t, rows, probes, docs, q.salience, probe) == got


def test_rescored_documents_follow_the_requested_k():
    """⌈rescore_per_refine · min(k / 100, 1) · refine_docs⌉, none when not above refine_docs:
    the default re-scores 3 × the refined documents at k ≥ 100, none at k = 10."""
    cfg = cs.CentroidSearchConfig()
    assert cfg.rescore_per_refine == cs.RESCORE_PER_REFINE == 3.0
    assert cfg.rescore_below_reach == cs.RESCORE_BELOW_REACH == 0.7
    assert cfg.rescored(300, 100) == 900 and cfg.rescored(300, 1000) == 900
    assert cfg.rescored(150, 50) == 225
    assert cfg.rescored(54, 10) == 0 and cfg.rescored(100, 33) == 0
    assert cs.CentroidSearchConfig(rescore_per_refine=0.0).rescored(300, 100) == 0
    with pytest.raises(errors.ConfigError, match="rescore_per_refine"):
        cs.CentroidSearchConfig(rescore_per_refine=-1.0)
    with pytest.raises(errors.ConfigError, match="rescore_below_reach"):
        cs.CentroidSearchConfig(rescore_below_reach=1.5)


def test_token_lists_hold_one_block_in_memory_at_a_time(tmp_path, monkeypatch):
    """The token lists are filled one block at a time and each block is let go once written:
    a block still referenced while the next one fills doubled the build's peak memory at
    100M tokens (two 256 MiB blocks; stop 63)."""
    store = write_store(tmp_path / "idx", random_documents(90, 16, seed=5, max_len=30), 16, 9)
    config = ci.CentroidIndexConfig(num_centroids=16, cells=4, token_lists=True)
    width = ci.CentroidIndex.build(store, config).codec.bytes_per_token
    monkeypatch.setattr(lists_lib, "TOKEN_BLOCK_BYTES", 20 * (width + 4))
    fill = lists_lib._token_block
    earlier, alive_at_calls = [], []

    def tracked(*args, **kwargs):
        alive_at_calls.append(sum(ref() is not None for ref in earlier))
        block = fill(*args, **kwargs)
        earlier.extend(weakref.ref(array) for array in block)
        return block

    monkeypatch.setattr(lists_lib, "_token_block", tracked)
    ci.CentroidIndex.build(store, config)
    assert len(alive_at_calls) > 3  # many blocks
    assert alive_at_calls == [0] * len(alive_at_calls)


@pytest.mark.skipif(not lists_lib.numba, reason="the compiled placement needs numba")
@pytest.mark.parametrize("beta_d", [1.0, 0.6])
def test_compiled_token_placement_equals_numpys_run_slots(tmp_path, monkeypatch, beta_d):
    """``_token_block`` places each block's tokens in one compiled pass (``_place_tokens``):
    the same documents and residual rows, in the same order, as NumPy's sort-based
    ``run_slots`` (the path without numba), for every block of consecutive centroids and with
    β^d pruning."""
    store = write_store(tmp_path / "idx", random_documents(70, 16, seed=8, max_len=40), 16, 11)
    config = ci.CentroidIndexConfig(num_centroids=16, cells=4, beta_d=beta_d)
    index = ci.CentroidIndex.build(store, config)
    shards = range(len(store.shard_spans()))
    offsets = lists_lib._token_offsets(store, index.codes, shards, beta_d, 16)
    blocks = [(0, 16), (0, 5), (5, 6), (6, 16)]
    compiled = [
        lists_lib._token_block(store, index.codes, index.residuals, shards, beta_d, offsets, *b)
        for b in blocks
    ]
    monkeypatch.setattr(lists_lib, "numba", None)
    for (lo, hi), (docs, packed) in zip(blocks, compiled, strict=True):
        want_docs, want_packed = lists_lib._token_block(
            store, index.codes, index.residuals, shards, beta_d, offsets, lo, hi
        )
        assert len(docs) == offsets[hi] - offsets[lo] > 0
        np.testing.assert_array_equal(docs, want_docs)
        np.testing.assert_array_equal(packed, want_packed)
    whole_docs, whole_packed = compiled[0]
    np.testing.assert_array_equal(np.concatenate([d for d, _ in compiled[1:]]), whole_docs)
    np.testing.assert_array_equal(np.concatenate([p for _, p in compiled[1:]]), whole_packed)


@pytest.mark.parametrize("beta_d", [1.0, 0.6])
def test_lists_by_position_are_the_same_whatever_the_runs_and_without_numba(
    tmp_path, monkeypatch, beta_d
):
    """``token_rows_in_memory`` reads the codes in runs of whole shards (``block_tokens``) and
    places them split by centroid between threads: one shard per run, a few, or all, in one
    to three threads, give the stable sort of the kept tokens by centroid — documents and
    rows — compiled (``_place_rows``) or with NumPy's ``run_slots``."""
    store = write_store(tmp_path / "idx", random_documents(70, 16, seed=8, max_len=40), 16, 11)
    index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(num_centroids=16, beta_d=beta_d))
    spans = store.shard_spans()
    assert len(spans) >= 5
    kept = ci.kept_rows(store, beta_d)
    assert len(kept) < store.num_tokens or beta_d == 1.0
    rows = kept[np.argsort(np.asarray(index.codes, np.int64)[kept], kind="stable")]
    args = (store, index.codes, index.residuals, 16, beta_d)
    shard_tokens = max(span[0]["num_tokens"] for span in spans)
    assert len(lists_lib._shard_runs(spans, range(len(spans)), 1)) == len(spans)
    assert 1 < len(lists_lib._shard_runs(spans, range(len(spans)), 2 * shard_tokens)) < len(spans)
    offsets = np.r_[0, np.cumsum([5, 0, 0, 7, 1, 0, 9])]
    assert lists_lib._centroid_parts(offsets, 1) == [(0, 7)]
    assert lists_lib._centroid_parts(offsets, 3) == [(0, 4), (4, 7)]  # 12 | 10 entries
    assert lists_lib._centroid_parts(np.zeros(4, np.int64), 2) == [(0, 3)]
    for numba_on in (True, False):
        if not numba_on:
            monkeypatch.setattr(lists_lib, "numba", None)
        for block_tokens, threads in ((1, 1), (2 * shard_tokens, 3), (None, 2)):
            (lists,) = lists_lib.token_rows_in_memory(*args, block_tokens, threads)
            np.testing.assert_array_equal(lists.rows, rows)
            np.testing.assert_array_equal(
                lists.docs, np.searchsorted(store.offsets, rows, "right") - 1
            )
            assert lists.offsets[-1] == len(kept)


def test_stage_two_gives_its_best_their_centroid_scores_where_it_imputed(store, index):
    """``with_centroid_terms``: for stage 2's best ``fill_docs`` documents, each query token
    whose probed clusters hold none of a document's tokens (its best centroid score for the
    token below the token's ``probes``-th best) counts that best centroid score instead of
    the imputed one; the others get the least change (they stay below); 0 leaves the estimate
    as it is."""
    searcher = cs.CentroidSearcher(store, index, cs.CentroidSearchConfig(fill_docs=6))
    q = _query(33, n=5)
    rows, probes = np.array([0, 1, 3, 4]), 2
    s_t = np.ascontiguousarray(index.centroids @ q.vectors.T)
    probe = cs.probed(s_t, probes, searcher.config.impute_depth, rows)
    rng = np.random.default_rng(1)
    cands = rng.permutation(store.num_docs)[:15]
    approx = rng.normal(size=15).astype(np.float32)
    got = searcher.with_centroid_terms(s_t, rows, probe, q.salience, cands, approx)
    w = q.salience[rows]
    top = np.argsort(-approx)[:6]
    delta = np.zeros(15)
    floor, imputed = probe[1][:, -1], probe[2]
    for j in top:  # the reference: every stored token's centroid, scored one by one
        codes = index.codes[store.offsets[cands[j]] : store.offsets[cands[j] + 1]]
        best = s_t[np.asarray(codes)][:, rows].max(axis=0)
        delta[j] = np.sum(w * np.where(best < floor, best - imputed, 0.0)) / w.sum()
    assert np.count_nonzero(delta[top]) >= 3 and np.ptp(delta[top]) > 1e-3
    want = approx + delta[top].min()
    want[top] = approx[top] + delta[top]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert got[np.setdiff1d(np.arange(15), top)].max() <= got[top].min()
    off = cs.CentroidSearcher(store, index, cs.CentroidSearchConfig(fill_docs=0))
    np.testing.assert_array_equal(
        off.with_centroid_terms(s_t, rows, probe, q.salience, cands, approx), approx
    )


def test_stage_two_adds_the_documents_mean_vector_term_to_its_best(store, index):
    """``with_means``: stage 2's best ``mean_docs`` documents get ``mean_weight`` · q̄·m_d (q̄
    the u^q-weighted mean of the probing query tokens, m_d the index's document mean), the
    others the least of those terms (they stay below); weight 0, or an index built without the
    means, leaves the estimate as it is, and a search then ranks as before."""
    assert index.means is not None and len(index.means) == store.num_docs
    searcher = cs.CentroidSearcher(store, index, cs.CentroidSearchConfig(mean_docs=5))
    assert searcher.config.mean_weight == cs.MEAN_WEIGHT == 0.2
    q = _query(31, n=4)
    rows = np.array([0, 2, 3])
    rng = np.random.default_rng(0)
    cands = rng.permutation(store.num_docs)[:12]
    approx = rng.normal(size=12).astype(np.float32)
    got = searcher.with_means(q.vectors, q.salience, rows, cands, approx)
    w = q.salience[rows]
    q_bar = (w @ q.vectors[rows]) / w.sum()
    dense = np.asarray(index.means[cands], np.float32) @ q_bar
    top = np.argsort(-approx)[:5]
    others = np.setdiff1d(np.arange(12), top)
    want = approx + 0.2 * dense[top].min()
    want[top] = approx[top] + 0.2 * dense[top]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert got[others].max() <= got[top].min()
    assert not np.allclose(got[top] - approx[top], got[top][0] - approx[top][0])  # per document
    off = cs.CentroidSearcher(store, index, cs.CentroidSearchConfig(mean_weight=0.0))
    np.testing.assert_array_equal(
        off.with_means(q.vectors, q.salience, rows, cands, approx), approx
    )
    bare = ci.CentroidIndex.build(
        store, ci.CentroidIndexConfig(residual_bits=8, doc_means=False), commit=False
    )
    assert bare.means is None and not bare.meta["doc_means"]
    plain = cs.CentroidSearcher(store, bare, cs.CentroidSearchConfig(probes=2))
    np.testing.assert_array_equal(
        plain.with_means(q.vectors, q.salience, rows, cands, approx), approx
    )
    weightless = cs.CentroidSearcher(
        store, index, cs.CentroidSearchConfig(probes=2, mean_weight=0.0)
    )
    for seed in range(3):
        qq = _query(40 + seed, n=5)
        (a,), _ = plain.search(qq.vectors, qq.salience, np.arange(5), 10)
        (b,), _ = weightless.search(qq.vectors, qq.salience, np.arange(5), 10)
        np.testing.assert_array_equal(a[0], b[0])


def test_the_refined_documents_tokens_are_counted_for_the_flops_report(tmp_path):
    """metrics.json's scoring_flops counted no document token for the centroid index
    (m̄ 0: about 5 orders of magnitude under the refinement's real cost); the searcher now
    counts the stored tokens of the documents it refined."""
    docs = random_documents(60, DIM, seed=5, min_len=7, max_len=7)  # every document 7 tokens
    store = write_store(tmp_path / "idx", docs, DIM, shard_size=11)
    index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(residual_bits=8))
    searcher = cs.CentroidSearcher(store, index, cs.CentroidSearchConfig(refine_docs=13))
    q = _query(3)
    _, counts = searcher.search(q.vectors, q.salience, np.arange(5), k=5)
    assert counts.refined > 0 and counts.refined_tokens == 7 * counts.refined
    full = search_lib.Searcher(
        store,
        search_lib.SearchConfig(backend="centroid", filter_exact_docs=0),
        centroid_index=index,
    )
    out = full.run(["q"], [q], k=5, show_progress=False)
    (cost,) = out.costs
    assert cost.candidates > 0 and cost.candidate_doc_tokens == 7 * cost.candidates
