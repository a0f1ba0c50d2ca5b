"""Activation recompute per layer, as the memory model (planner/cost/memory.py) prices it.

- "full": torch.utils.checkpoint (non-reentrant) around the layer: only the layer's inputs stay saved, the whole
  layer is re-run in backward.
- "selective" (Korthikanti et al. 2022, Sec. 4.2): recompute the attention core only -- QK^T, scale, mask,
  softmax, softmax dropout and the attention over V, or the fused SDPA op -- and keep everything else autograd
  saves. torch's selective checkpoint (create_selective_checkpoint_contexts) cannot express this: it re-runs the
  whole layer and caches the outputs of every op marked "save", which keeps tensors autograd never needs and
  recomputes GEMMs whose outputs autograd does not save. So this module records the core's ops while the layer
  runs (a TorchDispatchMode, below autograd) and, through saved_tensors_hooks, replaces each saved tensor that
  lives on storage the core created by a reference; backward replays the core from its saved inputs (Q, K, V,
  masks) under the forward's RNG state, as Megatron's checkpointed core attention does.

What the core is (a dataflow rule, no model is recognised by name): the outputs of SDPA ops (output, log-sum-exp);
a matmul of two non-core tensors whose output is a square matrix in its last two dims (the scores); every op with
a score input whose output is again square in its last two dims (scale, mask, softmax, dropout, casts). A matmul
of a score tensor with a non-core tensor (attention over V) ends the core. Anything the recorder cannot track
(tensor subclasses without storage such as DTensor, dtype reinterpretations) is saved as usual: correct, only
less memory saved.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

MATMULS = frozenset({"mm", "bmm", "baddbmm", "addmm", "addbmm", "matmul"})


def apply_recompute(module: nn.Module, mode: str) -> None:
    """Recompute this layer's activations in backward ("none", "selective" or "full", see module doc). The
    forward is replaced on the instance rather than wrapping the module, so parameter FQNs do not change."""
    if mode == "none":
        return
    inner = module.forward
    if mode == "full":
        full = partial(checkpoint, inner, use_reentrant=False, context_fn=_same_function_modes)
        module.forward = full  # type: ignore[method-assign]
    elif mode == "selective":
        module.forward = functools.wraps(inner)(partial(_selective_forward, inner))  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown recompute mode {mode!r} (none, selective, full)")


def _same_function_modes() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch's checkpoint re-runs the layer in backward without the torch-function modes that were active around
    its forward (the dry run's attention kernels, CPU attention on DTensors): recompute under the same ones, so
    that the recomputation saves what the forward saved (checkpoint checks that it does)."""
    from torch.overrides import _get_current_function_mode_stack

    modes = list(_get_current_function_mode_stack())

    @contextlib.contextmanager
    def again() -> Any:
        with contextlib.ExitStack() as stack:
            for m in modes:
                stack.enter_context(m)
            yield

    return contextlib.nullcontext(), again()


def _selective_forward(inner: Any, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    core = _Core()
    with torch.autograd.graph.saved_tensors_hooks(core.pack, core.unpack), _CoreRecorder(core):
        return inner(*args, **kwargs)


# ---- the recorded core ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _View:
    """A tensor on storage the core created: the creating op's output index and the view's geometry."""

    op: int
    out: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class _Op:
    func: Any
    args: Any  # pytree of the call's (args, kwargs): non-core tensors held, core tensors as _View
    rng: tuple[torch.Tensor, torch.device | None] | None  # generator state before a random op
    versions: tuple[tuple[torch.Tensor, int], ...]  # held inputs and their version at record time


@dataclass
class _Ref:
    """What a saved tensor on core storage is packed as."""

    core: _Core
    view: _View
    dtype: torch.dtype


@dataclass
class _Core:
    """The core ops of one layer call, and (in backward) their replayed outputs."""

    ops: list[_Op] = field(default_factory=list)
    # storage key -> (weak reference, op index, output index, dtype, holds scores). The weak reference pins the
    # StorageImpl's address, so a live storage with the same key is the same storage; expired means it died.
    creator: dict[int, tuple[StorageWeakRef, int, int, torch.dtype, bool]] = field(default_factory=dict)
    replayed: list[Any] | None = None
    pending: int = 0  # packed references not yet unpacked

    def lookup(self, t: torch.Tensor) -> tuple[_View, bool] | None:
        """The view of `t` if it lies on core storage (and whether that storage holds scores), else None."""
        key = _storage_key(t)
        hit = self.creator.get(key) if key is not None else None
        if hit is None:
            return None
        ref, op, out, dtype, score = hit
        if ref.expired():
            del self.creator[key]
            return None
        if dtype != t.dtype:
            return None
        return _View(op, out, tuple(t.shape), tuple(t.stride()), t.storage_offset()), score

    def pack(self, t: torch.Tensor) -> Any:
        found = self.lookup(t)
        if found is None:
            return t
        self.pending += 1
        return _Ref(self, found[0], t.dtype)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Ref):
            return packed
        core = packed.core
        if core.replayed is None:
            core.replayed = core.replay()
        value = core.materialise(packed.view)
        core.pending -= 1
        if core.pending <= 0:  # every reference unpacked: free the replayed tensors
            core.replayed, core.pending = None, 0
        return value

    def materialise(self, view: _View) -> torch.Tensor:
        assert self.replayed is not None
        base = self.replayed[view.op][view.out]
        return torch.as_strided(base, view.size, view.stride, view.offset)

    def replay(self) -> list[Any]:
        """Re-run the core ops in order (no autograd), each random op under its recorded generator state."""
        self.replayed = []
        with torch.no_grad():
            for op in self.ops:
                for tensor, version in op.versions:
                    if tensor._version != version:
                        raise RuntimeError(
                            "selective recompute: an input of the attention core was modified in place after "
                            "the forward used it"
                        )
                args, kwargs = pytree.tree_map(lambda x: self.materialise(x) if isinstance(x, _View) else x, op.args)
                with _rng_state(op.rng):
                    out = op.func(*args, **kwargs)
                self.replayed.append(out if isinstance(out, (tuple, list)) else (out,))
        return self.replayed


