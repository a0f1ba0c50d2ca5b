"""Physical lower bounds as a property: for random layouts of random models on every GPU profile, no term of the
predicted step may be faster than physics allows, whatever the efficiency factors say.

Bounds (each at line rate or peak, no efficiency factor):
  compute    the bottleneck rank's FLOPs over the dense bf16 peak: 3x forward matmul FLOPs + 1.5x the attention
             score/value FLOPs (causal kernels skip the masked half; backward = 2x forward), plus the forward once
             more for fully recomputed blocks, divided by tp (replicated layers only add to a GPU's share).
  tp comm    every tensor-parallel all-reduce (or all-gather + reduce-scatter pair) of B bytes makes each GPU send
             2(tp−1)/tp·B, over NVLink (and its NIC when tp spans nodes); a node-spanning group must also move
             2(N−1)/N·B through each node's k NICs (forward and backward; a recomputed forward's collectives are
             part of recompute_s).
  pp comm    per micro-batch each chunk sends its activation forward (unless it is the last stage) and its
             gradient backward (unless it is the first), 1/tp of it per GPU.
  dp comm    the gradient all-reduce, reduce-scatter + all-gather, or ZeRO-3's per-micro-batch gathers (forward
             and backward; a recomputed forward runs on the backward's) and the reduce-scatter, with the same
             per-GPU and per-node bounds, on the group the dp ranks form.
  cp comm    context parallelism: every attention layer's K/V (all cp ranks' chunks, 1/tp of it per GPU) is
             all-gathered forward (again in recompute_s for a fully recomputed forward) and its gradient
             reduce-scattered backward: each GPU receives (cp−1)/cp of it per pass over NVLink and its NIC.
             With cp every token-proportional bound above is ÷cp (a lower bound even for the embeddings, which
             run whole) and the dp group is the dp·cp ranks.
  optimizer  Adam reads at least the fp32 master weights and both moments (12 bytes per local parameter, sharded
             under ZeRO) from HBM at its datasheet bandwidth.
With Megatron 2021 semantics (nothing overlaps) every exposed term is at least its bound; with mlm-run's overlap the
data-parallel term may hide under compute, but the step is still at least every bound.
"""

from __future__ import annotations

import functools
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.hardware import ClusterProfile, GPUProfile, list_gpus, resolve
from mlm.planner.cost.inputs import LayerCost, ModelCostInputs, for_tp
from mlm.planner.cost.step_time import MEGATRON_2021, MLM_RUN, CostOptions, Evaluation, evaluate, summarize
from mlm.planner.layout import Layout

REL = 1 - 1e-9  # float slack only


