#!/usr/bin/env bash
# One GPU-machine call for the kernels: the gpu-marked test suite, then benchmark suites.
# Run from the repo root on the GPU machine with the project installed, OUT set to a folder that
# comes back and GIT_COMMIT set (the machine has no .git). Results land in $OUT/bench (JSON,
# report.md, report.json, PNG; copy to experiments/results/kernels/<gpu>/) and $OUT/run.log, so a
# call cut short still returns what was measured. PARTS picks what runs (default: tests
# bench_paper bench_recsys_long):
#   tests             the gpu-marked tests (TEST_WORKERS, at most 16; TEST_TIMEOUT)
#   bench_paper       every kind on the paper suite; bench_recsys_long: the recsys and long suites
#   bench_paper_hand  the paper suite with the hand rules (JFA_LAUNCH_TABLE=off) into $OUT/hand
#   graph_paper       self-attention on the paper suite, ours and varlen_attn, by call and by kernels
#   target_ab         target attention with SPLIT_DQ as shipped ($OUT/bench) and forced off ($OUT/nosplit)
#   split_ab          the ops on the long suite as shipped ($OUT/long) and with T_SPLITS=4 ($OUT/split)
#   table_ab          each kind of AB_KINDS (default "dense_attention ops") on AB_SUITE (paper) with the
#                     launch table ($OUT/table) and the hand rules ($OUT/hand), then bench-compare of the
#                     two into $OUT/compare-<kind>.md; AB_ORDER="hand table hand table" alternates
#                     processes (repeats into $OUT/hand-2, ...), AB_MODES=fwd_bwd one mode, AB_CPUS=0-3
#                     pins each run to those cores
# GRAPH_MS=1: bench_paper, bench_paper_hand and bench_recsys_long also time every row as a CUDA-graph
# replay (the kernels' own time, what a launch table changes; host-bound call times move between
# runs of the same code). E.g.
#   PARTS="tests bench_paper" bash experiments/gpu/kernels.sh
#   GRAPH_MS=1 PARTS="bench_paper bench_paper_hand" bash experiments/gpu/kernels.sh   # table vs hand rules
set -uo pipefail
PARTS=" ${PARTS:-tests bench_paper bench_recsys_long} "
: "${OUT:?set OUT}" "${GIT_COMMIT:?set GIT_COMMIT}"
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1
log=$OUT/run.log
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
if [[ $PARTS == *" tests "* ]]; then
  workers=${TEST_WORKERS:-$(nproc)}; [ "$workers" -gt 16 ] && workers=16  # the tests are mostly compiles
  python3 -c "import xdist" 2>/dev/null && par=(-n "$workers") || par=()
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rfE -m gpu "${par[@]}" -p no:cacheprovider tests/ \
    >> "$log" 2>&1
  echo "gpu tests rc=$?" | tee -a "$log"
  grep -E "passed|failed" "$log" | tail -2
fi
mkdir -p "$OUT/bench"
graph=(); [ "${GRAPH_MS:-0}" = 1 ] && graph=(--graph-ms)
if [[ $PARTS == *" bench_paper "* ]]; then
  python3 -m experiments bench all --suite paper --out "$OUT/bench" --commit "$GIT_COMMIT" "${graph[@]}" \
    --flex-budget-s "${FLEX_BUDGET:-60}" --deadline-s "${PAPER_DEADLINE:-280}" >> "$log" 2>&1
  echo "bench paper rc=$?" | tee -a "$log"
fi
if [[ $PARTS == *" bench_paper_hand "* ]]; then
  JFA_LAUNCH_TABLE=off python3 -m experiments bench all --suite paper --out "$OUT/hand" --commit "$GIT_COMMIT" "${graph[@]}" \
    --flex-budget-s "${FLEX_BUDGET:-60}" --deadline-s "${PAPER_DEADLINE:-280}" >> "$log" 2>&1
  echo "bench paper (hand rules) rc=$?" | tee -a "$log"
fi
if [[ $PARTS == *" graph_paper "* ]]; then  # kernels alone vs call (host included): is a gap host time?
  python3 -m experiments bench attention --suite paper --providers varlen_attn --graph-ms --out "$OUT/bench" \
    --commit "$GIT_COMMIT" --deadline-s "${GRAPH_DEADLINE:-200}" >> "$log" 2>&1
  echo "bench graph_paper rc=$?" | tee -a "$log"
fi
if [[ $PARTS == *" target_ab "* ]]; then
  for variant in bench nosplit; do
    force=(); [ $variant = nosplit ] && force=(--force dense_bwd:SPLIT_DQ=0)
    python3 -m experiments bench dense_attention --suite paper --providers varlen_attn --graph-ms --out "$OUT/$variant" \
      --commit "$GIT_COMMIT" "${force[@]}" --deadline-s "${AB_DEADLINE:-120}" >> "$log" 2>&1
    echo "bench target_ab $variant rc=$?" | tee -a "$log"
  done
fi
if [[ $PARTS == *" split_ab "* ]]; then
  for variant in long split; do
    force=(); [ $variant = split ] && force=(--force jagged_jagged_bmm:T_SPLITS=4)
    python3 -m experiments bench ops --suite long --graph-ms --out "$OUT/$variant" --commit "$GIT_COMMIT" "${force[@]}" \
      --deadline-s "${AB_DEADLINE:-120}" >> "$log" 2>&1
    echo "bench split_ab $variant rc=$?" | tee -a "$log"
  done
fi
if [[ $PARTS == *" table_ab "* ]]; then  # the launch table against the hand rules, kind by kind, on one machine
  for kind in ${AB_KINDS:-dense_attention ops}; do
    declare -A seen=()
    for variant in ${AB_ORDER:-table hand}; do
      seen[$variant]=$(( ${seen[$variant]:-0} + 1 )); dir=$OUT/$variant; [ "${seen[$variant]}" -gt 1 ] && dir=$dir-${seen[$variant]}
      off=(); [ $variant = hand ] && off=(JFA_LAUNCH_TABLE=off)
      pin=(); [ -n "${AB_CPUS:-}" ] && pin=(taskset -c "$AB_CPUS")
      env "${off[@]}" "${pin[@]}" python3 -m experiments bench "$kind" --suite "${AB_SUITE:-paper}" --providers varlen_attn --graph-ms \
        ${AB_MODES:+--modes "$AB_MODES"} --out "$dir" --commit "$GIT_COMMIT" --deadline-s "${AB_DEADLINE:-120}" \
        --no-report >> "$log" 2>&1
      echo "bench table_ab $kind $variant ($dir) rc=$?" | tee -a "$log"
    done
    runs() { ls "$OUT"/"$1"{,-*}/*-"$kind"-*.json 2>/dev/null | paste -sd, -; }
    base=$(runs hand); new=$(runs table)
    [ -n "$base" ] && [ -n "$new" ] && python3 -m experiments bench-compare "$base" "$new" --out "$OUT/compare-$kind.md" \
      | grep -E "PASS|MISS|slower|geomean" | tee -a "$log"
  done
fi
if [[ $PARTS == *" bench_recsys_long "* ]]; then
  python3 -m experiments bench all --suite recsys,long --out "$OUT/bench" --commit "$GIT_COMMIT" "${graph[@]}" \
    --flex-budget-s "${FLEX_BUDGET:-60}" --deadline-s "${RL_DEADLINE:-240}" >> "$log" 2>&1
  echo "bench recsys,long rc=$?" | tee -a "$log"
fi
tail -45 "$log"
