"""The search index at scale: streamed build (bounded memory), mapped load, few open files, the
public store writer, 2-bit residuals (issue 23)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
import weakref

import index_utils
import numpy as np
import pytest

from aligner_jax.common import errors, fileio
from aligner_jax.core import pruning
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import codec as codec_lib
from aligner_jax.indexing import inverted_lists as lists_lib
from aligner_jax.indexing import kmeans, sample_file
from aligner_jax.indexing import token_store as ts
from aligner_jax.indexing.sample_file import SampleFile


def _store(tmp_path, num_docs=60, dim=16, shard_size=7, seed=0):
    docs = index_utils.random_documents(num_docs, dim, seed=seed)
    return index_utils.write_store(tmp_path / "idx", docs, dim, shard_size=shard_size)


def _reference(store: ts.TokenStore, config: ci.CentroidIndexConfig):
    """The same index computed in memory from the whole store at once (what the streamed build
    must reproduce exactly)."""
    vectors = np.asarray(store.vectors(), np.float32)
    salience = np.asarray(store.salience(), np.float32)
    kept = pruning.top_fraction_segments(salience, store.offsets, config.beta_d)
    c = config.num_centroids
    rng = np.random.default_rng(config.seed)
    sample = vectors[np.sort(rng.choice(kept, config.sample_per_centroid * c, replace=False))]
    centroids, cells = kmeans.fit_two_level(
        sample, c, config.cells, config.kmeans_iterations, config.seed
    )
    codes, _ = kmeans.assign_two_level(vectors, centroids, cells)
    s_codes, _ = kmeans.assign_two_level(sample, centroids, cells)
    codec = codec_lib.ResidualCodec.fit(sample - centroids[s_codes], config.residual_bits)
    residuals = codec.encode(vectors - centroids[codes])
    return (centroids, codes, residuals, *_lists_of(store, codes, len(centroids), config.beta_d))


def _lists_of(store, codes, num_centroids, beta_d):
    """The inverted file (centroid → sorted documents owning a β^d-kept token of it) and the
    document → distinct centroid lists, computed in memory from every token's code."""
    salience = np.asarray(store.salience(), np.float32)
    kept = pruning.top_fraction_segments(salience, store.offsets, beta_d)
    docs = np.searchsorted(store.offsets, np.arange(store.num_tokens), side="right") - 1
    ivf = [sorted({int(d) for d in docs[kept][codes[kept] == j]}) for j in range(num_centroids)]
    doc_codes = [sorted(set(codes[docs == i].tolist())) for i in range(store.num_docs)]
    return ivf, doc_codes


def _assert_lists_equal(index, ivf, doc_codes):
    for j, docs in enumerate(ivf):
        assert index.lists.inverted_list(j).tolist() == docs
    for i, cs in enumerate(doc_codes):
        assert index.lists.document_centroids(np.array([i]))[0].tolist() == cs
    everyone = np.arange(len(doc_codes))[::-1]  # every document at once, in another order
    codes, counts = index.lists.document_centroids(everyone)
    assert codes.tolist() == [c for i in everyone for c in doc_codes[i]]
    assert counts.tolist() == [len(doc_codes[i]) for i in everyone]


@pytest.mark.parametrize("beta_d,block_pairs", [(1.0, None), (0.5, None), (1.0, 7), (0.5, 100)])
def test_streamed_build_equals_the_in_memory_reference(tmp_path, beta_d, block_pairs, monkeypatch):
    """Also with the inverted file filled a few entries at a time (many centroid blocks)."""
    if block_pairs:
        monkeypatch.setattr(lists_lib, "IVF_BLOCK_PAIRS", block_pairs)
    store = _store(tmp_path)
    config = ci.CentroidIndexConfig(
        num_centroids=16,
        cells=4,
        sample_per_centroid=8,
        residual_bits=4,
        beta_d=beta_d,
        doc_lists_max_fraction=1.0,
    )
    index = ci.CentroidIndex.build(store, config)
    centroids, codes, residuals, ivf, doc_codes = _reference(store, config)
    np.testing.assert_array_equal(index.centroids, centroids)
    np.testing.assert_array_equal(np.asarray(index.codes), codes)
    np.testing.assert_array_equal(np.asarray(index.residuals), residuals)
    _assert_lists_equal(index, ivf, doc_codes)
    # u^d in uint8 steps of the segment's largest / 255: within half a step of the store's
    step = index.meta["segments"][0]["salience_scale"]
    assert step == pytest.approx(float(np.max(store.salience())) / 255)
    assert index.salience.arrays[0].dtype == np.uint8
    np.testing.assert_allclose(
        index.salience[np.arange(store.num_tokens)],
        np.asarray(store.salience(), np.float32),
        rtol=0,
        atol=step / 2 + 1e-7,
    )


