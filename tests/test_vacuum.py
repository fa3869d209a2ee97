"""``aligner-index --vacuum`` (``updates.vacuum``): the store written again without its deleted
documents, in full shards, with a new search index; one commit that loses nothing live."""

from __future__ import annotations

import shutil
import sqlite3

import numpy as np
import pytest
from index_utils import random_documents, write_store

from aligner_jax.common.errors import ConfigError, IndexIntegrityError, SnapshotGoneError
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import documents as documents_lib
from aligner_jax.indexing import token_store as ts
from aligner_jax.indexing import updates
from aligner_jax.retrieval import searcher as search_lib

DIM = 16
SHARD = 8


def _rows(docs, start):
    return [
        documents_lib.IndexDocument(d.doc_id, f"title {d.doc_id}", f"text of {d.doc_id}", {"n": i})
        for i, d in enumerate(docs, start=start)
    ]


@pytest.fixture(scope="module")
def updated(tmp_path_factory):
    """60 documents in shards of 8 with a documents table and a search index, then three adds
    of 2 documents each (three small shards) and 13 documents deleted."""
    directory = tmp_path_factory.mktemp("vacuum") / "idx"
    docs = random_documents(66, DIM, seed=5, max_len=12)
    write_store(directory, docs[:60], DIM, shard_size=SHARD)
    for shard, start in enumerate(range(0, 60, SHARD)):
        documents_lib.write_shard(
            directory, shard, _rows(docs[start : min(start + SHARD, 60)], start)
        )
    manifest = ts.read_manifest(directory)
    manifest["indexing"] = {"shard_size": SHARD}
    ts.write_manifest(directory, manifest)
    ci.CentroidIndex.build(ts.TokenStore(directory), ci.CentroidIndexConfig(num_centroids=8))
    for start in (60, 62, 64):
        updates.add_encoded(str(directory), docs[start : start + 2])
    deleted = [f"doc{i}" for i in (0, 1, 2, 9, 17, 30, 31, 32, 33, 34, 35, 61, 64)]
    updates.delete_documents(str(directory), deleted)
    return directory, docs, set(deleted)


def _searchers(directory):
    store = ts.TokenStore(directory)
    exhaustive = search_lib.Searcher(store, search_lib.SearchConfig(backend="exact", k_prime=0))
    fast = search_lib.Searcher(
        store,
        search_lib.SearchConfig(backend="centroid", k_prime=1),
        centroid_index=ci.CentroidIndex.load(store),
    )
    return store, exhaustive, fast


def _query(seed):
    q = np.random.default_rng(seed).normal(size=(5, DIM)).astype(np.float32)
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def _table_rows(directory) -> int:
    with sqlite3.connect(directory / documents_lib.FILE) as db:
        return db.execute("SELECT COUNT(*) FROM documents").fetchone()[0]


