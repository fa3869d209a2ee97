"""The search API and binaries on a real (bundled MiniLM) index of the toy collection:
aligner-index → Searcher.load / aligner-search, persistence, add/delete, one code path with
aligner-eval."""

from __future__ import annotations

import json
from pathlib import Path

import gin
import numpy as np
import pytest
from fixtures import TOY_DOCS, TOY_QRELS, TOY_QUERIES, write_beir_fixture

from aligner_jax.common import cli, errors, fileio
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import Encoder, EncodingConfig
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import indexer
from aligner_jax.indexing import token_store as ts
from aligner_jax.retrieval import searcher as search_lib

FIRST = {k: v for k, v in TOY_DOCS.items() if k not in ("d9", "d10", "d11")}
LATER = {k: TOY_DOCS[k] for k in ("d9", "d10", "d11")}
MODEL = "--gin_file=models/minilm_identity.gin"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    return {
        "all": write_beir_fixture(root, TOY_DOCS, TOY_QUERIES, TOY_QRELS, name="all"),
        "first": write_beir_fixture(root, FIRST, TOY_QUERIES, {}, name="first"),
        "later": write_beir_fixture(root, LATER, TOY_QUERIES, {}, name="later"),
        "root": root,
    }


@pytest.fixture(scope="module")
def built(folders):
    """aligner-index on the whole toy corpus (store + search index + encoder.json)."""
    from fixtures import run_module

    index_dir = folders["root"] / "index_all"
    r = run_module(
        "aligner_jax.index",
        MODEL,
        f"--corpus={folders['all'] / 'corpus.jsonl'}",
        f"--index_dir={index_dir}",
        "--gin.IndexingConfig.shard_size=5",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return index_dir


def test_index_writes_a_self_describing_search_index(built):
    assert (built / indexer.ENCODER_FILE).exists()
    meta = json.loads(ci.published_meta(built).read_text())
    shards = [name for segment in meta["segments"] for name in segment["shards"]]
    assert shards == ["shard-00000", "shard-00001", "shard-00002"]
    assert meta["store_fingerprint"] == ts.read_manifest(built)["model"]["fingerprint"]
    for name, entry in meta["files"].items():
        assert (built / ci.SUBDIR / f"{name}.npy").stat().st_size == entry["bytes"]


def test_search_binary_prints_the_ranking_and_no_log_for_one_query(built):
    """``aligner-search --query``: the ranking on stdout, stderr free of the load's INFO lines
    and of a second copy of the truncation note."""
    from fixtures import run_module

    r = run_module("aligner_jax.search", f"--index_dir={built}", "--query=honey bees in the hive")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "query: honey bees in the hive" and lines[1].split()[:1] == ["1"]
    assert not [line for line in r.stderr.splitlines() if line[:1] in "IW" and line[1:5].isdigit()]


def test_free_text_search_ranks_the_relevant_document_first(built):
    searcher = search_lib.Searcher.load(str(built))
    ranked = searcher.search("honey bees in the hive", k=3)
    assert [d for d, _ in ranked][:1] == ["d1"] and len(ranked) == 3
    assert all(a[1] >= b[1] for a, b in zip(ranked, ranked[1:], strict=False))
    batch = searcher.search_batch(["honey bees in the hive", "Sicilian defence chess"], k=2)
    assert [d for d, _ in batch[0]] == [d for d, _ in ranked[:2]] and batch[1][0][0] == "d2"
    # encoded in another batch (other padding): the same scores up to float rounding
    np.testing.assert_allclose([s for _, s in batch[0]], [s for _, s in ranked[:2]], atol=1e-5)
    exhaustive = search_lib.Searcher.load(str(built), mode="exhaustive")
    ceiling = exhaustive.search("honey bees in the hive", k=3)
    assert [d for d, _ in ceiling] == [d for d, _ in ranked]
    np.testing.assert_allclose([s for _, s in ceiling], [s for _, s in ranked], atol=0.03)
    with pytest.raises(errors.ConfigError, match="k=0"):
        searcher.search("bees", k=0)


def test_loaded_index_gives_what_the_building_process_gave(built, tmp_path):
    """Persistence: a rebuilt-in-process index (same seed) and the loaded one rank identically."""
    store = ts.TokenStore(built)
    loaded = search_lib.Searcher.load(str(built))
    fresh_index = ci.CentroidIndex.build(store)  # rewrites the same files, same seed
    fresh = search_lib.Searcher(
        store,
        search_lib.SearchConfig(backend="centroid"),
        centroid_index=fresh_index,
        encoder=loaded.encoder,
    )
    for text in TOY_QUERIES.values():
        assert fresh.search(text, k=12) == loaded.search(text, k=12)


def test_another_model_is_refused(built):
    cli.parse_gin(["models/minilm.gin"], ["AlignerConfig.projection = 'dense'"])
    other = Encoder(loading.load_encoder(), EncodingConfig())
    gin.clear_config()
    with pytest.raises(errors.IndexIntegrityError, match="fingerprint"):
        search_lib.Searcher.load(str(built), encoder=other)


def test_eval_and_search_share_one_code_path(built, folders, run_binary, tmp_path):
    out = tmp_path / "eval"
    r = run_binary(
        "evaluate",
        "--gin_file=eval/zero_shot.gin",
        f"--dataset_dir={folders['all']}",
        f"--output_dir={out}",
        f"--index_dir={built}",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["timing"]["index_build_s"] == 0.0  # loaded, not rebuilt
    run = {}
    for line in (out / "run.trec").read_text().splitlines():
        qid, _, doc, rank, score, _ = line.split()
        run.setdefault(qid, []).append((doc, float(score)))
    searcher = search_lib.Searcher.load(str(built))
    for qid, text in TOY_QUERIES.items():
        mine = searcher.search(text, k=5)
        assert [d for d, _ in mine] == [d for d, _ in run[qid][:5]]
        np.testing.assert_allclose([s for _, s in mine], [s for _, s in run[qid][:5]], atol=1e-5)


def test_search_binary_prints_titles_and_writes_a_trec_run(built, folders, run_binary, tmp_path):
    r = run_binary("search", f"--index_dir={built}", "--query=black hole gravity", "--k=2")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "query: black hole gravity"
    assert "d4" in lines[1] and "Black holes" in lines[1] and len(lines) == 3
    run_file = tmp_path / "run.trec"
    r = run_binary(
        "search",
        f"--index_dir={built}",
        f"--queries={folders['all'] / 'queries.jsonl'}",
        f"--output={run_file}",
        "--k=4",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split() for line in run_file.read_text().splitlines()]
    assert len(rows) == 4 * len(TOY_QUERIES) and rows[0][1] == "Q0" and rows[0][3] == "1"
    assert f"wrote {run_file}" in r.stdout
    r = run_binary("search", f"--index_dir={built}", "--queries=x.jsonl")
    assert r.returncode != 0
    assert (
        r.stderr.strip().splitlines()[-1].endswith("--queries needs --output=RUN_FILE (a TREC run)")
    )
    assert "Traceback" not in r.stderr


def _load_counting_hashes(monkeypatch, index_dir, **overrides):
    """``Searcher.load`` and the index files (not the two small manifests) it hashed."""
    hashed, real = [], fileio.sha256_file
    monkeypatch.setattr(
        fileio, "sha256_file", lambda path, *a, **kw: hashed.append(Path(path).name) or real(path)
    )
    searcher = search_lib.Searcher.load(str(index_dir), **overrides)
    monkeypatch.setattr(fileio, "sha256_file", real)
    small = [n for n in hashed if n == ts.MANIFEST or n.startswith(f"{ci.SUBDIR}-")]
    return searcher, [n for n in hashed if n not in small]


def test_first_load_after_aligner_index_does_not_hash_and_still_refuses_altered_files(
    folders, run_binary, tmp_path, monkeypatch
):
    """aligner-index records the checksums it computed from the bytes it wrote: the first
    Searcher.load hashes no index file; a file altered after the job is still refused."""
    index_dir = tmp_path / "index"
    r = run_binary(
        "index", MODEL, f"--corpus={folders['later'] / 'corpus.jsonl'}", f"--index_dir={index_dir}"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    searcher, hashed = _load_counting_hashes(monkeypatch, index_dir)
    assert hashed == []
    assert searcher.search("beekeeper smoke veil", k=1)[0][0] == "d10"
    for victim in ("shard-00000.vectors.npy", f"{ci.SUBDIR}/segment-00001.residuals.npy"):
        path = index_dir / victim
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        with pytest.raises(errors.IndexIntegrityError, match=r"sha256 does not match"):
            search_lib.Searcher.load(str(index_dir))
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))


def test_add_then_delete_equals_a_rebuild_in_exhaustive_mode(
    built, folders, run_binary, monkeypatch
):
    index_dir = folders["root"] / "index_grown"
    r = run_binary(
        "index",
        MODEL,
        f"--corpus={folders['first'] / 'corpus.jsonl'}",
        f"--index_dir={index_dir}",
        "--gin.IndexingConfig.shard_size=5",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_binary(
        "index", f"--index_dir={index_dir}", f"--add={folders['later'] / 'corpus.jsonl'}"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = ts.read_manifest(index_dir)
    assert [u["op"] for u in manifest["updates"]] == ["add"]
    assert manifest["counts"]["num_docs"] == len(TOY_DOCS)
    meta = json.loads(ci.published_meta(index_dir).read_text())
    assert meta["updates"][-1]["op"] == "add" and "drift" in meta["updates"][-1]
    fast, hashed = _load_counting_hashes(monkeypatch, index_dir)
    assert hashed == []  # --add recorded its checksums too: the first load hashes no index file
    grown = search_lib.Searcher.load(str(index_dir), mode="exhaustive")
    rebuilt = search_lib.Searcher.load(str(built), mode="exhaustive")
    for text in TOY_QUERIES.values():
        a, b = grown.search(text, k=12), rebuilt.search(text, k=12)
        assert [d for d, _ in a] == [d for d, _ in b]
        np.testing.assert_allclose([s for _, s in a], [s for _, s in b], atol=1e-5)
    assert fast.search("beekeeper smoke veil", k=1)[0][0] == "d10"  # added shards, fast mode
    r = run_binary("index", f"--index_dir={index_dir}", "--delete=d10,d1")
    assert r.returncode == 0, r.stderr[-2000:]
    for mode in ("fast", "exhaustive"):
        searcher, hashed = _load_counting_hashes(monkeypatch, index_dir, mode=mode)
        assert hashed == []  # so did --delete
        ranked = searcher.search("honey bees hive", k=12)
        assert {"d1", "d10"}.isdisjoint(d for d, _ in ranked)
        # exhaustive ranks every live document; fast mode only the candidates its probes reach
        assert len(ranked) == 10 if mode == "exhaustive" else 1 <= len(ranked) <= 10
    r = run_binary("index", f"--index_dir={index_dir}", "--delete=nope")
    assert r.returncode != 0 and "not in" in r.stderr.splitlines()[-1]
    assert "Traceback" not in r.stderr


def test_vacuum_from_the_command_line_and_the_build_run_again_after_it(
    built, folders, run_binary, tmp_path
):
    """``--delete=ID --vacuum``: the store without the documents, searchable; the command that
    built the index, run again, keeps the vacuumed store and encodes nothing (without the
    guard, it encoded the corpus again into the shards the vacuum had replaced)."""
    import shutil

    index_dir = Path(shutil.copytree(built, tmp_path / "vacuumed"))
    r = run_binary("index", f"--index_dir={index_dir}", "--delete=d1,d4", "--vacuum")
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["deleted_docs"] == 2 and summary["removed_docs"] == 2
    assert (summary["shards_before"], summary["shards_after"]) == (3, 2)  # 12 - 2 docs, by 5
    manifest = (index_dir / ts.MANIFEST).read_bytes()
    assert sorted(p.name for p in index_dir.glob("shard-?????.json")) == [
        "shard-00003.json",
        "shard-00004.json",
    ]
    searcher = search_lib.Searcher.load(str(index_dir))
    hits = searcher.search(TOY_QUERIES["q1"], k=3)
    assert hits[0].doc_id == "d10" and hits[0].title == "Beekeeping"  # d1 is gone
    r = run_binary(
        "index",
        MODEL,
        f"--corpus={folders['all'] / 'corpus.jsonl'}",
        f"--index_dir={index_dir}",
        "--gin.IndexingConfig.shard_size=5",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["shards_written"] == 0
    assert (index_dir / ts.MANIFEST).read_bytes() == manifest
    assert not (index_dir / "shard-00000.json").exists()
    r = run_binary("index", f"--index_dir={index_dir}", "--vacuum", "--compact")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--vacuum rewrites the store" in r.stderr.strip().splitlines()[-1]


def test_a_committed_replacement_run_again_is_refused_as_done(built, tmp_path):
    """--delete X --add=FILE re-run after it committed (a kill at the commit leaves the user
    unsure) deleted the new X and added it again: re-encoded, one more tombstone each time."""
    import shutil

    from aligner_jax.indexing import updates

    index_dir = Path(shutil.copytree(built, tmp_path / "replace"))
    new = tmp_path / "d1.jsonl"
    new.write_text(json.dumps({"_id": "d1", "title": "Bees", "text": "bees again"}) + "\n")
    updates.update_index(str(index_dir), delete="d1", add=str(new))
    before = (index_dir / ts.MANIFEST).read_bytes()
    with pytest.raises(errors.ConfigError, match=r"this replacement was committed already"):
        updates.update_index(str(index_dir), delete="d1", add=str(new))
    assert (index_dir / ts.MANIFEST).read_bytes() == before
    new.write_text(json.dumps({"_id": "d1", "title": "Bees", "text": "bees, third"}) + "\n")
    summary = updates.update_index(str(index_dir), delete="d1", add=str(new))  # new bytes: applied
    assert summary["deleted_docs"] == 1 and summary["added_docs"] == 1
    assert int(ts.TokenStore(index_dir).deleted.sum()) == 2
    # With --vacuum, the last update is the vacuum: the replacement before it is still known.
    new.write_text(json.dumps({"_id": "d1", "title": "Bees", "text": "bees, fourth"}) + "\n")
    updates.update_index(str(index_dir), delete="d1", add=str(new), vacuum_store=True)
    before = (index_dir / ts.MANIFEST).read_bytes()
    with pytest.raises(errors.ConfigError, match=r"this replacement was committed already"):
        updates.update_index(str(index_dir), delete="d1", add=str(new), vacuum_store=True)
    assert (index_dir / ts.MANIFEST).read_bytes() == before


def test_a_searcher_keeps_its_generation_until_refreshed(built, tmp_path):
    """A searcher opened before another writer commits a delete and a re-add keeps answering
    from the generation it opened; ``refresh()`` moves to the committed one, where the deleted
    document is gone and the same id, added again, is back as a new document."""
    import shutil

    from aligner_jax.indexing import updates

    index_dir = Path(shutil.copytree(built, tmp_path / "gen"))
    old = search_lib.Searcher.load(str(index_dir))
    query = TOY_QUERIES[next(iter(TOY_QUERIES))]
    before = old.search(query, k=12)
    top = before[0][0]
    updates.update_index(str(index_dir), delete=top)
    assert old.search(query, k=12) == before  # the old generation, though its files were removed
    assert old.refresh() is not old
    fresh = old.refresh()
    assert fresh.generation == old.generation + 1
    assert top not in [hit[0] for hit in fresh.search(query, k=12)]
    assert fresh.refresh() is fresh  # nothing committed since
    again = tmp_path / "again.jsonl"
    again.write_text(json.dumps({"_id": top, "title": "", "text": TOY_DOCS[top]["text"]}) + "\n")
    updates.update_index(str(index_dir), add=str(again))  # a deleted id may come back
    store = ts.TokenStore(index_dir)
    assert store.doc_ids.count(top) == 2 and int(store.deleted.sum()) == 1
    assert top in [hit[0] for hit in fresh.refresh().search(query, k=12)]
