"""Scaffolding shared by every test: a clean gin config and one way to run a binary.

Constants and data builders shared across files (tiny BEIR folders, logical axis names) live in
``fixtures.py``; pytest fixtures live here.
"""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import tempfile


def _share_compilations() -> None:
    """One persistent JAX compilation cache for the whole run: this process, the xdist workers
    and every binary a test starts (they inherit the environment) load an executable another
    one compiled instead of compiling the same tiny models again (a killed-and-resumed training
    test: 80 → 48 s). A fresh directory per run, removed at its end; a cache the user set is
    kept. Compilation counts are unaffected (``aligner_jax.common.compilations``)."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return  # the user's own, or this run's (an xdist worker inherits the controller's)
    directory = tempfile.mkdtemp(prefix="aligner_jax_tests_xla_cache_")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    os.environ.update(
        JAX_COMPILATION_CACHE_DIR=directory,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        # A size bound turns on JAX's file lock: concurrent processes never read a half entry.
        JAX_COMPILATION_CACHE_MAX_SIZE=str(4 << 30),
    )


_share_compilations()  # before anything imports jax, which reads these once

import gin  # noqa: E402
import pytest  # noqa: E402
from fixtures import run_module  # noqa: E402


def importorskip(module: str):
    """``pytest.importorskip``, except where the environment variable CI is set: there a missing
    test dependency (requirements-dev.txt) fails the test instead of silently skipping it."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module)


@pytest.fixture(autouse=True)
def _clean_gin():
    """Every test starts and ends with an empty gin config (binaries parse their own)."""
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.fixture()
def run_binary():
    """``run_binary("evaluate", "--flag=...")`` runs ``python -m aligner_jax.evaluate``."""
    return lambda name, *args, **kw: run_module(f"aligner_jax.{name}", *args, **kw)
