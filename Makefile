# Jagged Flash Attention: every entry point of the project. `make help` lists them.
# On a machine whose packages are already installed and that has no network (the GPU
# machine), run any target with `SETUP=none PY=python3`.

SHELL := /bin/bash
VENV ?= .venv
SETUP ?= venv
ifeq ($(SETUP),none)
PY ?= python3
else
PY ?= $(VENV)/bin/python
endif
PRESET ?= small
DATA ?= data/$(PRESET)
ABLATION ?= seq_len
RESULTS ?=
SUITE ?= paper
# the attention layouts to train or profile, one ranker each
ATTENTION ?= dense sdpa jagged
comma := ,
space := $() $()
PROFILE_DIR ?= $(or $(RESULTS),runs)/profile-$(PRESET)
PROFILE_STEPS ?= [30, 5]
GRID ?= small
SWEEP_OUT ?= runs/costmodel/sweep.parquet
PORT ?= 5000
MLFLOW_TRACKING_URI ?= sqlite:///$(CURDIR)/mlflow.db
export MLFLOW_TRACKING_URI
export PYTHONUNBUFFERED := 1

.DEFAULT_GOAL := help
.PHONY: help setup test test-fast test-gpu gpu-check data user-embeddings data-validate data-report experiment ui \
        bench config-sweep costmodel sweep report summary reproduce profile clean

help: ## list every target with one line each
	@grep -hE '^[a-zA-Z_%-]+:.*## ' $(MAKEFILE_LIST) | \
	  awk 'BEGIN {FS = ":.*## "}; {printf "  \033[36m%-26s\033[0m %s\n", $$1, $$2}'
	@echo "  variables: PRESET=$(PRESET) DATA=$(DATA) PY=$(PY) SETUP=$(SETUP) (none: use installed packages)"

ifeq ($(SETUP),none)
setup:
	@true
else
setup: $(VENV)/.installed ## create .venv with every dependency (idempotent; a no-op with SETUP=none)
$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/python || python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	# the CPU wheel first, so that no range in pyproject pulls a multi-GB CUDA build
	$(VENV)/bin/python -m pip install -q 'torch==2.13.0' || $(VENV)/bin/python -m pip install -q 'torch>=2.11,<2.15'
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@
endif

# one pytest worker per core, at most TEST_WORKERS; a test file stays on one worker (its fixtures are built once)
TEST_WORKERS ?= 2
XDIST = $(shell $(PY) -c "import xdist" 2>/dev/null && echo "-n $(TEST_WORKERS) --dist loadfile")

test: setup ## run the whole CPU test suite (Triton kernels through TRITON_INTERPRET=1; TEST_WORKERS=2 processes)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not gpu" $(XDIST) $(PYTEST_ARGS)

test-fast: setup ## the CPU suite without the tests marked slow (end-to-end fits, multi-process runs, sweeps, long interpreter grids): < 2 min
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not gpu and not slow" $(XDIST) $(PYTEST_ARGS)

test-gpu: setup ## run the GPU tests (kernels compiled by Triton, on a CUDA device)
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

GPU_CHECK_ARGS ?= --dtypes bf16,fp32 --dims 64,128
gpu-check: setup ## compile every Triton kernel for sm_90 here, no GPU needed: errors, registers, spills (GPU_CHECK_ARGS)
	env -u TRITON_INTERPRET $(PY) -m experiments gpu-check --ptxas $(GPU_CHECK_ARGS)

data: setup ## generate the PRESET data set (tiny|small|paper|long|timeline_tiny|timeline) under data/PRESET if absent
	@if [ -f $(DATA)/meta.json ]; then echo "$(DATA) exists (delete it to regenerate)"; \
	else $(PY) -m data_gen generate --preset $(PRESET) --out $(DATA); fi

user-embeddings: data ## PRESET=timeline: train the user encoder on DATA and export its daily embeddings (DATA/user_embeddings/; UE_ARGS=... for fit)
	$(PY) -m pipeline.user_embeddings fit --data $(DATA) --out $(DATA)/user_embeddings/encoder.pt $(UE_ARGS)
	$(PY) -m pipeline.user_embeddings export --data $(DATA) --encoder $(DATA)/user_embeddings/encoder.pt \
	  --out $(DATA)/user_embeddings/emb.parquet

data-validate: setup ## validate the PRESET data set (schema, alignment, checksums)
	$(PY) -m data_gen validate $(DATA)

data-report: data ## write length/popularity plots and a summary of the PRESET data
	$(PY) -m data_gen report $(DATA)

experiment: data ## the main job: dense, sdpa and jagged rankers (ATTENTION=a subset) compared in MLflow; table in runs/training/ (RESULTS=root to choose)
	$(PY) -m experiments sweep experiments/ablations/main.yaml --new --data $(DATA) --set name=main-$(PRESET) \
	  --set 'configs=[base, $(PRESET)]' \
	  --set 'grid={model.ranker.attention: [$(subst $(space),$(comma)$(space),$(strip $(ATTENTION)))]}' \
	  --results $(or $(RESULTS),runs) $(EXPERIMENT_ARGS)

