"""Token store: shards, manifest, exact round trip, integrity checks, pruning."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from index_utils import random_documents, write_store

from aligner_jax.common import errors, fileio
from aligner_jax.indexing import ann as ti
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import token_store as ts

DIM = 16


@pytest.fixture()
def docs():
    return random_documents(23, DIM, seed=1)


def test_round_trip_across_shards(tmp_path, docs):
    store = write_store(tmp_path / "idx", docs, DIM, shard_size=5)
    assert store.num_docs == 23
    assert store.doc_ids == [d.doc_id for d in docs]
    assert store.num_tokens == sum(len(d.token_ids) for d in docs)
    assert store.manifest["counts"]["num_shards"] == 5
    for i in (0, 4, 5, 11, 22):  # first/last of shards and a middle one
        v, s, t = store.document(i)
        np.testing.assert_array_equal(v, docs[i].vectors)
        np.testing.assert_allclose(s, docs[i].salience.astype(np.float16))
        np.testing.assert_array_equal(t, docs[i].token_ids)
    # Only real tokens are stored: bytes scale with tokens, not docs x max length.
    assert store.vectors().shape == (store.num_tokens, DIM)


def test_gather_padded_spans_shards(tmp_path, docs):
    store = write_store(tmp_path / "idx", docs, DIM, shard_size=4)
    picks = np.array([3, 4, 9, 22])
    length = max(len(docs[i].token_ids) for i in picks) + 3
    vec, mask, sal, ids = store.gather_padded(picks, length)
    for row, i in enumerate(picks):
        m = len(docs[i].token_ids)
        assert mask[row].sum() == m and mask[row, :m].all()
        np.testing.assert_array_equal(vec[row, :m], docs[i].vectors)
        assert not vec[row, m:].any() and not ids[row, m:].any()
    with pytest.raises(ValueError, match="tokens >"):
        store.gather_padded(picks, 2)


def _check_concatenated(store, docs, picks) -> int:
    """``concatenated`` gives the picked documents' rows in order, cast into ``out``."""
    t = sum(len(docs[i].token_ids) for i in picks)
    vectors = store.concatenated("vectors", picks, np.empty((t, DIM), np.float32))
    np.testing.assert_array_equal(
        vectors, np.concatenate([docs[i].vectors for i in picks]).astype(np.float32)
    )
    salience = store.concatenated("salience", picks, np.empty(t, np.float32))
    np.testing.assert_allclose(
        salience, np.concatenate([docs[i].salience.astype(np.float16) for i in picks])
    )
    return t


def test_concatenated_rows_of_documents_span_shards_and_cast_into_out(tmp_path, docs):
    store = write_store(tmp_path / "idx", docs, DIM, shard_size=4)
    picks = np.array([22, 3, 4, 9, 4])  # any order, across shards, repeated
    t = _check_concatenated(store, docs, picks)
    with pytest.raises(ValueError, match=f"hold {t} rows, out has {t + 1}"):
        store.concatenated("vectors", picks, np.empty((t + 1, DIM), np.float32))


def test_consecutive_documents_are_copied_as_one_run(tmp_path, docs):
    """Documents adjacent in the shard and in the output are one copy (an exhaustive search
    reads every document in order); a repeat, a gap or another order starts a new run."""
    lo, hi, to = (
        np.array([0, 5, 9, 9, 20]),
        np.array([5, 9, 12, 12, 21]),
        np.array([0, 5, 9, 12, 15]),
    )
    assert ts.merged_runs(lo, hi, to) == [(0, 12, 0), (9, 12, 12), (20, 21, 15)]
    assert ts.merged_runs(lo[:0], hi[:0], to[:0]) == []
    store = write_store(tmp_path / "idx", docs, DIM, shard_size=4)
    _check_concatenated(store, docs, np.array([22, 3, 4, 5, 6, 9, 4, 5, 7, 8]))
    _check_concatenated(store, docs, np.arange(len(docs)))


