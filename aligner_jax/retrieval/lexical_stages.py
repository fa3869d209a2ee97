"""Lexical first stages by name: ``bm25`` (bm25s, :mod:`aligner_jax.data.bm25`) and ``minicoil``
(BM25 with per-word meaning vectors, :mod:`aligner_jax.lexical.minicoil`).

Every stage is built from the corpus (``doc_ids``, texts) and answers
``search({qid: text}, k) -> {qid: {doc_id: score}}`` (the BEIR interchange), so evaluation,
reranking and hybrid fusion treat them alike. A new stage plugs in with :func:`register`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import gin

from aligner_jax.common import checks
from aligner_jax.common.errors import ConfigError
from aligner_jax.data import bm25
from aligner_jax.lexical import meaning
from aligner_jax.lexical import minicoil as minicoil_lib


class LexicalIndex(Protocol):
    def search(self, queries: Mapping[str, str], k: int) -> dict[str, dict[str, float]]: ...


@gin.configurable
@dataclasses.dataclass(frozen=True)
class LexicalConfig:
    """Which lexical first stage and its settings (bind in gin, e.g. ``LexicalConfig.kind``).

    Attributes:
      kind: a registered stage: ``bm25`` or ``minicoil``.
      k1, b: BM25's term-frequency saturation and length normalisation (``bm25``; the project's
        baseline, ``benchmarks/bm25_baseline.py``, uses 1.5 and 0.75).
      minicoil_models: a saved miniCOIL meaning-model folder (``minicoil``; None: fit the meaning
        models on the corpus being indexed, which needs no labels).
    """

    kind: str = "bm25"
    k1: float = 1.5
    b: float = 0.75
    minicoil_models: str | None = None

    def __post_init__(self):
        name = type(self).__name__
        checks.choice(f"{name}.kind", self.kind, tuple(STAGES))
        checks.number(f"{name}.k1", self.k1, low=0.0)
        checks.number(f"{name}.b", self.b, 0.0, 1.0)
        if self.minicoil_models is not None and self.kind != "minicoil":
            raise ConfigError(
                f"{name}.minicoil_models is read by kind='minicoil' only; with "
                f"kind={self.kind!r} it would be ignored: drop it, or bind "
                f"{name}.kind = 'minicoil'"
            )


@dataclasses.dataclass(frozen=True)
class Stage:
    """A lexical first stage: ``build(doc_ids, texts, encoder, config) -> LexicalIndex``;
    ``needs_encoder``: whether it reads the neural encoder's token vectors."""

    build: Callable[..., LexicalIndex]
    needs_encoder: bool


STAGES: dict[str, Stage] = {}


def register(name: str, needs_encoder: bool = False):
    """Registers ``build(doc_ids, texts, encoder, config)`` as the lexical stage ``name``."""

    def wrap(build):
        STAGES[name] = Stage(build, needs_encoder)
        return build

    return wrap


@register("bm25")
def _build_bm25(doc_ids: Sequence[str], texts: Sequence[str], encoder, config: LexicalConfig):
    return bm25.BM25Index.build(doc_ids, texts, k1=config.k1, b=config.b)


@register("minicoil", needs_encoder=True)
def _build_minicoil(doc_ids: Sequence[str], texts: Sequence[str], encoder, config: LexicalConfig):
    models = config.minicoil_models  # a file, or a saved miniCOIL index's folder
    if models is not None:
        models = str(meaning.models_file(models, "--gin.LexicalConfig.minicoil_models"))
    return minicoil_lib.MiniCoilIndex.build(
        list(doc_ids),
        list(texts),
        encoder,
        config=minicoil_lib.MiniCoilConfig(),
        models_path=models,
    )


def recorded_settings(config: LexicalConfig) -> dict:
    """The settings the configured stage searches with, for ``metrics.json``: BM25's ``k1`` and
    ``b``; miniCOIL's own ``MiniCoilConfig`` (its BM25 part has its own ``k1`` and ``b``:
    ``LexicalConfig.k1`` / ``b`` do not apply to it)."""
    if config.kind == "minicoil":
        used = dataclasses.asdict(minicoil_lib.MiniCoilConfig())
        return {"kind": config.kind, "minicoil_models": config.minicoil_models, "minicoil": used}
    return dataclasses.asdict(config)


def needs_encoder(config: LexicalConfig) -> bool:
    return STAGES[config.kind].needs_encoder


def build(
    config: LexicalConfig, doc_ids: Sequence[str], texts: Sequence[str], encoder=None
) -> LexicalIndex:
    """The configured lexical stage over the corpus (``encoder``: for stages that need one)."""
    if needs_encoder(config) and encoder is None:
        raise ValueError(f"the lexical stage {config.kind!r} needs an encoder")
    return STAGES[config.kind].build(doc_ids, texts, encoder, config)


def search_timed(
    index: LexicalIndex, queries: Mapping[str, str], k: int
) -> tuple[dict[str, dict[str, float]], list[float]]:
    """The stage's top ``k`` per query, one query at a time, and each query's latency (ms)."""
    results, ms = {}, []
    for qid, text in queries.items():
        t0 = time.perf_counter()
        results[qid] = index.search({qid: text}, k)[qid]
        ms.append(1000.0 * (time.perf_counter() - t0))
    return results, ms
