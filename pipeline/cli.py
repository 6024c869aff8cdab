"""``python -m pipeline fit|validate|test --config base.yaml --config <delta>.yaml [--key value]``.

A LightningCLI over :class:`pipeline.module.RankerModule` and :class:`pipeline.data.RankerData` with
the callbacks ``mlflow.*``, ``perf.*`` and ``checkpoint.*``; ``fit`` also tests, in the same MLflow
run. Bad options, data, tracking store or checkpoint stop it before training with one line and exit
status 2; 1 is a failed run, 130/143 an interrupted one. DDP: ``--trainer.strategy ddp
--trainer.devices N``. How a run works and why: docs/training.md."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Optional, Union

import mlflow
import torch
import yaml
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.callbacks import ModelSummary as LightningModelSummary
from pytorch_lightning.callbacks.progress import ProgressBar as ProgressBarBase
from jsonargparse import ArgumentError
from pytorch_lightning.cli import LightningCLI
from lightning_fabric.plugins import CheckpointIO

from pipeline.callbacks import ModelSummary, PerfMonitor, ProgressBar, RunChecks
from pipeline.data import RankerData
from pipeline.dist import launch_rank_zero, world_size
from pipeline.errors import ConfigError, check_writable
from pipeline.module import RankerModule
from pipeline.optim import TABLE_STATE
from pipeline.signals import StopOnSignal, flush_and_exit
from pipeline.resume import AtomicCheckpointIO, check_resume, checkpoint_run_id, load_checkpoint
from pipeline.tracking import (MLflowRun, RunLogger, check_tracking, end_run, environment_tags, flatten, git_commit,
                               log_run_inputs, logged_steps, run_command, tracking_uri)
from pipeline.user_features import manifest_path


def _seed_to_int(seed) -> int:
    return 0 if isinstance(seed, bool) else int(seed)


def _meta_field(data_dir: str, cast, *keys: str):
    """cast(meta.json[keys...]) of the data, None if unreadable (the data module's own check says
    what is wrong)."""
    try:
        value = json.loads((Path(data_dir) / "meta.json").read_text())
        for key in keys:
            value = value[key]
        return cast(value)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _data_digest(data_dir: str) -> str | None:
    return _meta_field(data_dir, str, "digest")


def _vocab_size(cfg) -> int | None:
    """Rows of the item table: data.vocab_size, else the data's vocabulary (None if unreadable)."""
    given = cfg.data.vocab_size
    return int(given) if given is not None else _meta_field(cfg.data.data_dir, int, "config", "vocab_size")


def _embedding_sha(cfg) -> str | None:
    """The sha256 the manifest of the configured user embedding file gives, if any."""
    emb = cfg.model.ranker.user_embedding
    try:
        return str(json.loads(manifest_path(emb.path).read_text())["sha256"]) if emb else None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the data module's own check says what is wrong


# a parse error raises (main() prints one line, not a usage dump); no abbreviated option names
_PARSING = {"exit_on_error": False, "allow_abbrev": False}


