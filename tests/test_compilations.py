"""No XLA compilation after ``Searcher.load`` (issue 27 item 4).

Compilations are counted with JAX's own monitoring hook (``aligner_jax.common.compilations``:
the ``backend_compile_duration`` event every compilation records, a persistent-cache hit
included). ``Searcher.load`` compiles, once, every shape a single query takes
(``refine.warm_up``: the query encoder's length buckets, the fixed-shape refinement of each query
bucket); afterwards queries of any length, a rerank and other alignment strategies compile
nothing. The fixed-shape refinement scores exactly as the per-length-bucket path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json

import jax
import numpy as np
import pytest
from fixtures import (
    REPO,
    TOY_DOCS,
    TOY_QRELS,
    TOY_QUERIES,
    run_module,
    run_python,
    write_beir_fixture,
    xla_flags,
)
from index_utils import random_documents, write_store

from aligner_jax.common import compilations as compile_counter
from aligner_jax.core import scoring
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import EncodedText, Encoder, EncodingConfig
from aligner_jax.retrieval import centroid_search, refine, sharded_search
from aligner_jax.retrieval import searcher as search_lib


@contextlib.contextmanager
def compilations():
    """Collects the name of every function compiled (or loaded from a persistent compilation
    cache) inside the block."""
    with compile_counter.counting() as counter:
        yield counter.names


def test_the_counter_sees_a_compilation():
    with compilations() as names:
        jax.jit(lambda x: x * 3.0 + 1.0)(np.ones(7, np.float32)).block_until_ready()
    assert names == ["jit(<lambda>)"]


CACHE_SCRIPT = r"""
import jax, numpy as np
from aligner_jax.common import compilations
with compilations.counting() as counter:
    jax.jit(lambda x: x * 5.0 - 2.0)(np.ones(9, np.float32)).block_until_ready()
