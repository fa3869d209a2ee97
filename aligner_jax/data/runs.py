"""Run files: the TREC run ``run.trec`` (``qid Q0 doc_id rank score tag`` lines, space-separated,
in trec_eval's order) and BEIR's ``results.json`` (``{qid: {doc_id: score}}``, best first), written
atomically. Scores are written exactly (``repr``: they read back as the same floats), so
trec_eval / pytrec_eval on either file reproduce the metrics computed from the same results."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from aligner_jax.common import fileio

RUN_FILE = "run.trec"  # the TREC run of an evaluation folder
RESULTS_FILE = "results.json"  # BEIR's interchange format of the same rankings


def _sort_key(item: tuple[str, float]) -> tuple[float, str]:
    return (item[1], item[0])


def ranked(scored: Mapping[str, float]) -> list[tuple[str, float]]:
    """``(doc_id, score)`` best first, in trec_eval's order (ties: larger doc id first)."""
    return sorted(((str(d), float(s)) for d, s in scored.items()), key=_sort_key, reverse=True)


def format_run(results: Mapping[str, Mapping[str, float]], tag: str) -> str:
    """``results[qid][doc_id] = score`` as the text of a TREC run file."""
    lines = []
    for qid, docs in results.items():
        for rank, (doc_id, score) in enumerate(ranked(docs), start=1):
            lines.append(f"{qid} Q0 {doc_id} {rank} {score!r} {tag}\n")
    return "".join(lines)


def format_results(results: Mapping[str, Mapping[str, float]]) -> str:
    """``results[qid][doc_id] = score`` as BEIR's ``results.json`` text: each query's documents
    best first (trec_eval's order), scores exact."""
    ordered = {str(q): dict(ranked(docs)) for q, docs in results.items()}
    return json.dumps(ordered, indent=None, separators=(",", ":")) + "\n"


def write_run(path: str | Path, results: Mapping[str, Mapping[str, float]], tag: str) -> None:
    fileio.atomic_write_text(path, format_run(results, tag))
