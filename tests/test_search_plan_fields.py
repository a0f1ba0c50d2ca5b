"""plan.json's `pinned` and `warnings`, candidates the sharding ILP cannot shard, and one tensor-parallel cost
model (issue 13, items 3, 4 and 6 on the search side)."""

from __future__ import annotations

import json
import textwrap
from dataclasses import replace

import pytest

from mlm.cli.plan import main
from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.hardware import resolve
from mlm.planner.cost.inputs import summarize
from mlm.planner.errors import Infeasible
from mlm.planner.plan import plan_from_dict
from mlm.planner.search.layouts import PlanRequest, _tp_options, search
from mlm.planner.search.make_plan import _first_shardable, _Sharder, make_plan
from mlm.planner.search.sharder import tp_cost
from mlm.planner.search.tp_sharding import plan_tensor_parallel

OLMO2 = textwrap.dedent(
    """
    from transformers import Olmo2Config, Olmo2ForCausalLM

    def build_model(layers: int = 2):
        cfg = Olmo2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        return Olmo2ForCausalLM(cfg)
    """
)


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    """OLMo 2 normalises q and k over the whole projection (every head at once, before the split into heads): the
    sharding ILP cannot split its attention, which sequence parallelism then cannot feed. (Qwen3's per-head norms
    were the example until they ran on the rank's heads.)"""
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("olmo2") / "olmo2_tiny.py"
    path.write_text(OLMO2)
    spec = load_model_spec(str(path))
    return spec, capture(spec, seq_len=128)


def test_old_plan_files_without_the_new_fields_still_load(tmp_path) -> None:
    spec = load_model_spec("gpt2")
    doc = make_plan(spec, capture(spec), PlanRequest(num_gpus=2, global_batch=8, tp=2)).plan.to_dict()
    assert doc["pinned"] == ["tp"]
    old = {k: v for k, v in doc.items() if k not in ("pinned", "warnings")}
    plan = plan_from_dict(old)
    assert plan.pinned == [] and plan.warnings == []
    again = plan_from_dict(json.loads(json.dumps(doc)))
    assert again.pinned == ["tp"] and again.warnings == doc["warnings"]
    with pytest.raises(Exception, match="pinned"):
        plan_from_dict({**doc, "pinned": ["not_a_field"]})


