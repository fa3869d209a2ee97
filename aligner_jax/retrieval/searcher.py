"""Search: query tokens → candidate documents → refinement → ranked documents.

``Searcher.load(index_dir)`` opens a persisted index (token store + compressed centroid index +
the encoder that built it) and answers free text: ``search("...", k=10, offset=0,
filter={...})`` → :class:`Hit` objects (doc id, score, rank, title, text, metadata; they unpack as
``(doc_id, score)``), filters applied during candidate generation (``allowed``). Backends:
``centroid`` (the compressed index of :mod:`indexing.centroid_index`, four stages in
:mod:`retrieval.centroid_search`: milliseconds per query on a CPU), ``scann`` and ``exact``
(token MIPS, below), or exhaustive refinement (``k_prime = 0``: the quality ceiling), which
``Searcher.load(..., mode="exhaustive", mesh=MESH)`` runs sharded over the devices of a mesh
(:mod:`retrieval.sharded_search`: processes × devices, each scoring its slice of the documents).

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
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import gin
import numpy as np

from aligner_jax.common import blas, checks, doc_ids, progress
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import flops, pruning, scoring, xtr
from aligner_jax.data import beir
from aligner_jax.encoding import loading
from aligner_jax.encoding.encoder import EncodedText, Encoder, EncodingConfig
from aligner_jax.indexing import ann as ti
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import documents as documents_lib
from aligner_jax.indexing import token_store as ts
from aligner_jax.models import aligner as aligner_lib
from aligner_jax.retrieval import centroid_search as cs
from aligner_jax.retrieval import (
    gather_max,
    probe_scores,
    probe_select,
    residual_max,
    sharded_search,
)
from aligner_jax.retrieval import refine as refine_lib

REFINE_MODES = ("full", "xtr")
BACKENDS = ("centroid",) + ti.BACKENDS
MODES = ("fast", "exhaustive", "device")


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
      filter_exact_docs: a filter (or ``subset``) that keeps at most this many documents is
        searched exhaustively over them (exact: every kept document refined with all its stored
        vectors; the float refinement costs about as much as an unfiltered fast search at ~60
        documents and 4x at ~500 on SciFact's 384-d store, ``benchmarks/filtered_search.py``); a
        larger one restricts candidate generation (as approximate as unfiltered search), and
        falls back to the exhaustive search of its documents when fewer than ``k + offset``
        candidates pass it. A compressed index of at most this many live documents is always
        searched so (``Searcher.small_collection``).
    """

    backend: str = "scann"
    k_prime: int = 4000
    beta_q: float = 1.0
    beta_d: float = 1.0
    refine: str = "full"
    top_k: int = 1000
    query_batch_size: int = 8
    salience: bool = True
    filter_exact_docs: int = 256

    def __post_init__(self):
        name = type(self).__name__
        checks.choice(f"{name}.backend", self.backend, BACKENDS)
        checks.choice(f"{name}.refine", self.refine, REFINE_MODES)
        checks.integer(f"{name}.k_prime", self.k_prime, minimum=0)
        checks.number(f"{name}.beta_q", self.beta_q, 0.0, 1.0, low_open=True)
        checks.number(f"{name}.beta_d", self.beta_d, 0.0, 1.0, low_open=True)
        checks.integer(f"{name}.top_k", self.top_k, minimum=1)
        checks.integer(f"{name}.query_batch_size", self.query_batch_size, minimum=1)
        checks.integer(f"{name}.filter_exact_docs", self.filter_exact_docs, minimum=0)
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
                "--gin.SearchConfig.refine=\"'xtr'\" scores from retrieved tokens: set "
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
    exact: list[bool] = dataclasses.field(default_factory=list)  # per query: allowed set refined
    # The configured top-1 strategy as the search alone ranks, where ``results`` scores it
    # otherwise (centroid search with --adapt: every strategy, top-1 too, from the float store,
    # so the adaptation compares them on one footing); None: ``results`` holds it.
    run_results: dict[str, dict[str, float]] | None = None

    def run(self, name: str) -> dict[str, dict[str, float]]:
        """The run of strategy ``name`` (the configured one) as the search alone ranks it."""
        return self.results[name] if self.run_results is None else self.run_results

    @property
    def search_ms(self) -> list[float]:
        return [a + b for a, b in zip(self.token_search_ms, self.refine_ms, strict=True)]


