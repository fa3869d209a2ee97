"""The ``aligner-search`` job: free-text queries against a persisted index.

One query (``--query``) prints a ranked list with the documents' titles (read from the corpus the
index records in its manifest, when it is still there); a file of queries (``--queries``, BEIR
``queries.jsonl``: ``{"_id", "text"}`` per line) is searched one query at a time, with progress,
and written as a TREC run (``--output``). Bad input is refused before anything is searched
(:func:`search_job`); queries and documents cut at the encoder's token budget are counted in what
it prints.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import threadpoolctl

from aligner_jax.common import checks, fileio, progress
from aligner_jax.common.errors import ConfigError, MissingPathError
from aligner_jax.data import beir, runs
from aligner_jax.encoding import loading
from aligner_jax.indexing import documents
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


def format_ranking(
    query: str, ranked: list[tuple[str, float]], titles: dict[str, str], snippet_chars: int = 0
) -> str:
    """The ranked list; ``snippet_chars`` > 0 adds that much of each hit's text (``--show=text``:
    :class:`searcher.Hit` objects carry it) under its line."""
    lines = [f"query: {query}"]
    for rank, hit in enumerate(ranked, start=1):
        doc_id, score = hit
        rank = getattr(hit, "rank", rank)
        lines.append(f"{rank:>4}  {score:8.4f}  {doc_id:<16}  {titles.get(doc_id, '')[:90]}")
        text = " ".join((getattr(hit, "text", None) or "").split())
        if snippet_chars and text:
            cut = text[:snippet_chars] + ("…" if len(text) > snippet_chars else "")
            lines.append(f"{'':>16}{cut}")
    return "\n".join(lines)


def parse_filter(spec: str | None) -> dict | None:
    """``--filter``: a JSON object of metadata conditions (``indexing.documents``)."""
    if spec is None:
        return None
    try:
        value = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--filter={spec}: not JSON ({e.msg} at column {e.colno}); write e.g. "
            """--filter='{"year": {"gte": 2015}}'"""
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(f"--filter={spec}: expected a JSON object of field conditions")
    try:  # checked before the index loads, and named by the flag
        documents.compile_filter(value)
    except ConfigError as e:
        raise ConfigError(f"--filter={spec}: {str(e).removeprefix('filter: ')}") from None
    return value


def check_output(output: str) -> Path:
    """Refuses, before anything is searched, a ``--output`` that could not be written: a folder,
    or a path under a file or in a folder without write permission (a missing folder is created
    when the run is written)."""
    path = Path(output)
    if path.is_dir():
        raise ConfigError(f"--output={output}: is a folder; give a file, e.g. {path / 'run.trec'}")
    fileio.check_output_dir(path.parent, "--output")
    return path


def live_documents(searcher: search_lib.Searcher, index_dir: str) -> int:
    """The index's live documents; refuses an index whose every document was deleted (nothing
    could be returned)."""
    store = searcher.store
    if store.num_docs and store.deleted.all():
        raise ConfigError(
            f"--index_dir={index_dir}: no live documents (all {store.num_docs} were deleted with "
            f"--delete); add some with aligner-index --index_dir={index_dir} --add=CORPUS.jsonl"
        )
    return int(store.num_docs - store.deleted.sum())


def truncation_note(searcher: search_lib.Searcher, texts: list[str]) -> str:
    """How many of ``texts`` the query encoder cut (``""`` when none), and the documents the
    index cut when it was built."""
    encoder = searcher.query_encoder()
    cut = encoder.count_truncated(texts, encoder.tokenize(texts, "query"), "query")
    docs = int(searcher.store.manifest.get("stats", {}).get("truncated_docs", 0))
    parts = []
    if cut:
        what = "the query was" if len(texts) == 1 else f"{cut} of {len(texts)} queries were"
        parts.append(f"{what} cut at {encoder.maxlen('query')} tokens")
    if docs:
        parts.append(f"the index cut {docs} documents at {encoder.maxlen('doc')} tokens")
    return "; ".join(parts)  # printed with the ranking or the summary


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
    show: str = "title",
    filter: str | None = None,
    offset: int = 0,
    depth: int | None = None,
) -> str:
    """Runs ``aligner-search``; returns what it prints (``show='text'``: a snippet of each hit;
    ``filter``: JSON metadata conditions; ``offset``: hits skipped, the page's start;
    ``depth``: the ranking the page is cut from, ``Searcher.search``'s).

    Everything a user gives is checked before the index is searched: the queries file (a corpus
    file, an empty or blank query, an empty file are refused naming the file and line), the
    ``--output`` path, an index without live documents. Truncated queries are counted and said.
    """
    if (query is None) == (queries is None):
        raise ConfigError("give exactly one of --query=TEXT or --queries=FILE.jsonl")
    if queries is not None and not output:
        raise ConfigError("--queries needs --output=RUN_FILE (a TREC run)")
    if query is not None and output:
        raise ConfigError(
            f"--output={output} is the run file of --queries=FILE.jsonl; --query prints its "
            "ranking (write the query to a queries file to get a run)"
        )
    if queries is not None and show == "text":
        raise ConfigError(
            "--show=text prints snippets under --query's ranking; the run file of --queries "
            "holds ids and scores only"
        )
    if query is not None and beir.is_blank(query):
        raise ConfigError("--query is empty: give a text to search for")
    if threads < 1:
        raise ConfigError(f"--threads={threads}: must be >= 1")
    if k < 1:
        raise ConfigError(f"--k={k}: must be >= 1")
    if offset < 0:
        raise ConfigError(f"--offset={offset}: must be >= 0")
    if depth is not None and depth < offset + k:
        raise ConfigError(
            f"--depth={depth}: the ranking's depth must be at least --offset + --k = {offset + k}"
        )
    conditions = parse_filter(filter)
    checks.index_dir(index_dir)
    if queries is not None and not Path(queries).is_file():
        what = "is a folder, not a file" if Path(queries).exists() else "no such file"
        raise MissingPathError(f"--queries={queries}: {what}; give a queries.jsonl")
    items = beir.load_queries(queries) if queries is not None else {}
    output_path = check_output(output) if queries is not None else None
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
    live = live_documents(searcher, index_dir)
    if query is not None:
        ranked = searcher.search(query, k=k, offset=offset, filter=conditions, depth=depth)
        titles = {h.doc_id: h.title or " ".join((h.text or "").split()[:12]) for h in ranked}
        if not any(titles.values()):  # an index without documents.sqlite: the corpus file's
            titles = corpus_titles(searcher.store.manifest, {d for d, _ in ranked})
        notes = [truncation_note(searcher, [query])]
        if ranked.filtered_docs is not None and conditions is not None:
            notes.append(f"the filter kept {ranked.filtered_docs} of {live} live documents")
        if not ranked:
            notes.append(f"no hits at ranks {offset + 1}..{offset + k}")
        note = "; ".join(n for n in notes if n)
        text = format_ranking(query, ranked, titles, 240 if show == "text" else 0)
        return text + (f"\nnote: {note}" if note else "")
    beir.check_not_a_corpus(queries, items, searcher.store.doc_ids, f"--index_dir={index_dir}")
    results, latency, filtered = {}, [], None
    with progress.Progress(len(items), "aligner-search", "query") as bar:
        for qid, text in items.items():
            t = time.perf_counter()
            ranked = searcher.search(text, k=k, offset=offset, filter=conditions, depth=depth)
            latency.append(1000.0 * (time.perf_counter() - t))
            results[qid], filtered = dict(ranked), ranked.filtered_docs
            bar.update(1)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    runs.write_run(output_path, results, tag=f"aligner_jax-{mode}", first_rank=offset + 1)
    note = truncation_note(searcher, list(items.values()))
    page = f", ranks {offset + 1}..{offset + k}" if offset else ""
    short = sum(len(hits) < k for hits in results.values())
    empty = sum(not hits for hits in results.values())
    found = ""
    if conditions is not None and filtered is not None:
        found += f"; the filter kept {filtered} of {live} live documents"
    if short:
        found += f"; {short} queries got fewer than {k} hits ({empty} none)"
    return (
        f"aligner-search: {len(items)} queries ({mode}, k={k}{page}, {threads} threads), index loaded "
        f"in {load_s:.2f}s, p50 {np.percentile(latency, 50):.1f} ms/query with query encoding; "
        f"truncated: {note or 'none'}{found}; wrote {output} "
        f"({sum(map(len, results.values()))} lines)"
    )
