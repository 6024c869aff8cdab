"""Run an ablation file: one ``python -m pipeline fit`` per grid point, children of one MLflow parent.

    python -m experiments sweep experiments/ablations/seq_len.yaml [--dry-run] [--set KEY=VALUE] ...
    make experiment-seq_len [SWEEP_ARGS="--max-runs 3"]

A rerun resumes (docs/experiments.md). Exit 0 when every point finished or is a recorded OOM, 1
when some did not, 2 for a bad file, data set or tracking URI, or a sweep of it running already."""

from __future__ import annotations

import argparse
import json
import queue
import re
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from experiments import parser, runs as runs_
from experiments.ablation import (Ablation, Point, cli_value, code_version, fit_args_error, load, parse_set, split_set)
from experiments.proc import (TAIL_BYTES, Slot, child_env, device_slots, error_line, failure_line, hold_lock,
                              lock_path, safe_name, sqlite_file, stream)
from experiments.report import write_table
from pipeline.errors import ConfigError, command
from pipeline.runenv import REPO_ROOT

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient


FIT_COMMAND = (sys.executable, "-m", "pipeline", "fit")  # tests swap in a wrapper that injects failures
_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|CUBLAS_STATUS_ALLOC_FAILED")


def fit_command(abl: Ablation, point: Point, parent_id: str) -> list[str]:
    """`python -m pipeline fit` for one point, a child run of the parent `parent_id`."""
    cmd = list(FIT_COMMAND)
    for cfg in abl.configs:
        cmd += ["--config", str(cfg)]
    for key, value in point.overrides.items():
        cmd += [f"--{key}", cli_value(value)]
    return cmd + ["--data.data_dir", str(point.dataset.dir), "--mlflow.experiment_name", abl.experiment,
                  "--mlflow.parent_run_id", parent_id, "--mlflow.run_name", abl.run_name(point)]


