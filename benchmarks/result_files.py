"""Writing a benchmark's results: ``<name>.json`` (the figures), ``<name>.md`` (their table) and
``<name>.png`` (their plot), each atomically, into one folder (``benchmarks/results`` by
default). A sibling module of the benchmark scripts, imported by them (not a benchmark)."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from aligner_jax.common import fileio  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def machine(note: str = "") -> str:
    """The machine a result was measured on, as every result names it."""
    return f"{platform.node()} ({os.cpu_count()} CPU cores{note})"


def save(
    results: dict,
    name: str,
    markdown: Callable[[dict], str],
    plot: Callable[[dict, Path], None] | None = None,
    folder: str | Path = RESULTS,
) -> Path:
    """Writes ``folder/name.json``, ``.md`` (``markdown(results)``, also printed) and, with
    ``plot``, ``.png``; returns the JSON's path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fileio.atomic_write_json(folder / f"{name}.json", results)
    table = markdown(results)
    fileio.atomic_write_text(folder / f"{name}.md", table)
    if plot is not None:
        plot(results, folder / f"{name}.png")
    print(table)
    return folder / f"{name}.json"
