"""Validation of the gin bindings that point the registered tasks at their data.

Errors are user errors (``ConfigError``): the binaries print them in one
line.

Every message names the binding to set and shows the flag that sets it, e.g.
``--gin.beir_train_source.dataset_dir="'/data/beir/scifact'"``.
"""

from __future__ import annotations

import os
from pathlib import Path

from aligner_jax.common.errors import ConfigError


def flag(binding: str, example: str) -> str:
    """The command-line form of a string binding: ``--gin.X.y="'value'"``."""
    return f"--gin.{binding}=\"'{example}'\""


def require_directory(binding: str, value: str | os.PathLike | None, example: str) -> Path:
    """The folder named by a binding; a clear error when it is unset or not a folder."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ConfigError(
            f"The gin binding {binding} is not set; point it at the data folder, e.g. "
            f"{flag(binding, example)} (or `{binding} = '{example}'` in a gin file)."
        )
    path = Path(os.path.expanduser(os.fspath(value)))
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        raise ConfigError(f"{binding}={os.fspath(value)!r}: {path} {what}; fix the binding.")
    return path.resolve()


def require_file(binding: str, value: str | os.PathLike | None, example: str) -> Path:
    """The file named by a binding; a clear error when it is unset or missing."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ConfigError(
            f"The gin binding {binding} is not set; point it at the file, e.g. "
            f"{flag(binding, example)}."
        )
    path = Path(os.path.expanduser(os.fspath(value)))
    if not path.is_file():
        what = "is a folder, not a file" if path.exists() else "does not exist"
        raise ConfigError(f"{binding}={os.fspath(value)!r}: {path} {what}; fix the binding.")
    return path.resolve()


def check_int(binding: str, value, minimum: int, allow_none: bool = False) -> int | None:
    """An integer binding ``≥ minimum`` (or None when allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = " or None" if allow_none else ""
        raise ConfigError(f"{binding}={value!r}: expected an integer ≥ {minimum}{none}.")
    return int(value)


def check_choice(binding: str, value, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{binding}={value!r}: expected one of {list(choices)}.")
    return value
