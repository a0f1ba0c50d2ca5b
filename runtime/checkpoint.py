"""Sharded checkpoints with torch.distributed.checkpoint (DCP), layout-independent and written atomically.

Keys are the model's own parameter FQNs ("model/<fqn>") and, for optimizer state, "optim/<canonical fqn>/<name>"
(a tied weight's copies on two stages share the first FQN of the tensor). DTensors are saved with their global
shape, so a checkpoint written under one (tp, pp, dp) loads under any other: DCP reads each rank's shards from
whatever shards were written. A save goes to DIR.tmp-<step> (files fsynced, the metadata file written last) and
is swapped in for DIR only when complete (DIR -> DIR.old, DIR.tmp-<step> -> DIR), so an interrupted save never
replaces a good checkpoint: a kill between the two renames leaves DIR.old, which `resolve` finds and the next save
moves back before anything is deleted. A failed write (a full disk) is reported as a CheckpointWriteError and the
previous checkpoint stays.

Loading never runs code from the checkpoint: tensors are read by DCP with torch.load(weights_only=True), DCP's
pickled .metadata is read by an unpickler that admits only DCP's own metadata classes, torch dtypes / sizes and
paths, and non-tensor ("bytes") entries, which DCP would unpickle freely, are refused.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.tensor import DTensor

from mlm.planner.errors import PlanError
from mlm.runtime.model_build import row_order
from mlm.runtime.stages import original_fqn
from mlm.runtime.tensor_parallel import copy_from_plain_shards, is_strided, to_plain_shards

META_FILE = "mlm_checkpoint.json"


class CheckpointError(PlanError):
    """--resume names something that is not a usable checkpoint."""


class CheckpointWriteError(CheckpointError, OSError):
    """A save could not be written (full disk, permissions); the previous checkpoint is kept."""


Order = tuple[int, torch.Tensor]


def training_state(
    stages: list[nn.Module], optimizer: torch.optim.Optimizer, canonical: dict[str, str]
) -> tuple[dict[str, Any], dict[str, Order]]:
    """The flat DCP state of this rank (its stages' parameters and buffers, and their optimizer state), and the
    keys whose tensors are stored with reordered rows (model_build.row_order): saved in the original order."""
    state: dict[str, Any] = {}
    orders: dict[str, Order] = {}
    names: dict[int, str] = {}
    by_param: dict[int, Order] = {}
    for stage in stages:
        for name, value in stage.state_dict().items():
            state["model/" + original_fqn(name)] = value
        for name, p in stage.named_parameters(remove_duplicate=False):
            fqn = original_fqn(name)
            names.setdefault(id(p), canonical.get(fqn, fqn))
            if (order := row_order(stage, name)) is not None:
                orders["model/" + fqn] = by_param[id(p)] = order
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                state[f"optim/{names[id(p)]}/{key}"] = value
                if id(p) in by_param and isinstance(value, torch.Tensor) and value.dim() > 0:
                    orders[f"optim/{names[id(p)]}/{key}"] = by_param[id(p)]
    return state, orders


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (a step with zero gradients at lr 0) so DCP can load into them."""
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, lr in zip(optimizer.param_groups, saved):
        g["lr"] = lr


def save(
    directory: Path, step: int, state: dict[str, Any], meta: dict[str, Any], orders: dict[str, Order] | None = None
) -> None:
    """Write `state` under directory.tmp-<step>, then (rank 0) swap it in for `directory`; tensors named in
    `orders` in their original row order. Collective."""
    tmp = directory.with_name(f"{directory.name}.tmp-{step}")
    rank = dist.get_rank()
    if rank == 0:
        recover(directory)
        for stale in directory.parent.glob(f"{directory.name}.tmp-*"):  # left by saves that were killed
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    # per-head shards of fused projections (_StridedShard) as plain chunks: DCP writes overlapping chunks for them
    orders = orders or {}
    state = {k: to_plain_shards(v, orders.get(k)) if _needs_plain(k, v, orders) else v for k, v in state.items()}
    try:
        dcp.save(state, checkpoint_id=str(tmp))
        error = None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP gathers every rank's write errors and raises on all ranks a
        error = e  # CheckpointException, which derives from BaseException
    if error is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space a full disk needs
        raise CheckpointWriteError(_save_failure(directory, tmp, step, error)) from None
    failure = [None]
    if rank == 0:
        try:
            _write_synced(tmp / META_FILE, json.dumps({**meta, "step": step}, indent=2) + "\n")
            _swap_in(tmp, directory)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            failure = [_save_failure(directory, tmp, step, e)]
    dist.broadcast_object_list(failure, src=0)  # every rank learns whether rank 0 could finish the swap
    if failure[0] is not None:
        raise CheckpointWriteError(failure[0])


def _save_failure(directory: Path, tmp: Path, step: int, error: BaseException) -> str:
    reason = _first_line(error)
    try:
        previous = latest_step(directory)
    except CheckpointError:
        previous = None
    kept = (
        f"the previous checkpoint (step {previous}) in {directory} is kept"
        if previous is not None
        else "no earlier checkpoint exists"
    )
    return (
        f"cannot write the checkpoint of step {step} to {tmp}: {reason}; {kept}. Free space or choose "
        f"another --save directory"
    )


def _first_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    for line in str(error).splitlines():  # DCP's CheckpointException lists per-rank tracebacks: find the cause
        if "Error:" in line and "Traceback" not in line:
            return line.strip()
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _swap_in(tmp: Path, directory: Path) -> None:
    """DIR -> DIR.old, tmp -> DIR, drop DIR.old: at every instant DIR or DIR.old is a complete checkpoint."""
    old = directory.with_name(f"{directory.name}.old")
    if directory.exists():
        if old.exists():
            shutil.rmtree(old)  # recover() ran: DIR is complete, so DIR.old is a stale copy
        directory.rename(old)
    tmp.rename(directory)
    _fsync_dir(directory.parent)
    if old.exists():
        shutil.rmtree(old)


def recover(directory: Path) -> None:
    """After a kill between the two renames of _swap_in: move DIR.old back to DIR (rank 0, before a save)."""
    old = directory.with_name(f"{directory.name}.old")
    if (old / META_FILE).is_file() and not (directory / META_FILE).is_file():
        if directory.exists():
            shutil.rmtree(directory)
        old.rename(directory)
        _fsync_dir(directory.parent)


def resolve(directory: Path, missing_ok: bool = False) -> Path | None:
    """The complete checkpoint that DIR stands for: DIR itself, or DIR.old when a save was cut between renames."""
    if (directory / META_FILE).is_file():
        return directory
    old = directory.with_name(f"{directory.name}.old")
    if (old / META_FILE).is_file():
        return old
    if missing_ok:
        return None
    raise CheckpointError(f"--resume {directory}: not an mlm checkpoint (no {META_FILE})")


def latest_step(directory: Path) -> int | None:
    """The step of the checkpoint in DIR (or its DIR.old), None when there is none."""
    found = resolve(directory, missing_ok=True)
    return None if found is None else int(read_meta(found)["step"])


def read_meta(directory: Path) -> dict[str, Any]:
    path = (resolve(directory) or directory) / META_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--resume {directory}: unreadable {META_FILE}: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or meta["step"] < 0:
        raise CheckpointError(f"--resume {directory}: {META_FILE} has no valid step")
    return meta


def _needs_plain(key: str, value: Any, orders: dict[str, Order]) -> bool:
    return isinstance(value, torch.Tensor) and (is_strided(value) or (key in orders and isinstance(value, DTensor)))


def load(directory: Path, state: dict[str, Any], orders: dict[str, Order] | None = None) -> None:
    """Load in place into this rank's tensors (any layout), under no_grad because they are leaf parameters;
    tensors named in `orders` are stored with reordered rows (training_state)."""
    found = resolve(directory) or directory
    orders = orders or {}
    strided = {k: v for k, v in state.items() if _needs_plain(k, v, orders)}
    state = {**state, **{k: to_plain_shards(v, orders.get(k)) for k, v in strided.items()}}  # as save() wrote them
    with torch.no_grad():
        try:
            dcp.load(state, storage_reader=SafeReader(str(found)), planner=_TensorsOnlyPlanner())
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP raises CheckpointException (a BaseException) wrapping per-rank errors
            raise CheckpointError(f"--resume {directory}: cannot load: {_first_line(e)}") from None
    for k, dst in strided.items():
        copy_from_plain_shards(dst, state[k], orders.get(k))


# ---- loading without running code from the checkpoint ----

_SAFE_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "WindowsPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "object"),
    ("copyreg", "_reconstructor"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch dtypes / Size / layouts and paths; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_SAFE_MODULE_PREFIXES) and "." not in name:
            value = super().find_class(module, name)
            if isinstance(value, type):
                return value
        elif (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which mlm does not load")


class SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(Path(self.path) / name, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class _TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP unpickles non-tensor entries with torch.load(weights_only=False); mlm checkpoints hold none."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise pickle.UnpicklingError(
            f"entry {read_item.dest_index.fqn!r} is a pickled object, not a tensor; mlm loads tensors only"
        )
