"""Salience pruning (§3.2): keep the top ⌈β·n⌉ tokens of a text by salience.

One rule for queries (β^q, before token retrieval), documents (β^d, in the token index or the
store) and explanations (Table 4's highlighted tokens): a text of ``n > 0`` tokens keeps
``max(1, ⌈β·n⌉)`` of them (all of them when β ≥ 1), the most salient first; ties keep the
earlier token. Positions are returned in text order.

Documents also lose their tokens of zero salience when stored (``salient``): in Eq. 2,
``A = Ã ⊙ (u^q ⊗ u^d)`` gives such a token no weight, so it adds nothing to a score; kept, it
can only win a query token's top-1 alignment and silence that query token. That departs from
the paper, whose refinement scores every token (§3.2; ``IndexingConfig.drop_zero_salience``).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from aligner_jax.core import salience as salience_lib

# How a β keeps tokens, by whether the model has saliences (the rule below: the top by
# salience, ties to the earlier token, so without saliences the first tokens).
PRUNED_BY = {
    True: "keeps each text's top β of tokens by unary salience (§3.2)",
    False: "keeps each text's first ⌈β·n⌉ tokens (by position)",
}


def keep_count(n, beta: float):
    """How many of ``n`` tokens (int or int array) survive pruning at ratio ``beta``:
    ``max(1, ⌈β·n⌉)`` in exact integer arithmetic (``salience.ratio_count``'s reading of β: in
    floats 0.07 · 100 is 7.000000000000001, whose ceiling kept 8 of 100)."""
    n = np.asarray(n, dtype=np.int64)
    if beta >= 1.0:
        kept = n
    else:
        frac = salience_lib.ratio_fraction(float(beta), "beta") if beta > 0 else Fraction(0)
        ceil = -((-frac.numerator * n) // frac.denominator)
        kept = np.minimum(np.maximum(1, ceil), n)
    return int(kept) if kept.ndim == 0 else kept


def top_fraction_segments(salience: np.ndarray, offsets: np.ndarray, beta: float) -> np.ndarray:
    """Rows kept in every segment of a concatenation of texts, sorted (vectorised).

    ``salience [T]`` holds the tokens of the texts ``offsets[i]..offsets[i+1]`` (``offsets [N+1]``,
    rows counted from ``offsets[0]``); the result is in the same coordinates as ``offsets``.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    if beta >= 1.0:  # every row: the saliences are not read
        return np.arange(offsets[0], offsets[-1], dtype=np.int64)
    lengths = np.diff(offsets)
    salience = np.asarray(salience, dtype=np.float32)
    if len(salience) != offsets[-1] - offsets[0]:
        raise ValueError(
            f"salience has {len(salience)} rows, offsets span {offsets[-1] - offsets[0]}"
        )
    segment = np.repeat(np.arange(len(lengths)), lengths)
    position = np.arange(len(salience))
    order = np.lexsort((position, -salience, segment))  # by text, then salience desc, then position
    rank = position - (offsets[segment] - offsets[0])  # ``order`` keeps each text's rows together
    kept = order[rank < keep_count(lengths, beta)[segment]]
    return np.sort(kept) + offsets[0]


def top_fraction(salience: np.ndarray, beta: float) -> np.ndarray:
    """Positions of the top ``max(1, ⌈β·n⌉)`` tokens of one text by salience, in text order."""
    return top_fraction_segments(salience, np.array([0, len(salience)]), beta)


def salient(salience: np.ndarray) -> np.ndarray:
    """Positions of one text's tokens with salience above 0, in text order; a text with none
    keeps its first token (a document is never empty)."""
    kept = np.flatnonzero(np.asarray(salience) > 0)
    return kept if len(kept) or not len(salience) else np.zeros(1, np.int64)
