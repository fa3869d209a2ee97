"""Serving on Qdrant (issue 12, item 3): a tiny token store exported to the real engine,
in-process (``qdrant_edge``), and to ``qdrant_client``'s local mode; its answers against ours.

The store is the toy collection plus mixed documents, encoded by a tiny random BERT without
salience (u ≡ 1), so ALIGNER's top-1 score is Σ_i max_j q_i·d_j / n_q: Qdrant's MaxSim ÷ n_q.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import gin
import numpy as np
import pytest
import scipy.sparse as sp
from fixtures import TOY_DOCS, TOY_QUERIES, run_module, write_beir_fixture

from aligner_jax.common import cli, errors
from aligner_jax.data import beir, bm25, corpus_sources
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import Encoder, EncodingConfig
from aligner_jax.indexing import indexer, updates
from aligner_jax.indexing import token_store as ts
from aligner_jax.lexical import meaning
from aligner_jax.lexical.minicoil import MiniCoilConfig, MiniCoilIndex
from aligner_jax.retrieval import lexical_stages as lexical_lib
from aligner_jax.retrieval import searcher as search_lib
from aligner_jax.serving import exporter, publish_job, querying, targets
from aligner_jax.serving import sparse as sparse_lib

TEXTS = [d["text"] for d in TOY_DOCS.values()]
MIXED = {  # more documents sharing words, so rankings have depth (lengths differ: no BM25 ties)
    f"m{i}": {"title": "Mixed" + " note" * i, "text": f"{TEXTS[i % 12]} {TEXTS[(3 * i + 5) % 12]}"}
    for i in range(18)
}
DOCS = {**TOY_DOCS, **MIXED}
QUERIES = list(TOY_QUERIES.values()) + ["gravity of the moon and black holes", "zzz unknownword"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A token store of DOCS (tiny BERT, no salience) with its encoder.json."""
    root = tmp_path_factory.mktemp("serving")
    folder = write_beir_fixture(root, DOCS, TOY_QUERIES, {}, name="docs")
    gin.clear_config()
    cli.parse_gin(["models/bert_tiny.gin"], ["AlignerConfig.salience = 'none'"])
    encoder = Encoder(loading.load_encoder(), EncodingConfig())
    gin.clear_config()
    documents, info = corpus_sources.open_corpus(str(folder / "corpus.jsonl"))
    index_dir = root / "index"
    indexer.build_token_store(
        documents, encoder, index_dir, indexer.IndexingConfig(shard_size=8), corpus_info=info
    )
    return index_dir


@pytest.fixture(scope="module")
def published(built, tmp_path_factory):
    path = tmp_path_factory.mktemp("edge") / "shard"
    record = exporter.publish_embedded(ts.TokenStore(built), path)
    return path, record


@pytest.fixture(scope="module")
def exhaustive(built):
    """Our searcher: every document refined with top-1 alignment (its encoder is reused)."""
    return search_lib.Searcher.load(str(built), mode="exhaustive")


@pytest.fixture(scope="module")
def ours(exhaustive):
    return exhaustive.search_batch(QUERIES, len(DOCS))


def _searcher(path, record, mode, encoder, **kw):
    config = querying.QueryConfig(mode=mode, **kw)
    target = targets.EdgeTarget(path)
    return querying.QdrantSearcher.open(target, record, encoder=encoder, config=config)


def test_multivector_top10_equals_the_exhaustive_top1_searcher(built, published, exhaustive, ours):
    path, record = published
    assert record["num_points"] == len(DOCS) and record["sparse"]["kind"] == "bm25"
    qdrant = _searcher(path, record, "multivector", exhaustive.encoder)
    try:
        theirs = qdrant.search_batch(QUERIES, 10)
        raw = qdrant.target.query(
            targets.QuerySpec("multivector", qdrant.encoder.encode(QUERIES[:1], "query")[0].vectors,
                              None, 10)
        )  # fmt: skip
    finally:
        qdrant.target.close()
    for mine, got in zip(ours, theirs, strict=True):
        mine = mine[:10]
        assert [d for d, _ in got] == [d for d, _ in mine]
        np.testing.assert_allclose([s for _, s in got], [s for _, s in mine], rtol=1e-5, atol=1e-6)
    # Qdrant's own score is the raw MaxSim sum: n_q times ALIGNER's normalised top-1 score.
    n_q = len(exhaustive.encoder.encode(QUERIES[:1], "query")[0].vectors)
    np.testing.assert_allclose(raw[0].score, n_q * ours[0][0][1], rtol=1e-5)
    assert raw[0].payload == {"doc_id": ours[0][0][0], "title": DOCS[ours[0][0][0]]["title"]}
    assert raw[0].id == ts.TokenStore(built).doc_ids.index(ours[0][0][0])  # point id = position


