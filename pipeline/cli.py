"""``python -m pipeline fit|validate|test --config base.yaml --config <delta>.yaml [--key value]``.

A LightningCLI over :class:`pipeline.module.RankerModule` and :class:`pipeline.data.RankerData`
with three always-present callbacks configured by their own keys: ``mlflow.*``
(:class:`pipeline.tracking.MLflowRun`), ``perf.*`` (:class:`pipeline.callbacks.PerfMonitor`)
and ``checkpoint.*`` (Lightning's ``ModelCheckpoint``). ``fit`` also tests the final weights on
the test split, in the same MLflow run.

Before anything trains: unknown keys and bad types fail in the parser; a bad backend,
max_seq_len, data set or tracking server raises :class:`pipeline.errors.ConfigError`, whose
message is printed alone, and the exit status is 2. ``--ckpt_path`` continues the MLflow run
stored in the checkpoint.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch
import yaml
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.callbacks.progress import ProgressBar as ProgressBarBase
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.loggers import MLFlowLogger

from pipeline.callbacks import PerfMonitor, ProgressBar
from pipeline.data import RankerData
from pipeline.errors import ConfigError
from pipeline.module import RankerModule
from pipeline.tracking import (
    MLflowRun,
    check_tracking,
    end_run,
    environment_tags,
    fail_active_run,
    log_run_inputs,
    tracking_uri,
)


def _seed_to_int(seed) -> int:
    return 0 if isinstance(seed, bool) else int(seed)


def run_id_from_checkpoint(path: str) -> str | None:
    """The MLflow run id a checkpoint was written by (None for foreign checkpoints)."""
    if not Path(path).is_file():
        raise ConfigError(f"--ckpt_path {path}: no such checkpoint file")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    return ckpt.get("callbacks", {}).get("MLflowRun", {}).get("run_id")


class RankerCLI(LightningCLI):
    def __init__(self, args=None, run: bool = True):
        super().__init__(
            RankerModule,
            RankerData,
            save_config_callback=None,  # the resolved config goes to MLflow instead
            seed_everything_default=0,
            auto_configure_optimizers=False,  # AdamW settings live in model.* (one way)
            args=args,
            run=run,
            parser_kwargs={"description": __doc__.split("\n")[0]},
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {k: v for k, v in LightningCLI.subcommands().items() if k in ("fit", "validate", "test")}

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--torch_num_threads", type=Optional[int], default=None,
            help="intra-op CPU threads of torch (default: torch's choice); 1 is the robust choice on "
            "a small CPU shared with other work, where spinning OpenMP threads stall each other",
        )
        parser.add_lightning_class_args(MLflowRun, "mlflow")
        parser.add_lightning_class_args(PerfMonitor, "perf")
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True})
        parser.link_arguments("seed_everything", "data.seed", compute_fn=_seed_to_int)
        parser.link_arguments("data.spec", "model.data_spec", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        check_tracking(tracking_uri())
        cfg = self.config[self.subcommand]
        if cfg.torch_num_threads is not None:
            if cfg.torch_num_threads <= 0:
                raise ConfigError(f"torch_num_threads must be > 0, got {cfg.torch_num_threads}")
            torch.set_num_threads(cfg.torch_num_threads)
        if cfg.get("ckpt_path"):
            stored = run_id_from_checkpoint(cfg.ckpt_path)
            given = cfg.mlflow.run_id
            if stored and given and stored != given:
                raise ConfigError(f"--mlflow.run_id {given} differs from the run {stored} stored in {cfg.ckpt_path}")
            cfg.mlflow.run_id = given or stored

    def instantiate_trainer(self, **kwargs):
        cfg = self.config[self.subcommand]
        run: MLflowRun = self._get(self.config_init, "mlflow")
        if run.run_name is None:
            run.run_name = f"{cfg.model.ranker.backend}-L{cfg.data.max_seq_len}"
        tags = {
            **environment_tags(),
            "backend": cfg.model.ranker.backend,
            "seed": str(cfg.seed_everything),
            "data_digest": self.datamodule.spec["digest"],
            "data_dir": str(Path(cfg.data.data_dir).resolve()),
        }
        run_id = run.start(tags)
        logger = _RunLogger(
            experiment_name=run.experiment_name, tracking_uri=tracking_uri(), run_id=run_id, log_model=False
        )
        trainer_cfg = self._get(self.config_init, "trainer", default={})
        callbacks = list(trainer_cfg.get("callbacks") or [])
        if trainer_cfg.get("enable_progress_bar") is not False and not any(
                isinstance(c, ProgressBarBase) for c in callbacks):  # no per-step read of the loss
            kwargs["callbacks"] = [*callbacks, ProgressBar()]
        return super().instantiate_trainer(logger=logger, **kwargs)

    def _log_inputs(self) -> None:
        # the dump is the resolved config with plain types (what `--print_config` shows)
        config_yaml = self._parser(self.subcommand).dump(self.config[self.subcommand], skip_none=False)
        params = yaml.safe_load(config_yaml)
        params.pop("ckpt_path", None)
        params["mlflow"].pop("run_id", None)
        run: MLflowRun = self._get(self.config_init, "mlflow")
        meta = Path(self.datamodule.data_dir) / "meta.json"
        log_run_inputs(params, config_yaml, meta, resumed=run.resumed)

    def before_fit(self) -> None:
        self._log_inputs()

    def after_fit(self) -> None:
        self.trainer.test(self.model, datamodule=self.datamodule)
        end_run("FINISHED")

    before_validate = before_test = before_fit

    def after_validate(self) -> None:
        end_run("FINISHED")

    after_test = after_validate


class _RunLogger(MLFlowLogger):
    """MLFlowLogger that ends an interrupted run (Ctrl-C, SIGINT from a sweep) KILLED, not FAILED.

    Lightning finalizes every logger with "failed" from inside its KeyboardInterrupt handler,
    after the callbacks' on_exception: the exception being handled tells the two apart.
    """

    def finalize(self, status: str = "success") -> None:
        if status == "failed" and isinstance(sys.exc_info()[1], KeyboardInterrupt):
            status = "KILLED"
        super().finalize(status)


def main(args: list[str] | None = None) -> None:
    """The CLI entry point: concise messages for configuration errors, FAILED runs on crashes."""
    try:
        RankerCLI(args=args)
    except ConfigError as err:
        fail_active_run()
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except FloatingPointError as err:  # NaN/inf loss: the run is already marked FAILED
        fail_active_run()
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except BaseException as err:
        run_id = fail_active_run()  # errors outside the trainer (its own are handled there)
        if run_id is not None:
            print(f"MLflow run {run_id} marked FAILED ({type(err).__name__}: {err})", file=sys.stderr)
        raise
