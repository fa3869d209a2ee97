"""Search: query tokens → candidate documents → refinement → ranked documents.

``Searcher.load(index_dir)`` opens a persisted index (token store + compressed centroid index +
the encoder that built it) and answers free text: ``search("...", k=10)`` → ``[(doc_id,
score)]``. Backends: ``centroid`` (the compressed index of :mod:`indexing.centroid_index`, four
stages in :mod:`retrieval.centroid_search`: milliseconds per query on a CPU), ``scann`` and
``exact`` (token MIPS, below), or exhaustive refinement (``k_prime = 0``: the quality ceiling).

For the token-MIPS backends the three steps are named and timed (XTR notebook habit):

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
from collections.abc import Mapping, Sequence

import gin
import numpy as np

from aligner_jax.common import checks, errors, progress
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import flops, pruning, scoring, xtr
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import EncodedText, Encoder, EncodingConfig
from aligner_jax.indexing import ann as ti
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import token_store as ts
from aligner_jax.models import aligner as aligner_lib
from aligner_jax.retrieval import centroid_search as cs
from aligner_jax.retrieval import refine as refine_lib

REFINE_MODES = ("full", "xtr")
BACKENDS = ("centroid",) + ti.BACKENDS
MODES = ("fast", "exhaustive")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """Search settings (bind in gin, e.g. ``SearchConfig.backend = 'exact'``).

    Attributes:
      backend: ``centroid`` (compressed index, fast), or token MIPS with ``scann`` or ``exact``.
      k_prime: token neighbours per query token of ``scann``/``exact`` (paper: 4000; the
        ``centroid`` backend sizes its stages by ``CentroidSearchConfig`` instead). 0 = every
        document is a candidate (exhaustive refinement, no candidate generation).
      beta_q: fraction of each query's tokens (top by salience) used for token search (§3.2).
      beta_d: fraction of each document's tokens (top by salience) in the token index (§3.2).
      refine: ``full`` (gather stored token vectors, Eq. 1–2) or ``xtr`` (f_XTR′).
      top_k: documents returned per query (paper: 1000).
      salience: weight the alignment by the model's unary saliences, A = Ã ⊙ (u^q ⊗ u^d)
        (Eq. 2); False: every salience is 1, so top-1 alignment is ColBERT's sum of maxima
        (§2.2) over the same vectors (β^q < 1 then has no salience to rank tokens by and is
        refused; an index built with β^d < 1 keeps the tokens its saliences chose).
      query_batch_size: queries searched and refined together by the token-MIPS backends
        (amortises gathering on dense candidate sets); a query's latency is its batch's time.
    """

    backend: str = "scann"
    k_prime: int = 4000
    beta_q: float = 1.0
    beta_d: float = 1.0
    refine: str = "full"
    top_k: int = 1000
    query_batch_size: int = 8
    salience: bool = True

    def __post_init__(self):
        name = type(self).__name__
        checks.choice(f"{name}.backend", self.backend, BACKENDS)
        checks.choice(f"{name}.refine", self.refine, REFINE_MODES)
        checks.integer(f"{name}.k_prime", self.k_prime, minimum=0)
        checks.number(f"{name}.beta_q", self.beta_q, 0.0, 1.0, low_open=True)
        checks.number(f"{name}.beta_d", self.beta_d, 0.0, 1.0, low_open=True)
        checks.integer(f"{name}.top_k", self.top_k, minimum=1)
        checks.integer(f"{name}.query_batch_size", self.query_batch_size, minimum=1)
        if not isinstance(self.salience, bool):
            raise ConfigError(
                f"{checks.flag(name + '.salience', self.salience)}: expected True or False"
            )
        if not self.salience and self.beta_q < 1.0:
            raise ConfigError(
                f"--gin.SearchConfig.beta_q={self.beta_q!r} ranks query tokens by salience: "
                "use 1.0 with --gin.SearchConfig.salience=False"
            )
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
    """Rankings per strategy plus per-query latencies (milliseconds) and candidate counts.

    A query's latency is the time until its ranking exists: searched alone (``centroid``, or
    ``query_batch_size=1``) its own time; searched in a batch, the batch's whole time (what each
    of its queries waits), never the batch's time divided among them. ``wall_s`` is the time of
    the whole run (throughput: ``len(search_ms) / wall_s`` queries/s).
    """

    results: dict[str, dict[str, dict[str, float]]]
    token_search_ms: list[float]
    refine_ms: list[float]
    num_candidates: list[int]
    costs: list[flops.QueryCost] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0

    @property
    def search_ms(self) -> list[float]:
        return [a + b for a, b in zip(self.token_search_ms, self.refine_ms, strict=True)]


def prune_query_tokens(encoded: EncodedText, beta_q: float) -> np.ndarray:
    """Positions of the query tokens kept at β^q (§3.2; the rule of ``core.pruning``)."""
    return pruning.top_fraction(encoded.salience, beta_q)


def whole_query_encoder(bundle) -> Encoder:
    """An encoder of whole queries (up to the backbone's maximum), as evaluation encodes them."""
    limit = aligner_lib.backbone_max_length(bundle.config.backbone)
    return Encoder(bundle, EncodingConfig(), query_maxlen=limit)


class Searcher:
    """Retrieves and ranks documents of a token store for queries (encoded, or free text with
    an ``encoder``)."""

    def __init__(
        self,
        store: ts.TokenStore,
        config: SearchConfig,
        token_index: ti.TokenIndex | None = None,
        refine_config: refine_lib.RefineConfig | None = None,
        centroid_index: ci.CentroidIndex | None = None,
        centroid_config: cs.CentroidSearchConfig | None = None,
        encoder: Encoder | None = None,
        alignment: str = "top_k:1",
    ):
        if not config.exhaustive and config.backend == "centroid" and centroid_index is None:
            raise ValueError("a centroid index is needed for backend='centroid'")
        if not config.exhaustive and config.backend != "centroid" and token_index is None:
            raise ValueError("a token index is needed when k_prime > 0")
        self.store = store
        self.config = config
        self.token_index = token_index
        self.encoder = encoder
        self.alignment = scoring.AlignmentStrategy.parse(alignment)
        self.centroid = None
        if centroid_index is not None and not config.exhaustive:
            self.centroid = cs.CentroidSearcher(
                store, centroid_index, centroid_config, salience=config.salience
            )
        self._refine_config = refine_config
        self._doc_positions: dict[str, int] | None = None
        self._refiner = None

    @property
    def refiner(self) -> refine_lib.Refiner | None:
        """Refinement over the float store, built on first use (the centroid backend's default
        top-1 path never needs it)."""
        if self._refiner is None and self.config.refine == "full":
            self._refiner = refine_lib.Refiner(
                self.store, self._refine_config, salience=self.config.salience
            )
        return self._refiner

    @classmethod
    def load(
        cls,
        index_dir: str,
        mode: str = "fast",
        checkpoint: str | None = None,
        encoder: Encoder | None = None,
        alignment: str = "top_k:1",
        verify_checksums: bool = False,
        centroid_config: cs.CentroidSearchConfig | None = None,
        **overrides,
    ) -> Searcher:
        """Opens a persisted index for free-text search.

        Args:
          index_dir: a token store folder with its ``search_index/`` (``aligner-index
            --search_index``) and ``encoder.json``.
          mode: ``fast`` (the compressed centroid index) or ``exhaustive`` (every document
            refined with the float store: the quality ceiling).
          checkpoint: a trained model folder replacing the recorded one (same fingerprint).
          encoder: a ready :class:`Encoder` instead of the recorded model.
          alignment: the alignment strategy of the final stage (§3.1).
          overrides: ``SearchConfig`` fields (e.g. ``top_k``, ``beta_q``).
        Refuses an encoder whose fingerprint differs from the store's.
        """
        if mode not in MODES:
            raise ConfigError(f"mode={mode!r}: choose one of {MODES}")
        store = ts.TokenStore(index_dir, verify_checksums=verify_checksums)
        if encoder is None:
            spec_path = store.directory / "encoder.json"
            if not spec_path.exists():
                raise errors.MissingPathError(
                    f"{spec_path} does not exist: this index does not record its model; pass "
                    "the model (--gin_file of the model, or --checkpoint)"
                )
            spec = ts.read_json(
                spec_path,
                "rebuild this index, or pass the model (--gin_file of the model, or --checkpoint)",
            )
            encoder = whole_query_encoder(loading.encoder_from_spec(spec, checkpoint))
        ts.check_model_matches(store.manifest, encoder.bundle.info(), store.directory)
        if mode == "exhaustive":
            config = SearchConfig(**{"backend": "exact", **overrides, "k_prime": 0})
            return cls(store, config, encoder=encoder, alignment=alignment)
        config = SearchConfig(**{"backend": "centroid", "k_prime": 1, **overrides})
        index = ci.CentroidIndex.load(store, verify_checksums=verify_checksums)
        return cls(
            store,
            config,
            centroid_index=index,
            centroid_config=centroid_config,
            encoder=encoder,
            alignment=alignment,
        )

    # -- free text -------------------------------------------------------------------------------
    def search(self, text: str, k: int = 10) -> list[tuple[str, float]]:
        """The ``k`` best documents for a free-text query: ``[(doc_id, score)]``, best first."""
        return self.search_batch([text], k)[0]

    def search_batch(self, texts: Sequence[str], k: int = 10) -> list[list[tuple[str, float]]]:
        """``search`` for several queries (encoded together)."""
        if self.encoder is None:
            raise ConfigError("this Searcher has no encoder: open it with Searcher.load")
        if k < 1:
            raise ConfigError(f"k={k}: must be >= 1")
        encoded = self.encoder.encode(list(texts), "query")
        ids = [str(i) for i in range(len(encoded))]
        out = self.run(ids, encoded, (self.alignment,), show_progress=False, k=k)
        ranked = out.results[next(iter(out.results))]
        return [list(ranked[i].items()) for i in ids]

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
    def run(
        self,
        query_ids: Sequence[str],
        queries: Sequence[EncodedText],
        strategies: Sequence[scoring.AlignmentStrategy | str] = ("top_k:1",),
        show_progress: bool = True,
        k: int | None = None,
    ) -> SearchOutput:
        """Ranks the store's documents for each encoded query with each strategy (the top ``k``,
        default ``SearchConfig.top_k``)."""
        cfg = self.config
        k = cfg.top_k if k is None else k
        strategies = tuple(scoring.AlignmentStrategy.parse(s) for s in strategies)
        queries = self._scored_queries(queries)
        if self.centroid is not None:
            return self._run_centroid(query_ids, queries, strategies, show_progress, k)
        find = lambda ids, batch: self.token_search(batch)  # noqa: E731
        return self._refine_all(query_ids, queries, find, strategies, show_progress, k)

    def rerank(
        self,
        query_ids: Sequence[str],
        queries: Sequence[EncodedText],
        candidates: Mapping[str, Sequence[str]],
        strategies: Sequence[scoring.AlignmentStrategy | str] = ("top_k:1",),
        show_progress: bool = True,
        k: int | None = None,
    ) -> SearchOutput:
        """Refines given candidates instead of searching for them (step 2 after another first
        stage: a TREC run, BM25, a hybrid's candidate union): each query's ``candidates[qid]``
        (document ids; a query without an entry gets none) are scored with all their stored
        token vectors and each strategy (Eq. 1–2) and the top ``k`` returned, as ``run`` does.
        A document id the store does not hold is a ``ConfigError``."""
        if self.config.refine != "full":
            raise ConfigError(
                "reranking refines stored token vectors: use --gin.SearchConfig.refine='full'"
            )
        k = self.config.top_k if k is None else k
        strategies = tuple(scoring.AlignmentStrategy.parse(s) for s in strategies)
        queries = self._scored_queries(queries)
        position = self.doc_positions
        lists = {}
        for qid in query_ids:
            ids = list(dict.fromkeys(candidates.get(qid, ())))
            unknown = [d for d in ids if d not in position]
            if unknown:
                raise ConfigError(
                    f"rerank: query {qid!r} lists {len(unknown)} document(s) the index "
                    f"{self.store.directory} does not hold (first: {unknown[0]!r})"
                )
            lists[qid] = np.asarray([position[d] for d in ids], np.int64)
        given = lambda ids, batch: [(lists[qid], None, None) for qid in ids]  # noqa: E731
        # One query at a time: a batch would score every query against the batch's union.
        return self._refine_all(query_ids, queries, given, strategies, show_progress, k, 1)

    def _scored_queries(self, queries: Sequence[EncodedText]) -> Sequence[EncodedText]:
        """The queries with u^q = 1 when ``SearchConfig.salience`` is off (Eq. 2 without
        saliences), else as given."""
        if self.config.salience:
            return queries
        return [dataclasses.replace(q, salience=np.ones_like(q.salience)) for q in queries]

    @property
    def doc_positions(self) -> dict[str, int]:
        """``{doc_id: index in the store}``, built on first use."""
        if self._doc_positions is None:
            self._doc_positions = {d: i for i, d in enumerate(self.store.doc_ids)}
        return self._doc_positions

    def _refine_all(
        self, query_ids, queries, find, strategies, show_progress, k, batch_size=None
    ) -> SearchOutput:
        """Steps 2 and 3 over query batches (``batch_size``, default
        ``SearchConfig.query_batch_size``); ``find(batch_ids, batch)`` gives each query's
        (candidate doc indices, token scores, token docs) as ``token_search`` does."""
        cfg = self.config
        names = [str(s) for s in strategies]
        if cfg.refine == "xtr":
            names = ["xtr"]
        results: dict[str, dict[str, dict[str, float]]] = {name: {} for name in names}
        token_ms, refine_ms, num_candidates, costs = [], [], [], []
        doc_lengths = self.store.doc_lengths
        qb = max(1, batch_size or cfg.query_batch_size)
        bar = progress.Progress(len(queries), "search", "query", enabled=show_progress)
        start_all = time.perf_counter()
        for lo in range(0, len(queries), qb):
            batch = list(queries[lo : lo + qb])
            batch_ids = list(query_ids[lo : lo + qb])
            t0 = time.perf_counter()
            found = find(batch_ids, batch)
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
                    results[name][qid] = self._rank(cands, scores[s], k)
            # Each query of the batch waits for the whole batch: its latency is the batch's time.
            token_ms += [1000.0 * (t1 - t0)] * len(batch)
            refine_ms += [1000.0 * (t2 - t1)] * len(batch)
            bar.update(len(batch))
        bar.close()
        wall = time.perf_counter() - start_all
        return SearchOutput(results, token_ms, refine_ms, num_candidates, costs, wall)

    def _run_centroid(self, query_ids, queries, strategies, show_progress, k) -> SearchOutput:
        """One query at a time through the four stages of :mod:`centroid_search` (or its
        WARP-style XTR scorer with ``refine='xtr'``)."""
        xtr_mode = self.config.refine == "xtr"
        names = ["xtr"] if xtr_mode else [str(s) for s in strategies]
        fast = strategies in ((scoring.AlignmentStrategy.parse("top_k:1"),),)
        results: dict[str, dict[str, dict[str, float]]] = {name: {} for name in names}
        search_ms, num_candidates, costs = [], [], []
        ids = self.store.doc_ids
        bar = progress.Progress(len(queries), "search", "query", enabled=show_progress)
        start_all = time.perf_counter()
        for qid, q in zip(query_ids, queries, strict=True):
            t0 = time.perf_counter()
            kept = prune_query_tokens(q, self.config.beta_q)
            if xtr_mode:
                ranking, reached = self.centroid.xtr(q.vectors, kept, k)
                rankings, refined = [ranking], reached
            else:
                refine_fn = None
                if not fast:
                    qbatch = refine_lib.QueryBatch.from_encoded(
                        [q], self.refiner.config.query_bucket(len(q.token_ids))
                    )
                    refine_fn = lambda d, qb=qbatch: self.refiner.score(qb, [d], strategies)[0]  # noqa: E731
                rankings, counts = self.centroid.search(q.vectors, q.salience, kept, k, refine_fn)
                reached, refined = counts.candidates, counts.refined
            search_ms.append(1000.0 * (time.perf_counter() - t0))
            for name, (docs, scores) in zip(names, rankings, strict=True):
                results[name][qid] = {
                    ids[int(d)]: float(x) for d, x in zip(docs, scores, strict=True)
                }
            num_candidates.append(reached)
            costs.append(
                flops.QueryCost(
                    query_tokens=len(q.token_ids),
                    searched_tokens=len(q.token_ids),
                    candidates=refined,
                    candidate_doc_tokens=0,
                    retrieved_hits=0,
                )
            )
            bar.update(1)
        bar.close()
        wall = time.perf_counter() - start_all
        return SearchOutput(
            results, [0.0] * len(search_ms), search_ms, num_candidates, costs, wall
        )  # fmt: skip

    def _xtr_scores(self, token_scores, token_docs, n_query_tokens):
        cands, scores = xtr.xtr_inference_scores_numpy(token_scores, token_docs)
        return cands, scores[None, :]

    def _rank(self, cands: np.ndarray, scores: np.ndarray, k: int) -> dict[str, float]:
        cands = np.asarray(cands)
        if self.store.deleted.any():  # tombstones (aligner-index --delete) are never returned
            alive = ~self.store.deleted[cands]
            cands, scores = cands[alive], scores[alive]
        k = min(k, len(cands))
        if k == 0:
            return {}
        top = np.argpartition(-scores, k - 1)[:k] if len(cands) > k else np.arange(len(cands))
        top = top[np.argsort(-scores[top], kind="stable")]
        ids = self.store.doc_ids
        return {ids[int(cands[j])]: float(scores[j]) for j in top if np.isfinite(scores[j])}
