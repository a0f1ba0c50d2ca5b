"""Cut an unmodified eager model into the plan's pipeline stages, keeping every parameter's original FQN.

Why not a traced graph: torch.distributed.pipelining.pipeline() (SplitPoint tracing) rejects DTensors and fails
with V-shaped schedules, and a torch.export graph replaces nn.Linear / nn.Embedding / HF Conv1D by aten ops, so
parallelize_module, fully_shard and activation checkpointing could no longer be applied to the user's modules.
Instead each stage runs the user's own forward (the whole training step, TrainingModule) on a structural copy of
the model in which

- the stage's layers are the original modules (parameters keep their FQNs, so checkpoints are layout-free and the
  plan's tensor_parallel keys match);
- every layer of another stage that holds parameters is a `Placeholder` without parameters or submodules (a
  parameter-free layer, e.g. a rotary table computed once in the root, runs on every stage); it returns *phantoms*: a
  one-element zero expanded to the recorded output shape (recorded in a meta-device dry run), so nothing of the
  other stage's size is allocated or computed. While the stage's forward runs, `PhantomMode` (a
  TorchDispatchMode) answers every op that reads a phantom with a phantom of the op's output shape, found on the
  meta device: the root-level code between other stages' layers (adding position embeddings, dropout, loops)
  runs without allocating or computing either. Ops on real tensors only (position ids, masks) run as usual;
- the first layer of the next stage is a `Boundary` that stops the forward by raising `StopStage` with its
  arguments; the stage sends the arguments that are activations (floating tensors with gradients);
- on the next stage a pre-hook on its first layer swaps those argument leaves for the received tensors;
- connections that skip over a boundary (a root-level residual from the embedding to the head, a U-Net's skips, an
  encoder's output read by every decoder layer) are carried: `carry_plan` lists, for each stage, the earlier
  layers' output activations that it or a later stage reads through root-level code (model_build records where
  each layer's arguments come from); a stage sends them after the boundary's arguments, passing on what it
  received for later stages, and the Placeholders of those layers return the received tensors.

A phantom still reaching one of the stage's own layers, the tensors sent to the next stage, or the loss (a value
the record did not trace, such as an integer tensor computed on another stage) fails with one line naming the layer
that reads it and the other stage's layer it comes from. Tied weights need nothing special: the owning layer holds
the parameter on its stage, and optim.py keeps the copies on different stages equal. A module outside every layer
that holds only other layers' parameters (T5's uncalled `shared` embedding, the tensor its encoder and decoder call
as embed_tokens) is an `Alias` on a stage that holds none of those layers, so that stage keeps no copy of it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mlm.planner.capture.training_step import TrainingModule
from mlm.planner.errors import PlanFileError
from mlm.planner.plan import Plan
from mlm.runtime.model_build import LOSS_LAYER, LayerCall, TensorSpec, plan_layers


class StopStage(BaseException):
    """Raised at the next stage's first layer; BaseException so user `except Exception` blocks cannot eat it."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


PHANTOM_ATTR = "_mlm_phantom_of"  # set on phantom tensors: the FQN of the other stage's layer they stand for


def phantom_of(x: Any) -> str | None:
    """The other-stage layer a phantom tensor stands for, or None for a real tensor (or a non-tensor)."""
    return getattr(x, PHANTOM_ATTR, None) if isinstance(x, torch.Tensor) else None


def make_phantom(shape: Any, dtype: torch.dtype, device: torch.device, origin: str) -> torch.Tensor:
    """A one-element zero expanded to `shape` (no memory of that size), tagged with the layer it stands for."""
    t = torch.zeros((), dtype=dtype, device=device).expand(tuple(shape))
    setattr(t, PHANTOM_ATTR, origin)
    return t


