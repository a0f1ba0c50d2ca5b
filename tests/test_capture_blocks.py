"""Blocks grouped by kind: each distinct block captured once and costed as itself (hand counts, plans)."""

from __future__ import annotations

import pytest
from conftest import MODELS

from mlm.planner.capture.loader import instantiate, load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.inputs import summarize

M = str(MODELS / "block_kinds.py")
S = 16


def _spec(entry, **args):
    return load_model_spec(M, entry, args)


def _exact(spec) -> int:
    return sum(p.numel() for p in instantiate(spec, "meta").parameters())


def test_dense_then_moe_stack_has_two_kinds_costed_by_hand() -> None:
    d, f, e, k = 64, 128, 4, 2
    spec = _spec("build_dense_then_moe", dense=2, moe=3, d=d, f=f, experts=e, top_k=k)
    ir = capture(spec, seq_len=S)
    assert ir.num_params == _exact(spec)
    kinds = {kd.name: kd for kd in ir.block_kinds}
    assert [len(kd.members) for kd in kinds.values()] == [2, 3]
    assert [kd.moe for kd in kinds.values()] == [False, True]
    attention = 4 * S * S * d  # QK^T and PV, non-causal count
    dense = 2 * S * (4 * d * d + 2 * d * f)
    moe = 2 * S * (4 * d * d + d * e + k * 2 * d * (f // 2))  # attention linears, router, top_k experts
    for block in ir.blocks:
        expected = moe if block.moe else dense
        assert block.flops_matmul + block.flops_attention == pytest.approx(expected + attention, rel=0.01)
    # the search receives one cost per block, and they differ by kind
    costs = summarize(ir).block_costs
    assert len(costs) == 5 and costs[0].model_flops != costs[-1].model_flops
    assert costs[0].model_flops == costs[1].model_flops and costs[2].model_flops == costs[4].model_flops
    assert any("2 kinds of block" in w for w in ir.warnings)


def test_module_dict_layers_are_blocks() -> None:
    spec = _spec("build_dict_layers", n=4)
    ir = capture(spec, seq_len=S)
    assert ir.num_params == _exact(spec)
    assert [b.name for b in ir.blocks] == [f"layers.{i}" for i in range(4)]
    assert "replicated x4" in ir.capture_method
    d = 64
    assert ir.blocks[0].flops_matmul == 2 * S * (4 * d * d + 8 * d * d)


def test_sliding_and_full_attention_are_different_kinds() -> None:
    spec = _spec("build_gemma3", layers=6, sliding_window=8)
    ir = capture(spec, seq_len=S)
    assert ir.num_params == _exact(spec)
    kinds = [kd.attention for kd in ir.block_kinds]
    assert kinds == [("sliding window 8",), ("causal",)]
    assert [b.attention for b in ir.blocks] == [("sliding window 8",), ("causal",)] * 3


def test_t5_encoder_and_decoder_stacks() -> None:
    spec = load_model_spec(str(MODELS / "hf_t5.py"), None, {"num_layers": 3})
    ir = capture(spec, seq_len=S)
    assert ir.num_params == _exact(spec)
    containers = {kd.container for kd in ir.block_kinds}
    assert containers == {"encoder.block", "decoder.block"}
    assert ir.num_layers == 6
    # block 0 of each stack holds the relative-position bias: its own kind
    assert sorted(len(kd.members) for kd in ir.block_kinds) == [1, 1, 2, 2]
    assert len(summarize(ir).block_costs) == 6


@pytest.mark.parametrize("pp", [1, 2])
def test_dense_then_moe_plans(pp: int, tmp_path, monkeypatch) -> None:
    import json

    from mlm.cli.plan import main

    monkeypatch.setenv("MLM_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "plan.json"
    argv = [M, "--entry", "build_dense_then_moe", "--gpus", "4", "--pp", str(pp), "--seq-len", str(S)]
    assert main([*argv, "--global-batch", "8", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["layout"]["pp"] == pp and plan["model"]["num_layers"] == 5
    assert sum(len(st["layers"]) for st in plan["stages"]) >= 5
