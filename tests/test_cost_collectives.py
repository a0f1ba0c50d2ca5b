"""Collectives as they execute: ring latency growing with the group, node-spanning groups at NIC bandwidth, and
what the runtime overlaps (DDP buckets, FSDP per-layer gathers) under mlm-run's and Megatron-LM 2021's semantics."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.collectives import all_gather_s, all_reduce_s, group_link
from mlm.planner.cost.hardware import resolve
from mlm.planner.cost.step_time import MEGATRON_2021, MLM_RUN, CostOptions, evaluate, summarize
from mlm.planner.layout import Layout

HW = resolve("a100-80gb", "dgx-a100")


@pytest.fixture(scope="module")
def inputs():
    return summarize(capture(load_model_spec("megatron-1.7b")))


def test_ring_latency_grows_with_the_group_and_with_the_nodes_it_spans():
    _, cluster = HW
    tiny = [all_reduce_s(8.0, n, group_link(cluster, n, 1)) for n in (2, 4, 8, 16, 64, 512)]
    assert all(b > a for a, b in zip(tiny, tiny[1:]))
    # 512 ranks: about 2 x 511 ring steps, each at least the NVLink hop latency
    assert tiny[-1] >= 2 * 511 * cluster.intra_node_step_latency_us * 1e-6
    # the same 64 ranks spread one per node (stride 8) cross the network on every hop: slower than 8 per node
    assert all_gather_s(8.0, 64, group_link(cluster, 64, 8)) > all_gather_s(8.0, 64, group_link(cluster, 64, 1))


def test_node_spanning_group_is_bound_by_its_members_nics():
    """Large message: a dp group with one member per node (after tp 8) runs at one NIC per member, one with eight
    members per node drives eight NICs; both at most at line rate."""
    _, cluster = HW
    nbytes = 4e9
    one = all_reduce_s(nbytes, 16, group_link(cluster, 16, 8))
    eight = all_reduce_s(nbytes, 128, group_link(cluster, 128, 1))
    line = cluster.inter_node_gbps * 1e9
    assert one >= 2 * 15 / 16 * nbytes / line
    assert eight >= 2 * 15 / 16 * nbytes / (8 * line)  # 16 nodes of 8: each node's share through its 8 NICs
    assert 6 < one / eight < 9


def test_ddp_buckets_hide_under_the_backward_but_the_last_one(inputs):
    lo = Layout(tp=1, pp=1, dp=64, micro_batch=4, num_microbatches=2, recompute="full", zero=0)
    none = evaluate(inputs, lo, *HW, options=MEGATRON_2021).breakdown["dp_comm_s"]
    hidden = evaluate(inputs, lo, *HW, options=MLM_RUN).breakdown["dp_comm_s"]
    link = group_link(HW[1], 64, 1)
    # after the backward: the last bucket and the gradient norm's one fp32 all-reduce over every rank
    last_bucket = all_reduce_s(MLM_RUN.ddp_bucket_bytes, 64, link) + all_reduce_s(4.0, 64, link)
    assert none > hidden >= last_bucket * (1 - 1e-9)
    # a backward far longer than the all-reduce hides everything but the last bucket
    assert hidden == pytest.approx(last_bucket, rel=1e-6)
    half = evaluate(inputs, lo, *HW, options=CostOptions(dp_overlap=0.5)).breakdown["dp_comm_s"]
    assert none >= half >= hidden


def test_zero3_gathers_per_micro_batch_and_not_again_for_a_recomputed_forward(inputs):
    """No overlap: each micro-batch adds a forward and a backward gather (none more under full recompute: the
    recomputed forward runs inside the backward, on the parameters FSDP2 gathered for it, as the dry run counts:
    tests/test_dry_run.py z3-full); the reduce-scatter is once per step after accumulation, and once per
    micro-batch with every-micro-batch reduction (mlm-run's FSDP2)."""
    base = Layout(tp=1, pp=1, dp=64, micro_batch=1, num_microbatches=2, recompute="none", zero=3)
    opts = replace(MLM_RUN, dp_overlap=0.0, zero3_reduce_every_microbatch=False)

    def dp(lo: Layout, o: CostOptions = opts) -> float:
        return evaluate(inputs, lo, *HW, options=o).breakdown["dp_comm_s"]

    two, four = dp(base), dp(replace(base, num_microbatches=4))
    full2 = dp(replace(base, recompute="full"))
    gather = (four - two) / 4  # two more micro-batches x two gathers
    assert gather > 0
    assert full2 == pytest.approx(two, rel=1e-9)
    every = dp(base, replace(opts, zero3_reduce_every_microbatch=True))
    assert every > two
    # mlm-run overlap: FSDP prefetch hides gathers under compute, never below the first layer's gather
    assert 0 < evaluate(inputs, base, *HW).breakdown["dp_comm_s"] < two


def test_tp_overlap_hides_at_most_the_collectives(inputs):
    lo = Layout(tp=8, pp=1, dp=1, micro_batch=2, num_microbatches=4, sequence_parallel=True)
    plain = evaluate(inputs, lo, *HW)
    hidden = evaluate(inputs, lo, *HW, options=CostOptions(tp_overlap=1.0))
    assert 0 <= hidden.breakdown["tp_comm_s"] < plain.breakdown["tp_comm_s"]
    assert hidden.breakdown["compute_s"] == plain.breakdown["compute_s"]
