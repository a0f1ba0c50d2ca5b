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

    global batch = micro_batch * num_microbatches * dp. cp: context parallelism, each sequence split over cp ranks
    (load-balanced causal chunks, ring K/V exchange); the GPUs are tp·cp·dp·pp, ranks ordered tp fastest, then cp,
    dp, pp (Megatron-Core's order). ep: expert parallelism, the routed experts of every MoE layer split over ep
    ranks; like Megatron-Core, ep adds no GPUs but is carved out of the dp·cp ranks (ep divides dp·cp; the dp·cp/ep
    ranks holding the same experts are their data-parallel group), and the experts keep tp as their expert-tensor
    parallel size. vpp > 1 means the interleaved 1F1B schedule with vpp model
    chunks per pipeline rank. zero: 0 = replicated optimizer (DDP), 1 = optimizer states sharded over dp
    (distributed optimizer), 3 = parameters, gradients and optimizer states sharded (FSDP).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
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

    @property
    def expert_dp(self) -> int:
        """Data-parallel size of the routed experts: the dp·cp ranks that hold the same experts."""
        return self.dp * self.cp // self.ep

    def describe(self) -> str:
        sp = " sp" if self.sequence_parallel else ""
        cp = f"·cp{self.cp}" if self.cp > 1 else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        return (
            f"pp{self.pp}·dp{self.dp}{cp}·tp{self.tp}{sp}{ep} mb{self.micro_batch}×{self.num_microbatches}"
            f" vpp{self.vpp} recompute={self.recompute} zero{self.zero}"
        )
