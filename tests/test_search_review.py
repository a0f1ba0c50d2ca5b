"""Review of the layout search: uneven stages for feasibility, Infeasible hints, pins that cannot take effect,
interleaved chunk balance in the stage MILP, zero-recompute normalisation, and --explain's comparisons."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from mlm.cli.plan import main
from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.hardware import resolve
from mlm.planner.cost.step_time import summarize
from mlm.planner.errors import Infeasible
from mlm.planner.layout import Layout
from mlm.planner.plan import plan_from_dict
from mlm.planner.search.layouts import PlanRequest, search
from mlm.planner.search.make_plan import make_plan
from mlm.planner.search.plan_document import stage_layers

A100_40 = resolve("a100-40gb", "dgx-a100")
A100_80 = resolve("a100-80gb", "dgx-a100")


@pytest.fixture(scope="module")
def llama8b():
    spec = load_model_spec("llama3-8b")
    return spec, capture(spec)


@pytest.fixture(scope="module")
def gpt2():
    spec = load_model_spec("gpt2")
    return spec, capture(spec)


def test_layout_that_fits_only_with_uneven_stages_is_found(llama8b) -> None:
    """On a GPU whose memory lies between the uneven (7, 9, 9, 7) stages' peak and the balanced stages' peak (the
    head's stage overflows), the search finds a fitting layout with the MILP's uneven stages. It used to discard
    the group on the balanced probe and report the model as not fitting. The capacity is derived from the cost
    model, not fixed, so the property holds whatever the memory model's constants."""
    from mlm.planner.cost.step_time import StageAssignment, evaluate

    spec, ir = llama8b
    gpu, cluster = A100_40
    inputs = summarize(ir)
    layout = Layout(tp=1, pp=4, dp=1, micro_batch=1, num_microbatches=64, recompute="full")
    balanced = evaluate(inputs, layout, gpu, cluster).peak_memory_bytes
    uneven = evaluate(inputs, layout, gpu, cluster, StageAssignment((7, 9, 9, 7))).peak_memory_bytes
    assert uneven < balanced  # the premise: the head's stage is the heaviest when stages are even
    tight = replace(gpu, hbm_gib=(uneven + balanced) / 2 / 2**30)
    req = PlanRequest(num_gpus=4, global_batch=64, tp=1, pp=4, micro_batch=1, recompute="full")
    result = search(ir, req, tight, cluster)
    best = result.best
    assert best.evaluation.fits and best.assignment is not None
    assert (best.layout.tp, best.layout.pp) == (1, 4)
    assert len(set(best.assignment.blocks_per_stage)) > 1  # uneven
    # the plan's stages are the assignment the cost model evaluated
    pairs = stage_layers(ir, best.layout, best.assignment)
    blocks = {layer.name for layer in ir.blocks}
    assert tuple(sum(n in blocks for n in layers) for layers, _ in pairs) == best.assignment.blocks_per_stage
    rc = best.assignment.recompute_blocks or best.assignment.blocks_per_stage
    assert tuple(len(r) for _, r in pairs) == tuple(rc)
    assert tuple(s.recompute_blocks for s in best.evaluation.stages) == tuple(rc)


def test_smallest_gpu_count_looks_below_a_node(llama8b) -> None:
    """2 GPUs is too few, 4 is enough: the hint said 8 (it only tried whole nodes)."""
    _, ir = llama8b
    with pytest.raises(Infeasible, match=r"fits on (\d+) GPUs") as info:
        search(ir, PlanRequest(num_gpus=2, global_batch=64), *A100_40)
    need = int(re.search(r"fits on (\d+) GPUs", str(info.value)).group(1))
    assert need == 4
    search(ir, PlanRequest(num_gpus=need, global_batch=64), *A100_40)


def test_hint_keeps_the_dp_pin_and_never_names_the_requested_count() -> None:
    """--dp 64 on 64 GPUs cannot hold gpt3-175b with zero 0; the hint used to drop the dp pin and say it fits on
    fewer GPUs than requested."""
    ir = capture(load_model_spec("gpt3-175b"))
    req = PlanRequest(num_gpus=64, global_batch=1536, dp=64, zero=0)
    with pytest.raises(Infeasible, match=r"fits on (\d+) GPUs with the pinned choices") as info:
        search(ir, req, *A100_80)
    need = int(re.search(r"fits on (\d+) GPUs", str(info.value)).group(1))
    assert need > 64 and need % 64 == 0
    best = search(ir, replace(req, num_gpus=need), *A100_80).best
    assert best.layout.dp == 64 and best.layout.zero == 0


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["gpt2", "--gpus", "8", "--pp", "1", "--vpp", "2"], "--vpp 2 needs pipeline parallelism"),
        (["gpt2", "--gpus", "8", "--tp", "1", "--sequence-parallel"], "--sequence-parallel needs tensor parallelism"),
        (["gpt2", "--gpus", "1", "--sequence-parallel"], "--sequence-parallel needs tensor parallelism"),
    ],
)
def test_pins_that_cannot_take_effect_are_named(argv, flag, capsys) -> None:
    """These used to say "no runnable layout for 8 GPUs with the pinned choices; it fits on 8 GPUs"."""
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert flag in err and "fits on" not in err


