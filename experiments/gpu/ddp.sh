#!/usr/bin/env bash
# The multi-GPU run (2 GPUs of one host, NCCL; NVLink multicast off): weak scaling of the jagged
# and SDPA rankers from 1 to 2 GPUs at the paper preset (same batch of 512 per GPU, CUDA-graph
# steps, bf16, max_seq_len 1024), the dense / sparse / densify embedding gradients on 2 GPUs
# (eager steps, Adagrad: the optimizer that treats them alike), and the token balance of the
# sampler on the paper data. Each part runs only if the call's budget still holds it; a later
# call with the returned mlflow.db carried back adds to the same runs table.
# Run from the repo root with the project installed (offline: from wheels), with OUT and
# GIT_COMMIT set (no .git there). Returns $OUT/ddp.log, $OUT/ddp-summary.md, $OUT/mlflow.db,
# $OUT/ddp-token-balance.md.
#   PARTS="data balance scaling modes" bash experiments/gpu/ddp.sh             # everything once
#   CALL_BUDGET_S=200 PARTS=scaling REPEAT_FROM=2 REPEATS=3 LOG=ddp-repeats.log bash experiments/gpu/ddp.sh
#       # more repeats of the scaling runs (named NAME#2, NAME#3) for their spread
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
MODES=${MODES:-"dense sparse densify rows"}
REPEATS=${REPEATS:-1}  # runs of each scaling configuration (named NAME#k from the second on)
REPEAT_FROM=${REPEAT_FROM:-1}  # a later invocation adds repeats REPEAT_FROM..REPEATS
EXTRA=${EXTRA:-}
budget=${CALL_BUDGET_S:-570}
log=$OUT/${LOG:-ddp.log}
left() { echo $((budget - SECONDS)); }
has() { [[ " $PARTS " == *" $1 "* ]]; }
save() {
  cp -f mlflow.db "$OUT/mlflow.db" 2>/dev/null
  python3 experiments/gpu/runs_table.py ddp > "$OUT/ddp-summary.md" 2>> "$log"
}
fit() {  # fit NAME DEVICES STRATEGY ARGS...: one run of the preset, skipped when the budget is short
  local name=$1 devices=$2 strategy=$3; shift 3
  if [ "$(left)" -lt 120 ]; then echo "$name: not started, $(left)s left" | tee -a "$log"; return; fi
  local dist=(--trainer.devices "$devices" --trainer.accelerator "$ACCEL")
  [ "$strategy" = ddp ] && dist+=(--trainer.strategy ddp)
  timeout $(( $(left) - 30 )) python3 -m pipeline fit --config experiments/configs/base.yaml --config "$CONFIG" \
    --data.data_dir "$DATA" --trainer.max_steps "$STEPS" \
    --trainer.limit_val_batches 0 --checkpoint.save_top_k 0 --checkpoint.save_last false \
    --mlflow.experiment_name ddp --mlflow.run_name "$name" "${dist[@]}" "$@" $EXTRA >> "$log" 2>&1
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
    for spec in $SCALING; do  # attention:devices:strategy[:table_sync]
      IFS=: read -r attention devices strategy sync <<< "$spec"
      sync_args=(); [ -n "$sync" ] && sync_args=(--model.table_sync "$sync")
      fit "$attention-w$devices-$strategy${sync:+-$sync}$suffix" "$devices" "$strategy" \
        --model.ranker.attention "$attention" --trainer.limit_test_batches 5 "${sync_args[@]}"
    done
  done
fi
if has modes; then  # 2 GPUs, eager steps (graphs replay dense gradients only), the whole test split
  for mode in $MODES; do  # rows: the dense gradient exchanged as its touched rows (model.table_sync)
    grad_args=(--model.embedding_grad "$mode"); [ "$mode" = rows ] && grad_args=(--model.table_sync rows)
    fit "jagged-w2-$mode" "${MODE_DEVICES:-2}" ddp --model.ranker.attention jagged --model.cuda_graphs false \
      "${grad_args[@]}" --model.optimizer adagrad --model.lr "${ADAGRAD_LR:-0.02}" \
      --trainer.limit_test_batches 1.0
  done
fi
save
cat "$OUT/ddp-summary.md"
grep -E "rc=|Traceback|Error" "$log" | tail -30
