"""Cut an unmodified eager model into the plan's pipeline stages, keeping every parameter's original FQN.

Why not a traced graph: torch.distributed.pipelining.pipeline() (SplitPoint tracing) rejects DTensors and fails
with V-shaped schedules, and a torch.export graph replaces nn.Linear / nn.Embedding / HF Conv1D by aten ops, so
parallelize_module, fully_shard and activation checkpointing could no longer be applied to the user's modules.
Instead each stage runs the user's own forward (the whole training step, TrainingModule) on a structural copy of
the model in which

- the stage's layers are the original modules (parameters keep their FQNs, so checkpoints are layout-free and the
  plan's tensor_parallel keys match);
- every parameter-holding layer of another stage is a `Placeholder` without parameters that returns zeros shaped
  like the real output (recorded in a meta-device dry run), so the root-level code of the forward (loops over
  blocks, position ids, masks) runs unchanged and cheaply; parameterless layers (dropout, rotary tables) run;
- the first layer of the next stage is a `Boundary` that stops the forward by raising `StopStage` with its
  arguments; the stage sends the arguments that are activations (floating tensors with gradients);
- on the next stage a pre-hook on its first layer swaps those argument leaves for the received tensors.

Limitation (checked where possible): activations must flow layer to layer; a root-level skip connection that
jumps over a stage boundary would read a placeholder.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from mlm.planner.capture.training_step import TrainingModule
from mlm.planner.errors import PlanFileError
from mlm.planner.plan import Plan
from mlm.runtime.model_build import LOSS_LAYER, LayerCall, TensorSpec, plan_layers


class StopStage(BaseException):
    """Raised at the next stage's first layer; BaseException so user `except Exception` blocks cannot eat it."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


class Placeholder(nn.Module):
    """Stands in for a layer that lives on another stage: no parameters, returns zeros of the recorded shape."""

    def __init__(self, fqn: str, output: Any, device: torch.device) -> None:
        super().__init__()
        self.fqn, self.output, self.device = fqn, output, device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return pytree.tree_map(
            lambda s: torch.zeros(s.shape, dtype=s.dtype, device=self.device) if isinstance(s, TensorSpec) else s,
            self.output,
        )

    def extra_repr(self) -> str:
        return f"{self.fqn} (on another stage)"


class Boundary(nn.Module):
    """The next stage's first layer: stops this stage's forward and hands over its call arguments."""

    def __init__(self, fqn: str) -> None:
        super().__init__()
        self.fqn = fqn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise StopStage(args, kwargs)

    def extra_repr(self) -> str:
        return f"{self.fqn} (next stage starts here)"


