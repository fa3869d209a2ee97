"""Checking that a parameter tree (a checkpoint, imported weights) fits the configured model."""

from __future__ import annotations

import jax
import numpy as np

from aligner_jax.common.errors import CheckpointError


def _name(path) -> str:
    """A tree path as dotted names and indices: the same for a NamedTuple field (an attribute in
    a live tree, e.g. an optimizer state) and the dict key orbax's metadata gives it."""
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def shape_differences(expected, given) -> tuple[list[str], list[str], list[tuple]]:
    """(missing, unexpected, wrong) leaves of ``given`` against ``expected`` by dotted path,
    each sorted; wrong: (path, given shape, expected shape)."""
    e_paths = {
        _name(p): tuple(np.shape(v)) for p, v in jax.tree_util.tree_leaves_with_path(expected)
    }
    g_paths = {_name(p): tuple(np.shape(v)) for p, v in jax.tree_util.tree_leaves_with_path(given)}
    missing = sorted(set(e_paths) - set(g_paths))
    extra = sorted(set(g_paths) - set(e_paths))
    wrong = [(k, g_paths[k], e_paths[k]) for k in sorted(set(e_paths) & set(g_paths))
             if e_paths[k] != g_paths[k]]  # fmt: skip
    return missing, extra, wrong


def check_param_tree(expected, given, source: str) -> None:
    """Raises ``CheckpointError`` naming ``source`` when paths or shapes differ from ``expected``."""
    missing, extra, wrong = shape_differences(expected, given)
    if missing or extra or wrong:
        raise CheckpointError(
            f"{source}: parameters do not fit the configured model: missing {missing[:5]}, "
            f"unexpected {extra[:5]}, wrong shapes {wrong[:5]}. Check the gin model file."
        )
