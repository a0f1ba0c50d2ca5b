"""The cost model: step time and per-GPU memory of a layout, from summarised IR numbers and hardware profiles.

Pure arithmetic on frozen dataclasses (no torch): `summarize(ir)` once per model, then `evaluate` per layout in
well under a millisecond. Per micro-batch and per layer (planner/cost/inputs.py says how layers are split):

  GEMMs       2·m·k·n/tp FLOPs at gpu.gemm_efficiency((m·k·n/tp)^(1/3)), m = micro_batch·seq; backward = 2x
              forward (input and weight gradients have the same m·n·k, hence the same size and efficiency).
  attention   fused kernels: the profile's convention, 7·b·h·s²·d fwd+bwd FLOPs (= 1.75x the IR's non-causal
              forward count) at attention_efficiency(s), split 2:5 forward:backward; materialised scores (manual):
              batched (s, s, d) GEMMs, backward 2x.
  memory-bound  bytes / (hbm_gbps · memory_bound_efficiency), tp-region bytes ÷tp, residual-stream bytes ÷tp only
              with sequence parallelism; backward moves 2x the forward bytes (reads saved input and grad, writes grad).
  tp comm     per block 2 all-reduces forward and 2 backward (Megatron's g and f), or all-gather + reduce-scatter
              pairs with SP (same ring bytes); not overlapped (Megatron-LM 2021 runs them on the compute stream).
  recompute   full: one more forward of the block incl. its all-reduces; selective: the attention core's forward
              (score matmuls and softmax/dropout bytes; nothing when the fused kernel saves no scores).
  pp comm     per virtual stage and micro-batch one send/recv forward and one backward of the boundary activation,
              1/tp of it per rank plus an NVLink all-gather without SP (Narayanan et al. 2021, scatter/gather opt.).
  bubble      planner/cost/schedule.py: m·t_max + (Σ t_rank − t_max)/vpp, i.e. (pp−1)/(vpp·m) of ideal when balanced.
  dp comm     bf16 gradient all-reduce in DDP buckets (zero 0) or reduce-scatter + parameter all-gather
              (zero 1) of the rank's local parameters once per step; zero 3 gathers each layer's parameters in
              forward, again in a fully recomputed forward, and in backward on every micro-batch, and
              reduce-scatters per layer once per step (mlm-run) or every micro-batch. Latency grows with the ring
              and a group spanning nodes runs at its members' NIC bandwidth (collectives.py). What overlaps:
              CostOptions (default mlm-run, torch DDP/FSDP2: hidden up to the compute it runs under; MEGATRON_2021:
              nothing hidden). Tied embeddings add a first/last-stage gradient all-reduce when pp > 1.
  optimizer   Adam as a memory-bound pass: 28 bytes per local parameter (fp32 master, m, v read+written; bf16
              grad read, bf16 weight written), sharded over dp under zero >= 1.

Breakdown: step_time_s = compute_s + recompute_s + tp_comm_s + pp_comm_s (the busiest pipeline rank's
per-micro-batch terms x m; compute_s holds GEMMs, attention and memory-bound ops) + bubble_s + dp_comm_s (exposed
part) + optimizer_s, exactly.

Calibration: each GPU profile's GEMM and attention curves are its prior times one compute factor fitted on the
train rows of the published runs in profiles/calibration/ and checked on held-out rows (planner/cost/calibration.py,
benchmarks/fit_profiles.py, the profile's [calibration] table, docs/calibration.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from mlm.planner.cost.collectives import Link, all_gather_s, all_reduce_s, group_link, p2p_link, p2p_s, reduce_scatter_s
from mlm.planner.cost.hardware import ClusterProfile, GPUProfile, gemm_size
from mlm.planner.cost.inputs import LayerCost, ModelCostInputs, summarize
from mlm.planner.cost.memory import (
    MemoryBreakdown,
    activation_bytes,
    local_params,
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
    tp_overlap: fraction of tensor-parallel collective time hidden behind the block's GEMMs (Megatron-Core
        --tp-comm-overlap); 0 in mlm-run and in Megatron-LM 2021/2022.
    """

    dp_overlap: float = 1.0
    ddp_bucket_bytes: float = 25.0 * 2**20
    zero3_reduce_every_microbatch: bool = True
    grad_reduce_bytes: float = 4.0
    tp_overlap: float = 0.0


