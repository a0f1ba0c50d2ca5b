"""The per-GPU memory model: model states per ZeRO stage and activations per recompute choice.

Model states, as mlm-run keeps them (docs/semantics.md; measured by `mlm-run --dry-run`): bf16 compute copies of
the weights (2 bytes), fp32 master weights (4), fp32 gradients (4: FSDP2's reduce dtype, Megatron's main_grad), two
fp32 Adam moments (8): 18 bytes per parameter without sharding (Megatron-LM's count too). zero 1 (FSDP2 without
resharding after forward, the closest torch has to Megatron's distributed optimizer) shards the master weights and
moments over dp and keeps the gathered bf16 weights and the accumulated fp32 gradients whole: 6 + 12/dp, as
Megatron's distributed optimizer. zero 3 (FSDP2) shards all of it, 16/dp, plus a gather buffer for the unit in
flight; under pipelining it cannot reshard between micro-batches (runtime/data_parallel.py) and keeps zero 1's
6 + 12/dp. The ZeRO paper's accounting (fp16 gradients, 16 bytes) is `grad_bytes=2`.

Activations per block and in-flight micro-batch (Korthikanti et al. 2022, Table 2), with the IR's saved tensors:
  none:      sharded/tp + replicated (÷tp with sequence parallelism)          = sbh(10 + 24/t + 5as/(ht)) for GPT
  selective: the same minus the attention core (attn_core/tp)                 = sbh·34/t with SP
  full:      the block input only (÷tp with SP)                               = 2sbh (÷t with SP)
Full recompute also needs one block's full activations while it is recomputed: `working_bytes`. The last stage's
peak is in the loss's backward, which holds fp32 temporaries of the logits' size beside the saved log-probabilities
(`loss_backward_bytes`; 2 or 3 of them, by the kernels mlm-run calls).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlm.planner.cost.inputs import LayerCost

PARAM_BYTES = 2.0  # bf16 compute copy of the weights (compute_copy_bytes for another compute dtype)
MASTER_BYTES = 4.0  # fp32 master weights (FSDP2's sharded parameter under MixedPrecisionPolicy)
GRAD_BYTES = 4.0  # fp32 gradients (FSDP2 reduce_dtype, Megatron main_grad)
ADAM_BYTES = 8.0  # Adam's two fp32 moments
OPTIMIZER_BYTES = MASTER_BYTES + ADAM_BYTES  # what ZeRO-1 shards in the ZeRO paper's accounting
# Tensors of the (local) fp32 logits' size that a cross-entropy backward allocates at once, beside the saved
# log-probabilities (which the activations count). aten: nll_loss_backward's dense gradient of the log-probabilities
# and log_softmax_backward's gradient of the logits. torch's loss_parallel (a vocabulary-parallel head,
# torch/distributed/tensor/parallel/loss.py): (zeros_like(x) + exp(x)) * grad, three at once.
LOSS_BACKWARD_TEMPS = 2
VOCAB_PARALLEL_LOSS_BACKWARD_TEMPS = 3


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


def local_expert_params(layer: LayerCost, tp: int) -> float:
    """Routed-expert parameters of `layer` one tp rank holds before expert parallelism: those split by
    expert-tensor parallelism ÷tp, those kept whole on every tp rank (inputs.for_tp) whole."""
    return (layer.expert_params - layer.experts_whole) / tp + layer.experts_whole


def compute_copy_bytes(compute_bytes: float, dp: int) -> float:
    """Bytes per parameter that the compute copy of the weights takes beside the fp32 master (docs/semantics.md):
    bf16 compute, the bf16 copy FSDP2 gathers (2, at dp 1 too: fully_shard over one rank casts). fp32 compute (CPU
    runs): FSDP2's unsharded fp32 parameter, or DDP's fp32 gradient buckets (4, the same size), and nothing when
    dp = 1 (no wrapper: the optimizer steps the parameters the model computes with)."""
    if compute_bytes == PARAM_BYTES:
        return PARAM_BYTES
    return 0.0 if dp == 1 else float(compute_bytes)


def state_bytes(
    params: float,
    zero: int,
    dp: int,
    pipelined: bool = False,
    grad_bytes: float = GRAD_BYTES,
    compute_bytes: float = PARAM_BYTES,
) -> MemoryBreakdown:
    """Parameter, gradient and optimizer bytes of `params` local parameters under ZeRO stage `zero` (module doc);
    the fp32 master weights count as parameters, as the runtime holds them (the sharded FSDP2 parameter), with the
    compute copy of `compute_bytes` per element (compute_copy_bytes)."""
    if zero >= 3 and not pipelined:
        return MemoryBreakdown(params * MASTER_BYTES / dp, params * grad_bytes / dp, params * ADAM_BYTES / dp)
    copy = compute_copy_bytes(compute_bytes, dp)
    if zero >= 1:
        return MemoryBreakdown(params * (copy + MASTER_BYTES / dp), params * grad_bytes, params * ADAM_BYTES / dp)
    return MemoryBreakdown(params * (copy + MASTER_BYTES), params * grad_bytes, params * ADAM_BYTES)


def bytes_per_param(zero: int, dp: int, pipelined: bool = False) -> float:
    """Static bytes per local parameter under `zero`: 18, 6 + 12/dp, or 16/dp (6 + 12/dp pipelined)."""
    return state_bytes(1.0, zero, dp, pipelined).static


def zero3_buffer_bytes(
    block: LayerCost, tp: int, zero: int, pipelined: bool = False, compute_bytes: float = PARAM_BYTES, ep: int = 1
) -> float:
    """FSDP keeps the gathered parameters (in the compute dtype) of the current and the prefetched block and the
    unsharded fp32 gradients of one block before they are reduce-scattered (none of it extra when pipelined: all
    stay whole); of the routed experts, the 1/ep this rank holds."""
    if zero < 3 or pipelined:
        return 0.0
    params = local_params(block, tp) - local_expert_params(block, tp) * (1.0 - 1.0 / ep)
    return params * (2 * compute_bytes + GRAD_BYTES)


def activation_bytes(
    layer: LayerCost, recompute: str, tp: int, sp: bool, micro_batch: int, gathered_inputs: bool = True
) -> float:
    """Saved activation bytes of one in-flight micro-batch of `layer` (Korthikanti et al. 2022, Table 2), as
    mlm-run saves them: under SP the residual-stream tensors are sequence shards (÷tp) except the column-parallel
    linears' inputs, which autograd saves as gathered (gathered_inputs=False: Megatron, which saves the shard and
    re-gathers it in backward)."""
    gathered = layer.act_gathered if sp and tp > 1 and gathered_inputs else 0.0
    rep = (layer.act_replicated - gathered) / (tp if sp else 1) + gathered
    if recompute == "full":
        return micro_batch * layer.act_input / (tp if sp else 1)
    sharded = layer.act_sharded - (layer.act_core if recompute == "selective" else 0.0)
    return micro_batch * (sharded / tp + rep)


def working_bytes(
    block: LayerCost, recompute: str, tp: int, sp: bool, micro_batch: int, gathered_inputs: bool = True
) -> float:
    """Transient activations of the block being recomputed under full recompute (once per GPU)."""
    return activation_bytes(block, "none", tp, sp, micro_batch, gathered_inputs) if recompute == "full" else 0.0


def loss_backward_bytes(post: LayerCost, vocab_shards: int, micro_batch: int) -> float:
    """Transient bytes of the loss's backward on the last stage, once per GPU (one micro-batch's backward runs at a
    time): a vocabulary-parallel loss (vocab_shards > 1) on its shard of the logits, else on the whole logits."""
    temps = VOCAB_PARALLEL_LOSS_BACKWARD_TEMPS if vocab_shards > 1 else LOSS_BACKWARD_TEMPS
    return micro_batch * temps * post.loss_logits_bytes / vocab_shards
