"""The layout search: pinning, infeasible requests, the stage MILP, plan.json round trip, and consistency checks
(the free search against the same search with pins: both use mlm's own cost model, so they check the search,
not the predictions)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from conftest import megatron_rows

from mlm.cli.plan import main
from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.hardware import resolve
from mlm.planner.errors import Infeasible, PlanError
from mlm.planner.plan import load_plan, plan_from_dict, save_plan
from mlm.planner.search.layouts import PlanRequest, search
from mlm.planner.search.make_plan import make_plan
from mlm.planner.search.stage_milp import StageProblem, solve_stages

A100 = resolve("a100-80gb", "dgx-a100")


@pytest.fixture(scope="module")
def gpt3():
    return capture(load_model_spec("gpt3-175b"))


@pytest.fixture(scope="module")
def small():
    spec = load_model_spec("megatron-1.7b")
    return spec, capture(spec)


def test_search_respects_partial_pins(gpt3) -> None:
    result = search(gpt3, PlanRequest(num_gpus=1024, global_batch=1536, tp=8, pp=16, zero=0), *A100)
    lay = result.best.layout
    assert (lay.tp, lay.pp, lay.dp, lay.zero) == (8, 16, 8, 0)
    assert lay.global_batch == 1536
    assert result.best.evaluation.fits
    assert all(c.layout.tp == 8 and c.layout.pp == 16 for c in result.ranked)


def test_consistency_free_search_is_no_slower_than_any_pinned_choice(gpt3) -> None:
    """Consistency test: the planner against itself under one cost model (the search's pruning must be valid)."""
    free = search(gpt3, PlanRequest(num_gpus=1024, global_batch=1536), *A100).best
    for tp, pp in ((8, 16), (8, 8), (4, 8)):
        pinned = search(gpt3, PlanRequest(num_gpus=1024, global_batch=1536, tp=tp, pp=pp), *A100).best
        assert free.evaluation.step_time_s <= pinned.evaluation.step_time_s * (1 + 1e-9)


@pytest.mark.parametrize(
    "row", [r for r in megatron_rows() if r["params_b"] in ("1.7", "39.1")], ids=lambda r: r["params_b"]
)
def test_consistency_free_search_no_slower_than_the_papers_split(row: dict[str, str]) -> None:
    """Consistency test, not a measurement: the free search is no slower, under mlm's own cost model, than the
    same search pinned to the paper's tp and pp (benchmarks/bench_search.py prints all ten rows)."""
    ir = capture(load_model_spec(f"megatron-{row['params_b']}b"))
    req = PlanRequest(num_gpus=int(row["gpus"]), global_batch=int(row["global_batch"]))
    free = search(ir, req, *A100).best
    paper = search(ir, replace(req, tp=int(row["tp"]), pp=int(row["pp"])), *A100).best
    assert free.evaluation.step_time_s <= paper.evaluation.step_time_s * (1 + 1e-9)


def test_fully_pinned_layout_is_evaluated_exactly(small) -> None:
    spec, ir = small
    req = PlanRequest(
        num_gpus=32,
        global_batch=512,
        tp=1,
        pp=1,
        dp=32,
        micro_batch=4,
        vpp=1,
        recompute="full",
        sequence_parallel=False,
        zero=0,
    )
    outcome = make_plan(spec, ir, req, "a100-80gb", "dgx-a100")
    lay = outcome.plan.layout
    assert (lay.micro_batch, lay.num_microbatches, lay.recompute, lay.zero) == (4, 4, "full", 0)
    assert outcome.result is None
    assert outcome.plan.stages[0].recompute_layers == [b.name for b in ir.blocks]


def test_pinned_layout_that_does_not_fit_names_the_stage(gpt3) -> None:
    req = PlanRequest(
        num_gpus=32,
        global_batch=64,
        tp=8,
        pp=4,
        dp=1,
        micro_batch=1,
        vpp=1,
        recompute="none",
        sequence_parallel=False,
        zero=0,
    )
    with pytest.raises(Infeasible, match=r"stage \d+ needs .* GiB .*over by"):
        make_plan(load_model_spec("gpt3-175b"), gpt3, req)


def test_model_that_fits_nowhere_says_the_smallest_gpu_count(gpt3) -> None:
    with pytest.raises(Infeasible, match=r"fits on (\d+) GPUs") as info:
        search(gpt3, PlanRequest(num_gpus=8, global_batch=1536), *A100)
    import re

    need = int(re.search(r"fits on (\d+) GPUs", str(info.value)).group(1))
    assert need > 8 and need % 8 == 0
    search(gpt3, PlanRequest(num_gpus=need, global_batch=1536), *A100)  # and it really does


def test_indivisible_batch_and_partial_nodes_are_rejected_with_a_fix(small) -> None:
    _, ir = small
    with pytest.raises(Infeasible, match="try --global-batch"):
        search(ir, PlanRequest(num_gpus=64, global_batch=63, tp=1, pp=1, cp=1), *A100)  # cp 64 would run it
    with pytest.raises(Infeasible, match="use 8 or 16"):
        search(ir, PlanRequest(num_gpus=12, global_batch=512), *A100)
    with pytest.raises(PlanError, match="tp·pp·dp"):
        search(ir, PlanRequest(num_gpus=32, global_batch=512, tp=2, pp=2, dp=2, cp=1), *A100)


def test_milp_gives_the_heavy_last_stage_fewer_blocks() -> None:
    base = StageProblem(
        num_blocks=32,
        pp=4,
        vpp=1,
        block_time_s=0.01,
        recompute_time_s=0.003,
        pre_time_s=0.0,
        post_time_s=0.06,
        block_static_bytes=1e9,
        pre_static_bytes=0,
        post_static_bytes=0,
        block_act_bytes=1e8,
        block_act_recompute_bytes=1e7,
        pre_act_bytes=0,
        post_act_bytes=0,
        inflight=(4, 3, 2, 1),
        capacity_bytes=70e9,
    )
    sol = solve_stages(base)
    assert sol is not None and sum(sol.blocks_per_stage) == 32
    assert sol.blocks_per_stage[-1] < min(sol.blocks_per_stage[:-1])
    assert sol.recompute_blocks == (0, 0, 0, 0)  # memory is ample: recomputing would only cost time
    tight = replace(base, capacity_bytes=9.5e9, post_time_s=0.0)
    sol = solve_stages(tight)
    assert sol is not None
    assert sol.recompute_blocks[0] > 0  # stage 0 holds the most in-flight micro-batches
    assert sol.recompute_blocks[0] >= sol.recompute_blocks[-1]
    assert solve_stages(replace(base, capacity_bytes=5e9)) is None


def test_milp_balances_chunks_under_interleaving() -> None:
    p = StageProblem(
        num_blocks=48,
        pp=4,
        vpp=3,
        block_time_s=0.01,
        recompute_time_s=0.0,
        pre_time_s=0.0,
        post_time_s=0.0,
        block_static_bytes=1e8,
        pre_static_bytes=0,
        post_static_bytes=0,
        block_act_bytes=1e7,
        block_act_recompute_bytes=1e7,
        pre_act_bytes=0,
        post_act_bytes=0,
        inflight=tuple([6.0] * 12),
        capacity_bytes=70e9,
        allow_recompute=False,
    )
    sol = solve_stages(p)
    assert sol is not None and set(sol.blocks_per_stage) == {4}


def test_plan_round_trips_through_json(tmp_path, small) -> None:
    spec, ir = small
    plan = make_plan(spec, ir, PlanRequest(num_gpus=64, global_batch=512)).plan
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    assert load_plan(path) == plan
    assert plan.model.sha256 == spec.sha256 and len(plan.model.sha256) == 64
    layers = [name for stage in plan.stages for name in stage.layers]
    assert layers == [layer.name for layer in ir.layers]  # every layer on exactly one stage, in order


def test_cli_json_is_the_plan_and_explain_says_why(capsys) -> None:
    assert main(["megatron-1.7b", "--gpus", "32", "--json"]) == 0
    plan = plan_from_dict(json.loads(capsys.readouterr().out))
    assert plan.layout.world_size == 32 and plan.predicted is not None
    assert plan.predicted.mfu > 0 and set(plan.predicted.breakdown) == {
        "compute_s",
        "tp_comm_s",
        "pp_comm_s",
        "dp_comm_s",
        "bubble_s",
        "recompute_s",
        "optimizer_s",
    }
    assert main(["megatron-1.7b", "--gpus", "32", "--explain", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "why these values" in out and "tp=" in out and "alternatives" in out


def test_cli_infeasible_is_one_line_exit_2(capsys) -> None:
    assert main(["gpt3-175b", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "fits on" in err and "Traceback" not in err
    assert main(["gpt2", "--gpus", "8", "--tp", "3"]) == 2
    assert main(["gpt2"]) == 2
    assert "--gpus" in capsys.readouterr().err
