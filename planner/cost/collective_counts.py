"""The collectives one GPU issues per training step, as the cost model prices them: count and payload bytes per op.

This is the cost model's communication stated as calls instead of seconds, for the dry run (`mlm-run --dry-run`)
to check against what the runtime issues. Payload bytes follow the dry run's convention (runtime/dry_run.py): the
full tensor an all-gather produces or a reduce-scatter consumes, the tensor an all-reduce or a send carries.

Per pipeline rank, with m micro-batches, its layers' LayerCost and its local parameters P (mlm-run semantics,
step_time.py's docstring):
  tp       per layer and micro-batch tp_fwd_count (+ all but the last again under full recompute) + tp_bwd_count
           all-reduces of micro_batch·tp_*_bytes, or as many all-gather + reduce-scatter pairs with sequence
           parallelism (full recompute: every gather again); plus tp_fixed_count all-reduces (vocabulary-parallel
           embedding, loss_parallel statistics) with or without SP; with SP one all-gather in backward where the
           first block's replicated input was sliced into sequence shards (first stage), and one all-reduce of
           each SP norm parameter's gradient per gradient reduction (every micro-batch under ZeRO-3, else once)
  pp       per virtual stage and micro-batch one send forward (not the last stage) and one backward (not the first)
           of micro_batch·block.output_bytes (/ tp with sequence parallelism: the rank's sequence shard)
  dp       zero 0: one all-reduce of the gradients per FSDP unit (replicate(), which every bf16 run and every tp > 1
           run uses, runtime/data_parallel.py; torch DDP, used only for fp32 runs with tp 1, would issue
           ceil(grad bytes / bucket) instead); zero 1 (and zero 3 under
           pipelining): one reduce-scatter of the gradients per FSDP unit, one all-gather of the parameters per unit
           and micro-batch (once per step under pipelining); zero 3: per unit and micro-batch one all-gather in
           forward and one in backward (a fully recomputed forward runs on it), and one reduce-scatter
           (CostOptions.zero3_reduce_every_microbatch; once per step when False)
  cp       per attention layer and micro-batch an all-gather of K and one of V over the cp group (again under
           full recompute) and a reduce-scatter of dK and one of dV, of cp·micro_batch·kv_bytes/tp each (the
           gathered K/V; `layer` holds one cp rank's share, inputs.cp_share); the tp and pp traffic is one rank's
           part of the sequence, and the dp terms reduce over dp·cp ranks
  ep       per MoE layer and micro-batch an all-to-all of the per-expert row counts, the dispatch and the combine
           forward (again under full recompute) and their two reverses backward, over the ep group
  tied     pp > 1 with a tied embedding: one all-reduce of its gradient on each rank holding a copy (the first,
           the last, and a middle one holding a tied layer such as T5's decoder embedding; of the rank's dp shard
           under ZeRO >= 1)
  norm     more than one rank: one all-reduce of the squared gradient norm (4 bytes) over every rank
FSDP units are what runtime/data_parallel.py wraps: every layer that holds parameters, plus the stage itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlm.planner.cost.inputs import (
    LayerCost,
    ModelCostInputs,
    cp_share,
    for_tp,
    sp_param_elems,
    tied_stages,
    vocab_shards,
)
from mlm.planner.cost.memory import local_expert_params, local_params
from mlm.planner.layout import Layout

GRAD_NORM_BYTES = 4.0  # the squared gradient norm, one fp32 scalar


@dataclass(frozen=True)
class CollectiveCount:
    count: int
    bytes: float

    def __add__(self, other: CollectiveCount) -> CollectiveCount:
        return CollectiveCount(self.count + other.count, self.bytes + other.bytes)


def pipeline_boundary_bytes(inputs: ModelCostInputs, layout: Layout, before_block: int | None = None) -> float:
    """What one tp rank sends across a pipeline boundary per micro-batch: its sequence shard under sequence
    parallelism, else the whole (replicated) activation (also the size of each pipeline receive buffer), and the
    activations that skip over blocks (a U-Net's skips, T5's encoder output), carried beside it: across the
    boundary before block `before_block` where the inputs know it, else the most any boundary carries."""
    before = inputs.block
    carried, by_boundary = inputs.carried_bytes, inputs.carried_by_boundary
    if before_block is not None and 0 < before_block < inputs.num_blocks:
        if len(inputs.block_costs) == inputs.num_blocks:  # the output of the block before it (T5's first block
            before = inputs.block_costs[before_block - 1]  # also returns its position bias)
        if len(by_boundary) == inputs.num_blocks - 1:
            carried = by_boundary[before_block - 1]
    per_sample = before.output_bytes / (layout.tp if layout.sequence_parallel else 1) + carried
    return layout.micro_batch * per_sample + before.output_fixed_bytes  # a position bias goes once, whole


def sp_norm_bytes(layout: Layout, compute_bytes: float, grad_reduce_bytes: float, zero3_every: bool) -> float:
    """Bytes per element of the SP norm gradients' tp all-reduce: the compute dtype when they are reduced inside
    the backward (ZeRO-3 reducing every micro-batch, or a single micro-batch), else the accumulated gradient's."""
    zero3 = layout.dp * layout.cp > 1 and layout.zero == 3 and layout.pp == 1 and zero3_every
    return compute_bytes if zero3 or layout.num_microbatches == 1 else grad_reduce_bytes