class RankerCLI(LightningCLI):
    def __init__(self, args=None, run: bool = True):
        super().__init__(
            RankerModule,
            RankerData,
            save_config_callback=None,  # the resolved config goes to MLflow instead
            seed_everything_default=0,
            auto_configure_optimizers=False,  # optimizer settings live in model.* (one way)
            args=args,
            run=run,
            parser_kwargs={"description": __doc__.split("\n")[0], **_PARSING,
                           **{cmd: {**_PARSING, "usage": f"python -m pipeline {cmd} [--config FILE ...] [--KEY VALUE ...]"}
                              for cmd in ("fit", "validate", "test")}},
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {k: v for k, v in LightningCLI.subcommands().items() if k in ("fit", "validate", "test")}

    def add_core_arguments_to_parser(self, parser) -> None:
        # the project's options first (--help lists them in this order), Lightning's Trainer last
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=self.subclass_mode_model)
        parser.add_lightning_class_args(self._datamodule_class, "data", subclass_mode=self.subclass_mode_data)
        parser.add_lightning_class_args(PerfMonitor, "perf")
        parser.add_lightning_class_args(MLflowRun, "mlflow")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True})
        parser.add_argument(
            "--torch_num_threads", type=Optional[int], default=None,
            help="intra-op CPU threads of torch (default: torch's choice); 1 is the robust choice on "
            "a small CPU shared with other work, where spinning OpenMP threads stall each other",
        )
        parser.add_argument(
            "--allow_code_change", type=bool, default=False,
            help="with --ckpt_path: resume a run that another commit of the code trained (its git_commit tag "
            "stays; this commit is recorded as git_commit.resumed); refused otherwise",
        )
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({"trainer." + k: v for k, v in self.trainer_defaults.items() if k != "callbacks"})
        # the data module shards across processes itself (token-balanced): not Lightning's sampler
        parser.set_defaults({"trainer.use_distributed_sampler": False})

    def add_arguments_to_parser(self, parser) -> None:
        for split in ("train", "val", "test"):  # Lightning's Union[float, int] reads "1" as 1.0, all batches
            limit = next(a for a in parser._actions if a.dest == f"trainer.limit_{split}_batches")
            limit._typehint = Optional[Union[int, float]]  # "1": one batch, as Lightning's docs mean it
        parser.link_arguments("seed_everything", "data.seed", compute_fn=_seed_to_int)
        parser.link_arguments("data.spec", "model.data_spec", apply_on="instantiate")
        # the ranker's user embedding option tells the data module what to join
        parser.link_arguments("model.ranker.user_embedding", "data.user_embedding")

    def parse_arguments(self, parser, args) -> None:
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            raise ConfigError(parse_error(err, sys.argv[1:] if args is None else args)) from None
        # here, before Lightning replaces the requested model settings by a checkpoint's
        subcommand = self.config.get("subcommand")
        if subcommand:
            self._preflight(subcommand, self.config[subcommand])

    def _preflight(self, subcommand: str, cfg) -> None:
        check_ranges(cfg)
        check_padded_memory(cfg)
        vocab = _vocab_size(cfg)
        check_table_memory(cfg, vocab, training=subcommand == "fit")
        if cfg.trainer.use_distributed_sampler:
            raise ConfigError("trainer.use_distributed_sampler must stay false: the data module shards every split "
                              "across processes itself (balanced by tokens, evaluation without repeated examples)")
        rank_zero = launch_rank_zero()  # the only process that touches the tracking store and writes
        if rank_zero:
            check_tracking(tracking_uri())
        if subcommand == "fit" and rank_zero:
            check_writable("--trainer.default_root_dir", cfg.trainer.default_root_dir)
            if cfg.checkpoint.dirpath:
                check_writable("--checkpoint.dirpath", cfg.checkpoint.dirpath)
        if not cfg.get("ckpt_path"):
            return
        ckpt = load_checkpoint(cfg.ckpt_path)
        check_checkpoint_vocab(cfg.ckpt_path, ckpt, vocab)
        stored, given = checkpoint_run_id(ckpt), cfg.mlflow.run_id
        if stored and given and stored != given:
            raise ConfigError(f"--mlflow.run_id {given} differs from the run {stored} stored in {cfg.ckpt_path}")
        if subcommand == "fit" and rank_zero:
            params = flatten(self._resolved(subcommand)[1])
            check_resume(cfg.ckpt_path, ckpt, params, _data_digest(cfg.data.data_dir), code=git_commit(),
                         allow_code_change=cfg.allow_code_change, embedding=_embedding_sha(cfg))
        cfg.mlflow.run_id = given or stored

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand]
        if cfg.torch_num_threads is not None:
            torch.set_num_threads(cfg.torch_num_threads)
            # else Lightning's DDP launcher sets every process to cores / processes threads
            os.environ["OMP_NUM_THREADS"] = str(cfg.torch_num_threads)

    def instantiate_trainer(self, **kwargs):
        cfg = self.config[self.subcommand]
        run: MLflowRun = self._get(self.config_init, "mlflow")
        self.datamodule.load_splits(self.subcommand)  # fully validated before a run is recorded
        trainer_cfg = self._get(self.config_init, "trainer", default={})
        callbacks = list(trainer_cfg.get("callbacks") or [])
        if trainer_cfg.get("enable_progress_bar") is False:  # the switch wins over a config's bar (converge.yaml)
            callbacks = [c for c in callbacks if not isinstance(c, ProgressBarBase)]
        elif not any(isinstance(c, ProgressBarBase) for c in callbacks):  # no per-step read of the loss
            callbacks.append(ProgressBar())
        if trainer_cfg.get("enable_model_summary") is not False and not any(
                isinstance(c, LightningModelSummary) for c in callbacks):  # no FLOPs column of zeros
            callbacks.append(ModelSummary())
        callbacks += [RunChecks(), StopOnSignal()]  # no misleading validation; every rank stops at one batch
        kwargs["callbacks"] = callbacks
        plugins = trainer_cfg.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):  # no truncated .ckpt on a full disk
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        if not launch_rank_zero():
            return super().instantiate_trainer(logger=False, **kwargs)
        if run.run_name is None:
            run.run_name = f"{cfg.model.ranker.attention}-L{cfg.data.max_seq_len}"
        tags = {
            **environment_tags(),
            "attention": cfg.model.ranker.attention,
            "seed": str(cfg.seed_everything),
            "data_digest": self.datamodule.spec["digest"],
            "data_dir": str(Path(cfg.data.data_dir).resolve()),
        }
        run_id = run.start(tags)
        logger = RunLogger(
            experiment_name=run.experiment_name, tracking_uri=tracking_uri(), run_id=run_id, log_model=False,
            logged=logged_steps(run_id) if run.resumed else None,
        )
        trainer = super().instantiate_trainer(logger=logger, **kwargs)
        mlflow.set_tag("world_size", str(trainer.world_size))
        return trainer

    def _resolved(self, subcommand: str) -> tuple[str, dict]:
        """(YAML, dict) of the resolved config with plain types (what `--print_config` shows),
        without what names this invocation rather than the run (ckpt_path, allow_code_change, mlflow.run_id)."""
        return resolved_config(self._parser(subcommand), self.config[subcommand])

    def _params(self, subcommand: str, params: dict) -> dict:
        """The params a run shows: the settings that differ from the code's defaults, and the few
        that say what ran whatever their value (the whole config is the config.yaml artifact)."""
        parser = self._parser(subcommand)
        defaults = flatten(resolved_config(parser, parser.get_defaults(), validate=False)[1])
        return {k: v for k, v in flatten(params).items() if k in ALWAYS_PARAMS or defaults.get(k) != v}

    def _log_inputs(self) -> None:
        config_yaml, params = self._resolved(self.subcommand)
        run: MLflowRun = self._get(self.config_init, "mlflow")
        meta = Path(self.datamodule.data_dir) / "meta.json"
        log_run_inputs(self._params(self.subcommand, params), config_yaml, meta, resumed=run.resumed)
        self._log_user_embedding()

    def _log_user_embedding(self) -> None:
        """The joined embedding file's identity and, per split, the examples whose user had none."""
        dm = self.datamodule
        if dm.user_embedding is None or not dm.user_embedding_stats:
            return
        mlflow.set_tags({"user_embedding.sha256": dm.user_embedding_manifest["sha256"],
                         "user_embedding.encoder_run_id": str(dm.user_embedding_manifest.get("encoder_run_id", ""))})
        for split, st in dm.user_embedding_stats.items():
            mlflow.log_metrics({f"data/{split}_user_embedding_missing": st.missing,
                                f"data/{split}_user_embedding_missing_share": st.missing_share})
            print(f"user embeddings ({split}): {st.missing:,} of {st.rows:,} examples ({st.missing_share:.1%}) have "
                  f"none as of day - {dm.user_embedding.lag_days}: they use the learned unknown vector", flush=True)

    def before_fit(self) -> None:
        if launch_rank_zero():
            self._log_inputs()

    def after_fit(self) -> None:
        weights, step = self._test_weights()
        if self.trainer.is_global_zero:  # which weights the test/* metrics are of
            mlflow.log_metric("test/weights_step", step)
        self.trainer.test(self.model, datamodule=self.datamodule, ckpt_path=weights)
        end_run("FINISHED")

    def _test_weights(self) -> tuple[str | None, int]:
        """('best', its step) when the checkpoint callback watches a metric (checkpoint.monitor) and
        kept a checkpoint: with early stopping on val/auc, the weights at the validation peak rather
        than the final ones; else (None, the last step): the final weights."""
        ckpt = self.trainer.checkpoint_callback
        if ckpt is not None and ckpt.monitor and ckpt.best_model_path:
            found = re.search(r"step=(\d+)", Path(ckpt.best_model_path).name)
            if found:
                return "best", int(found.group(1))
        return None, self.trainer.global_step

    before_validate = before_test = before_fit

    def after_validate(self) -> None:
        end_run("FINISHED")

    after_test = after_validate


