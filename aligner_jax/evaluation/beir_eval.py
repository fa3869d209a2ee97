"""BEIR evaluation of an ALIGNER encoder: index the corpus's tokens, search, score the run.

The library behind the ``aligner-eval`` binary (:mod:`aligner_jax.evaluate`). :func:`evaluate` is
gin-configurable; the token store is written to ``index_dir`` (default ``OUTPUT_DIR/index``) and
reused by later runs with the same model and corpus; the token index (ScaNN or exact) is built per
run and its build time reported. Writes ``OUTPUT_DIR/metrics.json`` (metrics, per-query nDCG@10,
configuration, timings, index bytes), ``OUTPUT_DIR/run.trec`` (TREC run),
``OUTPUT_DIR/results.json`` (BEIR's ``{qid: {doc_id: score}}``) and ``OUTPUT_DIR/config.gin`` (the
operative gin config), and prints a one-screen summary naming the files it wrote.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path

import gin
import jax
import numpy as np
from absl import logging

from aligner_jax.common import checks, errors, fileio, progress
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import flops, scoring
from aligner_jax.data import beir, runs
from aligner_jax.encoding import loading as loading_lib
from aligner_jax.encoding.encoder import Encoder, EncodingConfig
from aligner_jax.evaluation import adaptation as adaptation_lib
from aligner_jax.evaluation import fusion_weights, metrics
from aligner_jax.indexing import ann as ti
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import documents, indexer
from aligner_jax.indexing import token_store as ts
from aligner_jax.models import aligner as aligner_lib
from aligner_jax.retrieval import hybrid as hybrid_lib
from aligner_jax.retrieval import lexical_stages as lexical_lib
from aligner_jax.retrieval import searcher as search_lib

K_VALUES = (10, 100)
LEGACY_RUN_FILE = "run.tsv"  # the name of run.trec before issue 13


def first_stages() -> tuple[str, ...]:
    """``evaluate.first_stage``: ALIGNER's own search, both fused, or a lexical stage alone."""
    return ("aligner", "hybrid", *lexical_lib.STAGES)


def corpus_info(dataset: beir.BeirDataset) -> dict:
    corpus_file = Path(dataset.path) / "corpus.jsonl"
    return {
        "dataset": dataset.name,
        "path": str(Path(dataset.path).resolve()),
        "num_docs": len(dataset.corpus),
        "sha256": fileio.sha256_file(corpus_file),
    }


def ensure_token_store(
    dataset: beir.BeirDataset,
    encoder: Encoder,
    index_dir: Path,
    verify_checksums: bool = False,
) -> tuple[ts.TokenStore, float, bool]:
    """Opens the token store for this model and corpus, building it first when needed.

    Returns (store, seconds spent encoding, whether an existing store was reused).
    """
    info = corpus_info(dataset)
    reused = False
    start = time.perf_counter()
    if indexer.store_is_complete_for(index_dir, encoder.bundle.info()):
        manifest = ts.read_manifest(index_dir)
        if manifest.get("corpus", {}).get("sha256") != info["sha256"]:
            raise errors.IndexIntegrityError(
                f"{index_dir / ts.MANIFEST}: built from another corpus "
                f"({manifest.get('corpus', {}).get('path')}); use another --index_dir"
            )
        added = sum(
            u.get("num_docs", 0) for u in manifest.get("updates", []) if u.get("op") == "add"
        )
        if added:  # its store holds documents the dataset's corpus lacks
            raise errors.IndexIntegrityError(
                f"{index_dir}: {added} documents were added to it (aligner-index --add) since it "
                f"was built from {manifest['corpus'].get('path')}; aligner-eval evaluates an "
                "index of the dataset's corpus alone: give another --index_dir (it builds one), "
                "or rank the queries with aligner-search --queries"
            )
        reused = True
        indexer.warn_unapplied_settings(index_dir, manifest)
        indexer.write_encoder_spec(index_dir, encoder.bundle)
        documents.fill_missing(index_dir, manifest, dataset.corpus)  # an index older than them
        logging.info("Reusing the token store in %s", index_dir)
    else:
        summary = indexer.build_token_store(
            dataset.corpus.values(), encoder, index_dir, corpus_info=info
        )
        if not summary.complete:
            raise RuntimeError(f"{index_dir}: indexing did not complete")
    seconds = 0.0 if reused else time.perf_counter() - start
    store = ts.TokenStore(index_dir, verify_checksums=verify_checksums)
    ts.check_model_matches(store.manifest, encoder.bundle.info(), index_dir)
    check_store_holds_corpus(store, dataset)
    return store, seconds, reused


