"""benchmarks/search_latency.py's sweep harness on hand-made inputs (no peers, no encoder): the
operating-point rule, the query splits, the paired bootstrap, the bytes rule and the reports."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from fixtures import REPO, write_beir_fixture
from index_utils import random_documents, write_store

sys.path.insert(0, str(REPO / "benchmarks"))
import search_latency as sl  # noqa: E402

from aligner_jax.encoding.encoder import EncodedText  # noqa: E402
from aligner_jax.indexing import centroid_index as ci  # noqa: E402
from aligner_jax.indexing import token_store as ts  # noqa: E402


def _row(setting, ndcg, recall, p50, complete=True, error=None):
    return {
        "setting": setting,
        "error": error,
        "tuning": {"ndcg@10": ndcg, "recall@100": recall, "p50_ms": p50, "complete": complete},
    }


EXACT = {"ndcg@10": 0.700, "recall@100": 0.900, "p50_ms": 80.0, "complete": True}


def test_rule_picks_the_fastest_setting_within_half_a_point_of_exact():
    rows = [
        _row("slow and exact", 0.700, 0.900, 30.0),
        _row("fast but short of recall", 0.700, 0.894, 2.0),  # 0.6 point below: out
        _row("fast but short of ndcg", 0.6949, 0.900, 3.0),  # 0.51 point below: out
        _row("fastest, errored", 0.700, 0.900, 1.0, error="TimeoutError"),
        _row("fastest, some queries unanswered", 0.700, 0.900, 1.5, complete=False),
        _row("at the edge", 0.695, 0.895, 9.0),  # exactly 0.5 point below both: in
        _row("above exact", 0.710, 0.910, 12.0),
    ]
    choice = sl.choose(rows, EXACT, tolerance=0.005)
    assert choice["setting"] == "at the edge"
    assert choice["admissible"] == ["slow and exact", "at the edge", "above exact"]
    assert choice["reason"] is None
    # a tighter tolerance leaves the slower ones
    assert sl.choose(rows, EXACT, tolerance=0.001)["setting"] == "above exact"


def test_rule_records_when_no_setting_is_admissible():
    rows = [_row("a", 0.60, 0.90, 1.0), _row("b", 0.70, 0.80, 2.0)]
    choice = sl.choose(rows, EXACT, tolerance=0.005)
    assert choice == {
        "setting": None,
        "admissible": [],
        "reason": "no setting within 0.5 point of its reference on both metrics",
    }
    assert sl.choose(rows, None, 0.005)["setting"] is None  # no exact reference: none chosen


def test_rule_judges_each_setting_against_its_own_reference():
    """Ours with a trained model's saliences is judged against exhaustive ALIGNER search (the
    function it approximates), a setting that scores MaxSim against exact MaxSim."""
    aligner = {"ndcg@10": 0.750, "recall@100": 0.950, "p50_ms": 200.0, "complete": True}
    refs = {"exact": EXACT, "exact-aligner": aligner}
    salient = {**_row("salience on, near exact MaxSim only", 0.700, 0.900, 5.0)}
    salient["reference"] = "exact-aligner"
    close = {**_row("salience on, near exact-aligner", 0.748, 0.946, 9.0)}
    close["reference"] = "exact-aligner"
    nosal = _row("salience off", 0.699, 0.899, 7.0)  # reference: exact MaxSim
    choice = sl.choose([salient, close, nosal], refs, tolerance=0.005)
    assert choice["admissible"] == ["salience on, near exact-aligner", "salience off"]
    assert choice["setting"] == "salience off"
    # exact MaxSim's figures alone do not judge a salience setting: no choice, and why
    choice = sl.choose([salient, nosal], {"exact": EXACT}, tolerance=0.005)
    assert choice == {
        "setting": None,
        "admissible": [],
        "reason": "no exact-aligner on the tuning queries",
    }


def test_reference_follows_the_scoring_function(tmp_path):
    assert sl.reference("aligner_jax", {"probe_docs": 640}, salient=True) == "exact-aligner"
    assert sl.reference("aligner_jax", {"salience": False}, salient=True) == "exact"
    assert sl.reference("aligner_jax", {"refine": "xtr"}, salient=True) == "exact"
    assert sl.reference("aligner_jax", {"probe_docs": 640}, salient=False) == "exact"
    assert sl.reference("xtr-warp", {}, salient=True) == "exact"
    assert sl.reference("exact-aligner", {}, salient=True) == "exact"
    store = write_store(tmp_path / "s", random_documents(3, 8), 8)
    assert store.has_saliences
    manifest = dict(store.manifest, model={**store.manifest["model"], "salience": "none"})
    ts.write_manifest(tmp_path / "s", manifest)
    assert not ts.TokenStore(tmp_path / "s").has_saliences


def test_exact_aligner_scores_every_document_by_eq_1_2(tmp_path):
    """exact-aligner ranks every document by top-1 alignment weighted by the saliences,
    sim = Σ_i u^q_i u^d_j* s_ij* / Σ_i u^q_i u^d_j* (j* = argmax_j s_ij), computed here
    by hand; exact MaxSim (mean of maxima) ranks them differently on the same vectors."""
    dim = 8
    docs = random_documents(30, dim, seed=5)
    store = write_store(tmp_path / "s", docs, dim)
    rng = np.random.default_rng(1)
    q = rng.normal(size=(4, dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    uq = np.array([1.0, 0.2, 0.7, 0.05], np.float32)
    query = EncodedText(token_ids=np.arange(4, dtype=np.int32), vectors=q, salience=uq)
    want = {}
    for d in docs:
        v = d.vectors.astype(np.float32)
        ud = d.salience.astype(np.float16).astype(np.float32)  # as stored
        s = q @ v.T
        j = s.argmax(1)
        w = uq * ud[j]
        want[d.doc_id] = float((w * s[np.arange(4), j]).sum() / w.sum())
    got = sl.ExactAligner(store, k=30)("q", query)
    assert set(got) == set(want)
    for doc_id, score in got.items():
        assert score == pytest.approx(want[doc_id], abs=1e-3)
    top = sorted(want, key=want.get, reverse=True)[:5]
    assert sorted(got, key=got.get, reverse=True)[:5] == top
    maxsim = sl.ExactMaxSim(store, k=30)("q", query)
    assert sorted(maxsim, key=maxsim.get, reverse=True)[:5] != top


def test_half_split_is_deterministic_disjoint_and_complete():
    qids = [str(i) for i in range(1, 77)]  # CISI's 76 test queries
    tuning, report = sl.half_split(qids, seed=0)
    assert (tuning, report) == sl.half_split(list(reversed(qids)), seed=0)  # order-free
    assert set(tuning).isdisjoint(report) and set(tuning) | set(report) == set(qids)
    assert len(tuning) == 38 and len(report) == 38
    assert tuning == sorted(tuning) and report == sorted(report)
    other, _ = sl.half_split(qids, seed=1)
    assert other != tuning  # the seed chooses the half
    # not the first or last half in id order: a random half
    assert tuning != sorted(qids)[:38] and tuning != sorted(qids)[38:]


def test_split_tunes_on_train_queries_when_the_collection_has_them(tmp_path):
    docs = {f"d{i}": f"text {i}" for i in range(4)}
    queries = {f"q{i}": f"query {i}" for i in range(10)}
    test_qrels = {"q0": {"d0": 1}, "q1": {"d1": 1}, "q2": {"d2": 1}}
    folder = write_beir_fixture(tmp_path, docs, queries, test_qrels, name="cisi_like")
    half = sl.split_queries(folder, test_qrels, seed=0)
    assert set(half.tuning).isdisjoint(half.report)
    assert set(half.tuning) | set(half.report) == set(test_qrels)
    assert "no train split" in half.description and "seed 0" in half.description

    train_qrels = {f"q{i}": {"d3": 1} for i in range(3, 10)}
    write_beir_fixture(tmp_path, docs, queries, train_qrels, split="train", name="cisi_like")
    write_beir_fixture(tmp_path, docs, queries, test_qrels, name="cisi_like")
    split = sl.split_queries(folder, test_qrels, seed=0)
    assert split.tuning == sorted(train_qrels) and split.report == sorted(test_qrels)
    assert split.qrels == {**train_qrels, **test_qrels}
    assert "train queries" in split.description and "7 of 7" in split.description
    sample = sl.split_queries(folder, test_qrels, seed=0, tuning_queries=4)
    assert len(sample.tuning) == 4 and set(sample.tuning) <= set(train_qrels)
    assert sample.tuning == sl.split_queries(folder, test_qrels, 0, 4).tuning  # seeded
    assert "4 of 7" in sample.description
    # a model trained on the train queries: tune on a seeded half of the test queries instead
    held = sl.split_queries(folder, test_qrels, seed=0, tuning="half")
    assert (held.tuning, held.report) == sl.half_split(test_qrels, 0)
    assert held.qrels == test_qrels and "--tuning_split=half" in held.description
    with pytest.raises(sl.app.UsageError, match="--tuning_split"):
        sl.split_queries(folder, test_qrels, seed=0, tuning="test")


def test_p50_interval_needs_three_rounds():
    assert sl.p50_interval([5.0, 7.0]) is None
    assert sl.p50_interval([6.0, 5.0, 7.5]) == [5.0, 7.5]


def test_grids_and_labels():
    grid = sl.parse_grid("n_ivf_probe=1,2;n_full_scores=256,4096", "fast_plaid_grid")
    assert grid == [
        {"n_ivf_probe": 1, "n_full_scores": 256},
        {"n_ivf_probe": 1, "n_full_scores": 4096},
        {"n_ivf_probe": 2, "n_full_scores": 256},
        {"n_ivf_probe": 2, "n_full_scores": 4096},
    ]
    assert sl.parse_grid("refine_per_k=1.5", "ours_grid") == [{"refine_per_k": 1.5}]
    with pytest.raises(sl.app.UsageError, match="--warp_grid"):
        sl.parse_grid("nprobe", "warp_grid")
    assert sl.short_label({"bits": 4, "probe_docs": 640, "refine_per_k": 3.0}) == "4/640/3"
    assert sl.short_label({}) == "default"
    assert sl.short_label({"bits": 4, "salience": False, "variant": "x"}) == "4/no salience/x"


def test_ours_grid_takes_the_salience_switch_and_names_a_wrong_knob():
    """``salience=false`` (a trained model's u^d off, as exact MaxSim scores) is a knob of our
    grid beside ``CentroidSearchConfig``'s; a misspelt one is named."""
    from absl import flags
    from absl.testing import flagsaver

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    with flagsaver.flagsaver(ours_grid="salience=false,true;probe_docs=640"):
        sl.check_flags()
        assert sl.parse_grid(sl._OURS_GRID.value, "ours_grid")[0]["salience"] is False
    with flagsaver.flagsaver(ours_grid="salence=false"):
        with pytest.raises(sl.app.UsageError, match="--ours_grid: 'salence' is not one of"):
            sl.check_flags()


def test_warp_retry_keeps_the_codec_sample_within_torch_quantile():
    for dim in (128, 384, 768):
        settings = dict(s.split("=") for s in sl.warp_large_input(dim))
        assert settings["embeddings_from_disk"] == "true"
        cap = int(settings["codec_sample_max_tokens"])
        assert cap <= sl.WARP_DEFAULT_CODEC_SAMPLE
        assert round(min(0.05 * cap, 50_000)) * dim <= sl.QUANTILE_LIMIT  # its held-out sample
    assert dict(s.split("=") for s in sl.warp_large_input(128))["codec_sample_max_tokens"] == (
        "1000000"  # 50,000 × 128 fits: the default
    )


def test_bytes_rule_counts_every_system_the_same_way(tmp_path):
    dim = 16
    store = write_store(tmp_path / "s", random_documents(40, dim, seed=2), dim, shard_size=15)
    index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(residual_bits=4))
    (tmp_path / "s" / "documents.sqlite").write_bytes(b"x" * 1000)  # text: never counted
    files = sl.store_files(tmp_path / "s")
    t = store.num_tokens
    published = {f"search_index/{n}.npy": e["bytes"] for n, e in index.meta["files"].items()}
    assert set(published) <= set(files)
    meta_json = f"search_index/{index.meta_path.name}"
    small = [n for n in files if n.startswith("shard-") and n.endswith(".offsets.npy")]
    small += [f"{shard['name']}.json" for shard in store.manifest["shards"]]
    resident = sum(published.values()) + files[meta_json] + files["manifest.json"]
    resident += sum(files[n] for n in small)
    kept = sum(s for n, s in files.items() if n.endswith((".vectors.npy", ".salience.npy")) and n.startswith("shard-"))  # fmt: skip
    got = sl.ours_bytes(store, index, False)
    assert got["index_bytes_resident"] == resident
    assert got["index_bytes"] == resident + kept
    assert got["bytes_per_token_resident"] == pytest.approx(resident / t)
    assert (
        got["bytes_per_token_disk"]
        == got["bytes_per_token"]
        == pytest.approx((resident + kept) / t)
    )
    # a setting that reads token lists: built in memory at load (an index without them), a
    # document id and a packed residual per kept token and the offsets, resident
    lists = sl.ours_bytes(store, index, True)
    copy = t * (4 + dim * 4 // 8) + 8 * (index.num_centroids + 1)
    assert (
        lists["index_bytes_resident"] == resident + copy
        and lists["index_bytes"] == got["index_bytes"]
    )
    # ... or the index's own files: opened by such settings, on disk only for the others
    with_lists = ci.CentroidIndex.build(
        store, ci.CentroidIndexConfig(residual_bits=4, token_lists=True)
    )
    files = sl.store_files(tmp_path / "s")
    tok = sum(e["bytes"] for n, e in with_lists.meta["files"].items() if ".tok_" in n)
    assert tok > copy - 8 * (index.num_centroids + 1)
    plain, reads = sl.ours_bytes(store, with_lists, False), sl.ours_bytes(store, with_lists, True)
    assert reads["index_bytes_resident"] == plain["index_bytes_resident"] + tok
    assert reads["index_bytes"] == plain["index_bytes"]
    on_disk_only = plain["index_bytes"] - plain["index_bytes_resident"]
    assert on_disk_only == got["index_bytes"] - got["index_bytes_resident"] + tok
    # ids, token ids and text are nobody's index bytes
    kind = sl.ours_kind(tmp_path / "s")
    assert {kind(n) for n in files if "doc_ids" in n or "token_ids" in n} == {None}
    assert kind("documents.sqlite") is None and kind("search_index/centroids-00000.npy") is None
    # the residuals take 4 bits a dimension: the search index's largest file per token
    residuals = next(v for n, v in published.items() if "residuals" in n)
    assert residuals == pytest.approx(t * dim * 4 / 8, abs=256)

    exact = sl.exact_bytes(tmp_path / "s", t, dim)
    offsets = sum(s for n, s in files.items() if n.endswith(".offsets.npy"))
    vectors = sum(s for n, s in files.items() if n.endswith(".vectors.npy"))
    assert exact["index_bytes_resident"] == 4 * dim * t + offsets
    assert exact["index_bytes"] == vectors + offsets

    # peers: the same rule over their folder, the update-only copies on disk only
    fp = {"centroids.npy": 400, "ivf.npy": 100, "embeddings.npy": 5000, "metadata.json": 10}
    got = sl.bytes_rule(fp, sl.peer_kind("fast-plaid"), 100)
    assert (got["index_bytes_resident"], got["index_bytes"]) == (510, 5510)
    warp = {"0.codes.npy": 7, "0.residuals.npy": 70, "codes.compacted.npy": 7, "residuals.compacted.npy": 70}  # fmt: skip
    got = sl.bytes_rule(warp, sl.peer_kind("xtr-warp"), 7)
    assert (got["bytes_per_token_resident"], got["bytes_per_token_disk"]) == (11.0, 22.0)


def _payload():
    def row(system, setting, settings, threads, ndcg, recall, p50, default=False):
        return {"system": system, "setting": setting, "settings": settings,
                "short": sl.short_label(settings), "model": "zero_shot", "dataset": "toy",
                "threads": threads, "ndcg@10": ndcg, "recall@100": recall, "p50_ms": p50,
                "p99_ms": 2 * p50, "e2e_p50_ms": p50 + 5, "e2e_p99_ms": 2 * p50 + 9,
                "ci95": {"ndcg@10": [-0.01, 0.0], "recall@100": [-0.02, 0.01], "p50_ms": [p50 - 1, p50 + 1]},
                "tuned_on": "toy split" if default else None, "default": default,
                "bytes_per_token_resident": 80.0, "bytes_per_token": 160.0, "load_avg_1m": 1.0,
                "error": None}  # fmt: skip

    rows = []
    for threads in (2, 1):
        rows += [
            row("aligner_jax", "pd=320", {"probe_docs": 320}, threads, 0.69, 0.90, 5.0),
            row("aligner_jax", "pd=640", {"probe_docs": 640}, threads, 0.70, 0.93, 8.0, True),
            row("fast-plaid", "n=1", {"n_ivf_probe": 1}, threads, 0.70, 0.92, 150.0, True),
            row("fast-plaid", "n=8", {"n_ivf_probe": 8}, threads, 0.71, 0.94, 900.0),
            row("exact", "exhaustive", {}, threads, 0.71, 0.94, 70.0, True),
        ]
    for r in rows:
        if r["system"] == "exact":
            r["tuned_on"] = None  # no knob: a default the rule did not choose
    failed = {"system": "xtr-warp", "setting": "—", "settings": {}, "short": "—", "p50_ms": None}
    failed.update({"ndcg@10": None, "recall@100": None, "default": False, "tuned_on": None})
    failed["error"] = "PanicException: quantile() input tensor is too large"
    rows.append({**rows[0], **failed})
    return {"rows": rows, "query_encoding": [], "machine": "toy", "k": 100, "rounds": 3,
            "rule": "the rule", "splits": {"toy/zero_shot": {"description": "toy split"}},
            "choices": [{"dataset": "toy", "model": "zero_shot", "threads": 2,
                         "system": "xtr-warp", "settings_swept": 0, "setting": None,
                         "admissible": [], "reason": "no setting within 0.5 point"}]}  # fmt: skip


def test_reports_draw_one_figure_per_store_and_thread_count(tmp_path):
    out = tmp_path / "search_latency"
    out.with_suffix(".json").write_text(json.dumps(_payload()))
    written = sl.write_outputs(json.loads(out.with_suffix(".json").read_text()), out)
    names = sorted(p.name for p in written)
    assert names == [
        "search_latency.md",
        "search_latency.png",
        "search_latency_toy_zero_shot_t1.png",
        "search_latency_toy_zero_shot_t2.png",
    ]
    assert all(p.stat().st_size > 0 for p in written)
    md = out.with_suffix(".md").read_text()
    assert "| pd=640 ★ |" in md and "| pd=320 |" in md and "| exhaustive |" in md
    assert "[-1.0, +0.0]" in md and "[7.0, 9.0]" in md  # metric and p50 intervals
    assert "none (no setting within 0.5 point)" in md and "quantile() input tensor" in md

    fig = sl.sweep_figure(_payload(), "toy", "zero_shot", 2)
    left, right = fig.axes
    assert left.get_ylabel().startswith("R@100") and right.get_ylabel().startswith("nDCG@10")
    labels = {t.get_text() for t in left.texts}
    assert {"320", "640", "1", "8", "default"} <= labels  # every setting labelled
    starred = [ln for ln in left.get_lines() if ln.get_marker() == "*"]
    assert len(starred) == 2  # ours and fast-plaid (exact has no knob: not chosen by the rule)
    sl.plotting.pyplot().close(fig)


def test_pareto_front_keeps_the_points_nothing_beats():
    points = [(5.0, 90.0), (8.0, 93.0), (9.0, 92.0), (150.0, 92.0), (900.0, 94.0), (5.0, 80.0)]
    assert sl.pareto_front(points) == [0, 1, 4]


def test_exact_runs_in_the_rounds_asked_and_exact_aligner_in_the_first():
    rounds = range(3)
    assert [sl.runs_in_round("exact", r, None) for r in rounds] == [True, True, True]
    assert [sl.runs_in_round("exact", r, 1) for r in rounds] == [True, False, False]
    assert [sl.runs_in_round("exact", r, 2) for r in rounds] == [True, True, False]
    assert [sl.runs_in_round("exact-aligner", r, None) for r in rounds] == [True, False, False]
    for system in ("aligner_jax", "xtr-warp", "fast-plaid"):
        assert all(sl.runs_in_round(system, r, 1) for r in rounds)
