"""The one rule for a document id, shared by every way documents come in (a BEIR corpus, the
Python ``Index``, the token-store writer) and every way they are named again (delete, subset).

An id is a non-empty string or an integer (JSON's two id types; not a bool), stored as the
string with surrounding whitespace removed: ``7``, ``"7"`` and ``" 7 "`` name one document.
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
    return doc_id
