"""Checkpoints: resume is bitwise on CPU, a checkpoint loads under another layout, saves are atomic."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from test_runtime_harness import make_plan, run_workers

from mlm.planner.errors import PlanError
from mlm.runtime.train import RunOptions, full_parameters, train

BASE = RunOptions(steps=6, optimizer="adamw", lr=1e-2, seed=0)


def _runs(rank: int, jobs: list[tuple[Any, RunOptions]]) -> list[tuple[list[float], dict[str, torch.Tensor], int]]:
    out = []
    for plan, opts in jobs:
        rt = train(plan, opts)
        out.append(([r.loss for r in rt.records], full_parameters(rt), rt.start_step))
    return out


def _merge(per_rank: list, i: int) -> tuple[list[float], dict[str, torch.Tensor], int]:
    params: dict[str, torch.Tensor] = {}
    for r in per_rank:
        params.update(r[i][1])
    return per_rank[0][i][0], params, per_rank[0][i][2]


def test_resume_is_bitwise_and_loads_under_other_layouts(tmp_path: Path) -> None:
    pp2 = make_plan("gpt", pp=2, micro_batch=2, num_microbatches=2)
    first_half = dataclasses.replace(BASE, steps=3, lr_decay_steps=6, save=tmp_path / "ck")
    second_half = dataclasses.replace(BASE, resume=tmp_path / "ck")
    result = run_workers(2, _runs, [(pp2, BASE), (pp2, first_half), (pp2, second_half)])
    straight, _, resumed = (_merge(result, i) for i in range(3))
    assert resumed[2] == 3
    assert resumed[0] == straight[0][3:]  # bitwise losses
    for name, value in straight[1].items():
        assert torch.equal(value, resumed[1][name]), name

    # saved under (tp, pp, dp) = (2, 2, 1) with AdamW state, resumed under (1, 1, 2): the same losses (AdamW
    # amplifies float noise in parameters, so parameters are compared loosely)
    p221 = make_plan("gpt", tp=2, pp=2, micro_batch=2, num_microbatches=2)
    run_workers(4, _runs, [(p221, dataclasses.replace(first_half, save=tmp_path / "ck221"))])
    p112 = make_plan("gpt", dp=2, micro_batch=2, num_microbatches=1)
    other = _merge(run_workers(2, _runs, [(p112, dataclasses.replace(BASE, resume=tmp_path / "ck221"))]), 0)
    assert other[0] == pytest.approx(straight[0][3:], abs=1e-5)
    for name, value in straight[1].items():
        torch.testing.assert_close(other[1][name], value, atol=1e-2, rtol=0)
    assert not list(tmp_path.glob("*.tmp-*")) and not list(tmp_path.glob("*.old"))


def test_a_fused_projection_with_reordered_rows_saves_in_the_model_order(tmp_path: Path) -> None:
    """Phi-3's qkv_proj at tp2 is stored with its rows reordered (each rank's q, k and v rows contiguous); the
    checkpoint holds the model's order, so a tp2 run saved at step 3 and resumed in one process continues as one
    process does (AdamW state included)."""
    from test_zoo import _fp32_plan

    tp2, single = _fp32_plan("phi3", 2, 1), _fp32_plan("phi3", 1, 1)
    first_half = dataclasses.replace(BASE, steps=3, lr_decay_steps=6, save=tmp_path / "ck")
    run_workers(2, _runs, [(tp2, first_half)])
    straight, resumed = (
        _merge(r, 0)
        for r in (
            run_workers(1, _runs, [(single, BASE)]),
            run_workers(1, _runs, [(single, dataclasses.replace(BASE, resume=tmp_path / "ck"))]),
        )
    )
    assert resumed[2] == 3
    assert resumed[0] == pytest.approx(straight[0][3:], abs=1e-5)
    for name, value in straight[1].items():
        torch.testing.assert_close(resumed[1][name], value, atol=1e-3, rtol=0)


def _save_then_fail(rank: int, plan: Any, opts: RunOptions) -> str:
    from mlm.runtime import checkpoint as ckpt

    rt = train(plan, opts)  # writes a good checkpoint at step 2
    real_save = ckpt.dcp.save

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    ckpt.dcp.save = broken
    try:
        from mlm.runtime.train import save_checkpoint

        save_checkpoint(rt, 99)
    except OSError:
        pass
    finally:
        ckpt.dcp.save = real_save
    return ckpt.read_meta(opts.save)["step"]


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    plan = make_plan("gpt", micro_batch=2, num_microbatches=1, dp=2)
    opts = dataclasses.replace(BASE, steps=2, save=tmp_path / "ck")
    steps = run_workers(2, _save_then_fail, plan, opts)
    assert steps == [2, 2]


def _resume_bad(rank: int, plan: Any, opts: RunOptions) -> str:
    try:
        train(plan, opts)
    except PlanError as e:
        return str(e)
    return "no error"


def test_resume_from_a_non_checkpoint_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    plan = make_plan("gpt", micro_batch=4, num_microbatches=1)
    [msg] = run_workers(1, _resume_bad, plan, dataclasses.replace(BASE, resume=tmp_path / "empty"))
    assert "not an mlm checkpoint" in msg