def open_centroid_index(store: ts.TokenStore, beta_d: float) -> tuple[ci.CentroidIndex, float]:
    """The store's persisted compressed index, built (once) with its recorded settings when
    missing or damaged, holding the index directory's writer lock; returns it and the seconds
    spent building (0 when loaded). An index of another β^d (``SearchConfig.beta_d``) is not
    replaced: this run builds one of its own, with the recorded settings but β^d, and does not
    publish it (the index that searches and servers load stays as it was)."""
    config = dataclasses.replace(ci.recorded_config(store.directory), beta_d=beta_d)
    commit = True
    if ci.CentroidIndex.exists(store.directory):
        try:
            index = ci.CentroidIndex.load(store)
        except errors.IndexIntegrityError as e:
            logging.warning("rebuilding the search index: %s", e)
        else:
            built_for = index.meta["config"]["beta_d"]
            if built_for == beta_d:
                logging.info("Loaded the search index of %s", store.directory)
                return index, 0.0
            logging.warning(
                "%s: its search index keeps beta_d=%s of each document's tokens; this run "
                "builds one with beta_d=%s for itself and does not save it (to keep one, "
                "aligner-index --index_dir=%s --search_index "
                "--gin.CentroidIndexConfig.beta_d=%s)",
                store.directory, built_for, beta_d, store.directory, beta_d,
            )  # fmt: skip
            commit = False
    with indexer.writer_lock(store.directory):  # one writer per index directory
        start = time.perf_counter()
        index = ci.CentroidIndex.build(store, config, commit=commit)
        return index, time.perf_counter() - start


def check_store_holds_corpus(store: ts.TokenStore, dataset: beir.BeirDataset) -> None:
    """The store must hold exactly the corpus's documents, in corpus order: otherwise some
    documents could never be retrieved and the metrics would be silently wrong."""
    corpus_ids = list(dataset.corpus)
    if store.doc_ids == corpus_ids:
        if store.deleted.any():
            logging.warning(
                "%s: %d of the corpus's documents are deleted from this index: never retrieved, "
                "they count as not found (docs_deleted in metrics.json)",
                store.directory, int(store.deleted.sum()),
            )  # fmt: skip
        return
    where = f"{store.directory}: the token store holds {store.num_docs} documents"
    corpus = Path(dataset.path) / "corpus.jsonl"
    ops = [u.get("op") for u in store.manifest.get("updates", [])]
    changed = [op for op in ops if op in ("add", "delete", "vacuum")]
    if changed:
        raise errors.IndexIntegrityError(
            f"{where} ({corpus}: {len(corpus_ids)}), and they were updated since it was built "
            f"({', '.join(dict.fromkeys(changed))}: {len(changed)} update(s)); "
            "aligner-eval scores the index of exactly --dataset_dir's corpus: search an updated "
            "index with aligner-search, or evaluate in another --index_dir"
        )
    if store.num_docs != len(corpus_ids):
        raise errors.IndexIntegrityError(
            f"{where}, {corpus} has {len(corpus_ids)}; rebuild the index (delete the folder) or "
            "use another --index_dir"
        )
    i = next(i for i, (a, b) in enumerate(zip(store.doc_ids, corpus_ids, strict=True)) if a != b)
    raise errors.IndexIntegrityError(
        f"{where}, but document {i} is {store.doc_ids[i]!r} in the store and {corpus_ids[i]!r} "
        f"in {corpus}; rebuild the index (delete the folder) or use another --index_dir"
    )


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else 0.0


@dataclasses.dataclass
class PreparedRun:
    """What an evaluation and a sweep both start from: the dataset, the encoder, the token store
    of the corpus (built or reused) and the encoded queries."""

    output: Path
    dataset: beir.BeirDataset
    encoder: Encoder
    store: ts.TokenStore
    encode_corpus_s: float
    index_reused: bool
    qids: list[str]
    queries: list
    encode_queries_s: float
    truncation: dict


