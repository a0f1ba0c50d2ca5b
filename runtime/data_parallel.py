"""Data parallelism and optimizer sharding per the plan's zero stage.

zero 0 is DDP's semantics on every path (whole fp32 parameters and optimizer state on every replica, gradients
accumulated over the micro-batches without communication and all-reduced over dp once per step, during or after
the last micro-batch's backward, in fp32), by one of two torch wrappers:
- fp32 compute (CPU runs) with tp == 1: torch's DistributedDataParallel (25 MB buckets all-reduced as the last
  micro-batch's backward produces them), with or without pipelining. Inside a torch.distributed.pipelining stage
  DDP crashed at step 2 ("rebuilt parameter indices size is not same as original model parameters size"): torch
  2.13's shape-inference forward calls the DDP module outside no_sync, arming the reducer, so the first
  micro-batch's backward reduced and the last one reduced again; train.py runs that forward under no_sync.
- bf16 compute (the CUDA default), or tp > 1: FSDP2's replicate() with the policy below, one group per layer
  that holds parameters plus the stage (as fully_shard's groups), each group's gradients all-reduced in fp32 as
  its backward ends in the last micro-batch (pp == 1) or at the pipeline's reduce step (pp > 1). Not DDP, because
  DDP's mixed precision (`_MixedPrecision`, experimental) accumulates gradients in bf16 under no_sync and swaps
  parameter storage in forward, which the pipeline's in-flight micro-batches would see; and DDP around a TP stage
  fails ("aten.cat.default got mixed torch.Tensor and DTensor"), while replicate() over the dp mesh composes with
  TP's DTensors as fully_shard does. DDP with a zero-bubble schedule trips a reducer INTERNAL ASSERT, so those
  schedules use replicate() too.

The "dp" mesh axis is dp·cp ranks long (mesh.py): context-parallel ranks hold the same weights and reduce their
gradients with the data-parallel ones, as in Megatron-Core, so everything here reads "dp" as dp·cp.

zero 1 / 3: FSDP2 fully_shard over the dp mesh axis (composed with TP's DTensors on the same mesh). zero 3 shards
parameters, gradients and optimizer state. zero 1 (shard only optimizer state) has no exact torch equivalent; the
closest is fully_shard with reshard_after_forward=False: parameters stay gathered from forward to backward
(ZeRO-2-like: gradients and optimizer state sharded). Under pp > 1, reshard_after_forward=False always: with a
zero-bubble schedule the default True gives silently wrong gradients, and with 1F1B it would re-gather parameters
for every micro-batch.

Dtypes (Megatron / torchtitan): with a bf16 compute dtype every wrapper is FSDP2-based with
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the parameters FSDP2 holds (sharded, or whole under
replicate()) are the fp32 master weights the optimizer steps; forward and backward run on a bf16 copy made per
layer group; gradients are accumulated, reduced and kept in fp32. dp == 1 uses fully_shard over the one-rank dp
mesh (no communication: only the bf16 cast). With fp32 compute the wrappers are as above, without a policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mlm.planner.layout import Layout

ZERO_BUBBLE_SCHEDULES = ("zbv", "interleaved-zero-bubble", "dualpipev")


@dataclass(frozen=True)
class DataParallelChoice:
    wrapper: Literal["none", "ddp", "replicate", "fsdp"]
    reshard_after_forward: bool


def choose_data_parallel(
    layout: Layout, schedule: str, compute_dtype: torch.dtype = torch.float32, allow_ddp: bool = True
) -> DataParallelChoice:
    """The dp wrapper for a layout, pipeline schedule name and compute dtype (see module doc for the reasons);
    allow_ddp=False takes replicate() where DDP would run (the dry run: DDP needs real tensors)."""
    mixed = compute_dtype != torch.float32
    if layout.dp * layout.cp == 1:  # context-parallel ranks reduce gradients together as dp ranks do (mesh.py)
        return DataParallelChoice("fsdp" if mixed else "none", False)
    if layout.zero == 0:
        # ep > 1: the expert banks are replicated over their own group (the dp ranks holding the same experts),
        # which DDP (one process group per wrapper) cannot nest
        ddp = allow_ddp and not mixed and layout.tp == 1 and layout.ep == 1 and schedule not in ZERO_BUBBLE_SCHEDULES
        return DataParallelChoice("ddp" if ddp else "replicate", False)
    return DataParallelChoice("fsdp", layout.zero == 3 and layout.pp == 1)


def mixed_precision(compute_dtype: torch.dtype) -> Any:
    """FSDP2's policy for a compute dtype: bf16 (or fp16) parameters in forward/backward, fp32 reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if compute_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def apply_data_parallel(
    stage: nn.Module,
    layer_modules: list[nn.Module],
    choice: DataParallelChoice,
    dp_mesh: DeviceMesh,
    compute_dtype: torch.dtype = torch.float32,
    expert_banks: tuple[list[nn.Module], DeviceMesh] | None = None,
) -> nn.Module:
    """Wrap one stage; returns the module to run (the DDP wrapper, or the stage itself made an FSDPModule). FSDP2
    and replicate() work on meta parameters (materialised afterwards); DDP needs them materialised first.
    `expert_banks`: the ep-sharded expert banks and the mesh of the ranks holding the same experts; each bank is
    its own group over that mesh, so the enclosing layer's group (over dp) leaves its parameters alone."""
    if choice.wrapper == "none":
        return stage
    if choice.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(stage, process_group=dp_mesh.get_group())
    mp = mixed_precision(compute_dtype)
    from torch.distributed.fsdp import fully_shard

    wrap: Any = partial(fully_shard, reshard_after_forward=choice.reshard_after_forward)
    if choice.wrapper == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        wrap = replicate
    if expert_banks is not None:
        # each bank its own group over the ranks holding the same experts; with replicate() that group all-reduces
        # even when it is one rank (ep = dp·cp), a call that moves nothing (collective_counts counts it)
        for bank in expert_banks[0]:
            wrap(bank, mesh=expert_banks[1], mp_policy=mp)
    shared = _params_shared_between(layer_modules) | _params_also_outside(stage, layer_modules)
    for module in layer_modules:  # one group per layer: its reduction starts as its backward ends
        params = list(module.parameters())
        if params and not any(id(p) in shared for p in params):
            wrap(module, mesh=dp_mesh, mp_policy=mp)
    wrap(stage, mesh=dp_mesh, mp_policy=mp)
    return stage


def _params_also_outside(stage: nn.Module, modules: list[nn.Module]) -> set[int]:
    """Parameters of the layers that a module outside them also holds (T5's `shared` embedding, the alias of
    decoder.embed_tokens and lm_head): the root group manages that module, so they stay there too."""
    inside = {id(m) for layer in modules for m in layer.modules()}
    mine = {id(p) for layer in modules for p in layer.parameters()}
    return {id(p) for m in stage.modules() if id(m) not in inside for p in m._parameters.values() if id(p) in mine}


def _params_shared_between(modules: list[nn.Module]) -> set[int]:
    """Parameters used by more than one layer (tied embeddings on one stage): those stay in the root FSDP group,
    because FSDP2 cannot shard one parameter in two groups."""
    seen: dict[int, int] = {}
    for i, module in enumerate(modules):
        for p in module.parameters():
            if seen.setdefault(id(p), i) != i:
                seen[id(p)] = -1
    return {k for k, v in seen.items() if v == -1}