def test_build_never_reads_more_than_one_shard_at_a_time(tmp_path, monkeypatch):
    """The build touches token rows only through one shard's maps at a time: no read spans
    shards (the old build concatenated every shard to draw its k-means sample), and every
    shard's vectors are unmapped before the next shard's are mapped."""
    store = _store(tmp_path, num_docs=80, shard_size=6)
    largest = max(s["num_tokens"] for s, _, _ in store.shard_spans())
    rows = ts.TokenStore._rows

    def one_shard_rows(self, kind, start, stop):
        assert stop - start <= largest, f"read {stop - start} rows of {kind} across shards"
        return rows(self, kind, start, stop)

    live: list[weakref.ref] = []
    most_live = [0]
    arrays = ts.TokenStore.shard_arrays

    def tracked(self, s):
        out = arrays(self, s)
        live[:] = [r for r in live if r() is not None]
        live.append(weakref.ref(out[0]))
        most_live[0] = max(most_live[0], len(live))
        return out

    monkeypatch.setattr(ts.TokenStore, "_rows", one_shard_rows)
    monkeypatch.setattr(ts.TokenStore, "shard_arrays", tracked)
    ci.CentroidIndex.build(store, ci.CentroidIndexConfig(num_centroids=16, beta_d=0.5))
    assert most_live[0] == 1


def test_the_build_holds_its_kmeans_sample_in_an_unlinked_file_and_reads_codes_unmapped(
    tmp_path, monkeypatch
):
    """The k-means sample (O(centroids), 0.5 GiB at 65,536 centroids) lives in a scratch file
    outside resident memory, gone once the build ends (the old build held it in an array); the
    list writer re-reads the codes it wrote with plain reads, not through a mapping whose
    touched pages stay resident (the old build mapped them)."""
    store = _store(tmp_path, num_docs=80, shard_size=6)
    seen = {}
    fit, write_group = kmeans.fit_two_level, lists_lib.write_group

    def fit_spy(sample, *args, **kwargs):
        seen["sample"] = type(sample)
        seen["files_during"] = sorted(p.name for p in (store.directory / ci.SUBDIR).iterdir())
        return fit(sample, *args, **kwargs)

    def write_group_spy(store_, codes, *args, **kwargs):
        seen["codes"] = {type(a) for a in codes.arrays}
        return write_group(store_, codes, *args, **kwargs)

    monkeypatch.setattr(kmeans, "fit_two_level", fit_spy)
    monkeypatch.setattr(lists_lib, "write_group", write_group_spy)
    config = ci.CentroidIndexConfig(num_centroids=16, cells=4, beta_d=0.5, seed=3)
    index = ci.CentroidIndex.build(store, config)
    assert seen["sample"] is SampleFile
    assert seen["files_during"] == []  # unlinked when opened: nothing to leave behind
    assert seen["codes"] == {fileio.NpyRows}
    assert not [p for p in (store.directory / ci.SUBDIR).iterdir() if "sample" in p.name]
    centroids, codes, residuals, ivf, doc_codes = _reference(store, config)
    np.testing.assert_array_equal(index.centroids, centroids)
    np.testing.assert_array_equal(np.asarray(index.codes), codes)
    np.testing.assert_array_equal(np.asarray(index.residuals), residuals)