def _count_or_fraction(v) -> bool:
    return v is None or (v >= 0 and (v <= 1 or v % 1 == 0))  # Lightning reads 2.0 as 2 batches


# what Lightning, torch and the callbacks would refuse with a traceback, some of them after the run
# has started (log_every_n_steps 0: a ZeroDivisionError at the first step): value check, what it must be
RANGES = {
    "trainer.max_epochs": (lambda v: v is None or v >= -1, "an integer >= -1 (-1: no limit)"),
    "trainer.max_steps": (lambda v: v >= -1, "an integer >= -1 (-1: no limit)"),
    "trainer.log_every_n_steps": (lambda v: v is None or v >= 1, "an integer >= 1"),
    "trainer.limit_train_batches": (_count_or_fraction, "a fraction in [0, 1] or a number of batches >= 0"),
    "trainer.limit_val_batches": (_count_or_fraction, "a fraction in [0, 1] or a number of batches >= 0"),
    "trainer.limit_test_batches": (_count_or_fraction, "a fraction in [0, 1] or a number of batches >= 0"),
    "trainer.val_check_interval": (lambda v: v is None or v > 0, "> 0 (a fraction of an epoch or a number of steps)"),
    "trainer.check_val_every_n_epoch": (lambda v: v is None or v >= 1, "an integer >= 1"),
    "trainer.accumulate_grad_batches": (lambda v: v >= 1, "an integer >= 1"),
    "model.lr": (lambda v: math.isfinite(v) and v > 0, "a number > 0"),
    "model.weight_decay": (lambda v: math.isfinite(v) and v >= 0, "a number >= 0"),
    "perf.warmup_steps": (lambda v: v >= 0, "an integer >= 0"),
    "checkpoint.every_n_train_steps": (lambda v: v is None or v >= 0, "an integer >= 0 (0: none)"),
    "checkpoint.every_n_epochs": (lambda v: v is None or v >= 0, "an integer >= 0 (0: none)"),
    "checkpoint.save_top_k": (lambda v: v >= -1, "an integer >= -1 (-1: every checkpoint)"),
    "seed_everything": (lambda v: isinstance(v, bool) or 0 <= v < 2**32, "an integer in [0, 2^32)"),
    "torch_num_threads": (lambda v: v is None or v > 0, "an integer > 0"),
}


