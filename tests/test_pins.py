"""Pinned layout fields hold in the search's result and in plan.json, including through the stage MILP, and the
plan lists them in `pinned` (issue 13, item 3)."""

from __future__ import annotations

import random

import pytest
from conftest import megatron_rows

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.hardware import resolve
from mlm.planner.errors import PlanError
from mlm.planner.search.layouts import PlanRequest, search
from mlm.planner.search.make_plan import make_plan


@pytest.mark.parametrize("row", megatron_rows()[3:6], ids=lambda r: r["params_b"])
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_pinned_recompute_holds_with_micro_batch_free(row: dict[str, str], recompute: str) -> None:
    """Before this test, `--recompute full` on these Table 1 rows came back as "none": the stage MILP, free to
    recompute any number of blocks, chose zero where memory allowed. A pin means every block recomputes."""
    b = float(row["params_b"])
    ir = capture(load_model_spec("megatron-1t" if b >= 1000 else f"megatron-{b:g}b"))
    request = PlanRequest(
        num_gpus=int(row["gpus"]),
        global_batch=int(row["global_batch"]),
        tp=int(row["tp"]),
        pp=int(row["pp"]),
        recompute=recompute,
        refine=2,
    )
    result = search(ir, request, *resolve("a100-80gb", "dgx-a100"))
    for cand in result.ranked:
        assert cand.layout.recompute == recompute
        assert (cand.layout.tp, cand.layout.pp) == (request.tp, request.pp)
        if cand.assignment is not None and cand.assignment.recompute_blocks is not None:
            assert cand.assignment.recompute_blocks == cand.assignment.blocks_per_stage


PIN_VALUES = {
    "tp": [1, 2, 4],
    "pp": [1, 2, 4],
    "micro_batch": [1, 2, 4],
    "vpp": [1, 2],
    "recompute": ["none", "selective", "full"],
    "sequence_parallel": [False, True],
    "zero": [0, 1, 3],
}


def _pin_combinations(seed: int, count: int) -> list[dict[str, object]]:
    """Random subsets of the layout fields with random values (fixed seed: the same combinations every run)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        fields = rng.sample(sorted(PIN_VALUES), rng.randint(1, 4))
        out.append({f: rng.choice(PIN_VALUES[f]) for f in fields})
    return out


@pytest.mark.parametrize(
    "preset, gpus, batch, gpu",
    [("gpt2", 8, 64, "a100-80gb"), ("llama3-8b", 16, 64, "a100-40gb"), ("megatron-1.7b", 32, 512, "a100-80gb")],
)
def test_every_pinned_field_holds_in_the_plan(preset: str, gpus: int, batch: int, gpu: str) -> None:
    """Many pin combinations: each field pinned is what the plan's layout carries and is listed in plan.pinned;
    a combination that cannot hold fails with PlanError (exit 2), never with another layout."""
    spec = load_model_spec(preset)
    ir = capture(spec)
    planned = 0
    for pins in _pin_combinations(len(preset), 12):
        request = PlanRequest(num_gpus=gpus, global_batch=batch, **pins)  # type: ignore[arg-type]
        try:
            outcome = make_plan(spec, ir, request, gpu, None)
        except PlanError:
            continue
        planned += 1
        layout = outcome.plan.layout
        for name, value in pins.items():
            assert getattr(layout, name) == value, (pins, layout.describe())
        assert set(outcome.plan.pinned) == set(pins)
        for cand in outcome.result.ranked if outcome.result else []:
            assert all(getattr(cand.layout, k) == v for k, v in pins.items()), (pins, cand.layout.describe())
    assert planned >= 4


def test_expert_parallelism_is_searched_at_every_tensor_parallel_size() -> None:
    """A mixture-of-experts model planned without --ep: ep is searched (not pinned) and at 64 GPUs some ranked
    layout splits the experts; with --tp 2 pinned the search still splits them (mlm-run runs ep with tp > 1,
    each tp rank holding its ep rank's experts whole), and the free result is no slower than either pinned one
    under the same cost model. A pinned --ep 2 --tp 2 is taken as asked, with sequence parallelism: the MoE
    module flattens batch and sequence into rows, which the sharding refused under SP (the search ran again
    without it); each tp rank now routes its own rows (style "rows": router and experts replicated over tp, run
    on the local rows, their gradients summed; parity in tests/test_expert_parallel.py)."""
    spec = load_model_spec("mixtral-8x7b")
    ir = capture(spec, seq_len=4096)
    outcome = make_plan(spec, ir, PlanRequest(num_gpus=64, global_batch=256), "h100-sxm", None)
    assert "ep" not in outcome.plan.pinned
    ranked = outcome.result.ranked if outcome.result else []
    assert any(c.layout.ep > 1 for c in ranked)
    tp2 = make_plan(spec, ir, PlanRequest(num_gpus=64, global_batch=256, tp=2), "h100-sxm", None)
    assert tp2.plan.layout.tp == 2 and tp2.plan.layout.ep > 1 and "ep" not in tp2.plan.pinned
    free_s = outcome.plan.predicted.step_time_s
    assert free_s <= tp2.plan.predicted.step_time_s
    pinned = make_plan(spec, ir, PlanRequest(num_gpus=64, global_batch=256, ep=2, tp=2), "h100-sxm", None)
    assert (pinned.plan.layout.ep, pinned.plan.layout.tp) == (2, 2) and {"ep", "tp"} <= set(pinned.plan.pinned)
    assert free_s <= pinned.plan.predicted.step_time_s
    assert pinned.plan.layout.sequence_parallel
    assert not any("flattens" in w for w in pinned.plan.warnings)
    styles = pinned.plan.tensor_parallel
    assert styles["layers.0.feed_forward.gate"] == styles["layers.0.feed_forward.experts"] == "rows"


def test_a_search_says_which_tensor_parallel_sizes_the_heads_rule_out() -> None:
    """Falcon with multi-query attention (4 query heads, 1 key/value head) on 2 GPUs: tp 2 would need the key/value
    head replicated, which mlm does not do, so the free search plans tp 1; before, it said nothing of why. The plan
    now carries one warning naming tp 2 and the head counts; a model whose heads divide every tp gets none."""
    from conftest import MODELS

    spec = load_model_spec(str(MODELS / "hf_zoo.py"), "build_falcon", {"multi_query": True})
    ir = capture(spec, seq_len=32)
    assert ir.num_kv_heads == 1
    plan = make_plan(spec, ir, PlanRequest(num_gpus=2, global_batch=8)).plan
    assert plan.layout.tp == 1
    said = [w for w in plan.warnings if "not searched" in w]
    assert len(said) == 1 and said[0].startswith("tp 2 not searched") and "1 key/value head " in said[0], said
    gpt = load_model_spec("gpt2", args={"n_layer": 2, "n_embd": 64, "n_head": 4})
    plan = make_plan(gpt, capture(gpt, seq_len=32), PlanRequest(num_gpus=2, global_batch=8)).plan
    assert not [w for w in plan.warnings if "not searched" in w]
