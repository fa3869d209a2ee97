"""The compiled probe scoring (``retrieval.probe_scores``): compiled once, at load.

Its values are tested through ``residual_candidates`` and ``xtr`` in ``test_centroid_search``
(compiled and NumPy paths against decoded vectors); here, each codec width directly."""

import os
import subprocess
import sys

import numpy as np
import pytest

from aligner_jax.common import scratch
from aligner_jax.indexing.codec import ResidualCodec
from aligner_jax.retrieval import probe_scores


def _decoded_sums(decoded, q, where, top_scores, starts, lengths, docs, w, imputed, num_docs):
    """The pass's sums from decoded residuals, in NumPy: (Σ_i w_i·(max_j q_i·(c + r̂_j) −
    imputed_i) per document over its reached query tokens, the documents reached)."""
    expected, reached = np.zeros(num_docs), np.zeros(num_docs, bool)
    for i in range(len(q)):
        best = np.full(num_docs, -np.inf)
        for a, c in enumerate(where[i]):
            r = np.arange(starts[c], starts[c] + lengths[c])
            np.maximum.at(best, docs[r], top_scores[i, a] + decoded[r] @ q[i])
        hit = np.isfinite(best)
        expected[hit] += w[i] * (best[hit] - imputed[i])
        reached |= hit
    return expected, reached


