"""The collectives one GPU issues per training step, as the cost model prices them: count and payload bytes per op.

This is the cost model's communication stated as calls instead of seconds, for the dry run (`mlm-run --dry-run`)
to check against what the runtime issues. Payload bytes follow the dry run's convention (runtime/dry_run.py): the
full tensor an all-gather produces or a reduce-scatter consumes, the tensor an all-reduce or a send carries.

Per pipeline rank, with m micro-batches, its layers' LayerCost and its local parameters P (mlm-run semantics,
step_time.py's docstring):
  tp       per layer and micro-batch tp_fwd_count (+ again under full recompute) + tp_bwd_count all-reduces of
           micro_batch·tp_*_bytes, or as many all-gather + reduce-scatter pairs with sequence parallelism
  pp       per virtual stage and micro-batch one send forward (not the last stage) and one backward (not the first)
           of micro_batch·block.output_bytes / tp
  dp       zero 0: ceil(grad bytes / DDP bucket) all-reduces of the gradients; zero 1 (and zero 3 under
           pipelining): one reduce-scatter of the gradients per FSDP unit, one all-gather of the parameters per unit
           and micro-batch (once per step under pipelining); zero 3: per unit and micro-batch one all-gather in
           forward (again in a fully recomputed forward) and one in backward, and one reduce-scatter
           (CostOptions.zero3_reduce_every_microbatch; once per step when False)
  tied     pp > 1 with a tied embedding: one all-reduce of its gradient on the first and the last rank
FSDP units are what runtime/data_parallel.py wraps: every layer that holds parameters, plus the stage itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlm.planner.cost.inputs import LayerCost, ModelCostInputs
from mlm.planner.cost.memory import local_params
from mlm.planner.layout import Layout

PARAM_WIRE_BYTES = 2.0  # bf16 parameters gathered


@dataclass(frozen=True)
class CollectiveCount:
    count: int
    bytes: float

    def __add__(self, other: CollectiveCount) -> CollectiveCount:
        return CollectiveCount(self.count + other.count, self.bytes + other.bytes)


def _add(out: dict[str, CollectiveCount], op: str, count: int, nbytes: float) -> None:
    if count > 0:
        out[op] = out.get(op, CollectiveCount(0, 0.0)) + CollectiveCount(count, nbytes)


def _tp(out: dict[str, CollectiveCount], layer: LayerCost, layout: Layout, m: int) -> None:
    if layout.tp == 1:
        return
    fwd = layer.tp_fwd_count * (2 if layout.recompute == "full" else 1)
    fwd_bytes = layer.tp_fwd_bytes * (2 if layout.recompute == "full" else 1)
    count = m * (fwd + layer.tp_bwd_count)
    nbytes = m * layout.micro_batch * (fwd_bytes + layer.tp_bwd_bytes)
    if layout.sequence_parallel:
        _add(out, "all_gather", count, nbytes)
        _add(out, "reduce_scatter", count, nbytes)
    else:
        _add(out, "all_reduce", count, nbytes)


def rank_collectives(
    inputs: ModelCostInputs,
    layout: Layout,
    blocks_per_stage: tuple[int, ...],
    pp_rank: int,
    grad_reduce_bytes: float = 4.0,
    ddp_bucket_bytes: float = 25.0 * 2**20,
    zero3_reduce_every_microbatch: bool = True,
    units: dict[int, int] | None = None,
) -> dict[str, CollectiveCount]:
    """Collectives of pipeline rank `pp_rank` in one step (see module doc); virtual stage i runs on rank i % pp.
    `units`: FSDP units per virtual stage when the IR knows them (parameter-holding layers + 1); by default the
    merged pre / post layers count as one layer each."""
    m, pp = layout.num_microbatches, layout.pp
    out: dict[str, CollectiveCount] = {}
    stages = [i for i in range(len(blocks_per_stage)) if i % pp == pp_rank]
    last = len(blocks_per_stage) - 1
    params = 0.0
    unit_count = 0
    for i in stages:
        layers = [inputs.block] * blocks_per_stage[i]
        if i == 0:
            layers.insert(0, inputs.pre)
        if i == last:
            layers.append(inputs.post)
        for layer in layers:
            _tp(out, layer, layout, m)
        held = [local_params(layer, layout.tp) for layer in layers]
        params += sum(held)
        # the IR's own count when given, else the parameter-holding layers + the stage's own FSDP unit
        unit_count += units[i] if units and i in units else sum(1 for p in held if p > 0) + 1
        if pp > 1:
            boundary = layout.micro_batch * inputs.block.output_bytes / layout.tp
            _add(out, "send", m * ((i < last) + (i > 0)), m * boundary * ((i < last) + (i > 0)))
    if pp > 1 and inputs.tied_params and (0 in stages or last in stages):
        params += inputs.tied_params / layout.tp if 0 not in stages or last not in stages else 0.0
        _add(out, "all_reduce", 1, grad_reduce_bytes * inputs.tied_params / layout.tp)
    if layout.dp > 1:
        grads = grad_reduce_bytes * params
        if layout.zero == 0:
            calls = max(1, math.ceil(grads / ddp_bucket_bytes))
            _add(out, "all_reduce", calls, grads)
        elif layout.zero == 1 or pp > 1:  # FSDP2 without resharding after forward
            gathers = 1 if pp > 1 else m
            _add(out, "reduce_scatter", unit_count, grads)
            _add(out, "all_gather", gathers * unit_count, gathers * PARAM_WIRE_BYTES * params)
        else:
            gathers = m * (3 if layout.recompute == "full" else 2)
            reduces = m if zero3_reduce_every_microbatch else 1
            _add(out, "all_gather", gathers * unit_count, gathers * PARAM_WIRE_BYTES * params)
            _add(out, "reduce_scatter", reduces * unit_count, reduces * grads)
    return out