def test_bm25_sparse_with_the_idf_modifier_is_bm25index(published, exhaustive):
    path, record = published
    ids = list(DOCS)
    texts = [beir.document_text(beir.Document(i, d["title"], d["text"])) for i, d in DOCS.items()]
    reference = bm25.BM25Index.build(ids, texts)
    expected = reference.search({str(i): q for i, q in enumerate(QUERIES)}, k=10)
    qdrant = _searcher(path, record, "sparse", exhaustive.encoder)
    try:
        theirs = qdrant.search_batch(QUERIES, 10)
    finally:
        qdrant.target.close()
    for i, got in enumerate(theirs):
        mine = expected[str(i)]
        assert [d for d, _ in got] == list(mine)  # only documents sharing a term, best first
        np.testing.assert_allclose([s for _, s in got], list(mine.values()), rtol=1e-5)
    assert theirs[-1] == []  # an unknown word matches nothing


def test_query_values_count_repeated_terms_like_bm25s():
    vectors = sparse_lib.Bm25Vectors.build(["honey bees bees hive", "bees are insects"])
    q = vectors.query_matrix(["bees bees honey", "unknownword"])
    column = vectors.column
    assert q[0, column["bee"]] == 2.0 and q[0, column["honey"]] == 1.0 and q[1].nnz == 0
    # document 0: tf(bee)=2, |d|=4; document 1: bee, insect ("are" is a stopword); avgdl=3
    expected = 2 / (2 + 1.5 * (1 - 0.75 + 0.75 * 4 / 3))
    assert vectors.doc_matrix[0, column["bee"]] == pytest.approx(expected, rel=1e-6)


def test_fusion_is_qdrants_rrf_of_the_two_prefetches(published, exhaustive):
    path, record = published
    qdrant = _searcher(path, record, "fusion", exhaustive.encoder, prefetch_limit=8, rrf_k=60)
    try:
        for text in QUERIES[:5]:
            encoded = qdrant.encoder.encode([text], "query")[0]
            spec = qdrant.spec(encoded, text, 30)  # prefetches max(limit, k) = 30 each
            fused = qdrant.target.query(spec)
            lists = [
                [h.id for h in qdrant.target.query(targets.QuerySpec(m, spec.multivector,
                                                                      spec.sparse,
                                                                      spec.prefetch_limit))]
                for m in ("sparse", "multivector")
            ]  # fmt: skip
            expected = targets.rrf_scores(lists, 60)
            assert {h.id for h in fused} == set(expected)  # the union of both prefetches
            np.testing.assert_allclose([h.score for h in fused], [expected[h.id] for h in fused])
            assert [h.score for h in fused] == sorted((h.score for h in fused), reverse=True)
    finally:
        qdrant.target.close()


def test_rerank_rescores_the_sparse_candidates_by_maxsim(published, exhaustive, ours):
    path, record = published
    qdrant = _searcher(path, record, "rerank", exhaustive.encoder, prefetch_limit=5)
    sparse = querying.QdrantSearcher(  # the same open shard (one opener at a time)
        qdrant.target, qdrant.encoder, qdrant.sparse, querying.QueryConfig(mode="sparse")
    )
    try:
        reranked = qdrant.search_batch(QUERIES[:4], 5)  # prefetch max(5, k) = 5
        candidates = sparse.search_batch(QUERIES[:4], 5)
        with pytest.raises(errors.LockedError, match="one process at a time"):
            _searcher(path, record, "sparse", exhaustive.encoder)
    finally:
        qdrant.target.close()
    for got, cands, mine in zip(reranked, candidates, ours, strict=False):
        full = dict(mine)
        expected = sorted(((d, full[d]) for d, _ in cands), key=lambda x: -x[1])
        assert [d for d, _ in got] == [d for d, _ in expected]
        np.testing.assert_allclose([s for _, s in got], [s for _, s in expected], rtol=1e-5)


def test_deleted_documents_are_not_exported(built, tmp_path, exhaustive):
    copy = tmp_path / "index"
    shutil.copytree(built, copy)
    updates.delete_documents(str(copy), ["d1", "m3"])
    store = ts.TokenStore(copy)
    record = exporter.publish_embedded(store, tmp_path / "shard")
    assert record["num_points"] == len(DOCS) - 2 and record["deleted_skipped"] == 2
    target = targets.EdgeTarget(tmp_path / "shard")
    target.open("bm25")
    try:
        points = target._shard.retrieve(list(range(len(DOCS))), True, False)
    finally:
        target.close()
    assert sorted(p.id for p in points) == [
        i for i, d in enumerate(store.doc_ids) if d not in ("d1", "m3")
    ]
    assert all(p.payload["doc_id"] == store.doc_ids[p.id] for p in points)
    # the exhaustive searcher drops tombstones too: the two still agree
    alive = search_lib.Searcher.load(str(copy), mode="exhaustive", encoder=exhaustive.encoder)
    ours = alive.search("honey bees", 10)
    assert "d1" not in dict(ours)
    qdrant = _searcher(tmp_path / "shard", record, "multivector", exhaustive.encoder)
    try:
        assert [d for d, _ in qdrant.search("honey bees", 10)] == [d for d, _ in ours]
    finally:
        qdrant.target.close()