class StageModule(nn.Module):
    """One pipeline stage: forward(*received, inputs, targets) -> activations for the next stage, or the loss
    (shape (1,)).

    `inner` is a TrainingModule over the stage's copy of the model, so parameter names are "inner.model." + the
    original FQN (`original_fqn` strips it).
    """

    PREFIX = "inner.model."

    def __init__(
        self,
        inner: TrainingModule,
        index: int,
        num_stages: int,
        layers: list[str],
        send_leaves: tuple[int, ...],
        recv_layer: str | None,
        recv_leaves: tuple[int, ...],
        context: Callable[[], Any] | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.index, self.num_stages, self.layers = index, num_stages, layers
        self.send_leaves, self.recv_leaves = send_leaves, recv_leaves
        self.context = context
        self._received: tuple[torch.Tensor, ...] | None = None
        if recv_layer is not None:
            inner.model.get_submodule(recv_layer).register_forward_pre_hook(
                self._inject, with_kwargs=True, prepend=True
            )

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, *received: torch.Tensor, inputs: Any, targets: torch.Tensor) -> Any:
        if self.index > 0:
            if len(received) != len(self.recv_leaves):
                raise RuntimeError(
                    f"stage {self.index} received {len(received)} tensors, expected {len(self.recv_leaves)}"
                )
            self._received = received
        try:
            if self.context is not None:
                with self.context():
                    loss = self.inner(inputs, targets)
            else:
                loss = self.inner(inputs, targets)
        except StopStage as stop:
            leaves = pytree.tree_leaves((stop.args, stop.kwargs))
            return tuple(_to_local(leaves[i]) for i in self.send_leaves)
        finally:
            self._received = None
        if not self.is_last:
            raise RuntimeError(f"stage {self.index} finished the forward without reaching the next stage")
        return loss.reshape(1)  # shape (1,): pipeline schedules concatenate the last stage's outputs

    def _inject(self, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._received is None:  # a later call of the same module: nothing to swap
            return None
        leaves, spec = pytree.tree_flatten((args, kwargs))
        for i, tensor in zip(self.recv_leaves, self._received):
            leaves[i] = tensor
        self._received = None
        new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
        return tuple(new_args), dict(new_kwargs)


def _to_local(x: Any) -> Any:
    """Pipeline p2p sends plain tensors; a DTensor activation goes as its local shard (the receiving layer's
    tensor-parallel input layout reinterprets it)."""
    to_local = getattr(x, "to_local", None)
    return to_local() if callable(to_local) else x


def original_fqn(name: str) -> str:
    return name[len(StageModule.PREFIX) :] if name.startswith(StageModule.PREFIX) else name


def stage_ranks(plan: Plan) -> list[int]:
    """Pipeline rank of every stage: stage i runs on rank i % pp (the interleaved schedules' placement)."""
    return [i % plan.layout.pp for i in range(len(plan.stages))]


def check_stage_boundaries(plan: Plan, calls: dict[str, LayerCall]) -> None:
    """Each stage but the first starts at a layer that receives at least one activation; "loss" is last."""
    for i, stage in enumerate(plan.stages):
        layers = [x for x in stage.layers if x != LOSS_LAYER]
        if LOSS_LAYER in stage.layers and (i != len(plan.stages) - 1 or stage.layers[-1] != LOSS_LAYER):
            raise PlanFileError(f'plan.json: stages[{i}] holds "loss"; it must be the last entry of the last stage')
        if not layers:
            raise PlanFileError(f"plan.json: stages[{i}] holds no layer (the loss must share a stage with the head)")
        if i > 0 and not calls[layers[0]].grad_leaves:
            raise PlanFileError(
                f"plan.json: stages[{i}] starts at {layers[0]}, which receives no activation from the previous stage"
            )
    if LOSS_LAYER not in plan.stages[-1].layers:
        raise PlanFileError('plan.json: the last stage must end with the pseudo-layer "loss"')


def build_stage(
    model: nn.Module,
    loss_fn: Any,
    plan: Plan,
    index: int,
    calls: dict[str, LayerCall],
    device: torch.device,
    context: Callable[[], Any] | None = None,
) -> StageModule:
    """The StageModule for stage `index`, sharing this stage's layer modules with `model` (see module doc)."""
    stages = plan.stages
    own = [x for x in stages[index].layers if x != LOSS_LAYER]
    all_layers = plan_layers(plan)
    next_first = None
    if index + 1 < len(stages):
        next_first = next(x for x in stages[index + 1].layers if x != LOSS_LAYER)
    replacements: dict[str, nn.Module] = {}
    for fqn in all_layers:
        if fqn in own:
            continue
        if fqn == next_first:
            replacements[fqn] = Boundary(fqn)
        elif any(True for _ in model.get_submodule(fqn).parameters()):
            replacements[fqn] = Placeholder(fqn, calls[fqn].output, device)
    stage_model = _replace_modules(model, replacements)
    send = calls[next_first].grad_leaves if next_first is not None else ()
    recv_layer = own[0] if index > 0 else None
    recv = calls[own[0]].grad_leaves if index > 0 else ()
    return StageModule(TrainingModule(stage_model, loss_fn), index, len(stages), own, send, recv_layer, recv, context)


def _replace_modules(root: nn.Module, replacements: dict[str, nn.Module]) -> nn.Module:
    """A copy of `root` with the modules at the given FQNs replaced. Only modules on the paths from the root to a
    replaced FQN are copied (shallowly); everything else, including the stage's own layers, is shared."""
    if not replacements:
        return root
    if "" in replacements:
        return replacements[""]
    clone = copy.copy(root)
    clone._modules = dict(root._modules)  # type: ignore[assignment]
    clone._parameters = dict(root._parameters)  # type: ignore[assignment]
    clone._buffers = dict(root._buffers)  # type: ignore[assignment]
    clone._forward_pre_hooks = type(root._forward_pre_hooks)()  # type: ignore[assignment]
    clone._forward_hooks = type(root._forward_hooks)()  # type: ignore[assignment]
    children: dict[str, dict[str, nn.Module]] = {}
    for fqn, module in replacements.items():
        head, _, rest = fqn.partition(".")
        children.setdefault(head, {})[rest] = module
    for head, sub in children.items():
        clone._modules[head] = _replace_modules(root._modules[head], sub)  # type: ignore[index,arg-type]
    return clone
