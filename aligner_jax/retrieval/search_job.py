"""The ``aligner-search`` job: free-text queries against a persisted index.

One query (``--query``) prints a ranked list with the documents' titles (read from the corpus the
index records in its manifest, when it is still there); a file of queries (``--queries``, BEIR
``queries.jsonl``: ``{"_id", "text"}`` per line) is searched one query at a time, with progress,
and written as a TREC run (``--output``).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import threadpoolctl

from aligner_jax.common import checks, progress
from aligner_jax.common.errors import ConfigError
from aligner_jax.data import beir, runs
from aligner_jax.encoding import loading
from aligner_jax.retrieval import searcher as search_lib


def corpus_titles(manifest: dict, doc_ids: set[str]) -> dict[str, str]:
    """Titles (or the first words of the text) of ``doc_ids`` from the indexed corpus file."""
    path = Path(manifest.get("corpus", {}).get("path", ""))
    path = path / "corpus.jsonl" if path.is_dir() else path
    if not path.is_file():
        return {}
    titles = {}
    for doc in beir.iter_corpus(path, check_duplicates=False):
        if doc.doc_id in doc_ids:
            titles[doc.doc_id] = doc.title or " ".join(doc.text.split()[:12])
            if len(titles) == len(doc_ids):
                break
    return titles


def format_ranking(query: str, ranked: list[tuple[str, float]], titles: dict[str, str]) -> str:
    lines = [f"query: {query}"]
    for rank, (doc_id, score) in enumerate(ranked, start=1):
        lines.append(f"{rank:>4}  {score:8.4f}  {doc_id:<16}  {titles.get(doc_id, '')[:90]}")
    return "\n".join(lines)


def search_job(
    index_dir: str,
    query: str | None = None,
    queries: str | None = None,
    output: str | None = None,
    k: int = 10,
    mode: str = "fast",
    threads: int = 2,
    checkpoint: str | None = None,
    alignment: str = "top_k:1",
) -> str:
    """Runs ``aligner-search``; returns what it prints."""
    if (query is None) == (queries is None):
        raise ConfigError("give exactly one of --query=TEXT or --queries=FILE.jsonl")
    if queries is not None and not output:
        raise ConfigError("--queries needs --output=RUN_FILE (a TREC run)")
    if threads < 1:
        raise ConfigError(f"--threads={threads}: must be >= 1")
    threadpoolctl.threadpool_limits(threads)
    t0 = time.perf_counter()
    encoder = None
    # --gin_file of a model: that model, checked against the index
    if checks.is_bound("load_encoder.config"):
        encoder = search_lib.whole_query_encoder(loading.load_encoder(checkpoint=checkpoint))
    searcher = search_lib.Searcher.load(
        index_dir, mode=mode, checkpoint=checkpoint, encoder=encoder, alignment=alignment
    )
    load_s = time.perf_counter() - t0
    if query is not None:
        ranked = searcher.search(query, k=k)
        titles = corpus_titles(searcher.store.manifest, {d for d, _ in ranked})
        return format_ranking(query, ranked, titles)
    items = list(beir.iter_queries(queries))
    results, latency = {}, []
    with progress.Progress(len(items), "aligner-search", "query") as bar:
        for qid, text in items:
            t = time.perf_counter()
            results[qid] = dict(searcher.search(text, k=k))
            latency.append(1000.0 * (time.perf_counter() - t))
            bar.update(1)
    runs.write_run(output, results, tag=f"aligner_jax-{mode}")
    return (
        f"aligner-search: {len(items)} queries ({mode}, k={k}, {threads} threads), index loaded "
        f"in {load_s:.2f}s, p50 {np.percentile(latency, 50):.1f} ms/query with query encoding; "
        f"wrote {output}"
    )