def test_interleaved_chunks_of_a_rank_are_balanced(capsys) -> None:
    """With vpp 2 the head's chunk sets the MILP's T alone; the solver used to return (5, 1, 1, 1, 1, 1, 1, 1)."""
    assert main(["gpt2", "--gpus", "16", "--pp", "4", "--vpp", "2", "--json"]) == 0
    plan = plan_from_dict(json.loads(capsys.readouterr().out))
    assert plan.layout.pp == 4 and plan.layout.vpp == 2
    counts = [sum(1 for n in s.layers if re.fullmatch(r"transformer\.h\.\d+", n)) for s in plan.stages]
    assert sum(counts) == 12
    for rank in range(4):
        chunks = counts[rank::4]
        assert max(chunks) - min(chunks) <= 1, counts
    names = [n for s in plan.stages for n in s.layers]
    assert names == [layer.name for layer in capture(load_model_spec("gpt2")).layers]


def test_milp_solution_without_recompute_is_reported_as_none(gpt2) -> None:
    """Ample memory: the MILP recomputes no block of a "full" layout; the plan said recompute full with no
    recompute layers."""
    from mlm.planner.search.layouts import _solve

    _, ir = gpt2
    layout = Layout(tp=1, pp=2, dp=1, micro_batch=1, num_microbatches=8, recompute="full")
    cand = _solve(summarize(ir), layout, *A100_80, PlanRequest(num_gpus=2, global_batch=8))
    assert cand is not None
    assert cand.layout.recompute == "none"
    assert all(s.recompute_blocks == 0 for s in cand.evaluation.stages)


def test_full_recompute_is_not_always_the_least_memory_probe() -> None:
    """On a stage with one block and one in-flight micro-batch full recompute keeps the input plus, while
    recomputing, the block's activations: more than selective. The probe used to reject the whole group. The GPU's
    memory is set between the two peaks as the cost model computes them."""
    from mlm.planner.cost.step_time import evaluate

    ir = capture(load_model_spec("gpt2", args={"n_layer": 2}))
    gpu, cluster = A100_80
    inputs = summarize(ir)
    peaks = {
        rc: evaluate(
            inputs, Layout(tp=1, pp=2, dp=1, micro_batch=1, num_microbatches=8, recompute=rc), gpu, cluster
        ).peak_memory_bytes
        for rc in ("selective", "full")
    }
    assert peaks["selective"] < peaks["full"]  # the premise
    tight = replace(gpu, hbm_gib=(peaks["selective"] + peaks["full"]) / 2 / 2**30)
    best = search(ir, PlanRequest(num_gpus=2, global_batch=8, tp=1, pp=2, micro_batch=1), tight, cluster).best
    assert best.evaluation.fits and best.layout.recompute in ("none", "selective")


def test_explain_compares_all_else_equal(gpt2) -> None:
    """Non-mesh dimensions are explained against the chosen layout with only that dimension changed (the
    comparison used to be any layout differing there, e.g. tp=1 for sequence parallelism, or "the only value
    that fits" for recompute values the search had pruned as slower)."""
    spec, ir = gpt2
    outcome = make_plan(spec, ir, PlanRequest(num_gpus=16, global_batch=512, pp=4, vpp=2))
    ex = outcome.explanations
    assert ex["pp"].endswith("pinned on the command line") and ex["vpp"].endswith("pinned on the command line")
    lay = outcome.plan.layout
    assert lay.recompute == "none"
    assert "all else equal" in ex["recompute"] and "recompute=full is +" in ex["recompute"]
    assert "all else equal" in ex["zero"] and "zero=3" in ex["zero"]
    assert "all else equal" in ex["micro_batch"]
    assert (
        ex["sequence_parallel"].endswith("needs tp > 1") if lay.tp == 1 else "all else equal" in ex["sequence_parallel"]
    )
