#!/usr/bin/env bash
# Train on a Cloud TPU VM pod slice: the SAME command runs on every worker; jax.distributed
# discovers the pod from the TPU metadata, each host feeds its shard of every global batch, and
# MODEL_DIR must be shared storage (a gs:// bucket or a mounted filesystem).
#
#   launch/tpu_pod.sh my-tpu us-central2-b runs/scifact_minilm.gin gs://bucket/aligner \
#       --gin.train.num_partitions=4 --gin.BATCH_SIZE=256
#
# Assumes the repository is checked out at the same path on every worker and `make install
# JAX_EXTRA=tpu` was run there (e.g. with `--worker=all --command="cd aligner_jax && make install
# JAX_EXTRA=tpu"`).
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: $0 TPU_NAME ZONE RUN_GIN MODEL_DIR [extra flags...]" >&2
  exit 2
fi
tpu=$1 zone=$2 run_gin=$3 model_dir=$4; shift 4
repo_dir=${REPO_DIR:-aligner_jax}
extra=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command \
  "cd $repo_dir && .venv/bin/python -m aligner_jax.train --multiprocess \
   --gin_file=$run_gin --gin.MODEL_DIR=\"'$model_dir'\"$extra"
