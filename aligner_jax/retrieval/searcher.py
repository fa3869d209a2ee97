"""Search: query tokens → token MIPS → candidate documents → refinement → ranked documents.

The three steps are named and timed (XTR notebook habit):

  1. ``token_search``: the top β^q of the query's tokens by salience each retrieve their k′ nearest
     document tokens from the token index (ScaNN or exact); their documents are the candidates.
     ``k_prime = 0`` skips this step: every document is a candidate (exhaustive refinement).
  2. ``refine``: candidates are scored with all their stored token vectors and the alignment
     strategy (or several at once), paper §2.1 and §3.2; or, with ``refine="xtr"``, scored from
     the retrieved token scores alone with f_XTR′ (XTR Eq. 4: no gather of document vectors).
  3. ``rank``: the top ``top_k`` documents per query (BEIR interchange
     ``results[qid][doc_id] = score``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import gin
import numpy as np
from absl import logging

from aligner_jax.common import checks
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import flops, pruning, scoring, xtr
from aligner_jax.encoding.encoder import EncodedText
from aligner_jax.indexing import ann as ti
from aligner_jax.indexing import token_store as ts
from aligner_jax.retrieval import refine as refine_lib

REFINE_MODES = ("full", "xtr")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """Search settings (bind in gin, e.g. ``SearchConfig.backend = 'exact'``).

    Attributes:
      backend: token MIPS backend, ``scann`` or ``exact``.
      k_prime: token neighbours per query token (paper: 4000). 0 = every document is a candidate
        (exhaustive refinement, no token search).
      beta_q: fraction of each query's tokens (top by salience) used for token search (§3.2).
      beta_d: fraction of each document's tokens (top by salience) in the token index (§3.2).
      refine: ``full`` (gather stored token vectors, Eq. 1–2) or ``xtr`` (f_XTR′).
      top_k: documents returned per query (paper: 1000).
      query_batch_size: queries refined together (amortises gathering on dense candidate sets).
    """

    backend: str = "scann"
    k_prime: int = 4000
    beta_q: float = 1.0
    beta_d: float = 1.0
    refine: str = "full"
    top_k: int = 1000
    query_batch_size: int = 8

    def __post_init__(self):
        name = type(self).__name__
        checks.choice(f"{name}.backend", self.backend, ti.BACKENDS)
        checks.choice(f"{name}.refine", self.refine, REFINE_MODES)
        checks.integer(f"{name}.k_prime", self.k_prime, minimum=0)
        checks.number(f"{name}.beta_q", self.beta_q, 0.0, 1.0, low_open=True)
        checks.number(f"{name}.beta_d", self.beta_d, 0.0, 1.0, low_open=True)
        checks.integer(f"{name}.top_k", self.top_k, minimum=1)
        checks.integer(f"{name}.query_batch_size", self.query_batch_size, minimum=1)
        if self.refine == "xtr" and self.k_prime == 0:
            raise ConfigError(
                "--gin.SearchConfig.refine='xtr' scores from retrieved tokens: set "
                "--gin.SearchConfig.k_prime > 0"
            )

    @property
    def exhaustive(self) -> bool:
        return self.k_prime == 0


@dataclasses.dataclass
class SearchOutput:
    """Rankings per strategy plus timings (milliseconds per query) and candidate counts."""

    results: dict[str, dict[str, dict[str, float]]]
    token_search_ms: list[float]
    refine_ms: list[float]
    num_candidates: list[int]
    costs: list[flops.QueryCost] = dataclasses.field(default_factory=list)

    @property
    def search_ms(self) -> list[float]:
        return [a + b for a, b in zip(self.token_search_ms, self.refine_ms, strict=True)]


def prune_query_tokens(encoded: EncodedText, beta_q: float) -> np.ndarray:
    """Positions of the query tokens kept at β^q (§3.2; the rule of ``core.pruning``)."""
    return pruning.top_fraction(encoded.salience, beta_q)


class Searcher:
    """Retrieves and ranks documents of a token store for encoded queries."""

    def __init__(
        self,
        store: ts.TokenStore,
        config: SearchConfig,
        token_index: ti.TokenIndex | None = None,
        refine_config: refine_lib.RefineConfig | None = None,
    ):
        if not config.exhaustive and token_index is None:
            raise ValueError("a token index is needed when k_prime > 0")
        self.store = store
        self.config = config
        self.token_index = token_index
        self.refiner = refine_lib.Refiner(store, refine_config) if config.refine == "full" else None

    # -- step 1 --------------------------------------------------------------------------------
    def token_search(self, queries: Sequence[EncodedText]):
        """Per query: (candidate doc indices, token scores [n', k′], token docs [n', k′])."""
        cfg = self.config
        if cfg.exhaustive:
            everything = np.arange(self.store.num_docs)
            return [(everything, None, None) for _ in queries]
        picks = [prune_query_tokens(q, cfg.beta_q) for q in queries]
        stacked = np.concatenate([q.vectors[p] for q, p in zip(queries, picks, strict=True)])
        scores, docs, _ = self.token_index.search(stacked, cfg.k_prime)
        out, start = [], 0
        for p in picks:
            s, d = scores[start : start + len(p)], docs[start : start + len(p)]
            start += len(p)
            out.append((np.unique(d[d >= 0]), s, d))
        return out

    # -- steps 2 and 3 ---------------------------------------------------------------------------
    def search(
        self,
        query_ids: Sequence[str],
        queries: Sequence[EncodedText],
        strategies: Sequence[scoring.AlignmentStrategy | str] = ("top_k:1",),
        progress_every: int = 50,
    ) -> SearchOutput:
        """Ranks the store's documents for each encoded query with each strategy."""
        cfg = self.config
        strategies = tuple(scoring.AlignmentStrategy.parse(s) for s in strategies)
        names = [str(s) for s in strategies]
        if cfg.refine == "xtr":
            names = ["xtr"]
        results: dict[str, dict[str, dict[str, float]]] = {name: {} for name in names}
        token_ms, refine_ms, num_candidates, costs = [], [], [], []
        doc_lengths = self.store.doc_lengths
        qb = max(1, cfg.query_batch_size)
        start_all = time.perf_counter()
        for lo in range(0, len(queries), qb):
            batch = list(queries[lo : lo + qb])
            batch_ids = list(query_ids[lo : lo + qb])
            t0 = time.perf_counter()
            found = self.token_search(batch)
            t1 = time.perf_counter()
            if cfg.refine == "xtr":
                scored = [
                    self._xtr_scores(s, d, len(q.token_ids))
                    for q, (_, s, d) in zip(batch, found, strict=True)
                ]
            else:
                length = self.refiner.config.query_bucket(max(len(q.token_ids) for q in batch))
                qbatch = refine_lib.QueryBatch.from_encoded(batch, length)
                cands = [c for c, _, _ in found]
                scores = self.refiner.score(qbatch, cands, strategies)
                scored = list(zip(cands, scores, strict=True))
            t2 = time.perf_counter()
            for q, qid, (cands, scores), (_, _, hit_docs) in zip(
                batch, batch_ids, scored, found, strict=True
            ):
                num_candidates.append(len(cands))
                costs.append(
                    flops.QueryCost(
                        query_tokens=len(q.token_ids),
                        searched_tokens=len(q.token_ids)
                        if hit_docs is None
                        else int(hit_docs.shape[0]),
                        candidates=len(cands),
                        candidate_doc_tokens=int(doc_lengths[cands].sum()),
                        retrieved_hits=0 if hit_docs is None else int((hit_docs >= 0).sum()),
                    )
                )
                for s, name in enumerate(names):
                    results[name][qid] = self._rank(cands, scores[s])
            token_ms += [1000.0 * (t1 - t0) / len(batch)] * len(batch)
            refine_ms += [1000.0 * (t2 - t1) / len(batch)] * len(batch)
            done = lo + len(batch)
            if progress_every and (done // progress_every) != (lo // progress_every):
                elapsed = time.perf_counter() - start_all
                logging.info(
                    "search: %d/%d queries, %.1f queries/s, median %d candidates",
                    done,
                    len(queries),
                    done / elapsed,
                    int(np.median(num_candidates)),
                )
        return SearchOutput(results, token_ms, refine_ms, num_candidates, costs)

    def _xtr_scores(self, token_scores, token_docs, n_query_tokens):
        cands, scores = xtr.xtr_inference_scores_numpy(token_scores, token_docs)
        return cands, scores[None, :]

    def _rank(self, cands: np.ndarray, scores: np.ndarray) -> dict[str, float]:
        k = min(self.config.top_k, len(cands))
        if k == 0:
            return {}
        top = np.argpartition(-scores, k - 1)[:k] if len(cands) > k else np.arange(len(cands))
        top = top[np.argsort(-scores[top], kind="stable")]
        ids = self.store.doc_ids
        return {ids[int(cands[j])]: float(scores[j]) for j in top if np.isfinite(scores[j])}
