#!/usr/bin/env bash
# One GPU-machine call for the training loop: the gpu tests of the CUDA-graph step, then `fit`
# runs of the paper preset (eager vs CUDA graphs, jagged vs sdpa, batch 512 and 2048; 300
# steps, 50 warm-up, the real loop traced over steps 150-169 where asked: attention's share of an
# eager step in its loop_summary.json), then `make profile` at batch 512. Each part runs only if the
# call's budget still holds it.
# Run from the repo root with the project installed (offline: from wheels), with OUT and
# GIT_COMMIT set (no .git there). Returns $OUT/loop.log, $OUT/mlflow.db.gz, $OUT/traces.tgz
# (the profile's traces in traces/profile-paper/).
#   RUNS="jagged:512:graphs:trace sdpa:512:eager" bash experiments/gpu/loop.sh
set -uo pipefail
: "${OUT:?set OUT}" "${GIT_COMMIT:?set GIT_COMMIT}"
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT
export MLFLOW_TRACKING_URI=sqlite:///$PWD/mlflow.db
budget=${CALL_BUDGET_S:-560}
log=$OUT/loop.log
left() { echo $((budget - SECONDS)); }
save() {
  [ -f mlflow.db ] && gzip -9c mlflow.db > "$OUT/mlflow.db.gz"
  tar czf "$OUT/traces.tgz" --exclude='*.json.gz' traces 2>/dev/null
  tar czf "$OUT/mlruns.tgz" --exclude='*.json.gz' mlruns 2>/dev/null  # artifacts: perf/steps.csv, configs
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU"; } | tee "$log"
make data PRESET=paper SETUP=none PY=python3 >> "$log" 2>&1; echo "data rc=$? at ${SECONDS}s" | tee -a "$log"
TESTS=${TESTS-tests/test_pipeline_graphs.py}
if [ -n "$TESTS" ]; then
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -rfE -m gpu -p no:cacheprovider $TESTS \
    >> "$log" 2>&1
  echo "gpu tests rc=$? at ${SECONDS}s" | tee -a "$log"; grep -E "passed|failed" "$log" | tail -1
fi
RUNS=${RUNS:-"jagged:512:graphs:trace jagged:512:eager:trace sdpa:512:graphs:trace sdpa:512:eager jagged:2048:graphs sdpa:2048:graphs"}
for spec in $RUNS; do
  IFS=: read -r attention bs mode trace <<< "$spec"
  name="$attention-b$bs-$mode"
  if [ "$(left)" -lt 100 ]; then echo "$name: not started, $(left)s left" | tee -a "$log"; continue; fi
  extra=()
  [ "$mode" = graphs ] && extra+=(--model.cuda_graphs true)
  [ -n "$trace" ] && extra+=(--perf.trace_steps "[150,10]" --perf.trace_dir "traces/$name")
  timeout $(( $(left) - 20 )) python3 -m pipeline fit --config experiments/configs/base.yaml \
    --config experiments/configs/paper.yaml --data.data_dir data/paper --model.ranker.attention "$attention" \
    --data.batch_size "$bs" --trainer.max_steps "${STEPS:-300}" --trainer.limit_val_batches 0 \
    --trainer.limit_test_batches 5 --checkpoint.save_top_k 0 --checkpoint.save_last false \
    --mlflow.experiment_name loop --mlflow.run_name "$name" "${extra[@]}" >> "$log" 2>&1
  echo "$name rc=$? at ${SECONDS}s" | tee -a "$log"
  save
done
python3 experiments/gpu/runs_table.py loop | tee -a "$log"
if [ "$(left)" -gt 120 ] && [ -n "${PROFILE-1}" ]; then
  timeout $(( $(left) - 10 )) make profile SETUP=none PY=python3 PRESET=paper \
    ATTENTION="${PROFILE_ATTENTION:-jagged sdpa dense}" PROFILE_DIR=traces/profile-paper >> "$log" 2>&1
  echo "profile rc=$? at ${SECONDS}s" | tee -a "$log"
fi
save
grep -E "rc=|Traceback|Error" "$log" | tail -30