def test_concatenated_reads_past_a_full_map_cache_without_evicting_it(tmp_path, docs):
    """With more shards than the cache holds, the unmapped shards' rows are read from their
    files (the same values) and the maps already open stay open: no map churn per document."""
    store = write_store(tmp_path / "idx", docs, DIM, shard_size=4)  # 6 shards
    store.MAX_OPEN_ARRAYS = 2
    store.document(4)  # maps shard 1: two of its three arrays stay in the cache
    held = dict(store._open)
    assert len(held) == 2
    for _ in range(2):  # the second read uses the parsed headers
        _check_concatenated(store, docs, np.array([22, 3, 4, 9, 4, 17, 0, 1, 2]))
        assert set(store._open) == set(held)  # reads reorder the LRU, never evict
        assert all(store._open[k] is v for k, v in held.items())


def test_truncated_shard_is_refused_naming_the_file(tmp_path, docs):
    write_store(tmp_path / "idx", docs, DIM, shard_size=10)
    victim = tmp_path / "idx" / "shard-00001.vectors.npy"
    data = victim.read_bytes()
    victim.write_bytes(data[:-64])
    with pytest.raises(errors.IndexIntegrityError, match=r"shard-00001\.vectors\.npy.*truncated"):
        ts.TokenStore(tmp_path / "idx")


@pytest.mark.parametrize("victim", ["shard-00002.token_ids.npy", "shard-00001.vectors.npy"])
def test_altered_shard_is_refused_by_default(tmp_path, docs, victim):
    """Same size, other bytes: refused without --verify_checksums, also after a verified open."""
    write_store(tmp_path / "idx", docs, DIM, shard_size=10)  # opened once: verified, recorded
    path = tmp_path / "idx" / victim
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(errors.IndexIntegrityError, match=rf"{victim}: sha256 does not match"):
        ts.TokenStore(tmp_path / "idx")


def test_checksums_computed_on_first_open_then_only_when_files_change(tmp_path, docs):
    write_store(tmp_path / "idx", docs, DIM, shard_size=10)
    (tmp_path / "idx" / ts.VERIFIED).unlink()
    assert ts.TokenStore(tmp_path / "idx").checksums_verified  # first open: hashed
    assert not ts.TokenStore(tmp_path / "idx").checksums_verified  # recorded: not again
    assert ts.TokenStore(tmp_path / "idx", verify_checksums=True).checksums_verified
    ids = tmp_path / "idx" / "shard-00000.doc_ids.json"
    os.utime(ids, ns=(0, 0))  # touched (same bytes): verified again, and passes
    assert ts.TokenStore(tmp_path / "idx").checksums_verified
    assert not ts.TokenStore(tmp_path / "idx").checksums_verified


def _spy_hashing(monkeypatch) -> list[str]:
    """The names of the files ``fileio.sha256_file`` hashes from now on."""
    hashed, real = [], fileio.sha256_file
    monkeypatch.setattr(
        fileio, "sha256_file", lambda path, *a, **kw: hashed.append(Path(path).name) or real(path)
    )
    return hashed


def test_the_writing_job_records_the_verification_so_the_first_open_does_not_hash(
    tmp_path, docs, monkeypatch
):
    """The job that wrote and hashed the files writes .verified.json with the manifest: the
    first open (store and search index) hashes only the small manifests; a file altered after
    that is still refused."""
    directory = tmp_path / "idx"
    directory.mkdir()
    entries = [
        ts.write_shard(directory, s, docs[i : i + 10], DIM) for s, i in enumerate((0, 10, 20))
    ]
    model = {"name": "test", "fingerprint": "m", "dim": DIM, "projection": "dense"}
    counts = {"num_docs": 23, "num_tokens": sum(e["num_tokens"] for e in entries), "num_shards": 3}
    ts.write_manifest(directory, {"model": model, "counts": counts, "shards": entries})
    hashed = _spy_hashing(monkeypatch)
    store = ts.TokenStore(directory)  # the first open
    assert not store.checksums_verified and set(hashed) <= {ts.MANIFEST}
    ci.CentroidIndex.build(store, ci.CentroidIndexConfig(num_centroids=8))
    hashed.clear()
    ci.CentroidIndex.load(ts.TokenStore(directory))
    assert all(n == ts.MANIFEST or n.startswith(f"{ci.SUBDIR}-") for n in hashed)
    time.sleep(0.05)  # altered later than the build, as anything after the job would be
    victims = ("shard-00001.vectors.npy", f"{ci.SUBDIR}/segment-00001.codes.npy")
    for victim in (directory / v for v in victims):
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))
        with pytest.raises(errors.IndexIntegrityError, match=rf"{victim.name}: sha256 does not"):
            ci.CentroidIndex.load(ts.TokenStore(directory))
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))  # intact again (verified once more, then recorded)
    ci.CentroidIndex.load(ts.TokenStore(directory))