class PhantomMode(TorchDispatchMode):
    """Ops that read a phantom return phantoms of their output shapes (computed on meta); others run as usual."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        origin = next((o for o in map(phantom_of, leaves) if o is not None), None)
        if origin is None:
            return func(*args, **kwargs)
        written = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        for name in written:  # in place into a real tensor from another stage's value: would corrupt it
            if isinstance(bound.get(name), torch.Tensor) and phantom_of(bound[name]) is None:
                raise PlanFileError(
                    f"root-level code writes the output of {origin} (on another pipeline stage) into a tensor "
                    f"of this stage ({func}); cut the stages elsewhere"
                )
        try:
            meta_out = func(*pytree.tree_map(_to_meta, args), **pytree.tree_map(_to_meta, kwargs))
        except Exception as e:  # data-dependent ops (.item(), nonzero) or ops without a meta kernel
            raise PlanFileError(
                f"root-level code computes {func} from the output of {origin}, which lives on another "
                f"pipeline stage ({type(e).__name__}); cut the stages elsewhere"
            ) from None
        if written and isinstance(bound.get(written[0]), torch.Tensor):
            return bound[written[0]]
        return pytree.tree_map(
            lambda m: make_phantom(m.shape, m.dtype, self.device, origin) if isinstance(m, torch.Tensor) else m,
            meta_out,
        )


def _to_meta(x: Any) -> Any:
    return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x


class _StandIn(nn.Module):
    """A module standing in for another stage's layer `fqn`: attribute reads fall through to the layer's meta-device
    original (`_original`, not registered as a submodule, so its parameters stay off this stage)."""

    fqn: str

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original")
            if original is None:
                raise
            return _elsewhere(getattr(original, name), f"{self.fqn}.{name}", self.fqn)


class Placeholder(_StandIn):
    """Stands in for a layer that lives on another stage: holds nothing, returns phantoms of the recorded shapes.

    Root-level code may read the layer's attributes (HF ViT reads its patch projection's weight dtype, a diffusers
    U-Net counts an up block's resnets): they are looked up on the layer's meta-device original, which this
    module does not register (no parameters). Calling one of the original's submodules (a DiT's head calls the
    first block's timestep embedder) would compute another stage's layer here: that fails with one line."""

    def __init__(
        self,
        fqn: str,
        output: Any,
        device: torch.device,
        original: nn.Module | None = None,
        carried: dict[tuple[str, int], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.fqn, self.output, self.device = fqn, output, device
        object.__setattr__(self, "_original", original)  # not a submodule: its parameters stay off this stage
        # the stage's received copies of other stages' outputs (StageModule.carried), (layer, leaf) -> tensor: the
        # leaves this stage needs are real, the others phantoms
        object.__setattr__(self, "_carried", carried if carried is not None else {})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten(self.output, is_leaf=lambda x: isinstance(x, TensorSpec))
        carried = self.__dict__["_carried"]
        out = [
            carried[(self.fqn, i)]
            if (self.fqn, i) in carried
            else make_phantom(x.shape, x.dtype, self.device, self.fqn)
            if isinstance(x, TensorSpec)
            else x
            for i, x in enumerate(leaves)
        ]
        return pytree.tree_unflatten(out, spec)

    def extra_repr(self) -> str:
        return f"{self.fqn} (on another stage)"


def _elsewhere(value: Any, fqn: str, layer: str) -> Any:
    """An attribute of another stage's layer as root-level code reads it: plain values as they are, modules behind
    _Elsewhere (the originals are shared with the stage that runs them, so they cannot be hooked)."""
    return _Elsewhere(value, fqn, layer) if isinstance(value, nn.Module) else value


class _Elsewhere:
    """A submodule of a layer on another stage: its attributes, length, items and iteration read through; calling
    it fails with one line (the root code would compute part of another stage's layer here)."""

    def __init__(self, module: nn.Module, fqn: str, layer: str) -> None:
        self._module, self._fqn, self._layer = module, fqn, layer

    def __getattr__(self, name: str) -> Any:
        return _elsewhere(getattr(self._module, name), f"{self._fqn}.{name}", self._layer)

    def __len__(self) -> int:
        return len(self._module)  # type: ignore[arg-type]

    def __getitem__(self, key: Any) -> Any:
        return _elsewhere(self._module[key], f"{self._fqn}.{key}", self._layer)  # type: ignore[index]

    def __iter__(self) -> Any:
        return (_elsewhere(m, f"{self._fqn}.{i}", self._layer) for i, m in enumerate(self._module))  # type: ignore[call-overload]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise PlanFileError(
            f"the model calls {self._fqn} outside its layer {self._layer}, which runs on another pipeline stage: a "
            f"module shared between layers must stay on one stage; plan this model with pp 1"
        )