def check_ranges(cfg) -> None:
    """ConfigError naming the first option in RANGES whose value cannot work."""
    for key, (ok, what) in RANGES.items():
        value = cfg.get(key)
        try:
            good = ok(value)
        except TypeError:  # a value of another type than the check expects
            good = False
        if not good:
            raise ConfigError(f"{key} must be {what}, got {value}")


def check_padded_memory(cfg) -> None:
    """ConfigError when a padded layout (dense, sdpa) at data.max_seq_len needs, for one tensor of a
    step alone, more memory than the device has: every history is padded to max_seq_len items."""
    ranker, n = cfg.model.ranker, cfg.data.max_seq_len
    if ranker.attention == "jagged" or n <= 0:
        return
    rows = max(cfg.data.batch_size, cfg.data.eval_batch_size or 0) + 1  # a bucket's batch: one padding sequence
    need = {f"one [{rows}, {n:,}, {ranker.embed_dim}] float32 activation": rows * n * ranker.embed_dim * 4}
    if ranker.attention == "dense":
        need[f"the [{rows}, {ranker.num_heads}, {n:,}, {n:,}] attention scores"] = rows * ranker.num_heads * n * n * 4
    what, size = max(need.items(), key=lambda kv: kv[1])
    gpu = _on_gpu(cfg)
    have = _memory(gpu)
    if size > have:
        raise ConfigError(f"data.max_seq_len {n:,} with the padded layout {ranker.attention}: every history is padded "
                          f"to {n:,} items, and {what} alone takes {_gib(size)}, more than the {_gib(have)} of "
                          f"{'the GPU' if gpu else 'this machine'}; use model.ranker.attention jagged or a smaller "
                          f"data.max_seq_len")


