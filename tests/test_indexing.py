"""The indexing job: streaming shards, exact resume after SIGKILL, many processes, bad input."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from fixtures import run_python, start_python, write_beir_fixture
from index_utils import random_documents, write_store

from aligner_jax.common import fileio
from aligner_jax.common.errors import ConfigError
from aligner_jax.indexing import ann as ti
from aligner_jax.indexing import token_store as ts

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega rho tau phi".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(1)
    docs = {
        f"d{i}": {"title": f"doc {i}", "text": " ".join(rng.choices(WORDS, k=rng.randint(3, 60)))}
        for i in range(60)
    }
    docs["d7"] = {"title": "", "text": ""}  # an empty document is kept and counted
    docs["d8"] = {"title": "long", "text": " ".join(["omega"] * 400)}  # truncated
    queries = {"q0": "alpha beta"}
    folder = write_beir_fixture(tmp_path_factory.mktemp("c"), docs, queries, {"q0": {"d0": 1}})
    return folder / "corpus.jsonl"


def _index_cmd(corpus, index_dir, *extra):
    """The arguments of ``python`` that run aligner-index (for `run_python`, `start_python`)."""
    return [
        "-m",
        "aligner_jax.index",
        "--gin_file=models/bert_tiny.gin",
        "--gin_file=index/default.gin",
        "--gin.IndexingConfig.shard_size=6",
        f"--corpus={corpus}",
        f"--index_dir={index_dir}",
        *extra,
    ]


def _checksums(index_dir: Path) -> dict[str, str]:
    manifest = json.loads((index_dir / ts.MANIFEST).read_text())
    return {
        meta["path"]: meta["sha256"] for s in manifest["shards"] for meta in s["files"].values()
    }


def test_killed_indexing_resumes_to_identical_bytes(corpus, tmp_path):
    reference = run_python(*_index_cmd(corpus, tmp_path / "ref"))
    assert reference.returncode == 0, reference.stderr[-2000:]
    summary = json.loads(reference.stdout.strip().splitlines()[-1])
    assert summary["complete"] and summary["num_docs"] == 60 and summary["num_shards"] == 10
    assert summary["empty_docs"] == 1 and summary["truncated_docs"] >= 1
    store = ts.TokenStore(tmp_path / "ref", verify_checksums=True)
    assert store.num_docs == 60 and store.doc_ids[:3] == ["d0", "d1", "d2"]

    target = tmp_path / "killed"
    rng = random.Random(os.getpid())
    for _ in range(2):  # killed twice at random points, then run to the end
        proc = start_python(*_index_cmd(corpus, target))
        wanted = len(list(target.glob("shard-?????.json"))) + rng.randint(1, 3)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if len(list(target.glob("shard-?????.json"))) >= wanted:
                time.sleep(rng.uniform(0.0, 0.3))  # maybe in the middle of the next shard
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.02)
        proc.wait(timeout=60)
        if (target / ts.MANIFEST).exists():  # killed after the store's commit (its search
            # index being built) or not at all: the store it published is whole
            assert ts.TokenStore(target, verify_checksums=True).num_docs == 60
    finished = run_python(*_index_cmd(corpus, target))
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert _checksums(target) == _checksums(tmp_path / "ref")
    assert not list(target.glob(".*.tmp"))  # temporary files of killed writes are cleaned up
    resumed = json.loads(finished.stdout.strip().splitlines()[-1])
    assert summary["tokens_encoded"] == summary["num_tokens"] == store.num_tokens
    # the rate counts this run's tokens, not the skipped shards' (resumed runs write the tail)
    shards = ts.TokenStore(target).manifest["shards"]
    written = shards[len(shards) - resumed["shards_written"] :]
    assert resumed["tokens_encoded"] == sum(s["num_tokens"] for s in written)


def test_two_processes_split_the_shards(corpus, tmp_path):
    first = run_python(
        *_index_cmd(corpus, tmp_path / "mp", "--process_index=0", "--process_count=2")
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert "INCOMPLETE" in first.stdout and not (tmp_path / "mp" / ts.MANIFEST).exists()
    assert sorted(p.name for p in (tmp_path / "mp").glob("shard-?????.json")) == [
        f"shard-{i:05d}.json" for i in range(0, 10, 2)
    ]
    second = run_python(
        *_index_cmd(corpus, tmp_path / "mp", "--process_index=1", "--process_count=2")
    )
    assert second.returncode == 0, second.stderr[-2000:]
    store = ts.TokenStore(tmp_path / "mp", verify_checksums=True)
    assert store.num_docs == 60 and store.manifest["counts"]["num_shards"] == 10
    # Each process's summary says whose counts it gives: the last one, complete, the index's
    # tokens (it printed its own shards' beside the whole corpus's documents).
    own = sum(s["num_tokens"] for s in store.manifest["shards"] if s["index"] % 2 == 0)
    assert (
        f"documents 60, tokens {own} (this process's), shards 10 (process 1 of 2: 5 written"
        in first.stdout
    )
    assert (
        f"complete\ndocuments 60, tokens {store.num_tokens}, shards 10 (process 2 of 2: 5"
        in second.stdout
    )


def test_bad_corpus_and_flags_name_the_problem(tmp_path):
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"_id": "a", "text": "fine"}\n{"_id": "a", "text": "again"}\n')
    proc = run_python(*_index_cmd(bad, tmp_path / "i"))
    assert proc.returncode != 0
    assert f"{bad}:2" in proc.stderr and "duplicate" in proc.stderr
    bad.write_text('{"_id": "a", "text": "fine"}\n{"_id": "b", "text": "again"}\n')
    proc = run_python(*_index_cmd(bad, tmp_path / "i"))  # the fixed file, the same folder
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ts.TokenStore(tmp_path / "i").doc_ids == ["a", "b"]
    proc = run_python(*_index_cmd(tmp_path / "missing.jsonl", tmp_path / "i2"))
    assert proc.returncode != 0 and "--corpus=" in proc.stderr
    proc = run_python(*_index_cmd(bad, tmp_path / "i3", "--process_index=2", "--process_count=2"))
    assert proc.returncode != 0 and "--process_index=2" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    index_dir = tmp_path / "i4"
    proc = run_python(
        "-m", "aligner_jax.index", f"--dataset_dir={empty}", f"--index_dir={index_dir}"
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.endswith(f"--dataset_dir={empty}: no corpus.jsonl in it")
    assert "Traceback" not in proc.stderr


def test_settings_change_in_the_same_index_dir_is_refused(corpus, tmp_path):
    assert run_python(*_index_cmd(corpus, tmp_path / "i")).returncode == 0
    proc = run_python(*_index_cmd(corpus, tmp_path / "i", "--gin.IndexingConfig.shard_size=7"))
    assert proc.returncode != 0 and "index_config.json" in proc.stderr


def test_scann_index_in_parts_matches_one_index(tmp_path):
    docs = random_documents(30, 16, seed=9, min_len=20, max_len=40)
    store = write_store(tmp_path / "s", docs, 16, shard_size=10)
    config = ti.ScannConfig(num_leaves=4, num_leaves_to_search=4, max_tokens_per_part=400)
    parts = ti.TokenIndex.build(store, "scann", scann_config=config, k_prime=20)
    assert parts.num_parts >= 2
    exact = ti.TokenIndex.build(store, "exact")
    q = np.stack([d.vectors[0].astype(np.float32) for d in docs[:5]])
    s_parts, _, r_parts = parts.search(q, 20)
    _, _, r_exact = exact.search(q, 20)
    assert np.all(np.diff(s_parts, axis=1) <= 1e-6)  # merged lists stay sorted
    recall = np.mean([len(set(a) & set(b)) / 20 for a, b in zip(r_parts, r_exact, strict=True)])
    assert recall > 0.9
    parts.save(tmp_path / "ti")
    loaded = ti.TokenIndex.load(store, tmp_path / "ti")
    np.testing.assert_array_equal(loaded.search(q, 20)[2], r_parts)


def test_scann_padding_is_no_token(tmp_path):
    """Where the searched leaves hold fewer tokens than k′, ScaNN pads its lists with index 0
    and a NaN score; they were taken as token 0 of the part (its document a candidate) with a
    NaN score, which made XTR's imputed m_i (the lowest score) 0."""
    docs = random_documents(30, 16, seed=9, min_len=20, max_len=40)
    store = write_store(tmp_path / "s", docs, 16, shard_size=10)
    config = ti.ScannConfig(num_leaves=8, num_leaves_to_search=1)
    index = ti.TokenIndex.build(store, "scann", scann_config=config, k_prime=400)
    q = np.stack([d.vectors[1].astype(np.float32) for d in docs[:5]])
    scores, doc_ids, rows = index.search(q, 400)
    found = rows >= 0
    assert not np.isnan(scores).any()
    assert 0 < found.sum(axis=1).max() < 400  # one leaf of eight: fewer than k′ found
    assert np.all(np.isfinite(scores) == found) and np.all((doc_ids >= 0) == found)
    assert np.all(np.diff(np.where(found, scores, -1e9), axis=1) <= 1e-6)
    for i in range(len(q)):  # each found token's score is its real dot product
        vectors = store.take("vectors", rows[i][found[i]]).astype(np.float32)
        np.testing.assert_allclose(scores[i][found[i]], vectors @ q[i], atol=2e-3)