MLM_RUN = CostOptions()
MEGATRON_2021 = CostOptions(
    dp_overlap=0.0, zero3_reduce_every_microbatch=False, grad_reduce_bytes=2.0
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

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s + self.recompute_s + self.tp_comm_s + self.pp_comm_s


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


@dataclass(frozen=True)
class StageCoefficients:
    """The cost model's per-block numbers for the stage MILP (all per micro-batch, seconds and bytes).

    Agreement with evaluate(): for an assignment (n_i, r_i), evaluate's StageCost.time_s of virtual stage i equals
    n_i·block_time_s + r_i·block_recompute_extra_s + [i=0]·pre_time_s + [i=S−1]·post_time_s + p2p_time_s, and a
    rank's memory equals Σ_i n_i·block_static_bytes + [i=0]·pre_static_bytes + [i=S−1]·post_static_bytes
    + inflight[i]·((n_i−r_i)·block_act_bytes + r_i·block_act_recompute_bytes + [i=0]·pre_act_bytes
    + [i=S−1]·post_act_bytes) + the rank-wide terms. capacity_bytes is HBM minus the rank-wide terms (reserve,
    ZeRO-3 buffer, and full recompute's working block, which evaluate counts only on ranks that recompute).
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


def balanced_blocks(num_blocks: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage as even as possible, extras on the middle stages (same rule as build_plan)."""
    base, extra = divmod(num_blocks, stages)
    counts = [base] * stages
    for i in sorted(range(stages), key=lambda i: abs(i - (stages - 1) / 2))[:extra]:
        counts[i] += 1
    return tuple(counts)


# ---- per-layer times ---------------------------------------------------------------------------------------------


def _layer_times(
    layer: LayerCost, layout: Layout, gpu: GPUProfile, tp_link: Link, seq: int, tp_overlap: float = 0.0
) -> _LayerTimes:
    """Forward, backward, exposed tp-collective and recompute time of one micro-batch through `layer`
    (tp_overlap: the fraction of the collectives hidden behind this layer's GEMMs, at most their time)."""
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
        else:
            both = 1.75 * flops / (peak * gpu.attention_efficiency(seq))
            attn_f, attn_b = both * 2.0 / 7.0, both * 5.0 / 7.0
    bandwidth = gpu.hbm_gbps * 1e9 * gpu.memory_bound_efficiency
    mem = mb * (layer.mem_sharded / tp + layer.mem_replicated / (tp if sp else 1)) / bandwidth
    tp_f = _tp_collective(layer.tp_fwd_count, mb * layer.tp_fwd_bytes, tp, sp, tp_link)
    tp_b = _tp_collective(layer.tp_bwd_count, mb * layer.tp_bwd_bytes, tp, sp, tp_link)
    forward = gemm + attn_f + mem
    if layout.recompute == "full":
        extra = forward + tp_f
    elif layout.recompute == "selective" and layer.attn_materialized:
        extra = attn_f + mb * layer.core_bytes / tp / bandwidth
    else:
        extra = 0.0
    tp_total = tp_f + tp_b
    tp_exposed = tp_total - min(tp_overlap * tp_total, 3.0 * gemm) if tp_overlap > 0 else tp_total
    return _LayerTimes(forward, 2.0 * gemm + attn_b + 2.0 * mem, tp_exposed, extra)


def _tp_collective(count: int, nbytes: float, tp: int, sp: bool, link: Link) -> float:
    """`count` all-reduces of `nbytes` in total, or as many all-gather + reduce-scatter pairs under SP."""
    if tp == 1 or count == 0:
        return 0.0
    if sp:
        return all_gather_s(nbytes, tp, link, count) + reduce_scatter_s(nbytes, tp, link, count)
    return all_reduce_s(nbytes, tp, link, count)


def _p2p_time(inputs: ModelCostInputs, layout: Layout, cluster: ClusterProfile, tp_link: Link) -> float:
    """Send/recv time per virtual stage and micro-batch (forward activation + backward gradient)."""
    if layout.pp == 1:
        return 0.0
    nbytes = layout.micro_batch * inputs.block.output_bytes
    one = p2p_s(nbytes / layout.tp, p2p_link(cluster, layout.tp * layout.dp))
    if not layout.sequence_parallel:
        one += all_gather_s(nbytes, layout.tp, tp_link)
    return 2.0 * one


# ---- evaluate ----------------------------------------------------------------------------------------------------


def _check(inputs: ModelCostInputs, layout: Layout, assignment: StageAssignment) -> None:
    stages = layout.pp * layout.vpp
    if layout.cp != 1:
        raise PlanError("context parallelism (cp > 1) is not modelled by the cost model yet")
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
    pp, vpp, tp, dp, m = layout.pp, layout.vpp, layout.tp, layout.dp, layout.num_microbatches
    num_stages = pp * vpp
    assignment = assignment or StageAssignment(balanced_blocks(inputs.num_blocks, num_stages))
    _check(inputs, layout, assignment)
    counts = assignment.blocks_per_stage
    rcs = assignment.recompute_blocks or (counts if layout.recompute != "none" else (0,) * num_stages)
    tp_link = group_link(cluster, tp, 1)
    seq = inputs.seq_len
    plain = replace(layout, recompute="none") if layout.recompute != "none" else layout
    o = options.tp_overlap
    blk = _layer_times(inputs.block, layout, gpu, tp_link, seq, o)
    pre = _layer_times(inputs.pre, plain, gpu, tp_link, seq, o)
    post = _layer_times(inputs.post, plain, gpu, tp_link, seq, o)
    p2p = _p2p_time(inputs, layout, cluster, tp_link)
    flight = inflight(pp, vpp, m)
    mb, sp = layout.micro_batch, layout.sequence_parallel
    a_none = activation_bytes(inputs.block, "none", tp, sp, mb)
    a_rc = activation_bytes(inputs.block, layout.recompute, tp, sp, mb)
    a_pre = activation_bytes(inputs.pre, "none", tp, sp, mb)
    a_post = activation_bytes(inputs.post, "none", tp, sp, mb)
    p_block = local_params(inputs.block, tp)
    p_pre = local_params(inputs.pre, tp)
    p_post = local_params(inputs.post, tp) + (inputs.tied_params / tp if pp > 1 else 0.0)
    per = state_bytes(1.0, layout.zero, dp, pp > 1)  # bytes per local parameter: params, grads, optimizer
    reserve = cluster.memory_reserve_gib * GIB
    buffer = zero3_buffer_bytes(inputs.block, tp, layout.zero, pp > 1)
    working = working_bytes(inputs.block, layout.recompute, tp, sp, mb)
    recomputing = [any(rcs[i] for i in range(r, num_stages, pp)) for r in range(pp)]
    names = inputs.block_names
    stages: list[StageCost] = []
    ranks = _RankTotals.zeros(pp)
    pos = 0
    for i, (n, r) in enumerate(zip(counts, rcs)):
        first, last = i == 0, i == num_stages - 1
        fwd, bwd, tpc = n * blk.forward_s, n * blk.backward_s, n * blk.tp_s
        params, acts = n * p_block, (n - r) * a_none + r * a_rc
        if first:
            fwd, bwd, tpc, params, acts = (
                fwd + pre.forward_s,
                bwd + pre.backward_s,
                tpc + pre.tp_s,
                params + p_pre,
                acts + a_pre,
            )
        if last:
            fwd, bwd, tpc, params, acts = (
                fwd + post.forward_s,
                bwd + post.backward_s,
                tpc + post.tp_s,
                params + p_post,
                acts + a_post,
            )
        rc = r * blk.recompute_s
        rank_wide = i < pp  # the rank's first chunk carries its reserve, working block and ZeRO-3 buffer
        memory = MemoryBreakdown(
            params * per.params + (buffer if rank_wide else 0.0),
            params * per.grads,
            params * per.optimizer,
            flight[i] * acts + (working if rank_wide and recomputing[i] else 0.0),
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
        )
        stages.append(stage)
        ranks.add(i % pp, stage, params)
    return _assemble(inputs, layout, gpu, cluster, stages, ranks, options)


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

    @staticmethod
    def zeros(pp: int) -> _RankTotals:
        return _RankTotals(*([0.0] * pp for _ in range(6)), [[0.0] * 5 for _ in range(pp)])

    def add(self, rank: int, s: StageCost, params: float) -> None:
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
        return self.forward[rank] + self.backward[rank] + self.recompute[rank] + self.tp[rank] + self.pp[rank]


def _dp_time(
    inputs: ModelCostInputs, layout: Layout, cluster: ClusterProfile, ranks: _RankTotals, options: CostOptions
) -> float:
    """Exposed data-parallel (and tied-embedding) communication per step, the slowest rank's (CostOptions says
    what overlaps with what)."""
    dp, pp = layout.dp, layout.pp
    exposed = 0.0
    if dp > 1:
        link = group_link(cluster, dp, layout.tp)
        o = options.dp_overlap
        for rank in range(pp):
            t = _dp_rank_time(inputs, layout, link, ranks, rank, o, options)
            exposed = max(exposed, t)
    if pp > 1 and inputs.tied_params:
        exposed += all_reduce_s(
            options.grad_reduce_bytes * inputs.tied_params / layout.tp, 2, p2p_link(cluster, layout.tp * dp)
        )
    return exposed


def _dp_rank_time(
    inputs: ModelCostInputs, layout: Layout, link: Link, ranks: _RankTotals, rank: int, o: float, options: CostOptions
) -> float:
    """One pipeline rank's exposed dp communication per step."""
    dp, m = layout.dp, layout.num_microbatches
    params = ranks.params[rank]
    param_bytes = 2.0 * params  # bf16 weights gathered
    grad_bytes = options.grad_reduce_bytes * params
    backward = ranks.backward[rank] + ranks.recompute[rank]  # one micro-batch
    forward = ranks.forward[rank]
    if layout.zero >= 3 and layout.pp == 1:
        # FSDP: per layer, the parameters are gathered for the forward, again for a fully recomputed forward,
        # and for the backward, on every micro-batch; gradients reduce-scattered per layer on every micro-batch
        # (mlm-run: FSDP2 reduces as each micro-batch's backward ends) or once per step
        layers = max(1, round(len(inputs.block_names) * params / max(_block_params(inputs, layout), 1.0)))
        layers = min(layers, len(inputs.block_names) + 2)
        gathers = 3 if layout.recompute == "full" else 2
        reduces = m if options.zero3_reduce_every_microbatch else 1
        comm = m * gathers * all_gather_s(param_bytes, dp, link, layers) + reduces * reduce_scatter_s(
            grad_bytes, dp, link, layers
        )
        first = all_gather_s(param_bytes / layers, dp, link)
        window = m * (forward + backward)
        return max(first, comm - o * window) if o > 0 else comm
    if layout.zero == 0:
        bucket = min(options.ddp_bucket_bytes, grad_bytes)
        calls = max(1, math.ceil(grad_bytes / max(bucket, 1.0)))
        comm = all_reduce_s(grad_bytes, dp, link, calls)
        return max(all_reduce_s(bucket, dp, link), comm - o * backward) if o > 0 else comm
    # zero 1, and zero 3 under pipelining (FSDP2 without resharding after forward): the gradients are
    # reduce-scattered once per step; the parameters gathered for every micro-batch's forward without pipelining
    # (FSDP2 reshards after each backward), once per step with it (the pipeline keeps them between micro-batches)
    gathers = 1 if layout.pp > 1 else m
    rs = reduce_scatter_s(grad_bytes, dp, link)
    ag = gathers * all_gather_s(param_bytes, dp, link)
    if o <= 0:
        return rs + ag
    return max(0.0, rs - o * backward) + max(0.0, ag - o * gathers * forward)


def _block_params(inputs: ModelCostInputs, layout: Layout) -> float:
    """Local parameters of one block under tp."""
    return local_params(inputs.block, layout.tp)


def _assemble(
    inputs: ModelCostInputs,
    layout: Layout,
    gpu: GPUProfile,
    cluster: ClusterProfile,
    stages: list[StageCost],
    ranks: _RankTotals,
    options: CostOptions,
) -> Evaluation:
    pp, m = layout.pp, layout.num_microbatches
    rank_times = [ranks.time(r) for r in range(pp)]
    pipe, bubble = pipeline_time(rank_times, m, layout.vpp)
    b = max(range(pp), key=rank_times.__getitem__)
    dp_s = _dp_time(inputs, layout, cluster, ranks, options)
    shard = layout.dp if layout.zero >= 1 else 1
    opt_s = max(ranks.params) * OPTIMIZER_TRAFFIC_BYTES / shard / (gpu.hbm_gbps * 1e9 * gpu.memory_bound_efficiency)
    breakdown = {
        "compute_s": m * (ranks.forward[b] + ranks.backward[b]),
        "tp_comm_s": m * ranks.tp[b],
        "pp_comm_s": m * ranks.pp[b],
        "dp_comm_s": dp_s,
        "bubble_s": bubble,
        "recompute_s": m * ranks.recompute[b],
        "optimizer_s": opt_s,
    }
    step = pipe + dp_s + opt_s
    rank_memory = tuple(MemoryBreakdown(*mem) for mem in ranks.memory)
    capacity = gpu.hbm_gib * GIB
    peak = max(x.total for x in rank_memory)
    fits = peak <= capacity
    tokens = layout.global_batch * inputs.seq_len
    tflops = layout.global_batch * inputs.model_flops_per_sample / step / layout.world_size / 1e12
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
    tp, sp, mb, zero, dp = layout.tp, layout.sequence_parallel, layout.micro_batch, layout.zero, layout.dp
    tp_link = group_link(cluster, tp, 1)
    plain = replace(layout, recompute="none") if layout.recompute != "none" else layout
    o = options.tp_overlap
    blk = _layer_times(inputs.block, layout, gpu, tp_link, inputs.seq_len, o)
    pre = _layer_times(inputs.pre, plain, gpu, tp_link, inputs.seq_len, o)
    post = _layer_times(inputs.post, plain, gpu, tp_link, inputs.seq_len, o)
    per_param = state_bytes(1.0, zero, dp, layout.pp > 1).static
    p_post = local_params(inputs.post, tp) + (inputs.tied_params / tp if layout.pp > 1 else 0.0)
    fixed = (
        cluster.memory_reserve_gib * GIB
        + zero3_buffer_bytes(inputs.block, tp, zero, layout.pp > 1)
        + working_bytes(inputs.block, layout.recompute, tp, sp, mb)
    )
    t_b = blk.forward_s + blk.backward_s + blk.tp_s
    return StageCoefficients(
        num_blocks=inputs.num_blocks,
        block_time_s=t_b,
        block_recompute_extra_s=blk.recompute_s,
        block_time_recompute_s=t_b + blk.recompute_s,
        pre_time_s=pre.forward_s + pre.backward_s + pre.tp_s,
        post_time_s=post.forward_s + post.backward_s + post.tp_s,
        p2p_time_s=_p2p_time(inputs, layout, cluster, tp_link),
        block_static_bytes=per_param * local_params(inputs.block, tp),
        pre_static_bytes=per_param * local_params(inputs.pre, tp),
        post_static_bytes=per_param * p_post,
        block_act_bytes=activation_bytes(inputs.block, "none", tp, sp, mb),
        block_act_recompute_bytes=activation_bytes(inputs.block, layout.recompute, tp, sp, mb),
        pre_act_bytes=activation_bytes(inputs.pre, "none", tp, sp, mb),
        post_act_bytes=activation_bytes(inputs.post, "none", tp, sp, mb),
        inflight=inflight(layout.pp, layout.vpp, layout.num_microbatches),
        fixed_bytes=fixed,
        capacity_bytes=gpu.hbm_gib * GIB - fixed,
    )
