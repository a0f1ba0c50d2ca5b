"""A parallel layout: how one training step is split over the GPUs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_CHOICES: tuple[str, ...] = ("none", "selective", "full")
ZERO_CHOICES: tuple[int, ...] = (0, 1, 3)


@dataclass(frozen=True)
class Layout:
    """Mesh sizes (pp x dp x cp x tp), micro-batching, schedule and memory-saving choices.

    global batch = micro_batch * num_microbatches * dp. vpp > 1 means the interleaved 1F1B schedule with vpp model
    chunks per pipeline rank. zero: 0 = replicated optimizer (DDP), 1 = optimizer states sharded over dp
    (distributed optimizer), 3 = parameters, gradients and optimizer states sharded (FSDP).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    micro_batch: int = 1
    num_microbatches: int = 1
    vpp: int = 1
    sequence_parallel: bool = False
    recompute: Recompute = "none"
    zero: int = 0

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.num_microbatches * self.dp

    @property
    def schedule(self) -> str:
        if self.pp == 1:
            return "none"
        return "interleaved-1f1b" if self.vpp > 1 else "1f1b"

    def describe(self) -> str:
        sp = " sp" if self.sequence_parallel else ""
        return (
            f"pp{self.pp}·dp{self.dp}·tp{self.tp}{sp} mb{self.micro_batch}×{self.num_microbatches}"
            f" vpp{self.vpp} recompute={self.recompute} zero{self.zero}"
        )
