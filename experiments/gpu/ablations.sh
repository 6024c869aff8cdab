#!/usr/bin/env bash
# One GPU-machine call for the ablations: `paper` data if absent, then the PARTS asked
# for, each a resumable sweep bounded by what is left of the call's budget, then its report.
# Run from the repo root with the project installed (offline: from wheels), with OUT and
# GIT_COMMIT set (no .git there). A call cut short loses nothing: rerun the same line (on the
# same warm machine, or on a fresh one with the returned mlflow.db.gz unzipped to ./mlflow.db)
# and finished runs are skipped, while the library's code is the same (a point is done only for
# the code that ran it: experiments.ablation.code_version).
#
#   PARTS="seq_len sparsity" bash experiments/gpu/ablations.sh          # throughput: one run at a time
#   PARTS="auc_parity history_value model profile reproduce" bash experiments/gpu/ablations.sh
#   PARTS=world bash experiments/gpu/ablations.sh   # issue 42: each ranker part vs the data (3 seeds; run twice)
#   PARTS="model+history_value" PARALLEL=3 bash experiments/gpu/ablations.sh   # side by side: 6 runs at once
#
# The accuracy parts may share the call with the GPU kernel tests (both are correctness only;
# never with the benchmarks, whose timings need the GPU alone):
#   PARTS=tests bash experiments/gpu/kernels.sh & PARTS="auc_parity history_value" bash experiments/gpu/ablations.sh; wait
# Parts (NAME, or NAME@axis=label,...[@axis=label,...]: only those points; A+B: A and B side by side): batch_size, seq_len, sparsity, compile, smoke (throughput and memory: runs never share the GPU), alure
# (the user encoder and its export, then the rankers with and without its embedding, each run alone on its GPU), s2 (dense vs
# S2 attention on the `long` data, each run alone on its GPU), history_value,
# model, auc_parity, world (accuracy: PARALLEL runs at once, default 4, 4 loader workers each; the report flags
# their throughput as shared), profile (`make profile`: the training loop's trace per attention layout at the
# PRESET, default paper, into experiments/results/training/<gpu>/profile-<preset>[-b<batch>]/<attention>/),
# reproduce (a jagged fit at max_seq_len 1024 with trainer.deterministic=warn, then `experiments.reproduce` of it:
# metrics beside the original's, GPU tolerance, and the ops without a deterministic kernel, its verdict in
# experiments/results/training/<gpu>/reproduce.json; REPRO_SOURCE=sweep reruns the seq_len run instead).
# GPUS=0,1 (a multi-GPU machine): the throughput sweeps run one point per GPU at once (`experiments.sweep
# --gpus`: each run has its GPU alone and its share of the cores), the accuracy sweeps ACC_GPUS
# (default: PARALLEL runs dealt over GPUS, e.g. 0,1,0,1). Datasets the parts declare are generated
# first, once.
# SWEEP_ARGS: more `experiments sweep` arguments for every part, e.g. "--accept-code <sweep.code_version>"
# (finished runs of that code count as done: only after a library change off the training path).
# REPORT_RESERVE_S (default 75): the seconds a sweep leaves at the end of the budget for its report and the save;
# 30 gives one long run (auc_parity's dense) the call, its report then written from the returned database.
# Reports go to experiments/results/ablations/<name>/<gpu>/. Returns $OUT/ablations.log, $OUT/mlflow.db.gz,
# $OUT/results.tgz (experiments/results/).
set -uo pipefail
: "${OUT:?set OUT}" "${GIT_COMMIT:?set GIT_COMMIT}"
export PYTHONPATH=${PYTHONPATH:-}:$PWD PYTHONUNBUFFERED=1 GIT_COMMIT
export MLFLOW_TRACKING_URI=sqlite:///$PWD/mlflow.db
PARTS=" ${PARTS:-seq_len sparsity history_value model profile} "
budget=${CALL_BUDGET_S:-570}
log=$OUT/ablations.log
save() {
  [ -f mlflow.db ] && gzip -9c mlflow.db > "$OUT/mlflow.db.gz"; tar czf "$OUT/results.tgz" experiments/results 2>/dev/null
  tar czf "$OUT/mlruns.tgz" mlruns 2>/dev/null  # the runs' artifacts (perf/steps.csv, traces, configs)
}
left() { echo $((budget - SECONDS)); }
preset=${PRESET:-paper}  # the data of the runs whose ablation file names none (PRESET=tiny: a CPU check)
slug=$(python3 -c 'from kernels.launch_table import device_slug; print(device_slug())')
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no GPU"; } | tee "$log"
if [ "${PRESET_DATA:-1}" = 1 ]; then  # PRESET_DATA=0: the parts asked for bring their own datasets
  make data PRESET="$preset" SETUP=none PY=python3 >> "$log" 2>&1; echo "data rc=$? at ${SECONDS}s" | tee -a "$log"