def test_documents_without_an_indexed_word_are_counted_and_warned_about(built, tmp_path, caplog):
    """Qdrant's IDF counts the points holding a sparse vector; ours every document: a document
    with no indexed word makes the engine's scores differ from BM25Index's, silently before."""
    copy = Path(shutil.copytree(built, tmp_path / "index"))
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"_id": "stop", "title": "", "text": "The and of the it is."}))
    updates.add_documents(str(copy), str(more))  # only stopwords: no indexed word
    with caplog.at_level("WARNING"):
        record = exporter.publish_embedded(ts.TokenStore(copy), tmp_path / "shard")
    assert record["sparse_empty_docs"] == 1 and record["num_points"] == len(DOCS) + 1
    assert "1 documents have no indexed word (an empty bm25 vector" in caplog.text
    assert f"counts the other {len(DOCS)} documents, ours all {len(DOCS) + 1}" in caplog.text


def test_minicoil_idf_check_counts_the_points_the_engine_counts():
    """The engine's N is the rows holding an entry: an empty row (a document without a known
    word) makes miniCOIL's idf (N over every document) differ, and the check says so."""

    class Index:
        doc_matrix = sp.csr_matrix(np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]))
        idf = bm25.lucene_idf(np.array([2, 1]), 3)  # as MiniCoilIndex counts: 3 documents

    assert sparse_lib.MiniCoilVectors(Index(), None).check_idf() > 0.1  # was 0.0
    Index.idf = bm25.lucene_idf(np.array([2, 1]), 2)
    assert sparse_lib.MiniCoilVectors(Index(), None).check_idf() < 1e-12


