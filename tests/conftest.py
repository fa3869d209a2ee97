"""Scaffolding shared by every test: a clean gin config and one way to run a binary.

Constants and data builders shared across files (tiny BEIR folders, logical axis names) live in
``fixtures.py``; pytest fixtures live here.
"""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import tempfile

import gin
import pytest
from fixtures import CHILD_CACHE, TEST_XLA_FLAGS, run_module


def pytest_configure(config):
    """A shell starts a background job (``make test &``, nohup) with SIGINT ignored, and its
    children inherit that: the binaries a test interrupts would never see Ctrl-C. Python's own
    handler, set here, is reset to the default in each child at exec, as from a terminal."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    flags = os.environ.get("XLA_FLAGS", "")
    if TEST_XLA_FLAGS not in flags:  # read when JAX first starts its backend, in each process
        os.environ["XLA_FLAGS"] = f"{flags} {TEST_XLA_FLAGS}".strip()
    if CHILD_CACHE not in os.environ and not hasattr(config, "workerinput"):
        # One persistent compilation cache for every binary the tests start (fixtures.python_env;
        # the xdist workers inherit the variable): the tiny models' encoders and train steps are
        # compiled once, not in each of ~100 child processes.
        config.jax_cache = tempfile.mkdtemp(prefix="aligner_jax_tests_jax_cache_")
        os.environ[CHILD_CACHE] = config.jax_cache


def pytest_unconfigure(config):
    if getattr(config, "jax_cache", None):
        shutil.rmtree(config.jax_cache, ignore_errors=True)


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
