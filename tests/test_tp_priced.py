"""One tensor-parallel cost model (issue 13 item 4): the search prices each (tp, sequence parallelism) with the
styles the sharding ILP chose, which are the styles plan.json carries and mlm-run executes.

Independent checks: where the ILP finds Megatron's layout (every preset transformer), pricing with its states
gives exactly the inputs Megatron's rule gives (a different derivation of the same split); where it replicates
a block's MLP (a narrow GPT whose MLP is too small to be worth its collectives), the priced block conserves the
parameters, shards fewer of them, and issues fewer tensor-parallel all-reduces — properties that must hold.
"""

from __future__ import annotations

import pytest

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.hardware import resolve
from mlm.planner.cost.inputs import for_tp, summarize
from mlm.planner.search.sharder import Sharder

NARROW = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 256, "block_size": 32}


def _sharder(model: str, args: dict | None = None, seq_len: int | None = None) -> Sharder:
    spec = load_model_spec(model, args=args)
    ir = capture(spec, seq_len=seq_len)
    gpu, cluster = resolve(None, None)
    return Sharder(ir, gpu, cluster)


@pytest.mark.parametrize("model", ["gpt2", "llama3-8b"])
def test_megatron_shaped_models_price_as_megatrons_rule(model: str) -> None:
    sharder = _sharder(model, seq_len=256)
    keys = [(tp, sp) for tp in (2, 4) for sp in (False, True)]
    inputs = sharder.priced_inputs(keys)
    assert inputs.tp_variants == ()
    assert inputs == summarize(sharder.ir)
    for tp, sp in keys:
        styles = sharder.solve(tp, sp).styles
        assert "replicate" not in {s for name, s in styles.items() if ".h." in name or ".layers." in name}


def test_a_replicated_mlp_is_priced_as_it_runs() -> None:
    sharder = _sharder("gpt2", NARROW, seq_len=32)
    sharding = sharder.solve(2, True)
    mlp = {name: s for name, s in sharding.styles.items() if ".mlp." in name}
    assert mlp and set(mlp.values()) == {"replicate"}, sharding.styles

    megatron = for_tp(summarize(sharder.ir), 2, True)
    priced = for_tp(sharder.priced_inputs([(2, True)]), 2, True)
    assert priced is not megatron and priced.block != megatron.block
    # c_attn col, attn c_proj row, c_fc and mlp c_proj on SP's token shard
    assert [g.split for g in priced.block.gemms] == ["col", "row", "sequence", "sequence"]
    assert [g.split for g in megatron.block.gemms] == ["col", "row", "col", "row"]
    for a, b in ((priced.block, megatron.block), (priced.pre, megatron.pre), (priced.post, megatron.post)):
        assert a.params_sharded + a.params_replicated == pytest.approx(b.params_sharded + b.params_replicated)
    assert priced.block.params_sharded < megatron.block.params_sharded
    assert priced.block.sp_param_elems > megatron.block.sp_param_elems  # the MLP's gradients reduce over tp
    assert priced.block.tp_fwd_count * 2 == megatron.block.tp_fwd_count  # one region per block, not two
    # the same GEMM FLOPs are done (a sequence split divides the rows instead of a weight dimension)
    flops = sum(2 * g.rows * g.k * g.n for g in priced.block.gemms)
    assert flops == sum(2 * g.rows * g.k * g.n for g in megatron.block.gemms)
    # another key keeps Megatron's rule: without SP the ILP shards the MLP
    both = sharder.priced_inputs([(2, True), (2, False)])
    assert for_tp(both, 2, False).block == for_tp(summarize(sharder.ir), 2, False).block
    assert for_tp(both, 2, True).block == priced.block
