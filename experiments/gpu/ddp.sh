#!/usr/bin/env bash
# The multi-GPU run (2 GPUs of one host, NCCL; NVLink multicast off): weak scaling of the jagged
# and SDPA rankers from 1 to 2 GPUs at the paper preset (same batch of 512 per GPU, CUDA-graph
# steps, bf16, max_seq_len 1024), the dense / sparse / densify embedding gradients on 2 GPUs
# (eager steps, Adagrad: the optimizer that treats them alike), and the token balance of the
# sampler on the paper data; the item table sharded by rows (model.table_layout sharded, CUDA-graph
# steps around the fixed-size all-to-all; AdamW, and row-wise Adagrad on a sparse shard gradient)
# at 1, 2 and 4 GPUs; and a 100M-item table (data.vocab_size) that one GPU cannot hold with AdamW,
# replicated on one GPU (refused in one line: the result) and sharded over 4. Each part runs only if the call's budget still holds it; a later
# call with the returned mlflow.db.gz unzipped to ./mlflow.db adds to the same runs table.
# Run from the repo root with the project installed (offline: from wheels), with OUT and
# GIT_COMMIT set (no .git there). Returns $OUT/ddp.log, $OUT/ddp-summary.md, $OUT/mlflow.db.gz,
# $OUT/ddp-token-balance.md and $OUT/<experiment>-scaling.png (runs_table.py --plot: examples/s and efficiency vs GPUs).
#   PARTS="data balance scaling modes" bash experiments/gpu/ddp.sh             # everything once
#   CALL_BUDGET_S=200 PARTS=scaling REPEAT_FROM=2 REPEATS=3 LOG=ddp-repeats.log bash experiments/gpu/ddp.sh
#       # more repeats of the scaling runs (named NAME#2, NAME#3) for their spread
#   PARTS="shard" bash experiments/gpu/ddp.sh      # on 4 GPUs: the sharded table's weak scaling
#   PARTS=auc AUC_DEVICES="1 2 4" bash experiments/gpu/ddp.sh   # test AUC at equal global batch and steps (AUC_LAYOUTS: of W > 1)
#   PARTS=trace TRACE_DEVICES="2 4" bash experiments/gpu/ddp.sh   # the step split of ranks 0 and 1: $OUT/trace-split.md
#   PARTS="bigtable" bash experiments/gpu/ddp.sh   # on 4 GPUs: the 100M-item table; also writes
#       $OUT/bigtable.json (per run: exit status, the refusal or error line, examples/s, peak memory)
# On a CPU (the check of this script): ACCEL=cpu DATA=data/tiny CONFIG=experiments/configs/tiny.yaml
#   STEPS=6 EXTRA="--torch_num_threads 1" SCALING="jagged:1:single jagged:2:ddp" bash experiments/gpu/ddp.sh
set -uo pipefail
: "${OUT:?set OUT}" "${GIT_COMMIT:?set GIT_COMMIT}"
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT
export MLFLOW_TRACKING_URI=sqlite:///$PWD/mlflow.db
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ACCEL=${ACCEL:-gpu}
DATA=${DATA:-data/paper}
CONFIG=${CONFIG:-experiments/configs/paper.yaml}
STEPS=${STEPS:-300}
PARTS=${PARTS:-"data balance scaling modes"}
SCALING=${SCALING:-"jagged:1:single jagged:1:ddp jagged:2:ddp sdpa:1:single sdpa:1:ddp sdpa:2:ddp"}
MODES=${MODES:-"dense sparse densify"}
# attention:devices:strategy[:variant]; variant: eager (no CUDA graphs), sharded (the sharded table,
# eager), sharded-fixed (its lookups by the fixed-size all-to-all, no host sync, eager), sharded-graphs
# (those lookups around CUDA-graph steps) or sharded-sparse (and row-wise Adagrad on a sparse shard
# gradient); runs_table.py compares each with its own 1-GPU base
SHARD=${SHARD:-"jagged:1:single jagged:2:ddp:sharded-graphs jagged:4:ddp:sharded-graphs jagged:1:ddp:sharded-sparse jagged:2:ddp:sharded-sparse jagged:4:ddp:sharded-sparse"}
BIG_VOCAB=${BIG_VOCAB:-100000000} BIG_DEVICES=${BIG_DEVICES:-4}
REPEATS=${REPEATS:-1}  # runs of each scaling configuration (named NAME#k from the second on)
REPEAT_FROM=${REPEAT_FROM:-1}  # a later invocation adds repeats REPEAT_FROM..REPEATS
EXTRA=${EXTRA:-}
EXPERIMENT=${EXPERIMENT:-ddp}  # the MLflow experiment of the runs and of $OUT/<it>-summary.md (another per batch size:
# EXPERIMENT=ddp-b2048 EXTRA="--data.batch_size 2048", the same run names)
budget=${CALL_BUDGET_S:-570}
log=$OUT/${LOG:-ddp.log}
left() { echo $((budget - SECONDS)); }
has() { [[ " $PARTS " == *" $1 "* ]]; }
save() {
  [ -f mlflow.db ] && gzip -9c mlflow.db > "$OUT/mlflow.db.gz"
  python3 experiments/gpu/runs_table.py "$EXPERIMENT" --plot "$OUT/${EXPERIMENT}-scaling.png" > "$OUT/${EXPERIMENT}-summary.md" 2>> "$log"
}
scaled() {  # scaled attention:devices:strategy[:variant] SUFFIX: one weak-scaling run of the preset
  local attention devices strategy variant extra=()
  IFS=: read -r attention devices strategy variant <<< "$1"
  case "$variant" in
    "") ;;
    eager) extra=(--model.cuda_graphs false) ;;
    sharded) extra=(--model.table_layout sharded --model.cuda_graphs false) ;;
    sharded-fixed) extra=(--model.table_layout sharded --model.table_exchange alltoall_fixed --model.cuda_graphs false) ;;
    sharded-graphs) extra=(--model.table_layout sharded --model.table_exchange alltoall_fixed) ;;  # the preset's graphs
    sharded-sparse) extra=(--model.table_layout sharded --model.table_exchange alltoall_fixed --model.optimizer rowwise
                           --model.embedding_grad sparse) ;;  # graphs; the shard's gradient sparse, row-wise Adagrad
    *) echo "unknown variant $variant" >&2; return 2 ;;
  esac
  fit "$attention-w$devices-$strategy${variant:+-$variant}$2" "$devices" "$strategy" \
    --model.ranker.attention "$attention" --trainer.limit_test_batches 5 "${extra[@]}"
}
fit() {  # fit NAME DEVICES STRATEGY ARGS...: one run of the preset, skipped when the budget is short
  local name=$1 devices=$2 strategy=$3; shift 3
  if [ "$(left)" -lt 120 ]; then echo "$name: not started, $(left)s left" | tee -a "$log"; return; fi
  local dist=(--trainer.devices "$devices" --trainer.accelerator "$ACCEL")
  [ "$strategy" = ddp ] && dist+=(--trainer.strategy ddp)
  timeout $(( $(left) - 30 )) python3 -m pipeline fit --config experiments/configs/base.yaml --config "$CONFIG" \
    --data.data_dir "$DATA" --trainer.max_steps "$STEPS" \
    --trainer.limit_val_batches 0 --checkpoint.save_top_k 0 --checkpoint.save_last false \
    --mlflow.experiment_name "$EXPERIMENT" --mlflow.run_name "$name" "${dist[@]}" "$@" $EXTRA >> "$log" 2>&1
  echo "$name rc=$? at ${SECONDS}s" | tee -a "$log"
  save
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU"; } \
  | tee -a "$log"
if has data; then
  make data PRESET=paper DATA="$DATA" SETUP=none PY=python3 >> "$log" 2>&1; echo "data rc=$? at ${SECONDS}s" | tee -a "$log"
fi
if has balance; then  # the sampler's split of every global batch of an epoch, 2 to 8 ranks
  timeout $(( $(left) - 30 )) python3 -m experiments balance --data "$DATA" --batch-size "${BATCH:-512}" \
    --max-seq-len "${MAX_SEQ_LEN:-1024}" --world-sizes 2 4 8 --out "$OUT/ddp-token-balance.md" >> "$log" 2>&1
  echo "balance rc=$? at ${SECONDS}s" | tee -a "$log"
fi
if has scaling; then  # same batch per GPU: weak scaling; the preset's CUDA-graph steps, AdamW
  for rep in $(seq "$REPEAT_FROM" "$REPEATS"); do  # repeats interleaved: a drift of the machine hits every configuration
    suffix=""; [ "$rep" -gt 1 ] && suffix="#$rep"
    for spec in $SCALING; do scaled "$spec" "$suffix"; done
  done
fi
if has shard; then  # the sharded table: eager steps, its base the same eager step on one GPU
  for rep in $(seq "$REPEAT_FROM" "$REPEATS"); do
    suffix=""; [ "$rep" -gt 1 ] && suffix="#$rep"
    for spec in $SHARD; do scaled "$spec" "$suffix"; done
  done
fi
if has trace; then  # the step of rank 0 and rank 1 split from a trace: compute, NCCL, exposed NCCL, idle (host)
  for w in ${TRACE_DEVICES:-2 4}; do
    fit "jagged-w$w-ddp-sharded-graphs-trace" "$w" ddp --model.ranker.attention jagged --model.table_layout sharded \
      --model.table_exchange alltoall_fixed --trainer.limit_test_batches 5 --perf.trace_steps "${TRACE_STEPS:-[150, 20]}" --perf.trace_dir "$OUT/trace-w$w"
  done
  python3 - "$OUT" <<'PY' | tee "$OUT/trace-split.md"
import json, sys, time
from pathlib import Path
for _ in range(60):  # the other ranks may still be writing theirs when rank 0's launcher returns
    if all(len(list(d.glob("rank*/loop_summary.json"))) >= int(d.name[7:]) for d in Path(sys.argv[1]).glob("trace-w*")):
        break
    time.sleep(1)
keys = ("wall", "compute", "comm", "exposed_comm", "idle")
print("| W | rank | " + " | ".join(f"{k} ms/step" for k in keys) + " |\n|---|---|" + "---:|" * len(keys))
paths = sorted(Path(sys.argv[1]).glob("trace-w*/rank*/loop_summary.json"))
if not paths:
    print("no trace was written: the fits' logs say why (a perf.trace_steps window past a run's last step warns)")
for path in paths:
    s = json.loads(path.read_text())
    print(f"| {path.parent.parent.name[7:]} | {path.parent.name[4:]} | "
          + " | ".join(f"{s[k + '_ms_per_step']:.2f}" for k in keys) + " |")
PY
fi
if has bigtable; then  # a table of BIG_VOCAB x 128 rows (51 GB in fp32): one GPU refuses it, 4 shards train it
  ckpt_off=(--checkpoint.save_last false --checkpoint.save_top_k 0 --trainer.limit_test_batches 2)
  fit "bigtable-w1-single" 1 single --data.vocab_size "$BIG_VOCAB" --model.ranker.attention jagged "${ckpt_off[@]}"
  # row-wise Adagrad on a sparse shard gradient (its update touches only the looked-up rows), then AdamW (a
  # dense update of all 25M rows of each shard); graph steps around the fixed-size all-to-all
  fit "bigtable-w$BIG_DEVICES-ddp-sharded-sparse" "$BIG_DEVICES" ddp --data.vocab_size "$BIG_VOCAB" --model.ranker.attention \
    jagged --model.table_layout sharded --model.table_exchange alltoall_fixed --model.optimizer rowwise --model.embedding_grad sparse \
    "${ckpt_off[@]}"
  fit "bigtable-w$BIG_DEVICES-ddp-sharded" "$BIG_DEVICES" ddp --data.vocab_size "$BIG_VOCAB" --model.ranker.attention jagged \
    --model.table_layout sharded --model.table_exchange alltoall_fixed "${ckpt_off[@]}"
  python3 - "$log" "$OUT/bigtable.json" "$BIG_DEVICES" "$EXPERIMENT" <<'PY'
import json, re, sys
import mlflow
text = open(sys.argv[1]).read()
out = {}
for name in ("bigtable-w1-single", f"bigtable-w{sys.argv[3]}-ddp-sharded", f"bigtable-w{sys.argv[3]}-ddp-sharded-sparse"):
    rc = re.findall(rf"^{name} rc=(\d+)", text, re.M)
    runs = mlflow.search_runs(experiment_names=[sys.argv[4]], filter_string=f"attributes.run_name = '{name}'",
                              output_format="list")
    m = runs[0].data.metrics if runs else {}
    out[name] = {"rc": int(rc[-1]) if rc else None, "status": runs[0].info.status if runs else "no run",
                 "examples_per_s": m.get("perf/train_examples_per_s"),
                 "peak_allocated_mb": m.get("mem/train_peak_allocated_mb")}
out["lines"] = [ln for ln in text.splitlines() if ln.startswith("error: ") or "OutOfMemoryError" in ln][-6:]
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(json.dumps(out, indent=1))
PY
fi
if has auc; then  # test AUC at equal global batch and steps: one pass at AUC_BATCH rows per step, split over
  # 1..N GPUs (AUC_DEVICES), replicated and sharded table, AUC_SEEDS seeds; the whole test split
  for seed in ${AUC_SEEDS:-0 1}; do
    for w in ${AUC_DEVICES:-1 2}; do
      per=$(( ${AUC_BATCH:-1024} / w )) steps=$(( ${AUC_ROWS:-1000000} / ${AUC_BATCH:-1024} ))
      layouts="replicated"; [ "$w" -gt 1 ] && layouts="${AUC_LAYOUTS:-replicated sharded}"
      for layout in $layouts; do
        STEPS=$steps fit "acc-g$w-$layout-s$seed" "$w" "$([ "$w" = 1 ] && echo single || echo ddp)" \
          --model.ranker.attention jagged --data.batch_size "$per" --seed_everything "$seed" \
          --model.table_layout "$layout" --trainer.limit_test_batches 1.0 \
          $([ "$layout" = sharded ] && echo --model.table_exchange alltoall_fixed)
      done
    done
  done
fi
if has modes; then  # 2 GPUs, eager steps (graphs replay dense gradients only), the whole test split
  for mode in $MODES; do
    grad_args=(--model.embedding_grad "$mode")
    fit "jagged-w2-$mode" "${MODE_DEVICES:-2}" ddp --model.ranker.attention jagged --model.cuda_graphs false \
      "${grad_args[@]}" --model.optimizer adagrad --model.lr "${ADAGRAD_LR:-0.02}" \
      --trainer.limit_test_batches 1.0
  done
fi
save
cat "$OUT/${EXPERIMENT}-summary.md"
grep -E "rc=|Traceback|Error" "$log" | tail -30
