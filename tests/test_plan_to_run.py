"""End to end: plans written by mlm-plan run under mlm-run and train the losses of one process.

The plan is the planner's own (a CPU profile measured by mlm-profile --quick), pinned only as far as the
properties under test need: pp 2 x dp 2 with zero 0 (the commonest Megatron layout), interleaved (vpp 2, so 5
blocks on 4 stages: the stage MILP must split them unevenly) and selective recompute. All use micro-batch 1, so the
single-process reference runs the same micro-batches (5 steps of AdamW, the CLI's default optimizer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = [
    "--model-arg",
    "n_layer=5",
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


def _plan(tmp_path: Path, cpu_profile: Path, name: str, pins: list[str]) -> dict:
    plan = tmp_path / f"{name}.json"
    proc = _cli(
        "mlm.cli.plan",
        "gpt2",
        *TINY,
        *pins,
        "--micro-batch",
        "1",
        "--gpu",
        str(cpu_profile),
        "--global-batch",
        "8",
        "--out",
        str(plan),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(plan.read_text())


def _run(tmp_path: Path, name: str) -> list[float]:
    log = tmp_path / f"{name}.jsonl"
    proc = _cli("mlm.cli.run", str(tmp_path / f"{name}.json"), "--steps", "5", "--log", str(log), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return _losses(log)


def _blocks(stage: dict) -> int:
    return sum(1 for fqn in stage["layers"] if fqn.startswith("transformer.h."))


def test_planned_layouts_run_and_agree(tmp_path: Path, cpu_profile: Path) -> None:
    plans = {
        "one": _plan(tmp_path, cpu_profile, "one", ["--gpus", "1"]),
        "planned": _plan(
            tmp_path,
            cpu_profile,
            "planned",
            ["--gpus", "4", "--pp", "2", "--dp", "2", "--vpp", "2", "--zero", "0", "--recompute", "selective"],
        ),
    }
    planned = plans["planned"]
    assert len({_blocks(st) for st in planned["stages"]}) > 1  # 5 blocks on 4 stages: uneven
    assert planned["layout"]["recompute"] == "selective" and any(st["recompute_layers"] for st in planned["stages"])
    assert planned["layout"]["vpp"] == 2 and len(planned["stages"]) == 4
    losses = {name: _run(tmp_path, name) for name in plans}
    assert len(losses["one"]) == 5
    for name, got in losses.items():
        assert got == pytest.approx(losses["one"], abs=1e-5), name
