"""The fused gather-and-max of stages 3–4 equals NumPy's gather, sum and ``segment_max``."""

import subprocess
import sys

import numpy as np
import pytest

from aligner_jax.retrieval import centroid_search as cs
from aligner_jax.retrieval import gather_max


def _case(seed: int, ties: bool):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 6, 40)  # documents of no rows included
    lengths[:2] = (0, 1)
    rows = int(lengths.sum())
    if ties:  # few distinct values: maxima reached by several rows, u^d must pick the largest
        s_t = rng.integers(-2, 3, (30, 9)).astype(np.float32)
        add = rng.integers(0, 2, (rows, 9)).astype(np.float32)
    else:
        s_t = rng.standard_normal((30, 9)).astype(np.float32)
        add = rng.standard_normal((rows, 9)).astype(np.float32)
    codes = rng.integers(0, 30, rows)
    u_d = rng.random(rows).astype(np.float32)
    return s_t, codes, lengths, add, u_d


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "numpy"])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_gather_segment_max_equals_take_then_segment_max(monkeypatch, compiled, ties):
    if not compiled:
        monkeypatch.setattr(gather_max, "numba", None)
    else:
        assert gather_max.numba is not None, "numba is a dependency (requirements.txt)"
    s_t, codes, lengths, add, u_d = _case(3, ties)
    got = gather_max.gather_segment_max(s_t, codes, lengths, reference=cs.segment_max)
    np.testing.assert_array_equal(got, cs.segment_max(np.take(s_t, codes, axis=0), lengths))
    assert got.shape == (40, 9) and np.isneginf(got[0]).all() and np.isfinite(got[1]).all()
    best, sel = gather_max.gather_segment_max(
        s_t, codes, lengths, add=add, at_max=u_d, reference=cs.segment_max
    )
    want_best, want_sel = cs.segment_max(s_t[codes] + add, lengths, at_max=u_d)
    np.testing.assert_array_equal(best, want_best)
    np.testing.assert_array_equal(sel, want_sel)
    empty = np.zeros(3, np.int64)  # no rows at all: every maximum and selected u^d is −∞
    got = gather_max.gather_segment_max(
        s_t, codes[:0], empty, add=add[:0], at_max=u_d[:0], reference=cs.segment_max
    )
    for a, b in zip(got, cs.segment_max(add[:0], empty, at_max=u_d[:0]), strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.shape == (3, 9) and np.isneginf(a).all()
    if ties:  # the case exists: some document's maximum is reached by two rows
        starts = np.cumsum(lengths) - lengths
        tied = [
            ((s_t[codes[a : a + n]] + add[a : a + n]) == want_best[d]).sum(0).max() > 1
            for d, (a, n) in enumerate(zip(starts, lengths, strict=True))
            if n
        ]
        assert any(tied)


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "numpy"])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_tokens_at_best_equals_the_comparison_of_the_gathered_rows(monkeypatch, compiled, ties):
    """The residual interaction's token choice: a row is kept when its centroid scores reach
    its document's best for some query token of weight > 0 (any query token when none or all
    have weight), as ``centroid_search._at_best`` decides on the gathered ``[rows, n]``."""
    if not compiled:
        monkeypatch.setattr(gather_max, "numba", None)
    s_t, codes, lengths, _, _ = _case(5, ties)
    best = cs.segment_max(np.take(s_t, codes, axis=0), lengths)
    rng = np.random.default_rng(1)
    for weights in (
        np.ones(9, np.float32),
        np.where(rng.random(9) < 0.5, 0.0, 1.0).astype(np.float32),  # some query tokens off
        np.zeros(9, np.float32),
    ):
        want = cs._at_best(np.take(s_t, codes, axis=0), best, lengths, weights)
        got = gather_max.tokens_at_best(
            s_t, codes.astype(np.uint16), lengths, best, weights, reference=cs._at_best
        )
        assert got.dtype == bool and got.shape == (len(codes),)
        np.testing.assert_array_equal(got, want)
        assert want.any() and (ties or not want.all())  # distinct scores: some rows dropped


def test_warm_up_compiles_the_pass_that_searches_then_reuse():
    """``Searcher.load`` calls ``warm_up``: afterwards a search's calls (the gather-and-max and
    the residual interaction's token choice, the index's uint16 codes) compile nothing."""
    code = (
        "import numpy as np\n"
        "from aligner_jax.retrieval import centroid_search as cs, gather_max as g\n"
        "assert not g._gather_max.signatures\n"
        "g.warm_up()\n"
        "warm = list(g._gather_max.signatures)\n"
        "s = np.ones((5, 3), np.float32)\n"
        "g.gather_segment_max(s, np.array([0, 4]), np.array([1, 1]), reference=cs.segment_max)\n"
        "g.gather_segment_max(s, np.array([1]), np.array([1]), add=np.ones((1, 3), np.float32),\n"
        "                     at_max=np.ones(1, np.float32), reference=cs.segment_max)\n"
        "assert len(warm) == 1 and list(g._gather_max.signatures) == warm, g._gather_max.signatures\n"
        "at = list(g._at_best.signatures)\n"
        "g.tokens_at_best(s, np.array([0, 4], np.uint16), np.array([1, 1]), s[:2],\n"
        "                 np.ones(3, np.float32))\n"
        "assert len(at) == 1 and list(g._at_best.signatures) == at, g._at_best.signatures\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
