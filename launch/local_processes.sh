#!/usr/bin/env bash
# Run N processes of one aligner binary on this machine as ONE multi-process JAX job (the way a
# multi-host job runs, to try it or test it without a cluster): a free coordinator port on
# 127.0.0.1, CPU devices with cross-process collectives (gloo), DEVICES_PER_PROCESS forced host
# devices per process (default 1), the same flags to every process plus --coordinator_address,
# --num_processes and --process_id. Each output line is prefixed with its process's rank
# ("[0] ...", stdout and stderr kept apart). Waits for all; as soon as one exits non-zero the
# others are stopped (SIGTERM, SIGKILL after KILL_AFTER seconds, default 5) and the script exits
# with that status. Ctrl-C / SIGTERM stop every process too.
#
#   launch/local_processes.sh 2 train --gin_file=runs/scifact_minilm.gin \
#       --gin.MODEL_DIR="'outputs/scifact_2proc'" --gin.TRAIN_STEPS=400
#   launch/local_processes.sh 2 index --corpus=../shared/data/beir/cisi/corpus.jsonl \
#       --index_dir=outputs/cisi_2proc
#
# PYTHON (default: the repository's .venv/bin/python) runs `PYTHON -m aligner_jax.BINARY`.
set -euo pipefail
if [ $# -lt 2 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NUM_PROCESSES BINARY [flags...]   (BINARY: train or index, or aligner-train)" >&2
  exit 2
fi
num=$1 binary=${2#aligner-}; shift 2
[ "$binary" = eval ] && binary=evaluate
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
if [ ! -f "$repo/aligner_jax/$binary.py" ]; then
  echo "$0: no binary '$binary' (aligner_jax/$binary.py): e.g. train, index" >&2
  exit 2
fi
if ! grep -q "distributed.declare_key_flags" "$repo/aligner_jax/$binary.py"; then
  echo "$0: aligner-$binary runs as one process (it takes no --coordinator_address): e.g. train, index" >&2
  exit 2
fi
port=$("$repo/.venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
export XLA_FLAGS="--xla_force_host_platform_device_count=${DEVICES_PER_PROCESS:-1} ${XLA_FLAGS:-}"
export PYTHONUNBUFFERED=1
kill_after=${KILL_AFTER:-5}

prefix() {  # "[RANK] " before each line; deaf to SIGTERM: it ends when its process's output
  trap '' TERM  # does, after the last lines a stopping process writes (a preemption save's)
  exec sed -u "s/^/[$1] /"
}

set -m  # job control: each process (and its line prefixers) runs in its own process group
pids=()
for ((rank = 0; rank < num; rank++)); do
  (
    # stderr through one prefixer, stdout (fd 3) through another; both are members of the
    # pipeline, so the subshell ends after their last lines; pipefail: the process's status
    set -o pipefail
    trap : TERM  # waits for its pipeline (a SIGTERM'd process saving its state) instead of dying
    { "$python" -m "aligner_jax.$binary" "$@" --coordinator_address="127.0.0.1:$port" \
        --num_processes="$num" --process_id="$rank" 2>&1 1>&3 3>&- |
        prefix "$rank" >&2 3>&-; } 3>&1 | prefix "$rank"
  ) &
  pids+=("$!")
done

stop_all() {  # SIGTERM every process group, SIGKILL what is left after $kill_after s
  set +m  # no job-control notices for the processes stopped here
  local pid killer
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  (
    nap=
    trap 'kill "$nap" 2>/dev/null; exit 0' TERM  # stopped early: its sleep goes with it
    sleep "$kill_after" &
    nap=$!
    wait "$nap"
    for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  ) &
  killer=$!
  wait "${pids[@]}" 2>/dev/null || true
  kill "$killer" 2>/dev/null || true
  # a process of a group whose subshell died first, if it ignored SIGTERM
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
}
trap 'stop_all; exit 130' INT
trap 'stop_all; exit 143' TERM

running=("${pids[@]}")
while ((${#running[@]} > 0)); do
  status=0
  wait -n -p finished "${running[@]}" || status=$?
  left=()
  for pid in "${running[@]}"; do [ "$pid" != "$finished" ] && left+=("$pid"); done
  running=("${left[@]+"${left[@]}"}")
  if [ "$status" != 0 ]; then
    for ((rank = 0; rank < num; rank++)); do [ "${pids[$rank]}" = "$finished" ] && break; done
    echo "$0: process $rank exited with status $status: stopping the others" >&2
    stop_all
    exit "$status"
  fi
done
