"""Sharded checkpoints with torch.distributed.checkpoint (DCP), layout-independent and written atomically.

Keys are the model's own parameter FQNs ("model/<fqn>") and, for optimizer state, "optim/<canonical fqn>/<name>"
(a tied weight's copies on two stages share the first FQN of the tensor). DTensors are saved with their global
shape, so a checkpoint written under one (tp, pp, dp) loads under any other: DCP reads each rank's shards from
whatever shards were written. A save goes to DIR.tmp-<step> and is renamed over DIR only when complete, so an
interrupted save never replaces a good checkpoint.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from mlm.planner.errors import PlanError
from mlm.runtime.stages import original_fqn

META_FILE = "mlm_checkpoint.json"


class CheckpointError(PlanError):
    """--resume names something that is not a usable checkpoint."""


def training_state(stages: list[nn.Module], optimizer: torch.optim.Optimizer,
                   canonical: dict[str, str]) -> dict[str, Any]:
    """The flat DCP state of this rank: its stages' parameters and buffers, and their optimizer state."""
    state: dict[str, Any] = {}
    names: dict[int, str] = {}
    for stage in stages:
        for name, value in stage.state_dict().items():
            state["model/" + original_fqn(name)] = value
        for name, p in stage.named_parameters(remove_duplicate=False):
            fqn = original_fqn(name)
            names.setdefault(id(p), canonical.get(fqn, fqn))
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                state[f"optim/{names[id(p)]}/{key}"] = value
    return state


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


def save(directory: Path, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write `state` under directory.tmp-<step>, then (rank 0) swap it in for `directory`."""
    tmp = directory.with_name(f"{directory.name}.tmp-{step}")
    rank = dist.get_rank()
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    if rank == 0:
        (tmp / META_FILE).write_text(json.dumps({**meta, "step": step}, indent=2) + "\n")
        old = directory.with_name(f"{directory.name}.old")
        if old.exists():
            shutil.rmtree(old)
        if directory.exists():
            directory.rename(old)
        tmp.rename(directory)
        if old.exists():
            shutil.rmtree(old)
    dist.barrier()


def read_meta(directory: Path) -> dict[str, Any]:
    path = directory / META_FILE
    if not path.is_file():
        raise CheckpointError(f"--resume {directory}: not an mlm checkpoint (no {META_FILE})")
    return json.loads(path.read_text())


def load(directory: Path, state: dict[str, Any]) -> None:
    """Load in place into this rank's tensors (any layout), under no_grad because they are leaf parameters."""
    with torch.no_grad():
        try:
            dcp.load(state, checkpoint_id=str(directory))
        except Exception as e:  # DCP raises CheckpointException wrapping per-rank errors
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"--resume {directory}: cannot load: {first}") from None
