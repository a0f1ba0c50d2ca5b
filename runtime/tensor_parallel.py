"""Apply the plan's tensor_parallel map to a stage: Megatron's per-head sharding on local tensors.

Styles (module FQN or fnmatch pattern -> style):
  colwise   column-parallel linear (nn.Linear or HF's Conv1D). When the module's output is split into equal
            chunks (fused q|k|v, gate|up), every chunk is sharded: rank r holds rows r of each chunk
            (a _StridedShard placement, so the global parameter keeps its layout for checkpoints and gathers)
  rowwise   row-parallel linear: local input sharded on features, output all-reduced (Replicate) or, with
            sequence parallelism, reduce-scattered (Shard(seq)); the output is a local tensor
  vocab     nn.Embedding: VocabParallelEmbedding (vocabulary-sharded table, masked local lookup, Replicate output);
            nn.Linear head: ColwiseParallel with a vocabulary-sharded DTensor output, consumed by loss_parallel()
  sequence  SequenceParallel (norms / dropout on sequence shards) when the layout has sequence_parallel, else none
  replicate nothing (parameters stay replicated over tp); a linear under SP gets its sequence-sharded input
            gathered (a head whose vocabulary tp does not divide)

Regions (what runs for attention and MLP blocks). The direct parent P of colwise and rowwise linears (the attention
or MLP module of a block) is a *region* when its colwise linears all read P's input. P's input is prepared once
(torchtitan's PrepareModuleInput): a Replicate DTensor (in the autocast dtype when autocast is on), built from the
sequence-sharded input with one all-gather under sequence parallelism (its backward: one reduce-scatter), or from
the replicated input without it (backward: one all-reduce of the gradient summed over all readers). The colwise
linears return local tensors, so attention runs on this rank's heads only; the rowwise linear reduces. Per block
forward: 2 all-reduces, or 2 all-gathers + 2 reduce-scatters with SP; backward the same (what
planner/cost/tp_collectives.py counts and the cost model prices).

User code reshapes with its own attributes (nanoGPT's `self.n_head`, `self.n_embd`, HF's `self.split_size`) and
with its input's width (`B, T, C = x.size()`). Which integer attributes of P take per-rank values, and whether P
must see an input of per-rank width (a view of the input that only shape queries may read; the colwise linears get
the real one), is found by running P under fake tensors: once unsharded (recording the heads each attention call
sees and how colwise outputs are split) and then for each candidate setting with per-rank linear outputs, until
every attention call sees heads/tp heads of the unsharded head size and the output shape is unchanged. Parameters
P holds itself with one entry per query head (GPT-OSS's attention sinks) are tried whole first, then split with
the heads (each rank its heads' entries, read by P as a local tensor). No consistent setting is a one-line error;
so is a tp that does not divide the (key/value) heads.

Linears outside any region (e.g. nanoGPT written with all linears in the block) keep the previous behaviour:
colwise outputs stay DTensors with global shapes, so unedited user code computes what it computes on one device and
DTensor inserts the collectives it needs (more than Megatron's).
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
import weakref
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.overrides import TorchFunctionMode

from mlm.planner.errors import Infeasible, PlanFileError
from mlm.runtime import stages as _stages

SEQ_DIM = 1  # activations are (batch, seq, hidden)
CHECK_SEQ = 8  # tokens of the fake input the region check runs on
_FOREIGN = tuple(getattr(_stages, n) for n in ("Placeholder", "Boundary") if hasattr(_stages, n))


def expand_tp_map(tp_map: dict[str, str], module_names: list[str]) -> dict[str, str]:
    """Concrete module FQN -> style; exact keys win over patterns, later patterns over earlier ones."""
    out: dict[str, str] = {}
    for key, style in tp_map.items():
        if key in module_names:
            continue
        for name in module_names:
            if fnmatch.fnmatchcase(name, key):
                out[name] = style
    for key, style in tp_map.items():
        if key in module_names:
            out[key] = style
    return out


def check_tp_map(tp_map: dict[str, str], model: nn.Module) -> None:
    names = [n for n, _ in model.named_modules() if n]
    for key in tp_map:
        if key not in names and not any(fnmatch.fnmatchcase(n, key) for n in names):
            raise PlanFileError(f"plan.json: tensor_parallel key {key!r} matches no module of the model")


def is_conv1d(module: nn.Module) -> bool:
    """HF's Conv1D: y = x @ weight + bias with weight of shape (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def features(module: nn.Module) -> tuple[int, int]:
    """(in, out) features of an nn.Linear or Conv1D."""
    w = module.weight
    return (w.shape[0], w.shape[1]) if is_conv1d(module) else (w.shape[1], w.shape[0])


def style_for(
    style: str, module: nn.Module, sequence_parallel: bool, whole_sequence: bool = True
) -> ParallelStyle | None:
    """The style of a linear outside any region (and of embeddings, heads, norms). `whole_sequence`: the linear is a
    plan layer of its own (an output head), whose output the loss reads whole."""
    seq = Shard(SEQ_DIM) if sequence_parallel else Replicate()
    if style == "replicate" and sequence_parallel and is_linear(module) and whole_sequence:
        # a replicated output head (its vocabulary not divided by tp) on the sequence-sharded residual stream:
        # gather its input once and compute the whole sequence with the plain weight, so that every tp rank holds
        # the same output and the same, complete, weight gradient (on the shard alone the gradient would be a
        # partial sum, a DTensor FSDP2 cannot reduce). Backward: a local slice, no communication.
        return PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True)
    if style == "replicate" and sequence_parallel and is_linear(module):
        # a replicated linear inside a block (the sharding ILP left an MLP whole): it computes this rank's sequence
        # shard with the replicated weight, as the norms do, so a chain of such linears stays on the shard and
        # joins the residual stream there; DTensor all-reduces the weight's partial gradient over tp
        return SequenceParallel(sequence_dim=SEQ_DIM, use_local_output=True)
    if style == "replicate" or (style == "sequence" and not sequence_parallel):
        return None
    if style == "heads":
        # a norm over the head width applied to this rank's heads (Qwen3's q_norm / k_norm): the weight a
        # replicated DTensor, the input claimed sharded along dimension 0 (any dimension but the normalised one
        # gives the same local computation), so that DTensor sums the weight's partial gradient over tp
        return SequenceParallel(sequence_dim=0, use_local_output=True)
    if style == "rows":
        return LocalRows()
    if style == "sequence":
        # a norm inside a block hands on its local shard, as a region's output is, for the block's code to mix with
        # the (local) residual (Gemma's post-norms); a norm layer of its own (a final norm) a DTensor, whose global
        # shape the root code after it may read (HF GPT-2 views the output to (-1, seq, hidden))
        return SequenceParallel(sequence_dim=SEQ_DIM, use_local_output=not whole_sequence)
    if style == "vocab" and isinstance(module, nn.Embedding):
        return VocabParallelEmbedding(Replicate())
    if style in ("colwise", "vocab"):
        if is_conv1d(module):
            return Conv1DParallel(colwise=True, input_layout=seq)
        return ColwiseParallel(input_layouts=seq, use_local_output=False)
    if style == "rowwise":
        if is_conv1d(module):
            return Conv1DParallel(colwise=False, output_layout=seq)
        if isinstance(module, nn.Embedding):
            return VocabParallelEmbedding(seq)
        return RowwiseParallel(output_layouts=seq)
    raise PlanFileError(f"plan.json: unknown tensor_parallel style {style!r}")