print(counter.names, counter.cache_hits)
"""


def test_a_persistent_cache_hit_counts_as_a_compilation(tmp_path):
    """With ``JAX_COMPILATION_CACHE_DIR`` set, a second process loads
    the first one's executable instead of compiling it: still counted as a compilation."""
    env = {
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    seen = []
    for _ in range(2):
        out = run_python("-c", CACHE_SCRIPT, **env)
        assert out.returncode == 0, out.stderr[-2000:]
        seen.append(out.stdout.strip().splitlines()[-1])
    assert seen == ["['jit(<lambda>)'] 0", "['jit(<lambda>)'] 1"]


def test_query_and_refinement_buckets():
    config = EncodingConfig()
    assert config.bucket_lengths(512, "query") == (16, 32, 48, 64, 128, 256, 512)
    assert config.bucket_lengths(70, "query") == (16, 32, 48, 64, 70)
    assert config.bucket_lengths(40, "query") == (16, 32, 40)
    assert config.bucket_lengths(256, "doc") == (32, 64, 96, 128, 160, 192, 224, 256)
    assert config.bucket_lengths(256) == config.bucket_lengths(256, "doc")
    refine_config = refine.RefineConfig()
    assert refine_config.query_buckets_upto(512) == (16, 32, 48, 64, 128, 256, 512)
    assert refine_config.query_buckets_upto(40) == (16, 32, 48)
    assert refine.RefineConfig(query_length_buckets=(16,)).query_buckets_upto(70) == (
        16,
        32,
        64,
        96,
    )


def test_fixed_shape_refinement_scores_as_the_bucketed_path(tmp_path):
    store = write_store(tmp_path / "store", random_documents(40, 8, seed=3, max_len=70), dim=8)
    rng = np.random.default_rng(0)

    def query(m: int) -> EncodedText:
        v = rng.normal(size=(m, 8)).astype(np.float32)
        return EncodedText(
            token_ids=rng.integers(5, 60, m).astype(np.int32),
            vectors=v / np.linalg.norm(v, axis=1, keepdims=True),
            salience=rng.uniform(0.2, 1.0, m).astype(np.float32),
        )

    queries = [query(5), query(23)]
    batch = refine.QueryBatch.from_encoded(queries, 32)
    candidates = [rng.choice(40, 17, replace=False), np.arange(40)[::-1]]
    strategies = tuple(scoring.AlignmentStrategy.parse(s) for s in ("top_k:1", "top_k:3"))
    fixed = refine.Refiner(store, refine.RefineConfig(block_docs=16))
    bucketed = refine.Refiner(store, refine.RefineConfig(fixed_shape_docs=0))
    assert fixed.max_length == 96 and len(bucketed.buckets) == 3
    got = fixed.score(batch, candidates, strategies)
    want = bucketed.score(batch, candidates, strategies)
    for g, w, c in zip(got, want, candidates, strict=True):
        assert g.shape == (2, len(c)) and np.isfinite(g).all()
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("salience", [True, False])
def test_top1_on_the_host_scores_as_the_jax_kernel(tmp_path, salience):
    """``RefineConfig.host_top1``: top-1 alignment without JAX (a product and a compiled maximum
    per chunk of store rows) gives the kernel's scores for every candidate list — the whole
    store in chunks smaller than one document, a subset, a rerank's few — with and without u^d."""
    docs = random_documents(40, 8, seed=5, min_len=1, max_len=70)
    store = write_store(tmp_path / "store", docs, dim=8)
    rng = np.random.default_rng(1)
    queries = []
    for m in (1, 6, 23):
        v = rng.normal(size=(m, 8)).astype(np.float32)
        u = rng.uniform(0.0, 1.0, m).astype(np.float32)
        u[0] = 0.0  # a query token of weight 0 adds nothing (Eq. 2)
        queries.append(EncodedText(np.arange(m, dtype=np.int32), v, u))
    batch = refine.QueryBatch.from_encoded(queries, 32)
    everything = np.arange(40)
    candidates = [everything, rng.choice(40, 9, replace=False), everything[::-1]]
    kernel = refine.Refiner(store, refine.RefineConfig(host_top1=False), salience=salience)
    want = kernel.score(batch, candidates, refine.TOP1)
    host = refine.Refiner(store, refine.RefineConfig(), salience=salience)
    got = host.score(batch, candidates, refine.TOP1)
    for g, w, c in zip(got, want, candidates, strict=True):
        assert g.shape == (1, len(c))
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
    # chunks of 64 floats: one document (up to 70 tokens) per chunk, most larger than it
    small = centroid_search.stored_top1_scores(
        store,
        everything,
        [(q.vectors, q.salience) for q in queries],
        salience,
        max_elements=64,
    )
    whole = kernel.score(batch, [everything] * 3, refine.TOP1)
    np.testing.assert_allclose(small, np.stack([w[0] for w in whole]), rtol=0, atol=1e-5)


def test_top1_on_the_host_compiles_nothing_at_warm_up(tmp_path):
    """The fixed shapes ``warm_up`` compiles are those the JAX kernel would run: none for
    top-1 alone scored on the host; the other strategies' (and top-1's without it) still."""
    store = write_store(tmp_path / "store", random_documents(12, 8, seed=2), dim=8)
    top3 = [("top_k:3",)]
    assert refine.Refiner(store).warm_up(40, [("top_k:1",)]) == 0
    assert refine.Refiner(store).warm_up(40, top3) == 3  # query buckets 16, 32, 48
    kernel = refine.Refiner(store, refine.RefineConfig(host_top1=False))
    assert kernel.warm_up(40, [("top_k:1",)]) == 3


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    """aligner-index of the toy corpus with the tiny random model (dense projection, LP
    saliences: the trained model's graph)."""
    root = tmp_path_factory.mktemp("compilations")
    corpus = write_beir_fixture(root, TOY_DOCS, TOY_QUERIES, TOY_QRELS) / "corpus.jsonl"
    r = run_module(
        "aligner_jax.index",
        "--gin_file=models/bert_tiny.gin",
        f"--corpus={corpus}",
        f"--index_dir={root / 'index'}",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return root / "index"


@pytest.fixture(scope="module")
def encoder(index_dir):
    """The index's model, queries cut at 64 tokens (buckets 16, 32, 48, 64: few compilations in
    CI; ``whole_query_encoder``'s 512 adds 128, 256 and 512, see above)."""
    spec = json.loads((index_dir / "encoder.json").read_text())
    return Encoder(loading.encoder_from_spec(spec), EncodingConfig(), query_maxlen=64)


# Queries of 1 to 150 words: every encoder and refinement bucket, and past the 64-token budget.
QUERIES = ["honey " * n for n in (1, 5, 13, 14, 15, 30, 31, 40, 62, 63, 64, 90, 150)]


@pytest.mark.parametrize(
    "mode, alignment",
    [("fast", "top_k:1"), ("fast", "top_k:2"), ("exhaustive", "top_k:1"), ("device", "top_k:1")],
)
def test_no_compilation_after_load(index_dir, encoder, mode, alignment):
    """``device``: the exhaustive search on the devices of a mesh (``sharded_search``), whose
    k and query batch are rounded up to powers of two."""
    searcher = search_lib.Searcher.load(
        str(index_dir), mode=mode, encoder=encoder, alignment=alignment
    )
    assert (searcher.sharded is not None) == (mode == "device")
    doc_ids = list(searcher.store.doc_ids)
    encoded = encoder.encode(QUERIES, "query")
    assert {len(e.token_ids) for e in encoded} >= {3, 16, 17, 32, 33, 64}
    with compilations() as names:
        for text in QUERIES:
            assert searcher.search(text, k=3)
            assert len(searcher.search(text, k=100)) == min(100, len(doc_ids))
        candidates = {str(i): doc_ids[i % 3 :] for i in range(len(QUERIES))}
        qids = list(candidates)
        out = searcher.rerank(qids, encoded, candidates, show_progress=False)
        assert [len(out.results["top_k:1"][q]) for q in qids[:3]] == [12, 11, 10]
    assert names == []


def test_encoding_a_query_transfers_only_its_tokens(encoder):
    """The model's parameters live on the device from construction: a query's encoding moves
    its ids and mask explicitly and nothing implicitly (NumPy parameters — a restored
    checkpoint's — would be transferred again by every call, ~0.5 ms a query for MiniLM's 106
    arrays on the CPU)."""
    bundle = dataclasses.replace(
        encoder.bundle, params=jax.tree_util.tree_map(np.asarray, encoder.bundle.params)
    )
    encoder = Encoder(bundle, EncodingConfig(), query_maxlen=64)
    expected = encoder.encode(["honey bees"], "query")[0]
    with jax.transfer_guard_host_to_device("disallow"):
        again = encoder.encode(["honey bees"], "query")[0]
    np.testing.assert_array_equal(again.vectors, expected.vectors)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(encoder._params))


@pytest.mark.parametrize(
    "knobs", [{"residual_candidates": True}, {}, {"residual_candidates": False}]
)
def test_residual_candidates_build_their_token_lists_at_load(index_dir, encoder, knobs):
    """With residual candidates (on by default where their lists fit) the centroid → token
    lists are built by ``Searcher.load``, not by the first query (the centroid interaction
    path never needs them)."""
    config = centroid_search.CentroidSearchConfig(**knobs)
    searcher = search_lib.Searcher.load(str(index_dir), encoder=encoder, centroid_config=config)
    on = knobs.get("residual_candidates", True)
    assert searcher.centroid.config.residual_candidates is on
    assert (searcher.centroid._token_lists is not None) == on
    with compilations() as names:
        assert searcher.search(QUERIES[1], k=3)
    assert names == []


def test_two_level_kmeans_compiles_a_few_kernels_whatever_the_number_of_cells():
    """Each cell's sample has its own size; padded to powers of two, the cells' fits share a
    few kernels (before: two compilations per distinct cell size, 396 in the k-means of SciFact's
    1.2M-token index, a third of its time)."""
    from aligner_jax.indexing import kmeans

    rng = np.random.default_rng(3)
    centres = rng.standard_normal((40, 24)).astype(np.float32)
    sizes = rng.integers(20, 400, len(centres))  # unequal cells
    sample = np.concatenate(
        [
            c + 0.05 * rng.standard_normal((n, 24)).astype(np.float32)
            for c, n in zip(centres, sizes, strict=True)
        ]
    )
    sample /= np.linalg.norm(sample, axis=1, keepdims=True)
    counts = []
    for cells in (16, 32):  # the second: 32 cells of sizes never seen before
        with compilations() as names:
            centroids, coarse = kmeans.fit_two_level(sample, 16 * cells, cells, 3, 0)
        assert centroids.shape == (16 * cells, 24) and coarse.shape == (cells, 24)
        counts.append(len(names))
    assert counts[1] <= 8, counts


def test_assigning_chunks_of_every_length_compiles_one_kernel_per_power_of_two():
    """The search-index build assigns each shard's last, shorter chunk: padded on the host to a
    power of two, lengths share a kernel (a kernel per length grew the build's memory by ~1.5
    GiB over 12M tokens)."""
    from aligner_jax.indexing import kmeans

    rng = np.random.default_rng(5)
    cells = rng.standard_normal((8, 20)).astype(np.float32)
    kmeans.assign(rng.standard_normal((600, 20)).astype(np.float32), cells)  # 1024 rows: warm
    with compilations() as names:
        for n in range(520, 1000, 37):  # 13 lengths, one power of two
            points = rng.standard_normal((n, 20)).astype(np.float32)
            codes, best = kmeans.assign(points, cells)
            np.testing.assert_array_equal(codes, np.argmax(points @ cells.T, axis=1))
    assert names == []


PLACEMENT_SCRIPT = r"""
import json, sys
import jax
import numpy as np
sys.path.insert(0, sys.argv[2])
from index_utils import random_documents, write_store
from aligner_jax.common import compilations as compile_counter
from aligner_jax.core import scoring
from aligner_jax.encoding.encoder import EncodedText
from aligner_jax.retrieval import refine

jax.config.update("jax_default_device", jax.devices()[1])  # the "accelerator": not cpu:0
store = write_store(sys.argv[1], random_documents(30, 8, seed=1, max_len=40), dim=8)
seen = []
kernel = refine.score_chunk

def spy(*args, **kwargs):
    out = kernel(*args, **kwargs)
    seen.append(sorted(str(d) for d in out.devices()))
    return out

refine.score_chunk = spy
query = EncodedText(np.arange(5, dtype=np.int32), np.eye(5, 8, dtype=np.float32), np.ones(5, np.float32))
batch = refine.QueryBatch.from_encoded([query], 16)
top1 = (scoring.AlignmentStrategy.parse("top_k:1"),)
result = {}
for name, config in {
    "fixed_cpu": refine.RefineConfig(block_docs=8, host_top1=False),
    "fixed_default": refine.RefineConfig(
        block_docs=8, fixed_shape_device="default", host_top1=False
    ),
    "bucketed": refine.RefineConfig(fixed_shape_docs=0, host_top1=False),
}.items():
    seen.clear()
    scores = refine.Refiner(store, config).score(batch, [np.arange(20)], top1)[0]
    result[name] = {"devices": sorted({d for s in seen for d in s}), "scores": scores.tolist()}
print(json.dumps(result))
"""


def test_fixed_shape_blocks_run_on_the_host_cpu_whatever_the_default_device(tmp_path):
    """A query's fixed-shape blocks are padded to the longest document; on a GPU host copying
    them to the device for every query made search slower than on a 2-core CPU (results README,
    GPU host). They run on the host's CPU (``cpu:0`` here, the default device being ``cpu:1``,
    standing in for an accelerator); ``fixed_shape_device="default"`` and the bucketed path
    (exhaustive refinement) run on the default device. Scores are the same everywhere. (The
    kernel's placement: ``host_top1``, which scores top-1 without it, is off.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "XLA_FLAGS": xla_flags("--xla_force_host_platform_device_count=2")}
    tests_dir = str(Path(__file__).resolve().parent)
    proc = subprocess.run(
        [sys.executable, "-c", PLACEMENT_SCRIPT, str(tmp_path / "store"), tests_dir],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["fixed_cpu"]["devices"] == ["cpu:0"]
    assert result["fixed_default"]["devices"] == ["cpu:1"]
    assert result["bucketed"]["devices"] == ["cpu:1"]
    np.testing.assert_allclose(
        result["fixed_cpu"]["scores"], result["bucketed"]["scores"], atol=1e-6
    )
    np.testing.assert_allclose(
        result["fixed_cpu"]["scores"], result["fixed_default"]["scores"], atol=0
    )


def test_fixed_shape_device_is_checked():
    with pytest.raises(Exception, match=r"fixed_shape_device.*choose one of \['cpu', 'default'\]"):
        refine.RefineConfig(fixed_shape_device="gpu")


def test_mesh_search_rounds_k_and_the_batch_up_and_returns_what_was_asked(index_dir, encoder):
    """The device search runs at k = 16 for k = 3 and pads 3 queries to 4: the answers are the
    first k of the larger search, one page per query."""
    searcher = search_lib.Searcher.load(
        str(index_dir), mode="exhaustive", encoder=encoder, mesh=sharded_search.document_mesh()
    )
    assert [sharded_search.k_bucket(k, 64) for k in (1, 3, 16, 17, 100, 1000)] == [
        16, 16, 16, 32, 64, 64,
    ]  # fmt: skip
    texts = QUERIES[:3]
    three, twenty = searcher.search_batch(texts, k=3), searcher.search_batch(texts, k=20)
    assert [len(p) for p in three] == [3, 3, 3]
    assert [[tuple(h) for h in p] for p in three] == [[tuple(h) for h in p[:3]] for p in twenty]
    single = [searcher.search(t, k=3) for t in texts]
    assert [[h[0] for h in p] for p in single] == [[h[0] for h in p] for p in three]


def test_e2e_latency_benchmark_runs_the_device_mode_without_compiling_after_load(
    index_dir, tmp_path
):
    """``benchmarks/e2e_latency.py --mode=device`` (the exact search on the devices of a mesh):
    every query timed, 0 compilations after load, the mode and devices in its report."""
    out = tmp_path / "e2e"
    r = run_python(
        REPO / "benchmarks" / "e2e_latency.py",
        f"--index_dir={index_dir}",
        f"--dataset_dir={index_dir.parent / 'toy'}",
        "--mode=device",
        "--rounds=1",
        "--rerank_candidates=5",
        f"--output_name={out}",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["mode"] == "device" and report["devices"] == ["cpu"]
    assert report["measured"]["compilations_after_load"] == 0
    measured = report["measured"]
    assert measured["end_to_end"]["n"] == report["queries"] == len(TOY_QUERIES)
    # search alone (interleaved) and encoding back to back (one pass after the rounds)
    assert measured["search"]["n"] == measured["encode_back_to_back"]["n"] == len(TOY_QUERIES)
    assert 0 < measured["search"]["p50_ms"] <= measured["search"]["max_ms"]
    md = out.with_suffix(".md").read_text()
    assert "mode `device` on cpu" in md
    assert "| search alone (the encoded query, k=10) |" in md
    assert "| query encoding, back to back" in md


def test_e2e_latency_benchmark_takes_search_rules_from_gin_and_records_them(index_dir, tmp_path):
    """``benchmarks/e2e_latency.py --gin.CentroidSearchConfig.*``: the fast mode searches with
    those rules (an operating point chosen elsewhere), records them, compiles nothing after
    load, the rerank of the rounds after the first on its own row; a misspelt field is one
    line naming it."""
    out = tmp_path / "e2e"
    common = [
        REPO / "benchmarks" / "e2e_latency.py",
        f"--index_dir={index_dir}",
        f"--dataset_dir={index_dir.parent / 'toy'}",
        "--rounds=2",
        "--rerank_candidates=5",
        f"--output_name={out}",
    ]
    r = run_python(
        *common,
        "--gin.CentroidSearchConfig.residual_candidates=True",
        "--gin.CentroidSearchConfig.probe_docs=7",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["mode"] == "fast"
    assert report["search_config"]["residual_candidates"] is True
    assert report["search_config"]["probe_docs"] == 7
    assert report["measured"]["compilations_after_load"] == 0
    measured = report["measured"]
    assert measured["end_to_end"]["n"] == measured["rerank"]["n"] == 2 * len(TOY_QUERIES)
    assert measured["rerank_after_first_round"]["n"] == len(TOY_QUERIES)
    assert measured["rerank_after_first_round"]["max_ms"] <= measured["rerank"]["max_ms"]
    # every timed query falls in one length bucket, whose bounds hold its length
    by_length = report["measured"]["by_query_tokens"]
    assert sum(b["samples"] for b in by_length.values()) == 2 * len(TOY_QUERIES)
    assert all(b["search"]["n"] == b["samples"] for b in by_length.values())
    tokens = report["measured"]["query_tokens"]
    spans = [tuple(map(int, key.split("-"))) for key in by_length]
    assert min(lo for lo, _ in spans) <= tokens["p50"] <= max(hi for _, hi in spans)
    assert not any(key.endswith("_ms") for key in tokens)  # a count, not a time
    md = out.with_suffix(".md").read_text()
    assert "By query length" in md and "| rerank, the rounds after the first" in md
    r = run_python(*common, "--gin.CentroidSearchConfig.probe_dcs=7")
    assert r.returncode != 0 and "probe_dcs" in r.stderr
    assert "e2e_latency.py: error: gin configuration error" in r.stderr
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_import_order_benchmark_holds_openblas_only_where_numpy_came_first(index_dir, tmp_path):
    """``benchmarks/import_order.py``: a child that imported NumPy before the package finds its
    OpenBLAS spinning; its search holds it (``blas.one_thread_if_spinning``), the ``_free``
    variant does not; both time every query with no compilation after load."""
    out = tmp_path / "order"
    r = run_python(
        REPO / "benchmarks" / "import_order.py",
        f"--index_dir={index_dir}",
        f"--dataset_dir={index_dir.parent / 'toy'}",
        "--variants=numpy_first,numpy_first_free",
        "--children=1",
        "--rounds=1",
        "--rerank_candidates=5",
        f"--output_dir={tmp_path}",
        f"--output_name={out.name}",
        OPENBLAS_NUM_THREADS="2",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads(out.with_suffix(".json").read_text())
    held, free = results["variants"]["numpy_first"], results["variants"]["numpy_first_free"]
    assert held["spinning_openblas"] == free["spinning_openblas"] == [1]
    assert (held["held_libraries"], free["held_libraries"]) == ([1], [0])
    for variant in (held, free):
        assert variant["compilations_after_load"] == 0
        assert variant["search"]["n"] == variant["end_to_end"]["n"] == len(TOY_QUERIES)
    assert "| numpy_first_free | [1] / [0] |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").exists()