@dataclasses.dataclass(frozen=True)
class Hit:
    """One ranked document: its id, score, 1-based rank (counting from the first page), and its
    title, text and metadata (from ``documents.sqlite``; None / {} in an index without them).

    Tuple-compatible with the ``(doc_id, score)`` pairs of earlier versions:
    ``for doc_id, score in searcher.search(...)``, ``hit[0]``, ``dict(hits)`` work.
    """

    doc_id: str
    score: float
    rank: int
    title: str | None = None
    text: str | None = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)

    def __iter__(self):
        return iter((self.doc_id, self.score))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i):
        return (self.doc_id, self.score)[i]

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (``doc_id, score, rank, title, text, metadata``)."""
        return dataclasses.asdict(self)


class SearchResults(list):
    """The hits of one query, best first (a list of :class:`Hit`), with what happened to it:

    ``query_tokens`` (tokens encoded), ``truncated_tokens`` (tokens dropped past the encoder's
    budget: 0 for a whole query), ``filtered_docs`` (documents the filter / subset kept; None
    without one), ``exact`` (True when the kept documents were all refined exhaustively) and
    ``took_ms`` (encoding excluded)."""

    def __init__(
        self,
        hits: Iterable[Hit] = (),
        query_tokens: int = 0,
        truncated_tokens: int = 0,
        filtered_docs: int | None = None,
        exact: bool = False,
        took_ms: float = 0.0,
    ):
        super().__init__(hits)
        self.query_tokens = query_tokens
        self.truncated_tokens = truncated_tokens
        self.filtered_docs = filtered_docs
        self.exact = exact
        self.took_ms = took_ms


def _scored(ids: Sequence[str], docs: np.ndarray, scores: np.ndarray) -> dict[str, float]:
    """``{doc_id: score}`` of a ranking of store positions, in its order."""
    return {ids[int(d)]: float(x) for d, x in zip(docs, scores, strict=True)}


def _check_query(text, where: str = "query") -> str:
    """A query is a string with a visible character (``beir.is_blank``; refused otherwise:
    there is nothing to search with)."""
    if not isinstance(text, str):
        raise ConfigError(f"{where}: expected a string, got {type(text).__name__} {text!r:.60}")
    if beir.is_blank(text):
        raise ConfigError(
            f"{where} is empty or whitespace (or invisible characters only): give the text to "
            "search for"
        )
    return text


def _check_page(k, offset, depth=None) -> tuple[int, int, int]:
    """``(k, offset, depth)`` checked; ``depth`` None is ``offset + k``."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise ConfigError(f"k={k!r}: expected an integer >= 1")
    if k < 1:
        raise ConfigError(f"k={k}: must be >= 1")
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
        raise ConfigError(f"offset={offset!r}: expected an integer >= 0")
    if offset < 0:
        raise ConfigError(f"offset={offset}: must be >= 0")
    if depth is None:
        return int(k), int(offset), int(k) + int(offset)
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)):
        raise ConfigError(f"depth={depth!r}: expected an integer >= offset + k")
    if depth < k + offset:
        raise ConfigError(
            f"depth={depth}: the ranking's depth must be at least offset + k = {k + offset}"
        )
    return int(k), int(offset), int(depth)


def prune_query_tokens(encoded: EncodedText, beta_q: float) -> np.ndarray:
    """Positions of the query tokens kept at β^q (§3.2; the rule of ``core.pruning``)."""
    return pruning.top_fraction(encoded.salience, beta_q)


def whole_query_encoder(bundle) -> Encoder:
    """An encoder of whole queries (up to the backbone's maximum), as evaluation encodes them."""
    limit = aligner_lib.backbone_max_length(bundle.config.backbone)
    return Encoder(bundle, EncodingConfig(), query_maxlen=limit)


