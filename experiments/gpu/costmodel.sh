#!/usr/bin/env bash
# One GPU-machine call for the launch-config cost model: the sweep, then the cost model's held-out-shape
# evaluation, report and exported table, all from the sweep's Parquet.
# Run from the repo root on the GPU machine with the project installed (offline: polars and
# mlflow from wheels; scikit-learn and nvidia-ml-py), with OUT set to a folder that comes back and GIT_COMMIT set
# (the GPU machine has no .git). Writes under $OUT:
#   sweep-<gpu>.parquet        every (family, shape, config) row: ms, power, energy, status
#   sweep.log, run.log         the sweep's progress; this script's summary
#   eval-<gpu>.json            per-family R^2, errors, per-shape slowdowns (model, hand, autotune)
#   report/costmodel.md        + 3 or 4 PNG plots (copy to experiments/results/tuning/<gpu>/, the
#                              Parquet to experiments/results/tuning/<gpu>/sweep.parquet)
#   configs/<gpu>.json         the launch table (copy to kernels/configs/ to put it in use)
# The sweep starts no new config after SWEEP_DEADLINE s (default 400) and is resumable: it goes on
# from RESUME=<path>, by default the committed experiments/results/tuning/<gpu>/sweep.parquet
# where one exists for this GPU (commit the returned Parquet there); a RESUME it cannot read stops the
# call (exit 2) rather than start afresh. GRID=small|medium (default)|full.
# Shapes timed before the energy pass get their energy-counter readings when resumed.
# FAMILIES=a,b sweeps only those kernel families (default all; e.g. the S2 ones alone:
# FAMILIES=s2_fwd,s2_bwd). MLFLOW=1 also logs the sweep as an MLflow run (Parquet as artifact) into ./mlflow.db.
# COMPILE_WORKERS=N: processes compiling the configs before the timing pass (the sweep's default:
# cores less 2, at most 12); ENERGY_S: seconds per energy reading (default 1); TIMING=graph|call
# (default graph: the kernels alone); REP_MS: timing repetitions, ms (default 40). MODEL=0 stops after
# the sweep (eval, report and export need no GPU: run them where the Parquet comes back).
# EXPECT_KERNEL_CODE=<12 hex>: stop (exit 3) before sweeping unless experiments.bench.stamp.kernel_code() is that
# (the digest the resumed rows carry), rather than time them all again.
# Where the machine returns few files per command, end with `bash experiments/gpu/pack.sh`. E.g.
#   GIT_COMMIT=$(git rev-parse HEAD) bash experiments/gpu/costmodel.sh; bash experiments/gpu/pack.sh
set -uo pipefail
: "${OUT:?set OUT}" "${GIT_COMMIT:?set GIT_COMMIT}"
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit --format=csv,noheader | tee "$log"
slug=$(python3 -c "import torch; from kernels.launch_table import device_slug; print(device_slug())")
code=$(python3 -c "from experiments.bench.stamp import kernel_code; print(kernel_code())")
echo "kernel code $code" | tee -a "$log"
if [ -n "${EXPECT_KERNEL_CODE:-}" ] && [ "$code" != "$EXPECT_KERNEL_CODE" ]; then
  echo "kernel code $code, not EXPECT_KERNEL_CODE=$EXPECT_KERNEL_CODE: every resumed row would be timed again; stopping" | tee -a "$log"
  exit 3
fi
data=$OUT/sweep-$slug.parquet
# RESUME= (set, empty) starts afresh; unset, the committed Parquet of this GPU where there is one
RESUME=${RESUME-$( [ -f "experiments/results/tuning/$slug/sweep.parquet" ] && echo "experiments/results/tuning/$slug/sweep.parquet")}
if [ -n "$RESUME" ]; then
  # a RESUME that is not there must not start afresh: that re-times every committed row
  cp "$RESUME" "$data" && chmod u+w "$data" || { echo "RESUME=$RESUME: cannot read it; stopping" | tee -a "$log"; exit 2; }
  echo "resuming from $RESUME" | tee -a "$log"
fi
deadline=${SWEEP_DEADLINE:-400}
timeout -k 30 $(( deadline + 120 )) python3 -m experiments config-sweep --grid "${GRID:-medium}" \
  --families "${FAMILIES:-all}" --deadline-s "$deadline" --out "$data" --commit "$GIT_COMMIT" ${MLFLOW:+--mlflow} \
  ${COMPILE_WORKERS:+--compile-workers "$COMPILE_WORKERS"} ${ENERGY_S:+--energy-s "$ENERGY_S"} \
  ${TIMING:+--timing "$TIMING"} ${REP_MS:+--rep-ms "$REP_MS"} \
  > "$OUT/sweep.log" 2>&1
rc=$?
echo "sweep rc=$rc" | tee -a "$log"
tail -4 "$OUT/sweep.log" | tee -a "$log"
if [ "$rc" = 2 ]; then echo "the sweep refused its input (another GPU's rows?): no model, report or table" | tee -a "$log"; exit 2; fi
if [ "${MODEL:-1}" = 0 ]; then exit "$rc"; fi
# the hand rules were retuned on the small grid's shapes: beyond it, judge on the other shapes only
judge=${JUDGE_ON:-$([ "${GRID:-medium}" = small ] && echo all || echo new)}
timeout 120 python3 -m experiments costmodel eval --data "$data" --out "$OUT/eval-$slug.json" --judge-on "$judge" >> "$log" 2>&1
echo "costmodel eval rc=$?" | tee -a "$log"
timeout 120 python3 -m experiments costmodel report --data "$data" --out "$OUT/report" --judge-on "$judge" > /dev/null 2>> "$log"
echo "costmodel report rc=$?" | tee -a "$log"
timeout 120 python3 -m experiments costmodel export --data "$data" --out "$OUT/configs/$slug.json" >> "$log" 2>&1
echo "costmodel export rc=$?" | tee -a "$log"
tail -30 "$log"
