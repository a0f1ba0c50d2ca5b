"""Fast single-process checks of the runtime's rules and of stage splitting (no process group needed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_runtime_harness import make_plan

from mlm.planner.capture.training_step import TrainingModule
from mlm.planner.errors import Infeasible, PlanFileError
from mlm.planner.layout import Layout
from mlm.runtime.data_parallel import choose_data_parallel
from mlm.runtime.model_build import build_model, load_checked_spec, record_layer_calls
from mlm.runtime.optim import lr_factor
from mlm.runtime.stages import StageModule, build_stage, check_stage_boundaries
from mlm.runtime.tensor_parallel import expand_tp_map
from mlm.runtime.train import check_plan_runnable, schedule_name


def test_data_parallel_choice_avoids_the_known_traps() -> None:
    # zero 0 is DDP semantics everywhere: torch's DDP for fp32 at tp 1 outside zero-bubble schedules (pipelining
    # included), FSDP2's replicate() otherwise (bf16, DDP + TP: mixed Tensor/DTensor; DDP + ZB: reducer assert);
    # under pp > 1 FSDP never reshards after forward (ZB schedules give wrong grads otherwise)
    assert choose_data_parallel(Layout(dp=2), "1f1b").wrapper == "ddp"
    assert choose_data_parallel(Layout(dp=2, pp=2), "1f1b").wrapper == "ddp"
    assert choose_data_parallel(Layout(dp=2, pp=2), "1f1b", torch.bfloat16).wrapper == "replicate"
    assert choose_data_parallel(Layout(dp=2, tp=2), "none").wrapper == "replicate"
    assert choose_data_parallel(Layout(dp=2, pp=2), "zbv").wrapper == "replicate"
    assert choose_data_parallel(Layout(dp=2, pp=2, zero=3), "zbv").reshard_after_forward is False
    assert choose_data_parallel(Layout(dp=2, pp=2, zero=3), "1f1b").reshard_after_forward is False
    assert choose_data_parallel(Layout(dp=2, zero=3), "none").reshard_after_forward is True
    zero1 = choose_data_parallel(Layout(dp=2, zero=1), "none")
    assert zero1 == choose_data_parallel(Layout(dp=2, tp=2, zero=1), "none")
    assert choose_data_parallel(Layout(dp=1, tp=2), "none").wrapper == "none"


def test_schedules_and_micro_batch_counts_are_validated() -> None:
    assert schedule_name(make_plan(pp=2, num_microbatches=2)) == "1f1b"
    assert schedule_name(make_plan(pp=2, num_microbatches=1)) == "gpipe"  # 1F1B needs >= pp micro-batches
    assert schedule_name(make_plan(pp=2, vpp=2, num_microbatches=2)) == "interleaved-1f1b"
    with pytest.raises(Infeasible, match="divisible by pp"):
        check_plan_runnable(make_plan(pp=2, vpp=2, num_microbatches=3))
    with pytest.raises(Infeasible, match="heads"):
        check_plan_runnable(
            dataclasses.replace(make_plan(tp=2), model=dataclasses.replace(make_plan().model, num_heads=3))
        )


def test_lr_schedule_warms_up_then_decays() -> None:
    values = [lr_factor(s, 2, 10) for s in range(10)]
    assert values[0] == 0.5 and values[1] == 1.0
    assert all(a >= b for a, b in zip(values[1:], values[2:])) and values[-1] > 0.1


def test_tp_map_patterns_expand() -> None:
    names = ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn", "lm_head"]
    out = expand_tp_map({"transformer.h.*.attn.c_attn": "colwise", "lm_head": "vocab"}, names)
    assert out == {
        "transformer.h.0.attn.c_attn": "colwise",
        "transformer.h.1.attn.c_attn": "colwise",
        "lm_head": "vocab",
    }


@pytest.mark.parametrize("kind,stages", [("gpt", 4), ("llama", 3), ("hf", 2)])
def test_stages_chained_in_one_process_equal_the_whole_model(kind: str, stages: int) -> None:
    """Running stage after stage (activations handed over as the pipeline would) gives the model's loss, with
    parameter FQNs unchanged and the tied weight on both end stages (gradients: see the parity tests)."""
    plan = make_plan(kind, pp=stages, micro_batch=2, num_microbatches=stages)
    spec = load_checked_spec(plan)
    calls = record_layer_calls(spec, plan, 2)
    check_stage_boundaries(plan, calls)
    ref_model = build_model(spec, 0)
    model = build_model(spec, 0)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    ref = TrainingModule(ref_model)(inputs, targets)
    parts = [build_stage(model, None, plan, i, calls, torch.device("cpu")) for i in range(stages)]
    acts: tuple = ()
    for part in parts:
        out = part(*acts, inputs=inputs, targets=targets)
        acts = tuple(a.detach().requires_grad_() for a in out) if not part.is_last else out
    torch.testing.assert_close(acts.reshape(()), ref, atol=1e-6, rtol=0)
    names = {n for p in parts for n, _ in p.named_parameters(remove_duplicate=False)}
    assert all(n.startswith(StageModule.PREFIX) for n in names)
    stripped = {n[len(StageModule.PREFIX) :] for n in names}
    assert stripped == {n for n, _ in ref_model.named_parameters(remove_duplicate=False)}


def test_plans_that_do_not_fit_the_model_are_rejected() -> None:
    plan = make_plan("gpt", pp=2, micro_batch=2, num_microbatches=2)
    spec = load_checked_spec(plan)
    swapped = [
        dataclasses.replace(s, layers=list(reversed(s.layers[:-1])) + s.layers[-1:]) if i == 1 else s
        for i, s in enumerate(plan.stages)
    ]
    with pytest.raises(PlanFileError, match="out of execution order"):
        record_layer_calls(spec, dataclasses.replace(plan, stages=swapped), 2)
    missing = [dataclasses.replace(s, layers=[x for x in s.layers if x != "lm_head"]) for s in plan.stages]
    with pytest.raises(PlanFileError, match="lm_head.weight' is in no layer"):
        record_layer_calls(spec, dataclasses.replace(plan, stages=missing), 2)
