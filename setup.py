"""aligner_jax: ALIGNER multi-vector retrieval (training, indexing, BEIR evaluation) on JAX/Flax."""

import setuptools

setuptools.setup(
    name="aligner_jax",
    version="0.1.0",
    description="ALIGNER multi-vector retrieval as sparse alignment: JAX/Flax trainer, ScaNN token index, BEIR evaluation",
    # The design card keeps ``tasks/`` and ``gin/`` at the repository's top level; installed, they
    # live inside our own package (``aligner_jax.tasks``, ``aligner_jax/gin``), never as a generic
    # top-level ``tasks`` package or inside another distribution's folder.
    packages=[
        *setuptools.find_packages(include=["aligner_jax", "aligner_jax.*"]),
        "aligner_jax.tasks",
        "aligner_jax.gin",
    ],
    package_dir={"aligner_jax.tasks": "tasks", "aligner_jax.gin": "gin"},
    package_data={"aligner_jax.gin": ["*/*.gin"]},
    license="Apache-2.0",
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.10,<0.11",
        "flax>=0.12,<0.13",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12",
        "clu>=0.0.12",
        "chex",
        "gin-config>=0.5",
        "absl-py>=2.0",
        "seqio>=0.0.20",
        "tensorflow==2.20.*",
        "tensorflow-text==2.20.*",
        "tensorflow-datasets",
        "scann==1.4.*",
        "pytrec-eval-terrier>=0.5.10",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "bm25s>=0.2",
        "PyStemmer",
        "numpy>=2.0",
        "scipy>=1.10",
        "numba>=0.61",
        "matplotlib",
        "tqdm",
        "psutil",
        "threadpoolctl>=3",
        "qdrant-edge-py==0.9.*",
    ],
    extras_require={
        "tpu": ["jax[tpu]>=0.10,<0.11"],
        "cuda": ["jax[cuda12]>=0.10,<0.11"],
        # aligner-publish --qdrant_url: a Qdrant server or cluster.
        "qdrant": ["qdrant-client>=1.20,<2"],
        "test": [
            "pytest>=8",
            "pytest-xdist",
            "hypothesis>=6",
            "ruff",
            "torch",
            "sentence-transformers",
            "qdrant-client>=1.20,<2",
        ],
    },
    entry_points={
        "console_scripts": [
            "aligner-eval=aligner_jax.evaluate:console_entry",
            "aligner-train=aligner_jax.train:console_entry",
            "aligner-index=aligner_jax.index:console_entry",
            "aligner-search=aligner_jax.search:console_entry",
            "aligner-explain=aligner_jax.explain:console_entry",
            "aligner-sweep=aligner_jax.sweep:console_entry",
            "aligner-export=aligner_jax.export:console_entry",
            "aligner-publish=aligner_jax.publish:console_entry",
            "aligner-serve=aligner_jax.serve:console_entry",
            "aligner-beir=aligner_jax.beir:console_entry",
        ]
    },
)
