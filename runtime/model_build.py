"""Load the plan's model file, check it is the one the plan was made for, record how its layers are called, and
build it on meta with only this rank's shards materialised (the section "building on meta" below).

The record comes from one forward of the whole training step on the meta device (no memory, no compute): for
each layer of the plan, the pytree structure of its first call's arguments (which leaves are activations that
carry gradients) and the shapes of its outputs. Stage splitting (stages.py) needs exactly this to cut an
unmodified eager model at layer boundaries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from mlm.planner.capture.loader import ModelSpec, for_training, instantiate, load_model_spec
from mlm.planner.capture.training_step import TrainingModule, example_batch, first_embedding_vocab
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
    # indices into pytree leaves of (args, kwargs) that are activations: with grad, or floating values computed from
    # an earlier parameter-holding layer's output (T5's decoder blocks read the cross-attention bias that block 0
    # returns, a mask without grad): another stage cannot recompute them, so a pipeline boundary sends them
    grad_leaves: tuple[int, ...]
    output: Any  # the output pytree with tensors replaced by TensorSpec
    # the shape of each pytree leaf of (args, kwargs), None for non-tensors and data-dependent shapes (context
    # parallelism tells by it which arguments are whole-sequence tensors, context_parallel.py)
    leaf_shapes: tuple[tuple[int, ...] | None, ...] = ()
    # FQN -> the first call's (args, kwargs) of each module inside the layer that holds a linear directly, tensors
    # as TensorSpec (tensor parallelism checks an attention / MLP region by calling it so, tensor_parallel.py)
    inner: dict[str, Any] = field(default_factory=dict)
    # (layer, output leaf) of the activations of other layers that this call's arguments are computed from through
    # root-level code (a U-Net's up block reads a down block's output): pipeline stages carry them (stages.py)
    reads: frozenset[tuple[str, int]] = frozenset()
    out_activations: tuple[int, ...] = ()  # indices of the output's pytree leaves that are activations
    # of grad_leaves / out_activations, those without grad (layer values such as T5's cross-attention bias): a
    # pipeline boundary sends them with no gradient back, which torch's PipelineStage does from 2.13 on (stages.py)
    no_grad_leaves: tuple[int, ...] = ()
    no_grad_outputs: tuple[int, ...] = ()
    # linears inside the layer whose output the model then modifies in place (Falcon adds the attention output into
    # the MLP's with +=): under tensor parallelism their rowwise output is a fresh tensor, not DTensor's local view
    modified_in_place: frozenset[str] = frozenset()


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
    """The whole model with the initial weights every layout gets for this seed (the single-process reference):
    built on meta and materialised whole (see the section on building on meta below)."""
    mm = build_meta_model(spec, seed, cpu=torch.device(device).type == "cpu")
    materialize(mm.model, mm, torch.device(device), lambda name: name)
    return mm.model


def token_batch(
    vocab: int, batch: int, seq: int, device: str | torch.device, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if str(device) == "meta":
        tokens = torch.zeros(batch, seq + 1, dtype=torch.long, device="meta")
    else:
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator).to(device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def meta_batch(spec: ModelSpec, model: nn.Module, plan: Plan, batch: int) -> tuple[Any, Any]:
    """A batch of `batch` rows on the meta device, as the run feeds it (runtime/data.py): the file's
    example_inputs, else token ids."""
    if spec.example_inputs is not None:
        with torch.device("meta"):
            return example_batch(spec.example_inputs, batch, plan.training.seq_len)
    return token_batch(model_vocab(model, plan), batch, plan.training.seq_len, "meta")


def model_vocab(model: nn.Module, plan: Plan) -> int:
    try:
        return first_embedding_vocab(model)
    except ValueError:
        return plan.model.vocab_size


def _holds_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"  # HF GPT-2's transposed linear


def _call_spec(x: Any) -> Any:
    """A call argument as recorded: a tensor's shape and dtype; None, numbers and strings as they are; any other
    object (a cache, a config) as None."""
    if isinstance(x, torch.Tensor):
        shape = _static_shape(x)
        return TensorSpec(shape, x.dtype) if shape is not None else None
    return x if x is None or isinstance(x, (bool, int, float, str)) else None


def _static_shape(x: Any) -> tuple[int, ...] | None:
    if not isinstance(x, torch.Tensor):
        return None
    try:
        return tuple(int(n) for n in x.shape)
    except (TypeError, ValueError, RuntimeError):  # an unbacked symbolic size
        return None


def record_layer_calls(spec: ModelSpec, plan: Plan, micro_batch: int) -> dict[str, LayerCall]:
    """Run the training step once on meta tensors and record each plan layer's first call (see module doc)."""
    model = for_training(instantiate(spec, "meta"), cpu=True, experts="batched_mm")
    layers = plan_layers(plan)
    check_layers_cover_model(model, layers)
    calls: dict[str, LayerCall] = {}
    pending: dict[str, tuple[tuple[int, ...], tuple[tuple[int, ...] | None, ...], tuple[int, ...]]] = {}
    order: list[str] = []
    handles = []
    strays: list[str] = []  # modules with parameters outside every layer that run (a tied lm_head left out)
    for fqn, module in model.named_modules():
        if (
            fqn
            and module._parameters
            and not any(fqn == f or fqn.startswith(f + ".") or f.startswith(fqn + ".") for f in layers)
        ):
            handles.append(module.register_forward_pre_hook(lambda _m, _a, fqn=fqn: strays.append(fqn)))
    inner: dict[str, Any] = {}
    for name, module in model.named_modules():
        if _holds_linear(module):

            def mark(_m: nn.Module, _args: tuple, out: Any, name: str = name) -> None:
                if isinstance(out, torch.Tensor):
                    setattr(out, LINEAR_OUTPUT_ATTR, name)

            handles.append(module.register_forward_hook(mark))
        if name and any(_holds_linear(c) for c in module.modules() if c is not module):  # a region may nest them

            def record(_m: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
                if name not in inner:
                    inner[name] = pytree.tree_map(_call_spec, (args, kwargs))

            handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    tracker = _OriginTracker()
    reads: dict[str, frozenset[tuple[str, int]]] = {}
    for fqn in layers:
        module = model.get_submodule(fqn)
        free = next(module.parameters(), None) is None  # runs on every stage: its ops pass tags on (stages.py)

        def pre(_m: nn.Module, args: tuple, kwargs: dict, fqn: str = fqn, free: bool = free) -> None:
            tracker.depth += not free
            if fqn in pending or fqn in calls:
                return
            leaves = pytree.tree_leaves((args, kwargs))
            grads = tuple(i for i, x in enumerate(leaves) if _is_activation(x) or _is_layer_value(x))
            values = tuple(i for i in grads if not _is_activation(leaves[i]))
            pending[fqn] = grads, tuple(_static_shape(x) for x in leaves), values
            reads[fqn] = frozenset().union(*(_origins(x) for x in leaves))
            order.append(fqn)

        def post(_m: nn.Module, _args: tuple, _kwargs: dict, out: Any, fqn: str = fqn, free: bool = free) -> None:
            tracker.depth -= not free
            leaves = pytree.tree_leaves(out)
            acts = tuple(i for i, x in enumerate(leaves) if _is_float(x))  # with grad or not
            if not free:
                for i in acts:
                    _tag(leaves[i], frozenset({(fqn, i)}), replace_tags=True)
            if fqn in calls:
                return
            spec_out = pytree.tree_map(
                lambda x: TensorSpec(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x, out
            )
            calls[fqn] = LayerCall(
                fqn,
                pending[fqn][0],
                spec_out,
                pending[fqn][1],
                out_activations=acts,
                no_grad_leaves=pending[fqn][2],
                no_grad_outputs=tuple(i for i in acts if not _is_activation(leaves[i])),
            )

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    inputs, targets = meta_batch(spec, model, plan, micro_batch)
    try:
        # Under FakeTensorMode (over the meta parameters): libraries that branch on data skip that branch for fake
        # tensors as they do when tracing (transformers' masking_utils.is_tracing), where on plain meta tensors
        # the branch's .item() fails.
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        # a ShapeEnv lets data-dependent sizes (torch.where in a hand-written MoE's dispatch) be symbols
        with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()), tracker:
            loss = TrainingModule(model, spec.loss_fn)(inputs, targets)
        reads[LOSS_LAYER] = _origins(loss)
    except Exception as e:  # user model code on meta tensors
        raise ModelLoadError(
            f"the training step does not run on the meta device: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    finally:
        for h in handles:
            h.remove()
    if strays:
        name = next(iter(model.get_submodule(strays[0])._parameters))
        raise PlanFileError(
            f"plan.json: parameter '{strays[0]}.{name}' is in no layer of the stages, and {strays[0]} runs"
        )
    for fqn in calls:
        mine = {k: v for k, v in inner.items() if k.startswith(fqn + ".")}
        changed = frozenset(k for k in tracker.modified_in_place if k.startswith(fqn + "."))
        calls[fqn] = replace(calls[fqn], inner=mine, reads=reads.get(fqn, frozenset()), modified_in_place=changed)
    calls[LOSS_LAYER] = LayerCall(LOSS_LAYER, (), None, reads=reads.get(LOSS_LAYER, frozenset()))
    missing = [f for f in layers if f not in calls]  # (calls also holds the loss's reads, under LOSS_LAYER)
    if missing:
        raise PlanFileError(f"plan.json: stages list layer(s) the forward never calls: {', '.join(missing[:3])}")
    if order != layers:
        first_bad = next(i for i, (a, b) in enumerate(zip(order, layers)) if a != b)
        raise PlanFileError(
            f"plan.json: stages list layers out of execution order: at position {first_bad} the "
            f"model calls {order[first_bad]} but the plan has {layers[first_bad]}"
        )
    return calls


LINEAR_OUTPUT_ATTR = "_mlm_linear_output"  # set on a linear's output during record_layer_calls: the linear's FQN
ORIGINS_ATTR = "_mlm_origins"  # set on tensors during record_layer_calls: the (layer, leaf) outputs they derive from


def _origins(x: Any) -> frozenset[tuple[str, int]]:
    return getattr(x, ORIGINS_ATTR, frozenset()) if isinstance(x, torch.Tensor) else frozenset()


def _tag(t: Any, tags: frozenset[tuple[str, int]], replace_tags: bool = False) -> None:
    if isinstance(t, torch.Tensor):
        setattr(t, ORIGINS_ATTR, tags if replace_tags else _origins(t) | tags)


class _OriginTracker(TorchDispatchMode):
    """While record_layer_calls runs the step: every op outside the plan's parameter-holding layers (root-level code,
    parameter-free layers) tags its outputs with the union of its inputs' tags, so each layer's arguments tell
    which earlier layers' activations they are computed from. Inside a layer nothing is tagged; its outputs are
    tagged (layer, leaf) when it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # > 0 inside a parameter-holding plan layer
        self.modified_in_place: set[str] = set()  # linears whose output an in-place op then writes (LayerCall)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.arguments and args and isinstance(args[0], torch.Tensor):
            alias = schema.arguments[0].alias_info
            if alias is not None and alias.is_write and (name := getattr(args[0], LINEAR_OUTPUT_ATTR, None)):
                self.modified_in_place.add(name)
        out = func(*args, **(kwargs or {}))
        if self.depth == 0:
            tags = frozenset().union(*(_origins(x) for x in pytree.tree_leaves((args, kwargs))))
            if tags:
                for t in pytree.tree_leaves(out):
                    _tag(t, tags)
        return out


def _is_activation(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _is_layer_value(x: Any) -> bool:
    """A floating tensor without grad computed from a parameter-holding layer's output (tagged by the tracker)."""
    return _is_float(x) and bool(_origins(x))


def check_layers_cover_model(model: nn.Module, layers: list[str]) -> None:
    """Every plan layer exists, no layer contains another, and every parameter lies inside some layer or is a root
    parameter (root_parameters: held by every stage)."""
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
    inside = {id(p) for fqn in layers for p in model.get_submodule(fqn).parameters()}
    for pname, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in inside and not _on_the_path_to_layers(pname, layers):
            raise PlanFileError(f"plan.json: parameter {pname!r} is in no layer of the stages")


def root_parameters(model: nn.Module, layers: list[str]) -> list[str]:
    """Parameters that no layer holds, one name per tensor: a ViT's class token and position table on the root
    module. The root-level code that reads them runs on every pipeline stage, so every stage holds a copy, kept
    equal as tied copies are (train.py); a tensor that a layer holds under another name (T5's `shared` embedding,
    called as encoder.embed_tokens) is that layer's."""
    inside = {id(p) for fqn in layers for p in model.get_submodule(fqn).parameters()}
    return [n for n, p in model.named_parameters() if id(p) not in inside and _on_the_path_to_layers(n, layers)]


def _on_the_path_to_layers(param: str, layers: list[str]) -> bool:
    """Whether the parameter's module is the root or a container of layers (whose own forward reads it), not a
    module of its own that the plan's layers leave out."""
    owner = param.rpartition(".")[0]
    return owner == "" or any(fqn.startswith(owner + ".") for fqn in layers)


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


# ---- building on meta and materialising only what a rank owns ----
#
# The model is instantiated once with its parameters on the meta device (buffers stay real: they are small and
# often computed in __init__, e.g. rotary tables) while a dispatch mode records, per parameter storage, the
# in-place ops __init__ applied to it (nn.init's uniform_/normal_/zero_/fill_, trunc_normal_'s erfinv_/mul_/add_/
# clamp_, an Embedding's padding row zero_, HF's _init_weights, nanoGPT's scaled c_proj init). After the stage is
# cut, tensor-parallelised and FSDP-sharded on meta, each parameter this rank holds is materialised by replaying
# its ops on a full-size CPU tensor (one parameter at a time) with a generator seeded from (seed, canonical FQN),
# and only the local shard is kept. The weights therefore depend on the seed and the parameter's name only, never
# on the layout. A parameter whose ops cannot be replayed (one that reads another meta tensor, e.g. orthogonal_'s
# copy_ from a QR) takes its value from a full fp32 CPU build instead, with a warning naming it.


class _Self:
    """Stands for the recorded parameter in a recorded op's arguments."""


SELF = _Self()

_EMPTY_FACTORIES = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
_FILL_FACTORIES = {"zeros": 0.0, "zeros_like": 0.0, "new_zeros": 0.0, "ones": 1.0, "ones_like": 1.0, "new_ones": 1.0}
_FULL_FACTORIES = {"full", "full_like", "new_full"}


@dataclass(frozen=True)
class InitOp:
    """One in-place op on (a view of) a parameter: the view's geometry, the op, its arguments with SELF."""

    geometry: tuple[tuple[int, ...], tuple[int, ...], int]
    func: Any  # an aten op, or a torch.nn.init function (recorded whole, see _init_functions_recorded)
    args: tuple
    kwargs: dict
    takes_generator: bool = False


@dataclass
class ParamRecipe:
    """How to recompute one parameter: a start value (None: zeros) and the in-place ops applied to it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    start: torch.Tensor | None = None
    ops: list[InitOp] = field(default_factory=list)
    unreplayable: str | None = None


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _writes_self(func: Any) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


class _InitRecorder(TorchDispatchMode):
    """Records in-place ops on storages born from empty / zeros / ones / full factories (see section doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, ParamRecipe] = {}
        self.inside_init = 0  # > 0 inside a recorded torch.nn.init call: its own ops are not recorded

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if _writes_self(func) and isinstance(args[0], torch.Tensor):
            recipe = self.live.get(_key(args[0]))
            if recipe is not None and not self.inside_init:
                self._record(recipe, func, args, kwargs)
            return out
        for i, arg in enumerate(func._schema.arguments):  # out= variants writing a recorded storage
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = kwargs.get(arg.name, args[i] if i < len(args) else None)
                if isinstance(value, torch.Tensor) and _key(value) in self.live:
                    self.live[_key(value)].unreplayable = f"written by {name} (out=)"
        returns = func._schema.returns
        if isinstance(out, torch.Tensor) and returns and returns[0].alias_info is None:
            key = _key(out)
            self.live.pop(key, None)  # a reused storage address
            shape, stride = tuple(out.shape), tuple(out.stride())
            if name in _EMPTY_FACTORIES:
                self.live[key] = ParamRecipe(shape, stride, out.dtype)
            elif name in _FILL_FACTORIES or name in _FULL_FACTORIES:
                value = _FILL_FACTORIES.get(name)
                if value is None:
                    value = args[1] if len(args) > 1 else kwargs.get("fill_value")
                recipe = ParamRecipe(shape, stride, out.dtype)
                recipe.ops.append(InitOp((shape, stride, 0), torch.ops.aten.fill_.Scalar, (SELF, value), {}))
                self.live[key] = recipe
        return out

    def _record(self, recipe: ParamRecipe, func: Any, args: tuple, kwargs: dict) -> None:
        target = args[0]
        geometry = (tuple(target.shape), tuple(target.stride()), target.storage_offset())
        rest: list[Any] = [SELF]
        for a in [*args[1:], *kwargs.values()]:
            if isinstance(a, torch.Tensor) and (a.is_meta or _key(a) in self.live):
                recipe.unreplayable = f"{func._schema.name} reads another uninitialised tensor"
                return
        for a in args[1:]:
            rest.append(a.detach().clone() if isinstance(a, torch.Tensor) else a)
        kw = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        kw.pop("generator", None)
        takes = any(a.name == "generator" for a in func._schema.arguments) if hasattr(func, "_schema") else True
        recipe.ops.append(InitOp(geometry, func, tuple(rest), kw, takes))

    def record_init_call(self, fn: Callable[..., Any], tensor: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        """A torch.nn.init function on a recorded parameter: recorded as one op (replayed on the real tensor, so
        data-dependent inits such as trunc_normal_'s rejection sampling or orthogonal_'s QR replay exactly; in
        torch 2.13 several of them return early on meta tensors) and run on the meta tensor for its checks."""
        recipe = self.live.get(_key(tensor)) if isinstance(tensor, torch.Tensor) else None
        if recipe is not None and not self.inside_init:
            takes = "generator" in inspect.signature(fn).parameters
            self._record(recipe, fn, (tensor, *args), kwargs)
            if recipe.ops and recipe.ops[-1].func is fn:
                recipe.ops[-1] = dataclasses.replace(recipe.ops[-1], takes_generator=takes)
        self.inside_init += 1
        try:
            return fn(tensor, *args, **kwargs)
        finally:
            self.inside_init -= 1


@contextlib.contextmanager
def _init_functions_recorded(recorder: _InitRecorder) -> Iterator[None]:
    """Route the public in-place functions of torch.nn.init (normal_, trunc_normal_, orthogonal_, ...) through
    the recorder while the model is instantiated. Code that imported one by name before (`from torch.nn.init
    import trunc_normal_`) bypasses this; its aten ops are still recorded where the function runs on meta."""
    originals = {
        name: fn
        for name, fn in vars(nn.init).items()
        if name.endswith("_") and not name.startswith("_") and callable(fn)
    }
    for name, fn in originals.items():
        setattr(nn.init, name, functools.partial(_recorded_init, recorder, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(nn.init, name, fn)


_DATA_SET = torch.Tensor.data.__set__  # type: ignore[attr-defined]  # a fresh method-wrapper per access: compare with ==


class _MetaDataAssignment(TorchFunctionMode):
    """Under the dry run's FakeTensorMode, `param.data = value` (transformers pads a tied head's bias so) on one of
    our meta parameters assigns a meta tensor of the value's geometry: a fake value computed from the parameter
    carries the device's dispatch keys, which set_data refuses on a meta tensor, and values do not matter here."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func == _DATA_SET and len(args) == 2 and isinstance(args[1], torch.Tensor):
            target, value = args
            if torch._C._dispatch_keys(target).has(torch._C.DispatchKey.Meta):  # ours: meta parameters
                value = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
                return func(target, value)
        return func(*args, **(kwargs or {}))


class _ValuesReadAsZero(TorchDispatchMode):
    """Under the dry run's FakeTensorMode, where values do not matter, a value that initialisation code reads
    (trunc_normal_'s rejection loop asks whether any sample is still out of range) is 0: a fake tensor has none."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return False if t.dtype == torch.bool else 0 if not t.is_floating_point() else 0.0
        return func(*args, **(kwargs or {}))


def _recorded_init(recorder: _InitRecorder, fn: Callable[..., Any], tensor: Any, *args: Any, **kwargs: Any) -> Any:
    return recorder.record_init_call(fn, tensor, args, kwargs)


@contextlib.contextmanager
def _parameters_on_meta(recorder: _InitRecorder | None, recipes: dict[int, ParamRecipe]) -> Iterator[None]:
    """Every parameter registered while active is replaced by a meta parameter of the same shape (buffers stay
    real); its recipe so far moves to the meta storage. Like accelerate's init_empty_weights(include_buffers=
    False)."""
    original = nn.Module.register_parameter
    moved: dict[int, tuple[weakref.ref, nn.Parameter]] = {}  # weak: ids of freed parameters are reused
    made: dict[int, nn.Parameter] = {}  # the parameters this context created (held, so their ids stay theirs)

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is None or param.is_meta or id(param) in made:
            # `made`: one of ours re-registered (a tie such as wte.weight = lm_head.weight). Under FakeTensorMode
            # ours are not is_meta (the copied __dict__ carries the fake tensor's cpu fake_device), so without
            # this the tie would get a second, untied parameter
            return original(module, name, param)
        seen = moved.get(id(param))
        if seen is not None and seen[0]() is param:
            return original(module, name, seen[1])
        data = param.detach()
        meta = nn.Parameter(
            torch.empty_strided(data.shape, data.stride(), dtype=data.dtype, device="meta"),
            requires_grad=param.requires_grad,
        )
        meta.__dict__.update(param.__dict__)
        recipe = recorder.live.pop(_key(data), None) if recorder is not None else None
        full = data.storage_offset() == 0 and data.untyped_storage().nbytes() == data.numel() * data.element_size()
        if recipe is None or not full:
            recipe = ParamRecipe(tuple(data.shape), tuple(data.stride()), data.dtype, start=data.clone())
        if recorder is not None:
            recorder.live[_key(meta)] = recipe
        recipes[id(meta)] = recipe
        moved[id(param)] = (weakref.ref(param), meta)
        made[id(meta)] = meta
        return original(module, name, meta)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        if recorder is None:
            with contextlib.ExitStack() as modes:
                if _fake_mode_active():
                    modes.enter_context(_ValuesReadAsZero())
                    modes.enter_context(_MetaDataAssignment())
                yield
        else:
            with recorder, _init_functions_recorded(recorder):
                yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


@dataclass
class MetaModel:
    """The model with meta parameters and real buffers, and how to compute each parameter's initial value."""

    model: nn.Module
    seed: int
    recipes: dict[str, ParamRecipe]  # by canonical FQN
    canonical: dict[str, str]
    fallback: dict[str, torch.Tensor] = field(default_factory=dict)  # values from a full CPU build

    def full_value(self, name: str) -> torch.Tensor:
        """The full initial value of a parameter (any FQN of it), on CPU in its own dtype."""
        name = self.canonical.get(name, name)
        if name in self.fallback:
            return self.fallback[name]
        recipe = self.recipes[name]
        gen = torch.Generator().manual_seed(param_seed(self.seed, name))
        if recipe.start is not None:
            value = recipe.start.clone()
        else:
            value = torch.empty_strided(recipe.shape, recipe.stride, dtype=recipe.dtype).zero_()
        with torch.no_grad():
            for op in recipe.ops:
                shape, stride, offset = op.geometry
                target = value.as_strided(shape, stride, offset)
                args = tuple(target if a is SELF else a for a in op.args)
                kwargs = dict(op.kwargs)
                if op.takes_generator:
                    kwargs["generator"] = gen
                op.func(*args, **kwargs)
        return value


def param_seed(seed: int, name: str) -> int:
    """The generator seed of one parameter: a hash of (seed, canonical FQN), independent of the layout."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _fake_mode_active() -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


def build_meta_model(spec: ModelSpec, seed: int, cpu: bool = True) -> MetaModel:
    """Instantiate with parameters on meta, recording their initialisation (see the section doc), set up for
    training (for_training; `cpu`: the compute runs on the CPU). Under a FakeTensorMode (the dry run) nothing is
    recorded: values do not matter there."""
    recipes: dict[int, ParamRecipe] = {}
    recorder = None if _fake_mode_active() else _InitRecorder()
    torch.manual_seed(seed)
    with _parameters_on_meta(recorder, recipes):
        model = instantiate(spec, "cpu")
    for_training(model, cpu)
    canonical = canonical_names(model)
    by_name: dict[str, ParamRecipe] = {}
    real: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if canonical[name] != name:
            continue
        if not p.is_meta:  # `param.data = tensor` in __init__: the value is known
            real[name] = p.detach()
            by_name[name] = ParamRecipe(tuple(p.shape), tuple(p.stride()), p.dtype, start=p.detach().clone())
            continue
        by_name[name] = recipes.get(id(p)) or ParamRecipe(tuple(p.shape), tuple(p.stride()), p.dtype)
    if real:  # make every parameter meta, so materialisation treats them alike
        for name, value in real.items():
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            old = module._parameters[leaf]
            meta = nn.Parameter(torch.empty_like(value, device="meta"), requires_grad=old.requires_grad)
            for n2, p2 in list(model.named_parameters(remove_duplicate=False)):
                if p2 is old:
                    o2, _, l2 = n2.rpartition(".")
                    model.get_submodule(o2)._parameters[l2] = meta
    mm = MetaModel(model, seed, by_name, canonical)
    bad = {n: r.unreplayable for n, r in by_name.items() if r.unreplayable}
    if bad and recorder is not None:
        warnings.warn(
            "cannot replay the initialisation of "
            + ", ".join(f"{n} ({why})" for n, why in list(bad.items())[:5])
            + ": building the whole model on the CPU in fp32 to take their initial values from it",
            stacklevel=2,
        )
        torch.manual_seed(seed)
        full = instantiate(spec, "cpu")
        values = dict(full.named_parameters())
        mm.fallback = {n: values[n].detach().clone() for n in bad}
        del full, values
    return mm


def materialize(
    module: nn.Module,
    mm: MetaModel,
    device: torch.device,
    rename: Callable[[str], str],
    row_shards: dict[str, tuple[int, int]] | None = None,
) -> None:
    """Allocate `module`'s meta parameters on `device` and fill each with its initial value, keeping only this
    rank's shard of DTensor parameters (TP / FSDP2 placements, sliced locally without communication). Each
    parameter object is kept (its contents swapped, as to_empty does), so ties and FSDP2's references hold; buffers
    keep their values and move to `device`. `rename` maps the module's parameter names to the model's FQNs;
    `row_shards` (model FQN -> (rank, size)) names parameters this rank holds chunk `rank` of dimension 0 of
    (expert banks under ep, expert_parallel.py), taken before any DTensor placement applies."""
    fake = _fake_mode_active()
    with torch.no_grad():
        for sub in module.modules():
            for name, b in list(sub._buffers.items()):
                if b is not None and b.device != device:
                    sub._buffers[name] = b.to(device)
        for name, p in module.named_parameters():
            if p.is_meta:
                fresh = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                for key, value in p.__dict__.items():  # attributes set on the parameter; under the dry run a fake
                    fresh.__dict__.setdefault(key, value)  # tensor's own (fake_device: meta) stay the fresh one's
                torch.utils.swap_tensors(p, fresh)
            if fake:
                continue
            full = mm.full_value(rename(name))
            if row_shards and rename(name) in row_shards:
                rank, size = row_shards[rename(name)]
                full = full.chunk(size, dim=0)[rank]
            if isinstance(p, DTensor):
                full = to_stored_order(full, row_order(module, name))
                p.to_local().copy_(local_shard(full, p.device_mesh, p.placements))
            else:
                p.copy_(full)
            del full


ROW_ORDER = "_mlm_row_order"  # module attribute: parameter name -> (dim, order) of a reordered fused projection


def row_order(root: nn.Module, name: str) -> tuple[int, torch.Tensor] | None:
    """(dim, order) when parameter `name` of `root` is stored with its rows reordered (tensor_parallel.LocalColwise
    on unequal chunks): stored[i] = original[order[i]] along dim."""
    owner, _, leaf = name.rpartition(".")
    return getattr(root.get_submodule(owner), ROW_ORDER, {}).get(leaf)


def to_stored_order(value: torch.Tensor, order: tuple[int, torch.Tensor] | None) -> torch.Tensor:
    return value if order is None else value.index_select(order[0], order[1].to(value.device))


def to_original_order(value: torch.Tensor, order: tuple[int, torch.Tensor] | None) -> torch.Tensor:
    return value if order is None else value.index_select(order[0], order[1].argsort().to(value.device))


def local_shard(full: torch.Tensor, mesh: Any, placements: Any) -> torch.Tensor:
    """This rank's part of `full` under DTensor `placements` on `mesh`, sliced on the CPU without communication
    (distribute_tensor would first move the whole tensor to the mesh's device). Shard(d) takes chunk r of
    torch.chunk(n); a _StridedShard(d, split_factor=f) with no later mesh dimension sharding d (per-head TP of a
    fused projection) takes chunks r, r + n, ... of chunk(n * f); one followed by a mesh dimension that shards d
    too (FSDP2 over a dimension TP already shards) chunks what those later dimensions leave, so it applies last."""
    coord = mesh.get_coordinate()
    dims = [getattr(p, "dim", None) for p in placements]
    strided = [type(p).__name__ == "_StridedShard" for p in placements]
    later = [isinstance(d, int) and strided[i] and d in dims[i + 1 :] for i, d in enumerate(dims)]
    order = [i for i in range(len(placements)) if not later[i]] + [
        i for i in reversed(range(len(placements))) if later[i]
    ]
    out = full
    for i in order:
        dim = dims[i]
        if not isinstance(dim, int):  # Replicate
            continue
        n, r = mesh.size(i), coord[i]
        f = 1 if later[i] else int(getattr(placements[i], "split_factor", 1))
        parts = out.chunk(n * f, dim=dim)
        picked = parts[r::n] if f > 1 else parts[r : r + 1]
        if len(picked) == 1:
            out = picked[0]
        else:
            out = torch.cat(picked, dim=dim) if picked else out.narrow(dim, 0, 0)
    return out