fi
python3 - "$preset" $PARTS >> "$log" 2>&1 <<'PY'  # the parts' own datasets, once, before any sweep
import sys
from pathlib import Path
from experiments.ablation import load
for part in {p.split("@")[0] for p in sys.argv[2:]}:
    path = Path(f"experiments/ablations/{part}.yaml")
    if path.is_file():
        other = None if sys.argv[1] == "paper" else f"data/{sys.argv[1]}"  # as sweep() passes --data
        for point in load(path, Path("data"), other, {}).points:
            point.dataset.ensure()
PY
echo "datasets rc=$? at ${SECONDS}s" | tee -a "$log"

sweep() {  # sweep NAME [extra sweep args...]: run until REPORT_RESERVE_S (75) before the budget ends, then report
  local name=$1; shift
  local t=$(( $(left) - ${REPORT_RESERVE_S:-75} ))  # 30: a long run's last minute, the report written elsewhere
  if [ "$t" -lt 60 ]; then echo "$name: not started, ${t}s left" | tee -a "$log"; return; fi
  # on SIGTERM the sweep stops the run in flight (recorded KILLED, resumed by the next call)
  # the files' own datasets on the GPU; --data (it replaces every file-level dataset) only for a check on other data
  local data=(); [ "$preset" != paper ] && data=(--data "data/$preset")
  timeout -k 90 "$t" python3 -m experiments sweep "experiments/ablations/$name.yaml" "${data[@]}" \
    --deadline-s $((t - 60)) --end-s "$t" "$@" ${SWEEP_ARGS:-} >> "$log" 2>&1  # SWEEP_ARGS: words
  echo "$name sweep rc=$? at ${SECONDS}s" | tee -a "$log"
  timeout 45 python3 -m experiments report --parent "$name" --commit "$GIT_COMMIT" --out experiments/results \
    >> "$log" 2>&1
  echo "$name report rc=$? at ${SECONDS}s" | tee -a "$log"
  [ -n "${GROUPED:-}" ] || save  # parts run side by side save once, when all have ended
}

par=${PARALLEL:-4}
through=() accuracy=(--parallel "$par")
if [ -n "${GPUS:-}" ]; then
  IFS=, read -ra ids <<< "$GPUS"
  acc=${ACC_GPUS:-$(for ((i = 0; i < par; i++)); do printf '%s,' "${ids[i % ${#ids[@]}]}"; done)}
  through=(--gpus "$GPUS") accuracy=(--gpus "${acc%,}")
