"""Search as a product (issue 25 items 1-3, 7; issue 24 item 6): hits with content, filters and
pagination, the Python indexing API (``aligner_jax.Index``), exhaustive search without a search
index, and API misuse refused in one clear line."""

from __future__ import annotations

import datetime
import json
import shutil

import numpy as np
import pytest
from fixtures import TOY_DOCS
from index_utils import random_documents, write_store

import aligner_jax
from aligner_jax.common.errors import ConfigError, IndexIntegrityError, LockedError
from aligner_jax.data import beir
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import documents as documents_lib
from aligner_jax.indexing import indexer
from aligner_jax.indexing import token_store as ts
from aligner_jax.retrieval import centroid_search as cs
from aligner_jax.retrieval import index_api
from aligner_jax.retrieval import searcher as search_lib

DIM = 16
NUM_DOCS = 300


def _toy_records():
    return [
        {
            "id": doc_id,
            "title": doc["title"],
            "text": doc["text"],
            "metadata": {"year": 2000 + i, "kind": "odd" if i % 2 else "even"},
        }
        for i, (doc_id, doc) in enumerate(TOY_DOCS.items())
    ]


@pytest.fixture(scope="module")
def toy_index(tmp_path_factory):
    """An index made from Python with the bundled MiniLM: 9 documents, then 3 more."""
    records = _toy_records()
    index = aligner_jax.Index.create(tmp_path_factory.mktemp("py") / "index")
    index.add(records[:9])
    index.add(records[9:])
    return index


@pytest.fixture(scope="module")
def toy_searcher(toy_index):
    return toy_index.searcher()


# -- synthetic store: 300 documents with metadata, a centroid index, exact references ---------
@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    directory = tmp_path_factory.mktemp("filters") / "idx"
    docs = random_documents(NUM_DOCS, DIM, seed=3, max_len=20)
    store = write_store(directory, docs, DIM, shard_size=64)
    for shard, start in enumerate(range(0, NUM_DOCS, 64)):
        rows = [
            documents_lib.IndexDocument(
                d.doc_id,
                f"title {d.doc_id}",
                f"text of {d.doc_id}",
                {
                    "group": i % 100,
                    "year": 1990 + i % 30,
                    "venue": {"name": f"v{i % 3}"},
                    "tags": [f"t{i % 4}", f"t{i % 5}"],
                    "doi.org": i % 2,
                },
            )
            for i, d in enumerate(docs[start : start + 64], start=start)
        ]
        documents_lib.write_shard(directory, shard, rows)
    index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(residual_bits=8))
    fast = search_lib.Searcher(
        store,
        search_lib.SearchConfig(backend="centroid", k_prime=1),
        centroid_index=index,
    )
    exhaustive = search_lib.Searcher(store, search_lib.SearchConfig(backend="exact", k_prime=0))
    return store, fast, exhaustive


def _query(seed, n=6):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(n, DIM)).astype(np.float32)
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def _restricted(exhaustive, q, keep, k=10):
    """Exhaustive search of every document, then only those in ``keep``: the reference."""
    ranked = exhaustive.search_vectors(q, k=NUM_DOCS)
    return [(h.doc_id, h.score) for h in ranked if h.doc_id in keep][:k]


def test_a_one_percent_filter_returns_the_exhaustive_restricted_top_k(synthetic):
    store, fast, exhaustive = synthetic
    keep = {d for i, d in enumerate(store.doc_ids) if i % 100 == 7}  # group 7: 3 docs, 1 %
    for seed in range(4):
        q = _query(seed)
        hits = fast.search_vectors(q, k=10, filter={"group": 7})
        assert hits.filtered_docs == 3 and hits.exact
        want = _restricted(exhaustive, q, keep)
        assert [h.doc_id for h in hits] == [d for d, _ in want]
        np.testing.assert_allclose([h.score for h in hits], [s for _, s in want], atol=1e-5)
        assert all(h.metadata["group"] == 7 for h in hits)


def test_a_large_filter_restricts_candidate_generation_and_still_fills_k(synthetic):
    """With the filter applied in candidate generation, the 50 documents refined are all ones
    that pass (a filter applied after the cut would keep about 50 / 6 of them: fewer than k)."""
    store, fast, exhaustive = synthetic
    index = fast.centroid.index
    searcher = search_lib.Searcher(
        store,
        search_lib.SearchConfig(backend="centroid", k_prime=1, filter_exact_docs=0),
        centroid_index=index,
        centroid_config=cs.CentroidSearchConfig(
            probes=index.num_centroids, interaction_docs=50, refine_docs=50
        ),
    )
    flt = {"year": {"gte": 2010, "lt": 2015}}  # 5 of 30 years: 50 documents
    keep = {d for i, d in enumerate(store.doc_ids) if 2010 <= 1990 + i % 30 < 2015}
    for seed in range(4):
        q = _query(10 + seed)
        hits = searcher.search_vectors(q, k=10, filter=flt)
        assert len(hits) == 10 and hits.filtered_docs == 50 and not hits.exact
        assert {h.doc_id for h in hits} <= keep
        assert all(2010 <= h.metadata["year"] < 2015 for h in hits)
        want = [d for d, _ in _restricted(exhaustive, q, keep)]
        assert len(set(want) & {h.doc_id for h in hits}) >= 9  # compressed scores
    # default stages (2 probes of 512 centroids) reach fewer passing documents than asked for:
    # then every document that passes is refined (exact)
    narrow = search_lib.Searcher(
        store,
        search_lib.SearchConfig(backend="centroid", k_prime=1, filter_exact_docs=0),
        centroid_index=index,
    )
    hits = narrow.search_vectors(_query(20), k=60, filter=flt)
    assert len(hits) == 50 and hits.exact
    assert {h.doc_id for h in hits} == keep


