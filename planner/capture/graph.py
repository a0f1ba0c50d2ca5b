"""The graph IR: an ordered list of layers with the costs the planner needs.

All per-sample quantities are for one sequence (micro-batch 1) of the captured sequence length; FLOPs and
activations of a transformer are linear in the micro-batch, so the cost model scales them. Activation bytes are
counted at the training precision (2 bytes per float element for bf16 mixed precision).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import networkx as nx

LayerKind = Literal["embedding", "block", "norm", "head", "loss", "other"]


HAND_WRITTEN_ATTENTION = "matmul-softmax-matmul"  # how capture names attention computed without SDPA (facts.py)


@dataclass(frozen=True)
class LinearOp:
    """One nn.Linear-like matmul (or embedding lookup) inside a layer, as captured."""

    fqn: str  # module path of the owning nn.Linear / nn.Embedding, relative to the model root
    kind: Literal["linear", "embedding"]
    in_features: int  # embedding: the vocabulary size
    out_features: int  # embedding: the embedding dimension
    has_bias: bool
    rows: int  # tokens per sample that pass through it (seq_len for a transformer)
    token_ids: bool = True  # embedding: indexed by ids from the batch (a position table reads an arange: False)


@dataclass(frozen=True)
class Activations:
    """Bytes saved for backward, per sample, split by how tensor/sequence parallelism shards them.

    sharded:    inside the tensor-parallel region (between a colwise and a rowwise linear): divided by tp.
    replicated: on the residual stream (norm inputs, dropout masks, linear inputs after a norm): replicated under
                tp, divided by tp under sequence parallelism.
    attn_core:  the part of `sharded` produced inside the attention core (tensors with a seq x seq extent):
                dropped by selective recompute (Korthikanti et al. 2022, Sec. 4.2).
    layer_input: the layer's input, the only thing kept under full recompute (sequence-sharded under SP).
    """

    sharded: float = 0.0
    replicated: float = 0.0
    attn_core: float = 0.0
    layer_input: float = 0.0

    @property
    def total(self) -> float:
        return self.sharded + self.replicated


@dataclass(frozen=True)
class ExpertGemm:
    """One GEMM of one routed expert: (tokens routed to it) x in_features @ in_features x out_features."""

    name: str  # parameter or module that holds the weight ("experts.gate_up_proj", "experts.0.w1")
    in_features: int
    out_features: int
    has_bias: bool = False


@dataclass(frozen=True)
class MoEIR:
    """A routed mixture-of-experts layer as recognised from the module tree and the graph (moe.py).

    The experts' compute is data dependent (tokens gathered per expert), so it is priced analytically: every token
    runs `top_k` experts, times `capacity_factor` (an option, default 1.0: perfect balance, no dropped tokens)."""

    module: str  # FQN of the MoE module (the router's and the experts' parent)
    num_experts: int
    top_k: int
    top_k_from: str  # where top_k was read ("the graph's topk op", "attribute gate.top_k", ...)
    expert_params: int  # parameters of one routed expert
    expert_gemms: tuple[ExpertGemm, ...]  # one expert's GEMMs, in order
    router: str  # FQN of the router weight's module (or parameter)
    router_params: int
    shared_modules: tuple[str, ...] = ()  # shared experts (run densely on every token, captured in the graph)
    shared_params: int = 0
    capacity_factor: float = 1.0
    tokens: int = 0  # tokens per sample entering the router (rows of the router GEMM)
    how: str = ""  # the structure it was recognised by (one phrase, for the warning)
    expert_modules: tuple[str, ...] = ()  # FQNs of the experts: the fused bank, or the list of expert modules
    expert_tensors: int = 0  # the routed experts' parameter tensors: every expert's, or the fused bank's

    @property
    def routed_params(self) -> int:
        return self.num_experts * self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token touches in this MoE module: router, top_k experts, shared experts."""
        return self.router_params + self.top_k * self.expert_params + self.shared_params

    def expert_flops_per_token(self) -> float:
        """Forward FLOPs of the routed experts per token (2 per multiply-add, top_k experts, capacity factor)."""
        per_expert = sum(2.0 * g.in_features * g.out_features for g in self.expert_gemms)
        return self.top_k * self.capacity_factor * per_expert


@dataclass(frozen=True)
class BlockKind:
    """One distinct kind of block: captured once (from `representative`), costed for each of `members`."""

    name: str  # "<container>#<i>", i in order of first appearance
    container: str  # FQN of the block container
    representative: str  # FQN of the block that was captured
    members: tuple[str, ...]  # FQNs of every block of this kind, in order
    module_type: str
    params: int  # parameters of one block of this kind
    attention: tuple[str, ...] = ()  # attention kinds of the captured block
    moe: bool = False
    flops_forward: float = 0.0  # forward FLOPs per sample of one block of this kind


