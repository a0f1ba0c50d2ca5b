"""The cost model: step time and per-GPU memory of a layout, from summarised IR numbers and hardware profiles.

Pure arithmetic on frozen dataclasses (no torch): `summarize(ir)` once per model, then `evaluate` per layout in
well under a millisecond. Per micro-batch and per layer (planner/cost/inputs.py says how layers are split):

  GEMMs       2·m·k·n/tp FLOPs at gpu.gemm_efficiency((m·k·n/tp)^(1/3)), m = micro_batch·seq; backward = 2x
              forward (input and weight gradients have the same m·n·k, hence the same size and efficiency).
  attention   fused kernels: the profile's convention, 7·b·h·s²·d fwd+bwd FLOPs for a causal call (= 1.75x the
              IR's non-causal forward count: the kernels skip the blocks above the diagonal), twice that for a call
              that computes every block (a mask tensor, or bidirectional: attn_full_flops), at
              attention_efficiency(s) (the profile's fused-attention curve for a stack that runs cuDNN's kernel,
              CostOptions.fused_attention), split 2:5 forward:backward; materialised scores (manual): batched
              (s, s, d) GEMMs, backward 2x.
  memory-bound  bytes / (hbm_gbps · memory_bound_efficiency), tp-region bytes ÷tp, residual-stream bytes ÷tp only
              with sequence parallelism; backward moves 2x the forward bytes (reads saved input and grad, writes grad).
  tp comm     per block 2 all-reduces forward and 2 backward (Megatron's g and f), or all-gather + reduce-scatter
              pairs with SP (same ring bytes); not overlapped (Megatron-LM 2021 runs them on the compute stream).
              The vocabulary-parallel embedding and loss_parallel all-reduce with or without SP; under SP the
              first block's sliced input is all-gathered in backward, and each SP norm parameter's gradient is
              all-reduced over tp with the gradients (dp comm).
  recompute   full: one more forward of the block incl. its all-reduces but the last; selective: the attention
              core's forward (score matmuls and softmax/dropout bytes; nothing when the fused kernel saves no scores).
  pp comm     per virtual stage and micro-batch one send/recv forward and one backward of the boundary activation
              as mlm-run sends it: the whole activation per tp rank, or its sequence shard (1/tp) under SP; not
              hidden (mlm-run), or, under the interleaved schedule, hidden in the steady state (pp_overlap:
              Megatron-Core's overlap_p2p_comm).
  bubble      planner/cost/schedule.py: m·t_max + (Σ t_rank − t_max)/vpp, i.e. (pp−1)/(vpp·m) of ideal when balanced.
  dp comm     gradient all-reduce in DDP buckets (zero 0; CostOptions.grad_reduce_bytes per element) or
              reduce-scatter + all-gather of the parameters in the compute dtype (zero 1) of the rank's local
              parameters once per step; zero 3 gathers each layer's parameters in forward and in backward
              (where a fully recomputed forward runs) on every micro-batch, and reduce-scatters per layer once
              per step (mlm-run) or every micro-batch. Latency grows with the ring
              and a group spanning nodes runs at its members' NIC bandwidth (collectives.py). What overlaps:
              CostOptions (default mlm-run, torch DDP/FSDP2: hidden up to the compute it runs under; MEGATRON_2021:
              nothing hidden); on a cluster whose collectives share the compute's cores (gloo on a CPU) at most
              collective_overlap_efficiency of each collective's own time hides. Tied embeddings add, when pp > 1, a
              gradient all-reduce over the pipeline ranks holding a copy (first, last, and a middle one such as
              T5's decoder embedding).
  optimizer   Adam as a memory-bound pass: 28 bytes per local parameter (fp32 master, m, v read+written; bf16
              grad read, bf16 weight written; with fp32 compute the same 28: fp32 grad read, no copy written),
              sharded over dp under zero >= 1.
  ep          expert parallelism (ep carved out of dp·cp, layout.py): each rank holds 1/ep of every MoE layer's
              routed experts (parameters, gradients, optimizer states ÷ep, the states sharded under zero over the
              dp·cp/ep ranks that hold the same experts, whose gradients are reduced over that group) and the dense
              part as dp·cp says. Its tokens reach their experts by an all-to-all (dispatch) and come back by
              another (combine), forward and again in backward: 4 per MoE layer and micro-batch of
              tokens·top_k·capacity·hidden·compute bytes (÷tp under SP: each tp rank dispatches its sequence
              shard), over NVLink inside a node, the NIC across (collectives.all_to_all_s), not overlapped
              (Megatron-Core's default). A rank receives tokens·top_k·capacity rows on average from its ep
              group, as many as it sends, so the expert GEMMs per rank are those of ep = 1; the capacity factor is
              the imbalance allowance (capture's option, in the warnings).
  cp          context parallelism: each sequence split over cp ranks in 2·cp load-balanced causal chunks, so every
              token-proportional term (GEMM rows, attention score work, memory-bound bytes, activations, tp and pp
              traffic, all-to-alls) is ÷cp per rank, attention at the efficiency of s/cp-long chunks. As mlm-run
              runs it (the all-gather form Llama 3 trained with): per attention layer and micro-batch an
              all-gather of K and of V (the layer's real K/V bytes, ÷tp; what ring attention passes forward) and a
              reduce-scatter of dK, dV in backward, not overlapped; the gathered K/V stay saved for the backward
              ((cp−1)/cp of the layer's K/V more activation than ÷cp, cp_share). Gradients (and ZeRO shards)
              reduce over dp·cp.

Breakdown: step_time_s = compute_s + recompute_s + tp_comm_s + pp_comm_s + ep_comm_s + cp_comm_s (the last two only
when ep > 1, cp > 1; the busiest pipeline rank's per-micro-batch terms x m; compute_s holds GEMMs, attention and
memory-bound ops) + bubble_s + dp_comm_s (exposed part) + optimizer_s, exactly. ep = cp = 1 gives the numbers of the
model without them.

Calibration: each GPU profile's GEMM and attention curves are its prior times one compute factor fitted on the
train rows of the published runs in profiles/calibration/ and checked on held-out rows (planner/cost/calibration.py,
benchmarks/fit_profiles.py, the profile's [calibration] table, docs/calibration.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from mlm.planner.cost.collective_counts import (
    GRAD_NORM_BYTES,
    pipeline_boundary_bytes,
    recomputed_reductions,
    sp_norm_bytes,
    sp_norm_reductions,
)
from mlm.planner.cost.collectives import (
    Link,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    group_link,
    p2p_link,
    p2p_s,
    reduce_scatter_s,
    ring_link,
)
from mlm.planner.cost.hardware import ClusterProfile, GPUProfile, gemm_size
from mlm.planner.cost.inputs import (
    FP32_BYTES,
    LayerCost,
    ModelCostInputs,
    cp_share,
    for_tp,
    sp_param_elems,
    summarize,
    tied_stages,
    vocab_shards,
)
from mlm.planner.cost.memory import (
    GRAD_BYTES,
    MemoryBreakdown,
    activation_bytes,
    local_expert_params,
    local_params,
    loss_backward_bytes,
    state_bytes,
    working_bytes,
    zero3_buffer_bytes,
)
from mlm.planner.cost.schedule import inflight, pipeline_time
from mlm.planner.errors import PlanError
from mlm.planner.layout import Layout

__all__ = [
    "MEGATRON_2021",
    "MLM_RUN",
    "CostOptions",
    "Evaluation",
    "StageAssignment",
    "StageCoefficients",
    "StageCost",
    "balanced_blocks",
    "evaluate",
    "stage_coefficients",
    "summarize",
]

OPTIMIZER_TRAFFIC_BYTES = 28.0  # per parameter per Adam step, see module docstring
GIB = float(2**30)


@dataclass(frozen=True)
class StageAssignment:
    """Blocks per virtual stage (length pp·vpp) and how many of them use layout.recompute (None: all)."""

    blocks_per_stage: tuple[int, ...]
    recompute_blocks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class CostOptions:
    """How the runtime executes communication: assumptions that are the runtime's, not the hardware's.

    The default is mlm-run's semantics (torch DDP / FSDP2, which overlap data-parallel traffic with compute);
    MEGATRON_2021 is Megatron-LM as Narayanan et al. 2021 ran it (gradient all-reduce after the backward).

    dp_overlap: fraction of the compute a data-parallel collective can run under that hides it (stream and
        bandwidth contention ignored: an assumption, stated here). DDP: bucketed all-reduces under the last
        micro-batch's backward (the earlier ones run under no_sync), the last bucket never hidden. ZeRO-1:
        reduce-scatter under that backward, parameter all-gather under the first forward (Megatron-Core
        --overlap-grad-reduce / --overlap-param-gather). ZeRO-3 (FSDP2 prefetch): every per-layer gather and
        reduce-scatter of the step under the step's compute, the first layer's gather never hidden.
    ddp_bucket_bytes: torch DDP's bucket_cap_mb = 25 default (one all-reduce call, hence one latency, per bucket).
    zero3_reduce_every_microbatch: True as mlm-run (FSDP2 reduce-scatters as each micro-batch's backward ends,
        measured by mlm-run --dry-run); False: one reduce-scatter per step after gradient accumulation.
    grad_reduce_bytes: bytes per gradient element on the wire (mlm-run 4: fp32 reduction, FSDP2's reduce_dtype
        and DDP on fp32 gradients; Megatron-LM 2021: 2, fp16 all-reduce).
    grad_buffer_bytes: bytes per parameter of the resident (unsharded under zero 0/1) gradient buffer: mlm-run 4,
        fp32 gradients; Megatron-Core's DDP keeps its buffer in the parameters' bf16 (2) when
        grad_reduce_in_fp32 is off, as NeMo's performance recipes set it.
    fused_loss_backward: the loss's backward writes the logits' gradient in place over the fp32 softmax it saved
        (Megatron-LM's vocabulary-parallel cross entropy, TransformerEngine's fused one): no temporaries of the
        logits' size (False: mlm-run's aten kernels, memory.loss_backward_bytes).
    tp_overlap: fraction of tensor-parallel collective time hidden behind the block's GEMMs (Megatron-Core
        --tp-comm-overlap); 0 in mlm-run and in Megatron-LM 2021/2022.
    sp_saves_gathered_inputs: under SP the column-parallel linears' inputs are saved gathered (mlm-run: torch's
        autograd keeps the all-gathered tensor, measured by mlm-run --dry-run) or as the rank's sequence shard,
        re-gathered in backward (False: Megatron-LM, Korthikanti et al. 2022).
    pipeline_buffers_every_microbatch: the pipeline keeps a receive buffer per micro-batch and direction for the
        whole step (torch's PipelineStage, mlm-run); False: only the in-flight ones, which the activations already
        count (Megatron-LM allocates each receive as it runs).
    loss_bytes: bytes per element of the logits the loss computes on, hence of the log-probabilities it saves and
        of its backward's temporaries: mlm-run upcasts to fp32 (4); 2 for a loss on the bf16 logits (NeMo
        AutoModel's MaskedCrossEntropy with fp32_upcast off, as its benchmark recipes set it).
    zero1_gathers_every_microbatch: under ZeRO-1 without pipelining the parameters are all-gathered for every
        micro-batch's forward (mlm-run: FSDP2 without resharding after forward reshards after each backward, as
        `mlm-run --dry-run` counts); False: once per step, after the optimizer (Megatron-Core's distributed
        optimizer, which keeps the whole bf16 parameters between steps).
    recompute_repeats_every_reduction: a fully recomputed forward repeats every tp reduction of the block
        (Megatron-LM's reentrant checkpoint re-runs the whole forward); False: torch's non-reentrant checkpoint in
        mlm-run stops at the last tensor the backward needs (LayerCost.tp_recompute_tail_count).
    cp_overlap: fraction of the layer's attention compute that hides context parallelism's K/V exchange (0 in
        mlm-run, which all-gathers K/V before the attention; Megatron-Core's ring attention, cp_comm_type p2p,
        sends the next chunk's K/V while the current one's attention runs, so up to all of it).
    expert_tensor_parallel: under tp > 1 the routed experts of an MoE layer are split over the tp ranks like an
        MLP, their combined output all-reduced (Megatron-Core's expert-tensor parallelism, whose size defaults to
        the tp size); False: each tp rank keeps its experts whole and runs them on the tokens the tp group shares
        (on its token shard under SP), with no tp collective (mlm-run: tensor parallelism leaves the expert banks
        unsharded, runtime/expert_parallel.py; measured by mlm-run --dry-run).
    fused_attention: the attention runs TransformerEngine's DotProductAttention, which picks cuDNN's fused
        attention over flash-attn on Hopper and later (GPUProfile.fused_attention_curve where the profile has one,
        else its attention_curve); False: F.scaled_dot_product_attention's FlashAttention-2, as mlm-run.
    pp_overlap: under the interleaved schedule, the fraction of the send/recv of the steady state's micro-batches
        hidden behind the chunks' compute (Megatron-Core's overlap_p2p_comm, on by default and only for the
        interleaved schedule; its warm-up and flush stay exposed unless --overlap-p2p-communication-warmup-flush);
        0: mlm-run (torch's schedules wait for each receive before the chunk that reads it).
    hidden_share: at most this share of a collective's own time hides under the compute the overlaps above allow
        (on_cluster sets it from ClusterProfile.collective_overlap_efficiency): where collectives and compute share
        the same cores, as gloo's threads and the compute on a CPU, running both costs the compute plus
        (1 - share) of the collective however long the compute is; 1 on GPUs (NCCL runs on SMs of its own).
    """

    dp_overlap: float = 1.0
    ddp_bucket_bytes: float = 25.0 * 2**20
    zero3_reduce_every_microbatch: bool = True
    grad_reduce_bytes: float = 4.0
    tp_overlap: float = 0.0
    sp_saves_gathered_inputs: bool = True
    pipeline_buffers_every_microbatch: bool = True
    cp_overlap: float = 0.0
    grad_buffer_bytes: float = GRAD_BYTES
    fused_attention: bool = False
    hidden_share: float = 1.0
    pp_overlap: float = 0.0
    fused_loss_backward: bool = False
    loss_bytes: float = 4.0
    zero1_gathers_every_microbatch: bool = True
    recompute_repeats_every_reduction: bool = False
    expert_tensor_parallel: bool = False


def with_loss_bytes(inputs: ModelCostInputs, loss_bytes: float) -> ModelCostInputs:
    """`inputs` with the loss computed on logits of `loss_bytes` per element instead of fp32 (CostOptions.loss_bytes):
    its saved log-probabilities and its backward's temporaries scale with it."""
    if loss_bytes == FP32_BYTES or not inputs.post.loss_logits_bytes:
        return inputs
    post, r = inputs.post, loss_bytes / FP32_BYTES
    saved = max(0.0, post.act_sharded - (1.0 - r) * post.loss_logits_bytes)
    return replace(inputs, post=replace(post, act_sharded=saved, loss_logits_bytes=r * post.loss_logits_bytes))


def _as_run(inputs: ModelCostInputs, layout: Layout, options: CostOptions) -> ModelCostInputs:
    """`inputs` as the runtime of `options` runs them under `layout`'s tp (inputs.for_tp) and loss precision."""
    tp_run = for_tp(inputs, layout.tp, layout.sequence_parallel, options.expert_tensor_parallel)
    return with_loss_bytes(tp_run, options.loss_bytes)


def on_cluster(options: CostOptions, cluster: ClusterProfile | None) -> CostOptions:
    """`options` with the share of a collective that can hide under compute on the cluster
    (ClusterProfile.collective_overlap_efficiency: 1 on GPUs, measured by mlm-profile on a CPU)."""
    e = cluster.collective_overlap_efficiency if cluster is not None else 1.0
    return options if e >= 1.0 else replace(options, hidden_share=min(options.hidden_share, e))


def _exposed(comm: float, window: float, options: CostOptions) -> float:
    """What of `comm` seconds of collectives stays exposed beside `window` seconds of compute they may run under:
    hidden up to the window and up to options.hidden_share of their own time."""
    return comm - min(max(window, 0.0), options.hidden_share * comm)


MLM_RUN = CostOptions()
MEGATRON_2021 = CostOptions(
    dp_overlap=0.0,
    recompute_repeats_every_reduction=True,
    zero3_reduce_every_microbatch=False,
    grad_reduce_bytes=2.0,
    sp_saves_gathered_inputs=False,
    pipeline_buffers_every_microbatch=False,
)  # Narayanan et al. 2021 / Korthikanti et al. 2022 runs: no DP overlap


@dataclass(frozen=True, slots=True)
class StageCost:
    """One virtual stage: its layers, per-micro-batch times, and its share of its GPU's memory (the rank's first
    chunk also carries the rank-wide terms: reserve, recompute working memory, ZeRO-3 buffers)."""

    index: int
    rank: int
    chunk: int
    layers: tuple[str, ...]
    num_blocks: int
    recompute_blocks: int
    forward_s: float
    backward_s: float
    recompute_s: float
    tp_comm_s: float
    pp_comm_s: float
    inflight: float
    memory: MemoryBreakdown
    ep_comm_s: float = 0.0  # expert all-to-alls (dispatch + combine, forward and backward)
    cp_comm_s: float = 0.0  # exposed ring K/V exchange of context parallelism

    @property
    def time_s(self) -> float:
        return (self.forward_s + self.backward_s + self.recompute_s + self.tp_comm_s + self.pp_comm_s) + (
            self.ep_comm_s + self.cp_comm_s
        )


@dataclass(frozen=True)
class Evaluation:
    """Predicted step time and memory of one layout. stages: the pp·vpp virtual stages (stage i on rank i % pp);
    rank_memory: per GPU (the sum of its stages' memory); breakdown sums to step_time_s (module docstring)."""

    layout: Layout
    stages: tuple[StageCost, ...]
    rank_memory: tuple[MemoryBreakdown, ...]  # per pipeline rank (one GPU)
    step_time_s: float
    breakdown: dict[str, float]
    tokens_per_s: float
    model_tflops_per_gpu: float
    mfu: float
    peak_memory_bytes: float
    capacity_bytes: float
    fits: bool
    reason: str | None
    bottleneck_rank: int


@dataclass(frozen=True)
class _LayerTimes:
    forward_s: float
    backward_s: float
    tp_s: float  # forward + backward collectives
    recompute_s: float  # extra time when recomputed under layout.recompute
    ep_s: float = 0.0  # expert all-to-alls, forward + backward
    cp_s: float = 0.0  # exposed ring K/V exchange, forward + backward


@dataclass(frozen=True)
class StageCoefficients:
    """The cost model's per-block numbers for the stage MILP (all per micro-batch, seconds and bytes).

    Agreement with evaluate(): for an assignment (n_i, r_i), evaluate's StageCost.time_s of virtual stage i equals
    n_i·block_time_s + r_i·block_recompute_extra_s + [i=0]·pre_time_s + [i=S−1]·post_time_s + p2p_time_s, and a
    rank's memory equals Σ_i n_i·block_static_bytes + [i=0]·pre_static_bytes + [i=S−1]·post_static_bytes
    + inflight[i]·((n_i−r_i)·block_act_bytes + r_i·block_act_recompute_bytes + [i=0]·pre_act_bytes
    + [i=S−1]·post_act_bytes) + stage_buffer_bytes[i] + the rank-wide terms. capacity_bytes is HBM minus the
    rank-wide terms (reserve, ZeRO-3 buffer, and full recompute's working block, which evaluate counts only on
    ranks that recompute).
    When blocks differ, the block_*s tuples give each block's own numbers and the sums above run over the blocks
    of stage i (its first r_i recomputed); the scalars are then their means (n·mean is the blocks' total).
    """

    num_blocks: int
    block_time_s: float
    block_recompute_extra_s: float
    block_time_recompute_s: float
    pre_time_s: float
    post_time_s: float
    p2p_time_s: float
    block_static_bytes: float
    pre_static_bytes: float
    post_static_bytes: float
    block_act_bytes: float
    block_act_recompute_bytes: float
    pre_act_bytes: float
    post_act_bytes: float
    inflight: tuple[float, ...]
    fixed_bytes: float
    capacity_bytes: float
    block_times_s: tuple[float, ...] = ()  # per block when blocks differ (then the block_* scalars are their means)
    block_recompute_extras_s: tuple[float, ...] = ()
    block_statics_bytes: tuple[float, ...] = ()
    block_acts_bytes: tuple[float, ...] = ()
    block_acts_recompute_bytes: tuple[float, ...] = ()
    recompute_working_bytes: float = 0.0  # full recompute's working block, part of fixed_bytes (see above)
    stage_buffer_bytes: tuple[float, ...] = ()  # stage_buffer_bytes: each virtual stage's, block-independent


def balanced_blocks(num_blocks: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage as even as possible, extras on the middle stages (same rule as build_plan)."""
    base, extra = divmod(num_blocks, stages)
    counts = [base] * stages
    for i in sorted(range(stages), key=lambda i: abs(i - (stages - 1) / 2))[:extra]:
        counts[i] += 1
    return tuple(counts)


# ---- per-layer times ---------------------------------------------------------------------------------------------


def _layer_times(
    layer: LayerCost,
    layout: Layout,
    gpu: GPUProfile,
    tp_link: Link,
    seq: int,
    options: CostOptions = MLM_RUN,
    cluster: ClusterProfile | None = None,
    moe_share: float = 1.0,
) -> _LayerTimes:
    """Forward, backward, exposed tp-collective and recompute time of one micro-batch through `layer`
    (options.tp_overlap: the fraction of the collectives hidden behind this layer's GEMMs, at most their time), and
    the expert all-to-alls and exposed K/V exchange (options.cp_overlap: the fraction hidden behind the attention;
    `cluster` needed when ep or cp > 1; `layer` already holds one cp rank's share; moe_share: the fraction of the
    blocks averaged into `layer` that are MoE, whose all-to-alls each carry dispatch_bytes / moe_share)."""
    mb, tp, sp = layout.micro_batch, layout.tp, layout.sequence_parallel
    peak = gpu.bf16_tflops * 1e12
    gemm = 0.0
    for g in layer.gemms:
        work = mb * g.rows * g.k * g.n / (1 if g.split == "replicate" else tp)
        gemm += 2.0 * work / (peak * gpu.gemm_efficiency(work ** (1.0 / 3.0)))
    attn_f = attn_b = 0.0
    if layer.attn_flops:
        flops = layer.attn_flops * mb / tp
        if layer.attn_materialized:
            attn_f = flops / (peak * gpu.gemm_efficiency(gemm_size(seq, seq, max(layer.head_dim, 1))))
            attn_b = 2.0 * attn_f
        else:  # fused kernels, forward + backward = 3.5 forwards, causal calls half of their counted FLOPs
            executed = 0.5 * (flops + layer.attn_full_flops * mb / tp)
            both = 3.5 * executed / (peak * gpu.attention_efficiency(seq, options.fused_attention))
            attn_f, attn_b = both * 2.0 / 7.0, both * 5.0 / 7.0
    bandwidth = gpu.hbm_gbps * 1e9 * gpu.memory_bound_efficiency
    mem = mb * (layer.mem_sharded / tp + layer.mem_replicated / (tp if sp else 1)) / bandwidth
    tp_f = _tp_collective(layer.tp_fwd_count, mb * layer.tp_fwd_bytes, tp, sp, tp_link)
    tp_b = _tp_collective(layer.tp_bwd_count, mb * layer.tp_bwd_bytes, tp, sp, tp_link)
    forward = gemm + attn_f + mem
    if layout.recompute == "full":
        extra = forward + _tp_again(layer, layout, tp_link, options.recompute_repeats_every_reduction)
    elif layout.recompute == "selective" and layer.attn_materialized:
        extra = attn_f + mb * layer.core_bytes / tp / bandwidth
    else:
        extra = 0.0
    a2a_f, ep_s = _all_to_alls(layer, layout, cluster, moe_share)
    ring_f, cp_s = _context_exchange(layer, layout, cluster)
    if options.cp_overlap > 0:  # each direction hidden up to the attention it runs beside
        ring_b = cp_s - ring_f
        ring_f = _exposed(ring_f, options.cp_overlap * attn_f, options)
        cp_s = ring_f + _exposed(ring_b, options.cp_overlap * attn_b, options)
    if layout.recompute == "full":
        extra += a2a_f + ring_f
    tp_overlap = options.tp_overlap
    tp_total = tp_f + tp_b + _tp_fixed(layer, layout, tp_link)
    tp_exposed = _exposed(tp_total, min(tp_overlap * tp_total, 3.0 * gemm), options) if tp_overlap > 0 else tp_total
    return _LayerTimes(forward, 2.0 * gemm + attn_b + 2.0 * mem, tp_exposed, extra, ep_s, cp_s)


def _all_to_alls(
    layer: LayerCost, layout: Layout, cluster: ClusterProfile | None, moe_share: float
) -> tuple[float, float]:
    """(forward, forward + backward) time of the expert all-to-alls of one micro-batch: dispatch and combine each
    way, over the ep group (ep consecutive ranks of the dp·cp ranks, tp apart)."""
    if layout.ep <= 1 or not layer.dispatch_bytes or cluster is None or moe_share <= 0:
        return 0.0, 0.0
    nbytes = layout.micro_batch * layer.dispatch_bytes / moe_share / (layout.tp if layout.sequence_parallel else 1)
    one = moe_share * all_to_all_s(nbytes, layout.ep, cluster, layout.tp)
    return 2.0 * one, 4.0 * one


def _context_exchange(layer: LayerCost, layout: Layout, cluster: ClusterProfile | None) -> tuple[float, float]:
    """(forward, forward + backward) time of context parallelism's K/V exchange for one micro-batch, as mlm-run
    runs it (runtime/context_parallel.py): an all-gather of K and of V over the cp group (each rank receives the
    other cp−1 ranks' chunks, its kv heads ÷tp: the bytes ring attention passes forward), and in backward a
    reduce-scatter of dK and dV. Not overlapped: the attention waits for its keys."""
    cp = layout.cp
    if cp <= 1 or not layer.kv_bytes or cluster is None:
        return 0.0, 0.0
    gathered = cp * layout.micro_batch * layer.kv_bytes / layout.tp  # `layer` holds one rank's K/V
    link = ring_link(cluster, cp, layout.tp)
    forward = all_gather_s(gathered, cp, link, calls=2)
    return forward, forward + reduce_scatter_s(gathered, cp, link, calls=2)


def _tp_collective(count: int, nbytes: float, tp: int, sp: bool, link: Link) -> float:
    """`count` all-reduces of `nbytes` in total, or as many all-gather + reduce-scatter pairs under SP."""
    if tp == 1 or count == 0:
        return 0.0
    if sp:
        return all_gather_s(nbytes, tp, link, count) + reduce_scatter_s(nbytes, tp, link, count)
    return all_reduce_s(nbytes, tp, link, count)


def _tp_again(layer: LayerCost, layout: Layout, link: Link, every: bool = False) -> float:
    """The tp collectives of a fully recomputed forward: every reduction but the last (torch's non-reentrant
    checkpoint stops once the backward has what it needs; the last too when an op after it saves a tensor, or
    `every`: a reentrant checkpoint) and, under SP, every gather."""
    f, tp, mb = layer.tp_fwd_count, layout.tp, layout.micro_batch
    if tp == 1 or f == 0:
        return 0.0
    n = f if every else recomputed_reductions(layer)
    again = mb * layer.tp_fwd_bytes * n / f
    if layout.sequence_parallel:
        gather = all_gather_s(mb * layer.tp_fwd_bytes, tp, link, f)
        return gather + (reduce_scatter_s(again, tp, link, n) if n else 0.0)
    return all_reduce_s(again, tp, link, n) if n else 0.0


def _tp_fixed(layer: LayerCost, layout: Layout, link: Link) -> float:
    """The tp collectives that neither SP nor recompute change: the all-reduces of a vocabulary-parallel embedding
    and of loss_parallel's statistics, and under SP the backward all-gather of the sliced first-block input."""
    tp, mb = layout.tp, layout.micro_batch
    if tp == 1:
        return 0.0
    fixed = all_reduce_s(mb * layer.tp_fixed_bytes, tp, link, layer.tp_fixed_count) if layer.tp_fixed_count else 0.0
    if layout.sequence_parallel and layer.sp_gather_bytes:
        fixed += all_gather_s(mb * layer.sp_gather_bytes, tp, link)
    return fixed


def _p2p_time(
    inputs: ModelCostInputs,
    layout: Layout,
    cluster: ClusterProfile,
    tp_link: Link,
    options: CostOptions = MLM_RUN,
    cheapest_block_s: float = 0.0,
) -> float:
    """Exposed send/recv time per virtual stage and micro-batch (forward activation + backward gradient), as mlm-run
    sends them: each tp rank sends its sequence shard under sequence parallelism, else the whole (replicated)
    activation. (Megatron's scatter-gather optimisation, 1/tp over the wire and an all-gather over tp, is not what
    runs.) Under options.pp_overlap and the interleaved schedule, the steady state's share is hidden: of the m·vpp
    chunk passes of the first rank, all but the 2(pp−1) + (vpp−1)·pp of warm-up (and as many of flush), and at
    most `cheapest_block_s`, the forward + backward of the cheapest block (a chunk holds at least one)."""
    if layout.pp == 1:
        return 0.0
    nbytes = pipeline_boundary_bytes(inputs, layout)
    p2p = 2.0 * p2p_s(nbytes, p2p_link(cluster, layout.tp * layout.cp * layout.dp))
    if options.pp_overlap <= 0 or layout.vpp <= 1:
        return p2p
    passes = layout.num_microbatches * layout.vpp
    steady = max(0, passes - 2 * (layout.pp - 1) - (layout.vpp - 1) * layout.pp) / passes
    return _exposed(p2p, options.pp_overlap * steady * min(p2p, cheapest_block_s), options)


@dataclass(frozen=True, slots=True)
class _BlockTerms:
    """What one block adds to its stage per micro-batch under a layout: times, local parameters (all, routed
    experts) and saved activation bytes without / with layout.recompute."""

    times: _LayerTimes
    params: float
    experts: float
    act: float
    act_recompute: float


def _block_terms(
    inputs: ModelCostInputs,
    layout: Layout,
    gpu: GPUProfile,
    tp_link: Link,
    seq: int,
    options: CostOptions,
    cluster: ClusterProfile,
) -> tuple[tuple[_BlockTerms, ...], tuple[int, ...]]:
    """Each distinct block's terms and every block's index into them. Identical blocks: one entry, the block
    (`inputs.block`, its all-to-alls spread by moe_share); differing blocks (dense-then-MoE, sliding/full
    attention, encoder/decoder): each kind priced as itself."""
    tp, sp, mb = layout.tp, layout.sequence_parallel, layout.micro_batch
    gathered = options.sp_saves_gathered_inputs
    uniform = inputs.uniform_blocks
    kinds, kind_of = ((inputs.block,), (0,) * inputs.num_blocks) if uniform else inputs.block_kinds
    share = moe_share(inputs) if uniform else 1.0
    terms = []
    for c in kinds:
        params, experts = rank_params(c, tp, layout.ep)
        terms.append(
            _BlockTerms(
                _layer_times(c, layout, gpu, tp_link, seq, options, cluster, share),
                params,
                experts,
                activation_bytes(c, "none", tp, sp, mb, gathered),
                activation_bytes(c, layout.recompute, tp, sp, mb, gathered),
            )
        )
    return tuple(terms), kind_of


def _cheapest_block_s(terms: tuple[_BlockTerms, ...]) -> float:
    """Forward + backward of the cheapest distinct block (_block_terms)."""
    return min(t.times.forward_s + t.times.backward_s for t in terms)


def _stage_blocks(
    terms: tuple[_BlockTerms, ...], kind_of: tuple[int, ...], pos: int, n: int, r: int
) -> tuple[float, float, float, float, float, float, float, float, float]:
    """Forward, backward, tp, ep, cp and recompute time, local parameters, routed-expert parameters and saved
    activation bytes of blocks pos..pos+n−1 on one stage, the first r of them recomputed (as plan.json's
    recompute_layers name them)."""
    if len(terms) == 1:
        b = terms[0]
        t = b.times
        return (
            n * t.forward_s,
            n * t.backward_s,
            n * t.tp_s,
            n * t.ep_s,
            n * t.cp_s,
            r * t.recompute_s,
            n * b.params,
            n * b.experts,
            (n - r) * b.act + r * b.act_recompute,
        )
    out = [0.0] * 9
    for j in range(pos, pos + n):
        b = terms[kind_of[j]]
        t, recomputed = b.times, j < pos + r
        out[0] += t.forward_s
        out[1] += t.backward_s
        out[2] += t.tp_s
        out[3] += t.ep_s
        out[4] += t.cp_s
        out[5] += t.recompute_s if recomputed else 0.0
        out[6] += b.params
        out[7] += b.experts
        out[8] += b.act_recompute if recomputed else b.act
    return tuple(out)  # type: ignore[return-value]


def rank_batch_bytes(inputs: ModelCostInputs, layout: Layout) -> float:
    """The step's batch on each rank, on every pipeline stage (runtime/data.py: each stage's forward reads the
    inputs and targets): its data-parallel share of the global batch, micro_batch · num_microbatches samples."""
    return inputs.batch_bytes * layout.micro_batch * layout.num_microbatches


def _rank_wide_bytes(inputs: ModelCostInputs, layout: Layout, gathered: bool = True) -> tuple[float, float]:
    """(ZeRO-3 gather buffer, full recompute's working activations): one block's worth per GPU, the largest
    kind's when blocks differ."""
    tp, sp, mb = layout.tp, layout.sequence_parallel, layout.micro_batch
    kinds = (inputs.block,) if inputs.uniform_blocks else inputs.block_kinds[0]
    buffer = max(zero3_buffer_bytes(c, tp, layout.zero, layout.pp > 1, inputs.compute_bytes, layout.ep) for c in kinds)
    working = max(working_bytes(c, layout.recompute, tp, sp, mb, gathered) for c in kinds)
    return buffer, working


# ---- evaluate ----------------------------------------------------------------------------------------------------


def pipeline_buffer_bytes(
    inputs: ModelCostInputs, layout: Layout, options: CostOptions = CostOptions()
) -> tuple[float, ...]:
    """Per virtual stage, the receive buffers torch's PipelineStage allocates for the step and keeps: one per
    micro-batch for the activation it receives (all but the first stage) and one for the gradient of its output
    (all but the last), each a boundary activation (the rank's sequence shard under SP). Not only the in-flight
    ones: torch prepares every micro-batch's buffers before the schedule runs (runtime/dry_run.py counts them)."""
    stages = layout.pp * layout.vpp
    if layout.pp == 1 or not options.pipeline_buffers_every_microbatch:
        return (0.0,) * stages
    each = layout.num_microbatches * pipeline_boundary_bytes(inputs, layout)
    return tuple(each * ((i > 0) + (i < stages - 1)) for i in range(stages))


def stage_buffer_bytes(
    inputs: ModelCostInputs, layout: Layout, options: CostOptions = CostOptions()
) -> tuple[float, ...]:
    """Per virtual stage, the bytes it holds at its peak that no block decides: its pipeline receive buffers and,
    on the last stage, the loss backward's temporaries (one micro-batch's, memory.loss_backward_bytes) beyond the
    ZeRO-3 gather buffer the rank already counts: FSDP2 holds no gathered block while the loss runs backward (the
    dry run measures the two at different moments), so the peak has the larger of them, not both."""
    out = list(pipeline_buffer_bytes(inputs, layout, options))
    if options.fused_loss_backward:
        return tuple(out)
    loss = loss_backward_bytes(inputs.post, vocab_shards(inputs, layout.tp), layout.micro_batch)
    gather_buffer = _rank_wide_bytes(inputs, layout, options.sp_saves_gathered_inputs)[0]
    out[-1] += max(loss - gather_buffer, 0.0)
    return tuple(out)


def _check(inputs: ModelCostInputs, layout: Layout, assignment: StageAssignment) -> None:
    stages = layout.pp * layout.vpp
    if layout.cp < 1 or layout.ep < 1 or (layout.dp * layout.cp) % layout.ep:
        raise PlanError(
            f"ep {layout.ep} must divide dp·cp = {layout.dp * layout.cp} (expert parallelism is carved out of the "
            f"data- and context-parallel ranks), and cp, ep must be >= 1"
        )
    if len(assignment.blocks_per_stage) != stages or sum(assignment.blocks_per_stage) != inputs.num_blocks:
        raise PlanError(
            f"stage assignment {assignment.blocks_per_stage} must place all {inputs.num_blocks} "
            f"blocks on pp·vpp = {stages} stages"
        )
    rc = assignment.recompute_blocks
    if rc is not None and (len(rc) != stages or any(not 0 <= r <= n for r, n in zip(rc, assignment.blocks_per_stage))):
        raise PlanError(f"recompute_blocks {rc} must give 0..n recomputed blocks for each of the {stages} stages")


def evaluate(
    inputs: ModelCostInputs,
    layout: Layout,
    gpu: GPUProfile,
    cluster: ClusterProfile,
    assignment: StageAssignment | None = None,
    options: CostOptions = CostOptions(),
) -> Evaluation:
    """Predict step time, its breakdown and per-GPU memory of `layout` (balanced blocks unless `assignment`)."""
    options = on_cluster(options, cluster)
    pp, vpp, tp, m = layout.pp, layout.vpp, layout.tp, layout.num_microbatches
    num_stages = pp * vpp
    assignment = assignment or StageAssignment(balanced_blocks(inputs.num_blocks, num_stages))
    _check(inputs, layout, assignment)
    counts = assignment.blocks_per_stage
    rcs = assignment.recompute_blocks or (counts if layout.recompute != "none" else (0,) * num_stages)
    inputs = _as_run(inputs, layout, options)
    whole = inputs
    inputs = cp_share(inputs, layout.cp)
    tp_link = group_link(cluster, tp, 1)
    seq = max(1, inputs.seq_len // layout.cp)
    plain = replace(layout, recompute="none") if layout.recompute != "none" else layout
    pre = _layer_times(inputs.pre, plain, gpu, tp_link, seq, options, cluster)
    post = _layer_times(inputs.post, plain, gpu, tp_link, seq, options, cluster)
    flight = inflight(pp, vpp, m)
    mb, sp = layout.micro_batch, layout.sequence_parallel
    g = options.sp_saves_gathered_inputs
    terms, kind_of = _block_terms(inputs, layout, gpu, tp_link, seq, options, cluster)
    p2p = _p2p_time(inputs, layout, cluster, tp_link, options, _cheapest_block_s(terms))
    a_pre = activation_bytes(inputs.pre, "none", tp, sp, mb, g)
    a_post = activation_bytes(inputs.post, "none", tp, sp, mb, g)
    p_pre, e_pre = rank_params(inputs.pre, tp, layout.ep)
    p_post, e_post = rank_params(inputs.post, tp, layout.ep)
    p_post += inputs.tied_params / vocab_shards(inputs, tp) if pp > 1 else 0.0
    # middle stages holding a tied copy (T5's decoder embedding), one copy per rank: not on the embedding's rank 0
    # nor on the rank of the last stage, whose head copy p_post holds
    tied = tied_stages(inputs, counts)
    tied_copies: dict[int, int] = {}
    for i in sorted(tied - {0, num_stages - 1}):
        if i % pp not in (0, (num_stages - 1) % pp):
            tied_copies.setdefault(i % pp, i)
    reserve = cluster.memory_reserve_gib * GIB
    buffer, working = _rank_wide_bytes(inputs, layout, g)
    batch = rank_batch_bytes(inputs, layout)
    buffers = stage_buffer_bytes(inputs, layout, options)
    recomputing = [any(rcs[i] for i in range(r, num_stages, pp)) for r in range(pp)]
    names = inputs.block_names
    stages: list[StageCost] = []
    ranks = _RankTotals.zeros(pp)
    pos = 0
    for i, (n, r) in enumerate(zip(counts, rcs)):
        first, last = i == 0, i == num_stages - 1
        fwd, bwd, tpc, epc, cpc, rc, params, experts, acts = _stage_blocks(terms, kind_of, pos, n, r)
        for edge, t, p_edge, e_edge, a_edge in (
            (first, pre, p_pre, e_pre, a_pre),
            (last, post, p_post, e_post, a_post),
        ):
            if edge:
                fwd, bwd, tpc, epc, cpc = (
                    fwd + t.forward_s,
                    bwd + t.backward_s,
                    tpc + t.tp_s,
                    epc + t.ep_s,
                    cpc + t.cp_s,
                )
                params, experts, acts = params + p_edge, experts + e_edge, acts + a_edge
        if tied_copies.get(i % pp) == i:
            params += inputs.tied_params / vocab_shards(inputs, tp)
        if 0 < i < pp:  # the copy of the root parameters every other pipeline rank holds (rank 0's are in pre)
            params += sum(inputs.root_param_numels)
        rank_wide = i < pp  # the rank's first chunk carries its reserve, working block and ZeRO-3 buffer
        static = stage_state_bytes(params, experts, layout, options.grad_buffer_bytes, inputs.compute_bytes)
        memory = MemoryBreakdown(
            static.params + (buffer if rank_wide else 0.0),
            static.grads,
            static.optimizer,
            flight[i] * acts
            + buffers[i]
            + (working if rank_wide and recomputing[i] else 0.0)
            + (batch if rank_wide else 0.0),
            reserve if rank_wide else 0.0,
        )
        layers = (inputs.pre.names if first else ()) + names[pos : pos + n] + (inputs.post.names if last else ())
        pos += n
        stage = StageCost(
            index=i,
            rank=i % pp,
            chunk=i // pp,
            layers=layers,
            num_blocks=n,
            recompute_blocks=r,
            forward_s=fwd,
            backward_s=bwd,
            recompute_s=rc,
            tp_comm_s=tpc,
            pp_comm_s=p2p,
            inflight=flight[i],
            memory=memory,
            ep_comm_s=epc,
            cp_comm_s=cpc,
        )
        stages.append(stage)
        ranks.add(i % pp, stage, params, experts)
    return _assemble(whole, inputs, layout, gpu, cluster, stages, ranks, options, len({i % pp for i in tied}))


def moe_share(inputs: ModelCostInputs) -> float:
    """Fraction of the blocks that dispatch tokens to routed experts (1.0 when blocks are not listed)."""
    if not inputs.block_costs:
        return 1.0
    return sum(1 for c in inputs.block_costs if c.dispatch_bytes > 0) / len(inputs.block_costs)


def rank_params(layer: LayerCost, tp: int, ep: int) -> tuple[float, float]:
    """(all, routed-expert) parameters of `layer` one rank holds: the dense part ÷tp (or replicated), the routed
    experts ÷ep, and ÷tp as well where expert-tensor parallelism splits them (inputs.for_tp)."""
    experts = local_expert_params(layer, tp)
    return local_params(layer, tp) - experts * (1.0 - 1.0 / ep), experts / ep


def stage_state_bytes(
    params: float, experts: float, layout: Layout, grad_bytes: float = GRAD_BYTES, compute_bytes: float = 2.0
) -> MemoryBreakdown:
    """Parameter, gradient and optimizer bytes of `params` local parameters, `experts` of them routed experts:
    the dense part sharded (per zero) over the dp·cp ranks, the experts over the dp·cp/ep that hold them;
    gradients of `grad_bytes` each (CostOptions.grad_buffer_bytes), the compute copy in `compute_bytes`."""
    pipelined, zero = layout.pp > 1, layout.zero
    per = state_bytes(1.0, zero, layout.dp * layout.cp, pipelined, grad_bytes, compute_bytes)
    if layout.ep == 1:
        return MemoryBreakdown(params * per.params, params * per.grads, params * per.optimizer)
    per_e = state_bytes(1.0, zero, layout.expert_dp, pipelined, grad_bytes, compute_bytes)
    dense = params - experts
    return MemoryBreakdown(
        dense * per.params + experts * per_e.params,
        dense * per.grads + experts * per_e.grads,
        dense * per.optimizer + experts * per_e.optimizer,
    )


@dataclass(frozen=True, slots=True)
class _RankTotals:
    """Per pipeline rank sums over its chunks (lists owned by one evaluate call)."""

    forward: list[float]
    backward: list[float]
    recompute: list[float]
    tp: list[float]
    pp: list[float]
    params: list[float]  # local parameter count
    memory: list[list[float]]  # params, grads, optimizer, activations, reserve bytes
    ep: list[float]
    cp: list[float]
    experts: list[float]  # local routed-expert parameters (part of params)

    @staticmethod
    def zeros(pp: int) -> _RankTotals:
        z = [[0.0] * pp for _ in range(9)]
        return _RankTotals(*z[:6], [[0.0] * 5 for _ in range(pp)], *z[6:])

    def add(self, rank: int, s: StageCost, params: float, experts: float = 0.0) -> None:
        self.ep[rank] += s.ep_comm_s
        self.cp[rank] += s.cp_comm_s
        self.experts[rank] += experts
        self.forward[rank] += s.forward_s
        self.backward[rank] += s.backward_s
        self.recompute[rank] += s.recompute_s
        self.tp[rank] += s.tp_comm_s
        self.pp[rank] += s.pp_comm_s
        self.params[rank] += params
        mem, m = self.memory[rank], s.memory
        mem[0] += m.params
        mem[1] += m.grads
        mem[2] += m.optimizer
        mem[3] += m.activations
        mem[4] += m.reserve

    def time(self, rank: int) -> float:
        return (self.forward[rank] + self.backward[rank] + self.recompute[rank] + self.tp[rank] + self.pp[rank]) + (
            self.ep[rank] + self.cp[rank]
        )


def _dp_time(
    inputs: ModelCostInputs,
    layout: Layout,
    cluster: ClusterProfile,
    ranks: _RankTotals,
    options: CostOptions,
    tied_ranks: int,
) -> float:
    """Exposed data-parallel (and tied-embedding, SP norm gradient and gradient-norm) communication per step, the
    slowest rank's (CostOptions says what overlaps with what). Dense gradients reduce over the dp·cp ranks; with
    ep > 1 the routed experts' over the dp·cp/ep ranks that hold the same experts (ep·tp apart); a tied weight's
    gradient over the `tied_ranks` pipeline ranks that hold a copy."""
    dp, pp = layout.dp, layout.pp
    exposed = 0.0
    if dp * layout.cp > 1:
        o = options.dp_overlap
        for rank in range(pp):
            t = _dp_rank_time(inputs, layout, _dp_groups(layout, cluster, ranks, rank), ranks, rank, o, options)
            exposed = max(exposed, t)
    if pp > 1:  # root parameters (a ViT's class token): each tensor's gradient all-reduced over the pp ranks
        link = p2p_link(cluster, layout.tp * layout.cp * dp)
        exposed += sum(all_reduce_s(options.grad_reduce_bytes * n, pp, link) for n in inputs.root_param_numels)
    if pp > 1 and inputs.tied_params and tied_ranks > 1:
        exposed += all_reduce_s(
            options.grad_reduce_bytes
            * inputs.tied_params
            / (vocab_shards(inputs, layout.tp) * (dp if layout.zero >= 1 else 1)),
            tied_ranks,
            p2p_link(cluster, layout.tp * layout.cp * dp),
        )
    if layout.tp > 1:  # SP norm and per-head norm gradients, the fullest rank's (ceil(blocks / pp))
        blocks = math.ceil(inputs.num_blocks / pp)
        sp = layout.sequence_parallel
        edge = max(inputs.pre, inputs.post, key=lambda c: c.sp_param_elems)
        count = blocks * inputs.block.head_param_count + (
            blocks * inputs.block.sp_param_count + edge.sp_param_count if sp else 0
        )
        times = sp_norm_reductions(layout, options.zero3_reduce_every_microbatch)
        if count:
            width = sp_norm_bytes(
                layout, inputs.compute_bytes, options.grad_reduce_bytes, options.zero3_reduce_every_microbatch
            )
            elems = blocks * inputs.block.head_param_elems
            elems += blocks * sp_param_elems(inputs.block, layout.ep) + edge.sp_param_elems if sp else 0.0
            exposed += times * all_reduce_s(width * elems, layout.tp, group_link(cluster, layout.tp, 1), count)
    if layout.world_size > 1:  # runtime/optim.py grad_norm: one fp32 scalar over every rank
        exposed += all_reduce_s(GRAD_NORM_BYTES, layout.world_size, group_link(cluster, layout.world_size, 1))
    return exposed


def _dp_groups(layout: Layout, cluster: ClusterProfile, ranks: _RankTotals, rank: int) -> list[tuple[float, int, Link]]:
    """(local parameters, group size, link) of each gradient-reduction group of one pipeline rank."""
    n = layout.dp * layout.cp
    if layout.ep == 1:
        return [(ranks.params[rank], n, group_link(cluster, n, layout.tp))]
    experts = ranks.experts[rank]
    edp = layout.expert_dp
    return [
        (ranks.params[rank] - experts, n, group_link(cluster, n, layout.tp)),
        (experts, edp, group_link(cluster, edp, layout.tp * layout.ep)),
    ]


def _dp_rank_time(
    inputs: ModelCostInputs,
    layout: Layout,
    groups: list[tuple[float, int, Link]],
    ranks: _RankTotals,
    rank: int,
    o: float,
    options: CostOptions,
) -> float:
    """One pipeline rank's exposed dp communication per step, over its reduction groups (each group's traffic
    as one group would run it, all of it under the same compute windows)."""
    m = layout.num_microbatches
    params = ranks.params[rank]
    backward = ranks.backward[rank] + ranks.recompute[rank]  # one micro-batch
    forward = ranks.forward[rank]
    grb = options.grad_reduce_bytes
    if layout.zero >= 3 and layout.pp == 1:
        # FSDP: per layer, the parameters are gathered for the forward and for the backward on every micro-batch
        # (a fully recomputed forward runs inside the backward, on the parameters gathered for it); gradients
        # reduce-scattered per layer on every micro-batch (mlm-run: FSDP2 reduces as each micro-batch's backward
        # ends) or once per step
        layers = max(1, round(len(inputs.block_names) * params / max(_block_params(inputs, layout), 1.0)))
        layers = min(layers, len(inputs.block_names) + 2)
        gathers = 2
        reduces = m if options.zero3_reduce_every_microbatch else 1
        comm = sum(
            m * gathers * all_gather_s(inputs.compute_bytes * p, n, link, layers)
            + reduces * reduce_scatter_s(grb * p, n, link, layers)
            for p, n, link in groups
        )
        first = max(all_gather_s(inputs.compute_bytes * p / layers, n, link) for p, n, link in groups)
        window = m * (forward + backward)
        return max(first, _exposed(comm, o * window, options)) if o > 0 else comm
    if layout.zero == 0:
        comm = floor = 0.0
        for p, n, link in groups:
            grad_bytes = grb * p
            bucket = min(options.ddp_bucket_bytes, grad_bytes)
            calls = max(1, math.ceil(grad_bytes / max(bucket, 1.0)))
            comm += all_reduce_s(grad_bytes, n, link, calls)
            floor = max(floor, all_reduce_s(bucket, n, link))
        return max(floor, _exposed(comm, o * backward, options)) if o > 0 else comm
    # zero 1, and zero 3 under pipelining (FSDP2 without resharding after forward): the gradients are
    # reduce-scattered once per step; the parameters gathered for every micro-batch's forward without pipelining
    # (FSDP2 reshards after each backward), once per step with it (the pipeline keeps them between micro-batches)
    # or where the runtime's distributed optimizer keeps them (CostOptions.zero1_gathers_every_microbatch)
    gathers = m if layout.pp == 1 and options.zero1_gathers_every_microbatch else 1
    rs = sum(reduce_scatter_s(grb * p, n, link) for p, n, link in groups)
    ag = sum(gathers * all_gather_s(inputs.compute_bytes * p, n, link) for p, n, link in groups)
    if o <= 0:
        return rs + ag
    return _exposed(rs, o * backward, options) + _exposed(ag, o * gathers * forward, options)


def _block_params(inputs: ModelCostInputs, layout: Layout) -> float:
    """Local parameters of one block under tp (and ep)."""
    return rank_params(inputs.block, layout.tp, layout.ep)[0]


def _optimizer_s(layout: Layout, gpu: GPUProfile, ranks: _RankTotals) -> float:
    """Adam's memory-bound pass over the busiest rank's local parameters (shards per zero: dense over dp·cp,
    routed experts over dp·cp/ep)."""
    bandwidth = gpu.hbm_gbps * 1e9 * gpu.memory_bound_efficiency
    if layout.zero < 1:
        return max(ranks.params) * OPTIMIZER_TRAFFIC_BYTES / 1 / bandwidth
    dense_shard = layout.dp * layout.cp
    if layout.ep == 1:
        return max(ranks.params) * OPTIMIZER_TRAFFIC_BYTES / dense_shard / bandwidth
    local = max((p - e) / dense_shard + e / layout.expert_dp for p, e in zip(ranks.params, ranks.experts))
    return local * OPTIMIZER_TRAFFIC_BYTES / bandwidth


def _assemble(
    whole: ModelCostInputs,
    inputs: ModelCostInputs,
    layout: Layout,
    gpu: GPUProfile,
    cluster: ClusterProfile,
    stages: list[StageCost],
    ranks: _RankTotals,
    options: CostOptions,
    tied_ranks: int,
) -> Evaluation:
    """The step's Evaluation from its stages (tied_ranks: the pipeline ranks holding a copy of a tied weight)."""
    pp, m = layout.pp, layout.num_microbatches
    rank_times = [ranks.time(r) for r in range(pp)]
    pipe, bubble = pipeline_time(rank_times, m, layout.vpp)
    b = max(range(pp), key=rank_times.__getitem__)
    dp_s = _dp_time(inputs, layout, cluster, ranks, options, tied_ranks)
    opt_s = _optimizer_s(layout, gpu, ranks)
    breakdown = {
        "compute_s": m * (ranks.forward[b] + ranks.backward[b]),
        "tp_comm_s": m * ranks.tp[b],
        "pp_comm_s": m * ranks.pp[b],
        "dp_comm_s": dp_s,
        "bubble_s": bubble,
        "recompute_s": m * ranks.recompute[b],
        "optimizer_s": opt_s,
    }
    if layout.ep > 1:  # the terms of ep and cp appear only where they are used (plan.json's breakdown stays as it was)
        breakdown["ep_comm_s"] = m * ranks.ep[b]
    if layout.cp > 1:
        breakdown["cp_comm_s"] = m * ranks.cp[b]
    step = pipe + dp_s + opt_s
    rank_memory = tuple(MemoryBreakdown(*mem) for mem in ranks.memory)
    capacity = gpu.hbm_gib * GIB
    peak = max(x.total for x in rank_memory)
    fits = peak <= capacity
    tokens = layout.global_batch * whole.seq_len
    tflops = layout.global_batch * whole.model_flops_per_sample / step / layout.world_size / 1e12
    return Evaluation(
        layout=layout,
        stages=tuple(stages),
        rank_memory=rank_memory,
        step_time_s=step,
        breakdown=breakdown,
        tokens_per_s=tokens / step,
        model_tflops_per_gpu=tflops,
        mfu=tflops / gpu.bf16_tflops,
        peak_memory_bytes=peak,
        capacity_bytes=capacity,
        fits=fits,
        reason=None if fits else _overflow_reason(stages, rank_memory, capacity, layout),
        bottleneck_rank=b,
    )


def _overflow_reason(
    stages: list[StageCost], rank_memory: tuple[MemoryBreakdown, ...], capacity: float, layout: Layout
) -> str:
    """Which GPU overflows, by how much, and what dominates its memory."""
    rank = max(range(len(rank_memory)), key=lambda r: rank_memory[r].total)
    mem = rank_memory[rank]
    idx = [s.index for s in stages[rank :: layout.pp]]
    where = f"pipeline stage {idx[0]}" if len(idx) == 1 else f"pipeline rank {rank} (stages {idx})"
    flight = max(s.inflight for s in stages[rank :: layout.pp])
    return (
        f"{where} needs {mem.total / GIB:.1f} GiB of {capacity / GIB:.1f} GiB (over by "
        f"{(mem.total - capacity) / GIB:.1f} GiB); {mem.largest()} dominate: activations "
        f"{mem.activations / GIB:.1f} GiB ({flight:g} in-flight micro-batches of {layout.micro_batch}, recompute "
        f"{layout.recompute}), weights+grads+optimizer {mem.static / GIB:.1f} GiB (zero {layout.zero}), "
        f"reserve {mem.reserve / GIB:.1f} GiB"
    )


# ---- the stage MILP's coefficients -------------------------------------------------------------------------------


def stage_coefficients(
    inputs: ModelCostInputs,
    layout: Layout,
    gpu: GPUProfile,
    cluster: ClusterProfile,
    options: CostOptions = CostOptions(),
) -> StageCoefficients:
    """Per-block time and memory coefficients under `layout`, computed by the same functions evaluate() uses."""
    options = on_cluster(options, cluster)
    inputs = _as_run(inputs, layout, options)
    tp, zero = layout.tp, layout.zero
    inputs = cp_share(inputs, layout.cp)
    seq = max(1, inputs.seq_len // layout.cp)
    tp_link = group_link(cluster, tp, 1)
    plain = replace(layout, recompute="none") if layout.recompute != "none" else layout
    g = options.sp_saves_gathered_inputs
    terms, kind_of = _block_terms(inputs, layout, gpu, tp_link, seq, options, cluster)
    pre = _layer_times(inputs.pre, plain, gpu, tp_link, seq, options, cluster)
    post = _layer_times(inputs.post, plain, gpu, tp_link, seq, options, cluster)
    per_param = state_bytes(
        1.0, zero, layout.dp * layout.cp, layout.pp > 1, options.grad_buffer_bytes, inputs.compute_bytes
    ).static

    def static(params: float, experts: float) -> float:
        if layout.ep == 1:
            return per_param * params
        return stage_state_bytes(params, experts, layout, options.grad_buffer_bytes, inputs.compute_bytes).static

    def edge_static(layer: LayerCost, extra: float = 0.0) -> float:
        params, experts = rank_params(layer, tp, layout.ep)
        return static(params + extra, experts)

    def time(t: _LayerTimes) -> float:
        return t.forward_s + t.backward_s + t.tp_s + (t.ep_s + t.cp_s)

    buffer, working = _rank_wide_bytes(inputs, layout, g)
    fixed = cluster.memory_reserve_gib * GIB + buffer + working + rank_batch_bytes(inputs, layout)
    kind_time = [time(b.times) for b in terms]
    kind_extra = [b.times.recompute_s for b in terms]
    kind_static = [static(b.params, b.experts) for b in terms]
    kind_act = [b.act for b in terms]
    kind_act_rc = [b.act_recompute for b in terms]
    each: dict[str, tuple[float, ...]] = {}
    if len(terms) > 1:  # blocks differ: the MILP places each as itself; the scalars are their means
        for name, per_kind in (
            ("block_times_s", kind_time),
            ("block_recompute_extras_s", kind_extra),
            ("block_statics_bytes", kind_static),
            ("block_acts_bytes", kind_act),
            ("block_acts_recompute_bytes", kind_act_rc),
        ):
            each[name] = tuple(per_kind[k] for k in kind_of)

    def mean(name: str, per_kind: list[float]) -> float:
        return sum(each[name]) / len(kind_of) if name in each else per_kind[0]

    t_b = mean("block_times_s", kind_time)
    extra = mean("block_recompute_extras_s", kind_extra)
    return StageCoefficients(
        num_blocks=inputs.num_blocks,
        block_time_s=t_b,
        block_recompute_extra_s=extra,
        block_time_recompute_s=t_b + extra,
        pre_time_s=time(pre),
        post_time_s=time(post),
        p2p_time_s=_p2p_time(inputs, layout, cluster, tp_link, options, _cheapest_block_s(terms)),
        block_static_bytes=mean("block_statics_bytes", kind_static),
        pre_static_bytes=edge_static(inputs.pre),
        post_static_bytes=edge_static(
            inputs.post, inputs.tied_params / vocab_shards(inputs, tp) if layout.pp > 1 else 0.0
        ),
        block_act_bytes=mean("block_acts_bytes", kind_act),
        block_act_recompute_bytes=mean("block_acts_recompute_bytes", kind_act_rc),
        pre_act_bytes=activation_bytes(inputs.pre, "none", tp, layout.sequence_parallel, layout.micro_batch, g),
        post_act_bytes=activation_bytes(inputs.post, "none", tp, layout.sequence_parallel, layout.micro_batch, g),
        inflight=inflight(layout.pp, layout.vpp, layout.num_microbatches),
        fixed_bytes=fixed,
        capacity_bytes=gpu.hbm_gib * GIB - fixed,
        recompute_working_bytes=working,
        stage_buffer_bytes=stage_buffer_bytes(inputs, layout, options),
        **each,
    )