def recomputed_reductions(layer: LayerCost) -> int:
    """The forward tp reductions a fully recomputed forward repeats: all but the last, which only feeds the block's
    output, unless an op after it saves a tensor for backward (LayerCost.tp_recompute_tail_count)."""
    f = layer.tp_fwd_count
    return min(f, max(f - 1, 0) + layer.tp_recompute_tail_count)


def sp_norm_reductions(layout: Layout, zero3_reduce_every_microbatch: bool) -> int:
    """How often per step each SP norm gradient is all-reduced over tp: with the gradients' reduction, so every
    micro-batch under ZeRO-3 without pipelining (when it reduces every micro-batch), else once."""
    every = layout.dp * layout.cp > 1 and layout.zero == 3 and layout.pp == 1 and zero3_reduce_every_microbatch
    return layout.num_microbatches if every else 1


def _add(out: dict[str, CollectiveCount], op: str, count: int, nbytes: float) -> None:
    if count > 0:
        out[op] = out.get(op, CollectiveCount(0, 0.0)) + CollectiveCount(count, nbytes)


def _tp(out: dict[str, CollectiveCount], layer: LayerCost, layout: Layout, m: int, recompute: str) -> None:
    if layout.tp == 1:
        return
    f, mb = layer.tp_fwd_count, layout.micro_batch
    per_call = layer.tp_fwd_bytes / f if f else 0.0
    # a fully recomputed forward repeats every reduction but the last (torch's non-reentrant checkpoint stops once
    # the backward has what it needs) and, under SP, every gather (planner/cost/tp_collectives.py)
    full = recompute == "full"
    again = recomputed_reductions(layer) if full else 0
    reductions = f + again + layer.tp_bwd_count
    reduced = layer.tp_fwd_bytes + again * per_call + layer.tp_bwd_bytes
    if layout.sequence_parallel:
        gathers = f + (f if full else 0) + layer.tp_bwd_count
        gathered = layer.tp_fwd_bytes * (2 if full else 1) + layer.tp_bwd_bytes
        _add(out, "all_gather", m * gathers, m * mb * gathered)
        _add(out, "reduce_scatter", m * reductions, m * mb * reduced)
        _add(out, "all_gather", m * (layer.sp_gather_bytes > 0), m * mb * layer.sp_gather_bytes)
    else:
        _add(out, "all_reduce", m * reductions, m * mb * reduced)
    _add(out, "all_reduce", m * layer.tp_fixed_count, m * mb * layer.tp_fixed_bytes)


def _cp(out: dict[str, CollectiveCount], layer: LayerCost, layout: Layout, m: int, recompute: str) -> None:
    if layout.cp == 1 or not layer.kv_bytes:
        return
    gathered = layout.cp * layout.micro_batch * layer.kv_bytes / layout.tp  # K and V together
    forwards = 2 if recompute == "full" else 1
    _add(out, "all_gather", m * 2 * forwards, m * forwards * gathered)
    _add(out, "reduce_scatter", m * 2, m * gathered)


