"""Live tensor-storage bytes by category over a training step, and the peak: the dry run's memory measurement.

Why not torch.distributed._tools.mem_tracker.MemTracker (tried first): its module hooks (ModTracker's multi-grad
hooks) keep every micro-batch's received activations alive until the tracker exits, so the measured peak grew
with the number of micro-batches where the program's does not (shown by tests/test_dry_run.py), it refuses a
stage module that runs once per micro-batch, and its per-op bookkeeping walks every module (minutes for a
96-layer stage). This tracker only follows storages: O(1) work per op, no hooks on the model.

A storage is counted once, from the op that creates it until Python frees it (a weak reference on the storage),
and resized with it (UntypedStorage.resize_, as FSDP2 allocates and frees its unsharded parameters, is not an op,
so it is wrapped while tracking). Its category is fixed when it appears: the one a `category()` context names
(the optimizer step, FSDP2's parameter gathering), else "activations" in forward and "temporaries" in backward
(torch._C._current_graph_task_id), and `reclassify` moves gradients once they are known (after each backward).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

CATEGORIES = (
    "parameters",
    "buffers",
    "gradients",
    "optimizer",
    "activations",
    "temporaries",
    "pipeline_buffers",
    "other",
)


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding `t`'s data: its own, or its inner tensors' for a wrapper subclass (DTensor). None for a
    tensor on the meta device (a fake tensor's device is the one it stands for): it holds no memory, though its
    storage reports bytes."""
    if t.device.type == "meta":
        return []
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor and not hasattr(t, "fake_mode"):
        names, _ = flatten()
        inner = [getattr(t, name, None) for name in names]
        return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):
        return []


class StorageTracker(TorchDispatchMode):
    """Enter it (inside a FakeTensorMode, or on real tensors) around the step; read `peak` and `peak_by`."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, list[Any]] = {}  # StorageImpl address -> [bytes, category]
        self._refs: dict[int, weakref.ref] = {}
        self.totals = dict.fromkeys(CATEGORIES, 0.0)
        self.peak = 0.0
        self.peak_by = dict(self.totals)
        self._current = 0.0
        self._forced: list[str] = []
        self._resize: Any = None
        self._paused = 0

    # ---- bookkeeping ----

    def track(self, tensor: torch.Tensor, category: str) -> None:
        """Count an existing tensor (parameters, buffers, optimizer state created before the step)."""
        for st in _storages(tensor):
            self._add(st, category)

    def reclassify(self, tensor: torch.Tensor | None, category: str) -> None:
        if tensor is None:
            return
        for st in _storages(tensor):
            entry = self._live.get(st._cdata)
            if entry is not None and entry[1] != category:
                self.totals[entry[1]] -= entry[0]
                self.totals[category] += entry[0]
                entry[1] = category

    @contextlib.contextmanager
    def category(self, name: str) -> Iterator[None]:
        """Storages created inside belong to `name`."""
        self._forced.append(name)
        try:
            yield
        finally:
            self._forced.pop()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Storages created inside are not counted (bookkeeping that a real run does on meta tensors)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _category_now(self) -> str:
        if self._forced:
            return self._forced[-1]
        return "temporaries" if torch._C._current_graph_task_id() != -1 else "activations"

    def _add(self, st: torch.UntypedStorage, category: str | None = None) -> None:
        key = st._cdata
        if key in self._live:
            return
        nbytes = float(st.nbytes())
        cat = category or self._category_now()
        self._live[key] = [nbytes, cat]
        try:
            self._refs[key] = weakref.ref(st, lambda _r, key=key: self._free(key))
        except TypeError:  # a storage Python cannot reference weakly: counted until the tracker exits
            pass
        self.totals[cat] += nbytes
        self._grow(nbytes)

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        self._refs.pop(key, None)
        if entry is not None:
            self.totals[entry[1]] -= entry[0]
            self._current -= entry[0]

    def _grow(self, nbytes: float) -> None:
        self._current += nbytes
        if self._current > self.peak:
            self.peak = self._current
            self.peak_by = dict(self.totals)

    def _resized(self, st: torch.UntypedStorage, size: int) -> None:
        key = st._cdata
        entry = self._live.get(key)
        if entry is None:
            if size > 0:
                self._add(st)
            return
        delta = float(st.nbytes()) - entry[0]
        entry[0] += delta
        self.totals[entry[1]] += delta
        if delta > 0:
            self._grow(delta)
        else:
            self._current += delta

    # ---- the mode ----

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._add(st)
        return out

    def __enter__(self) -> StorageTracker:
        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            result = original(st, size)
            tracker._resized(st, size)
            return result

        self._resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
