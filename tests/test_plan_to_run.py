"""End to end: plans written by mlm-plan run under mlm-run, and two different layouts train the same losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = [
    "--model-arg",
    "n_layer=4",
    "--model-arg",
    "n_embd=64",
    "--model-arg",
    "n_head=4",
    "--model-arg",
    "vocab_size=256",
    "--model-arg",
    "block_size=64",
]


def _cli(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "cpu.toml"
    proc = _cli("mlm.cli.profile", "--quick", "--out", str(out), cwd=out.parent)
    assert proc.returncode == 0, proc.stderr
    return out


def _losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in log.read_text().splitlines() if line.strip()]


def test_planned_layouts_run_and_agree(tmp_path: Path, cpu_profile: Path) -> None:
    losses = {}
    for name, pins in (
        ("dp2", ["--gpus", "2", "--tp", "1", "--pp", "1"]),
        ("tp2pp2", ["--gpus", "4", "--tp", "2", "--pp", "2"]),
    ):
        plan = tmp_path / f"{name}.json"
        proc = _cli(
            "mlm.cli.plan",
            "gpt2",
            *TINY,
            *pins,
            "--gpu",
            str(cpu_profile),
            "--global-batch",
            "8",
            "--out",
            str(plan),
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stderr
        log = tmp_path / f"{name}.jsonl"
        proc = _cli("mlm.cli.run", str(plan), "--steps", "2", "--optimizer", "sgd", "--log", str(log), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr + proc.stdout
        losses[name] = _losses(log)
    assert len(losses["dp2"]) == 2
    assert losses["dp2"] == pytest.approx(losses["tp2pp2"], abs=1e-5)
