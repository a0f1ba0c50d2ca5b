"""Load the plan's model file, check it is the one the plan was made for, and record how its layers are called.

The record comes from one forward of the whole training step on the meta device (no memory, no compute): for
each layer of the plan, the pytree structure of its first call's arguments (which leaves are activations that
carry gradients) and the shapes of its outputs. Stage splitting (stages.py) needs exactly this to cut an
unmodified eager model at layer boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from mlm.planner.capture.loader import ModelSpec, instantiate, load_model_spec
from mlm.planner.capture.training_step import TrainingModule, first_embedding_vocab
from mlm.planner.errors import ModelLoadError, PlanFileError
from mlm.planner.plan import Plan

LOSS_LAYER = "loss"


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of a tensor a layer returned in the dry run (used to build placeholder outputs)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class LayerCall:
    """How the training step first called one layer."""

    fqn: str
    grad_leaves: tuple[int, ...]  # indices into pytree leaves of (args, kwargs) that are activations with grad
    output: Any  # the output pytree with tensors replaced by TensorSpec


def load_checked_spec(plan: Plan) -> ModelSpec:
    """The plan's model file, imported; its sha256 must equal the plan's (else the plan describes another model)."""
    spec = load_model_spec(plan.model.source, plan.model.entry, plan.model.args)
    if spec.sha256 != plan.model.sha256:
        raise PlanFileError(
            f"model file {spec.path} has changed since the plan was made (sha256 {spec.sha256[:12]}… "
            f"!= plan's {plan.model.sha256[:12]}…): re-run mlm-plan for this file"
        )
    return spec


def plan_layers(plan: Plan) -> list[str]:
    """All layer FQNs of the plan in execution order, without the "loss" pseudo-layer."""
    return [name for stage in plan.stages for name in stage.layers if name != LOSS_LAYER]


def build_model(spec: ModelSpec, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """The whole model with deterministic initial weights: the same seed gives the same weights under any layout
    because every rank builds the full model the same way and then keeps only its part."""
    torch.manual_seed(seed)
    return instantiate(spec, device)


def token_batch(
    vocab: int, batch: int, seq: int, device: str | torch.device, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if str(device) == "meta":
        tokens = torch.zeros(batch, seq + 1, dtype=torch.long, device="meta")
    else:
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def model_vocab(model: nn.Module, plan: Plan) -> int:
    try:
        return first_embedding_vocab(model)
    except ValueError:
        return plan.model.vocab_size


def record_layer_calls(spec: ModelSpec, plan: Plan, micro_batch: int) -> dict[str, LayerCall]:
    """Run the training step once on meta tensors and record each plan layer's first call (see module doc)."""
    model = instantiate(spec, "meta")
    layers = plan_layers(plan)
    check_layers_cover_model(model, layers)
    calls: dict[str, LayerCall] = {}
    pending: dict[str, tuple[int, ...]] = {}
    order: list[str] = []
    handles = []
    for fqn in layers:
        module = model.get_submodule(fqn)

        def pre(_m: nn.Module, args: tuple, kwargs: dict, fqn: str = fqn) -> None:
            if fqn in pending or fqn in calls:
                return
            leaves = pytree.tree_leaves((args, kwargs))
            pending[fqn] = tuple(i for i, x in enumerate(leaves) if _is_activation(x))
            order.append(fqn)

        def post(_m: nn.Module, _args: tuple, _kwargs: dict, out: Any, fqn: str = fqn) -> None:
            if fqn in calls:
                return
            spec_out = pytree.tree_map(
                lambda x: TensorSpec(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x, out
            )
            calls[fqn] = LayerCall(fqn, pending[fqn], spec_out)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    inputs, targets = token_batch(model_vocab(model, plan), micro_batch, plan.training.seq_len, "meta")
    try:
        TrainingModule(model, spec.loss_fn)(inputs, targets)
    except Exception as e:  # user model code on meta tensors
        raise ModelLoadError(
            f"the training step does not run on the meta device: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    finally:
        for h in handles:
            h.remove()
    missing = [f for f in layers if f not in calls]
    if missing:
        raise PlanFileError(f"plan.json: stages list layer(s) the forward never calls: {', '.join(missing[:3])}")
    if order != layers:
        first_bad = next(i for i, (a, b) in enumerate(zip(order, layers)) if a != b)
        raise PlanFileError(
            f"plan.json: stages list layers out of execution order: at position {first_bad} the "
            f"model calls {order[first_bad]} but the plan has {layers[first_bad]}"
        )
    return calls


def _is_activation(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad


def check_layers_cover_model(model: nn.Module, layers: list[str]) -> None:
    """Every plan layer exists, no layer contains another, and every parameter lies inside some layer."""
    names = dict(model.named_modules())
    for fqn in layers:
        if fqn not in names:
            raise PlanFileError(f"plan.json: stages name layer {fqn!r}, which the model does not have")
    if len(set(layers)) != len(layers):
        raise PlanFileError("plan.json: stages list some layer twice")
    for fqn in layers:
        for other in layers:
            if other != fqn and other.startswith(fqn + "."):
                raise PlanFileError(f"plan.json: layer {other!r} lies inside layer {fqn!r}")
    for pname, _ in model.named_parameters(remove_duplicate=False):
        if not any(pname.startswith(f + ".") for f in layers):
            raise PlanFileError(f"plan.json: parameter {pname!r} is in no layer of the stages")


def owner_layer(param_fqn: str, layers: list[str]) -> str:
    return next(f for f in layers if param_fqn.startswith(f + "."))


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Parameter FQNs that share one tensor (e.g. wte.weight and lm_head.weight), in registration order."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Parameter FQN -> the first FQN of its tensor (tied copies on different stages share one checkpoint key)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out