def _shapes(seed: int = 14, n: int = 8) -> list[tuple[str, dict[str, int], int]]:
    """Random model shapes (seeded, so the cache below captures each once): GPT and Llama presets with random
    layers, width, heads, vocabulary and sequence length."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        heads = rng.choice([4, 8, 16, 32])
        hidden = heads * rng.choice([32, 64, 128])
        layers = rng.choice([2, 4, 8, 12])
        vocab = rng.choice([1000, 32000, 51200, 128256])
        seq = rng.choice([256, 1024, 2048, 8192])
        if i % 3 == 2:
            kv = rng.choice([h for h in (1, 2, 4, 8) if heads % h == 0])
            args = dict(dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv, vocab_size=vocab,
                        ffn_dim=rng.choice([2, 3, 4]) * hidden, max_seq_len=seq)  # fmt: skip
            out.append(("llama3-8b", args, seq))
        else:
            args = dict(n_layer=layers, n_head=heads, n_embd=hidden, vocab_size=vocab, block_size=seq)
            out.append(("gpt2", args, seq))
    return out


SHAPES = _shapes()
HARDWARE = {g: resolve(g, None) for g in list_gpus()}


@functools.cache
def _inputs(i: int) -> ModelCostInputs:
    preset, args, seq = SHAPES[i]
    return summarize(capture(load_model_spec(preset, args=args), seq_len=seq))


# ---- bounds ------------------------------------------------------------------------------------------------------


def _send_bound(nbytes: float, n: int, per_node: int, cluster: ClusterProfile, passes: float) -> float:
    """Time at least `passes`·(n−1)/n·nbytes leaves each GPU (NVLink + NIC at line rate), and, when the group
    spans N nodes with `per_node` members each, at least passes·(N−1)/N·nbytes leaves each node through its NICs."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    nvl, nic = cluster.intra_node_gbps * 1e9, cluster.inter_node_gbps * 1e9
    per_node = max(1, min(per_node, n))
    nodes = -(-n // per_node)
    if nodes == 1:
        return passes * (n - 1) / n * nbytes / nvl
    gpu = passes * (n - 1) / n * nbytes / (nvl + nic)
    node = passes * (nodes - 1) / nodes * nbytes / (per_node * nic)
    return max(gpu, node)


def _rank_stages(ev: Evaluation, rank: int):
    return [s for s in ev.stages if s.rank == rank]


def _stage_layers(inputs: ModelCostInputs, stage, last: int) -> list[tuple[LayerCost, int, int]]:
    """(layer, count, recomputed count) on a virtual stage."""
    out = [(inputs.block, stage.num_blocks, stage.recompute_blocks)]
    if stage.index == 0:
        out.append((inputs.pre, 1, 0))
    if stage.index == last:
        out.append((inputs.post, 1, 0))
    return out


def bounds(
    inputs: ModelCostInputs,
    lo: Layout,
    ev: Evaluation,
    gpu: GPUProfile,
    cluster: ClusterProfile,
    options: CostOptions = CostOptions(),
) -> dict:
    """Lower bounds of each breakdown term on the bottleneck rank (and dp/optimizer on the busiest rank), of the
    program that runs (for_tp: a tp that does not divide the vocabulary leaves embedding, head and loss replicated)."""
    inputs = for_tp(inputs, lo.tp)
    m, mb, tp, last = lo.num_microbatches, lo.micro_batch, lo.tp, lo.pp * lo.vpp - 1
    cp, dp = lo.cp, lo.dp * lo.cp
    peak = gpu.bf16_tflops * 1e12
    gpn = cluster.gpus_per_node
    b = ev.bottleneck_rank
    flops = tp_bytes = kv_passes = 0.0
    for s in _rank_stages(ev, b):
        for layer, n, r in _stage_layers(inputs, s, last):
            matmul = layer.model_flops - layer.attn_flops
            flops += n * (3 * matmul + 1.5 * layer.attn_flops)
            tp_bytes += n * (layer.tp_fwd_bytes + layer.tp_bwd_bytes + layer.tp_fixed_bytes)
            kv_passes += 2 * n * layer.kv_bytes  # (a recomputed forward's all-gather is part of recompute_s)
            if lo.recompute == "full":  # (the recomputed forward's collectives are costed in recompute_s)
                flops += r * (matmul + 0.5 * layer.attn_flops)
    compute = m * mb * flops / tp / cp / peak
    tp_comm = m * _send_bound(mb * tp_bytes / cp, tp, gpn, cluster, 2.0)
    members = max(1, gpn // tp) if tp <= gpn else 1  # cp ranks (tp apart) per node
    cp_comm = m * _send_bound(mb * kv_passes / tp, cp, members, cluster, 1.0) if cp > 1 else 0.0
    sends = sum((s.index != last) + (s.index != 0) for s in _rank_stages(ev, b))
    p2p_rate = (cluster.inter_node_gbps if tp * dp >= gpn else cluster.intra_node_gbps) * 1e9
    pp_comm = m * sends * mb * inputs.block.output_bytes / tp / cp / p2p_rate
    dp_comm = opt = 0.0
    for r in range(lo.pp):
        params = sum(
            n * (layer.params_sharded / tp + layer.params_replicated)
            for s in _rank_stages(ev, r)
            for layer, n, _ in _stage_layers(inputs, s, last)
        )
        opt = max(opt, 12.0 * params / (dp if lo.zero >= 1 else 1) / (gpu.hbm_gbps * 1e9))
        k = max(1, gpn // tp) if tp <= gpn else 1
        g, p = options.grad_reduce_bytes * params, 2.0 * params
        if lo.zero == 0:
            t = _send_bound(g, dp, k, cluster, 2.0)
        elif lo.zero == 1 or lo.pp > 1:
            # FSDP2 without resharding after forward: gathers per micro-batch (once per step under pipelining)
            gathers = 1 if lo.pp > 1 else m
            t = _send_bound(g, dp, k, cluster, 1.0) + gathers * _send_bound(p, dp, k, cluster, 1.0)
        else:
            gathers = 2  # forward and backward; a fully recomputed forward runs on the backward's gather (FSDP2)
            reduces = m if options.zero3_reduce_every_microbatch else 1
            t = m * gathers * _send_bound(p, dp, k, cluster, 1.0) + reduces * _send_bound(g, dp, k, cluster, 1.0)
        dp_comm = max(dp_comm, t)
    return {
        "compute": compute,
        "tp_comm": tp_comm,
        "pp_comm": pp_comm,
        "cp_comm": cp_comm,
        "dp_comm": dp_comm,
        "optimizer": opt,
    }


# ---- the property ------------------------------------------------------------------------------------------------


@st.composite
def cases(draw):
    i = draw(st.sampled_from(range(len(SHAPES))))
    inputs = _inputs(i)
    blocks = inputs.num_blocks
    pp = draw(st.sampled_from([p for p in (1, 2, 4, 8) if p <= blocks]))
    vpp = draw(st.sampled_from([v for v in (1, 2, 3) if pp > 1 and blocks >= pp * v] or [1]))
    tp = draw(st.sampled_from([1, 2, 4, 8, 16]))
    layout = Layout(
        tp=tp,
        pp=pp,
        dp=draw(st.sampled_from([1, 2, 4, 16, 64, 256])),
        cp=draw(st.sampled_from([1, 1, 2, 4, 8])),
        micro_batch=draw(st.sampled_from([1, 2, 4])),
        num_microbatches=draw(st.sampled_from([1, 2, 8, 16])),
        vpp=vpp,
        sequence_parallel=tp > 1 and draw(st.booleans()),
        recompute=draw(st.sampled_from(["none", "selective", "full"])),
        zero=draw(st.sampled_from([0, 1, 3])),
    )
    gpu = draw(st.sampled_from(sorted(HARDWARE)))
    options = draw(
        st.sampled_from(
            [MEGATRON_2021, MLM_RUN, replace(MLM_RUN, fused_attention=True), replace(MLM_RUN, pp_overlap=1.0)]
        )
    )
    return inputs, layout, gpu, options


@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_every_term_and_the_step_at_least_its_physical_bound(case):
    inputs, layout, name, options = case
    gpu, cluster = HARDWARE[name]
    ev = evaluate(inputs, layout, gpu, cluster, options=options)
    bd, lb = ev.breakdown, bounds(inputs, layout, ev, gpu, cluster, options)
    assert bd["compute_s"] + bd["recompute_s"] >= lb["compute"] * REL
    assert bd["tp_comm_s"] >= lb["tp_comm"] * REL
    if options.pp_overlap == 0:
        assert bd["pp_comm_s"] >= lb["pp_comm"] * REL
    assert bd.get("cp_comm_s", 0.0) >= lb["cp_comm"] * REL
    assert bd["optimizer_s"] >= lb["optimizer"] * REL
    if options.dp_overlap == 0:
        assert bd["dp_comm_s"] >= lb["dp_comm"] * REL
    assert ev.step_time_s >= max(lb.values()) * REL
    hidden_pp = options.pp_overlap > 0 and layout.vpp > 1  # the interleaved schedule's p2p may hide (Megatron-Core)
    serial = lb["compute"] + lb["tp_comm"] + (0.0 if hidden_pp else lb["pp_comm"])
    assert ev.step_time_s >= serial * REL  # none of these overlap here


# ---- the case that motivated the bound (issue 14) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt3():
    return summarize(capture(load_model_spec("gpt3-175b")))


@pytest.mark.parametrize("options", [MEGATRON_2021, MLM_RUN, CostOptions(zero3_reduce_every_microbatch=True)])
def test_zero3_gpt3_on_1536_gpus_is_at_least_its_gather_traffic(gpt3, options):
    """GPT-3 175B, ZeRO-3 without model parallelism on 1536 A100s, one sequence per GPU, full recompute: two
    all-gathers of the ~350 GB of bf16 weights (forward, and backward, where FSDP2 runs the recomputed forward on
    the parameters it gathered) and one reduce-scatter of the fp32 gradients, each moving (N−1)/N of it into or out
    of each of the N = 192 nodes through its 8 x 25 GB/s of InfiniBand: about 5 s however the collectives overlap.
    (Issue 14's "over 50 s" takes 25 GB/s per GPU for the whole buffer; a node's members share what its NICs
    receive over NVLink, as NCCL's rings do, so the physical bound is the per-node one.)"""
    gpu, cluster = HARDWARE["a100-80gb"]
    layout = Layout(tp=1, pp=1, dp=1536, micro_batch=1, num_microbatches=1, recompute="full", zero=3)
    ev = evaluate(gpt3, layout, gpu, cluster, options=options)
    lb = bounds(gpt3, layout, ev, gpu, cluster, options)
    assert lb["dp_comm"] > 5.0
    assert ev.step_time_s >= max(lb["dp_comm"], lb["compute"])
    if options.dp_overlap == 0:
        assert ev.breakdown["dp_comm_s"] >= lb["dp_comm"]


@pytest.mark.parametrize("recompute,collectives", [("none", 3), ("full", 3)])
@pytest.mark.parametrize("dp", [16, 64])
def test_zero3_traffic_at_least_bytes_over_node_nics(recompute, collectives, dp):
    """ZeRO-3 across nodes, no overlap: every all-gather (forward, backward, where a recomputed forward runs on
    the backward's gather) and the gradient reduce-scatter moves (nodes−1)/nodes of the 2·P bf16 bytes into or out
    of each node, whose 8 NICs carry at most 8 × 25 GB/s at line rate (a physical bound, no efficiency factor)."""
    inputs = summarize(capture(load_model_spec("megatron-1.7b")))
    p = inputs.pre.params_sharded + inputs.pre.params_replicated + inputs.post.params_sharded
    p += inputs.post.params_replicated + inputs.num_blocks * (
        inputs.block.params_sharded + inputs.block.params_replicated
    )
    layout = Layout(tp=1, pp=1, dp=dp, micro_batch=1, num_microbatches=2, recompute=recompute, zero=3)
    gpu, cluster = HARDWARE["a100-80gb"]
    ev = evaluate(inputs, layout, gpu, cluster, options=CostOptions(dp_overlap=0.0, zero3_reduce_every_microbatch=True))
    nodes = dp // cluster.gpus_per_node
    node_bytes_per_s = cluster.gpus_per_node * cluster.inter_node_gbps * 1e9
    bound = layout.num_microbatches * collectives * (nodes - 1) / nodes * 2 * p / node_bytes_per_s
    assert ev.breakdown["dp_comm_s"] >= bound
