"""Optimizer, learning-rate schedule, tied-weight gradient sync and clipping by the true global gradient norm."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

ADAMW_BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1


def build_optimizer(params: list[nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay on matrices (not on biases / norms), or plain SGD (parity tests: AdamW
    turns ~1e-9 float noise on near-zero gradients into lr-sized updates)."""
    kinds = {isinstance(p, DTensor) for p in params}
    foreach = None if len(kinds) <= 1 else False  # foreach kernels reject a mix of DTensor and plain tensors
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=foreach)
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=ADAMW_BETAS, foreach=foreach)


def lr_factor(step: int, warmup: int, decay_steps: int, min_ratio: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to min_ratio at `decay_steps`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, base_lr: float, factor: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = base_lr * factor


@dataclass(frozen=True)
class TiedCopy:
    """This rank's copy of a parameter that is tied across pipeline stages, and the group of all its copies."""

    param: nn.Parameter
    group: dist.ProcessGroup
    primary: bool  # the copy counted in the gradient norm


def sync_tied_grads(copies: list[TiedCopy]) -> None:
    """Megatron's embedding-group all-reduce: each stage holding a copy of a tied weight (wte on the first stage,
    lm_head on the last) adds the other copies' gradients, so all copies take the same step and stay equal."""
    for copy in copies:
        grad = copy.param.grad
        if grad is None:
            grad = copy.param.grad = torch.zeros_like(copy.param)
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(copy.param.placements):
            # e.g. a vocabulary-parallel embedding's gradient comes out Replicate while the weight is Shard(0)
            grad = copy.param.grad = grad.redistribute(copy.param.device_mesh, copy.param.placements)
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        dist.all_reduce(local, group=copy.group)


def grad_norm(params: list[nn.Parameter], pp_group: dist.ProcessGroup | None, exclude: set[int]) -> torch.Tensor:
    """The global L2 norm of all gradients of the model, whichever rank holds them.

    torch.nn.utils.clip_grad_norm_ fails on a mix of DTensor and plain gradients and sees only this stage, so:
    group gradients by (mesh, placements), take each group's norm (a DTensor norm reduces over its mesh), sum the
    squares, and all-reduce over the pipeline group. `exclude` holds ids of non-primary tied copies."""
    groups: dict[object, list[torch.Tensor]] = {}
    device = None
    for p in params:
        if p.grad is None or id(p) in exclude:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else ("plain", g.device)
        groups.setdefault(key, []).append(g)
        device = g.device if not isinstance(g, DTensor) else g.to_local().device
    total_sq = torch.zeros((), dtype=torch.float32, device=device or "cpu")
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.float().to(total_sq.device) ** 2
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total_sq, group=pp_group)
    return total_sq.sqrt()


def clip_grads(params: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients by min(1, max_norm / norm), as clip_grad_norm_ does, one tensor at a time (mixed types)."""
    coef = min(1.0, max_norm / (float(total_norm) + 1e-6))
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