class Boundary(_StandIn):
    """The next stage's first layer: stops this stage's forward and hands over its call arguments (its attributes
    are read on its meta-device original, as Placeholder's are)."""

    def __init__(self, fqn: str, original: nn.Module | None = None) -> None:
        super().__init__()
        self.fqn = fqn
        object.__setattr__(self, "_original", original)

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
        carry_in: tuple[tuple[str, int], ...] = (),
        carry_out: tuple[tuple[str, int], ...] = (),
        carried: dict[tuple[str, int], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.index, self.num_stages, self.layers = index, num_stages, layers
        self.send_leaves, self.recv_leaves = send_leaves, recv_leaves
        self.context = context
        self._received: tuple[torch.Tensor, ...] | None = None
        # outputs of earlier stages' layers that this stage (or a later one) reads past the boundary (carry_plan):
        # received after the boundary's tensors, in carry_in order; carry_out is sent after the boundary's
        self.carry_in, self.carry_out = carry_in, carry_out
        self.carried: dict[tuple[str, int], torch.Tensor] = carried if carried is not None else {}
        self._produced: dict[tuple[str, int], torch.Tensor] = {}
        for fqn in dict.fromkeys(layer for layer, _ in carry_out if layer in layers):
            inner.model.get_submodule(fqn).register_forward_hook(partial(self._produce, fqn))
        if recv_layer is not None:
            inner.model.get_submodule(recv_layer).register_forward_pre_hook(
                self._inject, with_kwargs=True, prepend=True
            )
        if index > 0:  # only later stages meet phantoms (the layers before them live elsewhere)
            for fqn in layers:
                inner.model.get_submodule(fqn).register_forward_pre_hook(partial(_check_real, fqn), with_kwargs=True)

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, *received: torch.Tensor, inputs: Any, targets: torch.Tensor) -> Any:
        self._produced.clear()
        self.carried.clear()
        if self.index > 0:
            expected = len(self.recv_leaves) + len(self.carry_in)
            if len(received) != expected:
                raise RuntimeError(f"stage {self.index} received {len(received)} tensors, expected {expected}")
            # the gradients sent back: with row-major strides too (a permute's backward gives the received
            # activation a permuted gradient, and the previous stage receives into a buffer of those strides)
            received = tuple(_StandardGradStrides.apply(x) if x.requires_grad else x for x in received)
            self._received = received[: len(self.recv_leaves)]
            self.carried.update(zip(self.carry_in, received[len(self.recv_leaves) :]))
        device = next((t.device for t in (*received, targets) if isinstance(t, torch.Tensor)), torch.device("cpu"))
        try:
            with contextlib.ExitStack() as stack:
                if self.context is not None:
                    stack.enter_context(self.context())
                if self.index > 0:
                    stack.enter_context(PhantomMode(device))
                loss = self.inner(inputs, targets)
        except StopStage as stop:
            leaves = pytree.tree_leaves((stop.args, stop.kwargs))
            sent = tuple(leaves[i] for i in self.send_leaves)
            sent += tuple(self._produced[k] if k in self._produced else self.carried[k] for k in self.carry_out)
            for x in sent:
                if phantom_of(x) is not None:
                    raise PlanFileError(_skip_message(self.layers[-1], "the next stage", phantom_of(x))) from None
            return tuple(_standard_strides(_to_local(x)) for x in sent)
        finally:
            self._received = None
            self._produced.clear()
            self.carried.clear()
        if not self.is_last:
            raise RuntimeError(f"stage {self.index} finished the forward without reaching the next stage")
        if phantom_of(loss) is not None:
            raise PlanFileError(_skip_message("the loss", "this stage", phantom_of(loss)))
        return loss.reshape(1)  # shape (1,): pipeline schedules concatenate the last stage's outputs

    def _produce(self, fqn: str, _module: nn.Module, _args: tuple, out: Any) -> None:
        """Keep this forward's output leaves of an own layer that a later stage reads (the first call's)."""
        leaves = pytree.tree_leaves(out)
        for layer, i in self.carry_out:
            if layer == fqn and (layer, i) not in self._produced:
                self._produced[(layer, i)] = leaves[i]

    def _inject(self, _module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._received is None:  # a later call of the same module: nothing to swap
            return None
        leaves, spec = pytree.tree_flatten((args, kwargs))
        for i, tensor in zip(self.recv_leaves, self._received):
            leaves[i] = tensor
        self._received = None
        new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
        return tuple(new_args), dict(new_kwargs)


def _check_real(fqn: str, _module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Pre-hook on a stage's own layer: none of its inputs may stand for another stage's output."""
    for x in pytree.tree_leaves((args, kwargs)):
        origin = phantom_of(x)
        if origin is not None:
            raise PlanFileError(_skip_message(fqn, "this stage", origin))


def _skip_message(reader: str, where: str, origin: str) -> str:
    return (
        f"{reader} (on {where}) reads the output of {origin}, which runs on an earlier pipeline stage: the model "
        f"has a connection that skips over a stage boundary; cut the stages so that only the previous layer's "
        f"activations cross it"
    )


def _to_local(x: Any) -> Any:
    """Pipeline p2p sends plain tensors; a DTensor activation goes as its local shard (the receiving layer's
    tensor-parallel input layout reinterprets it)."""
    to_local = getattr(x, "to_local", None)
    return to_local() if callable(to_local) else x


def _standard_strides(x: Any) -> Any:
    """`x` with row-major strides: torch's pipeline stage makes the peer's receive buffers with the strides of what
    is sent, and gloo's p2p needs contiguous buffers; a permuted activation (ConvNeXt's channels-last blocks), even
    one that counts as contiguous through a size-1 dimension, is copied."""
    if not isinstance(x, torch.Tensor):
        return x
    standard, step = [], 1
    for size in reversed(x.shape):
        standard.append(step)
        step *= max(size, 1)
    return x if tuple(reversed(standard)) == x.stride() else x.clone(memory_format=torch.contiguous_format)


class _StandardGradStrides(torch.autograd.Function):
    """Identity whose backward gives the gradient row-major strides (_standard_strides)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _standard_strides(grad)


def original_fqn(name: str) -> str:
    return name[len(StageModule.PREFIX) :] if name.startswith(StageModule.PREFIX) else name


def stage_ranks(plan: Plan) -> list[int]:
    """Pipeline rank of every stage: stage i runs on rank i % pp (the interleaved schedules' placement)."""
    return [i % plan.layout.pp for i in range(len(plan.stages))]


def check_stage_boundaries(plan: Plan, calls: dict[str, LayerCall]) -> None:
    """Each stage but the first receives at least one activation (its first layer's inputs, or activations carried
    past the boundary: a decoder stage after an encoder starts at the decoder's embedding); "loss" is last."""
    carry = carry_plan(plan, calls)
    for i, stage in enumerate(plan.stages):
        layers = [x for x in stage.layers if x != LOSS_LAYER]
        if LOSS_LAYER in stage.layers and (i != len(plan.stages) - 1 or stage.layers[-1] != LOSS_LAYER):
            raise PlanFileError(f'plan.json: stages[{i}] holds "loss"; it must be the last entry of the last stage')
        if not layers:
            raise PlanFileError(f"plan.json: stages[{i}] holds no layer (the loss must share a stage with the head)")
        if i > 0 and not calls[layers[0]].grad_leaves and not carry[i]:
            raise PlanFileError(
                f"plan.json: stages[{i}] starts at {layers[0]}, which receives no activation from the previous stage"
            )
    if LOSS_LAYER not in plan.stages[-1].layers:
        raise PlanFileError('plan.json: the last stage must end with the pseudo-layer "loss"')
    if _torch_version() < (2, 13):
        for i, stage in enumerate(plan.stages[1:], start=1):
            first = next(x for x in stage.layers if x != LOSS_LAYER)
            values = [k for k in carry[i] if k[1] in calls[k[0]].no_grad_outputs]
            if calls[first].no_grad_leaves or values:
                raise PlanFileError(
                    f"plan.json: stages[{i}] receives a value without grad from an earlier stage's layer (a mask or "
                    f"bias a layer returns, read by {first} or later); sending it needs torch >= 2.13, whose "
                    f"PipelineStage sends no gradient back for it (this is torch {torch.__version__}): upgrade "
                    f"torch, or plan with fewer pipeline stages"
                )


def _torch_version() -> Any:
    """torch's TorchVersion, which compares with tuples (a function, so a test can stand in an older one)."""
    return torch.__version__


def carry_plan(plan: Plan, calls: dict[str, LayerCall]) -> list[tuple[tuple[str, int], ...]]:
    """For each stage, the (layer, output leaf) activations of earlier stages' layers it receives besides the next
    layer's inputs: those that its layers other than the first (whose inputs arrive as the boundary), its loss, or
    the inputs it sends on read through root-level code (record_layer_calls' `reads`: a U-Net's skips, T5's encoder
    output), and those a later stage needs, which it passes on. Stage 0 receives nothing."""
    stage_of = {f: i for i, st in enumerate(plan.stages) for f in st.layers if f != LOSS_LAYER}
    position = {f: i for i, f in enumerate(plan_layers(plan))}
    firsts = [next(x for x in st.layers if x != LOSS_LAYER) for st in plan.stages]
    carry: list[tuple[tuple[str, int], ...]] = [()] * len(plan.stages)
    later: set[tuple[str, int]] = set()
    for s in reversed(range(1, len(plan.stages))):
        readers = [f for f in plan.stages[s].layers if f != firsts[s]]
        if s + 1 < len(plan.stages):
            readers.append(firsts[s + 1])
        wanted = {k for f in readers if f in calls for k in calls[f].reads} | later
        mine = {k for k in wanted if stage_of.get(k[0], s) < s and k[1] in calls[k[0]].out_activations}
        carry[s] = tuple(sorted(mine, key=lambda k: (position[k[0]], k[1])))
        later = mine
    return carry


def build_stage(
    model: nn.Module,
    loss_fn: Any,
    plan: Plan,
    index: int,
    calls: dict[str, LayerCall],
    device: torch.device,
    context: Callable[[], Any] | None = None,
    carry: list[tuple[tuple[str, int], ...]] | None = None,
) -> StageModule:
    """The StageModule for stage `index`, sharing this stage's layer modules with `model` (see module doc);
    `carry`: carry_plan(plan, calls), computed once for all stages."""
    stages = plan.stages
    carry = carry if carry is not None else carry_plan(plan, calls)
    carried: dict[tuple[str, int], torch.Tensor] = {}
    own = [x for x in stages[index].layers if x != LOSS_LAYER]
    all_layers = plan_layers(plan)
    next_first = None
    if index + 1 < len(stages):
        next_first = next(x for x in stages[index + 1].layers if x != LOSS_LAYER)
    replacements: dict[str, nn.Module] = {}
    for fqn in all_layers:
        if fqn in own or (fqn != next_first and _parameter_free(model.get_submodule(fqn))):
            continue
        original = model.get_submodule(fqn)
        replacements[fqn] = (
            Boundary(fqn, original)
            if fqn == next_first
            else Placeholder(fqn, calls[fqn].output, device, original, carried)
        )
    for fqn in aliases_elsewhere(model, all_layers, own):
        replacements[fqn] = Alias(fqn, model.get_submodule(fqn))
    stage_model = _replace_modules(model, replacements)
    send = calls[next_first].grad_leaves if next_first is not None else ()
    recv_layer = own[0] if index > 0 else None
    recv = calls[own[0]].grad_leaves if index > 0 else ()
    carry_out = carry[index + 1] if index + 1 < len(stages) else ()
    return StageModule(
        TrainingModule(stage_model, loss_fn),
        index,
        len(stages),
        own,
        send,
        recv_layer,
        recv,
        context,
        carry[index],
        carry_out,
        carried,
    )


def aliases_elsewhere(model: nn.Module, layers: list[str], own: list[str]) -> list[str]:
    """Modules outside every layer (and not containers of layers) all of whose parameters are parameters of layers,
    none of them this stage's: the stage need not hold them (see Alias)."""
    in_layers = {id(p) for f in layers for p in model.get_submodule(f).parameters()}
    mine = {id(p) for f in own for p in model.get_submodule(f).parameters()}
    found: list[str] = []
    for name, module in model.named_modules():
        related = (f for f in [*layers, *found] if name == f or name.startswith(f + ".") or f.startswith(name + "."))
        if not name or next(related, None) is not None:
            continue
        params = [id(p) for p in module.parameters()]
        if params and all(i in in_layers and i not in mine for i in params):
            found.append(name)
    return found


class Alias(_StandIn):
    """Stands in for a module outside every layer that only aliases other stages' layers' parameters (T5's
    `shared`): no parameters here; attribute reads see the original (an embedding's `num_embeddings`), and calling
    it fails with one line, since its weights live on another stage."""

    def __init__(self, fqn: str, original: nn.Module) -> None:
        super().__init__()
        self.fqn = fqn
        object.__setattr__(self, "_original", original)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PlanFileError(
            f"{self.fqn} holds only the parameters of layers on other pipeline stages but is called here; "
            f"plan.json's stages must hold it with its layers"
        )


def _parameter_free(module: nn.Module) -> bool:
    """A layer without parameters (rotary tables, position ids, masks) runs on every stage instead of standing
    in for another stage: Hugging Face decoders compute the rotary cos/sin once in the root (`rotary_emb`) and
    pass them to every block, so a later stage's blocks would otherwise read an earlier stage's output. What it
    computes from real inputs is real on this stage; from another stage's activations, PhantomMode keeps it a
    phantom and the skip check below names it as before."""
    return next(module.parameters(), None) is None


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
