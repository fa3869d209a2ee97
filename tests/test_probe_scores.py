"""The compiled probe scoring (``retrieval.probe_scores``): compiled once, at load.

Its values are tested through ``residual_candidates`` and ``xtr`` in ``test_centroid_search``
(compiled and NumPy paths against decoded vectors)."""

import subprocess
import sys


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