def test_vacuum_drops_deleted_documents_and_merges_small_shards(updated, tmp_path):
    source, docs, deleted = updated
    directory = shutil.copytree(source, tmp_path / "idx")
    old_files = {p.name for p in directory.glob("shard-*")}
    _, before, _ = _searchers(directory)
    wanted = [before.search_vectors(_query(seed), k=20) for seed in range(4)]
    summary = updates.vacuum(str(directory))
    assert summary["vacuumed"] and summary["removed_docs"] == 13 and summary["live_docs"] == 53
    assert (summary["shards_before"], summary["shards_after"]) == (11, 7)  # 8 + 3 adds → 7 full
    assert summary["store_bytes_after"] < summary["store_bytes_before"]
    store = ts.TokenStore(directory, verify_checksums=True)
    assert store.num_docs == 53 and not store.deleted.any()
    assert [s["num_docs"] for s in store.manifest["shards"]] == [8] * 6 + [5]
    assert [s["index"] for s in store.manifest["shards"]] == list(range(11, 18))
    assert store.manifest["updates"][-1]["op"] == "vacuum"
    live = [d for d in docs if d.doc_id not in deleted]
    assert store.doc_ids == [d.doc_id for d in live]  # store order kept
    for i, d in enumerate(live):  # every live document's tokens, bit for bit
        vectors, salience, token_ids = store.document(i)
        np.testing.assert_array_equal(vectors, d.vectors)
        np.testing.assert_array_equal(token_ids, d.token_ids)
        np.testing.assert_array_equal(salience, d.salience.astype(np.float16))
    assert not old_files & {p.name for p in directory.glob("shard-*")}  # the old files are gone
    _, exhaustive, fast = _searchers(directory)
    for seed in range(4):
        q = _query(seed)
        want = wanted[seed]
        got = exhaustive.search_vectors(q, k=20)
        assert [h.doc_id for h in got] == [h.doc_id for h in want]
        np.testing.assert_allclose([h.score for h in got], [h.score for h in want], atol=1e-6)
        hits = fast.search_vectors(q, k=5)
        assert hits and not {h.doc_id for h in hits} & deleted
    hits = exhaustive.search_vectors(_query(0), k=53)
    assert len(hits) == 53
    for h in hits:  # contents moved with them (add_encoded's rows hold the id alone)
        built = int(h.doc_id[3:]) < 60
        assert h.title == (f"title {h.doc_id}" if built else None), h
        assert h.metadata == ({"n": int(h.doc_id[3:])} if built else {}), h
    kept = exhaustive.search_vectors(_query(1), k=53, filter={"n": {"gte": 28, "lt": 38}})
    assert sorted(h.doc_id for h in kept) == ["doc28", "doc29", "doc36", "doc37"]


def test_a_searcher_opened_before_a_vacuum_keeps_what_it_mapped_or_says_to_reload(
    updated, tmp_path
):
    """A searcher of the earlier generation keeps the shards it mapped (and their documents'
    table rows, which stay until the next vacuum removes them); one that must open a replaced
    shard file says to load the index again (the server does it and answers)."""
    source, _, _ = updated
    directory = shutil.copytree(source, tmp_path / "idx")
    _, old, _ = _searchers(directory)
    want = old.search_vectors(_query(2), k=10)  # maps every shard
    _, unmapped, _ = _searchers(directory)
    updates.vacuum(str(directory))
    hits = old.search_vectors(_query(2), k=10)
    assert [h.doc_id for h in hits] == [h.doc_id for h in want]
    assert [h.title for h in hits] == [h.title for h in want]
    assert sum(h.title == f"title {h.doc_id}" for h in hits) >= 8
    with pytest.raises(SnapshotGoneError, match=r"shard-00000.* removed by an update committed "):
        unmapped.search_vectors(_query(2), k=10)
    opened = _searchers(directory)[1]
    (directory / "shard-00011.vectors.npy").unlink()  # lost, not replaced: another message
    with pytest.raises(IndexIntegrityError, match=r"shard-00011.vectors.npy: missing \(it"):
        opened.search_vectors(_query(2), k=10)


def test_the_next_vacuum_removes_the_table_rows_of_the_replaced_shards(updated, tmp_path):
    source, _, _ = updated
    directory = shutil.copytree(source, tmp_path / "idx")
    rows_before = _table_rows(directory)
    updates.vacuum(str(directory))
    assert _table_rows(directory) == rows_before + 53  # the live documents' rows, copied
    updates.delete_documents(str(directory), ["doc3"])
    again = updates.vacuum(str(directory))
    assert again["table_rows_removed"] == rows_before
    assert _table_rows(directory) == 53 + 52  # the first vacuum's rows, and the live copies


def test_nothing_to_vacuum_commits_nothing(updated, tmp_path):
    source, _, _ = updated
    directory = shutil.copytree(source, tmp_path / "idx")
    updates.vacuum(str(directory))
    manifest = (directory / ts.MANIFEST).read_bytes()
    summary = updates.vacuum(str(directory))  # the replaced shards' rows go, nothing else
    assert summary == {"vacuumed": False, "table_rows_removed": 66}
    assert updates.vacuum(str(directory)) == {"vacuumed": False, "table_rows_removed": 0}
    assert (directory / ts.MANIFEST).read_bytes() == manifest


