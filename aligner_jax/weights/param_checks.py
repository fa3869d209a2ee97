"""Checking that a parameter tree (a checkpoint, imported weights) fits the configured model."""

from __future__ import annotations

import jax
import numpy as np

from aligner_jax.common.errors import CheckpointError


def check_param_tree(expected, given, source: str) -> None:
    """Raises ``CheckpointError`` naming ``source`` when paths or shapes differ from ``expected``."""
    e_paths = {
        jax.tree_util.keystr(p): v.shape for p, v in jax.tree_util.tree_leaves_with_path(expected)
    }
    g_paths = {
        jax.tree_util.keystr(p): np.shape(v) for p, v in jax.tree_util.tree_leaves_with_path(given)
    }
    missing = sorted(set(e_paths) - set(g_paths))
    extra = sorted(set(g_paths) - set(e_paths))
    wrong = sorted(k for k in set(e_paths) & set(g_paths) if tuple(e_paths[k]) != tuple(g_paths[k]))
    if missing or extra or wrong:
        raise CheckpointError(
            f"{source}: parameters do not fit the configured model: missing {missing[:5]}, "
            f"unexpected {extra[:5]}, wrong shapes "
            f"{[(k, g_paths[k], e_paths[k]) for k in wrong[:5]]}. Check the gin model file."
        )
