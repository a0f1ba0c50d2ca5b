"""The per-GPU memory model: model states per ZeRO stage and activations per recompute choice.

Model states (mixed-precision Adam, Rajbhandari et al. 2020 "ZeRO", Sec. 3): bf16 parameters (2 bytes) and
gradients (2), fp32 master weights and two fp32 moments (12): 16 bytes per parameter. ZeRO-1 (Megatron's
distributed optimizer) shards the 12 optimizer bytes over dp; ZeRO-3 (FSDP) shards all 16 and adds a gather
buffer for the unsharded parameters and gradients of the unit in flight.

Activations per block and in-flight micro-batch (Korthikanti et al. 2022, Table 2), with the IR's saved tensors:
  none:      sharded/tp + replicated (÷tp with sequence parallelism)          = sbh(10 + 24/t + 5as/(ht)) for GPT
  selective: the same minus the attention core (attn_core/tp)                 = sbh·34/t with SP
  full:      the block input only (÷tp with SP)                               = 2sbh (÷t with SP)
Full recompute also needs one block's full activations while it is recomputed: `working_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlm.planner.cost.inputs import LayerCost

PARAM_BYTES = 2.0  # bf16 weights
GRAD_BYTES = 2.0  # bf16 gradients
OPTIMIZER_BYTES = 12.0  # fp32 master weights + Adam's two fp32 moments


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Bytes on one GPU (or one virtual stage's share of it)."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    reserve: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.reserve

    @property
    def static(self) -> float:
        return self.params + self.grads + self.optimizer

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        return MemoryBreakdown(
            self.params + other.params,
            self.grads + other.grads,
            self.optimizer + other.optimizer,
            self.activations + other.activations,
            self.reserve + other.reserve,
        )

    def largest(self) -> str:
        """Name of the largest term (for infeasibility messages)."""
        terms = {
            "parameters": self.params,
            "gradients": self.grads,
            "optimizer states": self.optimizer,
            "activations": self.activations,
            "reserve": self.reserve,
        }
        return max(terms, key=terms.__getitem__)


def local_params(layer: LayerCost, tp: int) -> float:
    """Parameters of `layer` one tp rank holds."""
    return layer.params_sharded / tp + layer.params_replicated


def state_bytes(params: float, zero: int, dp: int) -> MemoryBreakdown:
    """Parameter, gradient and optimizer bytes of `params` local parameters under ZeRO stage `zero`."""
    if zero >= 3:
        return MemoryBreakdown(params * PARAM_BYTES / dp, params * GRAD_BYTES / dp, params * OPTIMIZER_BYTES / dp)
    optimizer = params * OPTIMIZER_BYTES / (dp if zero >= 1 else 1)
    return MemoryBreakdown(params * PARAM_BYTES, params * GRAD_BYTES, optimizer)


def bytes_per_param(zero: int, dp: int) -> float:
    """Static bytes per local parameter under `zero`: 16, 4 + 12/dp, or 16/dp."""
    return state_bytes(1.0, zero, dp).static


def zero3_buffer_bytes(block: LayerCost, tp: int, zero: int) -> float:
    """FSDP keeps the gathered bf16 parameters of the current and the prefetched block and the unsharded bf16
    gradients of one block before they are reduce-scattered."""
    return 0.0 if zero < 3 else local_params(block, tp) * (2 * PARAM_BYTES + GRAD_BYTES)


def activation_bytes(layer: LayerCost, recompute: str, tp: int, sp: bool, micro_batch: int) -> float:
    """Saved activation bytes of one in-flight micro-batch of `layer` (Korthikanti et al. 2022, Table 2)."""
    rep = layer.act_replicated / (tp if sp else 1)
    if recompute == "full":
        return micro_batch * layer.act_input / (tp if sp else 1)
    sharded = layer.act_sharded - (layer.act_core if recompute == "selective" else 0.0)
    return micro_batch * (sharded / tp + rep)


def working_bytes(block: LayerCost, recompute: str, tp: int, sp: bool, micro_batch: int) -> float:
    """Transient activations of the block being recomputed under full recompute (once per GPU)."""
    return activation_bytes(block, "none", tp, sp, micro_batch) if recompute == "full" else 0.0