def no_encoder_message(directory) -> str:
    """Why a text query cannot be searched in an index that records no model."""
    return (
        f"{directory} records no query encoder (no encoder.json: a store written by "
        "TokenStoreWriter): search it with search_vectors(query_vectors), or give the model "
        "(Searcher.load(..., encoder=...); aligner-search: --gin_file of the model)"
    )


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
        sharded: sharded_search.ShardedExhaustiveSearch | None = None,
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
        self.sharded = sharded  # exhaustive search over a mesh (``load(..., mesh=)``)
        self.centroid = None
        if centroid_index is not None and not config.exhaustive:
            self.centroid = cs.CentroidSearcher(
                store, centroid_index, centroid_config, salience=config.salience
            )
        self._refine_config = refine_config
        self._doc_positions: dict[str, int] | None = None
        self._refiner = None
        self._documents: documents_lib.DocumentTable | None = None
        self._batch_envelope: tuple[int, int | None] | None = None  # see ``warm_batches``

    @property
    def refiner(self) -> refine_lib.Refiner | None:
        """Refinement over the float store, built on first use (the centroid backend's default
        top-1 path never needs it)."""
        if self._refiner is None and self.config.refine == "full":
            self._refiner = refine_lib.Refiner(
                self.store, self._refine_config, salience=self.config.salience
            )
        return self._refiner

    LOAD_OPTIONS = ("mode", "checkpoint", "encoder", "alignment", "verify_checksums", "mesh")

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
        mesh=None,
        **overrides,
    ) -> Searcher:
        """Opens a persisted index for free-text search.

        Args:
          index_dir: a token store folder with its ``search_index/`` (``aligner-index
            --search_index``) and ``encoder.json``; a store without ``encoder.json`` (written by
            ``TokenStoreWriter``) opens without a query encoder: ``search_vectors`` answers,
            ``search`` of a text says to give ``encoder=``.
          mode: ``fast`` (the compressed centroid index), ``exhaustive`` (every document
            refined with the float store: the quality ceiling) or ``device`` (``exhaustive``
            with ``mesh=sharded_search.document_mesh()`` unless a mesh is given: the documents
            resident on the accelerators of every process, for GPU / TPU hosts).
          checkpoint: a trained model folder replacing the recorded one (same fingerprint).
          encoder: a ready :class:`Encoder` instead of the recorded model.
          alignment: the alignment strategy of the final stage (§3.1).
          mesh: with ``mode="exhaustive"``, a ``jax.sharding.Mesh`` (e.g.
            ``sharded_search.document_mesh()``: every device of every process) over which the
            documents' token vectors are laid out and searched (``ShardedExhaustiveSearch``,
            configured by ``ShardedSearchConfig``): the same ranking as one device, for an
            index larger than one device's or host's memory. Top-1 alignment only; filtered
            searches refine their documents on this host instead. ``k`` runs rounded up to a
            power of two; a single query's shapes at k ≤ 16 and k ≤ 128 compile at load.
          overrides: ``SearchConfig`` fields (e.g. ``top_k``, ``beta_q``).
        Refuses an encoder whose fingerprint differs from the store's. Exhaustive mode reads the
        token store alone (no search index needed).
        """
        fields = sorted(f.name for f in dataclasses.fields(SearchConfig))
        unknown = sorted(set(overrides) - set(fields))
        if unknown:
            raise ConfigError(
                f"Searcher.load: unknown option {unknown[0]!r}; options are "
                f"{', '.join(cls.LOAD_OPTIONS + ('centroid_config',))} and the SearchConfig "
                f"fields {', '.join(fields)}"
            )
        if not isinstance(index_dir, (str, os.PathLike)):
            raise ConfigError(
                f"Searcher.load: index_dir must be a folder path, got {type(index_dir).__name__}"
            )
        if mode not in MODES:
            raise ConfigError(f"mode={mode!r}: choose one of {MODES}")
        if mode == "device":
            mode, mesh = "exhaustive", sharded_search.document_mesh() if mesh is None else mesh
        if mesh is not None:
            sharded_search.check_mesh(mesh, mode, alignment)
        if encoder is not None and not isinstance(encoder, Encoder):
            raise ConfigError(
                f"Searcher.load: encoder must be an aligner_jax.Encoder, got "
                f"{type(encoder).__name__}"
            )
        store = ts.TokenStore(index_dir, verify_checksums=verify_checksums)
        spec_path = store.directory / "encoder.json"
        if encoder is None and spec_path.exists():
            spec = ts.read_json(
                spec_path,
                "rebuild it with aligner-index, or give the model (Searcher.load(..., "
                "encoder=...); aligner-search: --gin_file of the model or --checkpoint)",
            )
            encoder = whole_query_encoder(loading.encoder_from_spec(spec, checkpoint))
        if encoder is not None:
            ts.check_model_matches(store.manifest, encoder.bundle.info(), store.directory)
        elif checkpoint is not None:
            raise ConfigError(
                f"Searcher.load: checkpoint={checkpoint!r} replaces the model recorded in "
                f"{spec_path}, which does not exist; give "
                "encoder=aligner_jax.Encoder(...) instead"
            )
        if mode != "exhaustive":  # the store and the search index of one committed generation
            store, index = ci.CentroidIndex.open_snapshot(index_dir, verify_checksums, store=store)
        if mode == "exhaustive":
            config = SearchConfig(**{"backend": "exact", **overrides, "k_prime": 0})
            sharded = None
            if mesh is not None:
                settings = sharded_search.ShardedSearchConfig()
                sharded = sharded_search.ShardedExhaustiveSearch(
                    store, mesh, dataclasses.replace(settings, salience=config.salience)
                )
            searcher = cls(store, config, encoder=encoder, alignment=alignment, sharded=sharded)
        else:
            config = SearchConfig(**{"backend": "centroid", "k_prime": 1, **overrides})
            searcher = cls(
                store,
                config,
                centroid_index=index,
                centroid_config=centroid_config,
                encoder=encoder,
                alignment=alignment,
            )
        blas.warn_if_spinning()
        # Every shape a single query's search or rerank takes compiles now, none after load.
        refine_lib.warm_up(searcher.encoder, searcher.refiner, searcher.alignment)
        if searcher.centroid is not None:
            gather_max.warm_up()
            residual_max.warm_up()
            probe_select.warm_up()
            if searcher.centroid.config.residual_candidates or searcher.config.refine == "xtr":
                probe_scores.warm_up()
                searcher.centroid.token_lists()  # built now, not by the first query
        if searcher.sharded is not None:
            longest = searcher.encoder.maxlen(aligner_lib.QUERY)
            searcher.sharded.warm_up(searcher.refiner.config.query_buckets_upto(longest))
        searcher._load_args = (index_dir, mode, alignment, verify_checksums, centroid_config, mesh)
        searcher._load_overrides = overrides
        return searcher

    def query_encoder(self) -> Encoder:
        """The encoder of text queries; a ``ConfigError`` says how to give one when the index
        records no model (a store written by ``TokenStoreWriter``)."""
        if self.encoder is None:
            raise ConfigError(no_encoder_message(self.store.directory))
        return self.encoder

    @property
    def generation(self) -> int | None:
        """The search-index generation this searcher reads (None: exhaustive, or none)."""
        pointer = self.store.manifest.get("search_index")
        return pointer.get("generation") if pointer else None

    def refresh(self) -> Searcher:
        """A searcher of the same index, settings and encoder on the newest committed state
        (after another process's ``--add``, ``--delete`` or ``--compact``); this one keeps
        answering from the generation it opened (``searcher = searcher.refresh()``). Returns
        ``self`` when nothing was committed since."""
        if not hasattr(self, "_load_args"):
            raise ConfigError("Searcher.refresh: open the searcher with Searcher.load")
        index_dir, mode, alignment, verify, centroid_config, mesh = self._load_args
        if ts.read_manifest(index_dir) == self.store.manifest:
            return self
        return type(self).load(
            index_dir, mode=mode, encoder=self.encoder, alignment=alignment,
            verify_checksums=verify, centroid_config=centroid_config, mesh=mesh,
            **self._load_overrides,
        )  # fmt: skip

    # -- free text -------------------------------------------------------------------------------
    def search(
        self,
        text: str,
        k: int = 10,
        offset: int = 0,
        filter: Mapping[str, Any] | None = None,
        subset: Iterable[str] | None = None,
        depth: int | None = None,
    ) -> SearchResults:
        """The ``k`` best documents for a free-text query after the first ``offset`` (a page):
        :class:`Hit` objects, best first, with title, text and metadata.

        ``filter``: conditions on metadata (``{"year": {"gte": 2015}, "source": {"in": [...]}}``,
        :mod:`indexing.documents`); ``subset``: document ids (PyLate's ``subset=``). Both restrict
        candidate generation (not the cut top-k): whenever ``k + offset`` documents pass, that
        many are ranked (see ``SearchConfig.filter_exact_docs``).

        A page is ranks ``offset + 1`` to ``offset + k`` of the ranking at ``depth`` (default
        ``offset + k``, as Qdrant's ``limit`` + ``offset``). The exhaustive mode's ranking does
        not depend on the depth, so its pages are consecutive slices of one ranking. The fast
        index probes and refines more documents for a deeper ranking
        (``CentroidSearchConfig``), so pages asked at their own default depths can repeat a
        document near a page boundary and never show another (6 of CISI's 76 test queries over
        5 pages of 10, zero-shot; none at depth 50: ``search_latency_stop95/paging_cisi*``).
        Pages asked with one ``depth`` (at least the last page's ``offset + k``) are consecutive
        slices of one ranking, at that depth's cost per page.
        """
        return self.search_batch([_check_query(text)], k, offset, filter, subset, depth)[0]

    def search_batch(
        self,
        texts: Sequence[str],
        k: int = 10,
        offset: int = 0,
        filter: Mapping[str, Any] | None = None,
        subset: Iterable[str] | None = None,
        depth: int | None = None,
    ) -> list[SearchResults]:
        """``search`` for several queries (encoded together), one :class:`SearchResults` each."""
        self.query_encoder()
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise ConfigError(
                f"search_batch: expected a list of query strings, got {type(texts).__name__}"
            )
        texts = [_check_query(t, f"query {i}") for i, t in enumerate(texts)]
        k, offset, depth = _check_page(k, offset, depth)
        allowed = self.allowed(filter, subset)
        token_ids = self.encoder.tokenize(texts, "query")
        dropped = self._dropped_query_tokens(texts, token_ids)
        pages: list[SearchResults] = [None] * len(texts)  # type: ignore[list-item]
        for group in self._batch_groups(token_ids, depth):
            encoded: list[EncodedText] = [None] * len(group)  # type: ignore[list-item]
            for i, e in self.encoder.encode_token_ids([token_ids[g] for g in group], "query"):
                encoded[i] = e
            found = self._search_encoded(
                encoded, k, offset, allowed, [dropped[g] for g in group], depth
            )
            for g, page in zip(group, found, strict=True):
                pages[g] = page
        return pages

    def warm_batches(self, max_batch: int, lengths: int = 2, k: int = 10) -> int:
        """Compiles what a batch of 2…``max_batch`` queries runs (row counts padded to powers of
        two) when each of its queries falls in one of the ``lengths`` shortest query length
        buckets and asks for at most ``k`` documents (``k + offset``): the query encoder's batched
        shapes and, with the documents on the devices (``mode="device"``), their search's.
        Afterwards :meth:`search_batch` searches any query outside that envelope alone (a single
        query of every length, and k ≤ 128, compiled at load), so a warmed searcher compiles
        nothing more (``aligner-serve`` warms its searchers so). Returns the shapes run."""
        encoder = self.query_encoder()
        longest = encoder.maxlen(aligner_lib.QUERY)
        encoder_buckets = encoder.config.bucket_lengths(longest, aligner_lib.QUERY)[:lengths]
        rows, batches, shapes = 2, [], 0
        while rows <= max_batch:
            for length in encoder_buckets:
                for _ in encoder.encode_token_ids([np.zeros(length, np.int32)] * rows, "query"):
                    pass
                shapes += 1
            batches.append(rows)
            rows *= 2
        max_tokens, max_k = max(encoder_buckets), None
        if self.sharded is not None:
            buckets = self.refiner.config.query_buckets_upto(longest)[:lengths]
            if batches:
                shapes += self.sharded.warm_up(buckets, ks=(k,), batches=batches)
            max_tokens = min(max_tokens, max(buckets))
            max_k = sharded_search.k_bucket(k, self.sharded.total)
        self._batch_envelope = (max_tokens, max_k)
        return shapes

    def _batch_groups(self, token_ids, need: int) -> list[list[int]]:
        """The queries of a ``search_batch`` call grouped as they are encoded and searched:
        all together, except, on a searcher warmed by :meth:`warm_batches`, each query outside
        its envelope alone (longer than its warmed lengths, or ``k + offset`` above its k)."""
        everyone = list(range(len(token_ids)))
        if self._batch_envelope is None or len(token_ids) < 2:
            return [everyone]
        max_tokens, max_k = self._batch_envelope
        if max_k is not None and need > max_k:
            return [[i] for i in everyone]
        inside = [i for i in everyone if len(token_ids[i]) <= max_tokens]
        alone = [[i] for i in everyone if len(token_ids[i]) > max_tokens]
        return ([inside] if inside else []) + alone

    def search_vectors(
        self,
        query_vectors,
        k: int = 10,
        offset: int = 0,
        filter: Mapping[str, Any] | None = None,
        subset: Iterable[str] | None = None,
        salience=None,
        depth: int | None = None,
    ) -> SearchResults:
        """``search`` for a query encoded elsewhere: its token vectors ``[n, D]`` (the index's
        dimension; L2-normalised like the store's) and optionally their saliences ``[n]``
        (default 1: every token counts the same)."""
        k, offset, depth = _check_page(k, offset, depth)
        try:
            vectors = np.asarray(query_vectors, np.float32)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"query_vectors: not an array of numbers ({e})") from None
        if vectors.ndim != 2 or vectors.shape[0] < 1 or vectors.shape[1] != self.store.dim:
            raise ConfigError(
                f"query_vectors of shape {vectors.shape}: expected [tokens, {self.store.dim}] "
                "(the index's dimension) with at least one token"
            )
        if not np.isfinite(vectors).all():
            raise ConfigError("query_vectors: holds NaN or infinite values")
        n = len(vectors)
        if salience is None:
            u = np.ones(n, np.float32)
        else:
            u = np.asarray(salience, np.float32)
            if u.shape != (n,) or not np.isfinite(u).all() or (u < 0).any():
                raise ConfigError(f"salience of shape {u.shape}: expected [{n}] finite values >= 0")
        query = EncodedText(token_ids=np.zeros(n, np.int32), vectors=vectors, salience=u)
        allowed = self.allowed(filter, subset)
        return self._search_encoded([query], k, offset, allowed, [0], depth)[0]

    def _dropped_query_tokens(self, texts: Sequence[str], token_ids) -> list[int]:
        """Tokens cut from each query by the encoder's budget (only queries at the budget are
        tokenized again, whole)."""
        budget = self.encoder.maxlen("query")
        dropped = [0] * len(texts)
        at_budget = [i for i, ids in enumerate(token_ids) if len(ids) >= budget]
        if at_budget:
            whole = self.encoder.bundle.tokenizer.encode_batch(
                [texts[i] for i in at_budget], 1 << 30
            )
            for i, ids in zip(at_budget, whole, strict=True):
                dropped[i] = max(0, len(ids) - budget)
        return dropped

    @property
    def small_collection(self) -> bool:
        """A compressed index of at most ``SearchConfig.filter_exact_docs`` live documents
        (full refinement): every one of them is refined exactly, as a filter keeping that many
        is (its centroids are few and coarse: 14 documents got 8 centroids and scores 0.15
        below exact)."""
        cfg = self.config
        if self.centroid is None or cfg.exhaustive or cfg.refine != "full":
            return False
        return int((~self.store.deleted).sum()) <= cfg.filter_exact_docs

    @property
    def documents(self) -> documents_lib.DocumentTable | None:
        """The index's ``documents.sqlite`` (titles, texts, metadata), or None without one."""
        if self._documents is None and (self.store.directory / documents_lib.FILE).exists():
            shards = sorted(self.store.manifest["shards"], key=lambda s: s["index"])
            self._documents = documents_lib.DocumentTable(self.store.directory, shards)
        return self._documents

    def allowed(
        self, filter: Mapping[str, Any] | None = None, subset: Iterable[str] | None = None
    ) -> np.ndarray | None:
        """Boolean ``[num_docs]`` of the documents passing ``filter`` and in ``subset`` (None:
        no restriction, also for an empty filter ``{}``, as in Qdrant)."""
        if (filter is None or (isinstance(filter, Mapping) and not filter)) and subset is None:
            return None
        mask = np.ones(self.store.num_docs, bool)
        if filter is not None:
            if not isinstance(filter, Mapping):
                documents_lib.compile_filter(filter)  # the one-line error
            if filter:
                table = self.documents
                if table is None:
                    documents_lib.DocumentTable(self.store.directory, [])  # names the fix
                mask &= table.mask(filter)
        if subset is not None:
            if isinstance(subset, (str, bytes)) or not isinstance(subset, Iterable):
                raise ConfigError(
                    f"subset={subset!r:.60}: expected a list of document ids, e.g. ['d1', 'd2']"
                )
            try:
                ids = [doc_ids.clean(d) for d in subset]
            except ValueError as reason:
                raise ConfigError(f"subset: an id {reason}") from None
            position = self.doc_positions
            unknown = [d for d in ids if d not in position]
            if unknown:
                raise ConfigError(
                    f"subset: {len(unknown)} id(s) are not documents of {self.store.directory} "
                    f"(first: {unknown[0]!r})"
                )
            keep = np.zeros(self.store.num_docs, bool)
            keep[[position[d] for d in ids]] = True
            mask &= keep
        return mask

    def _search_encoded(
        self, encoded, k: int, offset: int, allowed, dropped: Sequence[int], depth: int
    ) -> list[SearchResults]:
        """Ranks ``depth`` (≥ ``k + offset``) documents per encoded query and returns hits
        ``offset`` to ``offset + k`` with their contents."""
        ids = [str(i) for i in range(len(encoded))]
        out = self.run(
            ids, encoded, (self.alignment,), show_progress=False, k=depth, allowed=allowed
        )
        ranked = out.results[next(iter(out.results))]
        kept = None if allowed is None else int((allowed & ~self.store.deleted).sum())
        exact = (
            self.config.exhaustive
            or self.small_collection
            or (kept is not None and kept <= self.config.filter_exact_docs)
        )
        pages = []
        for i, qid in enumerate(ids):
            page = list(ranked[qid].items())[offset : offset + k]
            contents = [None] * len(page)
            if page and self.documents is not None:
                position = self.doc_positions
                contents = self.documents.fetch([position[d] for d, _ in page])
            hits = []
            for j, ((doc_id, score), row) in enumerate(zip(page, contents, strict=True)):
                row = row or {}
                hits.append(
                    Hit(
                        doc_id=doc_id,
                        score=score,
                        rank=offset + j + 1,
                        title=row.get("title"),
                        text=row.get("text"),
                        metadata=row.get("metadata") or {},
                    )
                )
            pages.append(
                SearchResults(
                    hits,
                    query_tokens=len(encoded[i].token_ids),
                    truncated_tokens=int(dropped[i]),
                    filtered_docs=kept,
                    exact=bool(exact or out.exact[i]),
                    took_ms=out.search_ms[i],
                )
            )
        return pages

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
    @blas.held
    def run(
        self,
        query_ids: Sequence[str],
        queries: Sequence[EncodedText],
        strategies: Sequence[scoring.AlignmentStrategy | str] = ("top_k:1",),
        show_progress: bool = True,
        k: int | None = None,
        allowed: np.ndarray | None = None,
    ) -> SearchOutput:
        """Ranks the store's documents for each encoded query with each strategy (the top ``k``,
        default ``SearchConfig.top_k``).

        ``allowed`` (bool ``[num_docs]``, e.g. :meth:`allowed` of a filter): only these
        documents are ranked. At most ``SearchConfig.filter_exact_docs`` of them (or with
        exhaustive search) are all refined (exact: exhaustive search restricted to them);
        more restrict candidate generation. A query whose candidates (that pass) are fewer
        than ``k`` has all the allowed documents refined instead (with the centroid index also
        unfiltered: every live one, so it gets ``min(k, documents)`` hits; a token index's
        candidates stay those its k' nearest tokens name)."""
        cfg = self.config
        k = cfg.top_k if k is None else k
        strategies = tuple(scoring.AlignmentStrategy.parse(s) for s in strategies)
        queries = self._scored_queries(queries)
        live = ~self.store.deleted if allowed is None else ~self.store.deleted & allowed
        if not live.any():  # every document deleted, or none passes the filter: nothing to rank
            names = ["xtr"] if cfg.refine == "xtr" else [str(s) for s in strategies]
            none = {name: {qid: {} for qid in query_ids} for name in names}
            zeros = [0.0] * len(queries)
            return SearchOutput(
                none, zeros, zeros, [0] * len(queries), [], 0.0, [True] * len(queries)
            )
        top1 = strategies == (scoring.AlignmentStrategy.parse("top_k:1"),)
        if self.sharded is not None and allowed is None and cfg.refine == "full" and top1:
            return self._run_sharded(query_ids, queries, show_progress, k, int(live.sum()))
        subset = None
        if allowed is None and self.small_collection:
            allowed = np.ones(self.store.num_docs, bool)  # every live document: exact, as cheap
        if allowed is not None:
            allowed = np.asarray(allowed, bool) & ~self.store.deleted
            if allowed.shape != (self.store.num_docs,):
                raise ValueError(f"allowed: shape {allowed.shape}, expected [num_docs]")
            if cfg.refine == "xtr":
                raise ConfigError(
                    "filters refine the documents they keep: use --gin.SearchConfig.refine=\"'full'\""
                )
            subset = np.flatnonzero(allowed)
            if cfg.exhaustive or len(subset) <= cfg.filter_exact_docs:
                every = lambda ids, batch: [(subset, None, None) for _ in batch]  # noqa: E731
                out = self._refine_all(query_ids, queries, every, strategies, show_progress, k)
                out.exact = [True] * len(queries)
                return out
        if self.centroid is not None:
            return self._run_centroid(
                query_ids, queries, strategies, show_progress, k, allowed, subset
            )
        if subset is None:  # the token index's k' bounds the candidates (§3.2), as it is
            find = lambda ids, batch: self.token_search(batch)  # noqa: E731
        else:

            def find(ids, batch):  # candidates that pass; all of them when fewer than k pass
                found = []
                for cands, s, d in self.token_search(batch):
                    kept = cands[allowed[cands]]
                    found.append((kept if len(kept) >= k else subset, s, d))
                return found

        return self._refine_all(query_ids, queries, find, strategies, show_progress, k)

    @blas.held
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
                "reranking refines stored token vectors: use --gin.SearchConfig.refine=\"'full'\""
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
        exact = [False] * len(queries)
        return SearchOutput(results, token_ms, refine_ms, num_candidates, costs, wall, exact)

    def _run_sharded(self, query_ids, queries, show_progress, k: int, live: int) -> SearchOutput:
        """Exhaustive top-1 search of query batches over the mesh (``self.sharded``): every
        live document scored on the device that holds it, the global top ``k`` gathered."""
        name = str(scoring.AlignmentStrategy.parse("top_k:1"))
        results: dict[str, dict[str, float]] = {}
        search_ms, costs = [], []
        ids, tokens = self.store.doc_ids, int(self.store.doc_lengths.sum())
        qb = self.config.query_batch_size
        bar = progress.Progress(len(queries), "search (sharded)", "query", enabled=show_progress)
        start_all = time.perf_counter()
        for lo in range(0, len(queries), qb):
            batch, batch_ids = list(queries[lo : lo + qb]), list(query_ids[lo : lo + qb])
            t0 = time.perf_counter()
            length = self.refiner.config.query_bucket(max(len(q.token_ids) for q in batch))
            qbatch = refine_lib.QueryBatch.from_encoded(batch, length)
            ranked = self.sharded.search(qbatch.vectors, qbatch.mask, qbatch.salience, k)
            for qid, q, top in zip(batch_ids, batch, ranked, strict=True):
                results[qid] = {ids[p]: s for p, s in top}
                costs.append(
                    flops.QueryCost(
                        query_tokens=len(q.token_ids),
                        searched_tokens=len(q.token_ids),
                        candidates=live,
                        candidate_doc_tokens=tokens,
                        retrieved_hits=0,
                    )
                )
            search_ms += [1000.0 * (time.perf_counter() - t0)] * len(batch)
            bar.update(len(batch))
        bar.close()
        wall = time.perf_counter() - start_all
        zeros, exact = [0.0] * len(queries), [True] * len(queries)
        return SearchOutput({name: results}, zeros, search_ms, [live] * len(queries), costs, wall,
                            exact)  # fmt: skip

    def _run_centroid(
        self, query_ids, queries, strategies, show_progress, k, allowed=None, subset=None
    ) -> SearchOutput:
        """One query at a time through the four stages of :mod:`centroid_search` (or its
        WARP-style XTR scorer with ``refine='xtr'``). With ``allowed`` only those documents are
        candidates. When fewer than ``k`` candidates are reached (a ``k`` near the number of
        documents, or a filter), all of ``subset`` (the allowed documents; without a filter every
        live one) are refined from the float store instead (exact)."""
        xtr_mode = self.config.refine == "xtr"
        names = ["xtr"] if xtr_mode else [str(s) for s in strategies]
        top1 = scoring.AlignmentStrategy.parse("top_k:1")
        fast = tuple(strategies) == (top1,)
        top1_at = list(strategies).index(top1) if not fast and top1 in strategies else None
        results: dict[str, dict[str, dict[str, float]]] = {name: {} for name in names}
        run_results = {} if top1_at is not None else None
        search_ms, num_candidates, costs, exact = [], [], [], []
        ids = self.store.doc_ids
        pool_size = len(subset) if subset is not None else int((~self.store.deleted).sum())
        bar = progress.Progress(len(queries), "search", "query", enabled=show_progress)
        start_all = time.perf_counter()
        for qid, q in zip(query_ids, queries, strict=True):
            t0 = time.perf_counter()
            kept = prune_query_tokens(q, self.config.beta_q)
            exact.append(False)
            if xtr_mode:  # f_XTR′: no document is refined with its stored vectors
                ranking, reached = self.centroid.xtr(q.vectors, kept, k)
                rankings, refined, refined_tokens = [ranking], reached, 0
            else:
                rankings = None
                if k < pool_size:  # else every document is asked for: refined below
                    refine_fn = None
                    if not fast:
                        qbatch = refine_lib.QueryBatch.from_encoded(
                            [q], self.refiner.config.query_bucket(len(q.token_ids))
                        )
                        refine_fn = lambda d, qb=qbatch: self.refiner.score(qb, [d], strategies)[0]  # noqa: E731
                    rankings, counts = self.centroid.search(
                        q.vectors, q.salience, kept, k, refine_fn, allowed=allowed
                    )
                    if top1_at is not None:  # top-1 as a search with it alone ranks (--adapt)
                        run_ranking = self.centroid.search(
                            q.vectors, q.salience, kept, k, None, allowed=allowed
                        )[0][0]
                    reached, refined = counts.candidates, counts.refined
                    refined_tokens = counts.refined_tokens
                # too few reached, or k asks for every one: refine them all (exact)
                if rankings is None or len(rankings[0][0]) < min(k, pool_size):
                    pool = subset if subset is not None else np.flatnonzero(~self.store.deleted)
                    rankings = self._refine_subset(q, pool, strategies, k)
                    run_ranking = rankings[top1_at] if top1_at is not None else None
                    reached = refined = len(pool)
                    refined_tokens = int(self.store.doc_lengths[pool].sum())
                    exact[-1] = True
                if run_results is not None:
                    run_results[qid] = _scored(ids, *run_ranking)
            search_ms.append(1000.0 * (time.perf_counter() - t0))
            for name, (docs, scores) in zip(names, rankings, strict=True):
                results[name][qid] = _scored(ids, docs, scores)
            num_candidates.append(reached)
            costs.append(
                flops.QueryCost(
                    query_tokens=len(q.token_ids),
                    searched_tokens=len(q.token_ids),
                    candidates=refined,
                    candidate_doc_tokens=refined_tokens,
                    retrieved_hits=0,
                )
            )
            bar.update(1)
        bar.close()
        wall = time.perf_counter() - start_all
        return SearchOutput(
            results, [0.0] * len(search_ms), search_ms, num_candidates, costs, wall, exact,
            run_results,
        )  # fmt: skip

    def _refine_subset(self, q: EncodedText, docs: np.ndarray, strategies, k: int):
        """[(doc indices, scores)] per strategy: ``docs`` refined with all their stored vectors,
        best ``k`` first."""
        qbatch = refine_lib.QueryBatch.from_encoded(
            [q], self.refiner.config.query_bucket(len(q.token_ids))
        )
        scores = self.refiner.score(qbatch, [docs], strategies)[0]
        rankings = []
        for row in scores:
            top = np.argsort(-row, kind="stable")[:k]
            rankings.append((docs[top], row[top]))
        return rankings

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