fi
run_part() {
  # NAME@axis=label,label[@axis=label...] runs only those points (e.g. batch_size@batch_size=512,
  # auc_parity@seed_everything=0@attention=dense,jagged)
  local spec=$1 part=${1%%@*} where=() conds c
  IFS=@ read -ra conds <<< "${spec#"$part"}"
  for c in "${conds[@]}"; do [ -n "$c" ] && where+=(--where "$c"); done
  case $part in
    seq_len|sparsity|compile|smoke|batch_size|s2) sweep "$part" "${where[@]}" "${through[@]}" ;;
    history_value|model|auc_parity|world|world_order|world_order_converge|order_peak) sweep "$part" "${where[@]}" "${accuracy[@]}" --set data.num_workers=4 ;;
    alure)  # the user encoder (days 1-12), its daily export, then the ranker sweep; each step once per machine
      ue=data/timeline/user_embeddings
      if [ ! -f "$ue/encoder.pt.json" ] && [ $(( $(left) - 240 )) -lt 120 ]; then  # a fit takes 64 s on an H200
        echo "alure: encoder fit not started, $(left)s left (it needs 120 s + 240 s for the export and a run)" | tee -a "$log"
      elif [ ! -f "$ue/encoder.pt.json" ]; then  # written when the encoder is saved
        timeout $(( $(left) - 240 )) python3 -m pipeline.user_embeddings fit --data data/timeline --embed-dim 128 \
          --dim 64 --max-seq-len 4096 --batch-size 512 --out "$ue/encoder.pt" >> "$log" 2>&1
        echo "alure encoder fit rc=$? at ${SECONDS}s" | tee -a "$log"
      fi
      if [ -f "$ue/encoder.pt.json" ] && [ ! -f "$ue/emb.parquet.json" ]; then
        timeout $(( $(left) - 180 )) python3 -m pipeline.user_embeddings export --data data/timeline \
          --encoder "$ue/encoder.pt" --out "$ue/emb.parquet" --batch-size 1024 >> "$log" 2>&1
        echo "alure encoder export rc=$? at ${SECONDS}s" | tee -a "$log"
      fi
      mkdir -p "experiments/results/ablations/alure/$slug"  # the report reads encoder.json beside it
      cp -f "$ue/encoder.pt.json" "experiments/results/ablations/alure/$slug/encoder.json" 2>/dev/null
      cp -f "$ue/emb.parquet.json" "experiments/results/ablations/alure/$slug/embeddings.json" 2>/dev/null
      if [ -f "$ue/emb.parquet.json" ]; then sweep alure "${where[@]}" "${through[@]}"; fi ;;
    profile)  # PROFILE_BATCHES="default 2048:jagged+sdpa": the preset's batch, then 2048 for two layouts
      for pb in ${PROFILE_BATCHES:-default}; do
        dir="experiments/results/training/$slug/profile-$preset" layouts="dense sdpa jagged" args=""
        if [ "$pb" != default ]; then
          dir+="-b${pb%%:*}" args="--data.batch_size ${pb%%:*}"
          if [[ $pb == *:* ]]; then layouts=${pb#*:}; layouts=${layouts//+/ }; fi
        fi
        timeout $(( $(left) > 200 ? 180 : 30 )) make profile SETUP=none PY=python3 PRESET="$preset" \
          ATTENTION="$layouts" PROFILE_DIR="$dir" PROFILE_ARGS="$args" >> "$log" 2>&1
        echo "profile $pb rc=$? at ${SECONDS}s" | tee -a "$log"
      done; save ;;
    reproduce)  # rerun a jagged run from its logged config (GPU tolerance). REPRO_SOURCE=fit (default): first a
      # fit of the seq_len point (jagged, max_seq_len 1024, 300 steps) with trainer.deterministic=warn, so that
      # torch uses its deterministic kernels and names every op that has none (a warning, collected below);
      # REPRO_SOURCE=sweep: the newest finished REPRO_SWEEP run at REPRO_AXIS=REPRO_LABEL (default seq_len, 1024)
      if [ "${REPRO_SOURCE:-fit}" = fit ] && [ "$(left)" -gt 300 ]; then
        # seq_len.yaml's budget (its `set`) as --key value pairs: the source is that sweep's point
        mapfile -t point_set < <(python3 -c "
import json
from experiments.ablation import read
for k, v in read('experiments/ablations/seq_len.yaml')['set'].items():
    print(f'--{k}'); print(v if isinstance(v, str) else json.dumps(v))")
        timeout $(( ($(left) - 60) / 2 )) python3 -m pipeline fit --config experiments/configs/base.yaml \
          --config "experiments/configs/$preset.yaml" --data.data_dir "data/$preset" "${point_set[@]}" \
          --data.max_seq_len 1024 --model.ranker.attention jagged --trainer.deterministic warn \
          --mlflow.run_name reproduce-source >> "$log" 2>&1
        echo "reproduce source fit rc=$? at ${SECONDS}s" | tee -a "$log"
        filter="attributes.run_name = 'reproduce-source' and attributes.status = 'FINISHED'"
      else
        filter="tags.\`sweep.name\` = '${REPRO_SWEEP:-seq_len}' and tags.\`sweep.axis.attention\` = 'jagged' and tags.\`sweep.axis.${REPRO_AXIS:-max_seq_len}\` = '${REPRO_LABEL:-1024}' and attributes.status = 'FINISHED'"
      fi
      run_id=$(python3 -c "
import mlflow, sys
runs = mlflow.search_runs(search_all_experiments=True, output_format='list', order_by=['attributes.start_time DESC'],
    filter_string=sys.argv[1])
print(runs[0].info.run_id if runs else '')" "$filter")
      if [ -n "$run_id" ] && [ "$(left)" -gt 150 ]; then
        timeout $(( $(left) - 30 )) python3 -m experiments reproduce --run "$run_id" --out experiments/results \
          >> "$log" 2>&1
        echo "reproduce $run_id rc=$? at ${SECONDS}s" | tee -a "$log"
        grep -o "[A-Za-z_.:]* does not have a deterministic implementation" "$log" | sort | uniq -c \
          | sed 's/^/nondeterministic op: /' | tee -a "$log"
      else
        echo "reproduce: no finished ${REPRO_SWEEP:-seq_len} jagged run at ${REPRO_AXIS:-max_seq_len}=${REPRO_LABEL:-1024}, or under 150 s left" | tee -a "$log"
      fi ;;
    *) echo "unknown part $part" | tee -a "$log" ;;
  esac
}
for spec in $PARTS; do
  if [[ $spec != *+* ]]; then run_part "$spec"; continue; fi
  # A+B: the accuracy parts A and B side by side, PARALLEL runs each, so that no run slot idles while
  # one sweep finishes its last points (they share mlflow.db; their lines interleave in the log)
  for sub in ${spec//+/ }; do GROUPED=1 run_part "$sub" & sleep 5; done
  wait; save
done
python3 -m experiments summary --results experiments/results >> "$log" 2>&1  # experiments/results/REPORT.md over what is there now
save
grep -E "rc=|: [0-9]+ (OK|OOM|FAILED|NOT RUN)" "$log" | tail -30