def test_a_sample_file_reads_and_writes_as_the_array_it_replaces(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    array = rng.standard_normal((1000, 8)).astype(np.float16)
    monkeypatch.setattr(sample_file, "SPAN_ROWS", 50)  # reads of 50 rows at most
    with SampleFile(tmp_path, array.shape, np.float16) as f:
        assert (len(f), f.shape, f.dtype) == (1000, (1000, 8), np.float16)
        for lo in range(0, 1000, 300):  # written in uneven slices
            f[lo : lo + 300] = array[lo : lo + 300]
        assert list(tmp_path.iterdir()) == []
        np.testing.assert_array_equal(f[0:1000], array)
        np.testing.assert_array_equal(f[997:2000], array[997:])
        assert f[5:5].shape == (0, 8)
        for rows in (
            rng.integers(0, 1000, 300),  # any order, repeats
            np.array([999, 0, 500, 0]),  # far apart
            np.arange(100, 400),  # one run longer than a read
            np.zeros(0, np.int64),
        ):
            np.testing.assert_array_equal(f[rows], array[rows])
        order = rng.permutation(1000)
        with f.permuted(order, chunk=128) as g:
            np.testing.assert_array_equal(g[0:1000], array[order])
        with pytest.raises(IndexError, match="out of range"):
            f[np.array([1000])]
        with pytest.raises(ValueError, match="take shape"):
            f[0:3] = array[:2]
        with pytest.raises(IndexError, match="step 1"):
            f[::2]


def test_two_level_kmeans_of_a_sample_file_equals_the_in_memory_fit(tmp_path):
    sample = np.random.default_rng(1).standard_normal((3000, 16)).astype(np.float16)
    in_memory = kmeans.fit_two_level(sample, 64, 8, iterations=4, seed=2)
    with SampleFile(tmp_path, sample.shape, sample.dtype) as f:
        f[0 : len(sample)] = sample
        from_file = kmeans.fit_two_level(f, 64, 8, iterations=4, seed=2)
    for a, b in zip(in_memory, from_file, strict=True):
        np.testing.assert_array_equal(a, b)


def test_npy_rows_read_slices_of_a_file_without_mapping_it(tmp_path):
    first = np.arange(40, dtype=np.uint16)
    second = np.arange(100, 130, dtype=np.uint16)
    fileio.atomic_save_npy(tmp_path / "a.npy", first)
    fileio.atomic_save_npy(tmp_path / "b.npy", second)
    rows = fileio.NpyRows(tmp_path / "a.npy")
    assert (len(rows), rows.shape, rows.dtype) == (40, (40,), np.uint16)
    np.testing.assert_array_equal(rows[3:17], first[3:17])
    assert not isinstance(rows[0:40], np.memmap)
    with pytest.raises(TypeError, match="contiguous slices"):
        rows[np.array([1, 2])]
    both = ci.Segmented([rows, fileio.NpyRows(tmp_path / "b.npy")])
    whole = np.concatenate([first, second])
    for lo, hi in ((0, 70), (35, 45), (40, 70), (69, 70), (70, 70)):  # across segments, too
        np.testing.assert_array_equal(both.span(lo, hi), whole[lo:hi])


def test_load_maps_the_large_arrays_instead_of_reading_them(tmp_path):
    store = _store(tmp_path)
    ci.CentroidIndex.build(
        store, ci.CentroidIndexConfig(num_centroids=16, doc_lists_max_fraction=1)
    )
    index = ci.CentroidIndex.load(ts.TokenStore(store.directory))
    for array in (*index.codes.arrays, *index.residuals.arrays, *index.salience.arrays):
        assert isinstance(array, np.memmap)
    (group,) = index.lists.groups
    assert isinstance(group.ivf_docs, np.memmap) and isinstance(group.doc_codes, np.memmap)


def test_an_added_segment_is_searched_like_a_rebuild_of_the_same_centroids(tmp_path):
    """``--add`` writes a second segment; codes and residuals read across both segments equal
    those the build computes for the same tokens with the same centroids."""
    docs = index_utils.random_documents(50, 16, seed=3)
    store = index_utils.write_store(tmp_path / "a", docs[:30], 16, shard_size=7)
    index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(num_centroids=8, cells=2))
    manifest = ts.read_manifest(store.directory)
    extra = [
        ts.write_shard(store.directory, 5 + i, docs[30 + 10 * i : 40 + 10 * i], 16)
        for i in range(2)
    ]
    manifest["shards"] += extra
    manifest["counts"]["num_docs"] += 20
    manifest["counts"]["num_tokens"] += sum(e["num_tokens"] for e in extra)
    manifest["counts"]["num_shards"] += 2
    ts.write_manifest(store.directory, manifest)
    grown = ts.TokenStore(store.directory)
    updated = index.update(grown, "add", num_docs=20)
    updated.commit(grown)
    assert [g["name"] for g in updated.meta["segments"]] == ["segment-00001", "segment-00002"]
    vectors = np.asarray(grown.vectors(), np.float32)
    codes, _ = kmeans.assign_two_level(vectors, updated.centroids, updated.cells)
    np.testing.assert_array_equal(np.asarray(updated.codes), codes)
    rows = np.array([0, 5, grown.num_tokens - 1, int(grown.offsets[30]) + 2])
    np.testing.assert_array_equal(updated.residuals[rows], np.asarray(updated.residuals)[rows])
    reloaded = ci.CentroidIndex.load(ts.TokenStore(store.directory))
    assert len(reloaded.codes) == grown.num_tokens
    # each segment's saliences in steps of its own largest u^d, read as one float32 array
    steps = [g["salience_scale"] for g in reloaded.meta["segments"]]
    truth = np.asarray(grown.salience(), np.float32)
    cut = int(grown.offsets[30])
    assert steps == pytest.approx([truth[:cut].max() / 255, truth[cut:].max() / 255])
    np.testing.assert_allclose(np.asarray(reloaded.salience), truth, atol=max(steps) / 2 + 1e-7)


