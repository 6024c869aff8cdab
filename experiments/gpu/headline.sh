#!/usr/bin/env bash
# One GPU for the headline numbers on the final code: the main job (`make experiment PRESET=paper`:
# dense, sdpa and jagged at batch 512, CUDA-graph steps), `fit` of jagged and sdpa at batch 2048
# (300 steps), and `make profile` at batch 512 and 2048 (the training loop's trace, eager steps):
# attention's share of a step beside fit's steady step. Run from the repo root with the project
# installed (offline: from wheels), with OUT and GIT_COMMIT set, paper data present. Returns
# $OUT/headline.log, $OUT/loop.log, $OUT/training/<gpu>/main-paper.md, $OUT/profile-paper-b{512,2048}/,
# $OUT/mlflow.db.gz, $OUT/mlruns.tgz.
set -uo pipefail
: "${OUT:?set OUT}" "${GIT_COMMIT:?set GIT_COMMIT}"
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT
export MLFLOW_TRACKING_URI=sqlite:///$PWD/mlflow.db
budget=${CALL_BUDGET_S:-540}
log=$OUT/headline.log
left() { echo $((budget - SECONDS)); }
save() { [ -f mlflow.db ] && gzip -9c mlflow.db > "$OUT/mlflow.db.gz"; tar czf "$OUT/mlruns.tgz" mlruns 2>/dev/null; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader -i "${CUDA_VISIBLE_DEVICES:-0}" \
  2>/dev/null || echo "no GPU"; } | tee "$log"
timeout $(( $(left) - 240 )) python3 -m experiments sweep experiments/ablations/main.yaml --new --data data/paper \
  --set name=main-paper --set 'configs=[base, paper]' --results "$OUT" >> "$log" 2>&1
echo "experiment rc=$? at ${SECONDS}s" | tee -a "$log"
save
# the batch-2048 fits are loop.sh's (same runs and names; its own log, loop.log)
runs=""; for attention in ${FIT_2048:-jagged sdpa}; do runs+=" $attention:2048:graphs"; done
CALL_BUDGET_S=$(( $(left) - 80 )) RUNS="$runs" TESTS="" PROFILE="" bash experiments/gpu/loop.sh > /dev/null
grep -E "rc=|not started" "$OUT/loop.log" | tee -a "$log"
for bs in 512 2048; do
  layouts="jagged sdpa dense"; [ "$bs" = 2048 ] && layouts="jagged sdpa"  # dense: out of memory in fit
  if [ "$(left)" -lt 60 ]; then echo "profile b$bs: not started, $(left)s left" | tee -a "$log"; continue; fi
  timeout $(( $(left) - 10 )) make profile SETUP=none PY=python3 PRESET=paper ATTENTION="$layouts" \
    PROFILE_DIR="$OUT/profile-paper-b$bs" PROFILE_ARGS="--data.batch_size $bs" >> "$log" 2>&1
  echo "profile b$bs rc=$? at ${SECONDS}s" | tee -a "$log"
done
save
grep -E "rc=|Traceback|Error" "$log" | tail -30