def prepare(
    dataset_dir: str,
    output_dir: str,
    split: str = "test",
    index_dir: str | None = None,
    encoding_config: EncodingConfig | None = None,
    unknown_qrels: str = "error",
    verify_checksums: bool = False,
    query_maxlen: int | None = None,
    dataset: beir.BeirDataset | None = None,
) -> PreparedRun:
    """Loads the BEIR split, the gin-configured encoder, the corpus's token store (under
    ``index_dir``, default ``OUTPUT_DIR/index``) and encodes every query, whole: up to
    ``query_maxlen`` tokens (None: the backbone's maximum, e.g. 512 for BERT, not the training
    length). Queries and documents that were cut are counted in ``truncation``. ``dataset``: the
    split, when the caller has loaded it already."""
    output = fileio.check_output_dir(output_dir, "--output_dir")  # created when results exist
    if index_dir and Path(index_dir).resolve() == output.resolve():
        raise ConfigError(
            f"--output_dir={output_dir} is the --index_dir: the run's files would land among "
            "the index's; give another --output_dir (the index may stay where it is)"
        )
    if index_dir and not (Path(index_dir) / ts.MANIFEST).exists():  # a complete one is only read
        fileio.check_output_dir(index_dir, "--index_dir")
    if dataset is None:
        dataset = beir.load_beir(dataset_dir, split=split, unknown_qrels=unknown_qrels)
    logging.info(
        "%s/%s: %d documents, %d queries",
        dataset.name,
        split,
        len(dataset.corpus),
        len(dataset.queries),
    )
    bundle = loading_lib.load_encoder()
    if query_maxlen is None:
        query_maxlen = aligner_lib.backbone_max_length(bundle.config.backbone)
    encoder = Encoder(bundle, encoding_config or EncodingConfig(), query_maxlen=query_maxlen)
    index_path = Path(index_dir) if index_dir else output / "index"
    store, encode_s, reused = ensure_token_store(dataset, encoder, index_path, verify_checksums)
    qids = list(dataset.queries)
    t0 = time.perf_counter()
    texts = [dataset.queries[q] for q in qids]
    token_ids = encoder.tokenize(texts, "query")
    encoded = [None] * len(qids)
    with progress.Progress(len(qids), "encode queries", "query") as bar:
        for i, e in encoder.encode_token_ids(token_ids, "query", bar=bar):
            encoded[i] = e
    truncation = {
        "query_maxlen": query_maxlen,
        "queries_truncated": encoder.count_truncated(texts, token_ids, "query"),
        "doc_maxlen": bundle.config.doc_maxlen,
        "docs_truncated": int(store.manifest.get("stats", {}).get("truncated_docs", 0)),
    }
    if truncation["queries_truncated"]:
        logging.warning(
            "%d of %d queries are longer than the query budget of %d tokens and were cut",
            truncation["queries_truncated"],
            len(qids),
            query_maxlen,
        )
    return PreparedRun(
        output,
        dataset,
        encoder,
        store,
        encode_s,
        reused,
        qids,
        encoded,
        time.perf_counter() - t0,
        truncation,
    )