def _local_leaves(model: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """`styles` with a 'heads' style (replicated weights on a rank-local input) on a module that has submodules
    (the routed experts of an MoE layer under SP: an nn.ModuleList of expert modules) moved to each submodule
    holding parameters: SequenceParallel replicates only a module's direct parameters, and DTensor then sums each
    one's partial gradient over tp. Parameters on the module itself beside its submodules are refused."""
    out = dict(styles)
    for name, style in styles.items():
        module = model.get_submodule(name)
        if style != "heads" or next(module.children(), None) is None:
            continue
        own = next((p for p, _ in module.named_parameters(recurse=False)), None)
        if own is not None:
            raise PlanFileError(
                f"{name}: sequence parallelism runs it on the rank's token shard with replicated weights, but it "
                f"holds the parameter {own!r} beside its submodules, which that cannot replicate: plan without "
                f"sequence parallelism"
            )
        del out[name]
        for sub, m in module.named_modules():
            if sub and next(m.parameters(recurse=False), None) is not None:
                out[f"{name}.{sub}"] = "heads"
    return out


def apply_tensor_parallel(
    model: nn.Module,
    tp_map: dict[str, str],
    mesh: DeviceMesh,
    sequence_parallel: bool,
    sequence_start: str | None = None,
    num_heads: int | None = None,
    layers: Collection[str] = (),
    calls: dict[str, Any] | None = None,
    modified_in_place: Collection[str] = (),
) -> bool:
    """Parallelize the modules of `model` (one stage's copy) in place; returns whether a vocabulary-parallel head
    is present (then the loss must run under loss_parallel()). `num_heads` (plan.model.num_heads), when given, is
    checked against the heads the attention calls see; `layers`: the plan's layer FQNs (a replicated linear that
    is one, an output head, computes the whole sequence under sequence parallelism, style_for); `calls`: FQN -> the
    recorded (args, kwargs) of the modules that may be regions (model_build.LayerCall.inner), so that the region
    check calls each as the model does (Hugging Face attention takes position embeddings and a mask by keyword);
    `modified_in_place`: linears whose output the model modifies in place (LayerCall.modified_in_place): a rowwise
    one returns a copy of DTensor's local view, which autograd forbids writing to (one extra copy of the output)."""
    names = [n for n, _ in model.named_modules() if n]
    concrete = expand_tp_map(tp_map, names)
    concrete = {n: s for n, s in concrete.items() if not isinstance(model.get_submodule(n), _FOREIGN)}
    concrete = _local_leaves(model, concrete)
    tp = mesh.size()
    regions = find_regions(model, concrete, tp, num_heads, calls)
    in_region = {lin: r for r in regions for lin in (*r.colwise, *r.rowwise)}
    ties = _ties(model)
    plan: dict[str, ParallelStyle] = {}
    vocab_head = False
    seq = Shard(SEQ_DIM) if sequence_parallel else Replicate()
    for name, style_name in concrete.items():
        module = model.get_submodule(name)
        region = in_region.get(name)
        if region is not None and style_name == "colwise":
            plan[name] = LocalColwise(region.splits.get(name, ()))
        elif region is not None:
            plan[name] = LocalRowwise(seq)
        elif (style := style_for(style_name, module, sequence_parallel, name in layers)) is not None:
            plan[name] = style
        if style_name == "vocab" and not isinstance(module, nn.Embedding):
            vocab_head = True
    if plan:
        parallelize_module(model, mesh, plan)
    for name in modified_in_place:
        if concrete.get(name) == "rowwise":
            model.get_submodule(name).register_forward_hook(_fresh_output)
    shared = _SharedInput()
    for region in regions:
        region.install(model, mesh, seq, shared)
    _retie(model, ties, set(concrete))
    if sequence_parallel and sequence_start is not None:
        _scatter_sequence(model, sequence_start, mesh)
        _sequence_dropout(model, list(layers), sequence_start, mesh)
    return vocab_head


def _fresh_output(_m: nn.Module, _args: tuple, out: Any) -> Any:
    return out.clone() if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) else out


# ------------------------------------------------------------------------------------------------------ regions


@dataclass
class Region:
    """An attention or MLP module whose colwise linears all read its input; see the module docstring."""

    fqn: str
    colwise: list[str]  # FQNs in the model
    rowwise: list[str]
    splits: dict[str, tuple[int, ...]] = field(default_factory=dict)  # colwise FQN -> the chunks its output is cut in
    attrs: dict[str, int] = field(default_factory=dict)  # attribute -> per-rank value
    proxy_width: int | None = None  # the module sees an input of this width (shape queries only)
    heads: tuple[int, ...] = ()  # heads of each attention call's q, k, v, unsharded
    dropouts: tuple[DropoutShard, ...] = ()  # how each F.dropout call's input is sharded, in call order
    head_params: tuple[tuple[str, int], ...] = ()  # parameters of P with one entry per head: (name, head dim)

    def install(self, model: nn.Module, mesh: DeviceMesh, seq: Placement, shared: _SharedInput | None = None) -> None:
        module = model.get_submodule(self.fqn)
        _own_settings(module, self.attrs)
        for name, value in self.attrs.items():
            _set_attr(module, name, value)
        if self.head_params:
            _shard_head_params(module, self.head_params, mesh)
        state = _RegionInput(mesh, seq, self.proxy_width, shared or _SharedInput())
        module.register_forward_pre_hook(state.prepare, with_kwargs=True)
        module.register_forward_hook(state.clear)
        _draw_dropout_as_one_device(module, self.dropouts, mesh, state)
        if self.proxy_width is not None:
            for fqn in self.colwise:
                model.get_submodule(fqn).register_forward_pre_hook(state.swap, prepend=True)


def _shard_head_params(module: nn.Module, head_params: tuple[tuple[str, int], ...], mesh: DeviceMesh) -> None:
    """Parameters with one entry per attention head that P reads itself (GPT-OSS's attention `sinks`): each rank
    holds its heads' entries (a Shard(dim) DTensor, the heads the colwise linears give it), and P's forward sees
    them as a local tensor, as its attention runs on local heads; their gradients need no tp reduction."""
    for name, dim in head_params:
        value = module._parameters[name]
        assert value is not None
        shard = distribute_tensor(value.detach(), mesh, [Shard(dim)])
        module.register_parameter(name, nn.Parameter(shard, requires_grad=value.requires_grad))
    _local_params_while_called(module, [name for name, _ in head_params])  # each rank's own entries: no reduction


def _per_head_params(module: nn.Module, heads: tuple[int, ...]) -> tuple[tuple[str, int], ...]:
    """P's own parameters (not its linears') with a dimension of the query head count: candidates for a per-head
    split (the first such dimension)."""
    if not heads:
        return ()
    out = []
    for name, value in module._parameters.items():
        if value is not None and heads[0] in value.shape:
            out.append((name, list(value.shape).index(heads[0])))
    return tuple(out)


@contextlib.contextmanager
def _heads_split(module: nn.Module, head_params: tuple[tuple[str, int], ...], tp: int) -> Any:
    """For one trial run: P's per-head parameters at their per-rank size (meta tensors; shapes are what count)."""
    kept = {name: module._parameters[name] for name, _ in head_params}
    try:
        for name, dim in head_params:
            value = kept[name]
            assert value is not None
            shape = list(value.shape)
            shape[dim] //= tp
            module._parameters[name] = nn.Parameter(torch.empty(shape, dtype=value.dtype, device="meta"))
        yield
    finally:
        module._parameters.update(kept)


def _input_keyword(kwargs: dict) -> str | None:
    """The keyword a module called with keywords only takes its input by: `hidden_states` (Hugging Face), else the
    first floating-point tensor."""
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "hidden_states"
    return next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()), None)


