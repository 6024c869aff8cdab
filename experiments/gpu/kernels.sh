#!/usr/bin/env bash
# One GPU-machine call for the kernels: the gpu-marked test suite, then every benchmark suite.
# Run from the repo root on the GPU machine after the wheel install line
# (../shared/device/README.md), with OUT set to a folder that comes back and GIT_COMMIT set
# (the GPU machine has no .git). Everything lands in $OUT/bench (JSON, markdown, PNG: at most
# 7 files) and $OUT/run.log, so a call cut short still returns what was measured.
set -uo pipefail
: "${OUT:?set OUT}" "${GIT_COMMIT:?set GIT_COMMIT}"
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
python3 -c "import xdist" 2>/dev/null && par=(-n 8) || par=()
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu "${par[@]}" -p no:cacheprovider tests/ \
  >> "$log" 2>&1
echo "gpu tests rc=$?" | tee -a "$log"
grep -E "passed|failed" "$log" | tail -2
mkdir -p "$OUT/bench"
python3 -m kernels.bench all --suite paper --out "$OUT/bench" --commit "$GIT_COMMIT" \
  --flex-budget-s "${FLEX_BUDGET:-60}" --deadline-s "${PAPER_DEADLINE:-280}" >> "$log" 2>&1
echo "bench paper rc=$?" | tee -a "$log"
python3 -m kernels.bench all --suite recsys,long --out "$OUT/bench" --commit "$GIT_COMMIT" \
  --flex-budget-s "${FLEX_BUDGET:-60}" --deadline-s "${RL_DEADLINE:-120}" >> "$log" 2>&1
echo "bench recsys,long rc=$?" | tee -a "$log"
tail -45 "$log"