def test_filters_compose_equality_membership_ranges_nested_fields_and_subsets(synthetic):
    store, _, exhaustive = synthetic
    ids = store.doc_ids
    q = _query(1)

    def kept(**kw):
        return {h.doc_id for h in exhaustive.search_vectors(q, k=NUM_DOCS, **kw)}

    assert kept(filter={"group": {"in": [1, 2]}}) == {
        ids[i] for i in range(NUM_DOCS) if i % 100 in (1, 2)
    }
    assert kept(filter={"venue.name": "v1", "year": {"gt": 2015}}) == {
        ids[i] for i in range(NUM_DOCS) if i % 3 == 1 and 1990 + i % 30 > 2015
    }
    assert kept(filter={"doc_id": {"in": ["doc3", "doc4"]}}) == {"doc3", "doc4"}
    assert kept(subset=["doc5", "doc9"], filter={"group": 5}) == {"doc5"}
    assert kept(filter={"group": {"in": []}}) == set()
    # a list-valued field matches by any element (Qdrant's rule); ne: by none
    assert kept(filter={"tags": "t1"}) == {ids[i] for i in range(NUM_DOCS) if 1 in (i % 4, i % 5)}
    assert kept(filter={"tags": {"in": ["t4"]}}) == {ids[i] for i in range(NUM_DOCS) if i % 5 == 4}
    assert kept(filter={"tags": {"gt": "t3"}}) == {ids[i] for i in range(NUM_DOCS) if i % 5 == 4}
    assert kept(filter={"tags": {"ne": "t0"}}) == {
        ids[i] for i in range(NUM_DOCS) if 0 not in (i % 4, i % 5)
    }
    assert kept(filter={"tags": {"ne": None}}) == set(ids)
    # a dot inside a key is written \. (a bare dot reaches a nested field)
    assert kept(filter={"doi\\.org": 1}) == {ids[i] for i in range(NUM_DOCS) if i % 2}
    assert kept(filter={"doi.org": 1}) == set()
    assert kept(filter={}) == set(ids)


def test_filters_on_lists_missing_fields_nulls_and_kinds_follow_qdrant(tmp_path):
    """One element of a list must satisfy every bound of a range; ne keeps documents without
    the field or with null; in may name null; booleans and numbers never match each other; a
    membership list longer than SQLite's parameter limit works (a new user's findings)."""
    metadata = {
        "a": {"years": [2010, 2025], "source": "x", "n": 1},
        "b": {"years": [2017], "source": None, "n": 2},
        "c": {"years": [], "source": "y", "flag": True},
        "d": {},
        "e": {"years": 2016, "source": "x"},
        "f": {"year": 2005, "n": 130_001},
    }
    rows = [documents_lib.IndexDocument(i, i, i, m) for i, m in metadata.items()]
    documents_lib.write_shard(tmp_path, 0, rows)
    table = documents_lib.DocumentTable(tmp_path, [{"index": 0, "num_docs": len(rows)}])

    def kept(filter):
        return "".join(np.array(list(metadata))[table.mask(filter)])

    assert kept({"years": {"gte": 2015, "lt": 2020}}) == "be"  # not a: 2025 ≥, 2010 <
    assert kept({"years": {"gte": 2015}}) == "abe"
    assert kept({"source": {"ne": "x"}}) == "bcdf"
    assert kept({"years": {"ne": 2017}}) == "acdef"
    assert kept({"years": {"ne": 2017, "gte": 2011}}) == "ae"
    assert kept({"source": None}) == kept({"source": {"eq": None}}) == "bdf"
    assert kept({"source": {"ne": None}}) == "ace"
    assert kept({"source": {"in": ["y", None]}}) == "bcdf"
    assert kept({"source": {"in": [None]}}) == "bdf"
    assert kept({"n": True}) == "" and kept({"flag": 1}) == "" and kept({"flag": True}) == "c"
    assert kept({"n": {"in": [True, 2]}}) == "b" and kept({"n": 1.0}) == "a"
    assert kept({"years": {"in": ["2016", 2010]}}) == "a"  # the string "2016" is not 2016
    assert kept({"n": {"in": list(range(130_000, 260_000))}}) == "f"
    assert kept({"doc_id": {"ne": "a"}, "title": {"in": ["a", "b"]}}) == "b"
    with pytest.raises(ConfigError, match=r"'n' in \{'a': 1\}: expected a list"):
        table.mask({"n": {"in": {"a": 1}}})
    for huge in ({"n": 10**20}, {"doc_id": {"lt": -(10**20)}}, {"n": {"in": [1, 2**63]}}):
        with pytest.raises(ConfigError, match=r"beyond 64-bit integers"):  # was an OverflowError
            table.mask(huge)
    assert kept({"n": {"lt": 2**63 - 1}}) == "abf"
    with pytest.raises(ConfigError, match=r"""field 'a"b': a key holding '"' cannot be filtered"""):
        table.mask({'a"b': 1})  # matched nothing, silently (SQLite's paths cannot name it)


