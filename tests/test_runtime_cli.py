"""mlm-run from the command line: a real torchrun launch, and bad input (one clear line, exit 2, no hang)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_runtime_harness import GPT_FILE, make_plan

from mlm.cli.run import main
from mlm.planner.plan import save_plan
from mlm.runtime.launch import cluster_commands

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MLM_PG_TIMEOUT_S": "30"}


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlm.cli.run", *args], env=ENV, capture_output=True, text=True, timeout=timeout
    )


def test_mlm_run_launches_torchrun_and_matches_one_process(tmp_path: Path) -> None:
    """pp = 2 through `mlm-run` (which starts torchrun itself) logs the losses of the single-process run."""
    save_plan(make_plan("gpt", pp=2, micro_batch=2, num_microbatches=2), tmp_path / "pp2.json")
    save_plan(make_plan("gpt", micro_batch=4, num_microbatches=1), tmp_path / "one.json")
    logs = {}
    for name in ("pp2", "one"):
        proc = _cli(
            str(tmp_path / f"{name}.json"),
            "--steps",
            "2",
            "--device",
            "cpu",
            "--log",
            str(tmp_path / f"{name}.jsonl"),
            "--optimizer",
            "sgd",
            "--lr",
            "0.1",
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        logs[name] = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs["pp2"]] == [1, 2]
    assert [r["loss"] for r in logs["pp2"]] == pytest.approx([r["loss"] for r in logs["one"]], abs=1e-5)
    assert "done, final loss" in proc.stderr


def _one_line_error(code: int, err: str, needle: str) -> None:
    assert code == 2
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert "Traceback" not in err
    assert any(needle in ln for ln in lines), err
    assert sum("error" in ln for ln in lines) == 1, err


def test_world_size_mismatch_under_torchrun(tmp_path: Path) -> None:
    save_plan(make_plan("gpt", pp=2, micro_batch=2, num_microbatches=2), tmp_path / "pp2.json")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            "-m",
            "mlm.cli.run",
            str(tmp_path / "pp2.json"),
            "--device",
            "cpu",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "the plan needs 2 processes" in proc.stderr and "1 were launched" in proc.stderr


def test_bad_inputs_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = tmp_path / "gpt.py"
    shutil.copy(GPT_FILE, model)
    plan = make_plan("gpt", micro_batch=4, num_microbatches=1, model_file=model)
    save_plan(plan, tmp_path / "plan.json")

    data = tmp_path / "tiny.bin"
    np.arange(5, dtype=np.uint16).tofile(data)
    _one_line_error(main([str(tmp_path / "plan.json"), "--data", str(data)]), capsys.readouterr().err, "holds 5 tokens")

    doc = json.loads((tmp_path / "plan.json").read_text())
    doc["layout"]["tp"] = "two"
    (tmp_path / "corrupt.json").write_text(json.dumps(doc))
    _one_line_error(main([str(tmp_path / "corrupt.json")]), capsys.readouterr().err, "layout.tp")

    save_plan(
        dataclasses.replace(
            plan, layout=dataclasses.replace(plan.layout, cp=3), cluster=dataclasses.replace(plan.cluster, num_gpus=3)
        ),
        tmp_path / "cp.json",
    )
    _one_line_error(main([str(tmp_path / "cp.json")]), capsys.readouterr().err, "divisible by 2·cp = 6")

    model.write_text(model.read_text() + "\n# edited\n")
    _one_line_error(main([str(tmp_path / "plan.json")]), capsys.readouterr().err, "has changed")

    model.unlink()
    _one_line_error(main([str(tmp_path / "plan.json")]), capsys.readouterr().err, "does not exist")

    _one_line_error(main([str(tmp_path / "missing.json")]), capsys.readouterr().err, "cannot read plan")


def test_more_gpus_than_the_machine_prints_cluster_commands(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_plan(make_plan("gpt", pp=2, dp=2, micro_batch=2, num_microbatches=2), tmp_path / "p.json")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main([str(tmp_path / "p.json"), "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "needs 4 GPUs" in err and "torchrun --nnodes=1 --nproc-per-node=4" in err and "sbatch --nodes=1" in err
    torchrun, sbatch = cluster_commands(64, 8, ["plan.json", "--steps", "5"])
    assert "--nnodes=8 --nproc-per-node=8" in torchrun and "plan.json --steps 5" in torchrun
    assert sbatch.startswith("sbatch --nodes=8 --ntasks-per-node=1 --gpus-per-node=8")
