"""Screenshots of the MLflow UI as a new user meets it, in a real headless browser (not a test).

    python tests/ui_screenshots.py --out runs/ui [--db mlflow.db] [--chromium /usr/bin/chromium]

Without --db it generates the tiny preset and runs the main job on it (`python -m experiments
sweep experiments/ablations/main.yaml`, three tiny fits) into a fresh database; then it starts
`make ui` (and says how long it took to answer) and walks as a user does: 1-front, 2-model-training
(the switch), 3-runs (the experiment), 4-views (its Views menu), 5-comparison (the sweep's view),
6-parent-run (the first printed link). Needs Playwright (`pip install playwright`) and a Chromium.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main_job_database(work: Path) -> str:
    """The main job (dense, sdpa, jagged) on the tiny preset, in a new sqlite database under `work`."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "PYTHONPATH": str(REPO)}
    run = lambda *cmd: subprocess.run([sys.executable, "-m", *cmd], cwd=REPO, env=env, check=True)  # noqa: E731
    run("data_gen", "generate", "--preset", "tiny", "--out", str(work / "tiny"))
    run("experiments", "sweep", "experiments/ablations/main.yaml", "--new", "--data", str(work / "tiny"),
        "--set", "name=main-tiny", "--set", "configs=[base, tiny]", "--set", "mlflow.system_metrics=false",
        "--set", f"trainer.default_root_dir={work / 'ckpt'}", "--results", str(work / "results"))
    return env["MLFLOW_TRACKING_URI"]


def serve(uri: str, port: int) -> tuple[subprocess.Popen, float]:
    """`make ui` on `uri`: (the process, seconds until the UI and the API answered)."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    t0 = time.monotonic()
    proc = subprocess.Popen(["make", "-s", "ui", "SETUP=none", f"PY={sys.executable}", f"PORT={port}"], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    while time.monotonic() - t0 < 120:
        try:
            urllib.request.urlopen(base + "/", timeout=2).read()
            search = urllib.request.Request(base + "/api/2.0/mlflow/experiments/search", data=b'{"max_results": 1}',
                                            headers={"Content-Type": "application/json"})
            urllib.request.urlopen(search, timeout=2).read()
            return proc, time.monotonic() - t0
        except OSError:
            time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit("make ui did not answer within 120 s")


def links(uri: str) -> tuple[str, str, str]:
    """(the view's name, its link, the parent run's link) as the sweep printed them."""
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import ui_link

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("main-job")
    parent = client.search_runs([experiment.experiment_id], "tags.`sweep.role` = 'parent'",
                                order_by=["attributes.start_time DESC"])[0]
    return parent.info.run_name, parent.data.tags["sweep.view"], ui_link(experiment.experiment_id, parent.info.run_id)


def screenshots(base: str, name: str, view: str, parent: str, out: Path, chromium: str) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1680, "height": 720})  # a new user: nothing stored yet

        def shot(name: str, click: str | None = None, url: str | None = None, then: str | None = None,
                 menu: bool = False) -> None:
            if url:
                page.goto(url)
            if click:  # a menu's items come last in the page, after a run of the same name
                found = page.get_by_text(click, exact=True)
                (found.last if menu else found.first).click()
            page.wait_for_timeout(4000)  # the UI polls: the network never goes idle
            close = page.locator('[data-component-id="mlflow.assistant.chat_panel.close"]')
            if close.count():  # the assistant panel that opens on a first visit (it stays closed then)
                close.first.click()
                page.wait_for_timeout(500)
            if then and page.get_by_text(then, exact=True).count():
                page.get_by_text(then, exact=True).first.click()
                page.wait_for_timeout(1000)
            page.screenshot(path=str(out / f"{name}.png"))
            print(f"{name}.png: {page.url}")

        shot("1-front", url=base + "/")
        shot("2-model-training", click="Model training")
        shot("3-runs", click="main-job")
        shot("4-views", click="Views")
        shot("5-comparison", click=name, menu=True)
        shot("6-comparison-link", url=f"{base}/{view}")
        shot("7-parent-run", url=f"{base}/{parent}", then="Show more")
        browser.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for the PNGs")
    p.add_argument("--db", help="a tracking database with the main job's runs (default: make one on tiny data)")
    p.add_argument("--port", type=int, default=5077)
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{Path(args.db).resolve()}" if args.db else main_job_database(Path(tmp))
        name, view, parent = links(uri)
        server, took = serve(uri, args.port)
        print(f"make ui answered after {took:.1f} s")
        try:
            screenshots(f"http://127.0.0.1:{args.port}", name, view, parent, out, args.chromium)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(30)


if __name__ == "__main__":
    main()