class _SharedInput:
    """The last region input prepared in this stage and what it was prepared into, both held weakly: regions that
    read the same tensor (GPT-J's and Phi-2's attention and MLP, in parallel off one norm) share one all-gather
    under SP (one reduce-scatter of the summed gradient backward), or one all-reduce of the gradient without it,
    as the cost model's shared gather prices."""

    def __init__(self) -> None:
        self.key: weakref.ref | None = None
        self.value: weakref.ref | None = None

    def get(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.key is None or self.value is None or self.key() is not x:
            return None
        return self.value()

    def put(self, x: torch.Tensor, prepared: torch.Tensor) -> None:
        self.key, self.value = weakref.ref(x), weakref.ref(prepared)


class _RegionInput:
    """Per-region forward state: the prepared input, and the narrow view handed to the module in proxy mode."""

    def __init__(self, mesh: DeviceMesh, seq: Placement, proxy_width: int | None, shared: _SharedInput) -> None:
        self.mesh, self.seq, self.proxy_width, self.shared = mesh, seq, proxy_width, shared
        self.full: DTensor | None = None
        self.proxy: torch.Tensor | None = None
        self.seq_len: int | None = None  # the region input's global sequence length (for dropout shards)
        # weak: a non-reentrant checkpoint's recompute stops early, before `clear` runs, and a strong reference
        # would keep the gathered input alive through the backward
        self.prepared: weakref.ref | None = None  # what the module got as its input
        self.local: weakref.ref | None = None  # under SP: the input as it came, this rank's sequence chunk

    def prepare(self, _m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        key = None if args else _input_keyword(kwargs)
        x = args[0] if args else kwargs.get(key) if key is not None else None
        if not isinstance(x, torch.Tensor):
            raise PlanFileError("tensor parallelism: an attention / MLP module must take its input as a tensor")
        kind = x.device.type
        self.local = None
        if isinstance(self.seq, Shard):
            self.local = weakref.ref(x)  # a DTensor's local view is taken when read (a fresh object dies at once)
        came = x
        cast = torch.is_autocast_enabled(kind) and x.is_floating_point()
        reused = self.shared.get(came)
        if reused is not None and (not cast or reused.dtype == torch.get_autocast_dtype(kind)):
            x = reused
        else:
            if cast:  # gather in the dtype the linears compute in
                x = x.to(torch.get_autocast_dtype(kind))
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, self.mesh, [self.seq], run_check=False)
            if tuple(x.placements) != (Replicate(),):
                x = x.redistribute(self.mesh, [Replicate()])
            self.shared.put(came, x)
        self.seq_len = x.shape[SEQ_DIM] if x.dim() > SEQ_DIM else None
        if self.proxy_width is not None:
            self.full = x
            x = self.proxy = x.to_local().detach().narrow(-1, 0, self.proxy_width)
        self.prepared = weakref.ref(x)
        if key is not None:
            return args, {**kwargs, key: x}
        return (x, *args[1:]), kwargs

    def swap(self, _m: nn.Module, inputs: tuple) -> tuple | None:
        if inputs and self.proxy is not None and inputs[0] is self.proxy:
            return (self.full, *inputs[1:])
        return None

    def clear(self, *_: Any) -> None:
        self.full = self.proxy = self.prepared = self.local = None

    def residual(self, args: tuple, kwargs: dict, tp: int) -> tuple[tuple, dict]:
        """Under SP, an op that mixes the module's (gathered) input with a tensor of this rank's sequence chunk
        (HF BERT adds its attention module's input to the reduce-scattered output inside the module) reads the
        input as it came: this rank's chunk, in its own dtype, as one device reads it; its gradient reaches the
        input directly. No such op: the arguments unchanged."""
        full = self.prepared() if self.prepared is not None else None
        local = self.local() if self.local is not None else None
        if isinstance(local, DTensor):
            local = local.to_local() if tuple(local.placements) == (self.seq,) else None
        if full is None or local is None or full.dim() <= SEQ_DIM:
            return args, kwargs
        flat = [*args, *kwargs.values()]
        if not any(a is full for a in flat):
            return args, kwargs
        n = full.shape[SEQ_DIM] // tp
        if not any(
            isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.dim() > SEQ_DIM and a.shape[SEQ_DIM] == n
            for a in flat
        ):
            return args, kwargs
        return tuple(local if a is full else a for a in args), {k: local if v is full else v for k, v in kwargs.items()}


def find_regions(
    model: nn.Module, concrete: dict[str, str], tp: int, num_heads: int | None, calls: dict[str, Any] | None = None
) -> list[Region]:
    """The regions of the model with their per-rank settings; settings are shared by modules of one shape."""
    by_parent = _region_parents(model, concrete)
    regions = []
    cache: dict[Any, Region | None] = {}
    for parent, (col, row) in by_parent.items():
        if not parent or not col or not row or _is_block(model, parent):
            continue
        module = model.get_submodule(parent)
        key = (type(module), _int_attrs(module), tuple(features(model.get_submodule(n)) for n in col + row))
        if key not in cache:
            rel = len(parent) + 1
            call = (calls or {}).get(parent)
            cache[key] = settle_region(module, parent, [n[rel:] for n in col], [n[rel:] for n in row], tp, call)
        found = cache[key]
        if found is None:
            continue
        if num_heads is not None and found.heads and found.heads[0] != num_heads:
            raise PlanFileError(
                f"plan.json: model.num_heads is {num_heads} but {parent} runs attention over {found.heads[0]} heads"
            )
        regions.append(
            Region(
                parent,
                col,
                row,
                {f"{parent}.{k}": v for k, v in found.splits.items()},
                found.attrs,
                found.proxy_width,
                found.heads,
                found.dropouts,
                found.head_params,
            )
        )
    return regions


def _region_parents(model: nn.Module, concrete: dict[str, str]) -> dict[str, tuple[list[str], list[str]]]:
    """Colwise and rowwise linears grouped by the module that runs them together: each linear's lowest ancestor
    that holds linears of both styles and is called (not a ModuleList / ModuleDict): GPT's attn for c_attn and c_proj,
    diffusers' FeedForward for net.0.proj (inside its GEGLU) and net.2. "" (the root) when none holds both."""
    styled = {n: s for n, s in concrete.items() if s in ("colwise", "rowwise") and is_linear(model.get_submodule(n))}

    def ancestors(name: str) -> list[str]:
        parts = name.split(".")
        return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]

    kinds: dict[str, set[str]] = {}
    for name, style in styled.items():
        for a in ancestors(name):
            kinds.setdefault(a, set()).add(style)
    out: dict[str, tuple[list[str], list[str]]] = {}
    for name, style in styled.items():
        parent = next(
            (
                a
                for a in ancestors(name)
                if len(kinds[a]) == 2 and not isinstance(model.get_submodule(a), (nn.ModuleList, nn.ModuleDict))
            ),
            "",
        )
        out.setdefault(parent, ([], []))[0 if style == "colwise" else 1].append(name)
    return out


def _is_block(model: nn.Module, fqn: str) -> bool:
    """An element of a ModuleList (a transformer block): its input is the residual, not a norm's output."""
    parent, _, last = fqn.rpartition(".")
    return last.isdigit() and isinstance(model.get_submodule(parent) if parent else model, nn.ModuleList)


def _int_attrs(module: nn.Module) -> tuple[tuple[str, int], ...]:
    """The module's public integer attributes, and those of a plain object it holds (a Hugging Face config, which
    Phi-3's attention reads its head count from) as "owner.name"."""
    out = []
    for k, v in vars(module).items():
        if k.startswith("_"):
            continue
        if type(v) is int:
            out.append((k, v))
        elif _is_settings_object(v):
            out += [(f"{k}.{a}", w) for a, w in vars(v).items() if type(w) is int and not a.startswith("_")]
    return tuple(sorted(out))


