#!/usr/bin/env bash
# Create the peer-engine virtualenv (FastPlaid + XTR-WARP + PyLate) outside the repo.
#
#   bash benchmarks/peers/setup_peer_venv.sh [/work/peer-venv]
#
# Both peers ship compiled Rust extensions linked against libtorch 2.11, and
# their wheels pin it (fast-plaid: torch==2.11.0; xtr-warp-rs: torch>=2.11,<2.12).
# No CPU-only torch 2.11 wheel is reachable here (the PyTorch CPU wheel index
# does not resolve; the local CPU wheel is torch 2.13.0), so PyPI's
# torch 2.11.0 (+cu130) is installed with its CUDA packages (~5 GB venv). It
# runs on the CPU. The versions installed when this was written are pinned
# in peer-venv-freeze.txt.
#
# PyLate (pylate_check.py: does pylate.models.ColBERT load an aligner-export
# folder as it is?) comes from peer-venv-pylate.txt with --no-deps: pylate
# 1.6.0 pins fast-plaid<=1.4.6.2110, and the resolver would downgrade the
# FastPlaid the search benchmarks measure; ColBERT models do not use it.
set -euo pipefail
VENV="${1:-/work/peer-venv}"
HERE="$(cd "$(dirname "$0")" && pwd)"
python3.11 -m venv "$VENV"
"$VENV/bin/pip" install -r "$HERE/peer-venv-freeze.txt"
"$VENV/bin/pip" install --no-deps -r "$HERE/peer-venv-pylate.txt"
"$VENV/bin/python" -c "import torch, fast_plaid, xtr_warp, pylate; print('torch', torch.__version__, 'pylate', pylate.__version__, 'cuda available:', torch.cuda.is_available())"