def _processes(cfg) -> tuple[int, int]:
    """(processes on this machine, processes in all) that trainer.devices and num_nodes ask for."""
    devices, gpu = cfg.trainer.devices, _on_gpu(cfg)
    if isinstance(devices, (list, tuple)):
        local = len(devices)
    elif str(devices).lstrip("-").isdigit() and int(devices) > 0:
        local = int(devices)
    elif "," in str(devices):
        local = len([d for d in str(devices).split(",") if d.strip()])
    else:  # auto or -1: every GPU, one CPU process
        local = max(torch.cuda.device_count(), 1) if gpu else 1
    return local, local * max(int(cfg.trainer.num_nodes or 1), 1)


def _on_gpu(cfg) -> bool:
    return cfg.trainer.accelerator in ("gpu", "cuda") or (cfg.trainer.accelerator == "auto" and torch.cuda.is_available())


def _memory(gpu: bool, processes: int = 1) -> int:
    """Bytes of one GPU where `gpu` and CUDA is there, else the host's memory over `processes`."""
    if gpu and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // processes


def check_table_memory(cfg, vocab: int | None, training: bool = True) -> None:
    """ConfigError when model.table_shards does not divide the world size, or when one process's part
    of the item table (all of it replicated, every S-th row sharded over S processes), with its
    gradient and optimizer state when `training`, needs more memory than its device has."""
    model, (local, world) = cfg.model, _processes(cfg)
    sharded, shards = model.table_layout == "sharded", model.table_shards or world
    if sharded and world % shards:
        raise ConfigError(f"model.table_shards {shards} does not divide the world size {world} (trainer.devices x "
                          f"trainer.num_nodes): every process must hold one shard of one whole table")
    if vocab is None:
        return
    (per_element, per_row, scratch), dim = TABLE_STATE.get(model.optimizer, (2, 0, 0)), model.ranker.embed_dim
    grad = model.embedding_grad != "sparse"  # a sparse gradient holds a step's rows, not the table's
    row = 4 * (dim * (1 + grad * (1 + scratch) + per_element) + per_row) if training else 4 * dim  # bytes a row
    rows = -(-vocab // shards) if sharded else vocab
    gpu = _on_gpu(cfg) and torch.cuda.is_available()
    have = _memory(gpu, local)
    if rows * row > have:
        where = f"each of {shards} processes' shard" if sharded else "one process's replica"
        extra = f" with its {'gradient and ' * grad}{model.optimizer} state" if training else ""
        raise ConfigError(f"the item table of {vocab:,} x {model.ranker.embed_dim} float32 rows does not fit: {where} "
                          f"({rows:,} rows){extra} takes {_gib(rows * row)}, more than the {_gib(have)} of "
                          f"{'a GPU' if gpu else 'a process'}; shard it (model.table_layout sharded) over at least "
                          f"{-(-vocab * row // have)} processes, or use a smaller table")


def check_checkpoint_vocab(path: str, ckpt: dict, vocab: int | None) -> None:
    """ConfigError when the checkpoint's item table has another number of rows than the data's."""
    table = ckpt["state_dict"].get("model.embed.item.weight")
    if vocab is not None and table is not None and table.shape[0] != vocab:
        raise ConfigError(f"--ckpt_path {path}: its item table has {table.shape[0]:,} rows, the data set (or "
                          f"data.vocab_size) has {vocab:,} items: a checkpoint loads only into a table of its size")


def _gib(size: int) -> str:
    return f"{size / 2**30:,.0f} GiB" if size >= 2**30 else f"{size / 2**20:,.0f} MiB"


def parse_error(err: ArgumentError, argv: list[str]) -> str:
    """One line for a parse error, naming the config file that holds an unknown key."""
    text = " ".join(str(err).split())
    configs = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
    if "Problems parsing config" in text:  # YAML syntax: jsonargparse names no file, yaml does
        for path in configs:
            try:
                yaml.safe_load(Path(path).read_text())
            except yaml.YAMLError as yerr:
                mark = getattr(yerr, "problem_mark", None)
                where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
                problem = getattr(yerr, "problem", None) or "not valid YAML"
                return f"{where}: {problem}; `python -m pipeline fit --help` lists the options"
            except OSError:
                continue
    bad = re.search(r"does not accept option '([^']+)'", text)
    if bad:
        key = bad.group(1)
        for path in configs:
            try:
                flat = flatten(yaml.safe_load(Path(path).read_text()) or {})
            except (OSError, yaml.YAMLError, AttributeError):
                continue
            if key in flat or any(k.startswith(key + ".") for k in flat):
                text = f"{path}: unknown key '{key}' ({text})"
    return f"{text}; `python -m pipeline fit --help` lists the options"


# shown as params of every run, default or not: what a reader of the runs table compares first
ALWAYS_PARAMS = {"model.ranker.attention", "data.batch_size", "data.max_seq_len", "data.data_dir", "seed_everything",
                 "trainer.precision", "trainer.max_epochs", "trainer.max_steps", "model.cuda_graphs"}


def resolved_config(parser, cfg, validate: bool = True) -> tuple[str, dict]:
    """(YAML, dict) of `cfg` with every key, None values included, without the keys that name an
    invocation rather than a run (ckpt_path, allow_code_change, mlflow.run_id)."""
    config_yaml = parser.dump(cfg, skip_validation=not validate, skip_unset=False)
    params = yaml.safe_load(config_yaml)
    params.pop("ckpt_path", None)
    params.pop("allow_code_change", None)
    params.get("mlflow", {}).pop("run_id", None)
    return config_yaml, params


def main(args: list[str] | None = None) -> None:
    """The CLI entry point: one line for expected failures, FAILED/KILLED runs, the exit status.
    A process of a distributed run that failed exits at once (its run already ended): the
    interpreter's teardown (NCCL's) could wait forever on peers left in a collective."""
    try:
        status = run_command(lambda: RankerCLI(args=args))
    except Exception:
        if world_size() == 1:
            raise
        traceback.print_exc()
        status = 1
    if status and world_size() > 1:
        flush_and_exit(status)
    if status:
        raise SystemExit(status)
