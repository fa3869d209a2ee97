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

from aligner_jax.common import errors, fileio, progress
from aligner_jax.common.errors import ConfigError
from aligner_jax.core import flops, scoring
from aligner_jax.data import beir, runs
from aligner_jax.encoding import loading as loading_lib
from aligner_jax.encoding.encoder import Encoder, EncodingConfig
from aligner_jax.evaluation import adaptation as adaptation_lib
from aligner_jax.evaluation import metrics
from aligner_jax.indexing import ann as ti
from aligner_jax.indexing import centroid_index as ci
from aligner_jax.indexing import indexer
from aligner_jax.indexing import token_store as ts
from aligner_jax.models import aligner as aligner_lib
from aligner_jax.retrieval import searcher as search_lib

K_VALUES = (10, 100)
LEGACY_RUN_FILE = "run.tsv"  # the name of run.trec before issue 13


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
        reused = True
        indexer.write_encoder_spec(index_dir, encoder.bundle)
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
    """The store's persisted compressed index, built (once) when missing or stale; returns it
    and the seconds spent building (0 when loaded)."""
    if ci.CentroidIndex.exists(store.directory):
        try:
            index = ci.CentroidIndex.load(store)
        except errors.IndexIntegrityError as e:
            logging.warning("rebuilding the search index: %s", e)
        else:
            if index.meta["config"]["beta_d"] == beta_d:
                logging.info("Loaded the search index of %s", store.directory)
                return index, 0.0
            logging.info("rebuilding the search index for beta_d=%s", beta_d)
    start = time.perf_counter()
    config = dataclasses.replace(ci.CentroidIndexConfig(), beta_d=beta_d)
    return ci.CentroidIndex.build(store, config), time.perf_counter() - start