def test_doc_id_filters_name_ids_as_delete_does_and_refuse_what_sqlite_would_guess(tmp_path):
    """A document added under the integer id 7 is the document "7" (doc_ids.clean) for eq, ne
    and in alike; a range on ids compares text, so it takes a string; a title is text. Before,
    SQLite's column affinity matched {"doc_id": 7} but not {"doc_id": {"in": [7]}} (nothing),
    and ordered {"doc_id": {"gte": 7}} as text, keeping "b" (a new user's findings)."""
    rows = [documents_lib.IndexDocument(i, f"t{i}", "", {}) for i in ("7", "10", "b")]
    documents_lib.write_shard(tmp_path, 0, rows)
    table = documents_lib.DocumentTable(tmp_path, [{"index": 0, "num_docs": len(rows)}])

    def kept(filter):
        return [r.doc_id for r, keep in zip(rows, table.mask(filter), strict=True) if keep]

    assert kept({"doc_id": 7}) == kept({"doc_id": {"eq": " 7"}}) == ["7"]
    assert kept({"doc_id": {"in": [7, "b"]}}) == ["7", "b"]
    assert kept({"doc_id": {"ne": 7}}) == ["10", "b"]
    assert kept({"doc_id": {"gte": "7"}}) == ["7", "b"]  # text order, as documented
    assert kept({"doc_id": {"in": [7, None]}}) == ["7"]  # an id is never null
    for bad, match in [
        ({"doc_id": {"gte": 7}}, r"'doc_id' gte 7: document ids are text and a range compares "
         r"them as text; give a string \(e\.g\. '7'\)"),
        ({"doc_id": 1.5}, r"'doc_id' eq 1\.5: a document id must be a string or an integer"),
        ({"doc_id": {"in": [True]}}, r"'doc_id' in True: a document id must be"),
        ({"title": {"in": ["t7", 7]}}, r"'title' in 7: a title is text; give a string"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            table.mask(bad)


def test_a_repeated_filter_reuses_its_mask_and_never_confuses_kinds(tmp_path, monkeypatch):
    """The mask of a recent filter is kept (Elasticsearch's filter cache): at 1M documents a
    filter costs 0.6-0.9 s of SQL per search, every time."""
    metadata = [{"n": 1}, {"n": True}, {"n": "1"}, {"n": 2}]
    rows = [documents_lib.IndexDocument(f"d{i}", "", "", m) for i, m in enumerate(metadata)]
    documents_lib.write_shard(tmp_path, 0, rows)
    monkeypatch.setattr(documents_lib, "MASK_CACHE_ENTRIES", 3)
    table = documents_lib.DocumentTable(tmp_path, [{"index": 0, "num_docs": len(rows)}])
    runs = []
    run = table._run_filter
    monkeypatch.setattr(table, "_run_filter", lambda *a: runs.append(a[0]) or run(*a))
    filters = [{"n": 1}, {"n": True}, {"n": "1"}, {"n": 1}, {"n": 1.0}, {"n": {"eq": 1}}]
    kept = [np.flatnonzero(table.mask(f)).tolist() for f in filters]
    assert kept == [[0], [1], [2], [0], [0], [0]]
    assert runs == [{"n": 1}, {"n": True}, {"n": "1"}]  # 1, 1.0 and {"eq": 1} are one filter
    assert not table.mask({"n": 1}).flags.writeable  # callers cannot change the kept mask
    table.mask({"n": 2})  # a fourth filter pushes out the least recently used, {"n": True}
    table.mask({"n": 1})
    table.mask({"n": True})
    assert runs[3:] == [{"n": 2}, {"n": True}]


def test_pages_are_consecutive_slices_of_one_ranking(synthetic):
    _, fast, exhaustive = synthetic
    q = _query(2)
    whole = exhaustive.search_vectors(q, k=30)
    pages = [exhaustive.search_vectors(q, k=10, offset=o) for o in (0, 10, 20)]
    assert [h.doc_id for p in pages for h in p] == [h.doc_id for h in whole]
    assert [h.rank for p in pages for h in p] == list(range(1, 31))
    for o in (0, 10, 20):  # the fast index: a page is a slice of the ranking at its depth
        page = fast.search_vectors(q, k=10, offset=o)
        deep = fast.search_vectors(q, k=o + 10)
        assert [h.doc_id for h in page] == [h.doc_id for h in deep][o:]
        assert [h.rank for h in page] == list(range(o + 1, o + 11))
    # pages asked with one depth are consecutive slices of the fast ranking at that depth
    pages = [fast.search_vectors(q, k=10, offset=o, depth=30) for o in (0, 10, 20)]
    assert [h.doc_id for p in pages for h in p] == [h.doc_id for h in fast.search_vectors(q, 30)]
    assert [h.rank for p in pages for h in p] == list(range(1, 31))
    with pytest.raises(ConfigError, match=r"^depth=15: .* at least offset \+ k = 20$"):
        fast.search_vectors(q, k=10, offset=10, depth=15)
    with pytest.raises(ConfigError, match=r"^depth=True: expected an integer"):
        fast.search_vectors(q, k=10, depth=True)
    assert len(exhaustive.search_vectors(q, k=10, offset=NUM_DOCS - 4)) == 4
    # asked for more than its candidates reach, the fast index refines every document: the
    # last page is the exhaustive one, not a short or empty page
    last = fast.search_vectors(q, k=10, offset=NUM_DOCS - 4)
    assert last.exact and [h.doc_id for h in last] == [
        h.doc_id for h in exhaustive.search_vectors(q, k=10, offset=NUM_DOCS - 4)
    ]
    assert len(fast.search_vectors(q, k=NUM_DOCS + 5)) == NUM_DOCS
    # k past every document: all of them, ranked exactly (they came in the fast order, scores
    # up to 0.02 off, exact False, when the probes happened to reach every document)
    whole = fast.search_vectors(q, k=NUM_DOCS + 5)
    assert whole.exact and [(h.doc_id, h.rank) for h in whole] == [
        (h.doc_id, h.rank) for h in exhaustive.search_vectors(q, k=NUM_DOCS + 5)
    ]


def test_hits_carry_content_and_still_unpack_as_pairs(toy_searcher):
    hits = toy_searcher.search("honey bees in the hive", k=3)
    top = hits[0]
    assert (top.doc_id, top.rank, top.title) == ("d1", 1, "Honey bees")
    assert top.text == TOY_DOCS["d1"]["text"] and top.metadata == {"year": 2001, "kind": "odd"}
    doc_id, score = top
    assert (doc_id, score) == (top[0], top[1]) == (top.doc_id, top.score)
    assert list(dict(hits)) == [h.doc_id for h in hits]
    assert top.as_dict()["title"] == "Honey bees"
    assert hits.query_tokens > 0 and hits.truncated_tokens == 0 and hits.filtered_docs is None


def test_filter_on_the_python_index(toy_searcher):
    hits = toy_searcher.search("honey bees in the hive", k=5, filter={"kind": "even"})
    assert len(hits) == 5 and all(h.metadata["kind"] == "even" for h in hits)
    assert hits[0].doc_id == "d10"  # the beekeeping document, d1 (odd) filtered out
    years = toy_searcher.search("bees", k=10, filter={"year": {"lte": 2002}})
    assert sorted(h.doc_id for h in years) == ["d0", "d1", "d2"]
    titled = toy_searcher.search(
        "bees", k=10, filter={"title": {"in": ["Chess openings", "Tides"]}}
    )
    assert sorted(h.doc_id for h in titled) == ["d11", "d2"]


def test_python_index_is_the_cli_index(toy_index, tmp_path):
    """Same files as aligner-index: manifest, checksums, encoder.json, a search index; a
    delete hides the document; Index.open reopens it."""
    directory = toy_index.directory
    store = ts.TokenStore(directory, verify_checksums=True)
    assert store.num_docs == 12 and len(store.manifest["shards"]) == 2
    assert (directory / indexer.ENCODER_FILE).exists() and (directory / ci.SUBDIR).is_dir()
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    reopened = aligner_jax.Index.open(copy)
    assert reopened.num_docs == 12
    with pytest.raises(ConfigError, match=r"^Index.delete: 1 ids are not in .*\['d99'\]"):
        reopened.delete(["d99"])  # the Python API's name, not the CLI flag's
    with pytest.raises(ConfigError, match="^Index.delete: an id must be a string or an integer"):
        reopened.delete([1.5])
    reopened.delete([" d1 "])  # ids are stored stripped (doc_ids.clean): this is d1
    hits = reopened.searcher().search("honey bees in the hive", k=3)
    assert "d1" not in [h.doc_id for h in hits] and hits[0].doc_id == "d10"
    with pytest.raises(ConfigError, match="already in"):
        reopened.add([{"id": "d2", "text": "again"}])
    # a deleted id comes back with its new content and metadata
    reopened.add([{"id": "d1", "title": "Bees again", "text": "Honey bees in the hive.", "v": 2}])
    hits = reopened.searcher().search("honey bees in the hive", k=1)
    assert (hits[0].doc_id, hits[0].title, hits[0].metadata) == ("d1", "Bees again", {"v": 2})
    # What a killed writer left is removed by the next update, from Python as from the CLI.
    leftovers = [copy / "shard-00099.vectors.npy", copy / ".manifest.json.123.tmp"]
    for path in leftovers:
        path.write_bytes(b"partial")
    reopened.delete(["d2"])
    assert not any(p.exists() for p in leftovers)
    assert reopened.vacuum()["vacuumed"]


def test_index_without_text_keeps_metadata_and_refuses_bad_records(tmp_path):
    config = indexer.IndexingConfig(store_text=False)
    index = aligner_jax.Index.create(tmp_path / "notext", config=config)
    index.add(
        [
            {"id": "a", "title": "Bees", "text": "Bees make honey.", "year": 2020},
            {
                "_id": 7,
                "text": "Chess is a board game.",
                "metadata": {"year": 2010},
                "day": datetime.date(2010, 5, 1),
                "counts": np.array([1, 2]),
            },
        ]
    )
    hits = index.searcher(mode="exhaustive").search("honey", k=2, filter={"year": 2020})
    assert [h.doc_id for h in hits] == ["a"]
    assert hits[0].title is None and hits[0].text is None  # store_text=False
    assert hits[0].metadata == {"year": 2020}
    chess = index.searcher(mode="exhaustive").search("chess", k=1, filter={"day": "2010-05-01"})
    assert chess[0].metadata == {"year": 2010, "day": "2010-05-01", "counts": [1, 2]}
    searcher = index.searcher(mode="exhaustive")  # an integer id added names the same document
    assert [h.doc_id for h in searcher.search("honey", k=2, subset=[7, " a"])] == ["a", "7"]
    with pytest.raises(ConfigError, match="^subset: an id is empty"):
        searcher.search("honey", k=2, subset=[""])
    assert ts.read_manifest(index.directory)["indexing"]["store_text"] is False
    for bad, match in [
        ([{"text": "no id"}], "document 0: 'id' must be"),
        ([{"id": " ", "text": "a"}], "document 0: 'id' is empty"),
        ([{"id": "x"}], r"document 0 \(id 'x'\): 'text' must be a string"),
        ([{"id": "x", "text": "a"}, {"id": "x", "text": "b"}], "repeats document 0"),
        ([{"id": "x", "text": "a", "metadata": [1]}], "'metadata' must be a dict"),
        ([{"id": "x", "text": "a", "when": object()}], r"metadata\.when is a object \(<obj"),
        ([{"id": "x", "text": "a", "v": [1.0, float("inf")]}], r"metadata\.v\[1\] is inf"),
        ([{"id": "x", "text": "a", "m": {3: "a"}}], "metadata.m has the key 3"),
        ([{"id": "x", "_id": "y", "text": "a"}], "has both 'id' and '_id'"),  # '_id' dropped
        ({"id": "x", "text": "a"}, "wrap one document in a list"),
        ([], "no documents"),
    ]:
        with pytest.raises(ConfigError, match=match):
            index.add(bad)
    with pytest.raises(ConfigError, match="already holds an index"):
        aligner_jax.Index.create(tmp_path / "notext")


def test_the_first_add_reports_documents_cut_at_the_budget_as_later_adds_do(tmp_path):
    """The first ``Index.add`` returned documents and tokens only, saying nothing of a document
    cut at the encoder's budget; later adds said it (a new user's finding)."""
    index = aligner_jax.Index.create(tmp_path / "cut")
    long = " ".join(f"word{i}" for i in range(2000))
    first = index.add([{"id": "a", "text": long}, {"id": "b", "text": "Bees make honey."}])
    budget = index.searcher().encoder.maxlen("doc")
    assert (first["added_docs"], first["truncated_docs"], first["doc_maxlen"]) == (2, 1, budget)
    later = index.add([{"id": "c", "text": long}])
    assert (later["added_docs"], later["truncated_docs"], later["doc_maxlen"]) == (1, 1, budget)
    assert set(first) - set(later) <= {"num_tokens", "empty_docs"}
    with pytest.raises(ConfigError, match="model="):
        aligner_jax.Index.create(tmp_path / "other", model=42)


def test_index_add_takes_a_pandas_frame(tmp_path):
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame(
        {
            "id": ["a", "b"],
            "title": ["Bees", None],
            "text": ["Bees make honey.", "Chess is a board game."],
            "year": [2020, 2010],
        }
    )
    index = aligner_jax.Index.create(tmp_path / "frame")
    index.add(frame)
    hits = index.searcher(mode="exhaustive").search("honey", k=2, filter={"year": {"lt": 2015}})
    assert [(h.doc_id, h.title, h.metadata) for h in hits] == [("b", "", {"year": 2010})]


def test_publishing_a_python_index_takes_its_own_texts_not_the_working_folders(
    toy_index, tmp_path, monkeypatch
):
    """An index made from Python names no corpus file: its texts and titles (BM25 vectors,
    Qdrant payload) come from its documents.sqlite. They used to be read from
    ``./corpus.jsonl`` of the working folder, whatever corpus that was."""
    from aligner_jax.indexing import token_store as ts
    from aligner_jax.serving import exporter

    decoy = tmp_path / "corpus.jsonl"
    decoy.write_text(
        "".join(
            json.dumps({"_id": d, "title": "decoy", "text": "unrelated"}) + "\n" for d in TOY_DOCS
        )
    )
    monkeypatch.chdir(tmp_path)
    store = ts.TokenStore(toy_index.directory)
    docs = exporter.store_documents(store, set(TOY_DOCS))
    assert {d: (docs[d].title, docs[d].text) for d in TOY_DOCS} == {
        d: (doc["title"], doc["text"]) for d, doc in TOY_DOCS.items()
    }
    assert exporter.corpus_files(store.manifest) == []


def test_exhaustive_mode_needs_no_search_index(toy_index, tmp_path):
    copy = tmp_path / "no_search_index"
    shutil.copytree(toy_index.directory, copy)
    shutil.rmtree(copy / ci.SUBDIR)
    searcher = search_lib.Searcher.load(str(copy), mode="exhaustive")
    hits = searcher.search("Sicilian defence chess", k=2)
    assert hits[0].doc_id == "d2" and hits[0].title == "Chess openings" and hits.exact


def test_documents_are_written_once_per_shard_and_refilled_on_rerun(toy_index, tmp_path):
    """Re-running the indexing job never duplicates rows; an index that lost (or never had)
    documents.sqlite gets it back from a re-run."""
    copy = tmp_path / "rerun"
    shutil.copytree(toy_index.directory, copy)
    records = aligner_jax.retrieval.index_api.to_documents(_toy_records()[:9])
    table = lambda: documents_lib.DocumentTable(copy, ts.read_manifest(copy)["shards"])  # noqa: E731
    assert table().count() == 12
    (copy / documents_lib.FILE).unlink()
    with pytest.raises(IndexIntegrityError, match="documents.sqlite does not exist"):
        search_lib.Searcher.load(str(copy), mode="exhaustive").search(
            "bees", filter={"kind": "odd"}
        )
    encoder = aligner_jax.Index.open(copy).encoder
    settings = ts.read_json(copy / indexer.CONFIG_FILE)
    for _ in range(2):
        summary = indexer.build_token_store(
            records, encoder, copy, indexer.IndexingConfig(), corpus_info=settings["corpus"]
        )
        assert summary.shards_skipped == 1 and summary.shards_written == 0
    assert table().count() == 9  # shard 0's rows are back (shard 1 came from an --add)
    assert table().fetch([3])[0]["title"] == TOY_DOCS["d3"]["title"]
    # aligner-eval reusing an index older than documents.sqlite fills it from the corpus
    corpus = {d.doc_id: d for d in aligner_jax.retrieval.index_api.to_documents(_toy_records())}
    assert documents_lib.fill_missing(copy, ts.read_manifest(copy), corpus) == 1
    assert documents_lib.fill_missing(copy, ts.read_manifest(copy), corpus) == 0
    assert table().count() == 12
    assert table().fetch([11])[0]["metadata"] == {"year": 2011, "kind": "odd"}


def test_beir_corpus_fields_become_filterable_metadata(toy_index, tmp_path):
    """A corpus.jsonl's extra keys and BEIR's metadata object, through the indexing job."""
    corpus = tmp_path / "corpus.jsonl"
    lines = [
        {"_id": "a", "title": "Bees", "text": "Bees make honey.", "metadata": {"year": 2019}},
        {"_id": "b", "title": "Chess", "text": "A chess opening.", "year": 2001, "lang": "en"},
    ]
    corpus.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    directory = tmp_path / "beir_index"
    indexer.build_token_store(beir.iter_corpus(corpus), toy_index.encoder, directory)
    searcher = search_lib.Searcher.load(str(directory), mode="exhaustive")
    hits = searcher.search("bees", k=2, filter={"year": {"gte": 2000}})
    assert {h.doc_id: h.metadata for h in hits} == {
        "a": {"year": 2019},
        "b": {"year": 2001, "lang": "en"},
    }
    assert [h.doc_id for h in searcher.search("bees", filter={"lang": "en"})] == ["b"]


def test_no_live_document_is_an_empty_answer_not_a_crash(synthetic):
    _, fast, exhaustive = synthetic
    for searcher in (fast, exhaustive):
        assert list(searcher.search_vectors(_query(0), k=5, filter={"group": 1000})) == []


def test_a_long_query_reports_the_tokens_it_dropped(toy_searcher):
    budget = toy_searcher.encoder.maxlen("query")
    hits = toy_searcher.search("bees " * (budget + 50), k=1)
    assert hits.query_tokens == budget and hits.truncated_tokens >= 50


# -- misuse: one clear line each (each of these was a TypeError, a traceback or 5 results) ----
@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((None,), {}, "query: expected a string, got NoneType"),
        (("",), {}, "query is empty or whitespace"),
        ((" \t\n",), {}, "query is empty or whitespace"),
        ((42,), {}, "query: expected a string, got int"),
        (("bees",), {"k": 0}, "k=0: must be >= 1"),
        (("bees",), {"k": "3"}, "k='3': expected an integer"),
        (("bees",), {"k": True}, "k=True: expected an integer"),
        (("bees",), {"offset": -1}, "offset=-1: must be >= 0"),
        (("bees",), {"offset": 1.5}, "offset=1.5: expected an integer"),
        (("bees",), {"filter": "year"}, "expected a dict of field conditions"),
        (("bees",), {"filter": {"year": {"after": 2000}}}, "unknown operator 'after'"),
        (("bees",), {"filter": {"year": {"in": 2000}}}, "expected a list of values"),
        (("bees",), {"filter": {"year": [2000]}}, "a list goes in"),
        (("bees",), {"filter": {"year": {"gt": None}}}, "null is not ordered"),
        (("bees",), {"subset": "d1"}, "expected a list of document ids"),
        (("bees",), {"subset": ["d1", "nope"]}, "1 id\\(s\\) are not documents"),
    ],
)
def test_search_misuse_is_one_clear_line(toy_searcher, args, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        toy_searcher.search(*args, **kwargs)


def test_batch_vectors_and_load_misuse(toy_index, toy_searcher, synthetic):
    with pytest.raises(ConfigError, match="expected a list of query strings"):
        toy_searcher.search_batch("bees")
    with pytest.raises(ConfigError, match="query 1 is empty"):
        toy_searcher.search_batch(["bees", ""])
    _, fast, _ = synthetic
    with pytest.raises(ConfigError, match=r"expected \[tokens, 16\]"):
        fast.search_vectors(np.zeros((3, 8)))
    with pytest.raises(ConfigError, match="NaN"):
        fast.search_vectors(np.full((2, DIM), np.nan))
    with pytest.raises(ConfigError, match="salience of shape"):
        fast.search_vectors(_query(0), salience=[1.0])
    directory = str(toy_index.directory)
    with pytest.raises(ConfigError, match="unknown option 'topk'.*SearchConfig fields"):
        search_lib.Searcher.load(directory, topk=5)
    with pytest.raises(ConfigError, match="index_dir must be a folder path, got NoneType"):
        search_lib.Searcher.load(None)
    with pytest.raises(ConfigError, match="mode='quick'"):
        search_lib.Searcher.load(directory, mode="quick")
    with pytest.raises(ConfigError, match="encoder must be an aligner_jax.Encoder"):
        search_lib.Searcher.load(directory, encoder="minilm")
    with pytest.raises(ConfigError, match="SearchConfig.top_k=0"):
        search_lib.Searcher.load(directory, top_k=0)


def test_corpus_metadata_merges_beir_metadata_and_extra_keys():
    record = {"_id": "1", "title": "t", "text": "x", "metadata": {"year": 2015}, "source": "pubmed"}
    assert documents_lib.metadata_of(record) == {"year": 2015, "source": "pubmed"}
    assert documents_lib.metadata_of({"_id": "1", "text": "x"}) == {}


def test_aligner_search_shows_snippets_filters_and_pages(toy_index, toy_searcher):
    from aligner_jax.retrieval import search_job

    index_dir = str(toy_index.directory)
    out = search_job.search_job(index_dir, query="honey bees in the hive", k=2, show="text")
    lines = out.splitlines()
    assert "d1" in lines[1] and "Honey bees" in lines[1]
    assert lines[2].strip() == TOY_DOCS["d1"]["text"]  # the snippet under its hit
    out = search_job.search_job(
        index_dir, query="honey bees in the hive", k=1, offset=1, filter='{"kind": "even"}'
    )
    second = toy_searcher.search("honey bees in the hive", k=2, filter={"kind": "even"})[1]
    first = out.splitlines()[1].split()
    assert first[0] == "2" and first[2] == second.doc_id  # page 2 of the even documents
    assert toy_searcher.documents.fetch([int(second.doc_id[1:])])[0]["metadata"]["kind"] == "even"
    with pytest.raises(ConfigError, match="--filter=year: not JSON"):
        search_job.search_job(index_dir, query="bees", filter="year")
    with pytest.raises(
        ConfigError, match=r"""^--filter=\{"year": \{"foo": 1\}\}: 'year' has an unknown"""
    ):
        search_job.search_job(index_dir, query="bees", filter='{"year": {"foo": 1}}')
    with pytest.raises(ConfigError, match=r"^--offset=-1: must be >= 0$"):  # named "offset=-1"
        search_job.search_job(index_dir, query="bees", offset=-1)
    with pytest.raises(ConfigError, match=r"^--depth=4: .* at least --offset \+ --k = 5$"):
        search_job.search_job(index_dir, query="bees", k=3, offset=2, depth=4)
    deep = search_job.search_job(index_dir, query="honey bees in the hive", k=1, offset=1, depth=6)
    whole = toy_searcher.search("honey bees in the hive", k=6)
    assert deep.splitlines()[1].split()[:3] == ["2", f"{whole[1].score:.4f}", whole[1].doc_id]
    # A filter that keeps nothing says so (it printed the query line alone).
    out = search_job.search_job(index_dir, query="bees", filter='{"year": {"gte": "2010"}}')
    assert out.splitlines()[-1] == (
        "note: the filter kept 0 of 12 live documents; no hits at ranks 1..10"
    )
    out = search_job.search_job(index_dir, query="bees", k=5, offset=40)  # past the end
    assert out.splitlines() == ["query: bees", "note: no hits at ranks 41..45"]


def test_aligner_search_queries_with_an_offset_write_the_ranks_of_that_page(toy_index, tmp_path):
    """``--queries --offset=N`` wrote the page's hits as ranks 1.. in the run file, as if they
    were the first; they are ranks N+1.., as ``--query`` prints them."""
    from aligner_jax.retrieval import search_job

    queries = tmp_path / "q.jsonl"
    queries.write_text(json.dumps({"_id": "q1", "text": "honey bees in the hive"}) + "\n")
    index_dir, out = str(toy_index.directory), tmp_path / "page2.trec"
    summary = search_job.search_job(index_dir, queries=str(queries), output=str(out), k=3, offset=2)
    assert "k=3, ranks 3..5" in summary
    page = [line.split() for line in out.read_text().splitlines()]
    full = tmp_path / "whole.trec"
    search_job.search_job(index_dir, queries=str(queries), output=str(full), k=5)
    first = [line.split() for line in full.read_text().splitlines()]
    assert [(r[2], r[3]) for r in page] == [(r[2], r[3]) for r in first[2:]]


def test_aligner_search_queries_summary_counts_the_filter_and_short_pages(toy_index, tmp_path):
    """With --queries, a filter that kept nothing and pages past the end wrote an empty or short
    run with exit 0 and a summary that said neither; --output with --query and --show=text with
    --queries were silently ignored."""
    from aligner_jax.retrieval import search_job

    queries = tmp_path / "q.jsonl"
    queries.write_text(
        "".join(
            json.dumps({"_id": f"q{i}", "text": t}) + "\n" for i, t in enumerate(["bees", "go"])
        )
    )
    index_dir, out = str(toy_index.directory), tmp_path / "run.trec"
    summary = search_job.search_job(
        index_dir, queries=str(queries), output=str(out), filter='{"nosuch": 1}'
    )
    assert "the filter kept 0 of 12 live documents; 2 queries got fewer than 10 hits (2 none)" in (
        summary
    )
    assert summary.endswith("(0 lines)") and out.read_text() == ""
    summary = search_job.search_job(index_dir, queries=str(queries), output=str(out), k=5, offset=9)
    assert "ranks 10..14" in summary and "2 queries got fewer than 5 hits (0 none)" in summary
    assert summary.endswith("(6 lines)") and len(out.read_text().splitlines()) == 6
    with pytest.raises(ConfigError, match=r"^--output=.* is the run file of --queries"):
        search_job.search_job(index_dir, query="bees", output=str(tmp_path / "x.trec"))
    with pytest.raises(ConfigError, match=r"^--show=text prints snippets under --query"):
        search_job.search_job(index_dir, queries=str(queries), output=str(out), show="text")
    assert not (tmp_path / "x.trec").exists()


def test_fetching_hits_reads_rows_through_the_primary_key_not_a_table_scan(synthetic):
    store, fast, _ = synthetic
    table = fast.documents
    positions = [299, 0, 64, 5, 64, 130]
    executed = []
    table._db().set_trace_callback(executed.append)  # the SQL as run, parameters filled in
    try:
        got = table.fetch(positions)
    finally:
        table._db().set_trace_callback(None)
    assert [r["doc_id"] for r in got] == [store.doc_ids[p] for p in positions]
    assert got[0]["title"] == f"title {store.doc_ids[299]}" and got[2]["metadata"]["group"] == 64
    (sql,) = [q for q in executed if "documents" in q]
    steps = [row[-1] for row in table._db().execute(f"EXPLAIN QUERY PLAN {sql}").fetchall()]
    # a table scan costs every search time proportional to the corpus (1.5 ms at 5k documents)
    assert not any(s.startswith("SCAN d") for s in steps), steps
    assert any("USING INDEX" in s or "USING PRIMARY KEY" in s for s in steps), steps


def test_a_small_collection_is_searched_exactly(toy_index, toy_searcher):
    """A compressed index of at most SearchConfig.filter_exact_docs live documents refines every
    one (a 12-document index got a handful of coarse centroids: its fast scores were up to 0.15
    below exact and its ranking differed, while a filter keeping all of them was exact)."""
    import aligner_jax

    exhaustive = aligner_jax.Searcher.load(str(toy_index.directory), mode="exhaustive")
    assert toy_searcher.small_collection and not exhaustive.small_collection
    for query in ("honey bees in the hive", "library classification", "stars"):
        fast, exact = toy_searcher.search(query, k=5), exhaustive.search(query, k=5)
        assert fast.exact
        assert [h.doc_id for h in fast] == [h.doc_id for h in exact]
        np.testing.assert_allclose([h.score for h in fast], [h.score for h in exact], atol=1e-5)


def _records(prefix: str, n: int) -> list[dict]:
    return [
        {"id": f"{prefix}{i}", "title": f"T {prefix}{i}", "text": f"bees {i}"} for i in range(n)
    ]


def test_a_first_add_stopped_then_given_other_documents_stores_those(tmp_path, monkeypatch):
    """A first ``Index.add`` killed before its store completed left shards of its documents;
    the next add, of other documents as many, reused them (their vectors under the new ids'
    rows of documents.sqlite: hit a2 titled "T b2")."""
    index = aligner_jax.Index.create(tmp_path / "idx", config=indexer.IndexingConfig(shard_size=5))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(indexer, "finalize", killed)
        with pytest.raises(KeyboardInterrupt):
            index.add(_records("a", 12))
    assert ts.read_shard_marker(index.directory, 1) is not None  # shards of a were written
    index.add(_records("b", 12))
    store = ts.TokenStore(index.directory)
    assert store.doc_ids == [f"b{i}" for i in range(12)]
    hits = index.searcher(mode="exhaustive").search("bees", k=12)
    assert sorted(h.title for h in hits) == sorted(f"T {h.doc_id}" for h in hits)


def test_a_first_add_stopped_before_its_search_index_completes_on_rerun(tmp_path, monkeypatch):
    """Killed between the store's commit and its search index, a first ``Index.add`` run again
    was refused ("already in ... delete them first"), and later adds never built the index."""
    index = aligner_jax.Index.create(tmp_path / "idx")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(index_api.updates, "rebuild_search_index", killed)
        with pytest.raises(KeyboardInterrupt):
            index.add(_records("a", 4))
    assert not ci.CentroidIndex.exists(index.directory)
    assert index.add(_records("a", 4))["added_docs"] == 4
    assert ci.CentroidIndex.exists(index.directory)
    assert {h.doc_id for h in index.searcher().search("bees", k=4)} == {f"a{i}" for i in range(4)}
    # stopped again, then other documents: the search index is built first, then they are added
    ts.write_manifest(index.directory, {**ts.read_manifest(index.directory), "search_index": None})
    index.add(_records("c", 2))
    assert ci.CentroidIndex.exists(index.directory)
    assert len(index.searcher().search("bees", k=10)) == 6


def test_a_search_index_build_never_publishes_over_an_update_committed_meanwhile(
    toy_index, tmp_path
):
    """A store opened before another process committed a delete: building its search index
    used to publish the manifest it read, and the deleted document came back."""
    directory = tmp_path / "copy"
    shutil.copytree(toy_index.directory, directory)
    stale = ts.TokenStore(directory)
    aligner_jax.Index.open(directory).delete(["d3"])
    with pytest.raises(LockedError, match="changed while its search"):
        ci.CentroidIndex.build(stale)
    assert ts.TokenStore(directory).deleted[stale.doc_ids.index("d3")]


def test_documents_added_as_vectors_get_rows_that_filters_find(toy_index, tmp_path):
    """``updates.add_encoded`` wrote no documents.sqlite rows: a filter on ``doc_id`` dropped
    its documents, which ``subset=`` still returned."""
    from aligner_jax.indexing import updates

    directory = tmp_path / "copy"
    shutil.copytree(toy_index.directory, directory)
    dim = int(ts.read_manifest(directory)["model"]["dim"])
    rng = np.random.default_rng(0)
    docs = []
    for i in range(2):
        v = rng.standard_normal((5, dim)).astype(np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        docs.append(ts.EncodedDocument(f"e{i}", v, np.ones(5, np.float32), np.arange(5)))
    with indexer.writer_lock(directory):
        updates.add_encoded(directory, docs)
    searcher = search_lib.Searcher.load(str(directory), mode="exhaustive")
    hits = searcher.search("bees", k=3, filter={"doc_id": "e1"})
    assert [(h.doc_id, h.title, h.metadata) for h in hits] == [("e1", None, {})]
