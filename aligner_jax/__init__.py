"""ALIGNER multi-vector retrieval as sparse alignment, in JAX/Flax.

The package follows the pipeline, one stage per subpackage (each imports only earlier ones):
``common`` (errors, atomic files, the binaries' gin plumbing) → ``core`` (the paper's math: Eq. 1–5,
XTR, pruning, FLOPs) → ``data`` (BEIR, BM25, corpus streams) and ``models`` (Flax BERT, T5,
the ALIGNER encoder) → ``weights`` (pretrained and trained parameters) → ``encoding`` (tokenizer,
``Encoder``) → ``tasks`` (seqio) → ``training`` and ``indexing`` → ``retrieval`` → ``evaluation``.
The top-level modules are the binaries: ``python -m aligner_jax.VERB`` is ``aligner-VERB``.

Python use (the names below are imported lazily: ``import aligner_jax`` stays light)::

    import gin, aligner_jax
    gin.parse_config_file(".../gin/models/minilm_identity.gin")
    bundle = aligner_jax.load_encoder()                  # the bundled all-MiniLM-L6-v2
    encoder = aligner_jax.Encoder(bundle)
    store = aligner_jax.TokenStore(".../index")          # written by aligner-index / aligner-eval
    report = aligner_jax.evaluate_beir(dataset_dir=".../beir/scifact", output_dir="/tmp/out")
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# ``evaluate`` and ``train`` are the binaries (``python -m aligner_jax.evaluate``): their library
# functions are exported as ``evaluate_beir`` and ``train_model`` so that no name means two things.
_PUBLIC = {
    "load_encoder": ("aligner_jax.encoding.loading", "load_encoder"),
    "Encoder": ("aligner_jax.encoding.encoder", "Encoder"),
    "TokenStore": ("aligner_jax.indexing.token_store", "TokenStore"),
    "Searcher": ("aligner_jax.retrieval.searcher", "Searcher"),
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