@pytest.fixture(scope="module")
def tiny_encoder():
    import gin

    from aligner_jax.common import cli
    from aligner_jax.encoding import loading
    from aligner_jax.encoding.encoder import Encoder

    gin.clear_config()
    try:
        cli.parse_gin(["models/bert_tiny.gin"])
        return Encoder(loading.load_encoder())
    finally:
        gin.clear_config()


def test_a_job_whose_processes_do_not_share_the_index_dir_fails_in_one_line(
    corpus, tiny_encoder, tmp_path
):
    """Each process of one JAX job writing to its own disk ended with exit 0, 'INCOMPLETE' and
    no manifest anywhere: past the barrier after encoding, a missing shard means the storage
    is not shared (here process 0 of 2, whose partner's shards never appear)."""
    from aligner_jax.data import beir
    from aligner_jax.indexing import indexer

    class Alone:  # ProcessSplit's interface, without the other process
        rank, count, leader = 0, 2, True

        def barrier(self, name):
            pass

    docs = list(beir.iter_corpus(corpus))[:12]
    with pytest.raises(ConfigError, match=r"1 of 3 shards \(e\.g\. shard-00001\), which other "
                       r"processes of this job wrote, are not visible to process 0 .* must be "
                       r"storage every process shares"):  # fmt: skip
        indexer.build_token_store(
            docs, tiny_encoder, tmp_path / "idx", indexer.IndexingConfig(5), 0, 2, split=Alone()
        )
    assert not (tmp_path / "idx" / ts.MANIFEST).exists()
    assert ts.read_shard_marker(tmp_path / "idx", 0) is not None  # its own work is kept


