r"""What the exact candidate lists of the scaling benchmark are made of (exact search, no ScaNN).

``benchmarks/scaling.py`` reports *candidate recall*: the fraction of the documents exact token
search makes candidates that ScaNN also makes candidates. This regenerates the same synthetic
corpora (same generator and seeds, streamed shard by shard, nothing written) and the same first
``--num_queries`` queries its recall was measured on, runs exact brute-force search for each
query token's k′ nearest tokens, and records per corpus size:

- ``own_centre_tokens``: the tokens of the query token's own centre in the corpus (mean);
- ``own_share_of_list``: the fraction of a k′ list that are tokens of the query token's centre;
- ``own_tokens_in_list``: the fraction of the own centre's tokens that made the list;
- ``candidate_docs``: documents per query (owners of its 32 lists), also as a share of the corpus;
- ``other_only_share``: the share of those documents reached only through tokens of *other*
  centres (the far end of the lists), the rest holding a token of a query token's own centre.

  .venv/bin/python benchmarks/scaling_candidates.py               # 1M, 4M, 16M tokens, k′=1000
  .venv/bin/python benchmarks/scaling_candidates.py --sizes=200000 --k_prime=100 --output=/tmp/c.json

Writes ``--output`` (default benchmarks/results/scaling_candidates.json).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from absl import app, flags

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import scaling  # noqa: E402

from aligner_jax.common import fileio  # noqa: E402

_SIZES = flags.DEFINE_list("sizes", ["1000000", "4000000", "16000000"], "Corpus sizes (tokens).")
_K_PRIME = flags.DEFINE_integer("k_prime", 1000, "Neighbours per query token (as scaling.py).")
_NUM_QUERIES = flags.DEFINE_integer("num_queries", 10, "scaling.py's recall queries: the first 10.")
_NOISE = flags.DEFINE_float("noise", scaling.DEFAULT_NOISE, "σ of the token noise (scaling.py).")
_OUTPUT = flags.DEFINE_string(
    "output", str(REPO / "benchmarks/results/scaling_candidates.json"), "Output JSON."
)


def exact_lists(num_tokens: int, k_prime: int, num_queries: int, noise: float) -> dict:
    """Streams the corpus of ``scaling.make_store(num_tokens, noise)`` through exact top-k′
    search for every query token; returns the statistics listed in the module docstring."""
    rng = np.random.default_rng(0)
    centers = scaling.synthetic_centres(rng)
    queries, q_assign = scaling.synthetic_queries(centers, num_queries, noise)
    q = np.concatenate(queries)  # (num_queries·32, DIM)
    q_centre = np.concatenate(q_assign)
    num_docs = num_tokens // scaling.DOC_TOKENS
    top_s = np.full((len(q), k_prime), -np.inf, np.float32)
    top_doc = np.full((len(q), k_prime), -1, np.int64)
    top_centre = np.full((len(q), k_prime), -1, np.int64)
    centre_counts = np.zeros(scaling.CLUSTERS, np.int64)
    for start in range(0, num_docs, scaling.SHARD_DOCS):
        docs = range(start, min(start + scaling.SHARD_DOCS, num_docs))
        made = [scaling.synthetic_document(rng, centers, noise) for _ in docs]
        vectors = np.concatenate([v for v, _ in made]).astype(np.float16).astype(np.float32)
        centre = np.concatenate([a for _, a in made])
        centre_counts += np.bincount(centre, minlength=scaling.CLUSTERS)
        doc = np.repeat(np.arange(docs.start, docs.stop), scaling.DOC_TOKENS)
        scores = q @ vectors.T
        keep = np.argpartition(-scores, k_prime - 1, axis=1)[:, :k_prime]
        all_s = np.concatenate([top_s, np.take_along_axis(scores, keep, 1)], axis=1)
        all_doc = np.concatenate([top_doc, doc[keep]], axis=1)
        all_centre = np.concatenate([top_centre, centre[keep]], axis=1)
        best = np.argpartition(-all_s, k_prime - 1, axis=1)[:, :k_prime]
        top_s = np.take_along_axis(all_s, best, 1)
        top_doc = np.take_along_axis(all_doc, best, 1)
        top_centre = np.take_along_axis(all_centre, best, 1)
    own = top_centre == q_centre[:, None]
    own_total = centre_counts[q_centre]
    cand, other_only = [], []
    for i in range(num_queries):
        rows = slice(32 * i, 32 * (i + 1))
        docs_all = set(top_doc[rows].ravel().tolist())
        docs_own = set(top_doc[rows][own[rows]].tolist())
        cand.append(len(docs_all))
        other_only.append(len(docs_all - docs_own) / len(docs_all))
    return {
        "num_tokens": num_docs * scaling.DOC_TOKENS,
        "num_docs": num_docs,
        "k_prime": k_prime,
        "noise": noise,
        "queries": num_queries,
        "own_centre_tokens": float(own_total.mean()),
        "own_share_of_list": float(own.mean()),
        "own_tokens_in_list": float((own.sum(1) / np.maximum(own_total, 1)).mean()),
        "candidate_docs": float(np.mean(cand)),
        "candidate_share_of_corpus": float(np.mean(cand) / num_docs),
        "other_only_share": float(np.mean(other_only)),
        "kth_score": float(top_s.min(1).mean()),
    }


def main(argv) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    rows = []
    for size in [int(s) for s in _SIZES.value]:
        t = time.perf_counter()
        rows.append(exact_lists(size, _K_PRIME.value, _NUM_QUERIES.value, _NOISE.value))
        print(f"{rows[-1]} ({time.perf_counter() - t:.0f} s)", flush=True)
    fileio.atomic_write_json(Path(_OUTPUT.value), rows, sort_keys=False)
    print(f"wrote {_OUTPUT.value}")


if __name__ == "__main__":
    app.run(main)