def test_beta_d_keeps_the_top_tokens_by_salience(built, tmp_path, exhaustive, caplog):
    store = ts.TokenStore(built)
    config = exporter.ExportConfig(beta_d=0.5, sparse="none")
    with caplog.at_level("WARNING"):
        record = exporter.publish_embedded(store, tmp_path / "shard", config)
    assert "beta_d=0.5 on a model without saliences (every u = 1): the export keeps each " in (
        caplog.text
    )  # the first tokens: what the sweep warns about too
    assert record["sparse"] is None and record["beta_d"] == 0.5
    target = targets.EdgeTarget(tmp_path / "shard")
    target.open(None)
    try:
        (point,) = target._shard.retrieve([3], False, True)
    finally:
        target.close()
    vectors, salience, _ = store.document(3)
    kept = np.sort(np.argsort(-salience.astype(np.float32), kind="stable")[: -(-len(vectors) // 2)])
    np.testing.assert_array_equal(
        np.array(point.vector["aligner"]), vectors[kept].astype(np.float32)
    )
    with pytest.raises(errors.ConfigError, match="publish with --sparse=bm25"):
        _searcher(tmp_path / "shard", record, "fusion", exhaustive.encoder).search("bees")


def _rrf_bounds(qdrant, text, prefetch, k=60):
    """Each fused document's lowest and highest RRF score (Σ 1 / (k + r)) when documents whose
    prefetch scores tie (to 1e-6) may take each other's ranks: engines order ties differently."""
    spec = qdrant.spec(qdrant.encoder.encode([text], "query")[0], text, prefetch)
    lo, hi = {}, {}
    for mode in ("sparse", "multivector"):
        hits = qdrant.target.query(targets.QuerySpec(mode, spec.multivector, spec.sparse, prefetch))
        scores = np.array([h.score for h in hits])
        for h in hits:
            ranks = np.flatnonzero(np.isclose(scores, h.score, rtol=1e-6, atol=0))
            doc = h.payload["doc_id"]
            lo[doc] = lo.get(doc, 0.0) + 1 / (k + ranks.max())
            hi[doc] = hi.get(doc, 0.0) + 1 / (k + ranks.min())
    return lo, hi


def test_qdrant_client_local_mode_gives_the_same_answers(built, published, exhaustive):
    path, record = published
    client = targets.ClientTarget("toy", location=":memory:")
    out = exporter.export_store(ts.TokenStore(built), client)
    assert out["num_points"] == len(DOCS)
    for mode in ("multivector", "sparse", "fusion", "rerank"):
        config = querying.QueryConfig(mode=mode, prefetch_limit=6)
        embedded = _searcher(path, record, mode, exhaustive.encoder, prefetch_limit=6)
        local = querying.QdrantSearcher(client, embedded.encoder, embedded.sparse, config)
        k = 30 if mode == "fusion" else 10  # fusion: the whole union of both prefetches
        try:
            a, b = embedded.search_batch(QUERIES, k), local.search_batch(QUERIES, k)
            bounds = (
                [_rrf_bounds(embedded, text, k) for text in QUERIES] if mode == "fusion" else []
            )
        finally:
            embedded.target.close()
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if mode == "fusion":  # tied prefetch scores come in either engine's order
                assert dict(x).keys() == dict(y).keys() == bounds[i][0].keys(), QUERIES[i]
                for hits in (x, y):
                    assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)
                    lo, hi = (np.array([bound[d] for d, _ in hits]) for bound in bounds[i])
                    scores = np.array([s for _, s in hits])
                    assert np.all((scores >= lo * (1 - 1e-5)) & (scores <= hi * (1 + 1e-5)))
                continue
            assert [d for d, _ in x] == [d for d, _ in y], mode
            np.testing.assert_allclose([s for _, s in x], [s for _, s in y], rtol=1e-5)
    with pytest.raises(errors.ConfigError, match="already exists"):
        exporter.export_store(ts.TokenStore(built), client)
    client.close()


class FakeMiniCoil:
    """The MiniCoilIndex contract: doc_matrix / query_matrix without idf, idf per cell."""

    def __init__(self, num_docs: int, cells: int = 24, seed: int = 0):
        rng = np.random.default_rng(seed)
        dense = rng.normal(size=(num_docs, cells)) * (rng.random((num_docs, cells)) < 0.3)
        self.doc_matrix = sp.csr_matrix(dense.astype(np.float32))
        self.idf = bm25.lucene_idf(np.bincount(self.doc_matrix.indices, minlength=cells),
                                         num_docs)  # fmt: skip
        self._cells = cells

    def query_matrix(self, texts):
        rows = [np.random.default_rng(len(t)).normal(size=self._cells) for t in texts]
        return sp.csr_matrix(np.array(rows, np.float32))


def test_minicoil_cells_with_the_idf_modifier_score_q_idf_d(built, tmp_path, exhaustive):
    store = ts.TokenStore(built)
    fake = FakeMiniCoil(store.num_docs)
    config = exporter.ExportConfig(sparse="minicoil")
    record = exporter.publish_embedded(store, tmp_path / "shard", config, minicoil_index=fake)
    assert record["sparse"] == {"kind": "minicoil"}
    assert sparse_lib.MiniCoilVectors(fake).check_idf() < 1e-9
    qdrant = querying.QdrantSearcher.open(
        targets.EdgeTarget(tmp_path / "shard"),
        record,
        encoder=exhaustive.encoder,
        config=querying.QueryConfig(mode="sparse"),
        minicoil_index=fake,
    )
    try:
        got = qdrant.search("honey bees in the hive", 10)
    finally:
        qdrant.target.close()
    q = fake.query_matrix(["honey bees in the hive"]).toarray()[0]
    scores = fake.doc_matrix.toarray() @ (q * fake.idf)
    order = [i for i in np.argsort(-scores, kind="stable") if scores[i] > 0][:10]
    assert [d for d, _ in got] == [store.doc_ids[i] for i in order]
    np.testing.assert_allclose([s for _, s in got], scores[order], rtol=1e-4)


def test_publish_refuses_flags_it_would_ignore(built, tmp_path):
    """Each of these was accepted and ignored: --record beside an embedded shard (then a query
    with it failed, saying no record), a query's --k/--mode/QueryConfig when publishing, and
    QueryConfig.rrf_k=0 (Qdrant's 0-based ranks gave the first hits 1/0 = inf)."""
    shard = str(tmp_path / "shard")
    with pytest.raises(errors.ConfigError, match=r"^--record=r.json: an embedded shard keeps "):
        publish_job.publish_job(str(built), qdrant_path=shard, record="r.json")
    for kwargs, named in (({"k": 5}, "--k"), ({"mode": "sparse"}, "--mode")):
        with pytest.raises(errors.ConfigError, match=rf"^{named}: for a query \(--query=TEXT\)"):
            publish_job.publish_job(str(built), qdrant_path=shard, **kwargs)
    gin.clear_config()
    cli.parse_gin([], ["QueryConfig.prefetch_limit = 50"])
    try:
        with pytest.raises(errors.ConfigError, match=r"^--gin.QueryConfig.\*: for a query"):
            publish_job.publish_job(str(built), qdrant_path=shard)
    finally:
        gin.clear_config()
    assert not (tmp_path / "shard").exists()  # nothing was published
    with pytest.raises(errors.ConfigError, match=r"QueryConfig.rrf_k=0: must be >= 1"):
        querying.QueryConfig(rrf_k=0)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(errors.ConfigError, match=r"^--qdrant_path=.*afile: a file, not a folder"):
        publish_job.publish_job(str(built), qdrant_path=str(tmp_path / "afile"))


def test_publish_binary_exports_then_queries(built, tmp_path, ours):
    path = tmp_path / "shard"
    r = run_module("aligner_jax.publish", f"--index_dir={built}", f"--qdrant_path={path}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"{len(DOCS)} documents (0 deleted skipped)" in r.stdout and "sparse bm25" in r.stdout
    r = run_module(
        "aligner_jax.publish", f"--qdrant_path={path}", f"--query={QUERIES[1]}", "--k=3",
        "--mode=multivector",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == f"query: {QUERIES[1]}  [multivector]" and len(lines) == 4
    assert [line.split()[2] for line in lines[1:]] == [d for d, _ in ours[1][:3]]
    assert lines[1].split()[3:] == DOCS[ours[1][0][0]]["title"].split()  # the payload's title
    r = run_module("aligner_jax.publish", f"--index_dir={built}", "--qdrant_url=http://x:6333")
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "aligner-publish: error: --qdrant_url needs --record=FILE.json (what the query side reads)"
    )


def test_a_foreign_folder_is_never_overwritten(built, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(errors.ConfigError, match="not an aligner-publish shard"):
        exporter.publish_embedded(ts.TokenStore(built), tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    first = exporter.publish_embedded(ts.TokenStore(built), tmp_path / "shard")
    before = (tmp_path / "shard" / exporter.RECORD).read_bytes()
    with pytest.raises(errors.ConfigError, match=r"already holds a publication; pass --overwrite"):
        exporter.publish_embedded(ts.TokenStore(built), tmp_path / "shard")
    assert (tmp_path / "shard" / exporter.RECORD).read_bytes() == before  # untouched
    (tmp_path / "shard" / "stale.txt").write_text("from the first publication")
    again = exporter.publish_embedded(ts.TokenStore(built), tmp_path / "shard", overwrite=True)
    assert again["num_points"] == first["num_points"]
    # Replaced as a whole folder (the record's bytes may coincide: same store, same timings).
    assert not (tmp_path / "shard" / "stale.txt").exists()
    assert json.loads((tmp_path / "shard" / exporter.RECORD).read_text()) == again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "shard"]


def test_publish_binary_refuses_to_replace_an_embedded_publication(built, tmp_path):
    path = tmp_path / "shard"
    first = run_module("aligner_jax.publish", f"--index_dir={built}", f"--qdrant_path={path}")
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_module("aligner_jax.publish", f"--index_dir={built}", f"--qdrant_path={path}")
    assert again.returncode == 1
    assert again.stderr.strip().splitlines()[-1] == (
        f"aligner-publish: error: --qdrant_path={path}: already holds a publication; pass "
        "--overwrite to replace it, or choose another folder"
    )
    cluster = run_module(
        "aligner_jax.publish", f"--index_dir={built}", f"--qdrant_path={tmp_path / 'new'}",
        "--shards=2", "--replication=2",
    )  # fmt: skip
    assert cluster.returncode == 1
    assert cluster.stderr.strip().splitlines()[-1] == (
        "aligner-publish: error: --shards and --replication: an embedded shard (--qdrant_path) "
        "is one shard in one process; shards and replicas are a Qdrant cluster's: publish with "
        "--qdrant_url=URL"
    )
    assert not (tmp_path / "new").exists()


def test_shards_and_replication_reach_the_server_and_the_record(built, tmp_path, monkeypatch):
    """A Qdrant cluster gets ``shard_number`` / ``replication_factor`` at collection creation
    (client local mode accepts them but keeps no cluster, so the request itself is checked)."""
    sent = []
    real = targets.ClientTarget.__init__

    def local_client(self, collection, url=None, location=None, **kwargs):
        real(self, collection, location=":memory:", **kwargs)
        self.url = url
        create = self.client.create_collection
        self.client.create_collection = lambda *a, **kw: sent.append(kw) or create(*a, **kw)

    monkeypatch.setattr(targets.ClientTarget, "__init__", local_client)
    record = tmp_path / "rec.json"
    out = publish_job.publish_job(
        str(built), qdrant_url="http://qdrant:6333", collection="c", record=str(record),
        shards=3, replication=2,
    )  # fmt: skip
    assert "collection 'c' at http://qdrant:6333, 3 shard(s) x 2 replica(s)" in out
    assert sent[0]["shard_number"] == 3 and sent[0]["replication_factor"] == 2
    target = exporter.read_record(record)["target"]
    assert target == {
        "kind": "client", "url": "http://qdrant:6333", "collection": "c",
        "shard_number": 3, "replication_factor": 2,
    }  # fmt: skip
    publish_job.publish_job(
        str(built), qdrant_url="http://qdrant:6333", collection="d", record=str(record)
    )
    assert sent[1]["shard_number"] is None and sent[1]["replication_factor"] is None
    with pytest.raises(errors.ConfigError, match=r"^--shards=0: must be >= 1$"):
        publish_job.publish_job(
            str(built), qdrant_url="http://q:6333", record=str(record), shards=0
        )
    with pytest.raises(errors.ConfigError, match="set when publishing"):
        publish_job.publish_job(None, qdrant_url="http://q:6333", record=str(record),
                                query="bees", replication=2)  # fmt: skip


# ---------------------------------------------------------------------- --sparse=minicoil

# Tiny meaning-model fitting (as tests/test_lexical.py): a few seconds on the 30 documents.
TINY_MINICOIL = {
    "min_sentences": 4,
    "sentences_per_word": 8,
    "validation_fraction": 0.5,
    "steps": 5,
    "teacher": "encoder",
    "triplets_per_word": 16,
    "input_rank": 8,
}
TINY_MINICOIL_GIN = [f"MiniCoilConfig.{k} = {v!r}" for k, v in TINY_MINICOIL.items()]
# Scores: Qdrant sums the float32 products in its own order, scipy in another.
MINICOIL_RTOL, MINICOIL_ATOL = 1e-4, 1e-5


def _publish_job(**kwargs) -> str:
    """``publish_job`` in-process with the tiny miniCOIL settings bound in gin."""
    gin.clear_config()
    cli.parse_gin([], TINY_MINICOIL_GIN)
    try:
        return publish_job.publish_job(**kwargs)
    finally:
        gin.clear_config()


def _texts(doc_ids):
    return [
        beir.document_text(beir.Document(i, DOCS[i]["title"], DOCS[i]["text"])) for i in doc_ids
    ]


@pytest.fixture(scope="module")
def minicoil_reference(built, exhaustive):
    """miniCOIL as aligner-eval builds it: the store's encoder, its documents, models fitted."""
    doc_ids = ts.TokenStore(built).doc_ids
    config = MiniCoilConfig(**TINY_MINICOIL)
    return MiniCoilIndex.build(doc_ids, _texts(doc_ids), exhaustive.encoder, config)


@pytest.fixture(scope="module")
def minicoil_published(built, tmp_path_factory):
    """The store published by the job with --sparse=minicoil (models fitted on its corpus)."""
    path = tmp_path_factory.mktemp("minicoil") / "shard"
    out = _publish_job(index_dir=str(built), qdrant_path=str(path), sparse="minicoil")
    return path, out


def _assert_same_ranking(got, expected, what=""):
    assert [d for d, _ in got] == list(expected), what
    np.testing.assert_allclose(
        [s for _, s in got], list(expected.values()), rtol=MINICOIL_RTOL, atol=MINICOIL_ATOL
    )


def test_minicoil_publication_answers_as_minicoilindex_search(
    minicoil_published, minicoil_reference, exhaustive
):
    path, out = minicoil_published
    assert f"{len(DOCS)} documents" in out and "sparse minicoil (" in out
    record = exporter.read_record(path / exporter.RECORD)
    state = record["sparse"]
    assert state["kind"] == "minicoil" and state["index"] == exporter.MINICOIL
    assert state["dim"] == minicoil_reference.models.dim and state["words_with_model"] > 0
    # The saved index is the reference's: same documents, words with models and cells.
    saved = MiniCoilIndex.load(path / exporter.MINICOIL, encoder=exhaustive.encoder)
    assert saved.doc_ids == minicoil_reference.doc_ids
    assert saved.models.words == minicoil_reference.models.words
    np.testing.assert_allclose(
        saved.doc_matrix.toarray(), minicoil_reference.doc_matrix.toarray(), rtol=1e-5, atol=1e-6
    )
    # The query side loads the saved models (nothing passed, nothing fitted): the top-10 of
    # the sparse vector in Qdrant is MiniCoilIndex.search's.
    expected = minicoil_reference.search({str(i): q for i, q in enumerate(QUERIES)}, 10)
    qdrant = querying.QdrantSearcher.open(
        targets.EdgeTarget(path), record, config=querying.QueryConfig(mode="sparse")
    )
    try:
        theirs = qdrant.search_batch(QUERIES, 10)
        # rerank / fusion: the sparse prefetch is miniCOIL's candidates (every document that
        # shares a word with the query here: prefetch_limit 100)
        matches = minicoil_reference.search({str(i): q for i, q in enumerate(QUERIES)}, 100)
        for mode in ("rerank", "fusion"):
            other = querying.QdrantSearcher(
                qdrant.target, qdrant.encoder, qdrant.sparse, querying.QueryConfig(mode=mode)
            )
            for i, hits in enumerate(other.search_batch(QUERIES[:4], 5)):
                if mode == "rerank":
                    assert {d for d, _ in hits} <= set(matches[str(i)]), mode
                    assert len(hits) == min(5, len(matches[str(i)])), mode
                else:
                    assert len(hits) == 5, mode
    finally:
        qdrant.target.close()
    assert sum(len(got) == 10 for got in theirs) >= 2  # rankings with depth
    for i, got in enumerate(theirs):
        _assert_same_ranking(got, expected[str(i)], QUERIES[i])
    assert theirs[-1] == []  # an unknown word matches nothing
    # The job's own --query (sparse mode) prints that ranking.
    printed = publish_job.publish_job(
        None, qdrant_path=str(path), query=QUERIES[1], k=10, mode="sparse"
    ).splitlines()
    assert printed[0] == f"query: {QUERIES[1]}  [sparse]"
    ranked = [(line.split()[2], float(line.split()[1])) for line in printed[1:]]
    assert [d for d, _ in ranked] == list(expected["1"])
    np.testing.assert_allclose([s for _, s in ranked], list(expected["1"].values()), atol=1e-4)


def test_publish_binary_takes_sparse_minicoil(built, tmp_path, minicoil_reference):
    """The binary no longer refuses --sparse=minicoil (gin binds the fitting settings); a later
    --query process reads the saved models."""
    path = tmp_path / "shard"
    gin_args = [f"--gin.MiniCoilConfig.{k}={v!r}" for k, v in TINY_MINICOIL.items()]
    r = run_module(
        "aligner_jax.publish", f"--index_dir={built}", f"--qdrant_path={path}",
        "--sparse=minicoil", *gin_args,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "sparse minicoil (" in r.stdout and "word models fitted on the corpus" in r.stdout
    assert (path / exporter.MINICOIL / "meaning.safetensors").is_file()
    r = run_module(
        "aligner_jax.publish", f"--qdrant_path={path}", f"--query={QUERIES[2]}", "--k=5",
        "--mode=sparse",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == f"query: {QUERIES[2]}  [sparse]" and len(lines) == 6
    expected = minicoil_reference.search({"q": QUERIES[2]}, 5)["q"]
    assert [line.split()[2] for line in lines[1:]] == list(expected)


def test_minicoil_models_are_reused_or_refused_in_one_line(
    built, minicoil_published, minicoil_reference, exhaustive, tmp_path
):
    path, _ = minicoil_published
    # a saved folder (the publication's own) is reused: the same cells, nothing fitted
    folder = path / exporter.MINICOIL
    out = publish_job.publish_job(
        str(built), qdrant_path=str(tmp_path / "again"), sparse="minicoil",
        minicoil_models=str(folder),
    )  # fmt: skip
    assert f"word models models {folder / 'meaning.safetensors'}" in out
    # aligner-eval's --gin.LexicalConfig.minicoil_models takes the same folder (it was refused:
    # "no miniCOIL meaning model file there", though its docstring names a folder)
    doc_ids = ts.TokenStore(built).doc_ids
    for given in (folder, folder / "meaning.safetensors"):
        config = lexical_lib.LexicalConfig(kind="minicoil", minicoil_models=str(given))
        built_index = lexical_lib.build(config, doc_ids, _texts(doc_ids), exhaustive.encoder)
        np.testing.assert_allclose(
            built_index.doc_matrix.toarray(), minicoil_reference.doc_matrix.toarray(),
            rtol=1e-5, atol=1e-6,
        )  # fmt: skip
    missing = lexical_lib.LexicalConfig(kind="minicoil", minicoil_models=str(tmp_path))
    with pytest.raises(errors.MissingPathError, match=r"^--gin.LexicalConfig.minicoil_models="):
        lexical_lib.build(missing, doc_ids, _texts(doc_ids), exhaustive.encoder)
    again = MiniCoilIndex.load(tmp_path / "again" / exporter.MINICOIL, encoder=exhaustive.encoder)
    np.testing.assert_allclose(
        again.doc_matrix.toarray(), minicoil_reference.doc_matrix.toarray(), rtol=1e-5, atol=1e-6
    )
    # models of another encoder: one line naming the flag (the binary prints it as
    # "aligner-publish: error: ..."), before any encoding; nothing is written
    other = tmp_path / "other"
    other.mkdir()
    meaning.MeaningModels(
        words=["bee"], weight=np.zeros((1, 16, 4), np.float32), bias=np.ones((1, 4), np.float32),
        encoder_fingerprint="f" * 64,
    ).save(other / "meaning.safetensors")  # fmt: skip
    for given in (other, other / "meaning.safetensors"):
        with pytest.raises(errors.ConfigError) as e:
            publish_job.publish_job(
                str(built), qdrant_path=str(tmp_path / "x"), sparse="minicoil",
                minicoil_models=str(given),
            )  # fmt: skip
        message = str(e.value)
        assert message.startswith(f"--minicoil_models={given}: fitted on another encoder's")
        assert message.endswith("omit the flag to fit them on the corpus")
        assert "\n" not in message and not (tmp_path / "x").exists()
    with pytest.raises(errors.MissingPathError, match=r"--minicoil_models=.*: no miniCOIL") as e:
        publish_job.publish_job(
            str(built), qdrant_path=str(tmp_path / "y"), sparse="minicoil",
            minicoil_models=str(tmp_path),
        )  # fmt: skip
    assert "\n" not in str(e.value)
    with pytest.raises(errors.ConfigError, match="--minicoil_models is for --sparse=minicoil"):
        publish_job.publish_job(
            str(built), qdrant_path=str(tmp_path / "y"), minicoil_models=str(other)
        )


def test_the_corpus_flag_when_the_corpus_moved(built, tmp_path):
    """An index without its documents' texts (built before they were stored) reads them
    from the corpus it names, or from ``--corpus`` where the corpus moved."""
    copy = tmp_path / "index"
    shutil.copytree(built, copy)
    (copy / "documents.sqlite").unlink()
    manifest = json.loads((copy / ts.MANIFEST).read_text())
    corpus = manifest["corpus"]["path"]
    manifest["corpus"]["path"] = str(tmp_path / "moved")
    (copy / ts.MANIFEST).write_text(json.dumps(manifest))
    for sparse in ("minicoil", "bm25"):  # refused before anything is encoded
        with pytest.raises(errors.MissingPathError, match=r"pass --corpus=PATH") as e:
            _publish_job(index_dir=str(copy), qdrant_path=str(tmp_path / "s"), sparse=sparse)
        assert "\n" not in str(e.value)
    out = publish_job.publish_job(str(copy), qdrant_path=str(tmp_path / "s"), corpus=corpus)
    assert f"{len(DOCS)} documents" in out


def test_minicoil_on_a_server_saves_its_models_beside_the_record(
    built, tmp_path, exhaustive, minicoil_reference
):
    store = ts.TokenStore(built)
    client = targets.ClientTarget("mc", location=":memory:")
    record_path = tmp_path / "records" / "mc.json"
    record_path.parent.mkdir()
    record = exporter.publish_client(
        store, client, record_path, exporter.ExportConfig(sparse="minicoil"),
        minicoil_index=minicoil_reference,
    )  # fmt: skip
    assert record["sparse"]["index"] == "mc.minicoil"
    assert (tmp_path / "records" / "mc.minicoil" / "minicoil.json").is_file()
    with pytest.raises(errors.ConfigError, match="saved beside its record"):
        querying.sparse_vectors(exporter.read_record(record_path))
    qdrant = querying.QdrantSearcher.open(
        client, exporter.read_record(record_path), encoder=exhaustive.encoder,
        config=querying.QueryConfig(mode="sparse"), record_dir=str(record_path.parent),
    )  # fmt: skip
    try:
        got = qdrant.search(QUERIES[0], 10)
    finally:
        client.close()
    _assert_same_ranking(got, minicoil_reference.search({"q": QUERIES[0]}, 10)["q"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"query": "   "}, r"--query is empty"),
        ({"query": "bees", "k": 0}, r"--k=0: must be >= 1"),
        ({"query": "bees", "sparse": "minicoil"}, r"--sparse: for publishing"),
        ({"query": "bees", "overwrite": True, "corpus": "c.jsonl"}, r"--overwrite, --corpus: for"),
    ],
)
def test_a_query_refuses_a_blank_text_and_the_publishing_flags(tmp_path, kwargs, match):
    """A blank --query used to return every document at ~1.0, and --sparse, --overwrite or
    ExportConfig bindings beside --query were ignored without a word."""
    with pytest.raises(errors.ConfigError, match=match):
        publish_job.publish_job(None, qdrant_path=str(tmp_path / "nothing"), **kwargs)
    assert not (tmp_path / "nothing").exists()


def test_a_replaced_document_is_published_with_its_new_text(built, tmp_path):
    """``--add=new.jsonl --delete=d2`` replaces d2: its vectors are the new text's, and so must
    its sparse vector and title be. The corpus files were read oldest first, the first
    occurrence kept: the point paired the new vectors with the deleted text."""
    copy = tmp_path / "index"
    shutil.copytree(built, copy)
    new = tmp_path / "new.jsonl"
    new.write_text(json.dumps({"_id": "d2", "title": "Updated", "text": "zebra zebra"}) + "\n")
    updates.update_index(str(copy), add=str(new), delete="d2")
    store = ts.TokenStore(copy)
    corpus = store.manifest["corpus"]["path"]
    for given in (corpus, None):  # the corpus named, or the index's own documents.sqlite
        doc = exporter.store_documents(store, {"d2", "d3"}, corpus=given)
        assert (doc["d2"].title, doc["d2"].text) == ("Updated", "zebra zebra")
        assert doc["d3"].text == DOCS["d3"]["text"]


def test_a_collection_that_lost_points_since_its_record_is_refused(built, exhaustive):
    """An interrupted --overwrite to a server deleted the collection first and wrote the record
    last, so the old record described a partial collection; queries searched 8 of 48 documents
    without a word."""
    client = targets.ClientTarget("toy", location=":memory:")
    record = exporter.export_store(ts.TokenStore(built), client)
    record["index_dir"] = str(built)
    searcher = querying.QdrantSearcher.open(client, record, encoder=exhaustive.encoder)
    assert len(searcher.search("honey bees", 5)) == 5
    client.client.delete("toy", points_selector=[0, 1, 2])
    with pytest.raises(errors.IndexIntegrityError, match=rf"holds {len(DOCS) - 3} points, its "
                       rf"publication record {len(DOCS)}: a publish was interrupted"):  # fmt: skip
        querying.QdrantSearcher.open(client, record, encoder=exhaustive.encoder)


def test_a_killed_publishs_hidden_folders_are_removed_by_the_next(built, tmp_path, monkeypatch):
    """A publish killed by SIGTERM or SIGKILL left .NAME.partial-PID behind, and the next one
    removed only its own process's: they piled up beside --qdrant_path."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    for name in (f".shard.partial-{ended.pid}", f".shard.old-{ended.pid}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "segment").write_text("x")
    alive = tmp_path / f".shard.partial-{os.getpid()}x"  # not a pid: someone else's, kept
    alive.mkdir()

    def stop(*args, **kwargs):
        raise errors.Terminated()

    monkeypatch.setattr(exporter, "export_store", stop)
    with pytest.raises(errors.Terminated):
        exporter.publish_embedded(ts.TokenStore(built), tmp_path / "shard")
    assert sorted(p.name for p in tmp_path.iterdir()) == [alive.name]
