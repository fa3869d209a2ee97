"""The one rule for a document id, shared by every way documents come in (a BEIR corpus, the
Python ``Index``, the token-store writer) and every way they are named again (delete, subset).

An id is a non-empty string or an integer (JSON's two id types; not a bool), stored as the
string with surrounding whitespace removed: ``7``, ``"7"`` and ``" 7 "`` name one document.
Whitespace inside an id is refused: TREC run files and qrels separate their fields by it, so such
an id could not be written to a run (or read back by ``--rerank_run`` and trec_eval).
This module imports nothing.
"""

from __future__ import annotations


def clean(value) -> str:
    """The stored form of a document id; ``ValueError`` says why ``value`` is not one
    ("must be a string or an integer, found float 1.5" / "is empty"), for the caller to prefix
    with the file, line or argument."""
    if not isinstance(value, str) and hasattr(value, "item"):  # a numpy scalar
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise ValueError(f"must be a string or an integer, found {type(value).__name__} {shown}")
    doc_id = str(value).strip()
    if not doc_id:
        raise ValueError("is empty")
    if any(c.isspace() for c in doc_id):
        shown = doc_id if len(doc_id) <= 40 else doc_id[:37] + "..."
        raise ValueError(
            f"{shown!r} contains whitespace, which separates the fields of TREC run and qrels "
            "files (replace it, e.g. by '_')"
        )
    return doc_id
