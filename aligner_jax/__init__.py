"""ALIGNER multi-vector retrieval as sparse alignment, in JAX/Flax.

The package follows the pipeline, one stage per subpackage (each imports only earlier ones):
``common`` (errors, atomic files, the binaries' gin plumbing) → ``core`` (the paper's math: Eq. 1–5,
XTR, pruning, FLOPs) → ``data`` (BEIR, BM25, corpus streams) and ``models`` (Flax BERT, T5,
the ALIGNER encoder) → ``weights`` (pretrained and trained parameters) → ``encoding`` (tokenizer,
``Encoder``) → ``tasks`` (seqio) → ``training`` and ``indexing`` → ``retrieval`` → ``evaluation``.
The top-level modules are the binaries: ``python -m aligner_jax.VERB`` is ``aligner-VERB``
(``evaluate``: ``aligner-eval``).

Python use (the names below are imported lazily: ``import aligner_jax`` stays light)::

    import aligner_jax
    from aligner_jax.common import cli
    cli.parse_gin(["models/minilm_identity.gin"])        # gin/ is on its search path
    bundle = aligner_jax.load_encoder()                  # the bundled all-MiniLM-L6-v2
    encoder = aligner_jax.Encoder(bundle)
    store = aligner_jax.TokenStore(".../index")          # written by aligner-index / aligner-eval
    index = aligner_jax.Index.create("/tmp/idx")         # from Python: add / delete / searcher
    index.add([{"id": "d1", "text": "...", "metadata": {"year": 2020}}])
    hits = index.searcher().search("...", k=10, filter={"year": {"gte": 2015}})  # [Hit]
    report = aligner_jax.evaluate_beir(dataset_dir=".../beir/scifact", output_dir="/tmp/out")
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

__version__ = "0.1.0"

#: What a binary says when Ctrl-C comes before its job starts (imports, flag parsing).
INTERRUPTED_BEFORE_START = "before the job started; nothing was written"


def program_name() -> str:
    """The running binary's name: ``aligner-index`` for ``aligner-index`` and for
    ``python -m aligner_jax.index``."""
    base = os.path.basename(sys.argv[0] if sys.argv else "").removesuffix(".py")
    return base if base.startswith("aligner-") else f"aligner-{base}"


def _exit_before_start(signum, frame) -> None:
    """SIGINT while a binary imports its modules: one line and exit 130, no traceback (nothing
    has been written yet; ``cli.run`` puts Python's handler back before parsing the flags)."""
    os.write(2, f"{program_name()}: interrupted: {INTERRUPTED_BEFORE_START}\n".encode())
    os._exit(130)


def _starting_a_binary() -> bool:
    """Whether this import starts one of the binaries: ``python -m aligner_jax.VERB`` (runpy
    imports the package while ``sys.argv[0]`` is still ``-m``) or an ``aligner-VERB`` script.
    ``import aligner_jax`` anywhere else changes nothing."""
    argv0 = sys.argv[0] if sys.argv else ""
    if argv0 != "-m":
        return os.path.basename(argv0).startswith("aligner-")
    argv = getattr(sys, "orig_argv", [])
    module = next((argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "-m"), "")
    return module.startswith("aligner_jax.") and module.count(".") == 1


if _starting_a_binary() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _exit_before_start)

# After each BLAS call NumPy's OpenBLAS keeps its worker threads spinning for 2^28 cycles
# (~0.1 s): a search then holds a core while XLA encodes the next query on the same cores
# (SciFact, 2 threads: encoding p50 13.4 ms after a search, 8.9 ms with workers that sleep at
# once; benchmarks/results/README.md, stop 44), and the search's own parallel passes lose their
# cores too (measured in ``common/blas.py``'s docstring). OpenBLAS reads it when it loads: the
# binaries and code that imports this package before NumPy get it; a value already set is kept;
# ``Searcher.load`` warns when NumPy came first, and a query then holds the library at one
# thread while it runs (``common/blas.py``).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

# ``evaluate`` and ``train`` are the binaries (``python -m aligner_jax.evaluate``): their library
# functions are exported as ``evaluate_beir`` and ``train_model`` so that no name means two things.
_PUBLIC = {
    "load_encoder": ("aligner_jax.encoding.loading", "load_encoder"),
    "Encoder": ("aligner_jax.encoding.encoder", "Encoder"),
    "TokenStore": ("aligner_jax.indexing.token_store", "TokenStore"),
    "Searcher": ("aligner_jax.retrieval.searcher", "Searcher"),
    "Hit": ("aligner_jax.retrieval.searcher", "Hit"),
    "Index": ("aligner_jax.retrieval.index_api", "Index"),
    "evaluate_beir": ("aligner_jax.evaluation.beir_eval", "evaluate"),
    "train_model": ("aligner_jax.training.trainer", "train"),
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        module, attribute = _PUBLIC[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'aligner_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
