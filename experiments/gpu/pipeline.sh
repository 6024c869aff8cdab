#!/usr/bin/env bash
# One GPU-machine call for the training side: `paper` data, the loader benchmark, the main job
# (`make experiment PRESET=paper`: dense, sdpa, jagged) and as much of the seq_len ablation as
# the 10-minute call leaves time for, then its report. Run from the repo root with the
# project installed (offline: from wheels), with OUT and GIT_COMMIT set (no .git there).
# Returns $OUT/run.log, $OUT/training/<gpu>/main-paper.md, $OUT/loader.log, $OUT/results.tgz and
# $OUT/mlflow.db.gz (every run, for `make ui` / `make report` here).
set -uo pipefail
: "${OUT:?set OUT}" "${GIT_COMMIT:?set GIT_COMMIT}"
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT
export MLFLOW_TRACKING_URI=sqlite:///$PWD/mlflow.db
budget=${CALL_BUDGET_S:-570}
log=$OUT/run.log
save() { [ -f mlflow.db ] && gzip -9c mlflow.db > "$OUT/mlflow.db.gz"; tar czf "$OUT/results.tgz" experiments/results 2>/dev/null; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
make data PRESET=paper SETUP=none PY=python3 >> "$log" 2>&1; echo "data rc=$? at ${SECONDS}s" | tee -a "$log"
timeout 60 python3 -m experiments loader-bench --data data/paper --workers 8 --max-seq-len 1024 \
  > "$OUT/loader.log" 2>&1; echo "loader bench rc=$? at ${SECONDS}s" | tee -a "$log"
timeout $((budget - SECONDS - 120)) python3 -m experiments sweep experiments/ablations/main.yaml --new \
  --data data/paper --set name=main-paper --set 'configs=[base, paper]' --results "$OUT" >> "$log" 2>&1
echo "experiment rc=$? at ${SECONDS}s" | tee -a "$log"
save
left=$((budget - SECONDS - 60))
if [ "$left" -gt 90 ]; then
  timeout "$left" python3 -m experiments sweep experiments/ablations/seq_len.yaml --data data/paper \
    --where max_seq_len=256,1024,4096 --deadline-s $((left - 75)) >> "$log" 2>&1
  echo "sweep rc=$? at ${SECONDS}s" | tee -a "$log"
  timeout 45 python3 -m experiments report --parent seq_len --commit "$GIT_COMMIT" --out experiments/results \
    >> "$log" 2>&1
  echo "report rc=$? at ${SECONDS}s" | tee -a "$log"
fi
save
tail -40 "$log"