@pytest.mark.parametrize("token_lists", [False, True])
def test_an_add_writes_the_lists_of_the_added_documents_only(tmp_path, monkeypatch, token_lists):
    """An ``--add`` reads only the shards added since the last full list write (the update used
    to read every shard and write every list again): their lists form a delta group, written
    again by the next add; once the delta would hold more than ``DELTA_FRACTION`` of the tokens,
    every list is written as one group. After each add: the lists equal those computed from
    every token's code, only the generation's files remain, and searches equal those of the
    same index whose lists were written as one group at every add. With ``token_lists`` each
    group holds its token lists too, which read together equal the lists built in memory from
    every token, and searches with residual candidates over them equal those over the lists
    built in memory."""
    from aligner_jax.indexing import updates
    from aligner_jax.retrieval import centroid_search as cs

    docs = index_utils.random_documents(130, 16, seed=7)
    store = index_utils.write_store(tmp_path / "idx", docs[:100], 16, shard_size=7)
    config = ci.CentroidIndexConfig(
        num_centroids=16, cells=4, beta_d=0.5, doc_lists_max_fraction=1.0, token_lists=token_lists
    )
    ci.CentroidIndex.build(store, config)
    one_group = tmp_path / "one_group"  # the same index, its lists always written whole
    shutil.copytree(store.directory, one_group)
    read = []
    shard_arrays = ts.TokenStore.shard_arrays
    monkeypatch.setattr(
        ts.TokenStore, "shard_arrays", lambda self, i: read.append(i) or shard_arrays(self, i)
    )
    rng = np.random.default_rng(3)
    queries = [rng.normal(size=(5, 16)).astype(np.float32) for _ in range(4)]
    # (added documents, list groups after the add, first shard of the last group, shards read)
    for lo, hi, groups, first, shards in [
        (100, 104, 2, 15, {15}),
        (104, 108, 2, 15, {15, 16}),
        (108, 125, 1, 0, set(range(18))),
    ]:
        monkeypatch.setattr(lists_lib, "DELTA_FRACTION", 0.12)
        read.clear()
        updates.add_encoded(store.directory, docs[lo:hi])
        assert set(read) == shards
        monkeypatch.setattr(lists_lib, "DELTA_FRACTION", 0.0)
        updates.add_encoded(one_group, docs[lo:hi])
        grown = ts.TokenStore(store.directory)
        index = ci.CentroidIndex.load(grown)
        assert len(index.lists.groups) == len(index.meta["lists"]) == groups
        assert index.meta["lists"][-1]["first_shard"] == first
        assert index.meta["updates"][-1]["list_groups"] == groups
        codes = np.asarray(index.codes)
        _assert_lists_equal(index, *_lists_of(grown, codes, 16, 0.5))
        on_disk = {p.name for p in (store.directory / ci.SUBDIR).glob("*.npy")}
        assert on_disk == {f"{n}.npy" for n in index.meta["files"]}
        other = ts.TokenStore(one_group)
        other_index = ci.CentroidIndex.load(other)
        assert len(other_index.lists.groups) == 1
        np.testing.assert_array_equal(np.asarray(other_index.codes), codes)
        a, b = cs.CentroidSearcher(grown, index), cs.CentroidSearcher(other, other_index)
        assert a.list_docs == b.list_docs
        for q in queries:
            q /= np.linalg.norm(q, axis=1, keepdims=True)
            w = np.ones(5, np.float32)
            ((docs_a, scores_a),), _ = a.search(q, w, np.arange(5), 30)
            ((docs_b, scores_b),), _ = b.search(q, w, np.arange(5), 30)
            np.testing.assert_array_equal(docs_a, docs_b)
            np.testing.assert_array_equal(scores_a, scores_b)
            assert (docs_a >= 100).any()  # the added documents are found
        assert index.lists.has_token_lists == other_index.lists.has_token_lists == token_lists
        if token_lists:
            _assert_token_lists_equal(index, grown)
            rc = cs.CentroidSearchConfig(residual_candidates=True, probes=3)
            mapped, in_memory, by_position = (
                cs.CentroidSearcher(grown, index, rc) for _ in range(3)
            )
            in_memory._token_lists = in_memory._build_token_lists()
            # one set of lists by position per index segment (the adds wrote several)
            by_position._token_lists = by_position._build_token_lists(by_position=True)
            assert len(by_position._token_lists) == len(index.residuals.arrays) > 1
            for q in queries:
                w = np.ones(5, np.float32)
                ((docs_a, scores_a),), _ = mapped.search(q, w, np.arange(5), 30)
                for other in (in_memory, by_position):
                    ((docs_b, scores_b),), _ = other.search(q, w, np.arange(5), 30)
                    np.testing.assert_array_equal(docs_a, docs_b)
                    np.testing.assert_allclose(scores_a, scores_b, rtol=1e-6)


def _assert_token_lists_equal(index, store):
    """The token lists of every list group, read as one (each centroid's run of each group in
    turn: groups hold increasing documents), equal those built in memory over every token."""
    from aligner_jax.retrieval import centroid_search as cs

    (want,) = cs.CentroidSearcher(store, index)._build_token_lists()
    groups = index.lists.token_lists()
    c = index.num_centroids
    keys = np.concatenate([np.repeat(np.arange(c), np.diff(g.offsets)) for g in groups])
    order = np.argsort(keys, kind="stable")  # by centroid, then group, then store order
    np.testing.assert_array_equal(sum(g.offsets for g in groups), want.offsets)
    np.testing.assert_array_equal(np.concatenate([g.docs for g in groups])[order], want.docs)
    np.testing.assert_array_equal(
        np.concatenate([g.residuals for g in groups])[order], want.residuals
    )


def test_an_index_of_format_5_loads_and_takes_an_add(tmp_path):
    """Format 5 named its one list group in ``tables``: it loads as it is, and an ``--add``
    keeps that group and writes the added documents' lists beside it (format 6)."""
    from aligner_jax.indexing import updates

    docs = index_utils.random_documents(70, 16, seed=2)
    store = index_utils.write_store(tmp_path / "idx", docs[:66], 16, shard_size=9)
    built = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(num_centroids=16))
    meta = json.loads(built.meta_path.read_text())
    meta["tables"].update(meta.pop("lists")[0]["tables"])
    meta["format"] = "aligner_jax.indexing.centroid_index/5"
    fileio.atomic_write_json(built.meta_path, meta)
    ci.CentroidIndex._open(built.directory, meta).commit(store)
    old = ci.CentroidIndex.load(ts.TokenStore(store.directory))
    assert "lists" not in old.meta and len(old.lists.groups) == 1
    ivf, doc_codes = _lists_of(store, np.asarray(old.codes), 16, 1.0)
    _assert_lists_equal(old, ivf, doc_codes)
    updates.add_encoded(store.directory, docs[66:])
    grown = ts.TokenStore(store.directory)
    new = ci.CentroidIndex.load(grown)
    assert new.meta["format"] == ci.FORMAT and len(new.lists.groups) == 2
    assert new.meta["lists"][0]["tables"]["ivf_docs"] == meta["tables"]["ivf_docs"]
    assert "ivf_docs" not in new.meta["tables"]
    _assert_lists_equal(new, *_lists_of(grown, np.asarray(new.codes), 16, 1.0))


