"""TREC run files: ``qid Q0 doc_id rank score tag`` lines, written atomically."""

from __future__ import annotations

from pathlib import Path

from aligner_jax.common import fileio


def write_run(path: str | Path, results: dict[str, dict[str, float]], tag: str) -> None:
    """Writes ``results[qid][doc_id] = score`` as a TREC run, each query's documents by score."""
    lines = []
    for qid, docs in results.items():
        ranked = sorted(docs.items(), key=lambda kv: -kv[1])
        for rank, (doc_id, score) in enumerate(ranked, start=1):
            lines.append(f"{qid} Q0 {doc_id} {rank} {score:.6f} {tag}\n")
    fileio.atomic_write_text(path, "".join(lines))