def test_probe_scores_warm_up_compiles_the_pass_that_residual_candidates_run():
    """``Searcher.load`` calls ``probe_scores.warm_up`` for the residual-candidate and XTR
    scorings: afterwards their call (any codec's bits, the token lists' int32 documents or
    int64 ones) compiles nothing."""
    code = (
        "import numpy as np\n"
        "from aligner_jax.indexing.codec import ResidualCodec\n"
        "from aligner_jax.retrieval import probe_scores as p\n"
        "assert not p._accumulate.signatures\n"
        "p.warm_up()\n"
        "warm = list(p._accumulate.signatures)\n"
        "rng = np.random.default_rng(0)\n"
        "for bits, kind in ((2, np.int32), (8, np.int64)):\n"
        "    codec = ResidualCodec.fit(rng.standard_normal((50, 6)).astype(np.float32), bits)\n"
        "    packed = codec.encode(rng.standard_normal((4, 6)).astype(np.float32))\n"
        "    acc, seen = np.zeros(3, np.float32), np.zeros(3, bool)\n"
        "    floor = np.full(3, -np.inf, np.float32)\n"
        "    p.accumulate(codec, np.ones((2, 6), np.float32), np.array([[0], [1]]),\n"
        "                 np.zeros((2, 1), np.float32), np.array([0, 2]), np.array([2, 2]),\n"
        "                 packed, np.array([0, 1, 1, 2], kind), np.ones(2), np.full(2, -9.0), floor,\n"
        "                 acc, seen)\n"
        "    assert seen.all() and np.isneginf(floor).all()\n"
        "assert len(warm) == 2 and list(p._accumulate.signatures) == warm, p._accumulate.signatures\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_compiled_pass_scores_each_document_as_decoded_residuals_do(bits):
    """Every codec width: each reached document's accumulated score is Σ_i w_i·(max_j
    q_i·(c + r̂_j) − imputed_i) over its tokens in the probed clusters, r̂ decoded — up to the
    rounding of the int16 weights."""
    rng = np.random.default_rng(bits)
    dim, rows = 12, 40
    codec = ResidualCodec.fit(rng.standard_normal((200, dim)).astype(np.float32), bits)
    packed = codec.encode(rng.standard_normal((rows, dim)).astype(np.float32))
    decoded = codec.decode(packed)
    docs = rng.integers(0, 7, rows).astype(np.int32)
    starts, lengths = np.arange(0, rows, 10), np.full(4, 10)  # four clusters of 10 rows
    q = rng.standard_normal((3, dim)).astype(np.float32)
    where = np.array([[0, 2], [1, 3], [3, 0]])
    top_scores = rng.standard_normal((3, 2)).astype(np.float32)
    w, imputed = np.array([1.0, 0.5, 2.0]), np.array([-1.0, -2.0, -0.5])
    acc, seen = np.zeros(7, np.float32), np.zeros(7, bool)
    floor = np.full(7, -np.inf, np.float32)
    probe_scores.accumulate(codec, q, where, top_scores, starts, lengths, packed, docs, w,
                            imputed, floor, acc, seen)  # fmt: skip
    expected, reached = _decoded_sums(decoded, q, where, top_scores, starts, lengths, docs, w,
                                      imputed, 7)  # fmt: skip
    np.testing.assert_array_equal(seen, reached)
    # within the int16 weights' rounding (½·scale per weight, every level at its largest)
    _, scale, _ = codec.integer_query_terms(q)
    bound = (w * 0.5 * scale * ((1 << bits) - 1) * codec.padded_dim).sum()
    assert np.abs(acc - expected).max() <= bound + 1e-5
    assert np.abs(acc - expected).max() < 1e-3 * np.abs(expected).max()  # the bound is loose
    assert np.isneginf(floor).all()
    # the lists by position: entry j's residual read at rows[j] of a store-order array
    order = rng.permutation(rows)
    store_order = np.empty_like(packed)
    store_order[order] = packed
    by_position, reached_too = np.zeros(7, np.float32), np.zeros(7, bool)
    probe_scores.accumulate(codec, q, where, top_scores, starts, lengths, store_order, docs, w,
                            imputed, floor, by_position, reached_too,
                            rows=order.astype(np.int32))  # fmt: skip
    np.testing.assert_array_equal(by_position, acc)
    np.testing.assert_array_equal(reached_too, seen)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_integer_query_terms_round_the_plane_weights_within_half_a_step(bits):
    """The int16 weights the compiled pass multiplies: within ½·scale of ``query_terms``'
    weights, the whole int16 range used where no overflow threatens, and no int32 overflow
    with every level at its largest."""
    rng = np.random.default_rng(bits)
    dim = 384
    codec = ResidualCodec.fit(rng.standard_normal((500, dim)).astype(np.float32), bits)
    q = rng.standard_normal((5, dim)).astype(np.float32)
    q[1] = 0.0  # a query token without weight: scale 1, all zeros
    weights, scale, constant = codec.integer_query_terms(q)
    planes, want_constant = codec.query_terms(q)
    exact = np.stack(planes, axis=1)
    assert weights.dtype == np.int16 and weights.shape == exact.shape
    np.testing.assert_array_equal(constant, want_constant)
    error = np.abs(exact - scale[:, None, None] * weights)
    assert (error <= 0.5 * scale[:, None, None] + 1e-6 * np.abs(exact)).all()  # float rounding
    assert not weights[1].any() and scale[1] == 1.0
    limit = min(32767, (2**31 - 1) // (((1 << bits) - 1) * codec.padded_dim))
    assert (np.abs(weights[[0, 2, 3, 4]]).reshape(4, -1).max(axis=1) == limit).all()
    worst = ((1 << bits) - 1) * np.abs(weights.astype(np.int64)).reshape(5, -1).sum(axis=1)
    assert worst.max() < 2**31


@pytest.mark.parametrize("num_docs", [5_000, 40_000])
@pytest.mark.parametrize("threads", [2, 3, 8])
def test_document_tiles_on_worker_threads_score_as_the_one_thread_pass(threads, num_docs):
    """``threads`` > 1 scores every ``threads``-th tile of documents on each thread, all into
    the caller's arrays: the same documents reached and the same sums to the bit as one pass
    (a document's sums are added in one order), the floor left at −∞, and a second call the
    same again. More threads than tiles: one thread per tile. Before stop 78 the query tokens
    were cut into groups whose sums were added afterwards (equal only up to rounding)."""
    rng = np.random.default_rng(threads)
    dim, rows = 16, 300
    codec = ResidualCodec.fit(rng.standard_normal((500, dim)).astype(np.float32), 4)
    packed = codec.encode(rng.standard_normal((rows, dim)).astype(np.float32))
    docs = np.sort(rng.integers(0, num_docs, (10, 30)), axis=1).reshape(-1).astype(np.int32)
    starts, lengths = np.arange(0, rows, 30), np.full(10, 30)  # each list in store order
    n = 5
    q = rng.standard_normal((n, dim)).astype(np.float32)
    where = rng.integers(0, 10, (n, 2))
    top_scores = rng.standard_normal((n, 2)).astype(np.float32)
    w, imputed = rng.uniform(0.5, 2.0, n), rng.uniform(-2.0, -1.0, n)

    def run(t):
        acc, seen = np.zeros(num_docs, np.float32), np.zeros(num_docs, bool)
        floor = np.full(num_docs, -np.inf, np.float32)
        probe_scores.accumulate(codec, q, where, top_scores, starts, lengths, packed, docs, w,
                                imputed, floor, acc, seen, threads=t)  # fmt: skip
        assert np.isneginf(floor).all()
        return acc, seen

    acc_1, seen_1 = run(1)
    assert 0 < seen_1.sum() < num_docs  # some documents reached, not all
    tile = probe_scores.tile_size(num_docs, threads)
    assert -(-num_docs // tile) >= min(threads, 4)  # several tiles: several threads score
    for _ in range(2):
        acc_t, seen_t = run(threads)
        np.testing.assert_array_equal(seen_t, seen_1)
        np.testing.assert_array_equal(acc_t, acc_1)


def test_tiles_leave_each_thread_a_tile_never_below_the_minimum():
    assert probe_scores.tile_size(10**6, 1) == probe_scores.TILE_DOCS
    assert probe_scores.tile_size(518_300, 2) == probe_scores.TILE_DOCS  # 16 tiles
    assert probe_scores.tile_size(51_830, 2) == 25_915  # one tile per thread
    assert probe_scores.tile_size(5_183, 3) == 1_728
    assert probe_scores.tile_size(5_183, 8) == probe_scores.MIN_TILE_DOCS
    assert probe_scores.tile_size(10, 8) == probe_scores.MIN_TILE_DOCS


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_scores_on_threads_of_its_own():
    """A process forked after a threaded pass (its workers exist only in the parent) still
    scores with threads: the child starts its own workers instead of waiting forever on the
    parent's."""
    code = (
        "import os, sys\n"
        "import numpy as np\n"
        "from aligner_jax.indexing.codec import ResidualCodec\n"
        "from aligner_jax.retrieval import probe_scores as p\n"
        "rng = np.random.default_rng(0)\n"
        "codec = ResidualCodec.fit(rng.standard_normal((50, 6)).astype(np.float32), 4)\n"
        "packed = codec.encode(rng.standard_normal((4, 6)).astype(np.float32))\n"
        "def run():\n"
        "    acc, seen = np.zeros(3, np.float32), np.zeros(3, bool)\n"
        "    p.accumulate(codec, np.ones((2, 6), np.float32), np.array([[0], [1]]),\n"
        "                 np.zeros((2, 1), np.float32), np.array([0, 2]), np.array([2, 2]),\n"
        "                 packed, np.array([0, 1, 1, 2], np.int32), np.ones(2), np.full(2, -9.0),\n"
        "                 np.full(3, -np.inf, np.float32), acc, seen, threads=2)\n"
        "    return seen.all()\n"
        "assert run()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if run() else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print('child', os.waitstatus_to_exitcode(status))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "child 0", out.stderr[-2000:]


@pytest.mark.parametrize("bits", [2, 4])
def test_lists_by_position_score_as_the_copy_over_several_touched_blocks(bits):
    """Runs longer than ``TOUCH_ROWS`` (whole and partial blocks, rows of several cache lines)
    read by position give the very sums of the same rows read in place."""
    rng = np.random.default_rng(7)
    dim, rows = 384, 3 * probe_scores.TOUCH_ROWS + 17
    codec = ResidualCodec.fit(rng.standard_normal((500, dim)).astype(np.float32), bits)
    packed = codec.encode(rng.standard_normal((rows, dim)).astype(np.float32))
    assert packed.shape[1] > 64  # a row spans more than one cache line
    docs = rng.integers(0, 50, rows).astype(np.int32)
    starts, lengths = np.array([0, 150]), np.array([150, rows - 150])
    q = rng.standard_normal((2, dim)).astype(np.float32)
    where, top_scores = np.array([[0, 1], [1, 0]]), rng.standard_normal((2, 2)).astype(np.float32)
    w, imputed = np.array([1.0, 0.5]), np.array([-1.0, -2.0])
    order = rng.permutation(rows)
    store_order = np.empty_like(packed)
    store_order[order] = packed
    out = []
    for table, by in ((packed, None), (store_order, order.astype(np.int32))):
        acc, seen = np.zeros(50, np.float32), np.zeros(50, bool)
        floor = np.full(50, -np.inf, np.float32)
        probe_scores.accumulate(codec, q, where, top_scores, starts, lengths, table, docs, w,
                                imputed, floor, acc, seen, rows=by)  # fmt: skip
        out.append((acc, seen))
    np.testing.assert_array_equal(out[0][0], out[1][0])
    np.testing.assert_array_equal(out[0][1], out[1][1])
    assert out[0][1].sum() > 40


def _sorted_lists(rng, num_docs: int, clusters: int, per_cluster: int):
    """``clusters`` runs of ``per_cluster`` entries, each run's documents in store order
    (ascending, repeats allowed), spread over all ``num_docs``."""
    docs = np.sort(rng.integers(0, num_docs, (clusters, per_cluster)), axis=1)
    starts = np.arange(0, clusters * per_cluster, per_cluster)
    return docs.reshape(-1).astype(np.int32), starts, np.full(clusters, per_cluster)


@pytest.mark.parametrize("threads", [1, 2])
def test_documents_taken_tile_by_tile_score_as_one_pass_over_every_list(threads):
    """A collection of several ``TILE_DOCS`` tiles (lists whose documents cross tile bounds,
    a document in two probed clusters of one query token, a last tile cut short): each reached
    document's sum is Σ_i w_i·(max_j q_i·(c + r̂_j) − imputed_i) as in one pass, r̂ decoded,
    up to the int16 weights' rounding."""
    rng = np.random.default_rng(threads)
    dim, num_docs = 16, 3 * probe_scores.TILE_DOCS + 123
    docs, starts, lengths = _sorted_lists(rng, num_docs, clusters=6, per_cluster=700)
    docs[700 + 5] = docs[5]  # cluster 1 holds a document of cluster 0 as well...
    docs[700:1400].sort()  # ...in its store order
    codec = ResidualCodec.fit(rng.standard_normal((500, dim)).astype(np.float32), 2)
    packed = codec.encode(rng.standard_normal((len(docs), dim)).astype(np.float32))
    decoded = codec.decode(packed)
    q = rng.standard_normal((3, dim)).astype(np.float32)
    where = np.array([[0, 1], [2, 5], [1, 3]])
    top_scores = rng.standard_normal((3, 2)).astype(np.float32)
    w, imputed = np.array([1.0, 0.5, 2.0]), np.array([-3.0, -2.0, -2.5])
    acc, seen = np.zeros(num_docs, np.float32), np.zeros(num_docs, bool)
    floor = np.full(num_docs, -np.inf, np.float32)
    probe_scores.accumulate(codec, q, where, top_scores, starts, lengths, packed, docs, w,
                            imputed, floor, acc, seen, threads=threads)  # fmt: skip
    expected, reached = _decoded_sums(decoded, q, where, top_scores, starts, lengths, docs, w,
                                      imputed, num_docs)  # fmt: skip
    assert np.unique(docs[:1400] // probe_scores.TILE_DOCS).size == 4  # every tile visited
    np.testing.assert_array_equal(seen, reached)
    assert np.abs(acc - expected).max() < 1e-3 * np.abs(expected).max()
    assert np.isneginf(floor).all()


def test_a_list_out_of_store_order_is_refused_not_scored_wrong():
    """Tiles read each list only as far as the tile's documents, which needs its documents in
    store order (``inverted_lists.TokenLists``): a list that is not raises, naming the count,
    instead of adding a document's sum twice, and leaves the per-document arrays clean."""
    rng = np.random.default_rng(3)
    num_docs = 2 * probe_scores.TILE_DOCS
    docs = np.array([probe_scores.TILE_DOCS + 7, 5, 6], np.int32)  # 5 after a later document
    codec = ResidualCodec.fit(rng.standard_normal((50, 8)).astype(np.float32), 4)
    packed = codec.encode(rng.standard_normal((3, 8)).astype(np.float32))
    floor = np.full(num_docs, -np.inf, np.float32)
    acc, seen = np.zeros(num_docs, np.float32), np.zeros(num_docs, bool)
    with pytest.raises(ValueError, match=r"^\d+ token-list entries out of store order"):
        probe_scores.accumulate(codec, np.ones((1, 8), np.float32), np.array([[0]]),
                                np.zeros((1, 1), np.float32), np.array([0]), np.array([3]),
                                packed, docs, np.ones(1), np.zeros(1), floor, acc, seen)  # fmt: skip
    assert np.isneginf(floor).all() and not acc.any() and not seen.any()  # left for the next


@pytest.mark.parametrize("count", [3, 500])
def test_scratch_clear_zeroes_what_was_set_a_few_at_a_time_or_whole(count):
    """``scratch.clear``: per-document arrays zero but at ``at`` come back all zero, by a
    scatter for a few entries (the rest untouched: a nonzero entry outside ``at`` survives) or
    by a fill past one in ``DENSE_SHARE`` (every entry)."""
    at = np.arange(0, 2 * count, 2)
    acc, seen = np.zeros(1000, np.float32), np.zeros(1000, bool)
    acc[at], seen[at] = 1.5, True
    acc[999] = 7.0  # outside at: kept by a scatter, cleared by a fill
    scratch.clear((acc, seen), at)
    assert not seen.any() and not acc[:999].any()
    assert acc[999] == (0.0 if count * scratch.DENSE_SHARE > 1000 else 7.0)