@gin.configurable
def evaluate(
    dataset_dir: str,
    output_dir: str,
    split: str = "test",
    index_dir: str | None = None,
    alignment: str = "top_k:1",
    search_config: search_lib.SearchConfig | None = None,
    encoding_config: EncodingConfig | None = None,
    unknown_qrels: str = "error",
    verify_checksums: bool = False,
    adapt: bool = False,
    adaptation_config: adaptation_lib.AdaptationConfig | None = None,
    ignore_identical_ids: str = "same_text",
    query_maxlen: int | None = None,
    first_stage: str = "aligner",
    rerank_run: str | None = None,
    lexical_config: lexical_lib.LexicalConfig | None = None,
    hybrid_config: hybrid_lib.HybridConfig | None = None,
) -> dict:
    """Evaluates the gin-configured encoder on one split of a BEIR folder; returns metrics.json.

    ``first_stage`` (``first_stages()``): ``aligner`` (token / centroid search), ``bm25`` or
    ``minicoil`` alone (``lexical_config``; no token store), or ``hybrid`` (both, the union
    refined by ALIGNER and fused, ``hybrid_config``; with ``adapt`` the fusion weight is chosen
    by the few-shot protocol instead of the alignment). ``rerank_run``: a TREC run file whose
    candidates ALIGNER refines instead of searching (queries it does not list get none).

    ``ignore_identical_ids`` (``beir.IDENTICAL_ID_MODES``) says when the document whose id is a
    query's id is removed from that query's ranking; the rule is applied once, to the rankings
    written to run.trec / results.json, scored in metrics.json and used by the adaptation.

    With ``adapt``, the candidates are also re-scored with every strategy of
    ``adaptation_config`` and the few-shot alignment adaptation of §4.1 is reported in
    ``adaptation.json`` / ``adaptation.md`` (metrics.json keeps the ``alignment`` strategy).
    """
    # Instantiated here (not as defaults) so that gin bindings of these classes apply.
    search_config = search_config or search_lib.SearchConfig()
    encoding_config = encoding_config or EncodingConfig()
    adaptation_config = adaptation_config or adaptation_lib.AdaptationConfig()
    lexical_config = lexical_config or lexical_lib.LexicalConfig()
    hybrid_config = hybrid_config or hybrid_lib.HybridConfig()
    check_first_stage(first_stage, rerank_run, adapt, search_config)
    if first_stage in lexical_lib.STAGES:
        if index_dir:
            raise ConfigError(
                f"--index_dir={index_dir}: evaluate.first_stage={first_stage!r} builds its "
                "lexical index in memory from --dataset_dir's corpus and reads no token index: "
                "drop --index_dir (or evaluate ALIGNER or hybrid with it)"
            )
        return evaluate_lexical(
            dataset_dir,
            output_dir,
            split,
            lexical_config,
            search_config.top_k,
            unknown_qrels,
            ignore_identical_ids,
            query_maxlen,
        )
    strategy = scoring.AlignmentStrategy.parse(alignment)
    strategies = [strategy]
    if adapt and first_stage != "hybrid":
        if search_config.refine == "xtr":
            raise ConfigError(
                "--adapt re-scores candidates with alignment strategies: use refine='full'"
            )
        extra = [scoring.AlignmentStrategy.parse(x) for x in adaptation_config.strategies]
        strategies += [x for x in extra if x != strategy]
    candidates, dataset = None, None
    if rerank_run or adapt:  # read (and refused) before any encoding
        fileio.check_output_dir(output_dir, "--output_dir")
        dataset = beir.load_beir(dataset_dir, split=split, unknown_qrels=unknown_qrels)
    if rerank_run:
        candidates, first_stage_info = read_rerank_run(rerank_run, dataset)
    if adapt:
        judged = sum(1 for q in dataset.queries if dataset.qrels.get(q))
        adaptation_lib.check_enough_queries(judged, adaptation_config.fold_size)
    run = prepare(
        dataset_dir,
        output_dir,
        split,
        index_dir,
        encoding_config,
        unknown_qrels,
        verify_checksums,
        query_maxlen,
        dataset,
    )
    output, dataset, bundle, store = run.output, run.dataset, run.encoder.bundle, run.store
    encode_s, reused, qids, encoded = run.encode_corpus_s, run.index_reused, run.qids, run.queries

    token_index, centroid_index, build_s = None, None, 0.0
    unpruned = search_config.exhaustive or bool(rerank_run)
    if unpruned and (search_config.beta_q, search_config.beta_d) != (1.0, 1.0):
        logging.warning(
            "SearchConfig.beta_q=%s, beta_d=%s not applied: they prune the tokens that generate "
            "candidates, and %s every token of every candidate is scored",
            search_config.beta_q, search_config.beta_d,
            "with --rerank_run" if rerank_run else "with exhaustive search",
        )  # fmt: skip
    if unpruned:  # no search: no token index
        pass
    elif search_config.backend == "centroid":
        centroid_index, build_s = open_centroid_index(store, search_config.beta_d)
    else:
        token_index = ti.TokenIndex.build(
            store, search_config.backend, beta_d=search_config.beta_d, k_prime=search_config.k_prime
        )
        build_s = token_index.build_seconds

    query_encode_s = run.encode_queries_s
    searcher = search_lib.Searcher(
        store,
        dataclasses.replace(search_config, k_prime=0) if rerank_run else search_config,
        token_index,
        centroid_index=centroid_index,
    )
    name = "xtr" if search_config.refine == "xtr" else str(strategy)
    hybrid_run = None
    if rerank_run:
        out = searcher.rerank(qids, encoded, candidates, strategies=tuple(strategies))
    elif first_stage == "hybrid":
        hybrid_run, out, first_stage_info = hybrid_search(
            searcher, run, strategy, lexical_config, hybrid_config
        )
    else:
        out = searcher.run(qids, encoded, strategies=tuple(strategies))
        first_stage_info = {"kind": first_stage}
    identical = beir.IdenticalIds.of(
        dataset.queries, dataset.corpus, dataset.qrels, ignore_identical_ids
    )
    if identical.query_ids_in_corpus:
        logging.warning("%s", identical.describe())
    ranked = {s: identical.apply(r) for s, r in out.results.items()}
    # the run is the configured strategy as the search alone ranks (centroid --adapt scores
    # every strategy, top-1 too, from the float store for the adaptation table)
    results = identical.apply(out.run(name))
    evaluation = metrics.evaluate_run(dataset.qrels, results, k_values=K_VALUES)
    k_prime = search_config.k_prime if token_index is not None else None  # no k′ search: None
    adapted, files = None, {}
    if adapt and hybrid_run is not None:
        adapted, files = fusion_adaptation(
            dataset, hybrid_run, hybrid_config, adaptation_config, search_config.top_k, identical
        )
    elif adapt:
        adapted, files = adaptation_files(dataset, ranked, adaptation_config)

    report = {
        "dataset": dataset.name,
        "split": split,
        "num_queries": len(qids),
        "num_docs": store.num_docs,
        "num_tokens": store.num_tokens,
        "config": {
            "model": bundle.name,
            "model_fingerprint": bundle.fingerprint(),
            "projection": bundle.config.projection,
            "salience": bundle.config.salience,
            "alignment": name,
            "search": "run"
            if rerank_run
            else (search_config.backend if not search_config.exhaustive else "exact"),
            "exhaustive": search_config.exhaustive and not rerank_run,
            "k_prime": k_prime,
            # β^q/β^d prune the tokens that generate candidates: none when every document (or
            # every document of the run) is one, whatever SearchConfig holds (None: not applied)
            "beta_q": None if unpruned else search_config.beta_q,
            "beta_d": None if unpruned else search_config.beta_d,
            "refine": search_config.refine,
            "top_k": search_config.top_k,
            "ignore_identical_ids": ignore_identical_ids,
            "first_stage": "run" if rerank_run else first_stage,
            "indexing": indexer.IndexingConfig.recorded(
                store.manifest.get("indexing", {})
            ).settings(),  # the store's, as written (a reused one keeps its own)
        },
        "first_stage": first_stage_info,
        "identical_ids": identical.as_dict(),
        "truncation": run.truncation,
        "docs_deleted": int(run.store.deleted.sum()),  # never retrieved: count as not found
        "metrics": {k: evaluation.aggregate[k] for k in ("ndcg@10", "recall@100", "mrr@10")},
        "metrics_all": evaluation.aggregate,
        "per_query": {
            qid: {"ndcg@10": evaluation.per_query.get(qid, {}).get("ndcg@10", 0.0)} for qid in qids
        },
        "timing": {
            "encode_corpus_s": encode_s,
            "index_reused": reused,
            "index_build_s": build_s,
            "query_encode_ms_per_query": 1000.0 * query_encode_s / max(len(qids), 1),
            "search_ms_per_query_p50": percentile(out.search_ms, 50),
            "search_ms_per_query_p90": percentile(out.search_ms, 90),
            "token_search_ms_per_query_p50": percentile(out.token_search_ms, 50),
            "refine_ms_per_query_p50": percentile(out.refine_ms, 50),
            # Latencies are per query (a batched query waits for its batch); throughput apart.
            "query_batch_size": 1  # rerank scores one query at a time (Searcher.rerank)
            if searcher.centroid is not None or rerank_run
            else search_config.query_batch_size,
            "search_queries_per_s": len(qids) / out.wall_s if out.wall_s else 0.0,
            # --adapt: the search also scores every strategy of the adaptation (slower)
            "includes_adaptation_scoring": len(strategies) > 1,
        },
        "candidates_per_query_median": float(np.median(out.num_candidates)),
        "scoring_flops": flops.run_flops(out.costs, store.dim, k_prime),
        "index_bytes": {
            "refinement_store": store.nbytes(),
            "token_index": token_index.nbytes()
            if token_index
            else (centroid_index.nbytes() if centroid_index else 0),
        },
        "dataset_stats": dataset.stats.as_dict(),
        "devices": [str(d) for d in jax.devices()],
    }
    if searcher.centroid is not None:
        stages = searcher.centroid
        probes, interaction, refine = stages.counts(searcher.config.top_k)  # the run's k
        report["config"]["centroid_stages"] = {
            "probes": probes,
            "interaction_docs": interaction,
            "refine_docs": refine,
            "num_centroids": stages.index.num_centroids,
            "residual_bits": stages.index.codec.bits,
        }
    if isinstance(adapted, dict):  # the hybrid: the fusion weight, per fusion method
        report["adaptation"] = {
            "chooses": "fusion weight",
            **{m: _adaptation_summary(r) for m, r in adapted.items()},
        }
        adapted = adapted[hybrid_config.fusion]
    if adapted is not None:
        report["adaptation"] = {
            **report.get("adaptation", {}),
            "default": adapted.default,
            "adapted_mean": adapted.adapted_mean,
            "adapted_std": adapted.adapted_std,
            "oracle": adapted.oracle,
            "oracle_strategy": adapted.oracle_strategy,
            "metric": adapted.metric,
        }
        if "chooses" not in report["adaptation"]:  # the default is a strategy, not a weight
            report["adaptation"]["default_strategy"] = adaptation_config.default_name
    report = write_results(output, files, report, results, tag=f"aligner_jax-{name}")
    print(summary(report, output))
    return report