def test_invalid_json_names_the_file(tmp_path, docs):
    write_store(tmp_path / "idx", docs, DIM, shard_size=10)
    ids = tmp_path / "idx" / "shard-00001.doc_ids.json"
    ids.write_text(ids.read_text().replace(",", " ", 1))
    (tmp_path / "idx" / ts.VERIFIED).unlink()
    with pytest.raises(
        errors.IndexIntegrityError, match=r"shard-00001\.doc_ids\.json: (sha256|not)"
    ):
        ts.TokenStore(tmp_path / "idx")
    with pytest.raises(
        errors.IndexIntegrityError, match=r"shard-00001\.doc_ids\.json: not valid JSON \(Expecting"
    ):
        ts.read_json(ids)
    manifest = tmp_path / "idx" / ts.MANIFEST
    manifest.write_text(manifest.read_text()[:-20])
    with pytest.raises(errors.IndexIntegrityError, match=r"manifest\.json: not valid JSON"):
        ts.TokenStore(tmp_path / "idx")


def test_shard_removed_from_the_manifest_is_refused(tmp_path, docs):
    write_store(tmp_path / "idx", docs, DIM, shard_size=10)
    path = tmp_path / "idx" / ts.MANIFEST
    manifest = json.loads(path.read_text())
    gone = manifest["shards"].pop(1)
    manifest["counts"]["num_docs"] -= gone["num_docs"]
    manifest["counts"]["num_tokens"] -= gone["num_tokens"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(errors.IndexIntegrityError, match=r"lists shards \[0, 2\], expected 0\.\.2"):
        ts.TokenStore(tmp_path / "idx")


def test_missing_manifest_and_model_mismatch(tmp_path, docs):
    with pytest.raises(errors.IndexIntegrityError, match="manifest.json does not exist"):
        ts.TokenStore(tmp_path / "nothing")
    store = write_store(tmp_path / "idx", docs, DIM, fingerprint="model-A")
    with pytest.raises(errors.IndexIntegrityError, match="fingerprint='model-B'"):
        ts.check_model_matches(
            store.manifest, {"fingerprint": "model-B", "name": "B"}, tmp_path / "idx"
        )
    manifest = json.loads((tmp_path / "idx" / ts.MANIFEST).read_text())
    manifest["counts"]["num_docs"] += 1
    (tmp_path / "idx" / ts.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(errors.IndexIntegrityError, match="counts"):
        ts.TokenStore(tmp_path / "idx")


def test_shard_marker_is_the_commit_point(tmp_path, docs):
    entry = ts.write_shard(tmp_path, 0, docs[:3], DIM, stats={"truncated_docs": 1})
    assert ts.read_shard_marker(tmp_path, 0) == entry
    assert entry["stats"] == {"truncated_docs": 1}
    assert ts.read_shard_marker(tmp_path, 1) is None
    # A shard file that changed size after its marker makes the shard incomplete again.
    (tmp_path / "shard-00000.salience.npy").write_bytes(b"x")
    assert ts.read_shard_marker(tmp_path, 0) is None
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temporaries


def test_prune_rows_keeps_top_beta_by_salience(tmp_path, docs):
    store = write_store(tmp_path / "idx", docs, DIM)
    rows = ti.prune_rows(store, 0.25)
    for i in range(store.num_docs):
        lo, hi = store.offsets[i], store.offsets[i + 1]
        kept = rows[(rows >= lo) & (rows < hi)] - lo
        m = hi - lo
        assert len(kept) == max(1, int(np.ceil(0.25 * m)))
        sal = store.salience(lo, hi).astype(np.float32)
        assert sal[kept].min() >= np.sort(sal)[::-1][len(kept) - 1]
    assert len(ti.prune_rows(store, 1.0)) == store.num_tokens
    with pytest.raises(ValueError, match="beta_d"):
        ti.prune_rows(store, 0.0)
