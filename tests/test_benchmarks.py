"""The scaling benchmark's pieces on small inputs (the full runs live in benchmarks/)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from fixtures import REPO, run_python

sys.path.insert(0, str(REPO / "benchmarks"))
import scaling  # noqa: E402

from aligner_jax.evaluation import plotting  # noqa: E402


def test_calibration_recovers_the_generating_noise(tmp_path):
    scaling.make_store(tmp_path / "store", 200_000, noise=0.074)
    stats = scaling.calibrate(tmp_path / "store")
    assert stats["tokens"] == 200_000 and stats["dim"] == scaling.DIM
    assert stats["matching_noise"] == pytest.approx(0.074, abs=0.01)
    assert stats["held_out_mean_cos_to_nearest_centroid"] == pytest.approx(
        scaling.cos_to_centre(0.074), abs=0.03
    )


def test_scaling_measures_a_small_corpus(tmp_path):
    proc = run_python(
        REPO / "benchmarks" / "scaling.py",
        "--sizes=100000",
        "--num_queries=3",
        "--k_prime=100",
        f"--workdir={tmp_path / 'work'}",
        f"--output={tmp_path / 'out'}",
        "--name=small",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "out" / "small.json").read_text())
    assert row["num_tokens"] == 100_000 and row["num_docs"] == 500 and row["num_parts"] == 1
    assert row["noise"] == scaling.DEFAULT_NOISE and row["k_prime"] == 100
    assert 0.5 <= row["token_recall_10"] <= 1.0 and 0.0 < row["candidate_recall"] <= 1.0
    assert row["index_bytes"] > 100_000 * scaling.DIM  # codes + the float32 reorder copy
    table = (tmp_path / "out" / "small.md").read_text()
    assert "| 100,000 | 1 |" in table and "σ = 0.074" in table
    assert not (tmp_path / "out" / "small.png").exists()  # a plot needs several sizes


def test_filter_cost_times_each_filter_first_and_repeated(tmp_path):
    proc = run_python(
        REPO / "benchmarks" / "filter_cost.py",
        "--docs=300,600",
        "--repeats=1",
        f"--work_dir={tmp_path / 'tables'}",
        f"--output={tmp_path / 'out'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "filter_cost.json").read_text())["rows"]
    assert [(r["docs"], r["filter_name"]) for r in rows][:2] == [
        (300, "range"),
        (300, "list element"),
    ]
    passing = {(r["docs"], r["filter_name"]): r["passing_docs"] for r in rows}
    assert passing[300, "ne (keeps null)"] == 200 and passing[600, "ne (keeps null)"] == 400
    assert 0 < passing[600, "two fields"] < passing[600, "range"] < 600
    assert all(r["first_ms"] > 0 and r["repeated_ms"] >= 0 for r in rows)
    assert "| 600 | range" in (tmp_path / "out" / "filter_cost.md").read_text()
    assert (tmp_path / "out" / "filter_cost.png").stat().st_size > 0


def test_multiprocess_index_reads_the_summaries_in_rank_order(tmp_path):
    """They were read in the order the processes finished, beside peak RSS in rank order: the
    encoding times of the two ranks could be swapped in the table."""
    log = tmp_path / "log"
    log.write_text(
        '[1] {"directory": "i", "encode_seconds": 13}\n[0] noise\n'
        '[0] {"directory": "i", "encode_seconds": 0}\n'
    )
    code = (  # in a child: the module defines absl flags other benchmarks define too
        "import sys; sys.path.insert(0, 'benchmarks'); import multiprocess_index as m; "
        f"print([s['encode_seconds'] for s in m.summaries(__import__('pathlib').Path('{log}'))])"
    )
    proc = run_python("-c", code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[0, 13]"


def _scaling_rows(recalls=(0.93, 0.84, 0.99)) -> list[dict]:
    sizes = (1_000_000, 4_000_000, 16_000_000)
    return [
        {
            "num_tokens": n,
            "num_docs": n // scaling.DOC_TOKENS,
            "num_parts": 1 if n <= 4_000_000 else 4,
            "build_s": 34e-6 * n,
            "index_bytes": 585 * n,
            "store_bytes": 262 * n,
            "search_ms_per_query_p50": 20e-6 * n,
            "search_ms_per_query_p90": 25e-6 * n,
            "candidate_recall": r,
            "token_recall_10": 0.99,
            "recall_queries": 10,
            "k_prime": 1000,
            "scann_config": {},
            "noise": 0.074,
            "cos_to_centre": scaling.cos_to_centre(0.074),
            "query_tokens": 32,
            "peak_rss_gib": 2.6e-6 * n,
        }
        for n, r in zip(sizes, recalls, strict=True)
    ]


def test_scaling_figure_keeps_units_apart_and_explains_a_recall_dip():
    rows = _scaling_rows()
    candidates = [
        {"num_tokens": r["num_tokens"], "k_prime": 1000, "noise": 0.074, "own_centre_tokens": t,
         "own_share_of_list": s, "candidate_docs": 3000.0, "candidate_share_of_corpus": 0.2,
         "other_only_share": o}
        for r, t, s, o in zip(rows, (240, 960, 3900), (0.24, 0.91, 1.0), (0.94, 0.63, 0.0), strict=True)
    ]  # fmt: skip
    assert scaling.recall_dips(rows) == [1]
    fig = scaling.figure(rows, candidates)
    panels = {ax.get_ylabel(): ax for ax in fig.axes}
    # One unit per axes: seconds, milliseconds, GiB and percent never share one.
    assert sorted(panels) == [
        "index build time (s)",
        "memory (GiB)",
        "recall (%)",
        "search time per query (ms)",
    ]
    sizes = [r["num_tokens"] for r in rows]
    memory = {ln.get_label(): list(ln.get_ydata()) for ln in panels["memory (GiB)"].get_lines()}
    assert memory["token index"] == pytest.approx([r["index_bytes"] / 2**30 for r in rows])
    assert memory["peak RSS (build + search)"] == pytest.approx([r["peak_rss_gib"] for r in rows])
    for ax in fig.axes:
        for line in ax.get_lines():
            assert list(line.get_xdata()) == sizes
    build = panels["index build time (s)"]
    assert [t.get_text() for t in build.texts] == ["34 s", "136 s", "544 s"]  # every point
    recall = panels["recall (%)"]
    assert [t.get_text() for t in recall.get_xticklabels()] == ["1M", "4M", "16M\n4 parts"]
    (dip,) = [t for t in recall.texts if t.get_text().startswith("dip")]
    assert tuple(dip.xy) == (4_000_000, pytest.approx(84.0))
    (caption,) = [t.get_text() for t in fig.texts if t.get_text().startswith("Dip")]
    assert caption.startswith("Dip at 4M: ScaNN misses 16% of exact search's candidate documents")
    assert "At 4M a list ends just past its centre's 960 tokens, and 63%" in caption
    plotting.pyplot().close(fig)
    # No dip, no caption.
    assert scaling.dip_caption(_scaling_rows((0.99, 0.9, 0.8)), candidates) == ""


def test_scaling_replot_rewrites_table_and_plot_from_saved_json(tmp_path):
    rows = _scaling_rows()
    (tmp_path / "x.json").write_text(json.dumps(rows))
    scaling_py = REPO / "benchmarks" / "scaling.py"
    proc = run_python(scaling_py, "--replot", f"--output={tmp_path}", "--name=x", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "x.md").read_text() == scaling.markdown(rows)
    assert "| 4,000,000 | 1 | 136.0 |" in scaling.markdown(rows)
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_candidate_lists_match_brute_force_on_the_written_store(tmp_path):
    import scaling_candidates

    from aligner_jax.indexing import token_store as ts

    num_tokens, k = 30_000, 40
    stats = scaling_candidates.exact_lists(num_tokens, k, num_queries=2, noise=0.074)
    scaling.make_store(tmp_path / "s", num_tokens, noise=0.074)
    store = ts.TokenStore(tmp_path / "s")
    vectors = store.vectors().astype(np.float32)
    doc_of = np.repeat(np.arange(store.num_docs), scaling.DOC_TOKENS)
    queries, _ = scaling.synthetic_queries(np.load(tmp_path / "s" / "centers.npy"), 2, 0.074)
    counts = []
    for q in queries:
        top = np.argsort(-(q @ vectors.T), axis=1)[:, :k]
        counts.append(len(set(doc_of[top].ravel().tolist())))
    assert stats["candidate_docs"] == pytest.approx(np.mean(counts))
    assert stats["num_docs"] == store.num_docs == num_tokens // scaling.DOC_TOKENS
    assert 0.0 <= stats["other_only_share"] <= 1.0 and 0.0 < stats["own_share_of_list"] <= 1.0


def test_search_latency_figure_labels_every_system_and_keeps_equal_scores_equal():
    import search_latency

    def row(system, threads, ndcg, p50, setting="default", error=None):
        return {"system": system, "setting": setting, "model": "zero_shot", "dataset": "toy",
                "ndcg@10": ndcg, "p50_ms": p50, "threads": threads, "error": error}  # fmt: skip

    payload = {
        "k": 100,
        "rows": [
            row("aligner_jax", 2, 0.7068, 8.7),
            row("aligner_jax", 1, 0.7068, 11.2, setting="default (quiet re-run)"),
            row("exact", 2, 0.7072, 9.5),
            row("fast-plaid", 2, None, None, error="TimeoutError: time limit\ntraceback"),
        ],
    }
    fig = search_latency.figure(payload)
    (ax,) = fig.axes
    labels = {t.get_text() for t in ax.texts if not t.get_text().startswith(("*", "no result"))}
    assert labels == {"aligner_jax ×2", "aligner_jax ×1*", "exact ×2"}
    (notes,) = [t.get_text() for t in ax.texts if t.get_text().startswith("*")]
    assert notes == "* quiet re-run\nno result: fast-plaid ×2: TimeoutError: time limit"
    low, high = ax.get_ylim()
    assert high - low >= 2.0  # 0.04 nDCG points apart must not fill the axes
    left, right = ax.get_xlim()
    assert right / left >= 5.0 and ax.get_xscale() == "log"
    filled = {ln.get_markerfacecolor() != "none" for ln in ax.get_lines()}
    assert filled == {True, False}  # 2 threads filled, 1 thread hollow
    plotting.pyplot().close(fig)


def test_incremental_helpers_compare_rankings_and_report_the_ratio():
    import incremental

    lines = [json.dumps({"_id": f"d{i}", "text": "x"}) for i in range(10)] + [""]
    base, added = incremental.split_lines(lines, 0.9)
    assert len(base) == 9 and len(added) == 1 and added[0] == lines[9]
    ids = [f"d{i}" for i in range(9)]
    picks = incremental.pick_deletions(ids, ["d9"], 3, seed=0)
    assert len(picks) == 3 and "d9" in picks and picks == sorted(picks)
    a = {"q1": {"d1": 0.9, "d2": 0.8, "d3": 0.1}, "q2": {"d1": 0.5, "d2": 0.4}}
    b = {"q1": {"d1": 0.9, "d2": 0.8, "d3": 0.1}, "q2": {"d2": 0.5, "d1": 0.4 + 1e-3}}
    same = incremental.compare_rankings(a, a, k=3)
    assert same["queries_top_k_differ"] == 0 and same["max_abs_score_delta"] == 0.0
    diff = incremental.compare_rankings(a, b, k=3)
    assert (
        diff["queries"] == 2 and diff["queries_top_k_differ"] == diff["queries_top_10_differ"] == 1
    )
    assert diff["max_abs_score_delta"] == pytest.approx(0.1)
    after = {"q1": {"d1": 0.9, "d3": 0.1, "d7": 0.05}}
    assert incremental.without(a, {"d2"}, k=1) == {"q1": {"d1": 0.9}, "q2": {"d1": 0.5}}
    assert incremental.check_deletions(a, after, {"d2"}, k=3) == {
        "deleted_returned": 0, "queries_not_prefix": 0, "queries": 1}  # fmt: skip
    bad = incremental.check_deletions(a, {"q1": {"d2": 0.8, "d3": 0.1}}, {"d2"}, k=3)
    assert bad["deleted_returned"] == 1 and bad["queries_not_prefix"] == 1

    def step(label, docs, wall, job, enc=None, idx=None):
        return {"label": label, "num_docs": docs, "wall_s": wall, "job_s": job, "encode_s": enc,
                "search_index_s": idx, "load_before": 1.0, "load_after": 1.2}  # fmt: skip

    steps = {
        "base": step("base", 90, 300.0, 280.0, 200.0, 80.0),
        "add": step("--add", 10, 30.0, 20.0, 18.0, 2.0),
        "delete": step("--delete", 5, 10.0, None),
        "rebuild": step("rebuild", 100, 400.0, 380.0, 290.0, 90.0),
    }
    r = incremental.ratios(steps)
    assert r["add_over_rebuild_wall"] == pytest.approx(0.075)
    assert r["add_over_rebuild_job"] == pytest.approx(20 / 380)
    metric = {"ndcg@10": 0.7, "recall@100": 0.9}
    modes = ("fast", "exhaustive", "exhaustive_less_deleted")
    payload = {
        "dataset": "toy", "num_docs": 100, "model": "m", "machine": "vm", "load_start": 1.0,
        "load_end": 1.2, "busy": "quiet", "k": 3, "deleted": 5, "steps": steps, "ratios": r,
        "exhaustive_queries": 2,
        "quality": {
            "exhaustive_added_vs_rebuild": same, "fast_added_vs_rebuild": diff,
            "metrics": {n: {m: metric for m in modes} for n in ("added", "rebuild")},
            "after_delete": {"fast": {"deleted_returned": 0}, "exhaustive": bad},
        },
        "drift": {"recorded": 0.05, "build_mean": 0.8, "added_mean": 0.75, "added_tokens": 1000,
                  "limit": 0.02, "added_mean_rebuild_centroids": 0.79, "rebuild_mean": 0.8},
    }  # fmt: skip
    table = incremental.markdown(payload)
    assert "**add / full rebuild: 7.5 %**" in table and "| --delete | 5 | 10.0 | — |" in table
    assert "lists differ for 0 queries" in table and "0.0500 = mean max" in table
    assert "| full rebuild | 70.00 | 90.00 | 70.00 ¹ (70.00) | 90.00 ¹ (90.00) |" in table
    fig = incremental.figure(payload)
    assert [t.get_text() for t in fig.axes[0].texts] == ["300 s", "30 s", "10 s", "400 s"]
    plotting.pyplot().close(fig)


@pytest.mark.parametrize("gnu_time", [True, False])
def test_a_child_reports_its_own_peak_rss_with_or_without_gnu_time(tmp_path, monkeypatch, gnu_time):
    from benchmarks import scale

    if not gnu_time:  # an accelerator host without GNU time: a small Python parent measures
        monkeypatch.setattr(scale, "GNU_TIME", tmp_path / "no-such-time")
    elif not scale.GNU_TIME.exists():
        pytest.skip("no /usr/bin/time here")
    code = "import numpy as np; a = np.ones(60_000_000); a += 1; print('{\"ok\": 1}')"
    result = scale.run_child([sys.executable, "-c", code], 1, tmp_path / "log.txt")
    assert result["ok"] == 1
    assert 0.44 < result["peak_rss_gib"] < 2.0  # 480 MB touched, not this process's peak


def test_demo_cost_splits_the_demo_wall_time_into_its_phases(tmp_path):
    from benchmarks import demo_cost

    timing = {"encode_corpus_s": 30.0, "index_build_s": 45.5, "index_reused": False,
              "search_ms_per_query_p50": 21.0}  # fmt: skip
    metrics = {"timing": timing, "num_docs": 12, "num_tokens": 345,
               "metrics": {"ndcg@10": 0.7, "recall@100": 0.9}}  # fmt: skip
    child = {"wall_s": 100.0, "peak_rss_gib": 1.5}
    load = ((1.234, 1, 1), (2.0, 2, 2))
    r = demo_cost.report(metrics, child, ["make", "demo"], load, "data")
    assert list(r["phases_s"].values()) == [30.0, 45.5, 24.5]  # the rest of the wall time
    assert sum(r["phases_s"].values()) == pytest.approx(r["wall_s"])
    assert (r["wall_s"], r["peak_rss_gib"], r["num_tokens"]) == (100.0, 1.5, 345)
    assert r["load_avg_before"] == [1.23, 1, 1]
    md = demo_cost.markdown(r)
    assert "Wall time 100 s, peak RSS 1.50 GiB" in md and "| index build | 45.5 |" in md
    demo_cost.plot(r, tmp_path / "cost.png")
    assert (tmp_path / "cost.png").stat().st_size > 1000
    # a demo that reused an index did not pay for encoding and building: refused
    with pytest.raises(ValueError, match="reused an existing index"):
        demo_cost.phases({**timing, "index_reused": True}, 100.0)


def _random_store(directory, num_docs: int, shard_size: int, seed: int):
    """A 16-d store of random unit vectors (5–29 tokens per document, ids d0..), written with
    the public writer, with an ``encoder.json`` as the benchmarks copy it."""
    from aligner_jax.indexing import token_store as ts

    rng = np.random.default_rng(seed)
    model = {"name": "test", "fingerprint": "f", "dim": 16, "projection": "dense"}
    with ts.TokenStoreWriter(directory, model, shard_size=shard_size) as writer:
        for i in range(num_docs):
            n = int(rng.integers(5, 30))
            v = rng.standard_normal((n, 16)).astype(np.float32)
            v /= np.linalg.norm(v, axis=1, keepdims=True)
            writer.add(f"d{i}", v.astype(np.float16), rng.random(n).astype(np.float32),
                       rng.integers(0, 100, n).astype(np.int32))  # fmt: skip
    (directory / "encoder.json").write_text("{}")
    return writer.store


def test_build_throughput_grows_a_store_and_builds_its_index_in_a_child(tmp_path):
    from aligner_jax.indexing import token_store as ts

    base = tmp_path / "base"
    tokens = _random_store(base, 60, shard_size=20, seed=0).num_tokens
    out = tmp_path / "out"
    proc = run_python(
        REPO / "benchmarks" / "build_throughput.py",
        f"--base_store={base}", "--base_tokens=600", "--scales=3", "--platforms=cpu",
        "--sigma=0.05", "--threads=1", f"--output_dir={out}", f"--work_dir={tmp_path / 'w'}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out / "build_throughput.json").read_text())
    (row,) = result["rows"]
    cut = ts.TokenStore(tmp_path / "w" / "base")
    assert cut.num_tokens <= 600 < cut.num_tokens + 30 and cut.num_tokens < tokens
    assert row["job"] == "build" and row["platform"] == "cpu" and row["docs"] == 3 * cut.num_docs
    assert row["tokens"] > 2 * cut.num_tokens and row["num_centroids"] >= 1
    assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["wall_s"])
    assert 0 < row["kmeans_s"] <= row["kmeans_and_compress_s"] < row["wall_s"]
    assert 0.5 < row["mean_centroid_score"] <= 1.0 and row["peak_rss_gib"] > 0.1
    assert not (tmp_path / "w" / "x3").exists()  # grown stores are deleted after measuring
    assert "| build | cpu |" in (out / "build_throughput.md").read_text()


def test_scale_results_go_to_an_output_dir_that_does_not_exist_yet(tmp_path):
    """``scale.py --output_dir`` names a new folder: its rows are written there (they were
    lost, with the hours that measured them, when the folder did not exist)."""
    from benchmarks import scale

    row = json.loads((REPO / "benchmarks/results/scale.json").read_text())["rows"][0]
    out = tmp_path / "new" / "folder"
    rows = scale.write_results(out, [row])
    assert rows == [row] == json.loads((out / "scale.json").read_text())["rows"]
    assert f"| {row['model']} |" in (out / "scale.md").read_text()


def test_scale_rows_gathered_from_several_runs_say_when_each_was_measured():
    """Rows that name when they were measured (``benchmarks/results/scale.json`` gathers the
    latest of several runs) get a "measured" column, one cell per column in every line; rows
    without it keep the table as it was."""
    from benchmarks import scale

    row = json.loads((REPO / "benchmarks/results/scale.json").read_text())["rows"][0]
    plain = {k: v for k, v in row.items() if k != "measured"}
    assert "measured" not in scale.markdown([plain])
    dated = [{**plain, "measured": "stop 64"}, {**plain, "scale": 3.0}]
    lines = [x for x in scale.markdown(dated).splitlines() if x.startswith("|")]
    assert lines[0].endswith("| measured |")
    assert [line.endswith("| stop 64 |") for line in lines[2:]].count(True) == 1
    assert len({line.count("|") for line in lines}) == 1


def test_scale_rows_with_other_search_rules_sit_beside_the_default_rows(tmp_path):
    """A row measured with ``--search_config`` overrides does not replace the default row of
    the same store and bits; the table names each row's rules."""
    from benchmarks import scale

    row = json.loads((REPO / "benchmarks/results/scale.json").read_text())["rows"][0]
    default = {**row, "search_overrides": {}}
    other = {**row, "search_overrides": {"residual_candidates": True}, "p50_ms": 1234.5}
    scale.write_results(tmp_path, [default])
    rows = scale.write_results(tmp_path, [other])
    assert rows == [default, other]
    again = {**other, "p50_ms": 99.0}
    assert scale.write_results(tmp_path, [again]) == [default, again]
    table = (tmp_path / "scale.md").read_text()
    assert "| residual_candidates=True |" in table and "| default |" in table
    # build overrides (--index_config) make rows of their own too, named before the search's
    mapped = {**other, "index_overrides": {"token_lists": True}}
    assert scale.write_results(tmp_path, [mapped]) == [default, again, mapped]
    assert "| token_lists=True, residual_candidates=True |" in (tmp_path / "scale.md").read_text()
    # every field bound (a rebuild would keep the index's recorded settings): given or default
    import dataclasses

    from aligner_jax.indexing import centroid_index as ci

    bindings = scale.index_bindings({"token_lists": True, "residual_bits": 2})
    assert "--gin.CentroidIndexConfig.residual_bits=2" in bindings
    assert "--gin.CentroidIndexConfig.token_lists=True" in bindings
    assert "--gin.CentroidIndexConfig.num_centroids=None" in bindings
    assert "--gin.CentroidIndexConfig.token_lists=None" in scale.index_bindings({})
    assert len(bindings) == len(dataclasses.fields(ci.CentroidIndexConfig))