class _CoreRecorder(TorchDispatchMode):
    """Tags the attention core's ops while a layer's forward runs and records them for replay (module doc)."""

    def __init__(self, core: _Core) -> None:
        super().__init__()
        self.core = core

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        rng = _capture_rng(func, args, kwargs)
        found = [self.core.lookup(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        is_core, score = self._classify(func, found, outs)
        if is_core and self._record(func, args, kwargs, rng) is None:
            is_core = False
        in_keys = {_storage_key(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for i, t in enumerate(outs):
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            if key is None or key in in_keys:  # a view or an in-place result: the storage keeps its creator
                continue
            if is_core:
                ref = StorageWeakRef(t.untyped_storage())
                self.core.creator[key] = (ref, len(self.core.ops) - 1, i, t.dtype, score)
            else:  # new storage of a non-core op (maybe at a freed core storage's address)
                self.core.creator.pop(key, None)
        return out

    @staticmethod
    def _classify(func: Any, found: list[tuple[_View, bool] | None], outs: Any) -> tuple[bool, bool]:
        """(is a core op, its outputs are scores) by the module doc's rule; `found` holds the inputs' lookups."""
        if func.is_view:
            return False, False
        name = func.overloadpacket.__name__
        if "scaled_dot_product" in name and "backward" not in name:
            return True, False
        score_in = any(f is not None and f[1] for f in found)
        first = outs[0] if outs else None
        square = isinstance(first, torch.Tensor) and first.dim() >= 3 and first.shape[-1] == first.shape[-2]
        if name in MATMULS:
            if score_in and any(f is None for f in found):
                return False, False  # attention over V: ends the core
            return (score_in or all(f is None for f in found)) and square, True
        return score_in and square, True

    def _record(self, func: Any, args: tuple, kwargs: dict, rng: Any) -> int | None:
        held: list[tuple[torch.Tensor, int]] = []
        failed = False

        def convert(x: Any) -> Any:
            nonlocal failed
            if not isinstance(x, torch.Tensor):
                return x
            found = self.core.lookup(x)
            if found is not None:
                return found[0]
            if _storage_key(x) is None:
                failed = True
            held.append((x, x._version))
            return x

        recorded_args = pytree.tree_map(convert, (args, kwargs))
        if failed:
            return None
        self.core.ops.append(_Op(func, recorded_args, rng, tuple(held)))
        return len(self.core.ops) - 1


def _storage_key(t: torch.Tensor) -> int | None:
    """Identity of t's storage; None for tensors without one (wrapper subclasses such as DTensor)."""
    if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter):
        return None
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _capture_rng(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.device | None] | None:
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return None
    cuda = next(
        (t.device for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_cuda), None
    )
    return (torch.cuda.get_rng_state(cuda), cuda) if cuda is not None else (torch.get_rng_state(), None)


class _rng_state:
    """Run under a recorded generator state and restore the current one afterwards."""

    def __init__(self, rng: tuple[torch.Tensor, torch.device | None] | None) -> None:
        self.rng = rng
        self.saved: torch.Tensor | None = None

    def __enter__(self) -> None:
        if self.rng is None:
            return
        state, device = self.rng
        if device is None:
            self.saved = torch.get_rng_state()
            torch.set_rng_state(state)
        else:
            self.saved = torch.cuda.get_rng_state(device)
            torch.cuda.set_rng_state(state, device)

    def __exit__(self, *_exc: object) -> None:
        if self.rng is None or self.saved is None:
            return
        device = self.rng[1]
        if device is None:
            torch.set_rng_state(self.saved)
        else:
            torch.cuda.set_rng_state(self.saved, device)
