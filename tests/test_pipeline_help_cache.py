"""`python -m pipeline fit --help`: built once, then printed from the cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline._help_cache import cache_file, is_help_request

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, want", [
    (["fit", "--help"], True), (["test", "-h"], True), (["fit"], False),
    (["fit", "--help", "--config", "x.yaml"], False), (["sweep", "--help"], False), (["fit", "--print_config"], False),
])
def test_only_a_bare_help_request_is_served_from_the_cache(argv, want):
    assert is_help_request(argv) is want


def test_the_key_follows_the_subcommand(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_file(["fit", "--help"]) != cache_file(["test", "--help"])
    assert cache_file(["fit", "--help"]).parent == tmp_path / "jagged-attn"


@pytest.mark.slow
def test_the_second_help_comes_from_the_cache_and_reads_the_same(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}

    def run() -> str:
        out = subprocess.run([sys.executable, "-m", "pipeline", "fit", "--help"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    first = run()
    assert "--model.ranker.attention" in first and "--trainer.max_steps" in first
    (cached,) = (tmp_path / "jagged-attn").glob("help-fit-*.txt")
    assert cached.read_text() == first
    cached.write_text(first + "served from the cache\n")  # proves the second call read the file
    assert run() == first + "served from the cache\n"


def test_the_encoder_commands_help_imports_neither_torch_nor_lightning_nor_mlflow():
    """`python -m pipeline.user_embeddings ... --help` answers at once: the heavy imports wait for a command."""
    code = ("import sys\nfrom pipeline.user_embeddings import main\ntry:\n    main(['fit', '--help'])\n"
            "except SystemExit:\n    pass\n"
            "print('heavy:', sorted({'torch', 'pytorch_lightning', 'mlflow'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "--max-seq-len" in out.stdout and out.stdout.splitlines()[-1] == "heavy: []", out.stdout[-2000:] + out.stderr