@dataclass(frozen=True)
class LayerIR:
    """One layer of the model in execution order (embedding, each block, final norm, head, loss)."""

    name: str  # module FQN ("transformer.h.3"), or "loss" for the loss computation
    kind: LayerKind
    params: int  # parameters owned by this layer (tied parameters counted once, at first use)
    flops_matmul: float  # forward FLOPs of linears (2*m*n*k), per sample
    flops_attention: float  # forward FLOPs of attention score and value products, per sample
    flops_elementwise: float  # forward FLOPs of everything else (one per output element), per sample
    bytes_moved: float  # bytes read+written by memory-bound (non-matmul) ops, per sample
    activations: Activations
    output_bytes: float  # bytes of the layer's output per sample (what a pipeline stage boundary sends)
    linears: tuple[LinearOp, ...] = ()
    block_group: str | None = None  # FQN of the repeated container (e.g. "transformer.h") for blocks
    attention: tuple[str, ...] = ()  # kind of each attention op in the layer, in order ("causal", "cross", ...)
    module_type: str = ""  # class name of the layer's module
    block_kind: str = ""  # BlockKind.name for blocks ("" for other layers)
    moe: MoEIR | None = None  # the routed MoE module inside this layer, if any (its experts priced analytically)
    # of flops_attention, the fused-kernel calls that compute every (query, key) block (a mask tensor, or not causal:
    # masks.computes_every_block); the other fused calls are causal and execute half of their counted FLOPs
    flops_attention_full: float = 0.0
    # bytes of the layer's outputs that the batch does not size (T5's position bias, computed from parameters and
    # position ids alone): a boundary sends them once per micro-batch, not per sample
    output_fixed_bytes: float = 0.0
    ops: nx.DiGraph | None = field(default=None, compare=False, repr=False, hash=False)

    @property
    def flops_forward(self) -> float:
        return self.flops_matmul + self.flops_attention + self.flops_elementwise


@dataclass(frozen=True)
class ModelIR:
    """The captured model: layers in order plus the facts the planner reads from the architecture."""

    layers: tuple[LayerIR, ...]
    num_params: int  # exact sum(p.numel()) over unique parameters of the whole model
    seq_len: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    capture_method: str  # "symbolic_trace" | "export" (+ " (one block, replicated xN)")
    capture_seconds: float
    tied_embeddings: bool = False
    # layers that hold a parameter another layer holds too (one tensor under several names: a tied embedding, which
    # T5 calls as encoder.embed_tokens, decoder.embed_tokens and lm_head); each pipeline stage holding one keeps a
    # copy and all-reduces its gradient with the others
    tied_layers: tuple[str, ...] = ()
    head_dim: int = 0  # from the attention op's query (0: no attention op found); not always hidden // heads
    attention_kinds: tuple[str, ...] = ()  # distinct kinds in graph order: "causal", "sliding window 4096", ...
    # how attention is computed, distinct, in graph order: "scaled_dot_product_attention", "matmul-softmax-matmul"
    # (mlm-run's context parallelism splits only the first)
    attention_ops: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()  # one sentence per assumption capture made (shown by --inspect, in plan.json)
    block_kinds: tuple[BlockKind, ...] = ()  # every distinct block, captured once each
    compute_bytes: int = 2  # bytes per element of the compute dtype the activations were captured in (bf16: 2)
    # False when the inputs are not token sequences that --seq-len shapes (images, latents): seq_len is then the
    # tokens a sample's attention runs over, or 1, and throughput is reported per sample
    token_inputs: bool = True
    # connections that skip over a block ("up_blocks.1 reads the output of time_embedding"): carried by the stages
    pipeline_skips: tuple[str, ...] = ()
    # per sample, the most bytes such connections carry across one block boundary beside the block's input (what
    # mlm-run's pipeline stages send on for them; priced with every boundary's activation)
    carried_bytes: float = 0.0
    carried_by_boundary: tuple[float, ...] = ()  # the same before each block but the first (pipeline_skips)
    # "<module> of <block>": a block's submodule that the model also calls outside the block (a DiT's head calls
    # its first block's timestep embedder): FSDP gathers a block's weights only around the block's own call
    reused_modules: tuple[str, ...] = ()
    # parameters outside every layer (a ViT's class token on the root module): mlm-run keeps a copy on every stage
    root_params: tuple[str, ...] = ()
    root_param_numels: tuple[int, ...] = ()  # their element counts, in the same order
    # bytes per sample of the batch mlm-run puts on each rank for a step (runtime/data.py): the (inputs, targets)
    # tensors as example_inputs returns them (images in fp32), else int64 token ids and targets
    batch_bytes: float = 0.0

    @property
    def moe_layers(self) -> tuple[LayerIR, ...]:
        return tuple(layer for layer in self.layers if layer.moe is not None)

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (the largest, if layers differ); 0 for a dense model."""
        return max((layer.moe.num_experts for layer in self.moe_layers if layer.moe), default=0)

    @property
    def experts_top_k(self) -> int:
        """Experts each token runs in an MoE layer (the largest, if layers differ); 0 for a dense model."""
        return max((layer.moe.top_k for layer in self.moe_layers if layer.moe), default=0)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: all of them, less the routed experts it is not sent to (top_k of each)."""
        idle = sum((m.num_experts - m.top_k) * m.expert_params for layer in self.moe_layers if (m := layer.moe))
        return self.num_params - idle

    @property
    def blocks(self) -> tuple[LayerIR, ...]:
        return tuple(layer for layer in self.layers if layer.kind == "block")

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def flops_forward_per_sample(self) -> float:
        return sum(layer.flops_forward for layer in self.layers)

    def model_flops_per_token(self) -> float:
        """Training FLOPs per token without recompute (forward + 2x backward), as MFU counts them."""
        return 3.0 * self.flops_forward_per_sample / self.seq_len