def test_pruned_tokens_can_be_left_out_of_the_store(corpus, tiny_encoder, tmp_path):
    """IndexingConfig.store_beta_d keeps only each document's top tokens by salience on disk."""
    from aligner_jax.data import beir
    from aligner_jax.indexing import indexer

    docs = list(beir.iter_corpus(corpus))[:12]
    full, half = (
        indexer.build_token_store(
            docs,
            tiny_encoder,
            tmp_path / name,
            indexer.IndexingConfig(5, store_beta_d=beta, drop_zero_salience=False),
        )
        for name, beta in (("full", 1.0), ("half", 0.5))
    )
    assert full.complete and half.complete
    a, b = ts.TokenStore(tmp_path / "full"), ts.TokenStore(tmp_path / "half")
    np.testing.assert_array_equal(b.doc_lengths, np.ceil(0.5 * a.doc_lengths).astype(int))
    for i in range(len(docs)):
        va, sa, _ = a.document(i)
        vb, sb, _ = b.document(i)
        # The kept tokens are the most salient ones (up to ties at the threshold), in text order.
        kept = np.array([np.flatnonzero((va == row).all(axis=1))[0] for row in vb])
        assert np.all(np.diff(kept) > 0)
        threshold = np.sort(sa.astype(np.float32))[::-1][len(sb) - 1]
        assert np.all(sa[kept].astype(np.float32) >= threshold)
    assert b.nbytes() < 0.7 * a.nbytes()