def test_scale_add_appends_to_a_grown_store_and_checks_it_against_a_rebuild(tmp_path):
    """``scale_add.py`` on a tiny grown store: the added documents are stored and indexed (a
    delta list group), the add is timed against the build, and the exhaustive ranking of the
    updated store equals the merge of the earlier one with the added documents' alone."""
    from aligner_jax.indexing import centroid_index as ci
    from aligner_jax.indexing import token_store as ts
    from benchmarks import scale

    source = tmp_path / "source"
    _random_store(source, 100, shard_size=25, seed=1)
    rng = np.random.default_rng(1)
    work = tmp_path / "work"
    config = ci.CentroidIndexConfig(num_centroids=32)
    scale.make_store(source, work / "x1", 1.0, 0.0)
    ci.CentroidIndex.build(ts.TokenStore(work / "x1"), config)
    scale.make_store(source, work / "x3", 3.0, scale.residual_sigma(work / "x1"), seed=3)
    ci.CentroidIndex.build(ts.TokenStore(work / "x3"), config)
    q = rng.standard_normal((12, 16)).astype(np.float32)
    np.savez(work / "queries.npz", ids=np.array(["a", "b"]), offsets=np.array([0, 5, 12]),
             vectors=q / np.linalg.norm(q, axis=1, keepdims=True), salience=rng.random(12))  # fmt: skip
    scale.exhaustive_child(work / "x3", work / "queries.npz", work / "x3" / "exhaustive.json")
    dataset = tmp_path / "ds"
    (dataset / "qrels").mkdir(parents=True)
    (dataset / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\na\td3\t1\nb\td7\t1\n")
    out = tmp_path / "out"
    proc = run_python(
        REPO / "benchmarks" / "scale_add.py", f"--index_dir={work / 'x3'}",
        f"--source_index={source}", "--fraction=0.05", "--build_s=10", "--check_exhaustive",
        f"--dataset_dir={dataset}", f"--output_dir={out}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads((out / "scale_add.json").read_text())["rows"]
    after = ts.TokenStore(work / "x3")
    assert row["added_docs"] == 15 and after.num_docs == 315 and after.doc_ids[-1] == "added-14"
    assert row["tokens_before"] + row["added_tokens"] == after.num_tokens
    assert row["list_groups"] == 2 and row["add_fraction_of_build"] == row["add_s"] / 10
    assert row["exhaustive_equals_rebuild"] is True
    assert row["queries_with_added_docs_in_top100"] == 2 and 0 <= row["top10_overlap"] <= 1
    table = (out / "scale_add.md").read_text()
    assert "| trained x3 |" in table
    header, rule, line = [t for t in table.splitlines() if t.startswith("|")]
    assert header.count("|") == rule.count("|") == line.count("|")  # one cell per column
    assert (out / "scale_add.png").stat().st_size > 1000


@pytest.mark.parametrize("threads", ["1", "2"])
def test_scale_exhaustive_reference_equals_brute_force_eq_1_2(tmp_path, monkeypatch, threads):
    """The scale benchmark's exhaustive reference (shards scored on threads, merged in shard
    order) ranks like Eq. 1–2 computed document by document, with u^d of the maximal token,
    tied documents in index order and deleted documents never returned."""
    from aligner_jax.indexing import token_store as ts
    from benchmarks import scale

    rng = np.random.default_rng(3)
    q = rng.standard_normal((13, 8)).astype(np.float32)
    u_q = rng.random(13).astype(np.float32)
    model = {"name": "test", "fingerprint": "f", "dim": 8, "projection": "dense"}
    docs = []
    with ts.TokenStoreWriter(tmp_path / "s", model, shard_size=7) as writer:
        for i in range(40):
            n = int(rng.integers(2, 12))
            v = rng.standard_normal((n, 8)).astype(np.float32)
            v = (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float16)
            if i in (30, 31):  # two identical documents: a tie
                v, u = docs[5]
            elif i == 12:  # query a's best document, deleted below
                v, u = (
                    (q[:6] / np.linalg.norm(q[:6], axis=1, keepdims=True)).astype(np.float16),
                    np.ones(6, np.float32),
                )
            else:
                u = (rng.random(n) * (rng.random(n) > 0.4)).astype(np.float32)  # zeros, as u^d
            docs.append((v, u))
            writer.add(f"d{i}", v, u, rng.integers(0, 50, len(v)).astype(np.int32))
    store = writer.store
    manifest = ts.read_manifest(store.directory)
    manifest["deleted"] = [12]
    ts.write_manifest(store.directory, manifest)
    np.savez(tmp_path / "q.npz", ids=np.array(["a", "b"]), offsets=np.array([0, 6, 13]),
             vectors=q, salience=u_q)  # fmt: skip
    monkeypatch.setenv("OMP_NUM_THREADS", threads)
    scale.exhaustive_child(store.directory, tmp_path / "q.npz", tmp_path / "out.json", k=10)
    found = json.loads((tmp_path / "out.json").read_text())
    found_scores = json.loads((tmp_path / "out.scores.json").read_text())
    for qid, (a, b) in (("a", (0, 6)), ("b", (6, 13))):
        scores = []
        for i, (v, u_d) in enumerate(docs):
            sims = v.astype(np.float32) @ q[a:b].T  # [tokens, query tokens]
            w = u_d[sims.argmax(0)] * u_q[a:b]
            z = w.sum()
            scores.append(-np.inf if i == 12 else (w * sims.max(0)).sum() / z if z > 0 else 0.0)
        expected = np.argsort(-np.array(scores), kind="stable")[:10]
        assert found[qid] == [f"d{i}" for i in expected]
        # (the store keeps u^d in float16, the reference here its float32 source)
        np.testing.assert_allclose(found_scores[qid], np.array(scores)[expected], rtol=1e-3)
    assert "d12" not in found["a"] + found["b"]


def test_query_path_ab_predecessors_give_what_the_current_code_gives(tmp_path):
    """The A/B benchmark times kept copies of replaced code: they must still compute the same."""
    import query_path_ab as ab
    from index_utils import random_documents, write_store

    from aligner_jax.indexing import centroid_index as ci
    from aligner_jax.indexing import documents as documents_lib
    from aligner_jax.retrieval import centroid_search as cs

    docs = random_documents(40, 8, seed=2, max_len=25)
    store = write_store(tmp_path / "idx", docs, 8, shard_size=9)
    picks = np.array([39, 0, 9, 17, 18, 3])
    for new, old in zip(
        store.gather_padded(picks, 32), ab.fancy_gather_padded(store, picks, 32), strict=True
    ):
        np.testing.assert_array_equal(new, old)
    store.MAX_OPEN_ARRAYS = 1  # the other shards are read from their files
    rows = int(sum(store.offsets[p + 1] - store.offsets[p] for p in picks))
    for kind, shape in (("vectors", (rows, 8)), ("salience", (rows,))):
        new = store.concatenated(kind, picks, np.empty(shape, np.float32))
        old = ab.opened_concatenated(store, kind, picks, np.empty(shape, np.float32))
        np.testing.assert_array_equal(new, old)
    del store.MAX_OPEN_ARRAYS  # the class's cap again
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, 50)
    values = rng.integers(0, 4, (lengths.sum(), 5)).astype(np.float32)  # ties
    u = rng.random(lengths.sum()).astype(np.float32)
    for new, old in zip(
        cs.segment_max(values, lengths, at_max=u),
        ab.reduceat_segment_max(values, lengths, at_max=u),
        strict=True,
    ):
        np.testing.assert_array_equal(new, old)
    for shard, start in enumerate(range(0, 40, 9)):
        rows = [
            documents_lib.IndexDocument(d.doc_id, f"t{d.doc_id}", "x", {"i": i})
            for i, d in enumerate(docs[start : start + 9], start=start)
        ]
        documents_lib.write_shard(store.directory, shard, rows)
    table = documents_lib.DocumentTable(store.directory, store.manifest["shards"])
    positions = [39, 0, 9, 17, 18, 3]
    new = table.fetch(positions)
    try:
        documents_lib.fetch_sql = ab.scan_fetch_sql
        old = table.fetch(positions)
    finally:
        documents_lib.fetch_sql = ab.NEW["fetch_sql"]
    assert new == old and [r["doc_id"] for r in new] == [store.doc_ids[p] for p in positions]
    index = ci.CentroidIndex.build(store, ci.CentroidIndexConfig(residual_bits=2, num_centroids=6))
    searcher = cs.CentroidSearcher(store, index)
    q = rng.standard_normal((3, 8)).astype(np.float32)
    top, top_scores, imputed = cs.probed(index.centroids @ q.T, 2)
    w = np.array([1.0, 0.5, 2.0], np.float32)
    new = searcher._score_probed(q, w, top, top_scores, imputed, None)
    old = ab.gathered_score_probed(searcher, q, w, top, top_scores, imputed, None)
    np.testing.assert_array_equal(new[0], old[0])
    np.testing.assert_allclose(new[1], old[1], atol=1e-5)
    assert len(new[0]) > 10
    # stage 2's float32 pass kept here, against the int16 one: the same documents, the same
    # scores up to float rounding (both multiply the same rounded weights); the one-loop int16
    # pass (before stop 68): the same integer sums, the same scores
    import threadpoolctl

    from aligner_jax.retrieval import probe_scores

    # (each on stop 77's query-token groups, ``grouped``: its sums added in another order than
    # the tiles' of today's threads, equal up to rounding on more than one thread)
    kernels = (
        (ab.float_accumulate, 1e-5),
        (ab.joint_accumulate, 1e-6),
        (ab.direct_accumulate, 1e-6),
        (ab.untouched_accumulate, 1e-6),
        (ab.untiled_accumulate, 1e-6),
        (ab.grouped_kernel, 1e-6),
    )
    for kernel, rtol in kernels:
        for threads in (1, 2):
            try:
                probe_scores.accumulate = ab.grouped(kernel)
                with threadpoolctl.threadpool_limits(threads):
                    before = searcher._score_probed(q, w, top, top_scores, imputed, None)
            finally:
                probe_scores.accumulate = ab.NEW["accumulate"]
            np.testing.assert_array_equal(before[0], new[0])
            np.testing.assert_allclose(before[1], new[1], rtol=rtol, atol=1e-6)
    # the lists by position, rows touched in blocks (stop 73's touch loop too) or scored as
    # read: the same as the copy
    searcher._token_lists = searcher._build_token_lists(by_position=True)
    for accumulate in (
        ab.NEW["accumulate"],
        ab.grouped(ab.untouched_accumulate),
        ab.grouped(ab.looped_accumulate),
        ab.grouped(ab.untiled_accumulate),
        ab.grouped(ab.grouped_kernel),
    ):
        try:
            probe_scores.accumulate = accumulate
            by_position = searcher._score_probed(q, w, top, top_scores, imputed, None)
        finally:
            probe_scores.accumulate = ab.NEW["accumulate"]
        np.testing.assert_array_equal(by_position[0], new[0])
        np.testing.assert_allclose(by_position[1], new[1], rtol=1e-6, atol=1e-6)
    # stop 65's reach (√N at every k): what the current rule gives at k ≤ 10, less at k = 100
    for n in (5183, cs.REACH_DOCS, 10 * cs.REACH_DOCS):
        assert ab.sqrt_reach_factor(n, 10) == pytest.approx(cs.reach_factor(n, 10))
        assert ab.sqrt_reach_factor(n) == pytest.approx(max(1.0, (n / cs.REACH_DOCS) ** 0.5))
    assert ab.sqrt_reach_factor(10 * cs.REACH_DOCS, 100) < cs.reach_factor(10 * cs.REACH_DOCS, 100)
    # the residual interaction's token choice, gathered then compared as before
    from aligner_jax.retrieval import gather_max

    s_t = np.ascontiguousarray((q @ index.centroids.T).T)
    codes = np.asarray(index.codes[np.arange(store.num_tokens)])
    lengths = np.diff(store.offsets)
    best = gather_max.gather_segment_max(s_t, codes, lengths, reference=cs.segment_max)
    for weights in (w, np.array([1.0, 0.0, 2.0], np.float32)):
        want = gather_max.tokens_at_best(s_t, codes, lengths, best, weights, reference=cs._at_best)
        got = ab.gathered_tokens_at_best(s_t, codes, lengths, best, weights)
        np.testing.assert_array_equal(got, want)
    # stage 2's selections and tail (before stop 69): the same rankings at every k, the tail
    # reached (k beyond stage 3's documents) and not
    scores = rng.standard_normal(9000).astype(np.float32)
    for m in (5, 100, 1200):
        np.testing.assert_array_equal(ab.partition_top(scores, m), cs._top(scores, m))
        assert set(ab.partition_best(scores, m).tolist()) == set(cs._best(scores, m).tolist())
    # stop 69's threshold selection (ties at the threshold partitioned): the same indices
    tied = rng.integers(0, 3, size=9000).astype(np.float32)
    for values in (scores, tied):
        for m in (5, 100, 1100):
            np.testing.assert_array_equal(ab.inclusive_best(values, m), cs._best(values, m))
    u_q = np.array([1.0, 0.5, 2.0], np.float32)
    for k in (3, 10, 40):
        new = searcher.search(q, u_q, np.arange(3), k)
        old = ab.eager_tail_search(searcher, q, u_q, np.arange(3), k)
        np.testing.assert_array_equal(old[0][0][0], new[0][0][0])
        np.testing.assert_array_equal(old[0][0][1], new[0][0][1])
        assert old[1] == new[1]


def test_scale_ratio_interleaves_scales_per_query_and_bounds_the_ratio(monkeypatch):
    """``scale_ratio``: every query runs on every searcher in each pass, the first of them
    rotating query by query; only the timed passes are kept; the bootstrap interval of the
    p50 ratio holds the ratio of the per-query medians, and is a point for constant times."""
    import scale_ratio

    calls = []

    class Fake:
        def __init__(self, name, ms):
            self.name, self.ms = name, ms

        def search(self, q, u, rows, k):
            calls.append((self.name, len(q), k))

    queries = [(str(i), np.zeros((i + 1, 4), np.float32), np.ones(i + 1)) for i in range(3)]
    clock = iter(np.arange(0.0, 100.0, 0.001))
    monkeypatch.setattr(scale_ratio.time, "perf_counter", lambda: next(clock))
    ms = scale_ratio.interleaved(queries, {"1": Fake("1", 0), "100": Fake("100", 0)}, 7, 2)
    assert len(calls) == 3 * 3 * 2 and {c[2] for c in calls} == {7}
    firsts = [calls[i][0] for i in range(0, len(calls), 2)]
    assert firsts[:3] == ["1", "100", "1"] and firsts[3:6] == ["100", "1", "100"]
    assert [c[1] for c in calls[:2]] == [1, 1]  # both searchers get the same query
    assert ms["1"].shape == (3, 2) and np.allclose(ms["1"], 1.0)  # one tick of the clock each
    rng = np.random.default_rng(0)
    base = rng.uniform(4, 6, (50, 2))
    other = 3 * base + rng.normal(0, 0.1, (50, 2))
    lo, hi = scale_ratio.ratio_interval(base, other, 500)
    assert lo < np.median(np.median(other, 1)) / np.median(np.median(base, 1)) < hi
    assert 2.8 < lo < hi < 3.2
    assert scale_ratio.ratio_interval(np.ones((9, 2)), np.full((9, 2), 2.5), 50) == [2.5, 2.5]
    # a folder that is not a scale (another index of one store) keeps its name in the rows
    assert [scale_ratio.scale_label(s) for s in ("1", "100", "0.5", "100c")] == [
        1.0, 100.0, 0.5, "100c"
    ]  # fmt: skip


def test_scale_quality_separates_the_distractors_from_the_collection(tmp_path):
    """``scale.quality`` says how much of the gap to exhaustive search the distractors make:
    their share of the exhaustive top 10, and the top-10 overlap over the collection's own
    documents only; with a k = 10 search's rankings, that search's top-10 overlap."""
    from benchmarks import scale

    real = [f"d{i}" for i in range(20)]
    noise = [f"{scale.DISTRACTOR}-{i}" for i in range(20)]
    # exhaustive: 4 distractors among the first 10; ours finds none of them, and ranks the
    # collection's own documents in exhaustive search's order
    exact = {"q1": noise[:4] + real[:6] + real[6:20] + noise[4:]}
    found = {"q1": real[:20]}
    found_k10 = {"q1": real[:8] + noise[:2]}
    qrels = {"q1": {"d0": 1}}
    result = scale.quality(found, exact, qrels, found_k10)
    assert result["top10_overlap"] == pytest.approx(0.6)  # d0..d5 of the 10
    assert result["exhaustive_top10_distractors"] == pytest.approx(0.4)
    assert result["top10_overlap_real"] == pytest.approx(1.0)  # d0..d9 in both
    assert result["top10_overlap_k10"] == pytest.approx(0.8)  # d0..d5 and two distractors
    assert scale.is_real("d3") and not scale.is_real(noise[0])
    # a row measured before these columns existed still renders
    row = json.loads((REPO / "benchmarks/results/scale.json").read_text())["rows"][0]
    new = ("top10_overlap_k10", "exhaustive_top10_distractors", "top10_overlap_real")
    old = {k: v for k, v in row.items() if k not in new}
    line = [x for x in scale.markdown([old]).splitlines() if x.startswith(f"| {row['model']}")]
    assert line and line[0].count("not measured") == 3
    assert line[0].count("|") == scale.markdown([old]).splitlines()[6].count("|")


def test_tune_search_picks_the_cheapest_admissible_setting_at_each_k():
    """``tune_search.choose``: at k = 100 the cheapest setting (p50 at k = 100) within the
    overlap, nDCG@10 and R@100 bounds; at k = 10 the cheapest (p50 at k = 10) with top-10
    overlap ≥ 0.95 and nDCG@10 within 0.5 point of exhaustive; None where nothing qualifies."""
    from benchmarks import tune_search

    def row(probe_docs, overlap10, overlap100, ndcg, p50_k10, p50_k100):
        return {"probe_docs": probe_docs, "top10_overlap": overlap10,
                "top100_overlap": overlap100, "ndcg@10": ndcg, "ndcg@10_exhaustive": 0.735,
                "recall@100": 0.93, "recall@100_exhaustive": 0.93, "p50_ms_k10": p50_k10,
                "p50_ms_k100": p50_k100}  # fmt: skip

    rows = [row(640, 0.946, 0.754, 0.736, 6.7, 16.8), row(1280, 0.978, 0.879, 0.735, 7.3, 18.2),
            row(2560, 0.985, 0.967, 0.735, 10.1, 18.9)]  # fmt: skip
    at100, at10 = tune_search.choose(rows)
    assert (at100["probe_docs"], at10["probe_docs"]) == (2560, 1280)
    rows[1]["ndcg@10"] = 0.729  # 0.6 point under exhaustive
    assert tune_search.choose(rows)[1]["probe_docs"] == 2560
    assert tune_search.choose(rows[:1]) == (None, None)


def test_query_styles_sets_and_overlaps(tmp_path):
    """``query_styles``: a collection's three query sets (its queries, titles of >= 3 words, one
    sentence of >= 8 words per document; fixed seeds), and overlaps with exhaustive rankings at
    k = 10 and 100 (mean and worst query) from a searcher's hits."""
    from fixtures import write_beir_fixture

    from benchmarks import query_styles

    long = "one two three four five six seven eight nine."
    docs = {
        f"d{i}": {"title": f"a title {i}" if i % 2 else "short", "text": f"Tiny. {long} {long}"}
        for i in range(12)
    }
    write_beir_fixture(tmp_path, docs, {f"q{i}": f"query {i}" for i in range(5)}, {"q0": {"d0": 1}})
    sets = query_styles.query_sets(tmp_path, "toy", 4)
    assert sorted(sets) == ["toy-queries", "toy-sentences", "toy-titles"]
    assert len(sets["toy-queries"]) == 4 and set(sets["toy-queries"]) < {
        f"query {i}" for i in range(5)
    }
    assert len(sets["toy-titles"]) == 4 and all(t.startswith("a title") for t in sets["toy-titles"])
    assert sets["toy-sentences"] == [long] * 4  # "Tiny." is too short
    assert query_styles.query_sets(tmp_path, "toy", 4) == sets  # seeded

    class Hit:
        def __init__(self, doc_id):
            self.doc_id = doc_id

    class Encoded:
        vectors, salience = np.zeros((2, 4), np.float32), None

    class Fake:  # finds d0..d(k-1) but d1 (replaced by x)
        def search_vectors(self, vectors, k, salience=None):
            return [Hit("x" if i == 1 else f"d{i}") for i in range(k)]

    exact = [[f"d{i}" for i in range(100)], [f"d{i}" for i in range(50, 150)]]
    row = query_styles.measure(Fake(), [Encoded(), Encoded()], exact)
    assert row["top10_overlap"] == pytest.approx((0.9 + 0.0) / 2)
    assert row["worst_top10_overlap"] == 0.0
    assert row["top100_overlap"] == pytest.approx((0.99 + 0.50) / 2)
    assert row["p50_ms_k10"] >= 0


def test_query_styles_says_where_missed_documents_were_lost():
    """``query_styles.misses``: each exhaustive top-k document the search did not return counts
    once, as unreached (not a stage-2 candidate), unrefined (a candidate, not refined) or
    outranked (refined, ranked out); the recording wrappers are gone afterwards."""
    from benchmarks import query_styles

    class Hit:
        def __init__(self, doc_id):
            self.doc_id = doc_id

    class Encoded:
        vectors, salience = np.zeros((2, 4), np.float32), None

    class Centroid:
        def candidates(self, *args):  # the centroid-interaction path's stage 2 (not taken here)
            raise AssertionError("not called")

        def residual_candidates(self, *args):
            return np.array([0, 1, 2, 3]), np.zeros(4, np.float32)

        def refine(self, q, s_t, docs, u_q, **kwargs):
            return np.zeros(len(docs), np.float32)

    class Searcher:  # reaches d0-d3, refines d0-d2 (a residual interaction first), returns d0, d1
        centroid = Centroid()
        store = type("Store", (), {"doc_ids": [f"d{i}" for i in range(8)]})()

        def search_vectors(self, vectors, k, salience=None):
            self.centroid.residual_candidates()
            self.centroid.refine(None, None, np.array([0, 3]), None, best_centroids=1)
            self.centroid.refine(None, None, np.array([0, 1, 2]), None)
            return [Hit(d) for d in ("d0", "d1", "d6", "d7")]

    searcher = Searcher()
    exact = [["d0", "d2", "d3", "d4", "d5"], ["d1", "d0", "d6", "d7", "d5"]]
    found = query_styles.misses(searcher, [Encoded(), Encoded()], exact, k=4)
    # query 1 misses d2 (refined), d3 (reached), d4 (not reached); query 2 misses none of its 4
    assert found == {
        "missed_unreached": 1 / 8,
        "missed_unrefined": 1 / 8,
        "missed_outranked": 1 / 8,
    }
    assert not vars(searcher.centroid)  # the class's methods again


@pytest.mark.parametrize("beta_d", [1.0, 0.6])
def test_lists_build_ab_predecessor_gives_what_the_current_code_gives(tmp_path, beta_d):
    """``lists_build_ab.py`` times stop 73's lists by position against the current build: the
    kept copy must still give the same arrays (several shards and segments, β^d pruning)."""
    import lists_build_ab as ab
    from index_utils import random_documents, write_store

    from aligner_jax.indexing import centroid_index as ci
    from aligner_jax.indexing import token_store as ts
    from aligner_jax.indexing import updates

    docs = random_documents(60, 8, seed=3, max_len=25)
    store = write_store(tmp_path / "idx", docs[:45], 8, shard_size=9)
    ci.CentroidIndex.build(store, ci.CentroidIndexConfig(num_centroids=8, beta_d=beta_d))
    updates.add_encoded(store.directory, docs[45:])
    store = ts.TokenStore(store.directory)
    index = ci.CentroidIndex.load(store)
    args = (store, index.codes, index.residuals, 8, beta_d)
    got, want = ab.BUILDERS["current"](*args), ab.stop73_token_rows_in_memory(*args)
    assert len(got) == len(want) == 2  # the build's segment and the add's
    for a, b in zip(got, want, strict=True):
        for field in ("offsets", "docs", "rows"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_scale_rows_record_the_machine_speed_next_to_the_load():
    """``scale.speed_probe`` times a fixed product and a memory-bound sum (positive medians, in
    ms); a row that holds one shows it in the table's load cell, a row without one only its
    load average."""
    from benchmarks import scale

    probe = scale.speed_probe(repeats=3)
    assert set(probe) == {"matmul", "stream"}
    assert all(np.isfinite(v) and v > 0 for v in probe.values())
    row = json.loads((REPO / "benchmarks/results/scale.json").read_text())["rows"][0]
    plain = {k: v for k, v in row.items() if k not in ("speed_probe_ms", "measured")}
    assert scale.load_cell(plain) == f"{row['machine_load']:.1f}"
    timed = plain | {"speed_probe_ms": {"before": {"matmul": 2.345, "stream": 31.26}}}
    assert scale.load_cell(timed) == f"{row['machine_load']:.1f}; probe 2.35 / 31.3 ms"
    line = [x for x in scale.markdown([timed]).splitlines() if x.startswith(f"| {row['model']}")]
    assert line[0].endswith(f"| {row['machine_load']:.1f}; probe 2.35 / 31.3 ms |")


def test_compaction_drift_reference_of_every_token_is_their_mean_best_centroid_score(tmp_path):
    """``compaction_drift._all_token_reference`` (the rule before stop 83) is the mean, over
    every stored token, of its best centroid score (brute force over all centroids here: the
    index has one cell), and the index's own reference is that of the held-out tokens."""
    import compaction_drift

    from aligner_jax.indexing import centroid_index as ci

    store = _random_store(tmp_path / "s", 80, shard_size=15, seed=3)
    config = ci.CentroidIndexConfig(num_centroids=16, cells=1, seed=0)
    index = ci.CentroidIndex.build(store, config, commit=False)
    vectors = np.asarray(store.vectors(), np.float32)
    brute = float((vectors @ np.asarray(index.centroids, np.float32).T).max(1).mean())
    assert compaction_drift._all_token_reference(store, index) == pytest.approx(brute, abs=1e-5)
    assert 0 < index.meta["mean_centroid_score"] <= 1.0


def test_compaction_drift_compares_both_references_on_a_small_index(tmp_path):
    """The benchmark end to end on the toy corpus (zero-shot MiniLM): a base store of part of
    the documents, one addition of the rest and one of another corpus, each row's drift the
    reference minus the added tokens' mean score, ``compacts`` the rule's verdict, and the
    JSON, Markdown and PNG written."""
    from fixtures import TOY_DOCS, run_module, write_beir_fixture, write_toy_beir

    data = write_toy_beir(tmp_path)
    index_dir = tmp_path / "index"
    r = run_module(
        "aligner_jax.index",
        "--gin_file=models/minilm_identity.gin",
        f"--corpus={data / 'corpus.jsonl'}",
        f"--index_dir={index_dir}",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    other = write_beir_fixture(
        tmp_path, {"o1": "quantum field theory of gauge bosons", "o2": "medieval poetry"}, {}, {},
        name="other",
    )  # fmt: skip
    out = tmp_path / "out"
    proc = run_python(
        REPO / "benchmarks" / "compaction_drift.py",
        f"--index_dir={index_dir}", f"--other_corpus={other / 'corpus.jsonl'}", "--other_docs=2",
        "--base_fraction=0.6", f"--work_dir={tmp_path / 'work'}", f"--output_dir={out}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out / "compaction_drift.json").read_text())
    base = int(len(TOY_DOCS) * 0.6)
    assert result["base_docs"] == base
    same, another = result["rows"]
    assert (same["docs"], another["docs"]) == (len(TOY_DOCS) - base, 2)
    for row in result["rows"]:
        assert row["tokens"] > 0
        assert row["drift"] == pytest.approx(result["reference_held_out"] - row["mean_score"])
        assert row["drift_all_token_reference"] == pytest.approx(
            result["reference_every_token"] - row["mean_score"]
        )
        assert row["compacts"] == (row["drift"] > result["drift_limit"])
    assert "| another corpus | 2 |" in (out / "compaction_drift.md").read_text()
    assert (out / "compaction_drift.png").stat().st_size > 0
    assert not (tmp_path / "work").exists()  # the scratch stores are removed


def test_vacuum_benchmark_on_a_small_index_loses_no_answer(tmp_path):
    """The vacuum benchmark end to end on the toy corpus: a third of the documents deleted,
    the vacuum in a child, the store smaller, every exhaustive answer identical."""
    from fixtures import TOY_DOCS, run_module, write_toy_beir

    data = write_toy_beir(tmp_path)
    index_dir = tmp_path / "index"
    r = run_module(
        "aligner_jax.index",
        "--gin_file=models/minilm_identity.gin",
        f"--corpus={data / 'corpus.jsonl'}",
        f"--index_dir={index_dir}",
        "--gin.IndexingConfig.shard_size=3",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "out"
    proc = run_python(
        REPO / "benchmarks" / "vacuum.py",
        f"--index_dir={index_dir}", f"--dataset_dir={data}", "--delete_fraction=0.34",
        f"--work_dir={tmp_path / 'work'}", f"--output={out}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out / "vacuum.json").read_text())
    assert result["deleted_docs"] == 4 and result["live_docs"] == len(TOY_DOCS) - 4
    assert result["vacuum"]["removed_docs"] == 4 and result["vacuum"]["peak_rss_gib"] > 0
    disk = result["disk"]
    assert disk["after"]["store_bytes"] < disk["before"]["store_bytes"]
    assert disk["after_second"]["table_bytes"] <= disk["after"]["table_bytes"]
    answers = result["answers"]
    assert answers["exhaustive_same_ids"] == answers["queries"] > 0
    assert answers["exhaustive_max_score_diff"] < 1e-5
    assert "| after |" in (out / "vacuum.md").read_text()
    assert (out / "vacuum.png").stat().st_size > 0


def _fake_eval(folder, dataset, model, results, ndcg10, centroids=2048):
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(results))
    metrics_json = {
        "dataset": dataset,
        "split": "test",
        "num_queries": 3,
        "num_docs": 4,
        "config": {
            "model": model,
            "model_fingerprint": model,
            "search": "centroid",
            "centroid_stages": {"probes": 32, "num_centroids": centroids},
        },
        "metrics": {"ndcg@10": ndcg10},
    }
    (folder / "metrics.json").write_text(json.dumps(metrics_json))


def test_false_negatives_compares_two_models_query_by_query(tmp_path):
    from fixtures import write_beir_fixture

    from aligner_jax.evaluation import metrics

    data = write_beir_fixture(
        tmp_path,
        {"a": "x", "b": "y", "c": "z", "d": "w"},
        {"q1": "one", "q2": "two", "q3": "three"},
        {"q1": {"a": 1}, "q2": {"b": 1}, "q3": {"c": 1}},
    )
    qrels = {"q1": {"a": 1}, "q2": {"b": 1}, "q3": {"c": 1}}
    # the treatment ranks q2's relevant document first (was second); q1 and q3 unchanged
    base = {"q1": {"a": 2.0, "b": 1.0}, "q2": {"a": 2.0, "b": 1.0}, "q3": {"c": 1.0}}
    treat = {"q1": {"a": 2.0, "b": 1.0}, "q2": {"b": 2.0, "a": 1.0}, "q3": {"c": 1.0}}
    logs = {}
    for name, run, fn in (("off", base, None), ("on", treat, 0.25)):
        model = tmp_path / f"model_{name}"
        model.mkdir()
        rows = [{"step": s, "loss": 1.0 / s, "accuracy": 0.5} for s in range(1, 61)]
        if fn is not None:
            for r in rows:
                r["false_negatives"] = fn
        logs[name] = rows
        (model / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        ndcg = metrics.evaluate_run(qrels, run, (10,))["ndcg@10"]
        # each model's store resolves its own centroid count (tokens of salience 0 left out)
        centroids = 4096 if name == "on" else 2048
        _fake_eval(tmp_path / f"eval_{name}", "toy", f"{model}@60", run, ndcg, centroids)
    control = tmp_path / "control.jsonl"
    control.write_text("".join(json.dumps(r) + "\n" for r in logs["off"][:6]))
    args = [
        f"--dataset_dirs={data}",
        f"--baseline_evals={tmp_path / 'eval_off'}",
        f"--treatment_evals={tmp_path / 'eval_on'}",
        f"--control_log={control}",
        "--bootstrap=200",
        f"--output={tmp_path / 'out'}",
    ]
    proc = run_python(REPO / "benchmarks" / "false_negatives.py", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "out" / "false_negatives.json").read_text())
    (row,) = results["rows"]
    expected = (1 - 1 / np.log2(3)) / 3  # q2 goes from rank 2 to rank 1, one query in three
    assert row["ndcg@10"]["difference"] == pytest.approx(expected)
    assert (row["ndcg@10"]["queries_up"], row["ndcg@10"]["queries_down"]) == (1, 0)
    assert row["recall@100"]["difference"] == 0.0 and row["recall@100"]["ci95"] == [0.0, 0.0]
    lo, hi = row["ndcg@10"]["ci95"]
    assert 0.0 <= lo <= expected <= hi
    assert results["training"]["mask"]["false_negatives_per_row"] == pytest.approx(0.25)
    assert results["training"]["no mask"]["false_negatives_per_row"] is None
    assert results["control"]["steps_compared"] == [1, 2, 3, 4, 5, 6]
    assert results["control"]["max_abs_loss_difference"] == 0.0
    assert (tmp_path / "out" / "false_negatives.png").exists()
    assert (row["baseline_store"], row["treatment_store"]) == (
        {"num_centroids": 2048},
        {"num_centroids": 4096},
    )
    # another search setting on one side is refused, naming it (a chosen stage setting too)
    metrics_path = tmp_path / "eval_on" / "metrics.json"
    changed = json.loads(metrics_path.read_text())
    changed["config"]["centroid_stages"]["probes"] = 64
    metrics_path.write_text(json.dumps(changed))
    proc = run_python(REPO / "benchmarks" / "false_negatives.py", *args)
    assert proc.returncode != 0 and "searched differently: ['centroid_stages']" in proc.stderr
    metrics_path = tmp_path / "eval_on" / "metrics.json"
    changed = json.loads(metrics_path.read_text())
    changed["config"]["search"] = "exhaustive"
    metrics_path.write_text(json.dumps(changed))
    proc = run_python(REPO / "benchmarks" / "false_negatives.py", *args)
    assert proc.returncode != 0
    assert "searched differently: ['centroid_stages', 'search']" in proc.stderr
