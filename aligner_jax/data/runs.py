"""Run files: the TREC run ``run.trec`` (``qid Q0 doc_id rank score tag`` lines, space-separated,
in trec_eval's order) and BEIR's ``results.json`` (``{qid: {doc_id: score}}``, best first), written
atomically. Scores are written exactly (``repr``: they read back as the same floats), so
trec_eval / pytrec_eval on either file reproduce the metrics computed from the same results.
``read_run`` reads one back (any system's run, to rerank it), with errors naming file and line."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Collection, Mapping
from pathlib import Path

from aligner_jax.common import fileio
from aligner_jax.common.errors import RunFileError
from aligner_jax.data import beir

RUN_FILE = "run.trec"  # the TREC run of an evaluation folder
RESULTS_FILE = "results.json"  # BEIR's interchange format of the same rankings


def _sort_key(item: tuple[str, float]) -> tuple[float, str]:
    return (item[1], item[0])


def ranked(scored: Mapping[str, float]) -> list[tuple[str, float]]:
    """``(doc_id, score)`` best first, in trec_eval's order (ties: larger doc id first)."""
    return sorted(((str(d), float(s)) for d, s in scored.items()), key=_sort_key, reverse=True)


def format_run(results: Mapping[str, Mapping[str, float]], tag: str, first_rank: int = 1) -> str:
    """``results[qid][doc_id] = score`` as the text of a TREC run file, ranks from
    ``first_rank`` (a later page of a ranking: offset + 1)."""
    lines = []
    for qid, docs in results.items():
        for rank, (doc_id, score) in enumerate(ranked(docs), start=first_rank):
            lines.append(f"{qid} Q0 {doc_id} {rank} {score!r} {tag}\n")
    return "".join(lines)


def format_results(results: Mapping[str, Mapping[str, float]]) -> str:
    """``results[qid][doc_id] = score`` as BEIR's ``results.json`` text: each query's documents
    best first (trec_eval's order), scores exact."""
    ordered = {str(q): dict(ranked(docs)) for q, docs in results.items()}
    return json.dumps(ordered, indent=None, separators=(",", ":")) + "\n"


def write_run(
    path: str | Path, results: Mapping[str, Mapping[str, float]], tag: str, first_rank: int = 1
) -> None:
    fileio.atomic_write_text(path, format_run(results, tag, first_rank))


@dataclasses.dataclass
class RunFile:
    """A run read back: ``results[qid][doc_id] = score`` for the known queries, the number of
    lines read, and the lines skipped per query id that is not among the known queries."""

    results: dict[str, dict[str, float]]
    num_lines: int
    skipped: dict[str, int]


def read_run(
    path: str | Path,
    query_ids: Collection[str],
    doc_ids: Collection[str],
    flag: str = "--rerank_run",
) -> RunFile:
    """Reads a TREC run (``qid Q0 doc_id rank score [tag]``, whitespace-separated).

    Lines of a query not in ``query_ids`` (e.g. a run over every query of a collection, scored
    on its test split) are skipped and counted. A document not in ``doc_ids`` (a run made on
    another corpus), a repeated (query, document) pair or a malformed line is a
    ``RunFileError`` naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise RunFileError(f"{flag}={path}: no such file (expected a TREC run file)")
    expected = "expected 'qid Q0 doc_id rank score tag'"
    results: dict[str, dict[str, float]] = {}
    skipped: dict[str, int] = {}
    num_lines = 0
    for number, line in beir.iter_decoded_lines(path, RunFileError):
        fields = line.split()
        if not fields:
            continue
        num_lines += 1
        where = f"{path}:{number}"
        if len(fields) not in (5, 6):
            raise RunFileError(f"{where}: {len(fields)} fields, {expected}")
        qid, _, doc_id, rank, score = fields[:5]
        try:
            value = float(score)
            int(rank)
        except ValueError:
            raise RunFileError(f"{where}: rank {rank!r} / score {score!r}: {expected}") from None
        if not math.isfinite(value):
            raise RunFileError(f"{where}: score {score!r} is not a finite number")
        if qid not in query_ids:
            skipped[qid] = skipped.get(qid, 0) + 1
            continue
        if doc_id not in doc_ids:
            raise RunFileError(
                f"{where}: document {doc_id!r} is not in the corpus; was the run made on "
                "another collection?"
            )
        docs = results.setdefault(qid, {})
        if doc_id in docs:
            raise RunFileError(f"{where}: document {doc_id!r} is listed twice for {qid!r}")
        docs[doc_id] = value
    if not num_lines:
        raise RunFileError(f"{flag}={path}: the file is empty ({expected})")
    if not results:
        raise RunFileError(
            f"{flag}={path}: none of its {len(skipped)} queries (e.g. {sorted(skipped)[:3]}) is a "
            f"query of the split searched ({len(query_ids)} queries); was it made for another "
            "split or collection?"
        )
    return RunFile(results, num_lines, skipped)