def test_capture_warnings_and_defaults_reach_plan_json(capsys) -> None:
    """Every assumption is one sentence in plan.json: capture's (ModelIR.warnings) and the command's defaults."""
    assert main(["gpt2", "--gpus", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    ir = capture(load_model_spec("gpt2"))
    for line in getattr(ir, "warnings", ()):
        assert line in doc["warnings"]
    assert any("--global-batch" in w for w in doc["warnings"])
    assert any("--gpu" in w for w in doc["warnings"])
    assert doc["pinned"] == []


def test_search_warns_when_a_milp_stops_at_its_time_limit() -> None:
    """A stage MILP given no time cannot prove anything: the search says so instead of planning on silently."""
    from mlm.planner.cost.step_time import StageAssignment, evaluate, summarize
    from mlm.planner.layout import Layout

    ir = capture(load_model_spec("llama3-8b"))
    gpu, cluster = resolve("a100-40gb", "dgx-a100")
    # a GPU on which only uneven stages fit (capacity between their peak and the balanced one): the MILP must run
    layout = Layout(tp=1, pp=4, dp=1, micro_batch=1, num_microbatches=64, recompute="full")
    inputs = summarize(ir)
    peaks = [evaluate(inputs, layout, gpu, cluster, a).peak_memory_bytes for a in (None, StageAssignment((7, 9, 9, 7)))]
    tight = replace(gpu, hbm_gib=sum(peaks) / 2 / 2**30)
    req = PlanRequest(num_gpus=4, global_batch=64, tp=1, pp=4, micro_batch=1, recompute="full", time_limit_s=0.001)
    try:
        result = search(ir, req, tight, cluster)
    except Infeasible as e:
        assert "time limit" in str(e)
        return
    assert any("time limit" in note for note in result.notes)


def test_unshardable_candidate_is_skipped_with_its_reason(olmo2) -> None:
    """Rank a sequence-parallel layout first: it is skipped (with the ILP's reason), the next one is planned."""
    spec, ir = olmo2
    gpu, cluster = resolve("a100-80gb", None)
    request = PlanRequest(num_gpus=8, global_batch=64, tp=2)
    result = search(ir, request, gpu, cluster)
    with_sp = [c for c in result.ranked if c.layout.sequence_parallel]
    without = [c for c in result.ranked if not c.layout.sequence_parallel]
    assert with_sp and without
    forced = replace(result, best=with_sp[0], ranked=with_sp[:3] + without)
    shard = _Sharder(ir, gpu, cluster, request)
    chosen, sharding = _first_shardable(forced, shard, request.top_k)
    assert not chosen.best.layout.sequence_parallel
    assert [c.layout for c, _ in shard.skipped] == [c.layout for c in with_sp[:3]]
    assert all("sequence parallelism" in why for _, why in shard.skipped)
    assert all(not c.layout.sequence_parallel for c in chosen.ranked)
    assert sharding.tp == 2 and not sharding.sequence_parallel


def test_no_shardable_candidate_fails_naming_the_reasons(olmo2, capsys) -> None:
    spec, _ = olmo2
    args = [spec.source, "--gpus", "8", "--seq-len", "128", "--global-batch", "64", "--tp", "2"]
    assert main([*args, "--sequence-parallel"]) == 2
    err = capsys.readouterr().err
    assert "no candidate layout can be sharded" in err and "sequence parallelism" in err
    assert main(args) == 0  # sequence parallelism free: the layouts without it are planned


@pytest.mark.parametrize("preset", ["gpt2", "llama3-8b", "gpt3-175b"])
def test_sharding_ilp_agrees_with_the_cost_models_split(preset: str) -> None:
    """Two methods, one answer: the ILP (graph + prices of the target GPU) and the cost model's Megatron rule
    (planner/cost/inputs.py) choose the same column/row split and the same forward collectives per block."""
    ir = capture(load_model_spec(preset))
    block = summarize(ir).block
    for gpu_name in ("a100-80gb", "h100-sxm"):
        gpu, cluster = resolve(gpu_name, None)
        tp = max(_tp_options(ir, PlanRequest(num_gpus=8, global_batch=8), cluster))  # what the search can choose
        sharding = plan_tensor_parallel(ir, tp, False, cost=tp_cost(gpu, cluster, tp))
        first = ir.blocks[0]
        ilp = {fqn: s for fqn, s in sharding.styles.items() if fqn.startswith(first.name + ".")}
        rule = [g.split for g in block.gemms]
        assert sorted(s for s in ilp.values() if s in ("colwise", "rowwise")) == sorted(
            {"col": "colwise", "row": "rowwise"}[s] for s in rule if s in ("col", "row")
        )
        colls = sharding.block_collectives(ir)
        assert sum(c.kind == "all-reduce" for c in colls) == block.tp_fwd_count
        assert sum(c.tensor_bytes for c in colls) == pytest.approx(block.tp_fwd_bytes)


def test_plan_carries_the_styles_the_ilp_chose_on_the_target_gpu() -> None:
    spec = load_model_spec("llama3-8b")
    ir = capture(spec)
    gpu, cluster = resolve("h100-sxm", None)
    plan = make_plan(spec, ir, PlanRequest(num_gpus=8, global_batch=64, tp=8, pp=1), "h100-sxm").plan
    cost = tp_cost(gpu, cluster, 8)
    assert cost.bf16_tflops == gpu.bf16_tflops and cost.hbm_gbps == gpu.hbm_gbps
    expected = plan_tensor_parallel(ir, 8, plan.layout.sequence_parallel, cost=cost).styles
    assert plan.tensor_parallel == expected