def write_results(output: Path, files: dict, report: dict, results: dict, tag: str) -> dict:
    """Writes the run (``run.trec``, ``results.json``), ``config.gin`` and the other ``files``
    atomically, ``metrics.json`` (``report``) last; returns the report as written."""
    files[runs.RUN_FILE] = runs.format_run(results, tag=tag)
    files[runs.RESULTS_FILE] = runs.format_results(results)
    files["config.gin"] = gin.operative_config_str()
    (output / LEGACY_RUN_FILE).unlink(missing_ok=True)  # an older run's file would go unlisted
    return fileio.write_outputs(output, files, report)


def check_first_stage(
    first_stage: str, rerank_run: str | None, adapt: bool, search_config: search_lib.SearchConfig
) -> None:
    """Refuses, before any work, first-stage settings that cannot go together."""
    checks.choice("evaluate.first_stage", first_stage, first_stages())
    if rerank_run and first_stage != "aligner":
        raise ConfigError(
            f"--rerank_run replaces the first stage, which is {first_stage!r} here (a gin file "
            f"such as eval/{first_stage}.gin, or --gin.evaluate.first_stage): drop it, or keep "
            "the default ('aligner')"
        )
    if first_stage in lexical_lib.STAGES and adapt:
        raise ConfigError(f"--adapt needs ALIGNER: evaluate.first_stage={first_stage!r}")
    if (rerank_run or first_stage == "hybrid") and search_config.refine != "full":
        raise ConfigError(
            "--rerank_run and the hybrid refine candidates with stored token vectors: use "
            "--gin.SearchConfig.refine=\"'full'\""
        )


