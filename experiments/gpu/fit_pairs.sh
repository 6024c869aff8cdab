#!/usr/bin/env bash
# `fit` speed of the jagged ranker against the SDPA ranker, in pairs: the `paper` preset at
# max_seq_len 1024, batch 512, 300 steps (throughput over steps 50-300), each pair one table
# update of PAIRS (optimizer:embedding_grad). On 2+ GPUs the two layouts run at the same time,
# jagged on GPU 0 and SDPA on GPU 1, each with its GPU and half the cores alone; on one GPU one
# after the other. Run from the repo root with the project installed, OUT and GIT_COMMIT set:
#   GIT_COMMIT=<sha> PAIRS="rowwise:sparse adamw:dense rowwise:sparse" bash experiments/gpu/fit_pairs.sh
# EXTRA="--model.ranker.num_layers 2" adds fit arguments to every run; CALL_BUDGET_S (default 560)
# bounds the call: a pair starts only while 110 s (150 s on one GPU) are left.
# Returns $OUT/fit-pairs.md (a row per run, the speed-up per pair), $OUT/fit-pairs.log and each
# run's log and MLflow database (written there, not in on_gpu's private copy) under $OUT/runs/ (pack.sh them on a machine that returns few files).
set -uo pipefail
: "${OUT:?set OUT}" "${GIT_COMMIT:?set GIT_COMMIT}"
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT
budget=${CALL_BUDGET_S:-560} log=$OUT/fit-pairs.log
mkdir -p "$OUT/runs"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$log"
n=$(nvidia-smi -L | wc -l) half=$(( $(nproc) / 2 ))
sides="jagged:0:0-$((half - 1)) sdpa:1:$half-$(( $(nproc) - 1 ))"
[ "$n" = 1 ] && sides="jagged:0:0-$(( $(nproc) - 1 )) sdpa:0:0-$(( $(nproc) - 1 ))"
make data PRESET=paper SETUP=none PY=python3 >> "$log" 2>&1; echo "data rc=$? at ${SECONDS}s" | tee -a "$log"
i=0
for pair in ${PAIRS:-rowwise:sparse adamw:dense}; do
  i=$((i + 1)) opt=${pair%%:*} grad=${pair#*:}
  if [ $((budget - SECONDS)) -lt $(( n == 1 ? 150 : 110 )) ]; then echo "pair $i $pair: not started at ${SECONDS}s" | tee -a "$log"; break; fi
  for side in $sides; do
    IFS=: read -r att gpu cores <<< "$side"
    name=p$i-$opt-$grad-$att
    # shellcheck disable=SC2086  # EXTRA: words
    MLFLOW_TRACKING_URI=sqlite:///$OUT/runs/$name.db timeout -k 10 $((budget - SECONDS - 5)) \
      bash experiments/gpu/on_gpu.sh "$gpu" "$cores" "$name" \
      python3 -m pipeline fit --config experiments/configs/base.yaml --config experiments/configs/paper.yaml \
      --data.data_dir data/paper --data.max_seq_len 1024 --data.batch_size 512 --trainer.max_steps 300 \
      --trainer.limit_val_batches 0 --trainer.limit_test_batches 25 --model.ranker.attention "$att" \
      --model.optimizer "$opt" --model.embedding_grad "$grad" --mlflow.run_name "$name" ${EXTRA:-} \
      > "$OUT/runs/$name.log" 2>&1 &
    [ "$n" = 1 ] && wait  # one GPU: the layouts one after the other
  done
  wait
  for att in jagged sdpa; do rm -rf "/tmp/repo-p$i-$opt-$grad-$att" "${OUT:?}/p$i-$opt-$grad-$att"; done  # on_gpu's copies
  echo "pair $i $pair done at ${SECONDS}s" | tee -a "$log"
done
python3 - "$OUT/runs" "$GIT_COMMIT" > "$OUT/fit-pairs.md" <<'PY'
import sqlite3, sys
from pathlib import Path
keys = ["perf/train_examples_per_s", "perf/step_time_ms", "perf/step_time_median_ms", "perf/step_time_p90_ms",
        "perf/host_step_ms", "mem/train_peak_allocated_mb", "perf/prepare_s"]
print(f"# fit pairs, jagged vs SDPA (commit {sys.argv[2]})\n")
print("| pair | attention | table update | examples/s | step mean ms | median | p90 | host ms | peak MB | prepare s | speed-up |")
print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
runs = {}
for db in sorted(Path(sys.argv[1]).glob("*.db"), key=lambda p: (int(p.stem.split("-")[0][1:]), p.stem.endswith("sdpa"))):
    m = dict(sqlite3.connect(db).execute("select key, value from latest_metrics"))
    pair, opt, grad, att = db.stem.split("-")
    runs[(pair, att)] = m
    if keys[0] not in m:
        print(f"| {pair[1:]} | {att} | {opt}, {grad} | no steady steps logged | | | | | | | |"); continue
    other = runs.get((pair, "jagged"))
    up = f"**{other[keys[0]] / m[keys[0]]:.2f}x**" if att == "sdpa" and other and keys[0] in other else ""
    cells = [f"{m[keys[0]]:,.0f}", *(f"{m.get(k, float('nan')):.2f}" for k in keys[1:5]),
             f"{m.get(keys[5], 0):,.0f}", f"{m.get(keys[6], float('nan')):.1f}"]
    print(f"| {pair[1:]} | {att} | {opt}, {grad} | " + " | ".join(cells) + f" | {up} |")
PY
cat "$OUT/fit-pairs.md" | tee -a "$log"