def test_tokens_of_zero_salience_are_not_stored(corpus, tiny_encoder, tmp_path):
    """By default a document keeps exactly its tokens of salience above 0, in text order (its
    first token when it has none); the setting is recorded, and a store that predates it keeps
    storing every token on --add."""
    from aligner_jax.core import pruning
    from aligner_jax.data import beir
    from aligner_jax.indexing import indexer, updates

    docs = list(beir.iter_corpus(corpus))[:12]
    indexer.build_token_store(docs, tiny_encoder, tmp_path / "default", indexer.IndexingConfig(5))
    indexer.build_token_store(
        docs, tiny_encoder, tmp_path / "all", indexer.IndexingConfig(5, drop_zero_salience=False)
    )
    default, every = ts.TokenStore(tmp_path / "default"), ts.TokenStore(tmp_path / "all")
    assert default.manifest["indexing"]["drop_zero_salience"] is True
    zero = np.asarray(every.salience()) == 0
    assert 0 < zero.mean() < 1  # the tiny model's LP gives some tokens no salience
    assert default.num_tokens == every.num_tokens - zero.sum()
    for i in range(len(docs)):
        va, sa, ia = every.document(i)
        vd, sd, idd = default.document(i)
        rows = np.flatnonzero(sa > 0) if (sa > 0).any() else np.array([0])
        np.testing.assert_array_equal(vd, va[rows])
        np.testing.assert_array_equal(idd, ia[rows])
        assert (sd > 0).all() or len(sd) == 1
    np.testing.assert_array_equal(pruning.salient(np.zeros(3, np.float32)), [0])
    assert len(pruning.salient(np.zeros(0, np.float32))) == 0

    # A store written before the setting existed records none: it keeps every token.
    manifest = json.loads((tmp_path / "all" / ts.MANIFEST).read_text())
    del manifest["indexing"]["drop_zero_salience"]
    (tmp_path / "all" / ts.MANIFEST).write_text(json.dumps(manifest))
    assert not indexer.IndexingConfig.recorded(manifest["indexing"]).drop_zero_salience
    more = [beir.Document(f"new-{d.doc_id}", d.title, d.text) for d in docs[:3]]
    updates.add_documents(str(tmp_path / "all"), more, tiny_encoder)
    grown = ts.TokenStore(tmp_path / "all")
    assert grown.num_tokens == every.num_tokens + every.doc_lengths[:3].sum()


def test_one_writer_per_index_directory(corpus, tmp_path):
    """A second aligner-index on a directory whose lock is held is refused naming the holder's
    pid; a lock file left by a dead process is taken over; process indexes lock separately."""
    index = tmp_path / "idx"
    index.mkdir()
    with fileio.exclusive_lock(index / ".lock-0", "test holder"):
        with fileio.exclusive_lock(index / ".lock-1", "another process index"):
            pass  # process 1 of a multi-process run is not blocked by process 0
        refused = run_python(*_index_cmd(corpus, index))
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1] == (
        f"aligner-index: error: index directory {index} (process 0): another process "
        f"(pid {os.getpid()}) is writing it and holds {index / '.lock-0'}; wait for it to "
        "finish, or use another folder"
    )
    assert not list(index.glob("shard-*"))
    (index / ".lock-0").write_text("999999\n")  # left by a killed run: no process holds it
    taken_over = run_python(*_index_cmd(corpus, index))
    assert taken_over.returncode == 0, taken_over.stderr[-2000:]
    assert (index / ts.MANIFEST).exists()