def _adaptation_summary(r: adaptation_lib.AdaptationResult) -> dict:
    return {
        "default": r.default,
        "adapted_mean": r.adapted_mean,
        "adapted_std": r.adapted_std,
        "oracle": r.oracle,
        "oracle_strategy": r.oracle_strategy,
        "choice_counts": r.as_dict()["choice_counts"],
    }


def read_rerank_run(path: str, dataset: beir.BeirDataset) -> tuple[dict[str, list[str]], dict]:
    """The candidates of ``--rerank_run`` for the split's queries, and what was read: lines of
    queries outside the split are skipped (counted, warned); a split query the run does not
    list gets no candidates (counted, warned); an unknown document is an error (file:line)."""
    read = runs.read_run(path, dataset.queries, dataset.corpus)
    missing = [q for q in dataset.queries if q not in read.results]
    if read.skipped:
        logging.warning(
            "--rerank_run=%s: %d lines of %d queries not in the %s split were skipped",
            path,
            sum(read.skipped.values()),
            len(read.skipped),
            dataset.split,
        )
    if missing:
        logging.warning(
            "--rerank_run=%s: %d of %d queries have no line (ranked empty, scored 0)",
            path,
            len(missing),
            len(dataset.queries),
        )
    info = {
        "kind": "run",
        "file": str(Path(path).resolve()),
        "sha256": fileio.sha256_file(path),
        "lines": read.num_lines,
        "skipped_lines": sum(read.skipped.values()),
        "skipped_queries": len(read.skipped),
        "queries_without_candidates": len(missing),
    }
    return {q: list(docs) for q, docs in read.results.items()}, info


def hybrid_search(
    searcher: search_lib.Searcher,
    run: PreparedRun,
    strategy: scoring.AlignmentStrategy,
    lexical_config: lexical_lib.LexicalConfig,
    config: hybrid_lib.HybridConfig,
) -> tuple[hybrid_lib.HybridRun, search_lib.SearchOutput, dict]:
    """ALIGNER + the lexical stage, fused (``retrieval.hybrid``); the fused ranking as a
    ``SearchOutput`` (first stages as token search, the union's refinement + fusion as refine)."""
    dataset = run.dataset
    t0 = time.perf_counter()
    index = lexical_lib.build(
        lexical_config,
        list(dataset.corpus),
        [beir.document_text(d) for d in dataset.corpus.values()],
        run.encoder,
    )
    build_s = time.perf_counter() - t0
    texts = dataset.queries
    t0 = time.perf_counter()
    hybrid = hybrid_lib.search(searcher, index, run.qids, run.queries, texts, strategy, config)
    wall_s = time.perf_counter() - t0
    name = str(strategy)
    fused = hybrid.fused(config.weight, config.fusion, config.rrf_k, searcher.config.top_k)
    first = [a + b for a, b in zip(hybrid.aligner_ms, hybrid.lexical_ms, strict=True)]
    second = [a + b for a, b in zip(hybrid.rerank_ms, hybrid.fusion_ms, strict=True)]
    out = search_lib.SearchOutput(
        {name: fused}, first, second, hybrid.num_candidates, hybrid.costs, wall_s
    )
    info = {
        "kind": "hybrid",
        "lexical": lexical_lib.recorded_settings(lexical_config),
        "hybrid": dataclasses.asdict(config),
        "lexical_index_build_s": build_s,
        "ms_per_query_p50": {
            part: percentile(getattr(hybrid, f"{part}_ms"), 50)
            for part in ("aligner", "lexical", "rerank", "fusion", "search")
        },
        "union_candidates_median": float(np.median(hybrid.num_candidates)),
    }
    return hybrid, out, info


def fusion_adaptation(
    dataset: beir.BeirDataset,
    hybrid: hybrid_lib.HybridRun,
    config: hybrid_lib.HybridConfig,
    adaptation: adaptation_lib.AdaptationConfig,
    top_k: int,
    identical: beir.IdenticalIds,
) -> tuple[dict[str, adaptation_lib.AdaptationResult], dict[str, str]]:
    """The few-shot fusion weight per method → fusion_adaptation.json and .md."""
    chosen = fusion_weights.choose_weights(
        hybrid, dataset.qrels, config, adaptation, top_k, K_VALUES, identical.apply
    )
    return chosen, fusion_weights.files(dataset.name, dataset.split, config, chosen)


