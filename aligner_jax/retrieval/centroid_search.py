"""Fast candidate generation and scoring over the compressed index (PLAID §4, WARP §3), CPU first.

For one query (token vectors q [n, D], saliences u^q), four stages, each vectorised NumPy/BLAS
(no Python loop over documents or tokens, no per-op JAX dispatch):

  1. **Centroid scores** S = q·Cᵀ ``[n, C]`` (one GEMM).
  2. **Probe + imputation** (WARPSELECT): each query token kept by β^q probes its ``probes`` best
     centroids; a document in a probed centroid's inverted list gets, for that token, the best
     probed centroid score it owns; a document a token did not reach gets the token's *imputed*
     score: WARPSELECT's is the score of its first centroid not probed (an upper bound on what
     an unprobed token can contribute, up to residuals); by default the score of its
     ⌈2·(probes + 1)⌉-th centroid, a typical value rather than the bound
     (``CentroidSearchConfig.impute_depth``). The mean over tokens ranks the candidates.
  3. **Centroid and residual interaction**: the best ``interaction_docs`` candidates are
     re-scored with every token's centroid score, Σ_i max_j S[i, code_j] (PLAID's centroid
     interaction: gathers from S, no vectors read); with ``residual_interaction`` (default) the
     tokens in each candidate's best centroids (the centroid that holds some weighted query
     token's maximum) are then scored with their residuals, q·(c + r̂), top-1 alignment and
     saliences as in stage 4 but over those tokens only (a lower bound of stage 4's score, about
     a sixth of its work per document). Centroid scores alone cannot order documents whose
     tokens share centroids and differ by their residuals (a corpus of near-duplicates, or the
     distractors of ``benchmarks/scale.py``: at 10× SciFact, 8 probes, 1,200 interaction and 300
     refined documents, centroid scores chose for refinement 90 % of the relevant documents of
     the exhaustive top 100, the residual interaction 97 %, all that stage 2 had passed on).
  4. **Compressed refinement**: the best ``refine_docs`` are scored with q·(c + r̂) using the packed
     residuals without decoding them, with top-1 alignment and saliences, Eq. 1–2, in one
     compiled pass on as many threads as BLAS may use (``residual_max``). With ``refine_margin`` (default None: every token), only tokens
     whose centroid score is within the margin of their document's best for some query token
     are scored (the best one always is, so every query token aligns): faster, approximate —
     the residual term can move a token by more than the margin (SciFact zero-shot, margin
     0.15: −0.01 nDCG@10, −14 % CPU) (other alignment strategies refine these documents from the float
     store through ``refine.Refiner``, see ``searcher``). With ``refine_float`` (by default on
     for models with saliences) the best ⌈refine_float·k⌉ of them (3·k: every refined one), at
     least 30 and at most 300, are scored again from the token store's float vectors, Eq. 1–2
     exactly (``refine_stored``): a residual's error can change which token a query token
     selects, and with it the u^d that weights it. Where that is every refined document the
     compressed pass is not run.

With ``CentroidSearchConfig.residual_candidates`` (on by default where the token lists fit,
below) stage 2 scores every token of the probed clusters with its residual, q·(c + r̂), WARP's
candidate scoring applied to Eq. 1–2 (``residual_candidates``), and stage 3 is skipped: the
best ``refine_docs`` by that score are refined — at k ≥ 100, for a query whose would-be refined
documents stage 2 mostly imputed, after stage 3's residual interaction has re-scored stage 2's
best ``3·refine_docs`` (``rescore_per_refine``, ``rescore_below_reach``, below).
Every probed token is read and scored, in one
compiled pass (``probe_scores``; the ``xtr`` scorer below shares it). It reads the probed
clusters' tokens from centroid → token lists (WARP's cluster-ordered residuals), mapped from an
index built with ``CentroidIndexConfig.token_lists``, else built in memory at load. Since both
passes are compiled it is the faster path at the same quality, and keeps more recall where
centroid scores cannot separate documents (k = 100, 2 threads, ``refine_per_k = 3``, against
``probe_docs = 640`` without it; ``benchmarks/results/search_latency_*_stop49.json``, quality on
the queries not used for tuning): CISI zero-shot p50 40.4 → 26.9 ms, CISI trained 29.5 → 12.1,
SciFact trained 21.4 → 11.1, nDCG@10 unchanged, R@100 within 1 point of exhaustive search;
SciFact trained grown 10× with distractors (``tune_search_trained_x10_stop50.md``, train
queries) R@100 87.0 → 94.0 (exhaustive 95.0), p50 28.5 → 16.0 ms. Its default (None) is on.
An index without token lists gets a copy built at load while it takes at most
``centroid_index.LISTS_IN_MEMORY_MAX`` (512 MiB: 14M tokens at 128-d and 2 bits, 2.7M at 384-d
and 4 bits), else lists by position (8 bytes per kept token; each probed token's residual
read from the index's map where it lies: ``CentroidSearcher.token_lists``). An index built
with the default ``CentroidIndexConfig.token_lists`` holds them past that size, except at 2
bits (kept compact: its lists would double it), where the build writes the residuals
grouped by centroid instead of in store order (``CentroidIndexConfig.cluster_order``): the
lists read them as runs, and refinement through a position map built at load.

With ``SearchConfig.refine = 'xtr'`` the compressed index runs the XTR scorer f_XTR′ (XTR Eq. 4)
the way the WARP engine does instead of stages 2–4: each kept query token probes its
``xtr_probes`` best centroids, the residuals of the (β^d-kept) tokens in those clusters are scored
without decoding (q·(c + r̂)), each (query token, document) pair keeps its best score, and a
document a token did not reach gets that token's imputed score, its first unprobed centroid's
score (WARPSELECT's missing-similarity estimate: what a token of an unprobed cluster scores up to
its residual). Every document reached by some token is ranked; one vectorised step per query
token, never per document or stored token.

Stage 2's estimate of its best documents (``mean_docs``, 3,000) also counts how close each
document as a whole lies to the query: ``mean_weight`` (0.2) · q̄·m_d, the u^q-weighted mean
query token against the document's mean token vector (``with_means``; an index built with
``CentroidIndexConfig.doc_means``, the default above 2 bits). Most terms of a document's
estimate are imputed where a model's matches are soft, and the imputed value is the same for
every document a token did not reach; this single-vector term tells those documents apart.

The ranking lists the refined documents by their score, then the other interaction documents,
then the other candidates, each block by its own estimate, shifted below the block before it
(so that any evaluator that sorts by score keeps this order).

Defaults follow the index actually built, so that the work per query stays nearly flat as the
corpus grows up to 51,830 documents and grows past it (``reach_factor``: at 124.5M tokens two
probes left 37 % of the exhaustive top 100 unreached): ``probes = clip(round(P · f(N, k) / L),
2, 32)`` for N documents, f = max(1, N / 51,830) at k ≥ 100 and max(1, √(N / 51,830)) at
k ≤ 10, L the mean number of documents in an
inverted list and P = 2,560 with residual candidates at k ≥ 100 (chosen on SciFact 10×'s train
queries: R@100 86.0 at 640), halved for each tenfold fewer requested documents (1,280 at k = 10,
``residual_probe_docs``), 640 without (a query token reaches about 640 documents: 8 probes on SciFact
zero-shot, whose lists hold about 80; 2 once lists are long, e.g. at 100× SciFact); ``refine_docs =
max(clip(⌈0.75·√N⌉, 40, 128), min(3·k, 512))`` for N documents and k requested, ``interaction_docs =
4·refine_docs``; ``xtr_probes = 4·probes``. The constants were chosen by
``benchmarks/tune_search.py`` on SciFact's *train* queries (200), never the test queries, by
the rule written there: refining 3·k documents is the least that returns ≥ 95 % of the
exhaustive top 100 at k = 100 (k documents return 70 %: the centroid interaction orders
documents near the cut poorly).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import gin
import numpy as np
from absl import logging

from aligner_jax.common import blas, checks, half, scratch
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import inverted_lists as lists_lib
from aligner_jax.indexing import token_store as ts
from aligner_jax.indexing.inverted_lists import TokenLists, concatenated_ranges
from aligner_jax.retrieval import gather_max, probe_scores, probe_select, residual_max

PROBE_DOCS = 640  # documents a query token reaches through its probes (tune_search.py)
RESIDUAL_PROBE_DOCS = 2560  # the same with residual candidates, k >= 100 (tune_search.py, 10x)
RESIDUAL_PROBE_K = 100  # below this k, RESIDUAL_PROBE_DOCS halves per tenfold fewer documents
REACH_DOCS = 51_830  # documents of the store those reaches were chosen on (SciFact grown 10x);
# a larger collection's automatic reach grows with (N / REACH_DOCS) ** exponent (``reach_factor``)
REACH_EXPONENT = 1.0  # ... at k >= RESIDUAL_PROBE_K: a fixed share of the collection (stop 76)
REACH_EXPONENT_K10 = 0.5  # ... at k <= 10: with sqrt(N) (stop 65); interpolated in log k between
MAX_PROBES = 32  # probes per query token, at most
REFINE_PER_K = 3.0  # refined documents per requested document (tune_search.py)
MAX_REFINE = 512  # refined documents at most (deeper ranks keep the interaction order)
MIN_REFINE = (40, 128)  # refined documents at least: clip(⌈0.75·√N⌉, 40, 128)
INTERACTION_PER_REFINE = 4  # centroid-interaction documents per refined document
RESIDUAL_PER_REFINE = 1.5  # of those, residual-interaction documents per refined document
RESCORE_PER_REFINE = 3.0  # with residual candidates: stage-2 documents re-scored per refined one
RESCORE_K = 100  # ... at k >= this; proportionally fewer below (none at k <= RESCORE_K / 3)
RESCORE_BELOW_REACH = 0.7  # ... for queries whose refined candidates stage 2 reached below this
# float re-scored documents per requested one, models with saliences: every refined document
REFINE_FLOAT = REFINE_PER_K  # (stop 79; 2·k before)
REFINE_FLOAT_MIN = 30  # float re-scored documents at least (when refine_float > 0)
REFINE_FLOAT_MAX = 300  # and at most (a k = 1,000 evaluation re-scores the best 300)
IMPUTE_DEPTH = 2.0  # a token's imputed score: its ⌈2·(probes + 1)⌉-th centroid's (query_styles.py)
MEAN_WEIGHT = 0.2  # weight of the documents' mean vectors in stage 2's estimate (tune_search.py)
MEAN_DOCS = 3000  # stage 2's best documents that get it
SELECT_PREFILTER_MIN = 4096  # ``_best`` selects among at least this many scores by a threshold
SELECT_SAMPLE = 2048  # ... estimated from this many of them
FILL_DOCS = 0  # stage 2's best documents whose imputed terms become centroid scores (tuning)
LIGHT_SHARE = 1e-4  # share of a query's u^q its lightest tokens may hold and not be probed


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CentroidSearchConfig:
    """Candidate counts of the four stages. Absolute counts (``probes``, ``interaction_docs``,
    ``refine_docs``) override the scale-free rules, which follow the index actually built:

      probes = clip(round(probe_docs · f(N, k) / L), 2, MAX_PROBES)   (L: mean documents per
               inverted list; f = max(1, (N / 51,830)^γ(k)), γ 1 at k ≥ 100 and ½ at k ≤ 10,
               for an automatic probe_docs: ``reach_factor``)
      refine = max(clip(⌈0.75·√N⌉, 40, 128), min(⌈refine_per_k · k⌉, 512))   (N docs, k asked)
      interaction = interaction_per_refine · refine

    ``residual_candidates``: stage 2 scores the probed clusters' tokens with their residuals
    and stage 3 is skipped (see the module docstring); None: on (``decided``), reading the
    token lists the index maps, else a copy built at load, else — past
    ``centroid_index.LISTS_IN_MEMORY_MAX`` — the lists by position (``token_lists``).
    ``rescore_per_refine``: with residual candidates, stage 2's best
    ⌈rescore_per_refine · min(k / 100, 1) · refine_docs⌉ documents are re-scored by stage 3's
    residual interaction (each one's tokens in its best centroid per query token, scored with
    their residuals, Eq. 1–2: ``best_centroid_tokens``) and the best ``refine_docs`` of them
    are refined (``rescored``; none when the count is not above ``refine_docs``: at k = 10 by
    default). Stage 2 gives every query token that did not reach a document an imputed score;
    where a model's matches are soft, those terms decide the order: on the trained 128-d model
    grown 10× (``benchmarks/scale.py``'s distractors), a relevant document's best token for 7
    of a query's 8 tokens lay in the query token's 113th–1,478th centroid of 32,768, and all 5
    relevant documents of the exhaustive top 100 the search lost had been reached by stage 2
    and ranked 352–1,895 by it, below the 300 refined. Chosen at 3 by ``tune_search.py``'s rule
    on SciFact's train queries (200) on the trained 1× store, 4 bits: the only admissible
    setting of 0 / 3 / 5 (top-100 overlap with exhaustive search at k = 100 0.901 / 0.953 /
    0.958, p50 16.8 / 24.0 / 24.0 ms); at 10× no setting is admissible (0, 2, 3, 5: 0.585 /
    0.656 / 0.693 / 0.739, p50 22.4 / 28.6 / 35.9 / 30.5 ms, settings timed one after the
    other), and on the zero-shot 384-d 1× store it gains nothing (0.980 / 0.984 / 0.984) for
    p50 24.4 / 46.9 / 54.0 ms (``benchmarks/results/tune_rescore_stop61/``). 0: off (stop
    60's search).
    ``rescore_below_reach``: ... only for a query whose would-be refined documents (stage 2's
    best ``refine_docs``) stage 2 reached, on average, for less than this share of the probing
    query tokens' weight (``reached_share``; the rest of their scores was imputed); 1: every
    query. Chosen at 0.7 by the same rule (train queries, ``tune_rescore_stop61/reach/``):
    the smallest of 0 / 0.5 / 0.6 / 0.7 / 1 that keeps the trained 1× store admissible
    (top-100 overlap 0.901 / 0.939 / 0.949 / 0.952 / 0.953); the zero-shot 1× store is
    admissible at each, and at 10× 0.5 and above re-score every query (0.692–0.693 against
    0.585). Per train query the share is 0.16–0.34 at trained 10×, 0.42–0.70 at trained 1× and
    0.54–0.74 zero-shot (10th–90th percentile): at 0.7 most zero-shot queries re-score too.
    ``probe_docs``: None: with residual candidates ``residual_probe_docs(k)`` (2,560 at
    k ≥ 100, halved for each tenfold fewer documents requested, at least 640), ``PROBE_DOCS``
    without.
    ``refine_float``: the best ⌈refine_float · k⌉ refined documents, at least
    ``refine_float_min`` and at most ``refine_float_max`` (the cap wins), are scored again with
    the token store's float vectors (Eq. 1–2 exactly, ``refine_stored``); 0: none; None: ``REFINE_FLOAT`` for a model with saliences, 0 without (``CentroidSearcher``
    decides). Chosen on SciFact's *train* queries (200, trained 128-d model, ``tune_search.py``,
    ``benchmarks/results/tune_float_stop56/``): top-10 overlap of a k = 10 search with
    exhaustive search 0.814 → 0.947 at 2 bits, 0.888 → 0.952 at 4 bits, 0.741 → 0.832 at 10×
    (``scale.py``'s distractors), nDCG@10 72.5 → 73.4 (exhaustive 73.3), for p50 4.2 → 5.9 ms
    at k = 10 and 7.1 → 10.6 ms at k = 100 (1×, 2 bits). A model without saliences loses little
    to compression (zero-shot 384-d, 4 bits, 1×: 0.98 without) and reads three times the bytes
    per token: off. At most 100 by default: SciFact's train queries (809) evaluated at
    k = 1,000 (512 refined) give nDCG@10 73.8 / 73.7 / 73.7 and R@100 98.2 for none / 128 / all
    512 re-scored, at p50 10.5 / 16.6 / 29.9 ms. Twice k since stop 57: which documents make
    the top k is decided by exact scores only if the documents just below rank k were
    re-scored too; on the same 200 train queries, k = 100, the share of the exhaustive top 100
    returned rose 0.827 → 0.904 at 1× (0.907 re-scoring 3·k) and 0.568 → 0.583 at 10×
    (there the rest never reached stage 4), for p50 10.5 → 13.1 ms at 1×
    (``benchmarks/results/tune_float_stop57/``; nDCG@10 and R@100 unchanged on those queries).
    Every refined document (``REFINE_PER_K`` · k, at most 300) since stop 79: where the float
    refinement takes every refined document, the compressed pass of stage 4 is not run
    (``_ranked``), and that pass over 3·k documents cost more than float vectors for the last
    third of them. On the same 200 train queries at k = 100 (``tune_search.py``,
    ``benchmarks/results/stop79/tune_float_all/``) top-100 overlap with exhaustive search rose
    0.945 → 0.952 on the trained 2-bit store at 1× (the rule's top-100 criterion, ≥ 0.95, met
    only so; its k = 10 overlap, 0.947, misses the rule either way) and 0.414 → 0.417 grown
    100× (63.9M tokens); nDCG@10, R@100 and the k = 10 search (30 refined, all float already)
    unchanged. Interleaved per query on the test queries
    (``benchmarks/results/stop79/query_path_ab_float_all*.md``): 1.05× as fast at k = 100 at
    1× and at 100×, 1.00× at k = 10.
    Taking stage 3's best 2·k to the float refinement without the compressed pass instead was
    1.21–1.26× as fast on the train queries but lost top-100 overlap (0.945 → 0.922 at 1×,
    0.414 → 0.409 at 100×): not adopted.
    ``query_tokens_ref``: with automatic probes, a query of n < this many probing tokens reaches
    ``documents_per_probe(k) · query_tokens_ref / n`` documents per token (as many in all as a
    query of this length, up to ``MAX_PROBES`` per token); None: every query token reaches
    ``documents_per_probe(k)`` (``benchmarks/query_styles.py``).
    ``impute_depth``: stage 2 gives a document a query token did not reach the score of that
    token's ⌈impute_depth·(probes + 1)⌉-th best centroid (1: its first unprobed one,
    WARPSELECT's bound). The bound is what an unreached document scores at best, rarely what it
    scores: its best token for that query token lies in *some* unprobed cluster, seldom the
    best of them. At 1 a document reached by a weak token ranks below every document the token
    missed, and stage 2 orders poorly what it passes on: most of the exhaustive top 10 the
    default search missed had been reached by stage 2 but not refined
    (``benchmarks/query_styles.py``, stop 53). Chosen at 2 on that benchmark's label-free
    query sets (3 cost the CISI index overlap at k = 10); the XTR scorer keeps WARPSELECT's
    imputation (XTR Eq. 4).
    ``mean_weight``: stage 2's best ``mean_docs`` documents get mean_weight · q̄·m_d added to
    their estimate (``with_means``: q̄ the u^q-weighted mean of the probing query tokens, m_d
    the document's mean token vector, which an index built with
    ``CentroidIndexConfig.doc_means`` holds; without them, or at 0, stage 2 is as before).
    Chosen at 0.2 on SciFact's train queries: on the trained 128-d store grown 10×
    (``scale.py``'s distractors; 100 train queries, every candidate given the term) 0 / 0.1 /
    0.2 / 0.3 gave a k = 100 search's top-100 overlap with exhaustive search 0.687 / 0.716 /
    0.725 / 0.720 and a k = 10 search's top-10 overlap 0.799 / 0.829 / 0.847 / 0.846; with
    the term on stage 2's best 3,000 only (200 train queries) 0.693 → 0.714 and 0.831 → 0.865
    at 0.2, the trained 1× store 0.952 → 0.963 and 0.952 → 0.959, the zero-shot 384-d 1×
    store unchanged (0.983 → 0.983, 0.983 → 0.984); ``tune_search.py`` on the 200 train queries
    (``benchmarks/results/tune_means_stop64/``): 10× 0.693 / 0.715 / 0.714 / 0.703 and
    0.831 / 0.859 / 0.865 / 0.863 for 0 / 0.1 / 0.2 / 0.3. Its written rule (the cheapest
    admissible setting) picks 0 at 1×, where both pass, and none at 10×; 0.2 is for the grown
    stores, as ``rescore_per_refine`` is. At 124.5M tokens (the trained store grown 195×, test
    queries) a k = 10 search's top-10 overlap rose 0.421 → 0.506, R@100 83.5 → 85.5
    (exhaustive 95.5), at 10× R@100 95.0 → 97.0 (exhaustive 97.0); the zero-shot store grown
    10×: 0.901 → 0.963 (``benchmarks/results/scale_stop64/``). Its price, interleaved per
    query on SciFact: +0.8 ms p50 at k = 10 (trained), +2.3 ms (zero-shot, 384-d rows)
    (``query_path_ab_means``). 0: stop 63's search.
    ``fill_docs``: stage 2's best ``fill_docs`` documents count, for each probing query token
    that reached none of their tokens, their own best centroid score for it instead of the
    imputed one (``with_centroid_terms``: PLAID's centroid interaction on the terms WARP's
    candidate scoring imputes). 0 (the default): off. On SciFact's train queries (200) on the
    trained 128-d store grown 10× (``scale.py``'s distractors, the mean term on), 0 / 1,000 /
    3,000 gave a k = 10 search's top-10 overlap with exhaustive search 0.865 / 0.877 / 0.885
    and a k = 100 search's top-100 overlap 0.714 / 0.701 / 0.742, for p50 9.8 / 12.3 / 16.2 ms
    at k = 10: refining 300 documents instead of 128 gave the same 0.885 for +1.6 ms
    (``benchmarks/results/tune_stop65/``). Where the k = 100 search loses the exhaustive
    top 100 there (100 train queries): 1.6 % of it was never reached, 2 % was in stage 2's best
    900 and 9.6 % in its best 3,000, 16.7 % ranked below its 3,000th.
    ``light_share``: the lightest query tokens whose u^q together are at most this share of the
    query's take no part in stages 2–4's compressed scoring (``weighed_tokens``: not probed,
    gathered or refined; the float refinement, Eq. 1–2 exactly, still counts them). Such a
    token moves a score by next to nothing and costs as much as any other: the trained 128-d
    model gives 28 % of its SciFact query tokens of weight > 0 a weight below 10⁻⁹ of the
    query's largest and 35 % below 10⁻³, together 10⁻⁵ of the weight. At 10⁻⁴ / 10⁻³ / 10⁻²
    34.4 / 35.6 / 36.5 % of the train queries' tokens of weight > 0 are left out; on 200 of
    them (``tune_search.py``, ``benchmarks/results/stop78/tune_light/``) the trained 2-bit
    store at 1× and grown 100× gave at each of 0 / 10⁻⁴ / 10⁻³ / 10⁻² the same nDCG@10,
    R@100 and top-10 overlap, top-100 overlap 0.947 / 0.945 / 0.945 / 0.945 and 0.416 / 0.414
    / 0.414 / 0.414. The smallest share that leaves out nearly all of them: 10⁻⁴. Interleaved
    per query on the 100× store (``benchmarks/results/stop78/query_path_ab_light_stop78.md``):
    p50 1.15× faster at k = 10, 1.21× at k = 100. A model without saliences (every u^q equal)
    is unaffected. 0: every token of weight > 0 (stop 77's search).
    """

    probes: int | None = None
    interaction_docs: int | None = None
    refine_docs: int | None = None
    refine_margin: float | None = None
    xtr_probes: int | None = None
    probe_docs: int | None = None
    refine_per_k: float = REFINE_PER_K
    interaction_per_refine: int = INTERACTION_PER_REFINE
    residual_interaction: bool = True
    residual_per_refine: float = RESIDUAL_PER_REFINE
    residual_candidates: bool | None = None
    rescore_per_refine: float = RESCORE_PER_REFINE
    rescore_below_reach: float = RESCORE_BELOW_REACH
    refine_float: float | None = None
    refine_float_min: int = REFINE_FLOAT_MIN
    refine_float_max: int = REFINE_FLOAT_MAX
    query_tokens_ref: int | None = None
    impute_depth: float = IMPUTE_DEPTH
    mean_weight: float = MEAN_WEIGHT
    mean_docs: int = MEAN_DOCS
    fill_docs: int = FILL_DOCS
    light_share: float = LIGHT_SHARE

    def __post_init__(self):
        name = type(self).__name__
        checks.number(f"{name}.refine_margin", self.refine_margin, low=0.0, allow_none=True)
        for field in ("probes", "interaction_docs", "refine_docs", "xtr_probes"):
            checks.integer(f"{name}.{field}", getattr(self, field), minimum=1, allow_none=True)
        checks.integer(f"{name}.probe_docs", self.probe_docs, minimum=1, allow_none=True)
        checks.integer(f"{name}.interaction_per_refine", self.interaction_per_refine, minimum=1)
        checks.number(f"{name}.refine_per_k", self.refine_per_k, low=0.0)
        checks.number(f"{name}.residual_per_refine", self.residual_per_refine, low=1.0)
        checks.number(f"{name}.rescore_per_refine", self.rescore_per_refine, low=0.0)
        checks.number(f"{name}.rescore_below_reach", self.rescore_below_reach, 0.0, 1.0)
        checks.number(f"{name}.refine_float", self.refine_float, low=0.0, allow_none=True)
        checks.integer(f"{name}.refine_float_min", self.refine_float_min, minimum=0)
        checks.integer(f"{name}.refine_float_max", self.refine_float_max, minimum=1)
        checks.number(f"{name}.impute_depth", self.impute_depth, low=1.0)
        checks.number(f"{name}.mean_weight", self.mean_weight, low=0.0)
        checks.integer(f"{name}.mean_docs", self.mean_docs, minimum=1)
        checks.integer(f"{name}.fill_docs", self.fill_docs, minimum=0)
        checks.number(f"{name}.light_share", self.light_share, 0.0, 0.5)
        checks.integer(
            f"{name}.query_tokens_ref", self.query_tokens_ref, minimum=1, allow_none=True
        )

    def decided(self) -> CentroidSearchConfig:
        """This config with ``residual_candidates`` decided: None = on, for every index (each
        can read its tokens by centroid, ``CentroidSearcher.token_lists``; stop 73's lists by
        position, where it once depended on the index's size). ``probe_docs`` stays as given
        (None: it follows the requested k, ``documents_per_probe``)."""
        residual = True if self.residual_candidates is None else self.residual_candidates
        return dataclasses.replace(self, residual_candidates=residual)

    def documents_per_probe(self, k: int | None = None) -> int:
        """``probe_docs``, or when automatic ``residual_probe_docs(k)`` with residual
        candidates (k None: the deepest, ``RESIDUAL_PROBE_DOCS``) and ``PROBE_DOCS`` without
        (an undecided ``residual_candidates`` counts as off)."""
        if self.probe_docs:
            return self.probe_docs
        return residual_probe_docs(k) if self.residual_candidates else PROBE_DOCS

    def resolved(
        self, num_docs: int, num_centroids: int, list_docs: float, k: int = 0, n: int = 0
    ) -> tuple[int, int, int]:
        """(probes, interaction_docs, refine_docs) for an index of these sizes (``list_docs``:
        the mean number of documents in an inverted list), ``k`` requested documents (0: not
        known; the probes of the deepest search) and a query of ``n`` probing tokens (0: not
        known; ``query_tokens_ref``); an automatic ``probe_docs`` counts as ``PROBE_DOCS``
        unless residual candidates are on (``decided`` decides them)."""
        reach = self.documents_per_probe(k or None)
        if not self.probe_docs:
            reach = reach * reach_factor(num_docs, k or None)
        if self.query_tokens_ref and 0 < n < self.query_tokens_ref:
            reach = reach * self.query_tokens_ref / n
        probes = self.probes or int(np.clip(round(reach / max(list_docs, 1e-9)), 2, MAX_PROBES))
        low, high = MIN_REFINE
        refine = self.refine_docs or max(
            int(np.clip(math.ceil(0.75 * math.sqrt(num_docs)), low, high)),
            min(math.ceil(self.refine_per_k * k), MAX_REFINE),
        )
        interaction = self.interaction_docs or self.interaction_per_refine * refine
        return min(probes, num_centroids), interaction, min(refine, interaction)

    def rescored(self, refine_docs: int, k: int) -> int:
        """Stage-2 documents re-scored by the residual interaction before ``refine_docs`` of
        them are refined, for ``k`` requested: ⌈rescore_per_refine · min(k / RESCORE_K, 1) ·
        refine_docs⌉ (none when that is not above ``refine_docs``)."""
        m = math.ceil(self.rescore_per_refine * min(k / RESCORE_K, 1.0) * refine_docs)
        return m if m > refine_docs else 0


def reach_factor(num_docs: int, k: int | None = None) -> float:
    """How many times the automatic documents-per-token reach (``residual_probe_docs``,
    ``PROBE_DOCS``) a collection of ``num_docs`` documents gets for ``k`` requested documents
    (None: the deepest search): max(1, (N / REACH_DOCS)^γ), γ = ``REACH_EXPONENT`` (1) at
    k ≥ ``RESIDUAL_PROBE_K``, ``REACH_EXPONENT_K10`` (½) at k ≤ 10, interpolated in log k
    between (not tuned there).

    The reaches were chosen on stores of at most ``REACH_DOCS`` documents. A fixed reach is a
    shrinking share of a growing collection, and past the centroid cap (65,536 at 128-d, from
    16.8M tokens) the lists lengthen with the corpus, so that the probes fall to 2: on the
    trained 128-d store grown 195× (1.01M documents, 124.5M tokens; ``benchmarks/scale.py``'s
    distractors, test queries, a diagnosis) the k = 100 search never reached 37 % of the
    exhaustive top 100 and 5 of the 11 relevant documents it lost, with 2 probes. Stop 65
    chose √(N / REACH_DOCS) on SciFact's train queries on the store grown 30×
    (``benchmarks/results/tune_stop65/``), a judgement between reaching 2,560 and 5,120
    documents (no setting met the written rule's overlaps).

    At k ≥ 100 the reach is a fixed share of the collection since stop 76, chosen on SciFact's
    train queries (200) on the trained 2-bit store grown 100× (518k documents, 63.9M tokens;
    ``benchmarks/results/tune_stop76/``): reaching 8,095 (√, 8 probes) / 14,400 (15) / 25,600
    (26, the linear rule) / 31,000 (32) documents gave R@100 91.4 / 92.9 / 94.4 / 94.4
    (exhaustive search 94.4), nDCG@10 71.8 / 72.7 / 72.8 / 72.7 (70.4), for p50 47.4 / 52.5 /
    71.8 / 67.5 ms at k = 100. No setting meets the tuning rule's overlaps (top-10 overlap at
    most 0.734, top-100 0.437); the rule applied is its quality part, the cheapest setting
    with nDCG@10 within 0.5 and R@100 within 1 point of exhaustive search: 25,600, N /
    REACH_DOCS = 10.0 times 2,560. At k = 10 every setting keeps nDCG@10 within 0.5 (71.8 at
    the √ rule's 4 probes): the k = 10 reach keeps √N. The work per query grows with N past
    REACH_DOCS documents (up to ``MAX_PROBES`` per query token): the price of the recall."""
    if k is None or k >= RESIDUAL_PROBE_K:
        exponent = REACH_EXPONENT
    else:
        t = float(np.clip(math.log10(max(k, 1) / 10), 0.0, 1.0))
        exponent = REACH_EXPONENT_K10 + t * (REACH_EXPONENT - REACH_EXPONENT_K10)
    return max(1.0, (num_docs / REACH_DOCS) ** exponent)


def residual_probe_docs(k: int | None) -> int:
    """Documents a query token reaches with residual candidates for ``k`` requested documents:
    ``RESIDUAL_PROBE_DOCS`` at k ≥ ``RESIDUAL_PROBE_K`` (or k None), halved for each tenfold
    fewer documents, at least ``PROBE_DOCS``: 2,560 at k = 100, 1,280 at k = 10, 640 at k = 1.
    The two ends were chosen on SciFact's train queries (``tune_search.py``): at k = 100 the
    cheapest setting within 1 point of exhaustive R@100 (10×, distractors), at k = 10 the
    cheapest whose top-10 overlap with exhaustive search is ≥ 0.95 (zero-shot, 1×: 0.978
    against 0.985 at 2,560, 0.946 at 640; the trained model reaches ≤ 0.85 at any setting,
    its codec's error, and at 10× loses 0.04 of it at 1,280: 0.560 against 0.601); between
    the two ends the rule is interpolated, not tuned. Those figures are with WARPSELECT's
    imputation; with ``impute_depth=2`` (stop 53) 640 would pass at k = 10 too (0.971) and
    1,280 gives 0.983; the rule was kept, the margin left for collections unlike SciFact."""
    if k is None or k >= RESIDUAL_PROBE_K:
        return RESIDUAL_PROBE_DOCS
    scaled = RESIDUAL_PROBE_DOCS * (max(k, 1) / RESIDUAL_PROBE_K) ** math.log10(2)
    return int(np.clip(round(scaled), PROBE_DOCS, RESIDUAL_PROBE_DOCS))


def lists_in_memory_bytes(index: ci.CentroidIndex, num_tokens: int) -> int:
    """Bytes of the token lists copied in memory for an index without them: a document (4
    bytes) and a packed residual per β^d-kept token (β^d·T of them, about)."""
    kept = math.ceil(index.meta["config"]["beta_d"] * num_tokens)
    return ci.token_lists_bytes(kept, index.codec.dim, index.codec.bits)


def top_columns(s: np.ndarray, w: int) -> np.ndarray:
    """Column indices of the ``w`` largest entries of each row of ``s [n, C]``, in no order
    (ties broken arbitrarily, as ``np.argpartition``'s).

    The w largest of a row lie in the w blocks of b columns with the largest maxima (any other
    block's entries are each below w such maxima), so a row is selected among those w·b
    entries: one pass over ``s`` for the block maxima, then partitions of C/b and w·b entries
    (b ≈ √(C/w)) instead of a partition of every row (65,536 centroids, 3 columns, 26 rows:
    0.7 ms against 20–50 ms)."""
    n, c = s.shape
    block = 1 << max(4, round(math.log2(math.sqrt(c / max(w, 1)))))
    if w * block * 4 > c:  # few blocks: a partition of the whole rows costs about as much
        return np.argpartition(-s, w - 1, axis=1)[:, :w]
    maxima = np.maximum.reduceat(s, np.arange(0, c, block), axis=1)  # [n, blocks]
    blocks = np.argpartition(-maxima, w - 1, axis=1)[:, :w]
    cols = (blocks[:, :, None] * block + np.arange(block)).reshape(n, w * block)
    values = np.take_along_axis(s, np.minimum(cols, c - 1), axis=1)
    values[cols >= c] = -np.inf  # the columns past the end of a shorter last block
    return np.take_along_axis(cols, np.argpartition(-values, w - 1, axis=1)[:, :w], axis=1)


def probed(
    s_t: np.ndarray, p: int, depth: float = 1.0, rows: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each query token ``rows[i]`` (default: every one) of Sᵀ ``s_t [C, n]``: its ``p``
    best centroids, best first (ties: the lower centroid first), their scores, and the token's
    imputed score: its ⌈depth·(p + 1)⌉-th best centroid's (depth 1: the first one not probed,
    WARPSELECT; ``CentroidSearchConfig.impute_depth``), or its last probed one − 1 when every
    centroid is probed.

    One compiled pass over Sᵀ in memory order (``probe_select``); without numba, or for a
    token with fewer such scores above −∞, a selection from the copied rows of S
    (``top_columns``; ties there in the partition's order)."""
    rows = np.arange(s_t.shape[1]) if rows is None else np.asarray(rows)
    width = min(max(math.ceil(depth * (p + 1)), p + 1), s_t.shape[0])
    chosen = probe_select.select(s_t, rows, width) if probe_select.available() else None
    if chosen is not None:
        top, scores = chosen
    else:
        s = s_t.T[rows]  # [n', C]
        top = top_columns(s, width)
        top = np.take_along_axis(top, np.argsort(-np.take_along_axis(s, top, 1), axis=1), 1)
        scores = np.take_along_axis(s, top, axis=1)
    imputed = scores[:, -1] if width > p else scores[:, -1] - 1.0
    return top[:, :p], scores[:, :p], imputed


def _segment_starts(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


SEGMENT_ROWS = 4096  # rows transposed at a time by segment_max


def segment_max(
    values: np.ndarray, lengths: np.ndarray, at_max: np.ndarray | None = None
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The maximum of each run of consecutive rows of ``values [T, n]`` (runs of ``lengths``,
    summing to T): ``[len(lengths), n]``; a run of length 0 gives −∞. With ``at_max [T]``
    (a value per row) also, per run and column, the largest ``at_max`` of the rows that attain
    the maximum (Eq. 2: the salience u^d of the selected token): ``(maxima, selected)``.

    The same as ``np.maximum.reduceat(values, starts, axis=0)`` for runs of length ≥ 1, 2–4×
    faster: NumPy reduces along axis 0 with one inner loop of length n per row, so on a few
    dozen query tokens the loop overhead dominates. Here runs are grouped into blocks of at
    most ``SEGMENT_ROWS`` rows (a longer run is a block of its own), each block is transposed
    into a per-thread scratch buffer and reduced along its contiguous axis."""
    lengths = np.asarray(lengths, np.int64)
    num, n = len(lengths), values.shape[1]
    if not lengths.all():
        out = np.full((num, n), -np.inf, values.dtype)
        sel = np.full((num, n), -np.inf, np.float32)
        nonempty = np.flatnonzero(lengths)
        if len(nonempty):
            part = segment_max(values, lengths[nonempty], at_max)
            if at_max is None:
                out[nonempty] = part
            else:
                out[nonempty], sel[nonempty] = part
        return out if at_max is None else (out, sel)
    out = np.empty((num, n), values.dtype)
    sel = None if at_max is None else np.empty((num, n), np.float32)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    g0 = 0
    while g0 < num:
        r0 = int(starts[g0])
        g1 = max(g0 + 1, int(np.searchsorted(ends, r0 + SEGMENT_ROWS, side="right")))
        r1 = int(ends[g1 - 1])
        local = starts[g0:g1] - r0
        block = scratch.buffer("segment_max.block", (n, r1 - r0), values.dtype)
        np.copyto(block, values[r0:r1].T)
        best = np.maximum.reduceat(block, local, axis=1)  # [n, runs]
        out[g0:g1] = best.T
        if sel is not None:
            rep = scratch.buffer("segment_max.repeated", block.shape, values.dtype)
            np.take(best, np.repeat(np.arange(g1 - g0), lengths[g0:g1]), axis=1, out=rep)
            chosen = scratch.buffer("segment_max.chosen", block.shape, np.float32)
            chosen.fill(-np.inf)
            np.copyto(chosen, np.broadcast_to(at_max[r0:r1], block.shape), where=block == rep)
            sel[g0:g1] = np.maximum.reduceat(chosen, local, axis=1).T
        g0 = g1
    return out if sel is None else (out, sel)


def _best(scores: np.ndarray, m: int) -> np.ndarray:
    """Indices of the ``m`` largest scores (all when there are fewer), ascending; of the scores
    equal to the m-th largest, the lowest indices.

    Stage 2 reaches tens of thousands of documents and keeps a few hundred or thousand
    (85,000 → 128–3,000 on the trained store grown 100×), and a partition of every score,
    with its negated copy and int64 index array, cost 0.7–2 ms each time. When m is small
    against them, a threshold a little below the m-th best of a strided sample of the scores
    keeps ~1.5·m of them in one comparison, and only those are partitioned. Every score of
    the m largest is at least the m-th largest, which is at least the threshold whenever m
    scores pass it, so the result is the same; else (an unlucky sample) every score is.

    Ties at the m-th score are common at scale (stage 2 gives documents reached only through
    copies of one token one score: on that store the 3,000th best was shared by up to 54,000
    documents for 17 of 50 queries); they are broken by index, not by the partition's order.
    Those ties often sit at the threshold itself (a sample of a tied score draws its threshold
    there), so only the scores strictly above it are partitioned: when m of them pass, they
    hold the m largest and every tie at the m-th; when fewer do but m reach it, the m-th
    largest is the threshold, and the scores above it plus the first of those equal to it are
    the answer, with no partition (stage 2's best 3,000 on SciFact grown 100×: up to 62,000
    scores reached the threshold, a mean 1.4 ms per query went to partitioning them)."""
    n = len(scores)
    if m >= n:
        return np.arange(n)
    kept = None
    if n >= SELECT_PREFILTER_MIN and m * 8 <= n:
        sample = scores[:: max(n // SELECT_SAMPLE, 1)]
        j = min(len(sample), math.ceil(1.5 * m * len(sample) / n) + 8)
        threshold = np.partition(sample, len(sample) - j)[len(sample) - j]
        above = np.flatnonzero(scores > threshold)
        if len(above) >= m:
            kept = above
        else:
            equal = np.flatnonzero(scores == threshold)[: m - len(above)]
            if len(above) + len(equal) == m:  # the m-th largest is the threshold
                return np.sort(np.concatenate([above, equal]))
    part = scores if kept is None else scores[kept]
    mth = np.partition(part, len(part) - m)[len(part) - m]  # the m-th largest
    taken = part > mth  # then the first of the ties at the m-th, as many as are missing
    taken[np.flatnonzero(part == mth)[: m - int(taken.sum())]] = True
    chosen = np.flatnonzero(taken)
    if len(chosen) < m:  # NaN scores (sorted above every number): as before, never chosen
        return np.argpartition(-scores, m - 1)[:m]
    return chosen if kept is None else kept[chosen]


def _added_to_best(approx: np.ndarray, top: np.ndarray, term: np.ndarray) -> np.ndarray:
    """``approx`` with ``term`` (one value per index of ``top``) added at ``top`` and the least
    of it everywhere else, so that the documents outside ``top`` stay below them."""
    out = approx + term.min()
    out[top] = approx[top] + term
    return out


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores, best first (ties: lower index first)."""
    part = _best(scores, k)
    return part[np.argsort(-scores[part], kind="stable")]


@dataclasses.dataclass
class StageCounts:
    candidates: int
    interaction: int
    refined: int
    refined_tokens: int = 0  # stored tokens of the refined documents (Σ_c m_c of refinement)


class CentroidSearcher:
    """Runs the four stages for one query at a time over a store and its compressed index."""

    def __init__(
        self,
        store: ts.TokenStore,
        index: ci.CentroidIndex,
        config: CentroidSearchConfig | None = None,
        salience: bool = True,
    ):
        """``salience=False``: every stored token's u^d is 1 (``SearchConfig.salience``)."""
        self.store = store
        self.index = index
        self.config = (config or CentroidSearchConfig()).decided()
        self.list_docs = index.lists.num_entries / max(index.num_centroids, 1)
        self.probes, self.interaction_docs, self.refine_docs = self.counts()
        self._scratch = threading.local()
        self.xtr_probes = min(self.config.xtr_probes or 4 * self.probes, index.num_centroids)
        self.alive = ~store.deleted
        self._token_lists = None
        self.uniform_salience = not salience or not store.has_saliences
        if not self.uniform_salience and index.salience is None:
            raise ValueError(f"{index.directory}: the index holds no saliences; rebuild it")
        self.salience = None if self.uniform_salience else index.salience
        if self.config.refine_float is None:
            auto = 0.0 if self.uniform_salience else REFINE_FLOAT
            self.config = dataclasses.replace(self.config, refine_float=auto)

    def counts(self, k: int = 0, n: int = 0) -> tuple[int, int, int]:
        """(probes, interaction_docs, refine_docs) of a search for ``k`` documents on this index
        by a query of ``n`` probing tokens (``CentroidSearchConfig.resolved``; k = 0: the
        deepest search's probes; n = 0: not known)."""
        return self.config.resolved(
            self.store.num_docs, self.index.num_centroids, self.list_docs, k, n
        )

    # -- stages ----------------------------------------------------------------------------------
    def candidates(
        self, s_t: np.ndarray, probe_rows: np.ndarray, weights: np.ndarray, alive=None, probes=None
    ):
        """Stage 2: (candidate docs, approximate scores) from the probed inverted lists (``probes``
        per query token; default ``self.probes``); only documents with ``alive[doc]`` (default:
        not deleted) are kept.

        One vectorised step per query token over the concatenation of its probed lists (best
        probe first): a document's best probed score is written last-wins in reverse order, and
        Σ_i w_i·(best_i − imputed_i) is accumulated once per document (a fancy ``+=`` adds once
        per distinct index) in per-thread scratch arrays that are reset where touched. The work
        is the number of list entries read, never a sort of them or an array per candidate."""
        top, top_scores, imputed = probed(
            s_t, probes or self.probes, self.config.impute_depth, probe_rows
        )
        w = np.asarray(weights[probe_rows], np.float32)
        best, acc, seen = self._buffers()
        for i in range(len(probe_rows)):
            docs, values = self.index.lists.probe(top[i], top_scores[i])
            best[docs[::-1]] = values[::-1]  # the best probe's score wins
            acc[docs] += w[i] * (best[docs] - imputed[i])
            seen[docs] = True
        return self._reached(w, imputed, alive)

    def residual_candidates(
        self,
        q: np.ndarray,
        s_t: np.ndarray,
        probe_rows: np.ndarray,
        weights,
        alive=None,
        probes=None,
        probe=None,
    ):
        """Stage 2 with residuals (WARP §3's candidate scoring for Eq. 1–2): each kept query
        token's probed clusters are read token by token (centroid → β^d-kept tokens), every
        token scored q·(c + r̂) without decoding; a document gets, for that query token, its
        best such token, else the token's imputed score (``probed``, ``impute_depth``).

        Centroid scores alone cannot tell apart documents whose tokens share centroids (near
        duplicates; ``benchmarks/scale.py``'s distractors): these scores can. ``probe``: the
        probed clusters, their scores and the imputed scores, if ``probed`` gave them already."""
        top, top_scores, imputed = probe or probed(
            s_t, probes or self.probes, self.config.impute_depth, probe_rows
        )
        qk = np.asarray(q[probe_rows], np.float32)
        w = np.asarray(weights[probe_rows], np.float32)
        return self._score_probed(qk, w, top, top_scores, imputed, alive)

    def _score_probed(self, q, w, top, top_scores, imputed, alive) -> tuple:
        """WARP's candidate scoring over the clusters ``top [n, p]`` (scores ``top_scores``) of
        query tokens ``q [n, D]`` (weights ``w``, imputed scores ``imputed``): the reached
        documents and their scores (``_reached``). Each probed cluster's packed residuals are
        one run of the token lists (``token_lists``), read where they lie; all query tokens in
        one compiled pass (``probe_scores``) or, without numba, one product ``[rows, W] @
        [W, 1]`` per plane and query token. With several list groups (an index after
        ``--add``), each is read in turn: a document's tokens are all in one group."""
        best, acc, seen = self._buffers()
        threads = blas.threads()
        for lists in self.token_lists():
            lengths = np.diff(lists.offsets)
            if probe_scores.available():
                probe_scores.accumulate(
                    self.index.codec, q, top, top_scores, lists.offsets[:-1], lengths,
                    lists.residuals, lists.docs, w, imputed, self._floor(), acc, seen,
                    threads=threads, rows=lists.rows,
                )  # fmt: skip
                continue
            for i in range(len(q)):
                pos, _ = concatenated_ranges(lists.offsets, top[i])
                values = self.index.codec.residual_scores(q[i : i + 1], lists.residual_rows(pos))[0]
                values += np.repeat(top_scores[i], lengths[top[i]])
                d = lists.docs[pos]
                best[d] = -np.inf
                np.maximum.at(best, d, values)  # each document's best token for query token i
                acc[d] += w[i] * (best[d] - imputed[i])
                seen[d] = True
        return self._reached(w, imputed, alive)

    def _reached(self, w: np.ndarray, imputed: np.ndarray, alive) -> tuple:
        """Stage 2's end: the reached documents (``alive`` ones: default, not deleted) and
        Σ_i w_i·(best_i or imputed_i) / Σ w from the scratch the token loop filled (reset)."""
        _, acc, seen = self._buffers()
        cands = np.flatnonzero(seen)
        approx = (float(w @ imputed) + acc[cands]) / max(float(w.sum()), 1e-12)
        scratch.clear((acc, seen), cands)
        keep = (self.alive if alive is None else alive)[cands]
        return cands[keep], approx[keep]

    def with_means(
        self, q: np.ndarray, weights: np.ndarray, probe_rows: np.ndarray, cands, approx
    ) -> np.ndarray:
        """Stage 2's estimate ``approx`` of ``cands`` with ``mean_weight`` · q̄·m_d added to its
        best ``mean_docs``: q̄ = Σ_i w_i q_i / Σ w over the probing query tokens, m_d the
        document's mean token vector (``CentroidIndexConfig.doc_means``); the others get the
        least of those terms, so they stay below. Unchanged for an index without the means.

        Stage 2 scores a query token that did not reach a document by one value for every such
        document; with soft matches most of a document's terms are imputed (``reached_share``)
        and that order decides which documents the later stages see. q̄·m_d = Σ_i w_i q_i·m_d /
        Σ w tells how close the document as a whole lies to every query token, a
        single-vector score of the kind dense retrieval uses, for one gather of D values per
        document. On the trained 128-d store grown 10× (``benchmarks/scale.py``'s distractors),
        the share of the exhaustive top 10 among stage 2's best 128 rose 0.854 → 0.881 with
        0.2, among its best 300 for the top 100 0.572 → 0.620 (100 train queries)."""
        weight = self.config.mean_weight
        if not weight or self.index.means is None or not len(cands):
            return approx
        w = np.asarray(weights[probe_rows], np.float32)
        q_bar = (w @ np.asarray(q[probe_rows], np.float32)) / max(float(w.sum()), 1e-12)
        top = _best(approx, self.config.mean_docs)
        rows = self.index.means[cands[top]]  # float16; NumPy's cast of it is 3× slower
        means = half.to_float32(rows, scratch.buffer("with_means.rows", rows.shape, np.float32))
        return _added_to_best(approx, top, np.float32(weight) * (means @ q_bar))

    def with_centroid_terms(
        self, s_t: np.ndarray, probe_rows: np.ndarray, probe: tuple, weights, cands, approx
    ) -> np.ndarray:
        """Stage 2's estimate ``approx`` of ``cands`` with, for its best ``fill_docs``, each
        imputed term replaced by the document's best centroid score for that query token
        (PLAID's centroid interaction, applied to the terms stage 2 did not reach); the others
        get the least change, so they stay below. 0: unchanged.

        A query token reaches a document when one of its ``probes`` best clusters holds a
        token of it, i.e. when the document's best centroid score for it is at least the
        token's ``probes``-th best (``reached_share``); stage 2 gives every other document one
        imputed value (``probe``: ``probed``'s clusters, their scores and the imputed scores).
        The document's own best centroid score, read from its distinct centroid ids
        (``_best_codes``), says how near its nearest token lies."""
        m = min(self.config.fill_docs, len(cands))
        w = np.asarray(weights, np.float32)[probe_rows]
        if not m or not w.sum():
            return approx
        _, top_scores, imputed = probe
        floor = top_scores[:, -1]  # the probes-th best: a reached document scores at least this
        top = _best(approx, m)
        best = self._best_codes(s_t, cands[top])[:, probe_rows]  # [m, n']
        delta = (np.where(best < floor, best - imputed, 0.0) @ w) / float(w.sum())
        return _added_to_best(approx, top, delta.astype(np.float32))

    def _buffers(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-thread scratch of stage 2 (best score, accumulated score, reached), one entry
        per document, allocated once; stage 2 leaves them zeroed where it touched them."""
        buffers = getattr(self._scratch, "buffers", None)
        if buffers is None or len(buffers[0]) != self.store.num_docs:
            n = self.store.num_docs
            buffers = (np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, bool))
            self._scratch.buffers = buffers
        return buffers

    def _floor(self) -> np.ndarray:
        """Per-thread scratch of ``probe_scores``: −∞ per document, left so by each use."""
        floor = getattr(self._scratch, "floor", None)
        if floor is None or len(floor) != self.store.num_docs:
            floor = self._scratch.floor = np.full(self.store.num_docs, -np.inf, np.float32)
        return floor

    def _best_codes(self, s_t: np.ndarray, docs: np.ndarray) -> np.ndarray:
        """Each document's best centroid score per query token ``[docs, n]``, over its distinct
        centroid ids — or, for an index without document → centroid lists, its tokens'
        centroid ids (the same maxima) — in one fused pass (``gather_max``)."""
        if self.index.lists.has_doc_lists:
            codes, lengths = self.index.lists.document_centroids(docs)
        else:
            rows, lengths = concatenated_ranges(self.store.offsets, docs)
            codes = self.index.codes[rows]
        return gather_max.gather_segment_max(s_t, codes, lengths, reference=segment_max)

    def interaction(self, s_t: np.ndarray, docs: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Stage 3: Σ_i w_i max_j S[i, code_j] / Σ w over all stored tokens of ``docs``, read
        from each document's distinct centroid ids (or its tokens' codes, see ``_best_codes``).

        ``s_t`` is Sᵀ ``[C, n]`` (token-major gathers read contiguous rows)."""
        return self._interaction(s_t, docs, weights)[0]

    def _interaction(
        self, s_t: np.ndarray, docs: np.ndarray, weights: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(``interaction`` scores of ``docs``, each document's best centroid score per query
        token ``[docs, n]``), from one gather of centroid scores."""
        best = self._best_codes(s_t, docs)
        return (best @ weights) / max(float(weights.sum()), 1e-12), best

    def reached_share(
        self,
        s_t: np.ndarray,
        probe_rows: np.ndarray,
        probes: int,
        docs: np.ndarray,
        u_q,
        probe: tuple | None = None,
    ) -> float:
        """The share of the probing query tokens' weight that stage 2 reached in ``docs``, mean
        over the documents: a document is reached by query token i when its best centroid
        score for i is at least i's ``probes``-th best (one of its probed clusters holds a token
        of the document); the other terms of its stage-2 score were imputed. ``probe``: the
        probed clusters, their scores (best first) and the imputed scores, if ``probed`` gave
        them already (the ``probes``-th best is then read, not selected again)."""
        w = np.asarray(u_q, np.float32)[probe_rows]
        if not len(docs) or not w.sum():
            return 1.0
        if probe is not None:
            floor = probe[1][:, -1]  # the probes-th best, probed's last column
        else:
            floor = probed(s_t, probes, rows=probe_rows)[1][:, -1]  # the probes-th best (or last)
        best = self._best_codes(s_t, docs)[:, probe_rows]  # [docs, n']
        return float(((best >= floor) @ w).mean() / w.sum())

    def best_centroid_tokens(
        self, s_t: np.ndarray, docs: np.ndarray, weights: np.ndarray
    ) -> np.ndarray:
        """For every stored token of ``docs`` (concatenated in order): whether its centroid is
        its document's best for some query token of weight > 0 (every token when no weight
        is) — the tokens the residual interaction scores (``refine(..., keep=)``)."""
        rows, lengths = concatenated_ranges(self.store.offsets, docs)
        return gather_max.tokens_at_own_best(
            s_t, self.index.codes[rows], lengths, weights, reference=_at_own_best
        )

    def refine(
        self,
        q: np.ndarray,
        s_t: np.ndarray,
        docs: np.ndarray,
        u_q: np.ndarray,
        keep: np.ndarray | None = None,
        best_centroids: np.ndarray | None = None,
    ) -> np.ndarray:
        """Stage 4: top-1 alignment with compressed vectors, Eq. 1–2 with u^q and u^d.

        ``keep`` (bool, one per stored token of ``docs`` in order): only these tokens are
        scored, each document's max over them. ``best_centroids`` (``[docs, n]``, each
        document's best centroid score per query token, from stage 3) keeps the tokens of
        ``best_centroid_tokens`` the same way (the residual interaction of stage 3), in one
        compiled pass over the tokens' centroid scores (``gather_max.tokens_at_best``).

        Token-major: ``s_t`` is Sᵀ ``[C, n]``, so a stored token's centroid scores are one
        contiguous row, and its residual scores one row of ``levels @ weightsᵀ``."""
        rows, lengths = concatenated_ranges(self.store.offsets, docs)
        if keep is not None:
            rows, lengths = _kept(rows, lengths, keep)
        if best_centroids is not None:  # one compiled pass over the rows' centroid scores
            at_best = gather_max.tokens_at_best(
                s_t, self.index.codes[rows], lengths, best_centroids, u_q, reference=_at_best
            )
            rows, lengths = _kept(rows, lengths, at_best)
        margin = self.config.refine_margin
        if margin is not None:  # tokens within `margin` of their doc's best centroid score
            sims = scratch.buffer("refine.sims", (len(rows), s_t.shape[1]), np.float32)
            np.take(s_t, np.asarray(self.index.codes[rows], np.intp), axis=0, out=sims)
            best_c = segment_max(sims, lengths)
            near = (sims >= np.repeat(best_c, lengths, axis=0) - margin).any(axis=1)
            rows, lengths = _kept(rows, lengths, near)
        # q·c + q·r̂ and each document's maxima in one pass (no [T, n] matrix), with the u^d of
        # each column's selected (maximal) token; selection is by S alone (Eq. 2).
        u_d = None if self.salience is None else np.asarray(self.salience[rows], np.float32)
        found = residual_max.residual_segment_max(
            self.index.codec, q, s_t, self.index.codes[rows], self.index.residuals[rows],
            lengths, at_max=u_d, threads=blas.threads(), reference=segment_max,
        )  # fmt: skip
        return _top1_scores(found, u_q)

    def refine_stored(self, q: np.ndarray, docs: np.ndarray, u_q: np.ndarray) -> np.ndarray:
        """Stage 4 from the token store's float vectors: Eq. 1–2 exactly (top-1 alignment, u^q
        and u^d), what exhaustive search computes, for ``docs`` only (``stored_top1_scores``).

        Compression moves a stored token's score by up to its residual error, enough to change
        which token a query token selects — and with it the u^d that weights it in Eq. 2: on
        SciFact trained (4 bits, k = 100) top-10 overlap with exhaustive search is 0.855, and
        0.957 with the best 30 documents re-scored here (``benchmarks/results/
        scale_refine_float_x1.md``)."""
        return stored_top1_scores(self.store, docs, [(q, u_q)], self.salience is not None)[0]

    def token_lists(self) -> list[TokenLists]:
        """The centroid → β^d-kept token lists (``inverted_lists.TokenLists``: offsets; each
        token's document and packed residual, in that order) of the residual candidates and the
        XTR scorer: each probed cluster's residuals are then one contiguous run, scored where
        they lie (WARP's layout), where gathering them from store order took more time than
        scoring them (SciFact zero-shot, 8 probes: 3.7 ms of gather against 2.7 ms of scoring).

        An index built with ``CentroidIndexConfig.token_lists`` holds them, one set per list
        group, mapped at load. Otherwise they are built here on first use (``Searcher.load``
        calls it when it will be needed), as one set: shard by shard (one pass counts, one
        places each centroid's tokens in store order), so that besides the lists — documents
        int32 below 2³¹, 4 bytes per kept token, and the residuals' bytes per token again (a
        copy of the index's residuals: 192 bytes at 384-d and 4 bits, 32 at 128-d and 2 bits) —
        the build holds one shard's codes and residuals at a time: the pages of the index's
        maps that a shard's pass read are released after it (``Segmented.release``), so that
        they do not stay counted in the process's RSS beside the copy.

        Where that copy would exceed ``centroid_index.LISTS_IN_MEMORY_MAX``, the lists are
        built by position instead (``inverted_lists.token_rows_in_memory``, one set per index
        segment): each token's document and its row in the segment, 8 bytes per kept token
        whatever the bits and dimension, the residuals read from the index's map where they
        lie — one scattered read per probed token instead of a contiguous run — except in a
        segment written grouped by centroid (``CentroidIndexConfig.cluster_order``, the
        default of such an index since stop 75), whose residuals are its lists' own, read as
        contiguous runs (its 4 bytes per token of rows become the position map refinement
        reads it through)."""
        if self._token_lists is None:
            self._token_lists = self.index.lists.token_lists()
        if self._token_lists is None:
            start = time.perf_counter()
            copy = lists_in_memory_bytes(self.index, self.store.num_tokens)
            residuals = self.index.residuals
            grouped = any(residuals.clustered(k) for k in range(len(residuals.arrays)))
            by_position = copy > ci.LISTS_IN_MEMORY_MAX or grouped
            built = self._build_token_lists(by_position)
            logging.info(
                "%s: token lists built in memory%s (%.0f MB, %.1f s); an index built with "
                "--gin.CentroidIndexConfig.token_lists=True holds them, mapped at load",
                self.index.directory,
                f" by position (a copy of the residuals would take {copy / 2**30:.1f} GiB)"
                if by_position
                else "",
                (
                    sum(
                        lists.nbytes
                        if lists.rows is not None or not grouped
                        # grouped by centroid: the segment's map is the lists' residuals
                        else lists.docs.nbytes + lists.offsets.nbytes
                        for lists in built
                    )
                    + residuals.positions_nbytes()
                )
                / 1e6,
                time.perf_counter() - start,
            )
            self._token_lists = built
        return self._token_lists

    def _build_token_lists(self, by_position: bool = False) -> list[TokenLists]:
        args = (
            self.store, self.index.codes, self.index.residuals, self.index.num_centroids,
            self.index.meta["config"]["beta_d"],
        )  # fmt: skip
        if by_position:
            return lists_lib.token_rows_in_memory(*args)
        return [lists_lib.token_lists_in_memory(*args)]

    @blas.held
    def xtr(
        self, q: np.ndarray, probe_rows: np.ndarray, k: int
    ) -> tuple[tuple[np.ndarray, np.ndarray], int]:
        """f_XTR′ (XTR Eq. 4) of the documents reached by the kept query tokens ``probe_rows``,
        WARP-style (see the module docstring): ((document indices, scores) best first, number of
        live documents reached)."""
        q = np.asarray(q, np.float32)[probe_rows]
        s_t = np.empty((self.index.num_centroids, len(q)), np.float32)
        top, top_scores, missing = probed(
            blas.matmul(self.index.centroids, q.T, s_t), self.xtr_probes
        )
        # f_XTR′ (Eq. 4): each token's best hit in a document, else its imputed score; the mean
        cands, total = self._score_probed(
            q, np.ones(len(q), np.float32), top, top_scores, missing, None
        )
        top_k = _top(total, min(k, len(cands)))
        return (cands[top_k], total[top_k]), len(cands)

    # -- the query path ------------------------------------------------------------------------
    @blas.held
    def search(
        self,
        q: np.ndarray,
        u_q: np.ndarray,
        probe_rows: np.ndarray,
        k: int,
        refine_fn=None,
        allowed: np.ndarray | None = None,
    ) -> tuple[list[tuple[np.ndarray, np.ndarray]], StageCounts]:
        """Ranks documents for one query: ([(doc indices, scores)] per scoring, stage counts).
        Query tokens of weight ``u_q = 0`` take no part (they would add 0 to every score).

        Without ``refine_fn`` stage 4 is top-1 alignment on compressed vectors (one ranking);
        ``refine_fn(docs) -> [S, len(docs)]`` scores the refined documents otherwise (S rankings:
        other alignment strategies, from the float store). ``allowed`` (bool ``[num_docs]``):
        only these documents (and never deleted ones) are candidates — a filter applied during
        candidate generation, not after the top-k is cut.

        NumPy's OpenBLAS, where its idle workers spin, is held at one thread meanwhile
        (``blas.held``).
        """
        alive = self.alive if allowed is None else self.alive & allowed
        q = np.asarray(q, np.float32)
        u_q = np.asarray(u_q, np.float32)
        live = u_q > 0
        float_query = (q[live], u_q[live]) if live.any() and not live.all() else (q, u_q)
        kept = weighed_tokens(u_q, self.config.light_share)
        if kept.any() and not kept.all():
            # a query token of weight 0 changes no score (Eq. 2: it adds 0 to both sums), one
            # of the light tail next to nothing: neither is probed, gathered or refined from
            # compressed vectors (the float refinement counts the light ones: ``float_query``)
            rows = np.flatnonzero(kept)
            probe_rows = np.searchsorted(rows, probe_rows[kept[probe_rows]])
            q, u_q = q[rows], u_q[rows]
        s_t = scratch.buffer("search.s_t", (self.index.num_centroids, len(q)), np.float32)
        blas.matmul(self.index.centroids, q.T, s_t)  # Sᵀ, centroid-major
        probes, interaction_docs, refine_docs = self.counts(k, len(probe_rows))
        if self.config.residual_candidates:
            probe = probed(s_t, probes, self.config.impute_depth, probe_rows)
            cands, approx = self.residual_candidates(q, s_t, probe_rows, u_q, alive, probes, probe)
            approx = self.with_centroid_terms(s_t, probe_rows, probe, u_q, cands, approx)
            approx = self.with_means(q, u_q, probe_rows, cands, approx)
            m = min(self.config.rescored(refine_docs, k), len(cands))
            top = _top(approx, max(m, min(refine_docs, len(cands))))
            below = self.config.rescore_below_reach
            if m > refine_docs and below < 1.0:  # only where stage 2 mostly imputed
                docs = cands[top[:refine_docs]]
                reached = self.reached_share(s_t, probe_rows, probes, docs, u_q, probe)
                m, top = (m, top) if reached < below else (0, top[:refine_docs])
            first, inter = cands[top], approx[top]
            order = np.arange(len(first))
            if m > refine_docs:  # the residual interaction of stage 3 over stage 2's best m
                keep = self.best_centroid_tokens(s_t, first, u_q)
                inter = self.refine(q, s_t, first, u_q, keep=keep)
                order = _top(inter, refine_docs)
        else:
            cands, approx = self.candidates(s_t, probe_rows, u_q, alive, probes)
            approx = self.with_means(q, u_q, probe_rows, cands, approx)
            first = cands[_top(approx, min(interaction_docs, len(cands)))]
            if self.config.residual_interaction:  # the best by centroid scores, by residuals
                m = math.ceil(self.config.residual_per_refine * refine_docs)
                inter, best_centroids = self._interaction(s_t, first, u_q)
                best = _top(inter, m)
                shifted = self.refine(q, s_t, first[best], u_q, best_centroids=best_centroids[best])
                # the others keep their order, below every re-scored document
                inter = inter - inter.max() + (shifted.min() if len(shifted) else 0.0) - 1.0
                inter[best] = shifted
            else:
                inter = self.interaction(s_t, first, u_q)
            order = _top(inter, min(refine_docs, len(first)))
        refined = first[order]
        rest = np.ones(len(first), bool)
        rest[order] = False
        tail = [(first[rest], inter[rest])]
        if len(first) < k:  # the ranking reaches past stage 3's documents into stage 2's
            others = ~np.isin(cands, first, assume_unique=True)
            tail.append((cands[others], approx[others]))
        rankings = self._ranked(q, s_t, u_q, refined, tail, k, refine_fn, float_query)
        offsets = self.store.offsets
        tokens = int((offsets[refined + 1] - offsets[refined]).sum())
        return rankings, StageCounts(len(cands), len(first), len(refined), tokens)

    def _ranked(self, q, s_t, u_q, refined, tail, k: int, refine_fn, float_query=None) -> list:
        """Stage 4 of ``refined`` (compressed top-1, or ``refine_fn``'s rankings), each ranking
        followed by the ``tail`` blocks ``[(docs, estimates)]`` in order, cut at ``k``.
        ``float_query``: the ``(q, u^q)`` the float refinement scores (default: ``q, u_q``)."""
        if refine_fn is None:
            m = 0
            if self.config.refine_float > 0:
                m = max(math.ceil(self.config.refine_float * k), self.config.refine_float_min)
                m = min(m, self.config.refine_float_max)
            m = min(m, len(refined))
            q_x, u_x = float_query or (q, u_q)
            if m and m == len(refined):  # every one from float vectors: none compressed
                return [_merge([(refined, self.refine_stored(q_x, refined, u_x))] + tail, k)]
            exact = self.refine(q, s_t, refined, u_q)
            if m:  # the best m again from float vectors, above the others
                best = _top(exact, m)
                rest = np.ones(len(refined), bool)
                rest[best] = False
                stored = self.refine_stored(q_x, refined[best], u_x)
                tail = [(refined[rest], exact[rest])] + tail
                refined, exact = refined[best], stored
            exact = exact[None, :]
        else:
            exact = np.asarray(refine_fn(refined))
        return [_merge([(refined, row)] + tail, k) for row in exact]


def weighed_tokens(u_q: np.ndarray, light_share: float) -> np.ndarray:
    """Whether each query token takes part in candidate generation (bool ``[n]``): every token
    but the lightest ones whose u^q together are at most ``light_share`` of the query's (Eq. 2:
    such a token moves a score by next to nothing; tokens of weight 0 are always left out,
    ties broken by position). A query of no weight keeps none (the caller keeps them all)."""
    u = np.asarray(u_q, np.float64)
    order = np.argsort(u, kind="stable")
    light = np.cumsum(u[order]) <= light_share * u.sum()
    kept = np.ones(len(u), bool)
    kept[order[light]] = False
    return kept


def _kept(rows: np.ndarray, lengths: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ``keep`` (bool per row) rows of consecutive documents of ``lengths`` rows, and each
    document's count of them."""
    return rows[keep], np.add.reduceat(keep, _segment_starts(lengths)).astype(np.int64)


STORED_TOP1_ELEMENTS = 1 << 21  # floats of one chunk's vectors and similarities (8 MiB)


def stored_top1_scores(
    store: ts.TokenStore,
    docs: np.ndarray,
    queries: list[tuple[np.ndarray, np.ndarray]],
    salience: bool = True,
    max_elements: int = STORED_TOP1_ELEMENTS,
) -> np.ndarray:
    """Eq. 1–2 exactly with top-1 alignment, from the token store's float vectors: the score of
    each of ``docs`` for each query ``(q [n, D], u^q [n])``, ``[len(queries), len(docs)]``.
    ``salience=False``: every stored token's u^d is 1 (``SearchConfig.salience``).

    What the JAX ``refine.Refiner`` computes for ``top_k:1``, on the CPU without padding or
    compilation: documents are read in chunks of consecutive store rows (each chunk's vectors
    and similarities at most ``max_elements`` floats, or one document), one product of a
    chunk's vectors with every query token at once, then each document's maximum per query
    token and the u^d of the token that holds it in one compiled pass (``gather_max``; its
    selection is by the similarity alone, Eq. 2). Memory is one chunk, whatever the corpus."""
    docs = np.asarray(docs, np.int64)
    q_all = np.ascontiguousarray(np.concatenate([q for q, _ in queries]), np.float32)
    bounds = np.cumsum([0] + [len(q) for q, _ in queries])
    out = np.zeros((len(queries), len(docs)), np.float32)
    lengths = store.offsets[docs + 1] - store.offsets[docs]
    per_token = store.dim + len(q_all)
    ends = np.cumsum(lengths)
    lo = 0
    while lo < len(docs):
        start = ends[lo - 1] if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, start + max_elements // per_token, "right")))
        part, part_lengths = docs[lo:hi], lengths[lo:hi]
        t = int(part_lengths.sum())
        vectors = scratch.buffer("stored_top1.vectors", (t, store.dim), np.float32)
        store.concatenated("vectors", part, out=vectors)
        sims = scratch.buffer("stored_top1.sims", (t, len(q_all)), np.float32)
        blas.matmul(vectors, q_all.T, sims)
        u_d = store.concatenated("salience", part, np.empty(t, np.float32)) if salience else None
        found = gather_max.gather_segment_max(
            sims, np.arange(t), part_lengths, at_max=u_d, reference=segment_max
        )
        for i, (_, u_q) in enumerate(queries):
            cols = slice(bounds[i], bounds[i + 1])
            one = (found[0][:, cols], found[1][:, cols]) if u_d is not None else found[:, cols]
            out[i, lo:hi] = _top1_scores(one, np.asarray(u_q, np.float32))
        lo = hi
    out[:, lengths == 0] = 0.0  # no token: Eq. 2's empty sums, 0 as the padded path gives
    return out


def _top1_scores(found, u_q: np.ndarray) -> np.ndarray:
    """Eq. 2's score of each document from its top-1 alignment: ``found`` the best score per
    query token ``[docs, n]``, or ``(best, u_sel)`` with the u^d of each selected token —
    Σ_i u^q_i u^d_i best_i / Σ_i u^q_i u^d_i (0 where every weight is 0); Σ_i u^q_i best_i / Σ u^q
    without saliences."""
    if not isinstance(found, tuple):
        return (found @ u_q) / max(float(u_q.sum()), 1e-12)
    best, u_sel = found
    a = u_sel * u_q[None, :]
    z = a.sum(1)
    return np.where(z > 0, (a * best).sum(1) / np.maximum(z, 1e-6), 0.0)


def _at_best(
    sims: np.ndarray, best: np.ndarray, lengths: np.ndarray, weights: np.ndarray
) -> np.ndarray:
    """Whether each stored token's centroid scores ``sims [T, n]`` (tokens of consecutive
    documents, ``lengths`` each) reach its document's ``best [docs, n]`` for some query token
    of weight > 0 (any query token when none has)."""
    live = weights > 0
    at = _at_document_rows(sims, best, lengths)[0]
    return (at if live.all() or not live.any() else at[:, live]).any(axis=1)


def _at_own_best(sims: np.ndarray, lengths: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """``_at_best`` against each document's own maxima (``best_centroid_tokens``)."""
    return _at_best(sims, segment_max(sims, lengths), lengths, weights)


def _at_document_rows(
    sims: np.ndarray, rows: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(``sims [T, n] == `` each token's document row of ``rows [docs, n]``, those rows
    repeated per token ``[T, n]``), both in this thread's scratch buffers."""
    equal = scratch.buffer("at_rows.equal", sims.shape, bool)
    repeated = scratch.buffer("at_rows.repeated", sims.shape, np.float32)
    np.take(rows, np.repeat(np.arange(len(lengths)), lengths), axis=0, out=repeated)
    np.equal(sims, repeated, out=equal)
    return equal, repeated


def _merge(blocks, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Concatenates ranked blocks, each shifted strictly below the previous block's minimum."""
    docs, scores, floor = [], [], np.inf
    remaining = k
    for d, sc in blocks:
        if remaining <= 0 or not len(d):
            continue
        top = _top(sc, min(remaining, len(d)))
        d, sc = d[top], sc[top].astype(np.float64)
        if np.isfinite(floor) and sc[0] >= floor:
            sc = sc - (sc[0] - floor) - 1e-4
        docs.append(d)
        scores.append(sc)
        floor = sc[-1]
        remaining -= len(d)
    if not docs:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(docs), np.concatenate(scores).astype(np.float32)
