#!/usr/bin/env bash
# Train on this machine's CPU (one process; all local devices). Optional: FAKE_DEVICES=8 to
# simulate an 8-device host (data x model sharding) with XLA's forced host platform devices.
#
#   launch/local_cpu.sh runs/scifact_minilm.gin /tmp/aligner_scifact [--gin.TRAIN_STEPS=600 ...]
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 RUN_GIN MODEL_DIR [extra flags...]" >&2
  exit 2
fi
run_gin=$1 model_dir=$2; shift 2
repo=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${FAKE_DEVICES:-}" ]; then
  if ! [[ $FAKE_DEVICES =~ ^[1-9][0-9]*$ ]]; then
    echo "$0: FAKE_DEVICES=$FAKE_DEVICES: expected a number of devices, e.g. FAKE_DEVICES=8" >&2
    exit 2
  fi
  export XLA_FLAGS="--xla_force_host_platform_device_count=${FAKE_DEVICES} ${XLA_FLAGS:-}"
fi
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
# MODEL_DIR as a gin (Python) string literal, whatever quotes the path holds
model_dir_literal=$("$repo/.venv/bin/python" -c 'import sys; print(repr(sys.argv[1]))' "$model_dir")
exec "$repo/.venv/bin/python" -m aligner_jax.train \
  --gin_file="$run_gin" --gin.MODEL_DIR="$model_dir_literal" "$@"