def evaluate_lexical(
    dataset_dir: str,
    output_dir: str,
    split: str,
    config: lexical_lib.LexicalConfig,
    top_k: int,
    unknown_qrels: str = "error",
    ignore_identical_ids: str = "same_text",
    query_maxlen: int | None = None,
) -> dict:
    """A lexical first stage alone (``bm25``, ``minicoil``) through the same outputs: run file,
    config.gin, metrics.json and the summary. BM25 encodes nothing; miniCOIL reads the
    gin-configured encoder's token vectors (no token store is built)."""
    output = fileio.check_output_dir(output_dir, "--output_dir")
    dataset = beir.load_beir(dataset_dir, split=split, unknown_qrels=unknown_qrels)
    encoder = None
    if lexical_lib.needs_encoder(config):
        bundle = loading_lib.load_encoder()
        limit = query_maxlen or aligner_lib.backbone_max_length(bundle.config.backbone)
        encoder = Encoder(bundle, EncodingConfig(), query_maxlen=limit)
    t0 = time.perf_counter()
    index = lexical_lib.build(
        config,
        list(dataset.corpus),
        [beir.document_text(d) for d in dataset.corpus.values()],
        encoder,
    )
    build_s = time.perf_counter() - t0
    found, ms = lexical_lib.search_timed(index, dataset.queries, top_k)
    identical = beir.IdenticalIds.of(
        dataset.queries, dataset.corpus, dataset.qrels, ignore_identical_ids
    )
    if identical.query_ids_in_corpus:
        logging.warning("%s", identical.describe())
    results = identical.apply(found)
    evaluation = metrics.evaluate_run(dataset.qrels, results, k_values=K_VALUES)
    report = {
        "dataset": dataset.name,
        "split": split,
        "num_queries": len(dataset.queries),
        "num_docs": len(dataset.corpus),
        "config": {
            "first_stage": config.kind,
            "lexical": lexical_lib.recorded_settings(config),
            "model": encoder.bundle.name if encoder else None,
            "top_k": top_k,
            "ignore_identical_ids": ignore_identical_ids,
        },
        "identical_ids": identical.as_dict(),
        "metrics": {k: evaluation.aggregate[k] for k in ("ndcg@10", "recall@100", "mrr@10")},
        "metrics_all": evaluation.aggregate,
        "per_query": {
            q: {"ndcg@10": evaluation.per_query.get(q, {}).get("ndcg@10", 0.0)}
            for q in dataset.queries
        },
        "timing": {
            "index_build_s": build_s,
            "search_ms_per_query_p50": percentile(ms, 50),
            "search_ms_per_query_p90": percentile(ms, 90),
        },
        "dataset_stats": dataset.stats.as_dict(),
    }
    report = write_results(output, {}, report, results, tag=f"aligner_jax-{config.kind}")
    print(lexical_summary(report, output))
    return report


def lexical_settings(lexical: dict) -> str:
    if lexical["kind"] == "bm25":
        return f"k1={lexical['k1']}, b={lexical['b']}"
    if lexical["kind"] == "minicoil":
        used = lexical.get("minicoil", {})
        bm25 = f", k1={used['k1']}, b={used['b']}" if "k1" in used else ""
        return f"meaning models {lexical['minicoil_models'] or 'fitted on the corpus'}{bm25}"
    return lexical["kind"]


def lexical_summary(report: dict, output: Path | str) -> str:
    c, m, t = report["config"], report["metrics"], report["timing"]
    lexical = c["lexical"]
    return "\n".join(
        [
            "=" * 72,
            f"{c['first_stage']} evaluation: {report['dataset']}/{report['split']} "
            f"({report['num_queries']} queries, {report['num_docs']} docs)",
            f"lexical    {c['first_stage']} ({lexical_settings(lexical)})"
            + (f", encoder {c['model']}" if c["model"] else ""),
            f"nDCG@10    {100 * m['ndcg@10']:.1f}   Recall@100 {100 * m['recall@100']:.1f}"
            f"   MRR@10 {100 * m['mrr@10']:.1f}",
            f"ids        {report['identical_ids']['description']}",
            f"timing     index build {t['index_build_s']:.1f}s, search p50 "
            f"{t['search_ms_per_query_p50']:.2f} ms/query",
            written_line(report, output),
            "=" * 72,
        ]
    )


