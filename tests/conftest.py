"""Scaffolding shared by every test: a clean gin config and one way to run a binary.

Constants and data builders shared across files (tiny BEIR folders, logical axis names) live in
``fixtures.py``; pytest fixtures live here.
"""

from __future__ import annotations

import importlib
import os
import signal

import gin
import pytest
from fixtures import run_module


def pytest_configure(config):
    """A shell starts a background job (``make test &``, nohup) with SIGINT ignored, and its
    children inherit that: the binaries a test interrupts would never see Ctrl-C. Python's own
    handler, set here, is reset to the default in each child at exec, as from a terminal."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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
