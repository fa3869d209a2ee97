"""Word analysis of miniCOIL: BM25's words, with where they sit in the text and in word-pieces.

One rule for both lexical scorers: a word is what the BM25 baseline (``data.bm25``) indexes —
bm25s's analysis: lower-case, split on bm25s's token pattern (``\\b\\w\\w+\\b``), drop bm25s's
English stop-words, stem with PyStemmer (Snowball English). The pattern and the stop-word list are
read from bm25s itself (no copy here), and ``tests/test_lexical.py`` checks that the words of
``analyze`` are exactly ``BM25Index.tokenize``'s. What this module adds is *where* each word is:
its character span, so that the encoder's word-pieces covering it can be averaged into the
word's contextual vector (miniCOIL works on words, not on COIL's word-pieces), and the sentence
it belongs to (the article trains meaning models on sentences).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Sequence

import bm25s
import numpy as np
import Stemmer
from bm25s import tokenization as bm25s_tokenization

# bm25s's own defaults, read once (the one copy of the rule lives in bm25s).
TOKEN_PATTERN = re.compile(inspect.signature(bm25s.tokenize).parameters["token_pattern"].default)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclasses.dataclass(frozen=True)
class Word:
    """One analysed word occurrence: its stem and its character span ``text[start:end]``."""

    stem: str
    start: int
    end: int


class Analyzer:
    """BM25's word analysis (see the module docstring) with character spans."""

    def __init__(self, stemmer_language: str | None = "english", stopwords: str | None = "en"):
        self.stemmer_language = stemmer_language
        self.stopwords = stopwords
        self._stemmer = Stemmer.Stemmer(stemmer_language) if stemmer_language else None
        self._stop = frozenset(bm25s_tokenization._infer_stopwords(stopwords or []))
        self._stems: dict[str, str] = {}

    def _stem(self, token: str) -> str:
        stem = self._stems.get(token)
        if stem is None:
            stem = self._stemmer.stemWord(token) if self._stemmer else token
            self._stems[token] = stem
        return stem

    def analyze(self, text: str) -> list[Word]:
        """The words of ``text`` in order, with spans into ``text`` (stop-words dropped)."""
        lowered = text.lower()
        back = None
        if len(lowered) != len(text):  # a few characters lower-case to two (e.g. 'İ')
            back = np.repeat(np.arange(len(text) + 1), [len(c.lower()) for c in text] + [1])
        words = []
        for match in TOKEN_PATTERN.finditer(lowered):
            token = match.group()
            if token in self._stop:
                continue
            start, end = match.span()
            if back is not None:
                start, end = int(back[start]), int(back[end - 1]) + 1
            words.append(Word(self._stem(token), start, end))
        return words

    def stems(self, text: str) -> list[str]:
        return [w.stem for w in self.analyze(text)]


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Sentences of ``text`` as ``(start, end)`` spans: cut after ``.``, ``!`` or ``?`` followed
    by white space. The cuts fall on white space, so no word crosses a sentence boundary and the
    words of a text are exactly the words of its sentences, in order."""
    spans, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        if match.start() > start:
            spans.append((start, match.start()))
        start = match.end()
    if start < len(text) and text[start:].strip():
        spans.append((start, len(text)))
    return spans


def pieces_of_words(offsets: np.ndarray, words: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """For each word span ``(start, end)``, the positions of the word-pieces that overlap it.

    ``offsets [n, 2]`` are the pieces' character spans (a tokenizer's offsets, in order). A word
    that no piece covers (e.g. characters the tokenizer drops) gets an empty array.
    """
    starts, ends = offsets[:, 0], offsets[:, 1]
    out = []
    for start, end in words:
        first = int(np.searchsorted(ends, start, side="right"))
        last = int(np.searchsorted(starts, end, side="left"))
        out.append(np.arange(first, max(first, last), dtype=np.int64))
    return out


def snippet_span(
    text: str,
    word: tuple[int, int],
    rng: np.random.Generator,
    min_words: int = 4,
    max_words: int = 6,
) -> tuple[int, int]:
    """The article's augmentation: a short window of ``text`` around one word occurrence.

    The window holds the white-space token of the word and 1–3 tokens on each side (drawn from
    ``rng``), widened to ``min_words`` and cut to ``max_words`` tokens where the text allows.
    Returns its character span (a substring of ``text``, so the word keeps its offsets shifted by
    the window's start).
    """
    tokens = [m.span() for m in re.finditer(r"\S+", text)]
    target = next(i for i, (s, e) in enumerate(tokens) if s <= word[0] < e)
    first = max(0, target - int(rng.integers(1, 4)))
    last = min(len(tokens), target + int(rng.integers(1, 4)) + 1)
    while last - first < min_words and (last < len(tokens) or first > 0):
        if last < len(tokens):
            last += 1
        else:
            first -= 1
    if last - first > max_words:
        if target - first >= max_words // 2:
            first = last - max_words
        else:
            last = first + max_words
    first, last = min(first, target), max(last, target + 1)
    return tokens[first][0], tokens[last - 1][1]
