"""Range and type checks of configuration fields, with messages that name the flag.

Every configurable dataclass validates its fields at construction (``__post_init__``) with these
helpers, so a bad ``--gin.SearchConfig.top_k=0`` fails before any work starts with one line
``--gin.SearchConfig.top_k=0: must be >= 1`` (a ``ConfigError``) instead of an empty run or a
``TypeError`` deep inside a computation. ``name`` is the gin name, ``Class.field``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import gin

from aligner_jax.common.errors import ConfigError, MissingPathError

#: What usually binds a parameter a gin file must bind: said in the one-line error.
BINDING_HINTS = {
    "load_encoder.config": "a model file, e.g. --gin_file=models/minilm.gin",
    "train.model": "a run file, e.g. --gin_file=runs/scifact_minilm.gin",
    "train.model_dir": "a run file, e.g. --gin_file=runs/scifact_minilm.gin",
    "train.num_train_steps": "a run file, e.g. --gin_file=runs/scifact_minilm.gin",
}


def required(name: str, value) -> None:
    """A parameter a gin file must bind (its default ``None``: unbound), e.g. ``train.model``:
    unbound, a ``ConfigError`` ``gin: train.model is not set: add a run file, e.g. ...,
    or --gin.train.model=VALUE``. Bound to a macro that a run file declares
    ``%gin.REQUIRED`` and nobody set (gin then passes its ``REQUIRED`` marker), the error
    names the macro: ``gin: TRAIN_STEPS (warmup_linear_decay.total_steps) is not set: add
    --gin.TRAIN_STEPS=VALUE``."""
    if value is None:
        hint = BINDING_HINTS.get(name, "a gin file that binds it")
        raise ConfigError(f"gin: {name} is not set: add {hint}, or --gin.{name}=VALUE")
    if value is gin.REQUIRED:
        macro = _macro_bound_to(name)
        if macro is None:
            raise ConfigError(f"gin: {name} is not set: add --gin.{name}=VALUE")
        raise ConfigError(f"gin: {macro} ({name}) is not set: add --gin.{macro}=VALUE")


_UNBOUND = object()


def bound_value(name: str, default=None):
    """The value gin binds to ``name`` (e.g. ``load_encoder.config``); ``default`` when it is
    unbound or its configurable is not registered."""
    try:
        return gin.query_parameter(name)
    except ValueError:
        return default


def is_bound(name: str) -> bool:
    """Whether gin binds ``name`` (to any value, None included)."""
    return bound_value(name, _UNBOUND) is not _UNBOUND


def _macro_bound_to(name: str) -> str | None:
    """``TRAIN_STEPS`` when gin binds ``name`` to ``%TRAIN_STEPS``, else None."""
    if not is_bound(name):
        return None
    bound = str(bound_value(name))
    macro = bound.removeprefix("%")
    return macro if bound.startswith("%") and macro != "gin.REQUIRED" else None


def flag(name: str, value) -> str:
    """The command-line spelling of a binding: ``--gin.SearchConfig.top_k=0``; of one a gin file
    binds to a macro, the macro's: ``--gin.TRAIN_STEPS=0 (warmup_linear_decay.total_steps)``."""
    macro = _macro_bound_to(name)
    return f"--gin.{macro}={value!r} ({name})" if macro else f"--gin.{name}={value!r}"


def integer(name: str, value, minimum: int | None = None, allow_none: bool = False) -> None:
    """``value`` is an int (not a bool) ``>= minimum``, or None when ``allow_none``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        none = " or None" if allow_none else ""
        raise ConfigError(f"{flag(name, value)}: expected an integer{none}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{flag(name, value)}: must be >= {minimum}")


def number(
    name: str,
    value,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    allow_none: bool = False,
) -> None:
    """``value`` is a finite int or float in ``[low, high]`` (``(low, high]`` when ``low_open``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{flag(name, value)}: expected a finite number")
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        if high is None:
            raise ConfigError(f"{flag(name, value)}: must be {'>' if low_open else '>='} {low}")
        if low is None:
            raise ConfigError(f"{flag(name, value)}: must be <= {high}")
        raise ConfigError(
            f"{flag(name, value)}: must be in {'(' if low_open else '['}{low}, {high}]"
        )


def choice(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ConfigError(f"{flag(name, value)}: choose one of {list(choices)}")


def integers(name: str, values, minimum: int, increasing: bool = False) -> None:
    """A non-empty tuple/list of integers ``>= minimum`` (strictly increasing when asked)."""
    if isinstance(values, str) or not isinstance(values, Sequence) or not values:
        raise ConfigError(f"{flag(name, values)}: expected a non-empty tuple of integers")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(f"{flag(name, values)}: every entry must be an integer >= {minimum}")
    if increasing and list(values) != sorted(set(values)):
        raise ConfigError(f"{flag(name, values)}: entries must be strictly increasing")


def index_dir(index_dir: str) -> None:
    """Refuses an ``--index_dir`` that is no folder (missing, or a file) in one line
    (``aligner-search``, ``aligner-serve``)."""
    path = Path(index_dir)
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "no such folder"
        raise MissingPathError(
            f"--index_dir={index_dir}: {what}; give the folder of an index built by "
            "aligner-index --corpus=CORPUS.jsonl --index_dir=DIR"
        )
