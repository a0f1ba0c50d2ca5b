"""Physical lower bounds as a property: no layout of a model may run faster than its FLOPs at the GPU's peak."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.hardware import resolve
from mlm.planner.cost.step_time import CostOptions, evaluate, summarize
from mlm.planner.layout import Layout

HW = resolve("a100-80gb", "dgx-a100")


@pytest.fixture(scope="module")
def inputs():
    return summarize(capture(load_model_spec("megatron-1.7b")))


@settings(max_examples=300, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 4, 8]),
    pp=st.sampled_from([1, 2, 4, 8]),
    dp=st.sampled_from([1, 2, 8, 32]),
    mb=st.sampled_from([1, 2, 4]),
    m=st.sampled_from([1, 8, 16]),
    recompute=st.sampled_from(["none", "selective", "full"]),
    zero=st.sampled_from([0, 1, 3]),
)
def test_step_is_at_least_flops_over_peak(inputs, tp, pp, dp, mb, m, recompute, zero):
    """Each GPU computes at least its 1/world share of the step's FLOPs as the capture counts them: forward and
    backward (3x the forward), plus the recomputed forward of every block under full recompute."""
    layout = Layout(tp=tp, pp=pp, dp=dp, micro_batch=mb, num_microbatches=m, recompute=recompute, zero=zero)
    ev = evaluate(inputs, layout, *HW)
    block = inputs.num_blocks * inputs.block.model_flops
    per_sample = 3 * (block + inputs.pre.model_flops + inputs.post.model_flops) + (block if recompute == "full" else 0)
    bound = layout.global_batch * per_sample / layout.world_size / (HW[0].bf16_tflops * 1e12)
    assert ev.step_time_s >= bound
    assert ev.breakdown["compute_s"] + ev.breakdown["recompute_s"] >= bound * (1 - 1e-9)


@pytest.mark.parametrize("recompute,collectives", [("none", 3), ("full", 4)])
@pytest.mark.parametrize("dp", [16, 64])
def test_zero3_traffic_at_least_bytes_over_node_nics(inputs, recompute, collectives, dp):
    """ZeRO-3 across nodes, no overlap: every all-gather (forward, recomputed forward, backward) and the gradient
    reduce-scatter moves (nodes−1)/nodes of the 2·P bf16 bytes into or out of each node, whose 8 NICs carry at most
    8 × 25 GB/s at line rate (a physical bound, no efficiency factor)."""
    p = inputs.pre.params_sharded + inputs.pre.params_replicated + inputs.post.params_sharded
    p += inputs.post.params_replicated + inputs.num_blocks * (
        inputs.block.params_sharded + inputs.block.params_replicated
    )
    layout = Layout(tp=1, pp=1, dp=dp, micro_batch=1, num_microbatches=2, recompute=recompute, zero=3)
    ev = evaluate(inputs, layout, *HW, options=CostOptions(dp_overlap=0.0))
    _, cluster = HW
    nodes = dp // cluster.gpus_per_node
    node_bytes_per_s = cluster.gpus_per_node * cluster.inter_node_gbps * 1e9
    bound = layout.num_microbatches * collectives * (nodes - 1) / nodes * 2 * p / node_bytes_per_s
    assert ev.breakdown["dp_comm_s"] >= bound
