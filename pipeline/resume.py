"""``fit --ckpt_path``: which checkpoints can be resumed, and only with the config they were made with.

:func:`load_checkpoint` reads only a checkpoint of ``pipeline fit`` (never unpickling objects);
:func:`check_resume` raises a ConfigError unless its MLflow run is unfinished and the command
asks for exactly that run's config and data (docs/training.md#resume).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import tempfile
import zipfile
from pathlib import Path

import mlflow
import torch
import yaml
from lightning_fabric.plugins import TorchCheckpointIO
from mlflow.tracking import MlflowClient

from pipeline.errors import ConfigError
from pipeline.tracking import first_line, flatten, shown, tracking_uri

COMPARED = ("model.", "data.", "trainer.", "seed_everything")
# how a run is watched or fed, never what it computes: extra callbacks (EarlyStopping among them:
# converge.yaml keeps no last.ckpt, so such a run restarts), the console, loader workers (they get
# whole batches from the sampler), Lightning's distributed sampler (always off), the item table's
# layout and shards (a checkpoint holds the whole table in every layout)
NOT_COMPARED = {"trainer.callbacks", "trainer.enable_progress_bar", "trainer.enable_model_summary",
                "data.num_workers", "trainer.use_distributed_sampler", "model.table_layout",
                "model.table_shards"}
_MAX_SHOWN = 6


def load_checkpoint(path: str) -> dict:
    """The checkpoint at `path` (memory-mapped, tensors on the CPU) if `pipeline fit` wrote it."""
    where = f"--ckpt_path {path}"
    if not Path(path).is_file():
        raise ConfigError(f"{where}: no such checkpoint file")
    ckpt = read_torch_file(path, where, "checkpoint", "a checkpoint of `pipeline fit`")
    hparams = ckpt.get("hyper_parameters") if isinstance(ckpt, dict) else None
    if not isinstance(hparams, dict) or "ranker" not in hparams or "state_dict" not in ckpt:
        raise ConfigError(f"{where}: not a checkpoint of `pipeline fit` (no ranker weights and hyper-parameters)")
    return ckpt


def read_torch_file(path: str, where: str, noun: str, what: str):
    """What torch.save wrote at `path` (memory-mapped, tensors on the CPU), never unpickling other
    objects (that could run their code); ConfigError "`where`: ..." for an empty, truncated or
    foreign file. noun, what: "checkpoint", "a checkpoint of `pipeline fit`" (for the messages)."""
    if Path(path).stat().st_size == 0:
        raise ConfigError(f"{where}: the file is empty (its writer was killed or the disk was full)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        raise ConfigError(f"{where}: holds Python objects other than tensors and plain values: not {what} "
                          f"(such files are never unpickled: that could run their code)") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as err:
        raise ConfigError(f"{where}: not a readable {noun}, truncated or not written by torch.save "
                          f"({first_line(err)})") from None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, writing each file beside its place and renaming it there: a
    failed write (a full disk) leaves no truncated .ckpt, and its error names the checkpoint."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
        os.close(fd)
        try:
            with open(tmp, "wb") as f:
                f.write(buffer.getbuffer())
            os.replace(tmp, path)
        except OSError as err:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise OSError(err.errno, err.strerror or str(err), str(path)) from None


def checkpoint_run_id(ckpt: dict) -> str | None:
    """The MLflow run id a checkpoint was written by (None when it has none)."""
    return ((ckpt.get("callbacks") or {}).get("MLflowRun") or {}).get("run_id")


def check_resume(path: str, ckpt: dict, requested: dict[str, str], data_digest: str | None, code: str = "unknown",
                 allow_code_change: bool = False, embedding: str | None = None) -> None:
    """Raise ConfigError if the checkpoint's run cannot be resumed with the `requested` config
    (flattened params, as the run logged them) on data of `data_digest`, by the commit `code`
    (unless `allow_code_change`), joining the user embedding file of sha256 `embedding`."""
    run_id = checkpoint_run_id(ckpt)
    if run_id is None:
        hparams = {k: v for k, v in ckpt["hyper_parameters"].items() if k != "data_spec"}
        recorded = _flat({"model": hparams})
        requested = {k: v for k, v in requested.items() if k in recorded}
        trained_on = None
    else:
        run = _run(run_id)
        if run.info.status == "FINISHED":
            raise ConfigError(f"--ckpt_path {path}: its MLflow run {run_id} is FINISHED (trained and tested): "
                              f"resuming would reopen it and log its metrics twice; start a new fit instead")
        recorded, trained_on = recorded_config(run), run.data.tags.get("data_digest")
        _check_code_and_embedding(path, run, code, allow_code_change, embedding)
    diffs = differences(recorded, requested)
    if trained_on and data_digest and trained_on != data_digest:
        diffs.append(f"data digest {data_digest[:16]} (the run trained on {trained_on[:16]})")
    if diffs:
        more = f", and {len(diffs) - _MAX_SHOWN} more" if len(diffs) > _MAX_SHOWN else ""
        raise ConfigError(f"--ckpt_path {path}: the command differs from the run it resumes: "
                          f"{'; '.join(diffs[:_MAX_SHOWN])}{more}. Resume with the run's own config "
                          f"(its config.yaml artifact) and data, or start a new fit")


def _check_code_and_embedding(path: str, run, code: str, allow_code_change: bool, embedding: str | None) -> None:
    tags = run.data.tags
    trained_by = tags.get("git_commit", "unknown")
    if "unknown" not in (trained_by, code) and trained_by != code and not allow_code_change:
        raise ConfigError(f"--ckpt_path {path}: its MLflow run {run.info.run_id} was trained by commit {trained_by} and "
                          f"this code is {code}: the steps before and after would run different code; resume with "
                          f"that code, or pass --allow_code_change true (the run keeps git_commit {trained_by[:12]} "
                          f"and records this one as git_commit.resumed)")
    joined = tags.get("user_embedding.sha256")
    if joined and embedding and joined != embedding:
        raise ConfigError(f"--ckpt_path {path}: the user embedding file changed since its run started (sha256 "
                          f"{embedding[:12]}, the run joined {joined[:12]}): the resumed steps would read another "
                          f"file; resume with the run's file or start a new fit")


def recorded_config(run) -> dict[str, str]:
    """The whole config a run trained with (its config.yaml artifact, flattened as params are),
    or its params where that artifact is missing (params hold only the non-default settings)."""
    try:
        text = mlflow.artifacts.load_text(f"{run.info.artifact_uri.rstrip('/')}/config.yaml")
        config = yaml.safe_load(text)
    except (mlflow.exceptions.MlflowException, OSError, yaml.YAMLError):
        return dict(run.data.params)
    if not isinstance(config, dict):
        return dict(run.data.params)
    config.pop("ckpt_path", None)
    (config.get("mlflow") or {}).pop("run_id", None)
    return _flat(config)


def differences(recorded: dict[str, str], requested: dict[str, str]) -> list[str]:
    """'key=requested (run: recorded)' for every compared key whose values differ."""
    keys = sorted(k for k in set(recorded) | set(requested) if k.startswith(COMPARED) and k not in NOT_COMPARED)
    out = []
    for key in keys:
        have, want = recorded.get(key), requested.get(key)
        if want is not None:
            want = want[:6000]  # params are logged cut to MLflow's limit
        if have != want:
            out.append(f"{key}={_show(want)} (run: {_show(have)})")
    return out


def _show(value: str | None) -> str:
    return "(absent)" if value is None else value if len(value) <= 60 else value[:57] + "..."


def _flat(config: dict, prefix: str = "") -> dict[str, str]:
    return flatten(json.loads(json.dumps(config)), prefix)  # tuples as lists, as in the logged params


def _run(run_id: str):
    try:
        return MlflowClient(tracking_uri()).get_run(run_id)
    except mlflow.exceptions.MlflowException as err:
        raise ConfigError(f"cannot resume MLflow run {run_id} at {shown(tracking_uri())}: "
                          f"{first_line(err)}") from None