class Sweep:
    lock_fds: tuple[int, ...] = ()  # the sweep's lock, inherited by every run it starts

    def __init__(self, abl: Ablation, args: argparse.Namespace, client: MlflowClient):
        import psutil

        from pipeline.tracking import tracking_uri

        self.abl, self.args, self.uri = abl, args, tracking_uri()
        # --end-s and --deadline-s count from the process's start: the caller's clock started then
        self.t_start = time.monotonic() - (time.time() - psutil.Process().create_time())
        self.client = client
        exp = self.client.get_experiment_by_name(abl.experiment)
        self.experiment_id = exp.experiment_id if exp else None  # created when the sweep runs
        self.parent: Run | None = None
        self.hashes: dict[str, str] = {}  # point name -> config hash
        self.slots = device_slots(args.gpus)
        self.parallel = len(self.slots) or max(1, args.parallel)  # runs at once
        self.timeout_s = args.timeout or abl.timeout_s  # of one run
        self._free: queue.Queue[Slot] = queue.Queue()  # the slots no run holds
        for slot in self.slots:
            self._free.put(slot)

    @property
    def command(self) -> str:
        return "python -m experiments sweep " + shlex.join(self.args.argv)

    # --- the parent ------------------------------------------------------------------------
    def existing_parent(self) -> Run | None:
        if self.args.new or self.experiment_id is None:
            return None
        try:
            return runs_.find_parent(self.client, self.abl.name, [self.experiment_id])
        except ConfigError:
            return None

    def open_parent(self) -> str:
        from pipeline.tracking import environment_tags

        if self.experiment_id is None:  # artifacts beside a sqlite store, wherever the sweep starts
            db = sqlite_file(self.uri)
            self.experiment_id = self.client.create_experiment(
                self.abl.experiment, artifact_location=str(db.parent / "mlruns") if db else None)
        parent = self.existing_parent()
        axes = {a: list(dict.fromkeys(p.labels[a] for p in self.abl.points)) for a in self.abl.axes}
        tags = {
            **environment_tags(), "sweep.role": "parent", "sweep.name": self.abl.name,
            "sweep.file": str(self.abl.path.relative_to(REPO_ROOT) if self.abl.path.is_relative_to(REPO_ROOT)
                              else self.abl.path),
            "sweep.description": self.abl.description, "sweep.axes": json.dumps(axes),
            "sweep.report": json.dumps(self.abl.report),
            "sweep.set": json.dumps({**(self.abl.raw.get("set") or {}), **split_set(parse_set(self.args.set))[1]}),
            "sweep.command": self.command,
        }
        if parent is None:
            run = self.client.create_run(self.experiment_id, run_name=self.abl.name, tags=tags)
            print(f"MLflow parent run {run.info.run_id} ({self.abl.name}), experiment {self.abl.experiment}")
        else:
            run = parent
            self.client.update_run(run.info.run_id, status="RUNNING")
            for k, v in tags.items():
                self.client.set_tag(run.info.run_id, k, v)
            print(f"resuming MLflow parent run {run.info.run_id} ({self.abl.name})")
        self.client.log_artifact(run.info.run_id, str(self.abl.path))
        self.parent = self.client.get_run(run.info.run_id)
        return run.info.run_id

    def previous(self) -> dict[str, list[Run]]:
        """Children of the parent by config hash; stale RUNNING ones (a killed sweep) are ended KILLED."""
        out: dict[str, list[Run]] = {}
        if self.parent is None:
            return out
        for run in runs_.child_runs(self.parent):
            if run.info.status == "RUNNING" and not self.args.dry_run:
                self.client.set_tag(run.info.run_id, "status", "KILLED")
                self.client.set_terminated(run.info.run_id, "KILLED")
                run = self.client.get_run(run.info.run_id)
            out.setdefault(run.data.tags.get("sweep.config_hash", ""), []).append(run)
        return out

    def expected_seconds(self) -> dict[str, float]:
        """Point name -> the seconds its earlier runs (any code version) say it needs: the median whole-process
        wall time (``sweep/process_wall_s``, start-up and data loading included, else the MLflow span) of
        its finished runs, or the longest a killed one ran (a lower bound) where that is longer."""
        done, cut = {}, {}
        for run in (r for runs in self._previous.values() for r in runs):
            name, end = run.data.tags.get("sweep.point"), run.info.end_time
            wall = run.data.metrics.get("sweep/process_wall_s")
            if wall is None and end:
                wall = (end - run.info.start_time) / 1000
            if not name or wall is None:
                continue
            status = runs_.run_status(run)
            if status == "OK":
                done.setdefault(name, []).append(wall)
            elif status == "KILLED":
                cut[name] = max(cut.get(name, 0.0), wall)
        return {n: max(cut.get(n, 0.0), statistics.median(done[n]) if n in done else 0.0) for n in {*cut, *done}}

    def done_status(self, previous: list[Run]) -> str | None:
        statuses = {runs_.run_status(r) for r in previous}
        return "OK" if "OK" in statuses else "OOM" if "OOM" in statuses and not self.args.retry_oom else None

    def point_hash(self, point: Point, digest: str | None, previous: dict[str, list[Run]]) -> tuple[str, str | None]:
        """(config hash, done status): this code's, else an --accept-code version's that finished."""
        h = self.abl.config_hash(point, digest)
        done = self.done_status(previous.get(h, []))
        accepted = (self.abl.config_hash(point, digest, c) for c in self.args.accept_code if digest and not done)
        old = next((o for o in accepted if self.done_status(previous.get(o, [])) == "OK"), None)
        return (old, "OK") if old else (h, done)

    # --- one point -----------------------------------------------------------------------
    def child_tags(self, point: Point, config_hash: str, slot: Slot | None = None) -> dict[str, str]:
        """sweep.parallel: how many runs shared this run's device at most (1: it had it alone)."""
        device = {} if slot is None else {"sweep.gpu": slot.gpu, "sweep.concurrent_runs": str(len(self.slots))}
        return {"sweep.name": self.abl.name, "sweep.point": point.name, "sweep.config_hash": config_hash,
                "sweep.code_version": code_version(),
                "sweep.overrides": json.dumps(point.overrides, default=str)[:5000],
                "sweep.parallel": str(slot.sharing if slot else self.parallel), **device,
                **{f"sweep.axis.{a}": label for a, label in point.labels.items()}}

    def find_child(self, config_hash: str, known: set[str]) -> Run | None:
        """The run the child process created: the newest with this hash that was not there before."""
        return runs_.new_run(self.client, [self.experiment_id],
                             f"tags.mlflow.parentRunId = '{self.parent.info.run_id}' and "  # hex ids: no quoting
                             f"tags.`sweep.config_hash` = '{config_hash}'", known)

    def record(self, point: Point, config_hash: str, child: Run | None, status: str, output: str,
               error: str | None, wall_s: float | None, tags: dict[str, str] | None = None,
               log: Path | None = None) -> str:
        """Tag the child with its outcome (`log`: its whole output); a run that never started gets a
        record of its own."""
        if child is None:
            child = self.client.create_run(
                self.experiment_id, run_name=self.abl.run_name(point),
                tags={"mlflow.parentRunId": self.parent.info.run_id, **(tags or self.child_tags(point, config_hash))})
        run_id = child.info.run_id
        self.client.set_tag(run_id, "status", status)
        if wall_s is not None:
            self.client.log_metric(run_id, "sweep/process_wall_s", wall_s)
        if log is not None:
            self.client.log_artifact(run_id, str(log), "sweep")
        if status != "OK":
            self.client.set_tag(run_id, "sweep.error", error or "")
            self.client.log_text(run_id, output[-TAIL_BYTES:], "sweep/output_tail.txt")
            if self.client.get_run(run_id).info.status in ("RUNNING", "FINISHED"):
                self.client.set_terminated(run_id, "KILLED" if status == "KILLED" else "FAILED")
        return run_id

    def run_point(self, point: Point, config_hash: str) -> str:
        if not self.slots:
            return self._run_point(point, config_hash, None)
        slot = self._free.get()  # at most len(--gpus) runs at once
        try:
            return self._run_point(point, config_hash, slot)
        finally:
            self._free.put(slot)

    def _run_point(self, point: Point, config_hash: str, slot: Slot | None) -> str:
        cmd = fit_command(self.abl, point, self.parent.info.run_id)
        tags = self.child_tags(point, config_hash, slot)
        env = child_env(tags)
        if slot is not None:
            env["CUDA_VISIBLE_DEVICES"] = slot.gpu
            cmd = slot.pin(cmd)
        known = {r.info.run_id for r in runs_.child_runs(self.parent)}
        log, t0 = self._logs / f"{self.abl.points.index(point) + 1:03d}-{safe_name(point.name)}.log", time.perf_counter()
        try:
            with open(log, "wb") as out:
                rc, output, timed_out = stream(cmd, env, self.timeout_s,
                                               prefix=f"[{point.name}] " if self.parallel > 1 else "",
                                               stop=self._stop, pass_fds=self.lock_fds, log=out, quiet=True)
        except KeyboardInterrupt:  # a run that FINISHED before the signal is a result; else it is KILLED
            child = self.find_child(config_hash, known)
            done = child is not None and child.info.status == "FINISHED"
            self.record(point, config_hash, child, "OK" if done else "KILLED", "", "interrupted (Ctrl-C)",
                        time.perf_counter() - t0, tags, log)
            raise
        wall = time.perf_counter() - t0
        child = self.find_child(config_hash, known)
        if rc == 0 and child is not None and child.info.status == "FINISHED":
            status, error = "OK", None
        elif timed_out:
            status, error = "KILLED", f"timed out after {self.timeout_s:.0f} s"
        elif _OOM.search(output):
            status, error = "OOM", error_line(output)
        else:
            status = "FAILED"
            error = failure_line(rc, output) if rc != 0 else "exited 0 without a FINISHED MLflow run"
        self.record(point, config_hash, child, status, output, error, wall, tags, log)
        return status

    # --- the whole grid --------------------------------------------------------------------
    def selected(self) -> list[Point]:
        points = self.abl.points
        for cond in self.args.where:
            axis, _, labels = cond.partition("=")
            if axis not in self.abl.axes:
                raise ConfigError(f"--where {cond}: {axis!r} is not an axis ({', '.join(self.abl.axes)})")
            points = [p for p in points if p.labels[axis] in labels.split(",")]
        return points

    def plan(self) -> int:
        """--dry-run: what each point would do, without generating data or running anything."""
        self.parent = self.existing_parent()
        previous = self.previous()
        print(f"ablation {self.abl.name}: {len(self.abl.points)} points, parent "
              f"{self.parent.info.run_id if self.parent else '(new)'}, tracking {self.uri}")
        points = self.selected()
        invalid = self.invalid_points(points)
        for i, point in enumerate(points):
            digest = point.dataset.digest()
            h, done = self.point_hash(point, digest, previous)
            data = str(point.dataset.dir) + ("" if digest else " (absent: generated first)")
            action = f"INVALID ({invalid[point.name]})" if point.name in invalid else f"skip ({done})" if done else "run"
            print(f"[{i + 1}] {point.name}: {action}; hash {h if digest else '(after generation)'}; data {data}")
            print("    python " + " ".join(fit_command(self.abl, point, "<parent>")[1:]))
        if invalid:
            print(f"error: {len(invalid)} point(s) would be refused by `pipeline fit`: fix the ablation file",
                  file=sys.stderr)
        return 2 if invalid else 0

    def invalid_points(self, points: list[Point]) -> dict[str, str]:
        """Point name -> why `pipeline fit` would refuse its arguments (a value's type, a key)."""
        errors = {p.name: fit_args_error(fit_command(self.abl, p, "<parent>")[len(FIT_COMMAND):]) for p in points}
        return {name: error for name, error in errors.items() if error}

    def run(self) -> int:
        points, results = self.selected(), {}
        invalid = self.invalid_points(points)
        if invalid:
            name, error = next(iter(invalid.items()))
            raise ConfigError(f"{self.abl.path}: {len(invalid)} point(s) would be refused by `pipeline fit`, "
                              f"e.g. {name}: {error}")
        parent_id = self.open_parent()
        self._previous, self._executed = self.previous(), 0
        self._logs = Path(tempfile.mkdtemp(prefix=f"sweep-{safe_name(self.abl.name)}-"))
        print(f"every run's whole output: {self._logs}/ (and in its MLflow artifacts, sweep/)")
        self._needs = self.expected_seconds()
        self._lock, self._stop = threading.Lock(), threading.Event()
        jobs = [(f"=== [{i + 1}/{len(points)}] {self.abl.name}: {p.name}", p) for i, p in enumerate(points)]
        try:
            if self.parallel == 1:
                for head, point in jobs:
                    results[point.name] = self.attempt(head, point)
            else:
                with ThreadPoolExecutor(self.parallel) as pool:
                    futures = {p.name: pool.submit(self.attempt, head, p) for head, p in jobs}
                    try:
                        for name, future in futures.items():
                            results[name] = future.result()
                    except KeyboardInterrupt:  # end the runs in flight (they record themselves KILLED)
                        self._stop.set()
                        pool.shutdown(wait=True, cancel_futures=True)
                        raise
        except KeyboardInterrupt:
            self.client.set_terminated(parent_id, "KILLED")
            print("\ninterrupted: the parent run is marked KILLED; rerun the same command to resume", file=sys.stderr)
            return 130
        return self.finish(parent_id, results)

    def attempt(self, head: str, point: Point) -> str:
        """One point: its data (generated once), skipped if done, else run; -> its status."""
        if self._stop.is_set():
            return "NOT RUN"
        try:
            with self._lock:  # two points may share a data set: generate it once
                digest = point.dataset.ensure()
        except ConfigError as err:
            h = self.hashes[point.name] = self.abl.config_hash(point, None)
            print(f"{head}: FAILED before starting: {err}", file=sys.stderr)
            self.record(point, h, None, "FAILED", str(err), str(err), None)
            return "FAILED"
        h, done = self.point_hash(point, digest, self._previous)
        self.hashes[point.name] = h
        if done:
            print(f"{head}: skipped, already {done} (hash {h})", flush=True)
            return done
        with self._lock:
            elapsed = time.monotonic() - self.t_start
            late = self.args.deadline_s is not None and elapsed > self.args.deadline_s
            need = self._needs.get(point.name)
            short = self.args.end_s is not None and need is not None and elapsed + need > self.args.end_s
            if late or short or (self.args.max_runs is not None and self._executed >= self.args.max_runs):
                why = ("past --deadline-s" if late else f"its earlier runs needed {need:.0f} s, "
                       f"{max(0.0, self.args.end_s - elapsed):.0f} s are left before --end-s" if short
                       else "--max-runs reached")
                print(f"{head}: not started ({why})")
                return "NOT RUN"
            self._executed += 1
        print(f"\n{head} (hash {h}) ===", flush=True)
        status = self.run_point(point, h)
        print(f"=== {point.name}: {status}", flush=True)
        return status

    def finish(self, parent_id: str, results: dict[str, str]) -> int:
        for point in self.abl.points:  # the whole grid, so that the report sees it whatever --where said
            if point.name not in self.hashes and (digest := point.dataset.digest()) is not None:
                self.hashes[point.name] = self.point_hash(point, digest, self._previous)[0]
        self.client.set_tag(parent_id, "sweep.hashes", json.dumps(sorted(set(self.hashes.values()))))
        header, rows = self.summary(parent_id)
        self.client.log_text(parent_id, runs_.markdown_table(header, rows) + "\n", "summary.md")
        self.client.log_text(parent_id, "\n".join(",".join(f'"{c}"' for c in r) for r in [header, *rows]) + "\n",
                             "summary.csv")
        counts = Counter(results.values())
        bad = any(s not in ("OK", "OOM") for s in results.values())
        self.client.set_terminated(parent_id, "KILLED" if "NOT RUN" in counts else "FAILED" if bad else "FINISHED")
        links = self.report_on_parent(parent_id)
        print(f"\n{runs_.text_table(header, rows)}\n")
        print(f"{self.abl.name}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
        print(f"MLflow tracking URI: {self.uri}; experiment '{self.abl.experiment}', parent run {parent_id}")
        print(f"  in `make ui`: {links}")
        if self.args.results:
            print(write_table(Path(self.args.results), self.abl, self.client.get_run(parent_id), self._frame,
                              (header, rows), time.monotonic() - self.t_start))
        print(f"report: python -m experiments report --parent {self.abl.name}   (make report PARENT={self.abl.name})")
        return 1 if bad else 0

    def report_on_parent(self, parent_id: str) -> str:
        """The report's table, plots and headline metrics on the parent and its view of the runs
        (experiments.report); returns their links. A failure is reported, not raised: the runs are safe."""
        from experiments.report import write_report
        from pipeline.tracking import UI_ADDRESS, ui_link

        links = f"{UI_ADDRESS}/{ui_link(self.experiment_id, parent_id)} (the parent run)"
        try:
            with tempfile.TemporaryDirectory() as tmp:
                write_report(self.client.get_run(parent_id), Path(tmp), log=True)
        except Exception as err:  # noqa: BLE001
            print(f"warning: the comparison could not be logged on the parent run: {err}", file=sys.stderr)
            return links
        return f"{UI_ADDRESS}/{self.client.get_run(parent_id).data.tags['sweep.view']} (the comparison), {links}"

    def summary(self, parent_id: str) -> tuple[list[str], list[list[str]]]:
        """Every point of the grid: its best run, or a row saying it has not run."""
        self.parent = self.client.get_run(parent_id)
        self._frame = runs_.grid_frame(self.parent, list(self.hashes.values()))
        header, rows = runs_.summary_rows(self._frame, self.abl.axes)
        by_point = {tuple(r[: len(self.abl.axes)]): r for r in rows}
        keys = [tuple(point.labels[a] for a in self.abl.axes) for point in self.abl.points]
        return header, [by_point.get(key) or [*key, "not run", *("-" for _ in header[len(key) + 1:])] for key in keys]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = parser("sweep", __doc__)
    p.add_argument("ablation", help="experiments/ablations/<name>.yaml")
    p.add_argument("--data", default=None, help="data directory replacing the file's top-level `dataset`")
    p.add_argument("--data-root", default=str(REPO_ROOT / "data"), help="where declared datasets live / are generated")
    p.add_argument("--results", default=None, metavar="DIR",
                   help="also write the summary table to DIR/training/<device>/<name>.md, never over a better one")
    p.add_argument("--dry-run", action="store_true", help="print each point's action and command, run nothing")
    p.add_argument("--max-runs", type=int, default=None, help="start at most N runs (skipped points do not count)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override of every run (trainer.max_steps=50), or of a top-level key of the file (name=x)")
    p.add_argument("--where", action="append", default=[], metavar="AXIS=LABEL[,LABEL]",
                   help="only the points with these labels, e.g. max_seq_len=1024,4096")
    p.add_argument("--end-s", type=float, default=None, help="the caller stops the sweep then (from the start)")
    p.add_argument("--deadline-s", type=float, default=None, help="start no new run after this many seconds")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (default: the file's timeout_s)")
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="run N points at once on the same device")
    p.add_argument("--gpus", default=None, metavar="LIST", help="a run at once per entry (GPU): 0,1 or 0,0,1,1")
    p.add_argument("--accept-code", action="append", default=[], metavar="VERSION",
                   help="a point's finished run of this code version (its sweep.code_version) counts as done: for a "
                        "library change off the training path, which must not rerun the grid")
    p.add_argument("--retry-oom", action="store_true", help="rerun points recorded as OOM")
    p.add_argument("--new", action="store_true", help="start a new parent run instead of resuming")
    args = p.parse_args(argv)
    if args.parallel < 1:
        p.error(f"--parallel must be >= 1, got {args.parallel}")
    if args.gpus is not None and args.parallel != 1:
        p.error("--gpus sets how many runs go at once: give it or --parallel, not both")
    args.argv = argv
    return args


@command
def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    abl = load(args.ablation, Path(args.data_root), args.data, parse_set(args.set))
    with runs_.tracking_store() as client:
        sweep = Sweep(abl, args, client)
        if args.dry_run:
            return sweep.plan()
        # one sweep of an ablation at a time: its runs inherit the lock, so that a sweep killed outright
        # keeps it until they have ended
        with hold_lock(lock_path(f"sweep-{abl.name}", abl.experiment, abl.name), f"a sweep of {abl.name}") as held:
            sweep.lock_fds = (held.fileno(),)
            return sweep.run()
