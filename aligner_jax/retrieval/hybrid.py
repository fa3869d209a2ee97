"""Hybrid retrieval: ALIGNER fused with a lexical first stage (BM25 or miniCOIL).

Per query: ALIGNER's first stage (the searcher's token or centroid search) and the lexical stage
each give their top ``depth`` documents; ALIGNER refines the union of both with all stored token
vectors and the chosen alignment (``Searcher.rerank``, Eq. 1–2), so every candidate has an
ALIGNER score and the lexical documents ALIGNER's first stage missed are not lost; the lexical
scores of the documents it returned are kept, the others have none. The two score lists are then
fused (:mod:`retrieval.fusion`: reciprocal-rank or min–max normalised-score fusion) with
ALIGNER's weight ``w`` and the lexical weight ``1 − w``.

The fusion needs no second pass: :class:`HybridRun` keeps both score lists, so any weight or
method is a NumPy step (the few-shot weight selection of ``evaluation`` re-fuses for a grid).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

import gin
import numpy as np

from aligner_jax.common import checks
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import scoring
from aligner_jax.encoding.encoder import EncodedText
from aligner_jax.retrieval import fusion as fusion_lib
from aligner_jax.retrieval import lexical_stages as lexical_lib
from aligner_jax.retrieval import searcher as search_lib

#: ALIGNER weights tried by the few-shot selection: 0 (lexical alone) to 1 (ALIGNER alone).
WEIGHT_GRID = tuple(round(0.1 * i, 1) for i in range(11))


@gin.configurable
@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Fusion of ALIGNER with the lexical stage (``LexicalConfig``).

    Attributes:
      fusion: ``score`` (min–max normalised scores) or ``rrf`` (reciprocal-rank fusion).
      weight: ALIGNER's weight ``w`` in [0, 1]; the lexical stage gets ``1 − w``. The default
        (score fusion, 0.7) needs no labels of the searched collection: it was chosen on
        SciFact's train queries, disjoint from every test split (``gin/eval/hybrid.gin``).
      rrf_k: RRF's rank constant (Cormack et al. 2009: 60).
      depth: documents each first stage contributes to the candidate union.
      weights: the grid the few-shot protocol (``--adapt``) chooses ``w`` from.
    """

    fusion: str = "score"
    weight: float = 0.7
    rrf_k: int = fusion_lib.RRF_K
    depth: int = 100
    weights: tuple[float, ...] = WEIGHT_GRID

    def __post_init__(self):
        name = type(self).__name__
        checks.choice(f"{name}.fusion", self.fusion, fusion_lib.FUSIONS)
        checks.number(f"{name}.weight", self.weight, 0.0, 1.0)
        checks.integer(f"{name}.rrf_k", self.rrf_k, minimum=0)
        checks.integer(f"{name}.depth", self.depth, minimum=1)
        if isinstance(self.weights, str) or not self.weights:
            raise ConfigError(f"{checks.flag(name + '.weights', self.weights)}: empty")
        for w in self.weights:
            checks.number(f"{name}.weights", w, 0.0, 1.0)


def weight_name(method: str, weight: float) -> str:
    """``rrf:w=0.5``: one fusion setting, named in reports and the few-shot table."""
    return f"{method}:w={weight:g}"


@dataclasses.dataclass
class HybridRun:
    """Both systems' scores of each query's candidate union, and per-query timings (ms)."""

    candidates: dict[str, list[str]]
    aligner: dict[str, np.ndarray]  # refined ALIGNER scores, aligned with candidates
    lexical: dict[str, np.ndarray]  # lexical scores, NaN where the stage did not return the doc
    aligner_ms: list[float]
    lexical_ms: list[float]
    rerank_ms: list[float]
    fusion_ms: list[float] = dataclasses.field(default_factory=list)
    num_candidates: list[int] = dataclasses.field(default_factory=list)
    costs: list = dataclasses.field(default_factory=list)  # the union's refinement (flops)

    def fused(
        self, weight: float, method: str, rrf_k: int = fusion_lib.RRF_K, k: int = 1000
    ) -> dict[str, dict[str, float]]:
        """``results[qid][doc_id]``: the top ``k`` of each query's union by fused score."""
        out = {}
        for qid, docs in self.candidates.items():
            f = fusion_lib.fuse(self.aligner[qid], self.lexical[qid], weight, method, rrf_k)
            out[qid] = fusion_lib.top(docs, f, k)
        return out

    @property
    def search_ms(self) -> list[float]:
        """End-to-end per query: both first stages, the refinement of the union and fusion."""
        parts = (self.aligner_ms, self.lexical_ms, self.rerank_ms, self.fusion_ms)
        return [float(sum(x)) for x in zip(*parts, strict=True)]


def search(
    searcher: search_lib.Searcher,
    lexical_index: lexical_lib.LexicalIndex,
    query_ids: Sequence[str],
    encoded: Sequence[EncodedText],
    texts: Mapping[str, str],
    strategy: scoring.AlignmentStrategy | str,
    config: HybridConfig,
) -> HybridRun:
    """Both first stages, ALIGNER's refinement of their union, fused by ``config``."""
    first = searcher.run(query_ids, encoded, (strategy,), k=config.depth)
    first_results = next(iter(first.results.values()))
    lexical, lexical_ms = lexical_lib.search_timed(
        lexical_index, {q: texts[q] for q in query_ids}, config.depth
    )
    union = {
        q: list(dict.fromkeys([*first_results.get(q, {}), *lexical.get(q, {})])) for q in query_ids
    }
    refined = searcher.rerank(query_ids, encoded, union, (strategy,), k=2 * config.depth)
    scores = next(iter(refined.results.values()))
    run = HybridRun({}, {}, {}, first.search_ms, lexical_ms, refined.search_ms, costs=refined.costs)
    for qid in query_ids:
        t0 = time.perf_counter()
        docs = list(scores[qid])  # refined (finite) and not deleted
        lex = lexical.get(qid, {})
        run.candidates[qid] = docs
        run.aligner[qid] = np.array([scores[qid][d] for d in docs], np.float64)
        run.lexical[qid] = np.array([lex.get(d, np.nan) for d in docs], np.float64)
        # Timed here (arrays + one fusion); HybridRun.fused makes the rankings for any weight.
        fusion_lib.fuse(
            run.aligner[qid], run.lexical[qid], config.weight, config.fusion, config.rrf_k
        )
        run.fusion_ms.append(1000.0 * (time.perf_counter() - t0))
        run.num_candidates.append(len(docs))
    return run