def test_vacuum_of_an_index_whose_every_document_is_deleted_is_refused(updated, tmp_path):
    source, _, _ = updated
    directory = shutil.copytree(source, tmp_path / "idx")
    updates.delete_documents(str(directory), list(ts.TokenStore(directory).live_positions()))
    manifest = (directory / ts.MANIFEST).read_bytes()
    with pytest.raises(ConfigError, match=r"every document of .* is deleted; nothing was done"):
        updates.vacuum(str(directory))
    assert (directory / ts.MANIFEST).read_bytes() == manifest


def test_vacuum_of_an_index_without_search_index_or_table(tmp_path):
    docs = random_documents(20, DIM, seed=1, max_len=6)
    directory = tmp_path / "bare"
    write_store(directory, docs, DIM, shard_size=4)
    updates.delete_documents(str(directory), ["doc0", "doc5"])
    summary = updates.vacuum(str(directory))
    store = ts.TokenStore(directory, verify_checksums=True)
    assert summary["shards_after"] == 1 and store.num_docs == 18  # the default shard size, 500
    assert "search_index" not in store.manifest
    assert not (directory / documents_lib.FILE).exists()


def test_vacuum_with_a_re_cluster_flag_is_refused(updated):
    source, _, _ = updated
    with pytest.raises(ConfigError, match=r"--vacuum .* without --search_index, --compact"):
        updates.update_index(str(source), vacuum_store=True, force_compact=True)


def test_a_searcher_opened_before_two_vacuums_says_to_reload(updated, tmp_path):
    """The second vacuum removes the table rows of the first one's replaced shards: a searcher
    of that generation answered filters with nothing and hits without their contents."""
    source, _, _ = updated
    directory = shutil.copytree(source, tmp_path / "idx")
    _, old, _ = _searchers(directory)
    old.search_vectors(_query(2), k=53)  # maps every shard
    updates.vacuum(str(directory))
    updates.delete_documents(str(directory), ["doc3"])
    updates.vacuum(str(directory))
    with pytest.raises(SnapshotGoneError, match=r"documents.sqlite: the rows .* load the index"):
        old.search_vectors(_query(2), k=10)
    with pytest.raises(SnapshotGoneError, match=r"removed by aligner-index --vacuum"):
        old.search_vectors(_query(2), k=10, filter={"n": {"gte": 28}})
    hits = _searchers(directory)[1].search_vectors(_query(2), k=10, filter={"n": {"gte": 28}})
    assert len(hits) == 10 and all(h.metadata["n"] >= 28 for h in hits)


def test_delete_with_vacuum_is_refused_before_deleting_everything(updated, tmp_path):
    source, _, _ = updated
    directory = shutil.copytree(source, tmp_path / "idx")
    manifest = (directory / ts.MANIFEST).read_bytes()
    every = ",".join(ts.TokenStore(directory).live_positions())
    with pytest.raises(ConfigError, match=r"deletes every document of .*nothing was done"):
        updates.update_index(str(directory), delete=every, vacuum_store=True)
    assert (directory / ts.MANIFEST).read_bytes() == manifest  # the delete was not committed


def test_delete_with_vacuum_interrupted_after_the_delete_finishes_when_run_again(
    updated, tmp_path, monkeypatch
):
    """The delete commits first; a re-run after the vacuum was killed refused the delete ("were
    deleted already") and so never vacuumed."""
    source, _, _ = updated
    directory = shutil.copytree(source, tmp_path / "idx")

    def killed(index_dir):
        raise KeyboardInterrupt

    monkeypatch.setattr(updates, "vacuum", killed)
    with pytest.raises(KeyboardInterrupt):
        updates.update_index(str(directory), delete="doc3,doc4", vacuum_store=True)
    monkeypatch.undo()
    assert ts.TokenStore(directory).deleted.sum() == 15  # the delete committed
    summary = updates.update_index(str(directory), delete="doc3,doc4", vacuum_store=True)
    assert summary["vacuumed"] and summary["live_docs"] == 51 and "deleted_docs" not in summary
    with pytest.raises(ConfigError, match=r"not in .* or were deleted already"):
        updates.update_index(str(directory), delete="doc3,nodoc", vacuum_store=True)
