"""First stages of aligner-eval on a tiny BEIR folder: BM25 alone (eval/bm25.gin), a TREC run
reranked by ALIGNER (--rerank_run), and the hybrid (eval/hybrid.gin) with its few-shot weight."""

from __future__ import annotations

import json

import gin
import pytest
from fixtures import (
    TOY_DOCS,
    TOY_QUERIES,
    parse_gin,
    run_module,
    trec_eval_run_file,
    write_toy_beir,
)

from aligner_jax.common import fileio
from aligner_jax.common.errors import ConfigError
from aligner_jax.data import bm25, runs
from aligner_jax.evaluation import beir_eval
from aligner_jax.retrieval import lexical_stages as lexical
from aligner_jax.retrieval import searcher


def _read(path):
    return runs.read_run(path, TOY_QUERIES, TOY_DOCS).results


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The toy folder, one token store, and ALIGNER's exhaustive run on it (the reference)."""
    tmp = tmp_path_factory.mktemp("toy")
    data = write_toy_beir(tmp / "data")
    parse_gin("eval/zero_shot.gin", "eval/exhaustive.gin")
    beir_eval.evaluate(dataset_dir=str(data), output_dir=str(tmp / "exh"), index_dir=str(tmp / "i"))
    gin.clear_config()
    return data, str(tmp / "i"), _read(tmp / "exh" / "run.trec")


