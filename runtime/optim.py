"""Optimizer, learning-rate schedule, tied-weight gradient sync, the loss as a token mean, and clipping by the true
global gradient norm."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._python_dispatch import TorchDispatchMode

ADAMW_BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1


def build_optimizer(params: list[nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay on matrices (not on biases / norms), or plain SGD (parity tests: AdamW
    turns ~1e-9 float noise on near-zero gradients into lr-sized updates).

    Parameters are grouped by kind (DTensor or plain), as torch's multi-tensor and fused kernels take one kind per
    call, and AdamW runs fused where torch has the kernel for the device (CUDA and CPU): its step allocates nothing,
    where the single-tensor step allocates two fp32 temporaries of each parameter's size and the multi-tensor one a
    copy of all second moments, memory the plan does not price (measured by mlm-run --dry-run)."""
    if name == "sgd":
        return torch.optim.SGD(_by_kind([{"params": params}]), lr=lr)
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = _by_kind([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}])
    fused = all(p.device.type in _fused_devices() and p.is_floating_point() for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=ADAMW_BETAS, fused=fused or None)


def _by_kind(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group split into its DTensor and its plain parameters (empty groups dropped)."""
    out = []
    for group in groups:
        for dtensor in (True, False):
            kept = [p for p in group["params"] if isinstance(p, DTensor) == dtensor]
            if kept:
                out.append({**group, "params": kept})
    return out


def _fused_devices() -> tuple[str, ...]:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return tuple(_get_fused_kernels_supported_devices())


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


def grad_norm(
    params: list[nn.Parameter],
    pp_group: dist.ProcessGroup | None,
    exclude: set[int],
    distinct: dict[int, int] | None = None,
) -> torch.Tensor:
    """The global L2 norm of all gradients of the model, whichever rank holds them, with one all-reduce of one
    scalar per step.

    torch.nn.utils.clip_grad_norm_ fails on a mix of DTensor and plain gradients and sees only this stage, and a
    DTensor norm per (mesh, placements) group costs one all-reduce per group and mesh dimension (and DTensor's
    get_total_norm materialises fp32 buffers the size of the gradients). So each rank sums the squares of its local
    gradient values in fp32, divides each tensor's sum by how many ranks of its pipeline stage hold the same values
    (the stage's ranks over the tensor's distinct shards: every rank of a stage holds some shard of each of the
    stage's parameters), and one all-reduce over every rank adds them up. `pp_group` only says whether there is a
    pipeline (the sum runs over the whole world either way); `exclude` holds ids of non-primary tied copies;
    `distinct` maps ids of parameters whose local values differ over more ranks than their placements say (ep:
    each rank of an ep group holds other experts under the same name) to that factor."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    pp = dist.get_world_size(pp_group) if pp_group is not None else 1
    stage_ranks = world // pp
    total_sq: torch.Tensor | None = None
    for p in params:
        if p.grad is None or id(p) in exclude:
            continue
        g = p.grad
        copies = stage_ranks
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                g = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
            # not is_shard(): _StridedShard (fused QKV split per head) is a shard that is_shard() does not name
            shards = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if not pl.is_replicate())
            copies = stage_ranks // shards
            g = g.to_local()
        if distinct and id(p) in distinct:
            copies = max(1, copies // distinct[id(p)])
        sq = torch.linalg.vector_norm(g.detach(), 2, dtype=torch.float32).square() / copies
        total_sq = sq if total_sq is None else total_sq + sq.to(total_sq.device)
    if total_sq is None:
        device = next((p.device for p in params if not isinstance(p, DTensor)), torch.device("cpu"))
        total_sq = torch.zeros((), dtype=torch.float32, device=device)
    if world > 1:
        dist.all_reduce(total_sq)
    return total_sq.sqrt()


def clip_grads(params: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients by min(1, max_norm / norm), as clip_grad_norm_ does, one tensor at a time (mixed types)."""
    coef = min(1.0, max_norm / (float(total_norm) + 1e-6))
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


# ---- the loss as a token mean ----
#
# The step's loss is the mean over every loss token of the global batch, as one device computes it, however the
# batch is split into micro-batches and replicas: each micro-batch's backward runs on its loss *sum*, and after
# the step's single all-reduce (train.py) the gradients are scaled by dp / (global token count) (the dp wrappers
# average over replicas). How the runtime learns a micro-batch's token count, in order:
#   1. loss_fn returns (loss_sum, token_count): used as given;
#   2. the loss ran exactly one mean-reduced cross-entropy / NLL (the user's loss_fn, or a model that computes its
#      own loss in forward(idx, targets)): its total weight, i.e. the targets that are not ignore_index (any
#      ignore_index; masks built inside loss_fn count);
#   3. otherwise (no such op, or several): the number of targets != -100 (torch's default ignore_index), i.e. the
#      loss is taken to be a mean over those.
# The default loss (next-token cross-entropy, ignore_index -100) is case 3, which equals case 2 without a dispatch
# mode on the hot path.

_NLL_OPS = ("nll_loss_forward", "nll_loss2d_forward")


class _NllWeights(TorchDispatchMode):
    """Records the total weight (non-ignored targets) of every mean-reduced NLL op that runs while active."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._schema.name.split("::")[-1] in _NLL_OPS:
            reduction = args[3] if len(args) > 3 else kwargs.get("reduction", 1)
            if reduction == 1:
                self.weights.append(out[1])
        return out


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, DTensor) else x


class LossTokens:
    """Turns each micro-batch's mean loss into a loss sum and records its token count (see section doc)."""

    def __init__(self) -> None:
        self.counts: list[torch.Tensor] = []
        self._mode: _NllWeights | None = None
        self.paused = False  # set while the pipeline infers shapes with an extra forward (train.py)

    def _sum(self, loss: Any, targets: Any, weights: list[torch.Tensor]) -> torch.Tensor:
        if isinstance(loss, (tuple, list)) and len(loss) == 2:
            total, count = loss
            count = torch.as_tensor(_local(count) if isinstance(count, torch.Tensor) else count)
        else:
            total = loss
            if len(weights) == 1:
                count = _local(weights[0])
            elif isinstance(targets, torch.Tensor):
                count = (targets != -100).sum()
            else:
                count = torch.tensor(1.0)
            total = loss.float() * count.to(loss.device, torch.float32).detach()
        if not self.paused:
            self.counts.append(count.detach().float().reshape(()))
        return total

    def wrap_loss_fn(self, loss_fn: Callable[[Any, Any], Any] | None) -> Callable[[Any, Any], Any] | None:
        """The user's loss_fn returning the loss sum (None stays None: attach() handles the built-in losses)."""
        if loss_fn is None:
            return None

        def summed(output: Any, batch: Any) -> torch.Tensor:
            with _NllWeights() as mode:
                loss = loss_fn(output, batch)
            return self._sum(loss, batch[1] if isinstance(batch, tuple) else None, mode.weights)

        return summed

    def attach(self, training_module: nn.Module, counts_inside_forward: bool) -> None:
        """Hooks on the last stage's TrainingModule: without a user loss_fn, turn its mean loss into a sum, counting
        NLL weights over the whole forward when the model computes its own loss (forward(idx, targets))."""
        if not counts_inside_forward:
            return
        from mlm.planner.capture.training_step import takes_targets

        watch = takes_targets(training_module.model)

        def pre(_m: nn.Module, _args: tuple) -> None:
            if watch:
                self._mode = _NllWeights()
                self._mode.__enter__()

        def post(_m: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            weights: list[torch.Tensor] = []
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
                weights, self._mode = self._mode.weights, None
            return self._sum(out, args[1] if len(args) > 1 else None, weights)

        training_module.register_forward_pre_hook(pre)
        training_module.register_forward_hook(post)

    def take(self) -> torch.Tensor:
        """The token count of the micro-batches since the last call (this rank's share; 0 without the loss)."""
        total = torch.stack(self.counts).sum() if self.counts else torch.zeros(())
        self.counts.clear()
        return total


def clip_and_scale_grads(params: list[nn.Parameter], max_norm: float, norm: float, scale: float) -> float:
    """Scale gradients by `scale` (1 / tokens, loss sums -> token mean) and clip by the global norm of the scaled
    gradients, in one pass; returns that norm."""
    true_norm = norm * scale
    coef = scale * min(1.0, max_norm / (true_norm + 1e-6))
    if coef != 1.0:
        grads = [p.grad for p in params if p.grad is not None]
        plain = [g for g in grads if not isinstance(g, DTensor)]
        if plain:
            torch._foreach_mul_(plain, coef)  # one kernel launch per device, as clip_grad_norm_ does
        for g in grads:
            if isinstance(g, DTensor):
                g.mul_(coef)
    return true_norm