# one worker and no job runner (GenAI scorers): MLflow's default, four workers and a runner each importing
# mlflow at once, answers only after half a minute on two cores
ui: setup ## serve the MLflow dashboard on 127.0.0.1:PORT (PORT=5000 by default; the same database as the runs)
	@echo "MLflow on http://127.0.0.1:$(PORT): click 'Model training' (top left) once, then an experiment; the links a sweep prints open there"
	MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(PY) -m mlflow server --backend-store-uri $(MLFLOW_TRACKING_URI) \
	  --host 127.0.0.1 --port $(PORT) --workers 1

bench: setup ## kernel benchmarks against every peer into runs/kernels/<gpu>/ (SUITE=paper|recsys|long|smoke; GPU; RESULTS=experiments/results for the committed ones)
	$(PY) -m experiments bench all --suite $(SUITE) --out '$(or $(RESULTS),runs)/kernels/<gpu>' $(BENCH_ARGS)

config-sweep: setup ## time every launch config of every kernel family on GRID=small|medium|full shapes (GPU; tiny: CPU interpreter) into SWEEP_OUT, resumable (CONFIG_SWEEP_ARGS="--deadline-s 400 --families a,b --mlflow")
	$(if $(filter tiny,$(GRID)),TRITON_INTERPRET=1 )$(PY) -m experiments config-sweep --grid $(GRID) --out $(SWEEP_OUT) \
	  $(if $(filter tiny,$(GRID)),--device cpu) $(CONFIG_SWEEP_ARGS)

costmodel: setup ## cost model from SWEEP_OUT: leave-shapes-out eval, runs/tuning/<gpu>/costmodel.md + plots (RESULTS=root), kernels/configs/<gpu>.json
	$(PY) -m experiments costmodel eval --data $(SWEEP_OUT) --out $(basename $(SWEEP_OUT))-eval.json $(COSTMODEL_ARGS)
	$(PY) -m experiments costmodel report --data $(SWEEP_OUT) --out '$(or $(RESULTS),runs)/tuning/<gpu>' $(COSTMODEL_ARGS)
	$(PY) -m experiments costmodel export --data $(SWEEP_OUT) $(COSTMODEL_ARGS)

sweep: setup ## run one ablation (ABLATION=main|model|auc_parity|history_value|seq_len|sparsity|batch_size|compile|s2|alure|smoke; SWEEP_ARGS=...)
	$(PY) -m experiments sweep experiments/ablations/$(ABLATION).yaml $(SWEEP_ARGS)

# a pattern rule (not .PHONY, which would skip it): one target per experiments/ablations/<name>.yaml
experiment-%: experiments/ablations/%.yaml setup ## run the ablation %.yaml, resumable (SWEEP_ARGS="--dry-run" | "--max-runs N" | "--set k=v")
	$(PY) -m experiments sweep experiments/ablations/$*.yaml $(SWEEP_ARGS)

report: setup ## tables + plots of a sweep into runs/ablations/<name>/<device>/ (PARENT=<run id or name>; RESULTS=experiments/results for the committed ones)
	@test -n "$(PARENT)" || { echo "usage: make report PARENT=<sweep parent run id or name, e.g. seq_len>"; exit 2; }
	$(PY) -m experiments report --parent $(PARENT) --out $(or $(RESULTS),runs) $(REPORT_ARGS)

summary: setup ## experiments/results/REPORT.md: the paper's claims, every target and ablation, from the committed results
	$(PY) -m experiments summary $(if $(RESULTS),--results $(RESULTS))

reproduce: setup ## rerun one MLflow run from its logged config and data digest, compare metrics (RUN=<run id>)
	@test -n "$(RUN)" || { echo "usage: make reproduce RUN=<MLflow run id> [REPRODUCE_ARGS='--rtol 5e-3']"; exit 2; }
	$(PY) -m experiments reproduce --run $(RUN) $(REPRODUCE_ARGS)

profile: data ## trace eager training steps per attention layout (ATTENTION=a subset): attention's share of a step, in PROFILE_DIR
	for a in $(ATTENTION); do $(PY) -m pipeline fit --config experiments/configs/base.yaml \
	  --config experiments/configs/$(PRESET).yaml --data.data_dir $(DATA) --model.ranker.attention $$a \
	  --model.cuda_graphs false --trainer.max_steps 45 --trainer.limit_val_batches 0 \
	  --trainer.limit_test_batches 0 --checkpoint.save_top_k 0 --checkpoint.save_last false \
	  --perf.trace_steps '$(PROFILE_STEPS)' --perf.trace_dir $(PROFILE_DIR)/$$a $(PROFILE_ARGS) || exit 1; done

clean: ## remove caches and checkpoints (keeps data/ and mlflow.db)
	rm -rf .pytest_cache checkpoints lightning_logs
	find . -name __pycache__ -prune -exec rm -rf {} +
