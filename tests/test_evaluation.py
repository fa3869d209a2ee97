"""End to end on a tiny BEIR folder: bundled backbone → token store → search → metrics.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures import (
    TOY_DOCS,
    TOY_QRELS,
    TOY_QUERIES,
    parse_gin,
    run_module,
    trec_eval_run_file,
    write_beir_fixture,
    write_toy_beir,
)

from aligner_jax.common import errors, fileio
from aligner_jax.evaluation import beir_eval
from aligner_jax.indexing import indexer
from aligner_jax.indexing import token_store as ts

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture()
def toy(tmp_path):
    return write_toy_beir(tmp_path / "data")


def test_zero_shot_exhaustive_and_token_search(toy, tmp_path, capsys, caplog):
    parse_gin("eval/zero_shot.gin", "eval/exhaustive.gin")
    out = tmp_path / "exh"
    (out).mkdir()
    (out / "run.tsv").write_text("stale\n")  # an older version's run file does not linger
    report = beir_eval.evaluate(
        dataset_dir=str(toy), output_dir=str(out), index_dir=str(tmp_path / "index")
    )
    saved = json.loads((out / "metrics.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert saved["dataset"] == "toy" and saved["split"] == "test"
    assert saved["num_queries"] == 4 and saved["num_docs"] == 12
    assert saved["config"]["projection"] == "identity"
    assert saved["config"]["alignment"] == "top_k:1"
    assert saved["config"]["search"] == "exact" and saved["config"]["k_prime"] is None  # no k′
    assert saved["timing"]["includes_adaptation_scoring"] is False
    # β^q/β^d prune what generates candidates: not applied here, and recorded so (None)
    assert saved["config"]["beta_q"] is None and saved["config"]["beta_d"] is None
    for key in ("ndcg@10", "recall@100", "mrr@10"):
        assert 0.0 <= saved["metrics"][key] <= 1.0
    # The toy queries share distinctive words with their relevant documents.
    assert saved["metrics"]["ndcg@10"] > 0.9
    assert set(saved["per_query"]) == {"q0", "q1", "q2", "q3"}
    for key in ("encode_corpus_s", "index_build_s", "search_ms_per_query_p50"):
        assert saved["timing"][key] >= 0.0
    run = (out / "run.trec").read_text().splitlines()
    assert len(run) == 4 * 12 and run[0].split()[3] == "1"
    assert "AlignerConfig.projection = 'identity'" in (out / "config.gin").read_text()
    # metrics.json, written last, records the checksums of the files beside it.
    names = ("run.trec", "results.json", "config.gin")
    assert saved["files"] == {n: fileio.sha256_file(out / n) for n in names}
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == sorted([*names, "metrics.json"])
    # BEIR's results.json: the rankings of run.trec ({qid: {doc_id: score}}, best first, exact).
    trec = {}
    for line in run:
        qid, _, doc, _, score, _ = line.split()
        trec.setdefault(qid, []).append((doc, float(score)))
    results = json.loads((out / "results.json").read_text())
    assert {q: list(docs.items()) for q, docs in results.items()} == trec
    # The summary names the files it wrote.
    printed = capsys.readouterr().out
    assert f"wrote      metrics.json, run.trec, results.json, config.gin in {out}" in printed
    assert "search latency p50" in printed
    assert "search exact exhaustive  (no token pruning: every token of every candidate)" in printed

    # Second run: ScaNN token search on the same store (reused, not re-encoded).
    parse_gin("eval/zero_shot.gin", "eval/scann.gin", bindings=["SearchConfig.k_prime = 50"])
    report2 = beir_eval.evaluate(
        dataset_dir=str(toy), output_dir=str(tmp_path / "scann"), index_dir=str(tmp_path / "index")
    )
    assert report2["timing"]["index_reused"] is True
    assert report2["config"]["search"] == "scann" and report2["config"]["k_prime"] == 50
    assert (report2["config"]["beta_q"], report2["config"]["beta_d"]) == (1.0, 1.0)
    assert report2["config"]["indexing"]["store_beta_d"] == 1.0

    # An indexing setting bound for a reused store is not applied: said, and the store's recorded
    parse_gin(
        "eval/zero_shot.gin", "eval/exhaustive.gin", bindings=["IndexingConfig.store_beta_d = 0.5"]
    )
    with caplog.at_level("WARNING"):
        report3 = beir_eval.evaluate(
            dataset_dir=str(toy),
            output_dir=str(tmp_path / "again"),
            index_dir=str(tmp_path / "index"),
        )
    assert "not applied: {'store_beta_d': 0.5}" in caplog.text
    assert report3["config"]["indexing"]["store_beta_d"] == 1.0
    assert report3["metrics"] == saved["metrics"]
    assert "qrels " not in beir_eval.summary(report3)
    # judgments skipped by unknown_qrels='skip' are said in the summary, not only in the JSON
    qrels = toy / "qrels" / "test.tsv"
    qrels.write_text(qrels.read_text() + "q0\tghost\t1\n")
    try:
        report4 = beir_eval.evaluate(
            dataset_dir=str(toy), output_dir=str(tmp_path / "skip"),
            index_dir=str(tmp_path / "index"), unknown_qrels="skip",
        )  # fmt: skip
    finally:
        qrels.write_text(qrels.read_text().replace("q0\tghost\t1\n", ""))
    assert (
        "qrels      1 judgment line(s) skipped (unknown queries: 0, unknown documents: 1): the "
        "metrics do not count them"
    ) in beir_eval.summary(report4)
    assert report2["metrics"]["ndcg@10"] == pytest.approx(saved["metrics"]["ndcg@10"], abs=0.05)


def test_store_of_another_model_is_refused(toy, tmp_path):
    parse_gin("eval/zero_shot.gin", "eval/exhaustive.gin")
    beir_eval.evaluate(
        dataset_dir=str(toy), output_dir=str(tmp_path / "a"), index_dir=str(tmp_path / "index")
    )
    manifest = json.loads((tmp_path / "index" / ts.MANIFEST).read_text())
    assert manifest["model"]["projection"] == "identity"
    assert manifest["counts"]["num_docs"] == 12
    # Another model (here: the same backbone with a random 128-d projection) must not reuse it.
    parse_gin(
        "eval/zero_shot.gin",
        "eval/exhaustive.gin",
        bindings=["AlignerConfig.projection = 'dense'"],
    )
    with pytest.raises(errors.IndexIntegrityError, match="built with fingerprint"):
        beir_eval.evaluate(
            dataset_dir=str(toy), output_dir=str(tmp_path / "b"), index_dir=str(tmp_path / "index")
        )


def test_interrupted_store_is_completed_not_rebuilt(toy, tmp_path):
    """A store whose manifest is missing (killed job) is resumed shard by shard."""
    parse_gin(
        "eval/zero_shot.gin", "eval/exhaustive.gin", bindings=["IndexingConfig.shard_size = 5"]
    )
    index = tmp_path / "index"
    beir_eval.evaluate(dataset_dir=str(toy), output_dir=str(tmp_path / "a"), index_dir=str(index))
    checksums = {p.name: fileio.sha256_file(p) for p in sorted(index.glob("shard-*"))}
    (index / ts.MANIFEST).unlink()
    (index / "shard-00002.json").unlink()  # the last shard never committed
    assert not indexer.store_is_complete_for(index, {})
    beir_eval.evaluate(dataset_dir=str(toy), output_dir=str(tmp_path / "b"), index_dir=str(index))
    assert {p.name: fileio.sha256_file(p) for p in sorted(index.glob("shard-*"))} == checksums
    assert json.loads((index / ts.MANIFEST).read_text())["counts"]["num_shards"] == 3


def _run_binary(*args, cwd=REPO):
    return run_module("aligner_jax.evaluate", *args, cwd=cwd)


def test_binary_reports_bad_input_with_file_and_line(tmp_path):
    data = write_toy_beir(tmp_path / "data")
    corpus = data / "corpus.jsonl"
    lines = corpus.read_text().splitlines()
    lines[2] = '{"_id": "d2", "text": broken'
    corpus.write_text("\n".join(lines) + "\n")
    proc = _run_binary(
        "--gin_file=eval/zero_shot.gin", f"--dataset_dir={data}", f"--output_dir={tmp_path / 'o'}"
    )
    assert proc.returncode != 0
    assert "corpus.jsonl:3" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()  # nothing is created before the inputs are valid


def test_binary_flag_errors(tmp_path):
    proc = _run_binary(
        "--gin_file=eval/zero_shot.gin",
        f"--dataset_dir={tmp_path}",
        f"--output_dir={tmp_path / 'o'}",
    )
    assert proc.returncode != 0
    assert "corpus.jsonl" in proc.stderr  # says what a BEIR folder must hold
    data = write_toy_beir(tmp_path / "data")
    proc = _run_binary(
        "--gin_file=eval/zero_shot.gin",
        "--gin.SearchConfig.backend='faiss'",
        f"--dataset_dir={data}",
        f"--output_dir={tmp_path / 'o'}",
    )
    assert proc.returncode != 0
    assert "SearchConfig.backend='faiss'" in proc.stderr
    assert "Traceback (most recent call last)" not in proc.stderr


def test_run_file_and_metrics_apply_one_identical_id_rule(tmp_path):
    """A query id that is also a document id: the judged-relevant, unrelated document "q2" stays
    in q2's ranking; "q0", whose text is q0's text, is dropped from q0's ranking; metrics.json
    equals pytrec_eval on run.trec exactly."""
    docs = dict(TOY_DOCS)
    docs["q0"] = TOY_QUERIES["q0"].upper()  # the query itself (ArguAna/Quora style)
    docs["q2"] = {"title": "Pancreas", "text": "Beta cells of the pancreas secrete insulin."}
    qrels = {**TOY_QRELS, "q2": {"d7": 1, "q2": 1}}
    data = write_beir_fixture(tmp_path / "data", docs, TOY_QUERIES, qrels)
    parse_gin("eval/zero_shot.gin", "eval/exhaustive.gin")
    out = tmp_path / "out"
    report = beir_eval.evaluate(dataset_dir=str(data), output_dir=str(out))
    rows = [line.split() for line in (out / "run.trec").read_text().splitlines()]
    assert not [r for r in rows if r[0] == "q0" and r[2] == "q0"]
    assert [r for r in rows if r[0] == "q2" and r[2] == "q2"]
    assert report["config"]["ignore_identical_ids"] == "same_text"
    ids = report["identical_ids"]
    assert (ids["query_ids_in_corpus"], ids["dropped"], ids["kept_judged_relevant"]) == (2, 1, 1)
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["metrics_all"] == trec_eval_run_file(out / "run.trec", data / "qrels/test.tsv")

    # BEIR's rule, asked for explicitly: the judged-relevant "q2" leaves run.trec and metrics alike.
    parse_gin("eval/zero_shot.gin", "eval/exhaustive.gin")
    beir_eval.evaluate(
        dataset_dir=str(data),
        output_dir=str(tmp_path / "always"),
        index_dir=str(out / "index"),
        ignore_identical_ids="always",
    )
    run = (tmp_path / "always" / "run.trec").read_text()
    assert "q2 Q0 q2 " not in run
    saved = json.loads((tmp_path / "always" / "metrics.json").read_text())
    assert saved["identical_ids"]["dropped_judged_relevant"] == 1
    assert saved["metrics_all"] == trec_eval_run_file(
        tmp_path / "always" / "run.trec", data / "qrels/test.tsv"
    )


def test_store_missing_documents_of_the_corpus_is_refused(toy, tmp_path):
    """A shard removed from the manifest with its counts adjusted: the store is self-consistent
    but holds 10 of the corpus's 12 documents; evaluating it is refused."""
    parse_gin(
        "eval/zero_shot.gin", "eval/exhaustive.gin", bindings=["IndexingConfig.shard_size = 5"]
    )
    index = tmp_path / "index"
    beir_eval.evaluate(dataset_dir=str(toy), output_dir=str(tmp_path / "a"), index_dir=str(index))
    manifest = json.loads((index / ts.MANIFEST).read_text())
    gone = manifest["shards"].pop()
    manifest["counts"] = {
        "num_docs": manifest["counts"]["num_docs"] - gone["num_docs"],
        "num_tokens": manifest["counts"]["num_tokens"] - gone["num_tokens"],
        "num_shards": 2,
    }
    (index / ts.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(
        errors.IndexIntegrityError,
        match=r"the token store holds 10 documents, .*corpus\.jsonl has 12",
    ):
        beir_eval.evaluate(
            dataset_dir=str(toy), output_dir=str(tmp_path / "b"), index_dir=str(index)
        )
    assert not (tmp_path / "b" / "metrics.json").exists()


def test_an_index_with_deletions_is_scored_with_a_count_and_a_vacuumed_one_refused(toy, tmp_path):
    """Deleted documents are never retrieved: metrics.json counts them (docs_deleted). A
    vacuumed index (the deleted documents gone from the store) was refused as "10 documents vs
    12"; the message now names the updates."""
    from aligner_jax.indexing import updates  # noqa: PLC0415

    parse_gin(
        "eval/zero_shot.gin", "eval/exhaustive.gin", bindings=["IndexingConfig.shard_size = 5"]
    )
    index = tmp_path / "index"
    beir_eval.evaluate(dataset_dir=str(toy), output_dir=str(tmp_path / "a"), index_dir=str(index))
    updates.delete_documents(str(index), [ts.TokenStore(index).doc_ids[0]])
    beir_eval.evaluate(dataset_dir=str(toy), output_dir=str(tmp_path / "b"), index_dir=str(index))
    metrics = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert metrics["docs_deleted"] == 1
    updates.vacuum(str(index))
    with pytest.raises(
        errors.IndexIntegrityError,
        match=r"updated since it was built \(delete, vacuum: 2 update\(s\)\).*aligner-search",
    ):
        beir_eval.evaluate(
            dataset_dir=str(toy), output_dir=str(tmp_path / "c"), index_dir=str(index)
        )
    assert not (tmp_path / "c" / "metrics.json").exists()


def test_deleted_manifest_is_named_not_reported_as_other_settings(toy, tmp_path):
    """A store built with other indexing settings whose manifest was deleted."""
    parse_gin(
        "eval/zero_shot.gin", "eval/exhaustive.gin", bindings=["IndexingConfig.shard_size = 5"]
    )
    index = tmp_path / "index"
    beir_eval.evaluate(dataset_dir=str(toy), output_dir=str(tmp_path / "a"), index_dir=str(index))
    (index / ts.MANIFEST).unlink()
    parse_gin("eval/zero_shot.gin", "eval/exhaustive.gin")
    with pytest.raises(errors.IndexIntegrityError, match=r"manifest\.json is missing"):
        beir_eval.evaluate(
            dataset_dir=str(toy), output_dir=str(tmp_path / "b"), index_dir=str(index)
        )


def test_queries_are_encoded_whole_and_truncation_is_counted(tmp_path):
    """A 100-word query: cut at the training length (64) only when asked; counted either way."""
    queries = dict(TOY_QUERIES)
    queries["q0"] = " ".join(["why does a volcano erupt lava and magma"] * 13)
    data = write_beir_fixture(tmp_path / "data", TOY_DOCS, queries, TOY_QRELS)
    parse_gin("eval/zero_shot.gin", "eval/exhaustive.gin")
    whole = beir_eval.evaluate(dataset_dir=str(data), output_dir=str(tmp_path / "whole"))
    assert whole["truncation"] == {
        "query_maxlen": 512,  # the BERT backbone's maximum, not AlignerConfig.query_maxlen (64)
        "queries_truncated": 0,
        "doc_maxlen": 256,
        "docs_truncated": 0,
    }
    parse_gin("eval/zero_shot.gin", "eval/exhaustive.gin")
    cut = beir_eval.evaluate(
        dataset_dir=str(data),
        output_dir=str(tmp_path / "cut"),
        index_dir=str(tmp_path / "whole" / "index"),
        query_maxlen=64,
    )
    assert cut["truncation"]["queries_truncated"] == 1
    saved = json.loads((tmp_path / "cut" / "metrics.json").read_text())
    assert saved["truncation"]["query_maxlen"] == 64


def test_a_text_of_exactly_the_maximum_length_is_not_counted_as_cut(toy, tmp_path):
    """Truncation counts are exact: a query (document) of exactly ``query_maxlen``
    (``doc_maxlen``) tokens is whole; one token less as the budget and it is cut."""
    from aligner_jax.data import beir
    from aligner_jax.encoding import loading

    parse_gin("eval/zero_shot.gin")
    tokenizer = loading.load_encoder().tokenizer
    query_lengths = [len(tokenizer.encode(q, 512)) for q in TOY_QUERIES.values()]
    doc_lengths = [
        len(tokenizer.encode(beir.document_text(beir.Document(i, d["title"], d["text"])), 512))
        for i, d in TOY_DOCS.items()
    ]
    query_max, doc_max = max(query_lengths), max(doc_lengths)
    parse_gin(
        "eval/zero_shot.gin",
        "eval/exhaustive.gin",
        bindings=[f"AlignerConfig.doc_maxlen = {doc_max}"],
    )
    exact = beir_eval.evaluate(
        dataset_dir=str(toy), output_dir=str(tmp_path / "exact"), query_maxlen=query_max
    )
    assert exact["truncation"] == {
        "query_maxlen": query_max,
        "queries_truncated": 0,
        "doc_maxlen": doc_max,
        "docs_truncated": 0,
    }
    parse_gin(
        "eval/zero_shot.gin",
        "eval/exhaustive.gin",
        bindings=[f"AlignerConfig.doc_maxlen = {doc_max - 1}"],
    )
    cut = beir_eval.evaluate(
        dataset_dir=str(toy), output_dir=str(tmp_path / "cut"), query_maxlen=query_max - 1
    )
    assert cut["truncation"]["queries_truncated"] == query_lengths.count(query_max)
    assert cut["truncation"]["docs_truncated"] == doc_lengths.count(doc_max)


def test_search_index_is_built_under_the_index_directory_lock(tmp_path):
    """aligner-eval building a missing search index takes the directory's writer lock: refused
    while another process (here: another open of the lock) writes the directory."""
    from index_utils import random_documents, write_store

    from aligner_jax.indexing import centroid_index as ci

    store = write_store(tmp_path / "index", random_documents(30, 8), dim=8)
    with fileio.exclusive_lock(tmp_path / "index" / ".lock-0", "holder"):
        with pytest.raises(errors.LockedError, match=r"index directory .* \(process 0\)"):
            beir_eval.open_centroid_index(store, beta_d=1.0)
    assert not ci.CentroidIndex.exists(store.directory)
    index, _ = beir_eval.open_centroid_index(store, beta_d=1.0)
    assert ci.CentroidIndex.exists(store.directory) and index.meta["config"]["beta_d"] == 1.0


def test_another_beta_d_builds_an_index_for_the_run_and_leaves_the_published_one(tmp_path, caplog):
    """aligner-eval with a ``SearchConfig.beta_d`` other than the search index's builds one for
    itself with the index's recorded settings (here 8-bit residuals) and does not publish it.
    It used to replace the published index with a default-settings one (4 bits), which later
    searches and servers then loaded."""
    from index_utils import random_documents, write_store

    from aligner_jax.indexing import centroid_index as ci

    store = write_store(tmp_path / "index", random_documents(40, 8), dim=8)
    ci.CentroidIndex.build(store, ci.CentroidIndexConfig(residual_bits=8, num_centroids=4))
    store = ts.TokenStore(tmp_path / "index")
    published = store.manifest["search_index"]
    index, build_s = beir_eval.open_centroid_index(store, beta_d=0.5)
    assert build_s > 0
    assert index.meta["config"]["beta_d"] == 0.5 and index.meta["config"]["residual_bits"] == 8
    assert "does not save it" in caplog.text
    after = ts.TokenStore(tmp_path / "index")
    assert after.manifest["search_index"] == published
    loaded = ci.CentroidIndex.load(after)
    assert loaded.meta["config"]["beta_d"] == 1.0 and loaded.meta["config"]["residual_bits"] == 8
    again, seconds = beir_eval.open_centroid_index(after, beta_d=1.0)
    assert seconds == 0.0 and again.meta["config"]["residual_bits"] == 8


def test_an_index_with_added_documents_is_refused_in_one_line(toy, tmp_path):
    """After aligner-index --add, aligner-eval failed with "shard-00001 holds document 'x',
    which the corpus does not; give the corpus this index was built from", which the user had
    given (and no corpus passes both checks)."""
    from aligner_jax.indexing import updates

    parse_gin("eval/zero_shot.gin", "eval/exhaustive.gin")
    index_dir = tmp_path / "index"
    beir_eval.evaluate(
        dataset_dir=str(toy), output_dir=str(tmp_path / "a"), index_dir=str(index_dir)
    )
    more = tmp_path / "more.jsonl"
    more.write_text(json.dumps({"_id": "x1", "title": "", "text": "an added document"}) + "\n")
    updates.update_index(str(index_dir), add=str(more))
    with pytest.raises(errors.IndexIntegrityError, match=r"1 documents were added to it "
                       r"\(aligner-index --add\) since it was built from .*data/toy; "):  # fmt: skip
        beir_eval.evaluate(
            dataset_dir=str(toy), output_dir=str(tmp_path / "b"), index_dir=str(index_dir)
        )
    assert not (tmp_path / "b").exists()


def test_an_output_dir_that_is_the_index_dir_is_refused(toy, tmp_path):
    """metrics.json and run.trec were written into the store's folder."""
    parse_gin("eval/zero_shot.gin", "eval/exhaustive.gin")
    same = tmp_path / "both"
    with pytest.raises(errors.ConfigError, match=r"--output_dir=.*both is the --index_dir"):
        beir_eval.evaluate(dataset_dir=str(toy), output_dir=str(same), index_dir=f"{same}/")
    assert not same.exists()
