#!/usr/bin/env bash
# Run on a Cloud TPU VM pod slice: the SAME command runs on every worker; jax.distributed
# discovers the pod from the TPU metadata (--multiprocess). Outputs (MODEL_DIR, --index_dir) must
# be storage every worker sees (a gs:// bucket for checkpoints, a mounted filesystem).
#
# Training: each host feeds its devices' rows of every global batch.
#   launch/tpu_pod.sh my-tpu us-central2-b runs/scifact_minilm.gin gs://bucket/aligner \
#       --gin.train.num_partitions=4 --gin.BATCH_SIZE=256
# Indexing: each host encodes its own shards of the corpus; the manifest and the search index
# are written when the last shard is done.
#   launch/tpu_pod.sh my-tpu us-central2-b index --corpus=/mnt/shared/corpus.jsonl \
#       --index_dir=/mnt/shared/index --gin_file=models/minilm.gin \
#       --gin.load_encoder.checkpoint="'gs://bucket/aligner'"
#
# Assumes the repository is checked out at the same path on every worker and `make install
# JAX_EXTRA=tpu` was run there (e.g. with `--worker=all --command="cd aligner_jax && make install
# JAX_EXTRA=tpu"`).
set -euo pipefail
usage="usage: $0 TPU_NAME ZONE RUN_GIN MODEL_DIR [flags...]  |  $0 TPU_NAME ZONE index [flags...]"
if [ $# -lt 3 ] || { [ "$3" != index ] && [ $# -lt 4 ]; }; then
  echo "$usage" >&2
  exit 2
fi
tpu=$1 zone=$2; shift 2
repo_dir=${REPO_DIR:-aligner_jax}
if [ "$1" = index ]; then
  shift
  job="-m aligner_jax.index --multiprocess$(printf ' %q' "$@")"
else
  run_gin=$1 model_dir=$2; shift 2
  job="-m aligner_jax.train --multiprocess --gin_file=$run_gin --gin.MODEL_DIR=\"'$model_dir'\"$(printf ' %q' "$@")"
fi
gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command \
  "cd $repo_dir && .venv/bin/python $job"
