#!/usr/bin/env bash
# Run a command on one GPU of a multi-GPU machine, in a private copy of the repo (its own
# mlflow.db, checkpoints and caches) pinned to a set of CPU cores, its outputs in $OUT/NAME.
# Two such jobs share a machine without sharing a GPU, a core, a database or a log.
#   bash experiments/gpu/on_gpu.sh GPU CORES NAME COMMAND...
#   bash experiments/gpu/on_gpu.sh 1 16-31 gpu1 bash experiments/gpu/kernels.sh
# data/ is linked, not copied: generate what both need before starting them.
set -uo pipefail
: "${OUT:?set OUT}"
gpu=$1 cores=$2 name=$3; shift 3
dir=/tmp/repo-$name
rm -rf "$dir" && mkdir -p "$dir" "$OUT/$name"
tar cf - --exclude=./data --exclude=./mlflow.db --exclude=./mlruns --exclude=./.git --exclude=./checkpoints \
  --exclude=./lightning_logs . | tar xf - -C "$dir"
ln -s "$PWD/data" "$dir/data"
cd "$dir" || exit 1
export CUDA_VISIBLE_DEVICES=$gpu OUT=$OUT/$name PYTHONPATH=${PYTHONPATH:-}:$dir
exec taskset -c "$cores" "$@"