def test_add_encoded_refuses_a_known_id_and_leaves_the_index_as_it_was(tmp_path):
    """Shards written before the clash are not committed, and the next writer removes them."""
    from aligner_jax.indexing import updates

    docs = index_utils.random_documents(30, 16, seed=5)
    store = index_utils.write_store(tmp_path / "idx", docs[:20], 16, shard_size=7)
    manifest = ts.read_manifest(store.directory)
    manifest["indexing"] = {"shard_size": 3}
    ts.write_manifest(store.directory, manifest)
    ci.CentroidIndex.build(ts.TokenStore(store.directory), ci.CentroidIndexConfig(num_centroids=8))
    before = (store.directory / ts.MANIFEST).read_bytes()
    with pytest.raises(errors.ConfigError, match=r"document id 'doc3' is already in .*nothing"):
        updates.add_encoded(store.directory, [*docs[20:29], docs[3]])
    assert (store.directory / ts.MANIFEST).read_bytes() == before
    assert ts.TokenStore(store.directory).num_docs == 20
    assert list(store.directory.glob("shard-00005.*"))  # written, not committed
    nan = dataclasses.replace(docs[29], vectors=np.full_like(docs[29].vectors, np.nan))
    with pytest.raises(errors.ConfigError, match=r"add_encoded: document 'doc29': .*NaN.*nothing"):
        updates.add_encoded(store.directory, [*docs[20:22], nan])
    assert (store.directory / ts.MANIFEST).read_bytes() == before
    summary = updates.add_encoded(store.directory, docs[20:23])
    assert summary["added_docs"] == 3 and summary["new_shards"] == ["shard-00003"]
    grown = ts.TokenStore(store.directory)
    assert grown.num_docs == 23 and grown.doc_ids[20:] == ["doc20", "doc21", "doc22"]
    assert not list(store.directory.glob("shard-0000[45].*"))  # the refused add's: removed


def test_document_centroid_lists_are_dropped_where_they_save_little_with_the_same_rankings(
    tmp_path,
):
    """Above ``doc_lists_max_fraction`` pairs per token the document → centroid lists are not
    written (2 bytes per pair less) and centroid interaction reads the tokens' codes: the same
    interaction scores, kept tokens and rankings as with the lists; an ``--add`` keeps the rule."""
    from aligner_jax.retrieval import centroid_search as cs

    docs = index_utils.random_documents(70, 16, seed=4)
    stores, indexes = [], []
    for fraction in (1.0, 0.0):
        store = index_utils.write_store(tmp_path / f"f{fraction}", docs[:60], 16, shard_size=9)
        config = ci.CentroidIndexConfig(num_centroids=32, doc_lists_max_fraction=fraction)
        stores.append(store)
        indexes.append(ci.CentroidIndex.build(store, config))
    (with_lists, without), pairs = indexes, indexes[0].lists.doc_code_count()
    assert not without.lists.has_doc_lists and without.lists.doc_code_count() == 0
    assert not list((stores[1].directory / ci.SUBDIR).glob("doc_code*"))
    lists_bytes = sum(e["bytes"] for n, e in with_lists.meta["files"].items() if "doc_code" in n)
    assert with_lists.nbytes() - without.nbytes() == lists_bytes  # nothing else differs
    assert with_lists.lists.groups[0].doc_codes.dtype == np.uint16 and lists_bytes > 2 * pairs
    rng = np.random.default_rng(0)
    docs_asked = np.array([3, 0, 41, 17, 59])
    for _ in range(4):
        q = rng.normal(size=(6, 16)).astype(np.float32)
        q /= np.linalg.norm(q, axis=1, keepdims=True)
        weights = rng.uniform(0.1, 1.0, 6).astype(np.float32)
        s_t = np.ascontiguousarray(q @ with_lists.centroids.T).T
        a, b = (cs.CentroidSearcher(st, ix) for st, ix in zip(stores, indexes, strict=True))
        np.testing.assert_array_equal(
            a.interaction(s_t, docs_asked, weights), b.interaction(s_t, docs_asked, weights)
        )
        np.testing.assert_array_equal(
            a.best_centroid_tokens(s_t, docs_asked, weights),
            b.best_centroid_tokens(s_t, docs_asked, weights),
        )
        ((docs_a, scores_a),), _ = a.search(q, weights, np.arange(6), 20)
        ((docs_b, scores_b),), _ = b.search(q, weights, np.arange(6), 20)
        np.testing.assert_array_equal(docs_a, docs_b)
        np.testing.assert_array_equal(scores_a, scores_b)
    # an update writes the lists again by the same rule (here: still none)
    grown_manifest = ts.read_manifest(stores[1].directory)
    extra = ts.write_shard(stores[1].directory, len(grown_manifest["shards"]), docs[60:], 16)
    grown_manifest["shards"].append(extra)
    grown_manifest["counts"]["num_docs"] += 10
    grown_manifest["counts"]["num_tokens"] += extra["num_tokens"]
    grown_manifest["counts"]["num_shards"] += 1
    ts.write_manifest(stores[1].directory, grown_manifest)
    grown = ts.TokenStore(stores[1].directory)
    updated = without.update(grown, "add", num_docs=10)
    assert not updated.lists.has_doc_lists and updated.meta["format"] == ci.FORMAT


