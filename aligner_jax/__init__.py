"""ALIGNER multi-vector retrieval as sparse alignment, in JAX/Flax."""

__version__ = "0.1.0"