def check_store_holds_corpus(store: ts.TokenStore, dataset: beir.BeirDataset) -> None:
    """The store must hold exactly the corpus's documents, in corpus order: otherwise some
    documents could never be retrieved and the metrics would be silently wrong."""
    corpus_ids = list(dataset.corpus)
    if store.doc_ids == corpus_ids:
        return
    where = f"{store.directory}: the token store holds {store.num_docs} documents"
    corpus = Path(dataset.path) / "corpus.jsonl"
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
) -> PreparedRun:
    """Loads the BEIR split, the gin-configured encoder, the corpus's token store (under
    ``index_dir``, default ``OUTPUT_DIR/index``) and encodes every query, whole: up to
    ``query_maxlen`` tokens (None: the backbone's maximum, e.g. 512 for BERT, not the training
    length). Queries and documents that were cut are counted in ``truncation``."""
    output = fileio.check_output_dir(output_dir, "--output_dir")  # created when results exist
    if index_dir and not (Path(index_dir) / ts.MANIFEST).exists():  # a complete one is only read
        fileio.check_output_dir(index_dir, "--index_dir")
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
    token_ids = encoder.tokenize([dataset.queries[q] for q in qids], "query")
    encoded = [None] * len(qids)
    with progress.Progress(len(qids), "encode queries", "query") as bar:
        for i, e in encoder.encode_token_ids(token_ids, "query", bar=bar):
            encoded[i] = e
    truncation = {
        "query_maxlen": query_maxlen,
        "queries_truncated": int(sum(len(t) >= query_maxlen for t in token_ids)),
        "doc_maxlen": bundle.config.doc_maxlen,
        "docs_truncated": int(store.manifest.get("stats", {}).get("truncated_docs", 0)),
    }
    if truncation["queries_truncated"]:
        logging.warning(
            "%d of %d queries reach --query_maxlen=%d tokens and were cut",
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
) -> dict:
    """Evaluates the gin-configured encoder on one split of a BEIR folder; returns metrics.json.

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
    strategy = scoring.AlignmentStrategy.parse(alignment)
    strategies = [strategy]
    if adapt:
        if search_config.refine == "xtr":
            raise ConfigError(
                "--adapt re-scores candidates with alignment strategies: use refine='full'"
            )
        extra = [scoring.AlignmentStrategy.parse(x) for x in adaptation_config.strategies]
        strategies += [x for x in extra if x != strategy]
    run = prepare(
        dataset_dir,
        output_dir,
        split,
        index_dir,
        encoding_config,
        unknown_qrels,
        verify_checksums,
        query_maxlen,
    )
    output, dataset, bundle, store = run.output, run.dataset, run.encoder.bundle, run.store
    encode_s, reused, qids, encoded = run.encode_corpus_s, run.index_reused, run.qids, run.queries

    token_index, centroid_index, build_s = None, None, 0.0
    if search_config.exhaustive:
        pass
    elif search_config.backend == "centroid":
        centroid_index, build_s = open_centroid_index(store, search_config.beta_d)
    else:
        token_index = ti.TokenIndex.build(
            store, search_config.backend, beta_d=search_config.beta_d, k_prime=search_config.k_prime
        )
        build_s = token_index.build_seconds

    query_encode_s = run.encode_queries_s
    searcher = search_lib.Searcher(store, search_config, token_index, centroid_index=centroid_index)
    out = searcher.run(qids, encoded, strategies=tuple(strategies))
    name = "xtr" if search_config.refine == "xtr" else str(strategy)
    identical = beir.IdenticalIds.of(
        dataset.queries, dataset.corpus, dataset.qrels, ignore_identical_ids
    )
    if identical.query_ids_in_corpus:
        logging.warning("%s", identical.describe())
    ranked = {s: identical.apply(r) for s, r in out.results.items()}
    results = ranked[name]
    evaluation = metrics.evaluate_run(dataset.qrels, results, k_values=K_VALUES)
    adapted, files = None, {}
    if adapt:
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
            "search": search_config.backend if not search_config.exhaustive else "exact",
            "exhaustive": search_config.exhaustive,
            "k_prime": search_config.k_prime,
            "beta_q": search_config.beta_q,
            "beta_d": search_config.beta_d,
            "refine": search_config.refine,
            "top_k": search_config.top_k,
            "ignore_identical_ids": ignore_identical_ids,
        },
        "identical_ids": identical.as_dict(),
        "truncation": run.truncation,
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
            "query_batch_size": 1
            if searcher.centroid is not None
            else search_config.query_batch_size,
            "search_queries_per_s": len(qids) / out.wall_s if out.wall_s else 0.0,
        },
        "candidates_per_query_median": float(np.median(out.num_candidates)),
        "scoring_flops": flops.run_flops(out.costs, store.dim, search_config.k_prime),
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
        report["config"]["centroid_stages"] = {
            "probes": stages.probes,
            "interaction_docs": stages.interaction_docs,
            "refine_docs": stages.refine_docs,
            "num_centroids": stages.index.num_centroids,
            "residual_bits": stages.index.codec.bits,
        }
    if adapted is not None:
        report["adaptation"] = {
            "default": adapted.default,
            "adapted_mean": adapted.adapted_mean,
            "adapted_std": adapted.adapted_std,
            "oracle": adapted.oracle,
            "oracle_strategy": adapted.oracle_strategy,
        }
    files[runs.RUN_FILE] = runs.format_run(results, tag=f"aligner_jax-{name}")
    files[runs.RESULTS_FILE] = runs.format_results(results)
    files["config.gin"] = gin.operative_config_str()
    (output / LEGACY_RUN_FILE).unlink(missing_ok=True)  # an older run's file would go unlisted
    report = fileio.write_outputs(output, files, report)
    print(summary(report, output))
    return report


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
            " exhaustive"
            if c["exhaustive"]
            else (f" {c['centroid_stages']}" if "centroid_stages" in c else f" k'={c['k_prime']}")
        )
        + f"  beta_q={c['beta_q']} beta_d={c['beta_d']}  refine={c['refine']}",
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
    if "adaptation" in report:
        a = report["adaptation"]
        lines.append(
            f"adaptation default {100 * a['default']:.1f}  adapted {100 * a['adapted_mean']:.1f}"
            f" ± {100 * a['adapted_std']:.1f}  oracle {100 * a['oracle']:.1f} ({a['oracle_strategy']})"
        )
    if output is not None:
        written = ", ".join(["metrics.json", *report.get("files", {})])
        lines.append(f"wrote      {written} in {output}")
    lines.append("=" * 72)
    return "\n".join(lines)
