"""Triplets for miniCOIL's meaning models, mined from a teacher's sentence similarities.

For one word, take sentences that contain it and the teacher's sentence embeddings of them
(cosine distance ``d = 1 − cos``). The article forms triplets whose teacher margin is at least
``min_margin`` (0.1): of three random sentences x, y, z, the anchor is the one whose distances to
the other two differ most, ``|d(a, p) − d(a, n)|``; the closer of the two is the positive and that
difference is the triplet's margin in the loss (``meaning.word_triplet_terms``). Each triplet
member then uses the word's vector either from the full sentence or from its augmentation (a
short snippet around the word, ``words.snippet_span``), drawn at random, with the sentence's
teacher similarity reused for the snippet, as the article does.

Sentences are split per word into training and validation sets before mining, so validation
triplets never share a sentence with training ones.
"""

from __future__ import annotations

import numpy as np


def mine_word_triplets(
    sim: np.ndarray, num: int, min_margin: float, rng: np.random.Generator, draws: int = 8
) -> tuple[np.ndarray, np.ndarray]:
    """Up to ``num`` triplets ``[t, 3]`` (anchor, positive, negative) and their margins ``[t]``.

    ``sim [S, S]`` is the teacher's cosine similarity of the word's sentences (S ≥ 3). Draws
    ``draws × num`` random triples (repeats dropped), keeps those whose margin exceeds ``min_margin``
    (the first ``num``, duplicates removed).
    """
    size = sim.shape[0]
    if size < 3 or num < 1:
        return np.zeros((0, 3), np.int64), np.zeros((0,), np.float32)
    dist = 1.0 - sim
    x, y, z = rng.integers(0, size, (3, draws * num))
    distinct = (x != y) & (x != z) & (y != z)
    x, y, z = x[distinct], y[distinct], z[distinct]
    dxy, dxz, dyz = dist[x, y], dist[x, z], dist[y, z]
    gaps = np.stack([np.abs(dxy - dxz), np.abs(dxy - dyz), np.abs(dxz - dyz)], axis=1)
    anchor_of = np.argmax(gaps, axis=1)
    margin = gaps[np.arange(len(x)), anchor_of]
    # (anchor, other1, other2, d(anchor, other1), d(anchor, other2)) per anchor choice
    anchor = np.choose(anchor_of, [x, y, z])
    o1 = np.choose(anchor_of, [y, x, x])
    o2 = np.choose(anchor_of, [z, z, y])
    d1 = np.choose(anchor_of, [dxy, dxy, dxz])
    d2 = np.choose(anchor_of, [dxz, dyz, dyz])
    positive = np.where(d1 < d2, o1, o2)
    negative = np.where(d1 < d2, o2, o1)
    keep = margin > min_margin
    triplets = np.stack([anchor, positive, negative], axis=1)[keep]
    margins = margin[keep].astype(np.float32)
    _, first = np.unique(triplets, axis=0, return_index=True)
    first = np.sort(first)[:num]
    return triplets[first], margins[first]


def split_sentences(
    count: int, validation_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """A random split of ``count`` sentence slots into (training, validation) positions; the
    validation set gets ``round(fraction × count)`` slots, or none when fewer than 3 would be
    left to it (no triplet fits in 2 sentences)."""
    order = rng.permutation(count)
    n_val = int(round(validation_fraction * count))
    if n_val < 3:
        n_val = 0
    return np.sort(order[n_val:]), np.sort(order[:n_val])


def build_batch(
    sims: list[np.ndarray],
    slots: list[np.ndarray],
    has_snippet: np.ndarray,
    num: int,
    min_margin: float,
    rng: np.random.Generator,
    width: int,
) -> dict:
    """Padded triplet arrays for every word (``meaning.triplet_loss``'s batch, without examples).

    Args:
      sims: per word, ``[S_w, S_w]`` teacher similarities of its sentence slots.
      slots: per word, the slot positions (rows of ``sims``) to mine among (train or validation).
      has_snippet: ``[V, width // 2]`` bool, whether slot j of word v has an augmented example;
        the example rows of word v are ``j`` (the sentence) and ``width // 2 + j`` (its snippet).
      num: triplets per word.
      min_margin: the article's minimum teacher margin.
      width: example rows per word.

    Returns ``triplets [V, num, 3]`` (example rows), ``margins [V, num]``, ``mask [V, num]``.
    """
    half = width // 2
    triplets = np.zeros((len(sims), num, 3), np.int32)
    margins = np.zeros((len(sims), num), np.float32)
    mask = np.zeros((len(sims), num), bool)
    for v, (sim, chosen) in enumerate(zip(sims, slots, strict=True)):
        t, m = mine_word_triplets(sim[np.ix_(chosen, chosen)], num, min_margin, rng)
        if not len(t):
            continue
        rows = chosen[t]  # slot positions
        use_snippet = (rng.random(rows.shape) < 0.5) & has_snippet[v, rows]
        triplets[v, : len(t)] = rows + half * use_snippet
        margins[v, : len(t)] = m
        mask[v, : len(t)] = True
    return {"triplets": triplets, "margins": margins, "mask": mask}