def _is_settings_object(v: Any) -> bool:
    return (
        hasattr(v, "__dict__")
        and not isinstance(v, (nn.Module, torch.Tensor, type))
        and not callable(v)
        and type(v).__module__ != "builtins"
    )


def _set_attr(module: nn.Module, name: str, value: int) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(getattr(module, owner) if owner else module, leaf, value)


def _own_settings(module: nn.Module, names: Collection[str]) -> None:
    """Give `module` its own copy of each object a per-rank attribute lives in: the config object is shared by
    every layer (and the model), and only this region's view of it takes per-rank head counts."""
    import copy

    for owner in {n.rpartition(".")[0] for n in names if "." in n}:
        setattr(module, owner, copy.copy(getattr(module, owner)))


# ------------------------------------------------------------------------------------------- the region check


class _Recorder(TorchFunctionMode):
    """Records attention calls (SDPA, 4-D matmuls), splits of colwise outputs, and non-shape reads of a proxy."""

    SHAPE_READS = frozenset(
        {
            torch.Tensor.size,
            torch.Tensor.dim,
            torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
            torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
            torch.Tensor.device.__get__,  # type: ignore[attr-defined]
            torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
            torch.Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
        }
    )
    SPLITS = frozenset({torch.Tensor.split, torch.split, torch.Tensor.chunk, torch.chunk, torch.Tensor.tensor_split})
    MATMULS = frozenset({torch.Tensor.__matmul__, torch.matmul, torch.Tensor.matmul})
    SLICES = frozenset({torch.Tensor.__getitem__, torch.Tensor.narrow, torch.narrow})

    def __init__(self, proxy: torch.Tensor | None = None) -> None:
        super().__init__()
        self.attention: list[tuple[int, ...]] = []
        self.outputs: dict[int, tuple[str, torch.Tensor]] = {}  # id of a colwise output -> (its linear, it)
        self.splits: dict[str, list[int]] = {}
        self.slices: dict[str, set[tuple[int, int]]] = {}  # colwise output -> [start, stop) of last-dim slices
        self.outputs_width: dict[str, int] = {}
        self.dropouts: list[tuple[int, ...]] = []  # input shape of each F.dropout call, in order
        self.proxy = proxy
        self.proxy_read = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.proxy is not None and func not in self.SHAPE_READS:
            flat = list(args) + list(kwargs.values())
            flat += [a for x in flat if isinstance(x, (list, tuple)) for a in x]
            if any(x is self.proxy for x in flat):
                self.proxy_read = True
        out = func(*args, **kwargs)
        if func is torch.nn.functional.dropout and args and isinstance(args[0], torch.Tensor):
            self.dropouts.append(tuple(args[0].shape))
        elif func is torch.nn.functional.scaled_dot_product_attention:
            self.attention += [tuple(t.shape) for t in args[:3]]
        elif func in self.MATMULS and all(isinstance(a, torch.Tensor) and a.dim() == 4 for a in args[:2]):
            self.attention += [tuple(a.shape) for a in args[:2]]
        elif func in self.SPLITS and args and id(args[0]) in self.outputs and isinstance(out, (list, tuple)):
            dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
            if dim in (-1, args[0].dim() - 1):
                self.splits[self.outputs[id(args[0])][0]] = [t.shape[-1] for t in out]
        elif func in self.SLICES and args and id(args[0]) in self.outputs:
            cut = _last_dim_slice(func, args, kwargs)
            if cut is not None:
                self.slices.setdefault(self.outputs[id(args[0])][0], set()).add(cut)
        return out

    def chunks(self) -> dict[str, list[int]]:
        """How each colwise output is cut along its features: split / chunk sizes, or the widths of slices that
        tile it (Phi-3's `qkv[..., :q]`, `qkv[..., q:q + kv]`, `qkv[..., q + kv:]`)."""
        out = dict(self.splits)
        for name, cuts in self.slices.items():
            ordered = sorted(cuts)
            width = self.outputs_width.get(name)
            tiles = ordered[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ordered, ordered[1:]))
            if name not in out and tiles and ordered[-1][1] == width and len(ordered) > 1:
                out[name] = [b - a for a, b in ordered]
        return out


def _last_dim_slice(func: Any, args: tuple, kwargs: dict) -> tuple[int, int] | None:
    """[start, stop) of a getitem / narrow that cuts only the last dimension of args[0], else None."""
    x = args[0]
    width = x.shape[-1]
    if func is torch.Tensor.__getitem__:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if not index or not isinstance(index[-1], slice) or index[-1].step not in (None, 1):
            return None
        rest = index[:-1]
        whole = all(i is Ellipsis or i == slice(None) for i in rest)
        if not whole or (Ellipsis not in rest and len(index) != x.dim()):
            return None
        start, stop, _ = index[-1].indices(width)
        return (start, stop) if stop > start else None
    bound = {**dict(zip(("input", "dim", "start", "length"), args)), **kwargs}
    dim, start, length = bound.get("dim"), bound.get("start"), bound.get("length")
    if dim not in (-1, x.dim() - 1) or not isinstance(start, int) or not isinstance(length, int):
        return None
    return (start % width, start % width + length)