def adaptation_files(
    dataset: beir.BeirDataset,
    results_by_strategy: dict[str, dict[str, dict[str, float]]],
    config: adaptation_lib.AdaptationConfig,
) -> tuple[adaptation_lib.AdaptationResult, dict[str, str]]:
    """Per-strategy per-query metrics → the §4.1 protocol → adaptation.json and .md."""
    metric = config.metric
    per_query = {}
    with progress.Progress(len(config.strategy_names), "adaptation: score", "strategy") as bar:
        for name in config.strategy_names:
            ev = metrics.evaluate_run(dataset.qrels, results_by_strategy[name], k_values=K_VALUES)
            per_query[name] = {q: ev.per_query.get(q, {}).get(metric, 0.0) for q in dataset.queries}
            bar.update(1)
    result = adaptation_lib.few_shot_adaptation(per_query, config)
    payload = {
        "dataset": dataset.name,
        "split": dataset.split,
        "config": dataclasses.asdict(config),
        **result.as_dict(),
        "per_query": per_query,
    }
    return result, {
        "adaptation.json": json.dumps(payload, indent=1) + "\n",
        "adaptation.md": adaptation_lib.markdown_table({dataset.name: result}),
    }


def summary(report: dict, output: Path | str | None = None) -> str:
    c, m, t, tr = report["config"], report["metrics"], report["timing"], report["truncation"]
    lines = [
        "=" * 72,
        f"ALIGNER evaluation: {report['dataset']}/{report['split']} "
        f"({report['num_queries']} queries, {report['num_docs']} docs, "
        f"{report['num_tokens']} tokens)",
        f"model      {c['model']} (projection={c['projection']}, salience={c['salience']})",
        f"alignment  {c['alignment']}   search {c['search']}"
        + (
            " (the candidates of --rerank_run)"
            if c["search"] == "run"
            else " exhaustive"
            if c["exhaustive"]
            else (f" {c['centroid_stages']}" if "centroid_stages" in c else f" k'={c['k_prime']}")
        )
        + (
            "  (no token pruning: every token of every candidate)"
            if c["beta_q"] is None
            else f"  beta_q={c['beta_q']} beta_d={c['beta_d']}"
        )
        + f"  refine={c['refine']}",
        f"nDCG@10    {100 * m['ndcg@10']:.1f}   Recall@100 {100 * m['recall@100']:.1f}"
        f"   MRR@10 {100 * m['mrr@10']:.1f}",
        f"ids        {report['identical_ids']['description']}",
        f"truncated  {tr['queries_truncated']} queries at {tr['query_maxlen']} tokens, "
        f"{tr['docs_truncated']} documents at {tr['doc_maxlen']} tokens",
        f"timing     corpus encode {t['encode_corpus_s']:.1f}s"
        + (" (reused)" if t["index_reused"] else "")
        + f", token index build {t['index_build_s']:.1f}s, search latency p50 "
        f"{t['search_ms_per_query_p50']:.1f} / p90 {t['search_ms_per_query_p90']:.1f} ms"
        + (f" (batches of {t['query_batch_size']})" if t.get("query_batch_size", 1) > 1 else "")
        + f", {t.get('search_queries_per_s', 0.0):.0f} queries/s, median candidates "
        f"{report['candidates_per_query_median']:.0f}",
    ]
    ds = report.get("dataset_stats", {})
    if ds.get("skipped_qrels"):
        lines.append(
            f"qrels      {ds['skipped_qrels']} judgment line(s) skipped (unknown queries: "
            f"{ds['unknown_query_qrels']}, unknown documents: {ds['unknown_document_qrels']}): "
            "the metrics do not count them"
        )
    first = report.get("first_stage", {})
    if first.get("kind") == "hybrid":
        h, ms = first["hybrid"], first["ms_per_query_p50"]
        lines.append(
            f"hybrid     {first['lexical']['kind']} ({lexical_settings(first['lexical'])}) + "
            f"ALIGNER, {h['fusion']} fusion, ALIGNER "
            f"weight {h['weight']}, depth {h['depth']}; p50 ms: ALIGNER {ms['aligner']:.1f}, "
            f"lexical {ms['lexical']:.1f}, union refine {ms['rerank']:.1f}"
        )
    elif first.get("kind") == "run":
        lines.append(
            f"reranked   {first['file']} ({first['lines']} lines, {first['skipped_lines']} "
            f"skipped, {first['queries_without_candidates']} queries without candidates)"
        )
    if "adaptation" in report:
        a = report["adaptation"]
        default = f" ({a['default_strategy']})" if "default_strategy" in a else ""
        lines.append(
            f"adaptation {a.get('metric', 'ndcg@10')}: default{default} {100 * a['default']:.1f}  "
            f"adapted {100 * a['adapted_mean']:.1f} ± {100 * a['adapted_std']:.1f}  oracle "
            f"{100 * a['oracle']:.1f} ({a['oracle_strategy']})"
        )
    if output is not None:
        lines.append(written_line(report, output))
    lines.append("=" * 72)
    return "\n".join(lines)


def written_line(report: dict, output: Path | str) -> str:
    """The summary line naming the files an evaluation wrote."""
    return f"wrote      {', '.join(['metrics.json', *report.get('files', {})])} in {output}"