def test_bm25_gin_through_the_binary_encodes_nothing(tmp_path):
    data = write_toy_beir(tmp_path / "data")
    out = tmp_path / "bm25"
    proc = run_module(
        "aligner_jax.evaluate", "--gin_file=eval/bm25.gin", f"--dataset_dir={data}",
        f"--output_dir={out}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "bm25 evaluation: toy/test (4 queries, 12 docs)" in proc.stdout
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["metrics_all"] == trec_eval_run_file(out / "run.trec", data / "qrels/test.tsv")
    assert saved["config"]["first_stage"] == "bm25" and saved["config"]["model"] is None
    written = ("run.trec", "results.json", "config.gin")
    assert sorted(p.name for p in out.iterdir()) == sorted(["metrics.json", *written])
    assert saved["files"] == {n: fileio.sha256_file(out / n) for n in written}
    # The run is bm25s's own ranking.
    index = bm25.BM25Index.build(
        list(TOY_DOCS), [f"{d['title']} {d['text']}" for d in TOY_DOCS.values()]
    )
    assert _read(out / "run.trec") == index.search(TOY_QUERIES, k=1000)


def test_a_lexical_first_stage_refuses_settings_it_would_ignore(tmp_path):
    """--index_dir (no token index is read) and LexicalConfig.minicoil_models with kind='bm25'
    were silently ignored by eval/bm25.gin."""
    data = write_toy_beir(tmp_path / "data")
    proc = run_module(
        "aligner_jax.evaluate", "--gin_file=eval/bm25.gin", f"--dataset_dir={data}",
        f"--output_dir={tmp_path / 'a'}", f"--index_dir={tmp_path / 'i'}",
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "first_stage='bm25' builds its lexical index in memory" in proc.stderr
    assert not (tmp_path / "a" / "metrics.json").exists()
    with pytest.raises(ConfigError, match=r"minicoil_models is read by kind='minicoil' only"):
        lexical.LexicalConfig(kind="bm25", minicoil_models="/m")


def test_rerank_refines_exactly_the_listed_candidates(toy, tmp_path):
    """The reranked scores are ALIGNER's exhaustive scores of the same documents; lines of a
    query outside the split are skipped and counted, a query without lines ranks nothing;
    metrics.json equals pytrec_eval on the run file."""
    data, index, full = toy
    lines = [
        "q0 Q0 d4 1 9 bm25",
        "q0 Q0 d0 2 8 bm25",
        "q0 Q0 d9 3 7 bm25",
        "q1 Q0 d10 1 3 bm25",
        "q1 Q0 d1 2 2 bm25",
        "q1 Q0 d2 3 1 bm25",
        "q3 Q0 d2 1 5 bm25",
        "q77 Q0 d2 1 5 bm25",
    ]
    first = tmp_path / "first.trec"
    first.write_text("\n".join(lines) + "\n")
    parse_gin("eval/zero_shot.gin")
    out = tmp_path / "reranked"
    report = beir_eval.evaluate(
        dataset_dir=str(data), output_dir=str(out), index_dir=index, rerank_run=str(first)
    )
    reranked = _read(out / "run.trec")
    assert set(reranked) == {"q0", "q1", "q3"}  # q2 has no line: nothing ranked
    assert list(reranked["q0"])[0] == "d0" and set(reranked["q0"]) == {"d4", "d0", "d9"}
    assert set(reranked["q1"]) == {"d10", "d1", "d2"} and list(reranked["q3"]) == ["d2"]
    for qid, docs in reranked.items():
        for doc, score in docs.items():
            assert score == pytest.approx(full[qid][doc], abs=1e-6)
    info = report["first_stage"]
    assert report["config"]["first_stage"] == "run" and report["config"]["search"] == "run"
    assert report["config"]["beta_q"] is None and report["config"]["exhaustive"] is False
    assert report["timing"]["query_batch_size"] == 1  # rerank scores one query at a time
    assert (info["lines"], info["skipped_lines"], info["skipped_queries"]) == (8, 1, 1)
    assert info["queries_without_candidates"] == 1
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["metrics_all"] == trec_eval_run_file(out / "run.trec", data / "qrels/test.tsv")
    assert saved["per_query"]["q2"]["ndcg@10"] == 0.0


def test_hybrid_default_few_shot_weight_and_the_aligner_limit(toy, tmp_path):
    data, index, full = toy
    parse_gin("eval/hybrid.gin", bindings=["AdaptationConfig.fold_size = 2"])
    out = tmp_path / "hybrid"
    report = beir_eval.evaluate(
        dataset_dir=str(data), output_dir=str(out), index_dir=index, adapt=True
    )
    assert report["config"]["first_stage"] == "hybrid"
    info = report["first_stage"]
    assert info["lexical"]["kind"] == "bm25" and info["hybrid"]["fusion"] == "score"
    assert info["hybrid"]["weight"] == 0.7 and info["union_candidates_median"] >= 1
    assert report["timing"]["search_queries_per_s"] > 0  # once 0: the run's wall time unset
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["metrics_all"] == trec_eval_run_file(out / "run.trec", data / "qrels/test.tsv")
    assert saved["metrics"]["ndcg@10"] > 0.9  # both systems find the toy's relevant documents
    adapted = json.loads((out / "fusion_adaptation.json").read_text())
    assert set(adapted["methods"]) == {"rrf", "score"}
    score = adapted["methods"]["score"]
    assert score["num_folds"] == 2 and len(score["per_strategy"]) == 11
    assert score["default"] == pytest.approx(saved["metrics"]["ndcg@10"])
    assert saved["adaptation"]["chooses"] == "fusion weight"
    assert set(saved["files"]) == {
        "run.trec", "results.json", "config.gin", "fusion_adaptation.json", "fusion_adaptation.md"
    }  # fmt: skip

    # ALIGNER's weight 1: the fused ranking is ALIGNER's exhaustive ranking of the union.
    parse_gin(
        "eval/hybrid.gin", bindings=["HybridConfig.weight = 1.0", "HybridConfig.fusion = 'score'"]
    )
    beir_eval.evaluate(dataset_dir=str(data), output_dir=str(tmp_path / "w1"), index_dir=index)
    fused = _read(tmp_path / "w1" / "run.trec")
    for qid, docs in fused.items():
        order = [d for d, _ in runs.ranked(full[qid]) if d in docs]
        assert [d for d, _ in runs.ranked(docs)] == order


def test_first_stage_settings_are_checked_before_any_work(tmp_path):
    data = write_toy_beir(tmp_path / "data")
    xtr = searcher.SearchConfig(backend="exact", refine="xtr")
    cases = [
        (dict(first_stage="faiss"), "--gin.evaluate.first_stage='faiss': choose one of"),
        (dict(first_stage="bm25", adapt=True), "--adapt needs ALIGNER"),
        (dict(first_stage="hybrid", rerank_run="x.trec"), "--rerank_run replaces the first"),
        (dict(first_stage="hybrid", search_config=xtr), "refine=\"'full'\""),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            beir_eval.evaluate(dataset_dir=str(data), output_dir=str(tmp_path / "o"), **kwargs)
    assert not (tmp_path / "o").exists()


def test_a_registered_lexical_stage_plugs_in_by_name(tmp_path):
    class Reversed:  # ranks documents in reverse corpus order
        def __init__(self, doc_ids):
            self.doc_ids = doc_ids

        def search(self, queries, k):
            ranked = self.doc_ids[::-1][:k]
            return {q: {d: float(len(ranked) - i) for i, d in enumerate(ranked)} for q in queries}

    lexical.register("reversed")(lambda ids, texts, encoder, config: Reversed(list(ids)))
    try:
        data = write_toy_beir(tmp_path / "data")
        parse_gin(bindings=["LexicalConfig.kind = 'reversed'"])
        out = tmp_path / "o"
        report = beir_eval.evaluate(
            dataset_dir=str(data), output_dir=str(out), first_stage="reversed"
        )
        assert list(_read(out / "run.trec")["q0"])[:2] == ["d11", "d10"]
        assert report["config"]["first_stage"] == "reversed"
    finally:
        del lexical.STAGES["reversed"]


def test_minicoil_alone_and_in_the_hybrid(toy, tmp_path):
    data, index, _ = toy
    parse_gin("eval/minicoil.gin", bindings=["MiniCoilConfig.k1 = 0.9"])
    out = tmp_path / "minicoil"
    report = beir_eval.evaluate(dataset_dir=str(data), output_dir=str(out))
    assert report["config"]["first_stage"] == "minicoil" and not (out / "index").exists()
    # the settings miniCOIL used (its own BM25 k1), not LexicalConfig's, which it ignores
    lexical = report["config"]["lexical"]
    assert "k1" not in lexical and lexical["minicoil"]["k1"] == 0.9
    assert report["metrics_all"] == trec_eval_run_file(out / "run.trec", data / "qrels/test.tsv")
    parse_gin("eval/hybrid.gin", bindings=["LexicalConfig.kind = 'minicoil'"])
    out = tmp_path / "hybrid"
    report = beir_eval.evaluate(dataset_dir=str(data), output_dir=str(out), index_dir=index)
    assert report["first_stage"]["lexical"]["kind"] == "minicoil"
    assert report["metrics_all"] == trec_eval_run_file(out / "run.trec", data / "qrels/test.tsv")