def _stub(module: nn.Module, name: str, out_features: int, rec: dict[str, Any], recorder: _Recorder | None) -> None:
    def forward(x: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        rec.setdefault(name, []).append(x)
        y = torch.empty(*x.shape[:-1], out_features, device=x.device, dtype=x.dtype)
        if recorder is not None:
            recorder.outputs[id(y)] = (name, y)  # kept alive, so its id is not reused
            recorder.outputs_width[name] = out_features
        return y

    module.forward = forward  # an instance attribute: nn.Module.__call__ finds it first


def _unstub(modules: list[nn.Module]) -> None:
    for m in modules:
        m.__dict__.pop("forward", None)


@contextlib.contextmanager
def _quiet_fake_errors() -> Any:
    """FakeTensorMode logs every failing op at error level; here a failure only rules a candidate setting out."""
    import logging

    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _fake_mode() -> contextlib.AbstractContextManager:
    from torch._guards import active_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    return contextlib.nullcontext() if active_fake_mode() is not None else FakeTensorMode(allow_non_fake_inputs=True)


@dataclass
class _Run:
    ok: bool
    inputs: dict[str, list[torch.Tensor]]
    recorder: _Recorder
    output: tuple[int, ...] = ()
    x: torch.Tensor | None = None


def _run(
    module: nn.Module,
    col: list[str],
    row: list[str],
    tp: int,
    width: int,
    proxy_width: int | None,
    call: Any = None,
) -> _Run:
    """One fake forward of `module` with linears stubbed: per-rank output widths when tp > 1. `call`: the recorded
    (args, kwargs) to call it with (its input of width `width` replaced by the check's), else the input alone."""
    mods = [module.get_submodule(n) for n in col + row]
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    inputs: dict[str, list[torch.Tensor]] = {}
    with _fake_mode(), torch.no_grad():
        leaves, tree, hidden = _recorded_call(call, width)
        shape = (1, CHECK_SEQ) if hidden is None else tuple(leaves[hidden].shape[:-1])
        x = torch.empty(*shape, width, device=device)
        arg = x if proxy_width is None else torch.empty(*shape, proxy_width, device=device)
        call_args: tuple = (arg,)
        call_kwargs: dict[str, Any] = {}
        if hidden is not None:
            made = [
                arg if i == hidden else torch.empty(v.shape, dtype=v.dtype, device=device) if _is_spec(v) else v
                for i, v in enumerate(leaves)
            ]
            call_args, call_kwargs = pytree.tree_unflatten(made, tree)
        recorder = _Recorder(arg if proxy_width is not None else None)
        for n, m in zip(col, mods):
            _stub(m, n, features(m)[1] // tp, inputs, recorder)
        for n, m in zip(row, mods[len(col) :]):
            _stub(m, n, features(m)[1], inputs, None)
        try:
            with recorder, _quiet_fake_errors():
                out = module(*call_args, **call_kwargs)
        except Exception:  # any failure of the user's code under this setting rules the setting out
            return _Run(False, inputs, recorder)
        finally:
            _unstub(mods)
    out = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(out, torch.Tensor):
        return _Run(False, inputs, recorder)
    return _Run(True, inputs, recorder, tuple(out.shape), arg)


def _is_spec(x: Any) -> bool:
    from mlm.runtime.model_build import TensorSpec

    return isinstance(x, TensorSpec)


def _recorded_call(call: Any, width: int) -> tuple[list[Any], Any, int | None]:
    """The recorded call's leaves, its tree, and which leaf is the region's input (the first floating tensor of
    at least 2 dimensions whose last is `width`); no recorded input: ([], None, None)."""
    if call is None:
        return [], None, None
    leaves, tree = pytree.tree_flatten(call)
    for i, v in enumerate(leaves):
        if _is_spec(v) and v.dtype.is_floating_point and len(v.shape) >= 2 and v.shape[-1] == width:
            return leaves, tree, i
    return [], None, None


def settle_region(
    module: nn.Module, fqn: str, col: list[str], row: list[str], tp: int, call: Any = None
) -> Region | None:
    """The per-rank setting of one region (attributes relative to `module`), None when it is no region (its
    colwise linears do not all read its input). Raises a one-line error when no setting runs per head."""
    width = features(module.get_submodule(col[0]))[0]
    ref = _run(module, col, row, 1, width, None, call)
    if not ref.ok or any(not all(t is ref.x for t in ref.inputs.get(n, [])) or n not in ref.inputs for n in col):
        return None
    heads = tuple(s[-3] for s in ref.recorder.attention)
    for h in dict.fromkeys(heads):
        if h % tp:
            kind = "attention heads" if h == heads[0] else "key/value heads (grouped-query attention)"
            raise Infeasible(f"tp={tp} does not divide the {h} {kind} of {fqn}; pick a tp dividing {h}")
    splits: dict[str, tuple[int, ...]] = {}
    for name, sizes in ref.recorder.chunks().items():
        if any(c % tp for c in sizes):
            raise Infeasible(f"tensor parallelism: tp={tp} does not divide the chunks {sizes} of {fqn}.{name}")
        splits[name] = tuple(sizes)
    want = [tuple(d // tp if i == len(s) - 3 else d for i, d in enumerate(s)) for s in ref.recorder.attention]
    widths = {features(module.get_submodule(n))[1] for n in col} | {features(module.get_submodule(n))[0] for n in row}
    widths |= {c for sizes in splits.values() for c in sizes}
    values = set(heads) | widths | {width}
    # a key/value head count divides the query heads; the model may repeat K/V to the query heads before the
    # attention call (Falcon), so the call does not show it
    kv = {v for _, v in _int_attrs(module) if heads and 1 < v < heads[0] and heads[0] % v == 0}
    # attributes of a held settings object (a config shared by the whole model) only where they count heads
    cands = [
        k for k, v in _int_attrs(module) if v in (values | kv if "." not in k else set(heads) | kv) and v % tp == 0
    ]
    original = dict(_int_attrs(module))
    proxies = [None] + ([width // tp] if width % tp == 0 else [])
    per_head = _per_head_params(module, heads)
    # whole first (every model before GPT-OSS's sinks runs so); split only where whole parameters cannot run
    splits_of_params = [(), per_head] if per_head else [()]
    subsets = [subset for k in range(len(cands) + 1) for subset in itertools.combinations(cands, k)]
    for proxy, head_params, subset in itertools.product(proxies, splits_of_params, subsets):
        attrs = {a: original[a] // tp for a in subset}
        try:
            for a, v in attrs.items():
                _set_attr(module, a, v)
            with _heads_split(module, head_params, tp):
                run = _run(module, col, row, tp, width, proxy, call)
        finally:
            for a in subset:
                _set_attr(module, a, original[a])
        if _consistent(run, ref, want, col, row, module, tp):
            dropouts = _dropout_shards(ref, run, tp)
            return Region(fqn, col, row, splits, attrs, proxy, heads, dropouts, head_params)
    raise PlanFileError(
        f"tensor parallelism: no per-rank setting of {type(module).__name__} {fqn}'s integer attributes "
        f"({', '.join(cands) or 'none'}) runs it on {heads[0] // tp if heads else '1/tp of its'} heads per rank; "
        f"give its linears style 'replicate' or compute head counts from tensor shapes"
    )


def _consistent(
    run: _Run, ref: _Run, want: list[tuple[int, ...]], col: list[str], row: list[str], module: nn.Module, tp: int
) -> bool:
    if not run.ok or run.output != ref.output or run.recorder.proxy_read or run.recorder.attention != want:
        return False
    if any(len(run.inputs.get(n, [])) != len(ref.inputs.get(n, [])) for n in col + row):
        return False
    if any(not all(t is run.x for t in run.inputs[n]) for n in col):
        return False
    return all(t.shape[-1] * tp == features(module.get_submodule(n))[0] for n in row for t in run.inputs[n])


# ------------------------------------------------------------------------------------------- region dropout


@dataclass(frozen=True)
class DropoutShard:
    """How one F.dropout call of a region sees its input on a rank: `dim` split over tp (attention heads), or
    `seq_dims` that hold the sequence (split when sequence parallelism reduce-scatters the rowwise output)."""

    dim: int | None = None
    seq_dims: tuple[int, ...] = ()


def _dropout_shards(ref: _Run, run: _Run, tp: int) -> tuple[DropoutShard, ...]:
    """Compare the unsharded and the per-rank region check: the dim each dropout input lost a factor tp on."""
    if len(ref.recorder.dropouts) != len(run.recorder.dropouts):
        return ()
    out = []
    for full, local in zip(ref.recorder.dropouts, run.recorder.dropouts):
        diff = [i for i, (a, b) in enumerate(zip(full, local)) if a != b]
        if len(full) == len(local) and len(diff) == 1 and local[diff[0]] * tp == full[diff[0]]:
            out.append(DropoutShard(dim=diff[0]))
        else:
            seq = ref.x.shape[SEQ_DIM] if ref.x is not None and ref.x.dim() > SEQ_DIM else CHECK_SEQ
            out.append(DropoutShard(seq_dims=tuple(i for i, d in enumerate(full) if d == seq)))
    return tuple(out)


def _draw_dropout_as_one_device(
    module: nn.Module, shards: tuple[DropoutShard, ...], mesh: DeviceMesh, state: _RegionInput
) -> None:
    """Run the region's forward under _RegionDropout (an instance forward wrapping the class's, so a raised error
    cannot leave the mode pushed)."""
    forward = module.forward

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _RegionDropout(shards, mesh, state):
            return forward(*args, **kwargs)

    module.forward = wrapped


class _RegionDropout(TorchFunctionMode):
    """Dropout inside a region, on tensors that hold this rank's heads or sequence chunk (docs/semantics.md).

    On CPU each sharded dropout draws the mask of the whole (unsharded) activation from the generator DropoutSeeds
    seeded, exactly as one device draws it, and keeps this rank's slice: the masks are one device's, and every tp
    rank's generator advances as one device's does, so later draws on replicated activations stay equal on all tp
    ranks. SDPA with dropout_p > 0 is computed as the math kernel computes it (softmax, the sliced mask, @ v).
    The whole mask costs tp x the local one, transiently: fine on CPU, where this is for exactness.
    On CUDA the fused kernels keep their own RNG: a sharded dropout draws from a generator forked and seeded per tp
    rank (Megatron's model-parallel RNG tracker), so head shards get independent masks and the default generator,
    which replicated dropouts use, is left where it was on every rank. Under fake tensors (the dry run) nothing is
    changed, so the dry run allocates what the device's kernels allocate.
    No hand-written code exists for this in torch: DTensor's RNG tracker covers DTensors on CUDA only, and these
    are local tensors."""

    def __init__(self, shards: tuple[DropoutShard, ...], mesh: DeviceMesh, state: _RegionInput) -> None:
        super().__init__()
        self.shards, self.state = shards, state
        self.tp, self.rank = mesh.size(), mesh.get_local_rank()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in _Recorder.SHAPE_READS:
            args, kwargs = self.state.residual(args, kwargs, self.tp)
        if func is torch.nn.functional.dropout:
            return self._dropout(func, args, kwargs)
        if func is torch.nn.functional.scaled_dot_product_attention:
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            q = args[0]
            if p > 0 and isinstance(q, torch.Tensor) and not isinstance(q, DTensor) and not is_fake(q):
                return self._sdpa(func, args, kwargs, p)
        return func(*args, **kwargs)

    def _dropout(self, func: Any, args: tuple, kwargs: dict) -> Any:
        x, p, training = _dropout_args(args, kwargs)
        k = self.calls
        self.calls += 1
        if not training or p == 0 or isinstance(x, DTensor) or is_fake(x) or k >= len(self.shards):
            return func(*args, **kwargs)
        dim = self._sharded_dim(self.shards[k], x)
        if dim is None:
            return func(*args, **kwargs)
        return _sharded_dropout(func, args, kwargs, dim, self.tp, self.rank, self.calls)

    def _sharded_dim(self, shard: DropoutShard, x: torch.Tensor) -> int | None:
        if shard.dim is not None and shard.dim < x.dim():
            return shard.dim
        seq = self.state.seq_len
        for d in shard.seq_dims:
            if seq is not None and d < x.dim() and x.shape[d] * self.tp == seq and x.shape[d] != seq:
                return d
        return None

    def _sdpa(self, func: Any, args: tuple, kwargs: dict, p: float) -> torch.Tensor:
        """Attention of this rank's heads with one device's dropout mask (the math kernel's formula)."""
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = {**dict(zip(names, args)), **kwargs}
        q, k, v = bound["query"], bound["key"], bound["value"]
        if q.device.type != "cpu":
            with _rank_generator(q.device, self.rank, self.calls):
                return func(*args, **kwargs)
        if k.shape[-3] != q.shape[-3]:  # grouped-query attention: as enable_gqa repeats the key/value heads
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        scale = bound.get("scale") or q.shape[-1] ** -0.5
        scores = (q @ k.transpose(-2, -1)) * scale
        s, t = scores.shape[-2:]
        mask = bound.get("attn_mask")
        if bound.get("is_causal"):
            causal = torch.ones(s, t, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(causal.logical_not(), float("-inf"))
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(mask.logical_not(), float("-inf"))
        elif mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1)
        whole = list(probs.shape)
        whole[-3] *= self.tp
        keep = torch.nn.functional.dropout(torch.ones(whole, dtype=probs.dtype, device=probs.device), p, True)
        keep = keep.narrow(-3, self.rank * probs.shape[-3], probs.shape[-3])
        return (probs * keep) @ v


@contextlib.contextmanager
def _rank_generator(device: torch.device, rank: int, calls: int) -> Any:
    """A generator forked from the default one and seeded per tp rank and call (Megatron's model-parallel RNG)."""
    import hashlib

    base = torch.cuda.initial_seed() if device.type == "cuda" else torch.initial_seed()
    key = f"{base}/{rank}/{calls}".encode()
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)
    with torch.random.fork_rng(devices=[device], device_type=device.type):
        torch.manual_seed(seed)
        yield


class _SequenceDropout(TorchFunctionMode):
    """Dropout in a layer on the sequence-parallel stretch (from the first sequence-sharded block to the head)
    whose input is this rank's sequence chunk (its sequence dimension as long as the layer input's): BERT's and
    T5's dropouts after a rowwise linear outside any region. On CPU the mask of the whole sequence is drawn, as one
    device draws it, and the rank keeps its chunk; on CUDA a generator forked per tp rank draws the chunk's mask
    (as _RegionDropout does). Region dropouts are handled by _RegionDropout, inside this mode: they reach here with
    tensors of the whole sequence or of the rank's heads, and pass."""

    def __init__(self, mesh: DeviceMesh, chunk: int) -> None:
        super().__init__()
        self.tp, self.rank, self.chunk = mesh.size(), mesh.get_local_rank(), chunk
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.dropout:
            return func(*args, **kwargs)
        x, p, training = _dropout_args(args, kwargs)
        sharded = isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and not is_fake(x)
        if not (sharded and training and p > 0 and x.dim() > SEQ_DIM and x.shape[SEQ_DIM] == self.chunk):
            return func(*args, **kwargs)
        self.calls += 1
        return _sharded_dropout(func, args, kwargs, SEQ_DIM, self.tp, self.rank, self.calls)


def _dropout_args(args: tuple, kwargs: dict) -> tuple[Any, float, bool]:
    """(input, p, training) of an F.dropout call."""
    bound = {**dict(zip(("input", "p", "training", "inplace"), args)), **kwargs}
    return bound["input"], bound.get("p", 0.5), bound.get("training", True)


def _sharded_dropout(func: Any, args: tuple, kwargs: dict, dim: int, tp: int, rank: int, calls: int) -> Any:
    """F.dropout on this rank's 1/tp of `dim`: on CPU one device's mask of the whole tensor, this rank's slice
    kept; elsewhere the device's own kernel under a generator forked per rank and call."""
    x, p, _ = _dropout_args(args, kwargs)
    if x.device.type != "cpu":
        with _rank_generator(x.device, rank, calls):
            return func(*args, **kwargs)
    whole = list(x.shape)
    whole[dim] *= tp
    mask = func(torch.ones(whole, dtype=x.dtype, device=x.device), p, True)
    return x * mask.narrow(dim, rank * x.shape[dim], x.shape[dim])


def _sequence_dropout(model: nn.Module, layers: list[str], start: str, mesh: DeviceMesh) -> None:
    """Run each plan layer of this stage from the one holding `start` (the first sequence-sharded module) on under
    _SequenceDropout, with the layer input's sequence length as the chunk."""
    first = next((i for i, n in enumerate(layers) if start == n or start.startswith(n + ".")), None)
    if first is None:
        return
    for name in layers[first:]:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        if isinstance(module, _FOREIGN):
            continue
        forward = module.forward

        def wrapped(*args: Any, __forward: Any = forward, **kwargs: Any) -> Any:
            x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            if not isinstance(x, torch.Tensor) or x.dim() <= SEQ_DIM or isinstance(x, DTensor):
                return __forward(*args, **kwargs)
            with _SequenceDropout(mesh, x.shape[SEQ_DIM]):
                return __forward(*args, **kwargs)

        module.forward = wrapped


def is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


# ------------------------------------------------------------------------------------------- region styles


def _shard_place(dim: int, split_factor: int) -> Placement:
    return Shard(dim) if split_factor == 1 else _StridedShard(dim, split_factor=split_factor)


def chunk_row_order(chunks: tuple[int, ...], tp: int) -> torch.Tensor:
    """Rows of a fused output cut into unequal chunks (Phi-3's q | k | v with fewer key/value heads), reordered so
    that contiguous block r of tp holds rows r of every chunk: out[i] is the original row of reordered row i."""
    starts = [sum(chunks[:i]) for i in range(len(chunks))]
    return torch.cat(
        [torch.arange(a + r * (c // tp), a + (r + 1) * (c // tp)) for r in range(tp) for a, c in zip(starts, chunks)]
    )


class LocalColwise(ParallelStyle):
    """Column-parallel nn.Linear / Conv1D inside a region: input a Replicate DTensor (prepared by the region),
    output this rank's local columns. An output cut into k equal chunks has each chunk sharded separately (a
    _StridedShard(split_factor=k) placement, so the global parameter keeps its layout). Unequal chunks have no
    DTensor placement: the parameter's rows are reordered (chunk_row_order) and plainly sharded, and the order is
    kept on the module (model_build.ROW_ORDER) for everything that reads or writes global values: initialisation,
    gathers, checkpoints."""

    def __init__(self, chunks: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.chunks = chunks

    def _partition(self, _name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        from mlm.runtime.model_build import ROW_ORDER

        wdim = 1 if is_conv1d(module) else 0
        equal = len(set(self.chunks)) <= 1
        order = None if equal else chunk_row_order(self.chunks, mesh.size())
        split_factor = len(self.chunks) if equal and self.chunks else 1
        for leaf, dim in (("weight", wdim), ("bias", 0)):
            value = getattr(module, leaf, None)
            if value is None:
                continue
            requires_grad = value.requires_grad
            if order is not None:
                value = value.detach().index_select(dim, order.to(value.device))
                module.__dict__.setdefault(ROW_ORDER, {})[leaf] = (dim, order)
            t = distribute_tensor(value.detach(), mesh, [_shard_place(dim, split_factor)])
            module.register_parameter(leaf, nn.Parameter(t, requires_grad=requires_grad))

    @staticmethod
    def _input(_mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        elif tuple(x.placements) != (Replicate(),):
            x = x.redistribute(mesh, [Replicate()])
        return (x, *inputs[1:])

    @staticmethod
    def _output(_mod: nn.Module, out: Any, _mesh: DeviceMesh) -> Any:
        return out.to_local() if isinstance(out, DTensor) else out

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._input, self._output)


class LocalRows(ParallelStyle):
    """A module that runs on this rank's own token rows under sequence parallelism, with replicated weights (an MoE
    router reading batch and sequence flattened into rows, a bank of routed experts): every parameter, its
    submodules' too, a Replicate DTensor (one global value); the forward runs on plain local tensors, so every op
    runs as in one process (top-k, index_add, grouped GEMMs, calls with several tensor arguments, tuple outputs):
    around each call of a module holding parameters (the bank itself, or each expert of an nn.ModuleList, which
    the list never calls) its weights are seen as to_local(grad_placements=[Partial()]), so the gradient from this
    rank's rows is a partial sum that DTensor all-reduces over tp, as it does the sequence-parallel norms'. (Style
    "heads", torch's SequenceParallel, claims one input sharded and needs DTensor rules for every op inside.)"""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for sub in module.modules():
            names = [name for name, p in sub._parameters.items() if p is not None]
            for name in names:
                value = sub._parameters[name]
                assert value is not None
                if not isinstance(value, DTensor):
                    t = distribute_tensor(value.detach(), device_mesh, [Replicate()])
                    sub.register_parameter(name, nn.Parameter(t, requires_grad=value.requires_grad))
            if names:
                _local_params_while_called(sub, names, partial_grads=True)
        return module


def _local_params_while_called(module: nn.Module, names: list[str], partial_grads: bool = False) -> None:
    """During each call of `module`, its DTensor parameters `names` as local tensors (differentiable: the gradient
    reaches the DTensor, in its own placements, or as a partial sum over the mesh with `partial_grads`)."""
    held: list[tuple[str, Any]] = []
    grad_placements = [Partial()] if partial_grads else None

    def local(mod: nn.Module, _args: tuple) -> None:
        for name in names:  # the parameter as it is now (FSDP2 may have put its unsharded one in place)
            param = mod._parameters[name]
            held.append((name, param))
            if isinstance(param, DTensor):
                mod._parameters[name] = param.to_local(grad_placements=grad_placements)

    def restore(mod: nn.Module, _args: tuple, _out: Any) -> None:
        while held:
            name, param = held.pop()
            mod._parameters[name] = param

    module.register_forward_pre_hook(local)
    module.register_forward_hook(restore, always_call=True)


class LocalRowwise(ParallelStyle):
    """Row-parallel nn.Linear / Conv1D inside a region: local input sharded on features, local output reduced to
    `output_layout` (Replicate: all-reduce; Shard(seq): reduce-scatter)."""

    def __init__(self, output_layout: Placement) -> None:
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if is_conv1d(module):
            return Conv1DParallel(colwise=False, output_layout=self.output_layout)._apply(module, device_mesh)
        return RowwiseParallel(output_layouts=self.output_layout)._apply(module, device_mesh)


# ---------------------------------------------------------------------------------------------- ties, sequence


def _ties(model: nn.Module) -> list[list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [v for v in by_id.values() if len(v) > 1]


def _retie(model: nn.Module, ties: list[list[str]], styled: set[str]) -> None:
    """parallelize_module replaces each module's parameters; parameters tied inside one stage (wte/lm_head with
    pp == 1) must point at one tensor again. Their shardings must agree (both vocab-sharded or both replicated),
    among the modules the plan gives a style; an alias on a module it does not (T5's `shared`, never called: the
    model calls encoder.embed_tokens) takes the styled copy."""
    for group in ties:
        names = sorted(group, key=lambda n: n.rpartition(".")[0] not in styled)  # styled modules first
        first = model.get_parameter(names[0])
        for other in names[1:]:
            mod_name, _, attr = other.rpartition(".")
            current = model.get_parameter(other)
            if current is first:
                continue
            aligned = _placements(current) == _placements(first) and current.shape == first.shape
            if not aligned and mod_name in styled:
                raise PlanFileError(
                    f"plan.json: tied parameters {names[0]} and {other} get different "
                    f"tensor_parallel shardings; give both modules the same style"
                )
            setattr(model.get_submodule(mod_name), attr, first)


def _placements(t: torch.Tensor) -> Any:
    return tuple(t.placements) if isinstance(t, DTensor) else None


def sequence_parallel_start(model: nn.Module, tp_map: dict[str, str]) -> str | None:
    """With sequence parallelism the embeddings produce full sequences and the sequence-sharded region starts at
    the first module with style "sequence" (in the full model), or at the transformer block enclosing it."""
    names = [n for n, _ in model.named_modules() if n]
    concrete = expand_tp_map(tp_map, names)
    seq_modules = [n for n, s in concrete.items() if s == "sequence"]
    if not seq_modules:
        return None
    first = min(seq_modules, key=names.index)
    return _enclosing_block(model, first) or first


def _scatter_sequence(model: nn.Module, target: str, mesh: DeviceMesh) -> None:
    """Split the hidden state (first argument) along the sequence at `target`, if this stage holds it. A
    differentiable redistribute, so the backward all-gathers the gradient. Registered after the stage's
    activation-injecting pre-hook, so it also applies to a received full-sequence activation."""
    try:
        module = model.get_submodule(target)
    except AttributeError:
        return
    if not any(True for _ in module.parameters()):
        return  # a placeholder or boundary of another stage

    def scatter(_m: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if isinstance(x, DTensor) or not isinstance(x, torch.Tensor):
            return args
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(SEQ_DIM)])
        return (x.to_local(),) + tuple(args[1:])

    module.register_forward_pre_hook(scatter)


def _enclosing_block(model: nn.Module, fqn: str) -> str | None:
    """The ancestor of `fqn` that is an element of a ModuleList (a transformer block), if any."""
    parts = fqn.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[: i - 1]) if i > 1 else ""
        parent_mod = model.get_submodule(parent) if parent else model
        if isinstance(parent_mod, nn.ModuleList) and parts[i - 1].isdigit():
            return ".".join(parts[:i])
    return None


class Conv1DParallel(ParallelStyle):
    """Column- or row-wise sharding of HF's Conv1D (weight (in, out)) outside regions, and row-wise inside them:
    colwise shards weight dim 1 and bias, rowwise shards weight dim 0. Input and output handling mirror
    ColwiseParallel / RowwiseParallel."""

    def __init__(self, colwise: bool, input_layout: Any = None, output_layout: Any = None) -> None:
        super().__init__()
        self.colwise = colwise
        self.input_layout = input_layout or (Replicate() if colwise else Shard(-1))
        self.output_layout = output_layout or (Shard(-1) if colwise else Replicate())

    def _partition(self, _name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        w_place = [Shard(1)] if self.colwise else [Shard(0)]
        b_place = [Shard(0)] if self.colwise else [Replicate()]
        module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, mesh, w_place)))
        if getattr(module, "bias", None) is not None:
            module.register_parameter("bias", nn.Parameter(distribute_tensor(module.bias, mesh, b_place)))

    def _input(self, _mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [self.input_layout], run_check=False)
        want = Replicate() if self.colwise else Shard(-1)
        if tuple(x.placements) != (want,):
            x = x.redistribute(mesh, [want])
        return (x,) + tuple(inputs[1:])

    def _output(self, _mod: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        if self.colwise:
            return out  # a DTensor sharded on the last dim (global shape; see module doc)
        out = out.redistribute(mesh, [self.output_layout]) if tuple(out.placements) != (self.output_layout,) else out
        return out.to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, self._partition, partial(_call_input, self._input), partial(_call_output, self._output)
        )


class VocabParallelEmbedding(ParallelStyle):
    """nn.Embedding with its table split by rows over tp (Megatron's VocabParallelEmbedding): each rank looks the
    ids up in its own rows (the others read row 0 and are zeroed) and the partial outputs are summed into
    `output_layout` (Replicate: all-reduce; Shard(seq): reduce-scatter, whose backward all-gathers).

    Written here because torch's RowwiseParallel on an embedding computes the weight's gradient as a Replicate
    DTensor, the whole vocabulary's gradient on every rank, before it is sliced to the shard (4008 MiB in fp32 for
    llama3-70b at tp 8, whose shard is 501 MiB; measured by mlm-run --dry-run). Here the backward is the local
    embedding's, so the gradient is the shard's own; the weight stays a Shard(0) DTensor (checkpoints, FSDP2)."""

    def __init__(self, output_layout: Placement) -> None:
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        assert isinstance(module, nn.Embedding)
        if module.num_embeddings < device_mesh.size():
            raise PlanFileError(f"plan.json: a {module.num_embeddings}-row embedding cannot be split over tp")
        w = distribute_tensor(module.weight, device_mesh, [Shard(0)])
        module.register_parameter("weight", nn.Parameter(w, requires_grad=module.weight.requires_grad))
        if type(module).forward is nn.Embedding.forward:
            module.forward = partial(_vocab_parallel_lookup, module, device_mesh, self.output_layout)  # type: ignore[method-assign]
            return module
        # a subclass with a forward of its own (Gemma scales the lookup by sqrt(hidden)) keeps it: its
        # super().forward reaches the vocabulary-parallel lookup, placed between it and nn.Embedding in the MRO
        module._mlm_vocab_parallel = (device_mesh, self.output_layout)  # type: ignore[assignment]
        cls = type(module)
        module.__class__ = type(cls.__name__, (cls, _VocabParallelLookup), {})
        return module


class _VocabParallelLookup(nn.Embedding):
    """nn.Embedding.forward replaced by the vocabulary-parallel lookup (see VocabParallelEmbedding)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        mesh, layout = self._mlm_vocab_parallel
        return _vocab_parallel_lookup(self, mesh, layout, input)


def _vocab_parallel_lookup(module: nn.Embedding, mesh: DeviceMesh, output_layout: Placement, ids: Any) -> Any:
    weight = module.weight
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    if isinstance(ids, DTensor):
        ids = ids.full_tensor()
    start = mesh.get_local_rank() * -(-module.num_embeddings // mesh.size())  # torch.chunk's rows per rank
    outside = (ids < start) | (ids >= start + local.shape[0])
    pad = module.padding_idx
    pad = pad - start if pad is not None and 0 <= pad - start < local.shape[0] else None
    out = nn.functional.embedding(
        (ids - start).masked_fill(outside, 0),
        local,
        pad,
        module.max_norm,
        module.norm_type,
        module.scale_grad_by_freq,
        module.sparse,
    )
    out = DTensor.from_local(out.masked_fill(outside.unsqueeze(-1), 0), mesh, [Partial()], run_check=False)
    return out.redistribute(mesh, [output_layout]).to_local()


def _call_input(fn: Any, mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return fn(mod, inputs, mesh)


def _call_output(fn: Any, mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    return fn(mod, outputs, mesh)


# ------------------------------------------------------------------ strided parameters outside the forward


def is_strided(t: torch.Tensor) -> bool:
    """A DTensor with a _StridedShard placement (per-head shards of a fused projection, or FSDP2 over them)."""
    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def gather_full(t: torch.Tensor) -> torch.Tensor:
    """The full tensor. torch 2.13 gathers (FSDP _StridedShard, TP _StridedShard) wrongly in one full_tensor();
    replicating the outer mesh dimensions first, one at a time, gives the right value."""
    if not isinstance(t, DTensor):
        return t
    placements = list(t.placements)
    for i in range(len(placements) - 1):
        if not isinstance(placements[i], Replicate):
            placements[i] = Replicate()
            t = t.redistribute(t.device_mesh, placements)
    return t.full_tensor()


def to_plain_shards(t: DTensor, order: tuple[int, torch.Tensor] | None = None) -> DTensor:
    """The same global value with every _StridedShard(d) replaced by Shard(d): one contiguous chunk per rank, which
    torch.distributed.checkpoint can describe (it writes overlapping chunks for _StridedShard); rows stored
    reordered (`order`, model_build.row_order) back in their original order. Collective."""
    from mlm.runtime.model_build import to_original_order

    plain = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in t.placements]
    full = to_original_order(gather_full(t), order)
    local = full
    coord = t.device_mesh.get_coordinate()
    for i, p in enumerate(plain):
        if isinstance(p, Shard):
            local = local.chunk(t.device_mesh.size(i), dim=p.dim)[coord[i]]
    return DTensor.from_local(local.contiguous(), t.device_mesh, plain, shape=full.shape, stride=full.stride())


def copy_from_plain_shards(dst: DTensor, src: DTensor, order: tuple[int, torch.Tensor] | None = None) -> None:
    """Write `src` (to_plain_shards' layout, e.g. as loaded from a checkpoint) into the DTensor `dst`."""
    from mlm.runtime.model_build import local_shard, to_stored_order

    with torch.no_grad():
        dst.to_local().copy_(local_shard(to_stored_order(src.full_tensor(), order), dst.device_mesh, dst.placements))
