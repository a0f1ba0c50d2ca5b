"""Apply the plan's tensor_parallel map to a stage with torch's parallelize_module.

Styles (module FQN or fnmatch pattern -> style):
  colwise   ColwiseParallel, output kept as a DTensor (use_local_output=False)
  rowwise   RowwiseParallel, local output (Replicate, or Shard(seq) with sequence parallelism)
  vocab     nn.Embedding: RowwiseParallel (vocabulary-sharded table, Replicate output);
            nn.Linear head: ColwiseParallel with a vocabulary-sharded DTensor output, consumed by loss_parallel()
  sequence  SequenceParallel (norms / dropout on sequence shards) when the layout has sequence_parallel, else none
  replicate nothing (parameters stay replicated over tp)

Why colwise outputs stay DTensors: user code hard-codes global sizes after projections (nanoGPT's
`q.view(B, T, self.n_head, C // self.n_head)`, `.split(self.n_embd)`, HF's `view(*shape[:-1], -1, head_dim)`).
On a DTensor those sizes are global, so the unedited model computes exactly what it computes on one device;
DTensor's sharding propagation inserts any collective needed. The same goes for SequenceParallel outputs, whose
global shape keeps `B, T, C = x.size()` right. HF GPT-2's Conv1D (a transposed Linear) gets the same styles with
the weight sharded along the other dimension; torch's styles accept only nn.Linear / nn.Embedding, which is the one
thing written by hand here.
"""

from __future__ import annotations

import fnmatch
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from mlm.planner.errors import PlanFileError
from mlm.runtime.stages import Boundary, Placeholder

SEQ_DIM = 1  # activations are (batch, seq, hidden)


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


def style_for(style: str, module: nn.Module, sequence_parallel: bool) -> ParallelStyle | None:
    seq = Shard(SEQ_DIM) if sequence_parallel else Replicate()
    if style == "replicate" or (style == "sequence" and not sequence_parallel):
        return None
    if style == "sequence":
        return SequenceParallel(sequence_dim=SEQ_DIM)
    if style == "vocab" and isinstance(module, nn.Embedding):
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style in ("colwise", "vocab"):
        if is_conv1d(module):
            return Conv1DParallel(colwise=True, input_layout=seq)
        return ColwiseParallel(input_layouts=seq, use_local_output=False)
    if style == "rowwise":
        if is_conv1d(module):
            return Conv1DParallel(colwise=False, output_layout=seq)
        if isinstance(module, nn.Embedding):
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        return RowwiseParallel(output_layouts=seq)
    raise PlanFileError(f"plan.json: unknown tensor_parallel style {style!r}")


def apply_tensor_parallel(
    model: nn.Module,
    tp_map: dict[str, str],
    mesh: DeviceMesh,
    sequence_parallel: bool,
    sequence_start: str | None = None,
) -> bool:
    """Parallelize the modules of `model` (one stage's copy) in place; returns whether a vocabulary-parallel head
    is present (then the loss must run under loss_parallel())."""
    names = [n for n, _ in model.named_modules() if n]
    concrete = expand_tp_map(tp_map, names)
    ties = _ties(model)
    plan: dict[str, ParallelStyle] = {}
    vocab_head = False
    for name, style_name in concrete.items():
        module = model.get_submodule(name)
        if isinstance(module, (Placeholder, Boundary)):
            continue  # a layer of another stage
        style = style_for(style_name, module, sequence_parallel)
        if style is not None:
            plan[name] = style
        if style_name == "vocab" and not isinstance(module, nn.Embedding):
            vocab_head = True
    if plan:
        parallelize_module(model, mesh, plan)
    _retie(model, ties)
    if sequence_parallel and sequence_start is not None:
        _scatter_sequence(model, sequence_start, mesh)
    return vocab_head


def _ties(model: nn.Module) -> list[list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [v for v in by_id.values() if len(v) > 1]


def _retie(model: nn.Module, ties: list[list[str]]) -> None:
    """parallelize_module replaces each module's parameters; parameters tied inside one stage (wte/lm_head with
    pp == 1) must point at one tensor again. Their shardings must agree (both vocab-sharded or both replicated)."""
    for names in ties:
        first = model.get_parameter(names[0])
        for other in names[1:]:
            mod_name, _, attr = other.rpartition(".")
            current = model.get_parameter(other)
            if current is first:
                continue
            if _placements(current) != _placements(first) or current.shape != first.shape:
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
    """Column- or row-wise sharding of HF's Conv1D (weight (in, out)): colwise shards weight dim 1 and bias,
    rowwise shards weight dim 0. Input and output handling mirror ColwiseParallel / RowwiseParallel."""

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


def _call_input(fn: Any, mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return fn(mod, inputs, mesh)


def _call_output(fn: Any, mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    return fn(mod, outputs, mesh)