def test_quantised_saliences_keep_zero_and_read_across_old_and_new_segments():
    """uint8 saliences: 0 stays exactly 0 (a pruned token stays pruned), the largest is 255
    steps; a format-3 segment (float16, no step) reads beside a quantised one."""
    u = np.array([0.0, 0.004, 0.5, 1.3, 2.35], np.float16)
    step = 2.35 / 255
    q = ci.quantize_salience(u, step)
    assert q.dtype == np.uint8 and q[0] == 0 and q[-1] == 255
    np.testing.assert_allclose(q * np.float32(step), u.astype(np.float32), atol=step / 2 + 1e-6)
    old = np.array([0.25, 0.75], np.float16)
    mixed = ci.Segmented([old, q], [None, step])
    read = mixed[np.array([1, 2, 6])]
    assert read.dtype == np.float32
    np.testing.assert_allclose(read, [0.75, 0.0, 2.35], atol=step / 2 + 1e-6)
    np.testing.assert_allclose(mixed.span(0, 3), [0.25, 0.75, 0.0], atol=1e-6)
    plain = ci.Segmented([old])
    assert plain[np.array([0])].dtype == np.float16  # unscaled arrays read as stored


@pytest.mark.parametrize("bits", [2, 4])
def test_residual_codec_round_trip(bits):
    rng = np.random.default_rng(0)
    residuals = rng.normal(scale=0.05, size=(4000, 24)).astype(np.float32)
    codec = codec_lib.ResidualCodec.fit(residuals, bits)
    packed = codec.encode(residuals)
    assert packed.shape == (4000, 24 * bits // 8)
    decoded = codec.decode(packed)
    inside = (residuals >= codec.lower) & (residuals < codec.lower + codec.step * (1 << bits))
    error = np.abs(decoded - residuals)
    assert inside.mean() > 0.95
    assert np.all(error[inside] <= np.broadcast_to(codec.step / 2, error.shape)[inside] + 1e-6)
    q = rng.normal(size=(3, 24)).astype(np.float32)
    np.testing.assert_allclose(
        codec.residual_scores(q, packed), q @ decoded.T, rtol=1e-4, atol=1e-4
    )


def test_a_store_of_many_shards_builds_and_searches_with_few_open_files(tmp_path):
    """120 shards (360 shard arrays) build and search, fast and exhaustively, under a limit of
    64 open files: the map cache sizes itself to the limit (at 96 maps, exhaustive search once
    failed with "Too many open files")."""
    store = _store(tmp_path, num_docs=240, shard_size=2, dim=8)
    script = textwrap.dedent(
        f"""
        import resource, numpy as np
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        from aligner_jax.indexing import centroid_index as ci, token_store as ts
        from aligner_jax.retrieval import centroid_search as cs
        from aligner_jax.retrieval.searcher import Searcher, SearchConfig
        store = ts.TokenStore({str(store.directory)!r})
        assert store.max_open_arrays == 16  # a quarter of the limit, not MAX_OPEN_ARRAYS (96)
        index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(num_centroids=8))
        searcher = cs.CentroidSearcher(store, index)
        q = np.asarray(store.document(5)[0], np.float32)
        (ranking,), _ = searcher.search(q, np.ones(len(q), np.float32), np.arange(len(q)), 3)
        exhaustive = Searcher(store, SearchConfig(backend="exact", k_prime=0))
        assert exhaustive.search_vectors(q, k=3)[0].doc_id == store.doc_ids[5]
        import os
        print(len(os.listdir("/proc/self/fd")), int(ranking[0][0]))
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    fds, best = map(int, out.stdout.split()[-2:])
    assert fds < 64
    assert best == 5


def test_token_store_writer_writes_a_store_the_readers_take(tmp_path):
    rng = np.random.default_rng(1)
    docs = {f"d{i}": rng.normal(size=(3 + i, 8)).astype(np.float32) for i in range(11)}
    model = {"name": "elsewhere", "fingerprint": "abc", "dim": 8, "salience": "none"}
    with ts.TokenStoreWriter(tmp_path / "w", model, shard_size=4) as writer:
        for doc_id, vectors in docs.items():
            writer.add(doc_id, vectors)
    store = writer.store
    assert store.num_docs == 11 and store.num_shards == 3
    assert store.doc_ids == list(docs)
    np.testing.assert_allclose(np.asarray(store.document(7)[0], np.float32), docs["d7"], atol=1e-3)
    manifest = json.loads((tmp_path / "w" / ts.MANIFEST).read_text())
    assert manifest["counts"]["num_tokens"] == sum(len(v) for v in docs.values())
    ts.TokenStore(tmp_path / "w", verify_checksums=True)  # checksums match the bytes
    with pytest.raises(errors.ConfigError, match="exists"):
        ts.TokenStoreWriter(tmp_path / "w", model)
    with pytest.raises(errors.ConfigError, match="expected \\[m, 8\\]"):
        ts.TokenStoreWriter(tmp_path / "v", model).add("x", np.zeros((2, 3)))


def test_a_store_written_elsewhere_is_searched_by_vectors_after_search_index(tmp_path):
    """The WORKSPACE path: ``TokenStoreWriter`` → ``aligner-index --search_index`` →
    ``Searcher.load`` → ``search_vectors`` (once refused: no ``encoder.json``); a text query
    says how to give the model, in one line."""
    from aligner_jax.indexing import updates
    from aligner_jax.retrieval import search_job
    from aligner_jax.retrieval.searcher import Searcher

    docs = index_utils.random_documents(80, 16, seed=3)
    directory = tmp_path / "elsewhere"
    with ts.TokenStoreWriter(directory, {"name": "mine", "fingerprint": "m", "dim": 16}) as w:
        for d in docs:
            w.add(d.doc_id, d.vectors, d.salience, d.token_ids)
    updates.rebuild_search_index(str(directory))
    fast = Searcher.load(str(directory))
    exhaustive = Searcher.load(str(directory), mode="exhaustive")
    assert fast.encoder is None and exhaustive.encoder is None
    query = docs[7].vectors[:5]
    assert fast.search_vectors(query, k=1)[0].doc_id == "doc7"
    assert exhaustive.search_vectors(query, k=1)[0].doc_id == "doc7"
    with pytest.raises(errors.ConfigError, match="records no query encoder .*search_vectors"):
        fast.search("a text query")
    with pytest.raises(errors.ConfigError, match="records no query encoder .*--gin_file"):
        search_job.search_job(str(directory), query="a text query")
    with pytest.raises(errors.ConfigError, match="checkpoint='ckpt' replaces the model"):
        Searcher.load(str(directory), checkpoint="ckpt")


@pytest.mark.parametrize(
    "doc_id, vectors, salience, token_ids, message",
    [
        ("x", np.full((3, 8), np.nan), None, None, "document 'x': vectors hold NaN or infinite"),
        ("x", np.full((3, 8), -np.inf), None, None, "NaN or infinite"),
        ("x", np.full((3, 8), 1e6), None, None, "beyond float16's range"),
        ("x", np.ones((3, 8), np.complex64), None, None, "dtype complex64, expected real"),
        ("x", np.zeros((0, 8)), None, None, "at least one token vector"),
        ("x", np.ones((3, 8)), np.ones(2), None, "salience of shape \\(2,\\), expected \\[3\\]"),
        ("x", np.ones((3, 8)), [np.nan, 1, 1], None, "salience must be finite and >= 0"),
        ("x", np.ones((3, 8)), [-1.0, 1, 1], None, "salience must be finite and >= 0"),
        ("x", np.ones((3, 8)), None, np.arange(5), "token_ids of shape \\(5,\\)"),
        ("x", np.ones((3, 8)), None, [0.5, 1.5, 2.5], "token_ids of dtype float64"),
        (None, np.ones((3, 8)), None, None, "id must be a string or an integer"),
        ("  ", np.ones((3, 8)), None, None, "id is empty"),
        (" d0 ", np.ones((3, 8)), None, None, "'d0' was added already"),
    ],
)
def test_token_store_writer_refuses_a_document_the_index_cannot_use_and_keeps_the_rest(
    tmp_path, doc_id, vectors, salience, token_ids, message
):
    """A bad document is refused at ``add`` in one line naming it (a NaN once made a non-finite
    centroid and every fast search returned nothing); the documents around it are kept."""
    rng = np.random.default_rng(2)
    model = {"name": "elsewhere", "fingerprint": "abc", "dim": 8, "salience": "none"}
    writer = ts.TokenStoreWriter(tmp_path / "w", model, shard_size=2)
    good = rng.normal(size=(4, 8)).astype(np.float32)
    writer.add("d0", good)
    with pytest.raises(errors.ConfigError, match="^TokenStoreWriter.add: .*" + message):
        writer.add(doc_id, vectors, salience, token_ids)
    for i in range(1, 6):
        writer.add(f"d{i}", rng.normal(size=(4, 8)).astype(np.float32))
    store = writer.close()
    assert store.doc_ids == [f"d{i}" for i in range(6)]
    index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(num_centroids=4))
    assert np.isfinite(np.asarray(index.centroids, np.float32)).all()


def test_drift_compares_added_tokens_with_tokens_the_kmeans_never_saw(tmp_path):
    """Documents of the same distribution as the build's drift ~0: the reference is the score
    of build tokens outside the k-means sample. Against every build token (the sample's fit
    its centroids closely) any addition looked like drift and --compact re-clustered."""
    from aligner_jax.indexing import updates

    docs = index_utils.random_documents(120, 16, seed=11, min_len=20, max_len=40)
    store = index_utils.write_store(tmp_path / "idx", docs[:100], 16, shard_size=25)
    config = ci.CentroidIndexConfig(num_centroids=256, sample_per_centroid=2)  # overfits
    index = ci.CentroidIndex.build(store, config)
    centroids, cells = np.asarray(index.centroids), np.asarray(index.cells)
    vectors = np.concatenate([np.asarray(d.vectors, np.float32) for d in docs[:100]])
    every = float(kmeans.assign_two_level(vectors, centroids, cells)[1].mean())
    assert index.meta["mean_centroid_score"] < every - 0.03  # the sample's tokens fit better
    updates.add_encoded(store.directory, docs[100:])
    drift = ci.CentroidIndex.load(ts.TokenStore(store.directory)).drift()
    added = index.meta["mean_centroid_score"] - drift
    assert abs(drift) < 0.02 < every - added


def test_scann_beyond_its_measured_limit_is_refused_in_one_line(tmp_path):
    from aligner_jax.indexing import ann

    store = _store(tmp_path, num_docs=20)
    config = ann.ScannConfig(max_token_dims=store.num_tokens * store.dim - 1)
    with pytest.raises(errors.ConfigError, match="measured limit.*backend=\"'centroid'\""):
        ann.TokenIndex.build(store, "scann", scann_config=config)


def test_a_rebuild_keeps_the_recorded_settings_unless_gin_binds_them(tmp_path):
    import gin

    store = _store(tmp_path, num_docs=30)
    ci.CentroidIndex.build(store, ci.CentroidIndexConfig(num_centroids=4, residual_bits=8))
    assert ci.recorded_config(store.directory).residual_bits == 8
    try:
        gin.parse_config("CentroidIndexConfig.residual_bits = 2")
        config = ci.recorded_config(store.directory)
        assert (config.residual_bits, config.num_centroids) == (2, 4)
    finally:
        gin.clear_config()


def test_segmented_reads_rows_by_index_slice_or_mask_alike():
    """``Segmented[rows]`` (a gather with ``np.take``) gives what NumPy's indexing gives for
    integer rows, lists, slices and boolean masks, within one segment and across several."""
    rng = np.random.default_rng(0)
    whole = rng.integers(0, 255, (30, 4)).astype(np.uint8)
    for parts in ([whole], [whole[:7], whole[7:19], whole[19:]]):
        seg = ci.Segmented(parts)
        mask = rng.random(30) < 0.4
        for rows in (np.array([29, 0, 7, 7, 18]), [3, 1], slice(2, 9), mask):
            if isinstance(rows, slice) and len(parts) > 1:
                continue  # several segments: span() reads ranges
            np.testing.assert_array_equal(seg[rows], whole[rows])


def test_document_means_are_unit_means_and_zero_for_empty_documents():
    """``document_sums`` then ``unit_rows`` (what the build stores): each run of rows summed
    in float32 and scaled to unit length (float16), zeros for a document without tokens,
    wherever it lies among the others; the sums of consecutive chunks of the rows
    (``document_sums`` with their start) add up to the sums of the whole."""
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(9, 4)).astype(np.float16)
    offsets = np.array([0, 0, 3, 3, 4, 9, 9])  # documents of 0, 3, 0, 1, 5 and 0 tokens
    got = ci.unit_rows(ci.document_sums(vectors.astype(np.float32), offsets))
    assert got.dtype == np.float16 and got.shape == (6, 4)
    for d in range(6):
        rows = np.asarray(vectors[offsets[d] : offsets[d + 1]], np.float32)
        if not len(rows):
            np.testing.assert_array_equal(got[d], 0.0)
            continue
        want = rows.sum(axis=0)
        np.testing.assert_allclose(
            got[d].astype(np.float32), want / np.linalg.norm(want), atol=1e-3
        )
    # summed chunk by chunk (as the build does), documents across a chunk's edge included
    whole = ci.document_sums(vectors.astype(np.float32), offsets)
    for cut in (2, 4, 6):
        parts = ci.document_sums(vectors[:cut].astype(np.float32), offsets) + ci.document_sums(
            vectors[cut:].astype(np.float32), offsets, start=cut
        )
        np.testing.assert_allclose(parts, whole, atol=1e-6)


def _means_of(store: ts.TokenStore) -> np.ndarray:
    vectors = np.asarray(store.vectors(), np.float32)
    sums = np.stack(
        [
            vectors[a:b].sum(axis=0)
            for a, b in zip(store.offsets[:-1], store.offsets[1:], strict=True)
        ]
    )
    return sums / np.linalg.norm(sums, axis=1, keepdims=True)


def test_the_index_holds_each_documents_mean_vector_and_an_add_appends_them(tmp_path):
    """A 4-bit build writes one mean vector per document (a file per segment, read as one
    array in store order); ``--add`` writes the added documents' in its segment; a 2-bit
    build writes none unless asked (``CentroidIndexConfig.doc_means``)."""
    from aligner_jax.indexing import indexer, updates

    docs = index_utils.random_documents(50, 16, seed=4)
    store = index_utils.write_store(tmp_path / "a", docs[:30], 16, shard_size=7)
    index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(num_centroids=8, cells=2))
    assert index.meta["doc_means"] and "segment-00001.means" in index.meta["files"]
    np.testing.assert_allclose(np.asarray(index.means, np.float32), _means_of(store), atol=1e-3)
    with indexer.writer_lock(store.directory):
        updates.add_encoded(store.directory, iter(docs[30:]))
    grown = ts.TokenStore(store.directory)
    added = ci.CentroidIndex.load(grown)
    assert len(added.meta["segments"]) == 2 and len(added.means) == 50 == grown.num_docs
    np.testing.assert_allclose(np.asarray(added.means, np.float32), _means_of(grown), atol=1e-3)
    compact = ci.CentroidIndexConfig(num_centroids=8, cells=2, residual_bits=2)
    assert ci.CentroidIndex.build(store, compact, commit=False).means is None
    asked = dataclasses.replace(compact, doc_means=True)
    np.testing.assert_allclose(
        np.asarray(ci.CentroidIndex.build(grown, asked, commit=False).means, np.float32),
        _means_of(grown),
        atol=1e-3,
    )