def _ep(out: dict[str, CollectiveCount], layer: LayerCost, layout: Layout, m: int, recompute: str) -> None:
    """Expert parallelism (runtime/expert_parallel.py), per MoE layer and micro-batch: forward, an all-to-all of
    the per-expert row counts, the dispatch and the combine (again under full recompute); backward, the reverse
    of the dispatch and of the combine. Rows: the rank's tokens·top_k·capacity, hidden wide."""
    if layout.ep <= 1 or not layer.moe_layer_count:
        return
    rows = layout.micro_batch * layer.dispatch_bytes / (layout.tp if layout.sequence_parallel else 1)
    forwards = 2 if recompute == "full" else 1
    n = layer.moe_layer_count
    _add(
        out,
        "all_to_all",
        m * n * (3 * forwards + 2),
        m * (forwards * (layer.expert_counts_bytes + 2 * rows) + 2 * rows),
    )


def _dp(
    out: dict[str, CollectiveCount],
    params: float,
    units: int,
    group: int,
    layout: Layout,
    wire: tuple[float, float, bool],
    replicated_alone: bool = False,
) -> None:
    """The gradient reduction (and FSDP's parameter gathers) of `params` local parameters in `units` FSDP units
    over a group of `group` ranks; wire: gradient bytes per element, parameter bytes per element, whether ZeRO-3
    reduces every micro-batch. A one-rank group communicates nothing, but a replicate() group of one rank (zero 0,
    `replicated_alone`: the expert banks of ep = dp·cp) still issues its all-reduce per unit."""
    grad_bytes, param_bytes, every_microbatch = wire
    if group <= 1:
        if replicated_alone and layout.zero == 0:
            _add(out, "all_reduce", units, grad_bytes * params)
        return
    m, pp = layout.num_microbatches, layout.pp
    grads = grad_bytes * params
    if layout.zero == 0:
        _add(out, "all_reduce", units, grads)
    elif layout.zero == 1 or pp > 1:  # FSDP2 without resharding after forward
        gathers = 1 if pp > 1 else m
        _add(out, "reduce_scatter", units, grads)
        _add(out, "all_gather", gathers * units, gathers * param_bytes * params)
    else:
        gathers = 2 * m  # forward and backward (a fully recomputed forward runs on the backward's gather)
        reduces = m if every_microbatch else 1
        _add(out, "all_gather", gathers * units, gathers * param_bytes * params)
        _add(out, "reduce_scatter", reduces * units, reduces * grads)


def rank_collectives(
    inputs: ModelCostInputs,
    layout: Layout,
    blocks_per_stage: tuple[int, ...],
    pp_rank: int,
    grad_reduce_bytes: float = 4.0,
    zero3_reduce_every_microbatch: bool = True,
    units: dict[int, int] | None = None,
    recompute_blocks: tuple[int, ...] | None = None,
    expert_tp: bool = False,
) -> dict[str, CollectiveCount]:
    """Collectives of pipeline rank `pp_rank` in one step (see module doc); virtual stage i runs on rank i % pp.
    `units`: FSDP units per virtual stage when the IR knows them (parameter-holding layers + 1); by default the
    merged pre / post layers count as one layer each. `recompute_blocks`: blocks per virtual stage that run
    layout.recompute (its first ones, as plan.json's recompute_layers; None: all of them)."""
    inputs = cp_share(for_tp(inputs, layout.tp, layout.sequence_parallel, expert_tp), layout.cp)
    m, pp = layout.num_microbatches, layout.pp
    dp = layout.dp * layout.cp  # the ranks that reduce gradients together
    out: dict[str, CollectiveCount] = {}
    stages = [i for i in range(len(blocks_per_stage)) if i % pp == pp_rank]
    last = len(blocks_per_stage) - 1
    params = expert_params = 0.0
    unit_count = expert_units = 0
    sp_tensors, sp_elems = 0, 0.0
    for i in stages:
        first_block, n = sum(blocks_per_stage[:i]), blocks_per_stage[i]
        # each block as itself where the IR's blocks differ (a dense block before MoE ones), else the mean block
        own = list(inputs.block_costs[first_block : first_block + n]) if inputs.block_costs else [inputs.block] * n
        layers = ([inputs.pre] if i == 0 else []) + own + ([inputs.post] if i == last else [])
        recomputed = n if recompute_blocks is None else recompute_blocks[i]
        for k, layer in enumerate(layers):  # the layers before and after the blocks are not recomputed
            block = k - (1 if i == 0 else 0)
            is_block = 0 <= block < n
            recompute = layout.recompute if is_block and block < recomputed else "none"
            _tp(out, layer, layout, m, recompute)
            _cp(out, layer, layout, m, recompute)
            _ep(out, layer, layout, m, recompute)
            expert_units += layer.moe_layer_count if layout.ep > 1 else 0
            if layout.tp > 1 and layout.sequence_parallel:
                sp_tensors += layer.sp_param_count
                sp_elems += sp_param_elems(layer, layout.ep)
            if layout.tp > 1:  # per-head norm weights, reduced with the SP norms' (style "heads")
                sp_tensors += layer.head_param_count
                sp_elems += layer.head_param_elems
        held = [local_params(layer, layout.tp) for layer in layers]
        params += sum(held)
        if layout.ep > 1:  # the routed experts: 1/ep of them here, reduced over the ranks holding the same ones
            experts = sum(local_expert_params(layer, layout.tp) for layer in layers)
            params -= experts
            expert_params += experts / layout.ep
        # the IR's own count when given, else the parameter-holding layers + the stage's own FSDP unit
        unit_count += units[i] if units and i in units else sum(1 for p in held if p > 0) + 1
        if pp > 1:
            # the activation forward across the boundary after the stage, its gradient back across the one before
            after = pipeline_boundary_bytes(inputs, layout, first_block + n) if i < last else 0.0
            before = pipeline_boundary_bytes(inputs, layout, first_block) if i > 0 else 0.0
            _add(out, "send", m * ((i < last) + (i > 0)), m * (after + before))
    holders = tied_stages(inputs, blocks_per_stage)  # the embedding's, the tied head's and any middle copy's stages
    if pp > 1 and set(stages) & holders and len({s % pp for s in holders}) > 1:
        vs = vocab_shards(inputs, layout.tp)
        # the IR counts tied parameters at the embedding: a rank without the embedding holds a copy (the head's, or
        # a middle layer's such as T5's decoder embedding), one per rank
        params += inputs.tied_params / vs if 0 not in stages else 0.0
        # each rank all-reduces the copy it holds: its dp shard under ZeRO >= 1 (FSDP2), else the whole tp shard
        shard = vs * (dp if layout.zero >= 1 else 1)
        _add(out, "all_reduce", 1, grad_reduce_bytes * inputs.tied_params / shard)
    roots = inputs.root_param_numels
    if pp > 1 and roots:  # every pipeline rank holds a copy and all-reduces each one's whole gradient over pp; only
        # the first stage's reads them (the IR counts them there), so only its data-parallel reduction carries them
        _add(out, "all_reduce", len(roots), grad_reduce_bytes * sum(roots))
    wire = (grad_reduce_bytes, inputs.compute_bytes, zero3_reduce_every_microbatch)
    _dp(out, params, unit_count, dp, layout, wire)
    if layout.ep > 1 and dp > 1:  # each expert bank its own FSDP unit over expert_dp ranks (runtime/data_parallel.py)
        _dp(out, expert_params, expert_units, layout.expert_dp, layout, wire, replicated_alone=True)
    # SP norm gradients are all-reduced over tp when the gradients are reduced: under ZeRO-3 every micro-batch, on
    # the unsharded gradient in the compute dtype (before FSDP's reduce-scatter casts it), else once per step, in
    # the compute dtype too when one micro-batch leaves nothing to accumulate (measured: bf16 at m = 1, fp32 at 2)
    sp_times = sp_norm_reductions(layout, zero3_reduce_every_microbatch)
    sp_bytes = sp_norm_bytes(layout, inputs.compute_bytes, grad_reduce_bytes, zero3_reduce_every_microbatch)
    _add(out, "all_reduce", sp_times * sp_tensors, sp_times * sp_bytes * sp_elems)
    if layout.tp * layout.pp * layout.dp * layout.cp > 1:
        _add(out, "all_reduce", 1, GRAD_NORM_BYTES)  # runtime/optim.py grad_norm: one fp32 scalar, every rank
    return out
