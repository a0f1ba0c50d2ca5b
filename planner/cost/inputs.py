"""Summarise a captured ModelIR into the plain numbers the cost model needs, once per model.

`summarize(ir)` walks the IR (and each layer's op graph, when present) and returns a ModelCostInputs of floats:
one LayerCost per block (`block_costs`: blocks of different kinds differ; layers between two stacks, such as an
encoder's final norm, are folded into the block before them), their mean as `block` (for the parts of the cost
model that treat blocks as interchangeable), the layers before the blocks (embedding…, first pipeline stage)
merged into `pre` and those after (final norm, head, loss; last stage) into `post`. Routed experts of an MoE layer
add their GEMMs (R = tokens·top_k·capacity rows each), their parameters and activations, priced split over tp
with one all-reduce of the combined output each way (expert-tensor parallelism, as Megatron-Core runs them);
for_tp keeps them whole on every tp rank instead where the runtime does (mlm-run). After this, `evaluate` in
planner/cost/step_time.py is pure arithmetic. Nothing here imports torch.

How a layer is split by tensor parallelism follows Megatron (Shoeybi et al. 2019): a linear reading the residual
stream is column-parallel, one reading a sharded tensor is row-parallel; the embedding, the head and the loss are
vocabulary-parallel; norms, residual adds and position embeddings are replicated (sharded only by sequence
parallelism). All quantities are per sample (micro-batch 1) of `seq_len` tokens, bytes in the training precision.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Literal

import networkx as nx

from mlm.planner.capture.experts import routed_rows, row_elements
from mlm.planner.capture.graph import Activations, LayerIR, ModelIR, MoEIR
from mlm.planner.errors import PlanError

Split = Literal["col", "row", "vocab", "replicate", "sequence"]  # sequence: a replicated linear on SP's shard
TPStates = Mapping[str, Mapping[str, str]]  # block name -> op-graph node -> "S" (split over tp) or "R" (whole)
FP32_BYTES = 4
LOSS_REDUCTIONS = 3  # vocab-parallel cross-entropy all-reduces max, sum(exp) and the target logit (Megatron)


@dataclass(frozen=True)
class Gemm:
    """One linear's forward GEMM: (rows x k) @ (k x n); tp divides k (row), n (col, vocab) or the rows (sequence:
    a replicated weight on sequence parallelism's shard of the tokens), not replicate."""

    rows: int  # tokens per sample
    k: int
    n: int
    split: Split
    expert: bool = False  # a routed expert's GEMM (split over tp only under expert-tensor parallelism: for_tp)


@dataclass(frozen=True)
class LayerCost:
    """Per-sample costs of one layer (or several merged), split by how tp / sequence parallelism shards them.

    mem_*: bytes moved by memory-bound forward ops inside the tp region (sharded) / on the residual stream
    (replicated, sharded only by SP). act_*: saved activation bytes as in graph.Activations. tp_fwd_* / tp_bwd_*:
    the tensor-parallel all-reduces (count and total bytes) in forward / backward (Megatron's g and f operators).
    """

    names: tuple[str, ...]
    gemms: tuple[Gemm, ...] = ()
    attn_flops: float = 0.0  # forward score and value products, counted non-causal (4·s²·h) as the papers do
    attn_materialized: bool = False  # seq x seq scores saved (manual attention): batched GEMMs, not a fused kernel
    # of attn_flops, the fused calls that compute every (query, key) block (a mask tensor or no causal flag); the
    # rest is causal and executes half of its counted FLOPs (graph.LayerIR.flops_attention_full)
    attn_full_flops: float = 0.0
    head_dim: int = 0
    mem_sharded: float = 0.0
    mem_replicated: float = 0.0
    core_bytes: float = 0.0  # memory-bound forward bytes of the attention core (selective recompute redoes them)
    act_sharded: float = 0.0
    act_replicated: float = 0.0
    act_core: float = 0.0
    act_input: float = 0.0
    # of act_replicated, the inputs the column-parallel linears save: under SP each is all-gathered once per tp
    # region and autograd keeps the gathered (whole) tensor for the weight gradient, so they stay whole
    act_gathered: float = 0.0
    output_bytes: float = 0.0
    output_fixed_bytes: float = 0.0  # per micro-batch, whatever its size (LayerIR.output_fixed_bytes)
    params_sharded: float = 0.0  # divided by tp (linear weights and biases, vocabulary embedding)
    params_replicated: float = 0.0  # norms, position embeddings
    tp_fwd_count: int = 0
    tp_fwd_bytes: float = 0.0
    tp_bwd_count: int = 0
    tp_bwd_bytes: float = 0.0
    # forward all-reduces that stay all-reduces under SP and are never recomputed: the vocabulary-parallel
    # embedding's partial sums (its output is replicated) and loss_parallel's per-token statistics
    tp_fixed_count: int = 0
    tp_fixed_bytes: float = 0.0
    # 1 when an op after the block's last forward reduction saves a tensor for backward (GPT-2's residual dropout
    # keeps its mask): a full recompute then runs through that reduction too, f reductions instead of f - 1
    tp_recompute_tail_count: int = 0
    # under SP, all-gathered once in backward: the replicated activation the first sequence-parallel module slices
    # into sequence shards (the input of the first block, on the first stage)
    sp_gather_bytes: float = 0.0
    # parameter tensors that SP makes replicated DTensors (norms on the residual stream): the gradient of each is a
    # partial sum over the sequence shards, all-reduced over tp with the gradients (collective_counts)
    sp_param_count: int = 0
    sp_param_elems: float = 0.0
    # parameters of ops that run on this rank's heads (per-head q/k norms, plan style "heads"): replicated, their
    # gradients partial sums over the tp ranks' heads, all-reduced over tp with or without SP, as the SP norms'
    head_param_count: int = 0
    head_param_elems: float = 0.0
    # fp32 bytes of the logits a cross-entropy loss reads (the loss layer; sequence x vocabulary): its backward's
    # temporaries are a few tensors of that size (memory.loss_backward_bytes)
    loss_logits_bytes: float = 0.0
    # the vocabulary of a layer priced as vocabulary-parallel (embedding, head, loss); a tp that does not divide it
    # leaves the layer replicated (for_tp)
    vocab_size: int = 0
    model_flops: float = 0.0  # forward matmul + attention FLOPs (what MFU counts, x3 for training)
    expert_params: float = 0.0  # routed experts' parameters (expert parallelism splits them)
    # the routed experts under tp: split like an MLP (expert-tensor parallelism, Megatron-Core's default ETP = TP),
    # their parameters in params_sharded, activations in act_sharded, bytes in mem_sharded and one all-reduce of
    # the combined output each way in tp_fwd / tp_bwd (expert_tp_count of expert_tp_bytes each way); or kept whole
    # on every tp rank as mlm-run runs them (for_tp(..., expert_tp=False) moves them: experts_whole of the
    # expert_params then replicated)
    expert_act: float = 0.0
    expert_mem: float = 0.0
    expert_tp_count: int = 0
    expert_tp_bytes: float = 0.0
    experts_whole: float = 0.0
    expert_tensor_count: int = 0  # the routed experts' parameter tensors (each expert's, or a fused bank's)
    dispatch_bytes: float = 0.0  # one all-to-all's bytes per sample: tokens·top_k·capacity·hidden·compute bytes
    # MoE layers merged into this one, and the bytes of the per-expert row counts each exchanges first (int64, one
    # per routed expert: mlm-run's all-to-all of the counts before the dispatch)
    moe_layer_count: int = 0
    expert_counts_bytes: float = 0.0
    kv_bytes: float = 0.0  # K and V bytes per sample of the attention ops, as ring context parallelism passes them


@dataclass(frozen=True)
class ModelCostInputs:
    """Everything evaluate() reads about the model."""

    block: LayerCost
    block_names: tuple[str, ...]
    pre: LayerCost  # merged layers before the first block (first pipeline stage)
    post: LayerCost  # merged layers after the last block (last pipeline stage)
    tied_params: float  # embedding weight the last stage must also hold when pp > 1 (tied head), 0 if untied
    seq_len: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    num_params: int
    block_costs: tuple[LayerCost, ...] = ()  # one per block, in order (block_names); `block` is their mean
    # with tied_params: blocks that (with the layers run after them) hold a copy of the tied weight besides the first
    # and last stage's, as T5's decoder embedding after its encoder's last block; their stage all-reduces it too
    tied_blocks: tuple[int, ...] = ()
    active_params: int = 0  # parameters one token uses (MoE: top_k of the routed experts); num_params if dense
    # (tp, sequence parallelism) -> these inputs with the blocks split as the sharding ILP split them, where that
    # differs from Megatron's rule (with_tp_styles); for_tp picks the one a layout runs
    tp_variants: tuple[tuple[tuple[int, bool], ModelCostInputs], ...] = ()
    # bytes per element of the compute dtype (bf16 2; 4 where mlm-run computes in fp32): the weights' compute copy
    # and FSDP's parameter all-gathers (ModelIR.compute_bytes; the activations were captured in it)
    compute_bytes: float = 2.0
    # per sample: activations that skip over blocks, carried across a stage boundary beside the block output
    carried_bytes: float = 0.0
    batch_bytes: float = 0.0  # per sample: the batch tensors on the device (ModelIR.batch_bytes)
    # per sample, what crosses the boundary before each block but the first beside the block input (ModelIR)
    carried_by_boundary: tuple[float, ...] = ()
    # element counts of the parameters outside every layer (a ViT's class token and position table): counted with
    # the first stage's layers, and every other pipeline rank holds a copy, its gradient all-reduced over pp
    root_param_numels: tuple[int, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.block_names)

    @cached_property
    def block_kinds(self) -> tuple[tuple[LayerCost, ...], tuple[int, ...]]:
        """(distinct block costs, each block's index into them): what pricing every block as itself needs, computed
        once per instance. Without block_costs (inputs built by hand) every block is `block`."""
        if not self.block_costs:
            return (self.block,), (0,) * self.num_blocks
        index: dict[tuple, int] = {}
        kinds: list[LayerCost] = []
        of = []
        for c in self.block_costs:
            key = _numbers(c)
            if key not in index:
                index[key] = len(kinds)
                kinds.append(c)
            of.append(index[key])
        return tuple(kinds), tuple(of)

    @cached_property
    def _whole_expert_variants(self) -> dict[bool, ModelCostInputs]:
        return {}

    def with_whole_experts(self, sequence_parallel: bool) -> ModelCostInputs:
        """These inputs with every routed expert whole on each tp rank (_whole_experts), built once per instance
        (the search prices many layouts of one model); `self` for a dense model."""
        if not any(c.expert_params > c.experts_whole for c in (self.block, self.pre, self.post, *self.block_costs)):
            return self
        cache = self._whole_expert_variants
        if sequence_parallel not in cache:
            cache[sequence_parallel] = replace(
                self,
                block=_whole_experts(self.block, sequence_parallel),
                pre=_whole_experts(self.pre, sequence_parallel),
                post=_whole_experts(self.post, sequence_parallel),
                block_costs=tuple(_whole_experts(c, sequence_parallel) for c in self.block_costs),
                tp_variants=(),
            )
        return cache[sequence_parallel]

    @property
    def uniform_blocks(self) -> bool:
        """Whether every block costs the same (then `block` is each of them, and counts per stage say it all)."""
        return len(self.block_kinds[0]) == 1

    @property
    def model_flops_per_sample(self) -> float:
        """Training FLOPs per sample without recompute: 3x forward matmul+attention (Korthikanti et al. 2022)."""
        return 3.0 * (self.pre.model_flops + self.num_blocks * self.block.model_flops + self.post.model_flops)


def summarize(ir: ModelIR, tp_states: TPStates | None = None, sequence_parallel: bool = False) -> ModelCostInputs:
    """Collapse `ir` to per-layer floats: one cost per block, their mean, and the merged layers before / after.
    `tp_states`: the blocks' op states as a tensor-parallel sharding chose them (default: Megatron's rule)."""
    blocks = [layer for layer in ir.layers if layer.kind == "block"]
    if not blocks:
        raise PlanError("the model has no repeated transformer blocks to place on pipeline stages")
    first = ir.layers.index(blocks[0])
    last = ir.layers.index(blocks[-1])
    costs: list[LayerCost] = []

    def own(layer: LayerIR) -> Mapping[str, str] | None:  # every layer the ILP split, blocks or not (a U-Net's)
        return tp_states.get(layer.name) if tp_states else None

    tied_blocks: list[int] = []  # blocks whose own or merged layers hold a tied copy (T5's decoder embedding)
    for layer in ir.layers[first : last + 1]:
        cost = _layer_cost(layer, ir, own(layer), sequence_parallel)
        if layer.kind == "block":
            costs.append(cost)
        else:  # between two stacks (an encoder's final norm): run with the block before it; what the next block
            # reads is computed from the two outputs (a decoder's token and position embeddings, added by root code)
            merged = _merge([costs[-1], cost])
            output = max(costs[-1].output_bytes, cost.output_bytes)
            fixed = max(costs[-1].output_fixed_bytes, cost.output_fixed_bytes)
            costs[-1] = replace(
                merged,
                names=costs[-1].names,
                head_dim=costs[-1].head_dim,
                output_bytes=output,
                output_fixed_bytes=fixed,
            )
        if layer.name in ir.tied_layers and len(costs) - 1 not in tied_blocks:
            tied_blocks.append(len(costs) - 1)
    block = costs[0] if all(_numbers(c) == _numbers(costs[0]) for c in costs) else _mean(costs)
    pre = _merge([_layer_cost(x, ir, own(x), sequence_parallel) for x in ir.layers[:first]])
    # SP's scatter of the first block's input: its backward all-gathers that input's gradient (the hidden state,
    # not the output of whatever layer runs last before the block: a rotary table's in Hugging Face decoders)
    entry = ir.layers[first].activations.layer_input if first > 0 else 0.0
    pre = replace(pre, sp_gather_bytes=entry or (ir.layers[first - 1].output_bytes if first > 0 else 0.0))
    post = _merge([_layer_cost(x, ir, own(x), sequence_parallel) for x in ir.layers[last + 1 :] if x.kind != "block"])
    head = [
        op.in_features * op.out_features
        for layer in ir.layers[last + 1 :]
        if layer.kind == "head"
        for op in layer.linears
        if op.kind == "linear" and op.out_features == ir.vocab_size
    ]
    owned_after = sum(x.params for x in ir.layers[last + 1 :])
    # a tied head's weight is counted at the embedding; with pp > 1 the last stage holds a copy (Megatron)
    tied = float(head[0]) if ir.tied_embeddings and head and owned_after < head[0] else 0.0
    return ModelCostInputs(
        block=block,
        block_names=tuple(b.name for b in blocks),
        pre=pre,
        post=post,
        tied_params=tied,
        tied_blocks=tuple(tied_blocks) if tied else (),
        seq_len=ir.seq_len,
        hidden_size=ir.hidden_size,
        num_heads=ir.num_heads,
        num_kv_heads=ir.num_kv_heads,
        vocab_size=ir.vocab_size,
        num_params=ir.num_params,
        block_costs=tuple(costs),
        active_params=_active_params(ir),
        compute_bytes=float(ir.compute_bytes),
        carried_bytes=float(ir.carried_bytes),
        batch_bytes=float(getattr(ir, "batch_bytes", 0.0)),
        carried_by_boundary=tuple(getattr(ir, "carried_by_boundary", ())),
        root_param_numels=tuple(getattr(ir, "root_param_numels", ())),
    )


def with_tp_styles(inputs: ModelCostInputs, ir: ModelIR, tp: int, sp: bool, states: TPStates) -> ModelCostInputs:
    """`inputs` that also know how the tensor-parallel sharding ILP split the layers at (tp, sp): `states` as
    TPSharding.states. Where every layer op's state is what Megatron's rule gives, nothing is added (the same
    numbers); else the blocks are priced from the ILP's states (a replicated MLP computes whole, or on SP's shard,
    issues no tp collective and all-reduces its weight gradients under SP), and for_tp(…, tp, sp) returns them."""
    if tp == 1 or all(_same_as_megatron(layer, states.get(layer.name)) for layer in ir.layers):
        return inputs
    variant = replace(summarize(ir, states, sp), tp_variants=())
    kept = tuple(v for v in inputs.tp_variants if v[0] != (tp, sp))
    return replace(inputs, tp_variants=(*kept, ((tp, sp), variant)))


def _same_as_megatron(layer: LayerIR, states: Mapping[str, str] | None) -> bool:
    return not states or layer.ops is None or _region_tags(layer) == _region_tags(layer, states)


def for_tp(
    inputs: ModelCostInputs, tp: int, sequence_parallel: bool = False, expert_tp: bool = True
) -> ModelCostInputs:
    """`inputs` as tp runs them: the blocks split as the sharding ILP chose (a tp_variants entry, else Megatron's
    rule), the embedding, head and loss replicated when tp does not divide the vocabulary
    (runtime/tensor_parallel.py: 'replicate' styles; under SP the head's input is gathered and every rank computes
    the whole logits), and, unless `expert_tp` (CostOptions.expert_tensor_parallel), the routed experts whole on
    every tp rank, as mlm-run runs them."""
    for key, variant in inputs.tp_variants:
        if key == (tp, sequence_parallel):
            inputs = variant
            break
    if tp > 1 and not expert_tp:
        inputs = inputs.with_whole_experts(sequence_parallel)
    if tp == 1 or not any(c.vocab_size % tp for c in (inputs.pre, inputs.post) if c.vocab_size):
        return inputs
    return replace(inputs, pre=_replicated_vocab(inputs.pre, tp), post=_replicated_vocab(inputs.post, tp))


def sp_param_elems(c: LayerCost, ep: int) -> float:
    """c.sp_param_elems on one rank: with ep > 1 it holds 1/ep of the whole routed experts that _whole_experts put
    there (under SP, their gradients all-reduced over tp)."""
    return c.sp_param_elems - c.experts_whole * (1.0 - 1.0 / ep) if ep > 1 else c.sp_param_elems


def _whole_experts(c: LayerCost, sp: bool) -> LayerCost:
    """`c` with its routed experts kept whole on every tp rank (mlm-run: tensor parallelism leaves the expert banks
    unsharded): they compute all the tokens the tp group shares and reduce nothing over tp; under SP they run on
    the rank's token shard, and each expert weight's gradient, a partial sum over the shards, is all-reduced over
    tp as the SP norms' are (sp_param_*)."""
    moved = c.expert_params - c.experts_whole
    if not moved and not c.expert_tp_count:
        return c
    gemms = tuple(
        replace(g, split="sequence" if sp else "replicate") if g.expert and g.split in ("col", "row") else g
        for g in c.gemms
    )
    return replace(
        c,
        gemms=gemms,
        params_sharded=max(c.params_sharded - moved, 0.0),
        params_replicated=c.params_replicated + moved,
        experts_whole=c.expert_params,
        sp_param_count=c.sp_param_count + (c.expert_tensor_count if sp else 0),
        sp_param_elems=c.sp_param_elems + (moved if sp else 0.0),
        act_sharded=c.act_sharded - c.expert_act,
        act_replicated=c.act_replicated + c.expert_act,
        mem_sharded=c.mem_sharded - c.expert_mem,
        mem_replicated=c.mem_replicated + c.expert_mem,
        tp_fwd_count=max(c.tp_fwd_count - c.expert_tp_count, 0),
        tp_fwd_bytes=max(c.tp_fwd_bytes - c.expert_tp_bytes, 0.0),
        tp_bwd_count=max(c.tp_bwd_count - c.expert_tp_count, 0),
        tp_bwd_bytes=max(c.tp_bwd_bytes - c.expert_tp_bytes, 0.0),
        expert_act=0.0,
        expert_mem=0.0,
        expert_tp_count=0,
        expert_tp_bytes=0.0,
    )


def tied_stages(inputs: ModelCostInputs, blocks_per_stage: tuple[int, ...] | list[int]) -> set[int]:
    """The (virtual) stages holding a copy of the tied weight when pp > 1: the first (the embedding), the last (the
    tied head) and those holding one of inputs.tied_blocks; empty without a tied head."""
    if not inputs.tied_params or len(blocks_per_stage) < 2:
        return set()
    out, start = {0, len(blocks_per_stage) - 1}, 0
    for i, n in enumerate(blocks_per_stage):
        if any(start <= b < start + n for b in inputs.tied_blocks):
            out.add(i)
        start += n
    return out


def vocab_shards(inputs: ModelCostInputs, tp: int) -> int:
    """How many ranks split a vocabulary-sized weight (a tied embedding's copy): tp when it divides the vocabulary."""
    return tp if inputs.vocab_size and inputs.vocab_size % tp == 0 else 1


def _replicated_vocab(c: LayerCost, tp: int) -> LayerCost:
    if not c.vocab_size or c.vocab_size % tp == 0:
        return c
    gemms = tuple(replace(g, split="replicate") if g.split == "vocab" else g for g in c.gemms)
    # the head's input (what its backward all-reduce carried) is gathered once under SP instead
    head_input = c.tp_bwd_bytes if any(g.split == "vocab" for g in c.gemms) else 0.0
    whole = c.act_sharded + c.act_replicated  # logits and their loss on the whole sequence, on every rank
    return replace(
        c,
        gemms=gemms,
        params_sharded=0.0,
        params_replicated=c.params_sharded + c.params_replicated,
        act_sharded=0.0,
        act_replicated=whole,
        act_gathered=whole if head_input else min(c.act_gathered, whole),
        mem_sharded=0.0,
        mem_replicated=c.mem_sharded + c.mem_replicated,
        tp_fwd_count=0,
        tp_fwd_bytes=0.0,
        tp_bwd_count=0,
        tp_bwd_bytes=0.0,
        tp_fixed_count=0,
        tp_fixed_bytes=0.0,
        sp_gather_bytes=c.sp_gather_bytes + head_input,
    )


def _active_params(ir: ModelIR) -> int:
    active = getattr(ir, "active_params", None)  # IRs pickled before MoE support lack the property's inputs
    return int(active) if isinstance(active, int) else ir.num_params


# ---- one layer ---------------------------------------------------------------------------------------------------


def _layer_cost(layer: LayerIR, ir: ModelIR, states: Mapping[str, str] | None = None, sp: bool = False) -> LayerCost:
    """`states`: the ILP's op states for a block under tp (None: Megatron's rule); `sp`: sequence parallelism,
    which decides how a replicated linear runs (on the token shard) when `states` has one."""
    a = layer.activations
    kind = layer.kind
    vocab = kind in ("head", "loss")
    tags = _region_tags(layer, states)
    if states:
        a = _resplit(layer, a, tags)
    gemms, sharded_params, fwd, bwd = _linears(layer, ir, tags, sp)
    gathered = bwd[1]  # distinct inputs of the column-parallel linears (before any MoE term)
    moe = getattr(layer, "moe", None)
    routed = dispatch = counts_bytes = out_bytes = expert_act = expert_mem = 0.0
    moe_layers = 0
    if moe is not None:
        experts, routed, out_bytes = _experts(moe, ir.compute_bytes)
        gemms, sharded_params = gemms + experts, sharded_params + routed
        fwd, bwd = (fwd[0] + 1, fwd[1] + out_bytes), (bwd[0] + 1, bwd[1] + out_bytes)
        dispatch = out_bytes * max(moe.top_k, 1) * moe.capacity_factor
        moe_layers, counts_bytes = 1, 8.0 * moe.num_experts
        saved, moved = row_elements(moe)
        expert_act = routed_rows(moe) * saved * ir.compute_bytes
        expert_mem = min(routed_rows(moe) * moved * ir.compute_bytes, layer.bytes_moved)
    mem_s, core = _memory_split(layer, ir.seq_len, kind, tags)
    dense_mem = layer.bytes_moved - expert_mem  # the op graph's split weighs the dense ops; the experts' are sharded
    fixed = (0, 0.0)
    if kind == "embedding":  # the vocabulary-parallel lookup's all-reduce (a replicated output, with or without SP)
        fixed, fwd = fwd, (0, 0.0)
    if kind == "loss" and _vocabulary_head(ir):  # loss_parallel over the vocabulary-parallel logits
        fixed = (LOSS_REDUCTIONS, LOSS_REDUCTIONS * FP32_BYTES * ir.seq_len)  # one float per token
    sp_count, sp_elems = _sequence_parallel_params(layer, tags, ir.vocab_size)
    head_count, head_elems = _head_params(layer, tags)
    tail = int(kind == "block" and fwd[0] > 0 and _saves_after_last_reduction(layer, tags))
    sharded = a.sharded if kind != "loss" else a.sharded + a.replicated
    replicated = a.replicated if kind != "loss" else 0.0
    return LayerCost(
        names=(layer.name,),
        gemms=gemms,
        attn_flops=layer.flops_attention,
        attn_full_flops=layer.flops_attention_full,
        attn_materialized=a.attn_core > 0,
        head_dim=ir.hidden_size // max(ir.num_heads, 1),
        mem_sharded=layer.bytes_moved if vocab else dense_mem * mem_s + expert_mem,
        mem_replicated=0.0 if vocab else dense_mem * (1.0 - mem_s),
        core_bytes=core,
        act_sharded=sharded,
        act_replicated=replicated,
        act_core=a.attn_core,
        act_input=a.layer_input,
        act_gathered=min(gathered, replicated),
        output_bytes=layer.output_bytes,
        output_fixed_bytes=layer.output_fixed_bytes,
        params_sharded=float(min(sharded_params, layer.params)),
        params_replicated=float(layer.params - min(sharded_params, layer.params)),
        tp_fwd_count=fwd[0],
        tp_fwd_bytes=fwd[1],
        tp_bwd_count=bwd[0],
        tp_bwd_bytes=bwd[1],
        tp_fixed_count=fixed[0],
        tp_fixed_bytes=fixed[1],
        tp_recompute_tail_count=tail,
        sp_param_count=sp_count,
        sp_param_elems=sp_elems,
        head_param_count=head_count,
        head_param_elems=head_elems,
        vocab_size=ir.vocab_size if kind in ("embedding", "head", "loss") else 0,
        loss_logits_bytes=float(FP32_BYTES * ir.seq_len * ir.vocab_size) if kind == "loss" else 0.0,
        model_flops=layer.flops_matmul + layer.flops_attention,
        expert_params=routed,
        expert_act=min(expert_act, sharded),
        expert_mem=expert_mem,
        expert_tp_count=moe_layers,
        expert_tp_bytes=out_bytes,
        expert_tensor_count=moe.expert_tensors if moe is not None else 0,
        dispatch_bytes=dispatch,
        moe_layer_count=moe_layers,
        expert_counts_bytes=counts_bytes,
        kv_bytes=_kv_bytes(layer, ir),
    )


def _kv_bytes(layer: LayerIR, ir: ModelIR) -> float:
    """K and V bytes of the layer's attention ops per sample, as the attention kernel receives them (what context
    parallelism gathers). An attention op of output (b, h, s, d_v) costs 2·b·h·s²·(d_qk + d_v) FLOPs (ops.py), so
    its K and V hold kv_heads·s·(d_qk + d_v) elements: the real head dims (MLA's d_qk ≠ d_v), with the heads its
    key has at the call (grouped-query K/V the model repeats before the call, as Hugging Face does with a mask,
    arrive with the query's heads; with enable_gqa, with the model's kv heads)."""
    g = layer.ops
    total = 0.0
    if g is not None:
        for _, d in g.nodes(data=True):
            shape = d.get("shape", ())
            if d.get("kind") != "attention" or len(shape) < 3 or not shape[-2]:
                continue
            heads = shape[-3] if len(shape) >= 3 else 1
            kv_heads = d.get("kv_heads") or min(ir.num_kv_heads or heads, heads)
            total += ir.compute_bytes * d.get("flops", 0.0) * kv_heads / (2.0 * heads * shape[-2])
        return total
    head_dim = ir.head_dim or ir.hidden_size // max(ir.num_heads, 1)
    return len(layer.attention) * ir.compute_bytes * 2.0 * ir.num_kv_heads * head_dim * ir.seq_len


def _saves_after_last_reduction(layer: LayerIR, tags: dict[str, str]) -> bool:
    """Whether an op computed from the block's last row-parallel output saves a tensor for backward: torch's
    non-reentrant checkpoint recomputes up to the last saved tensor, so that reduction is then repeated too."""
    g = layer.ops
    if g is None:
        return False
    rows = [
        n
        for n, d in g.nodes(data=True)
        if d.get("kind") == "linear" and tags.get(n) != "S" and any(tags.get(p) == "S" for p in g.predecessors(n))
    ]
    return bool(rows) and any(g.nodes[x].get("saved", 0.0) > 0 for x in nx.descendants(g, rows[-1]))


def _vocabulary_head(ir: ModelIR) -> bool:
    """Whether a head projects onto the vocabulary (priced vocabulary-parallel under tp; the loss then runs on the
    sharded logits). A U-Net's or a regression model's loss has no such head and reduces nothing over tp."""
    return bool(ir.vocab_size) and any(
        op.kind == "linear" and op.out_features == ir.vocab_size
        for layer in ir.layers
        if layer.kind == "head"
        for op in layer.linears
    )


def _linears(
    layer: LayerIR, ir: ModelIR, tags: dict[str, str], sp: bool
) -> tuple[tuple[Gemm, ...], float, tuple[int, float], tuple[int, float]]:
    """GEMMs with their tp split, tp-sharded parameter count, and the forward / backward all-reduces."""
    gemms: list[Gemm] = []
    sharded = 0.0
    fwd_n, fwd_b, bwd_n, bwd_b = 0, 0.0, 0, 0.0
    if layer.kind == "block":
        splits, inputs = _block_splits(layer, tags, sp, ir.compute_bytes)
        # an embedding inside a block (T5's relative-position bias) is a replicated lookup, not a GEMM
        for op, split in zip([op for op in layer.linears if op.kind == "linear"], splits):
            gemms.append(Gemm(op.rows, op.in_features, op.out_features, split))
            if split in ("col", "row"):
                sharded += op.in_features * op.out_features + (op.out_features if op.has_bias and split == "col" else 0)
            if split == "row":  # g: all-reduce the row-parallel output in forward
                fwd_n, fwd_b = fwd_n + 1, fwd_b + ir.compute_bytes * op.rows * op.out_features
        for size in inputs:  # f: all-reduce the input gradient of each group of column-parallel linears
            bwd_n, bwd_b = bwd_n + 1, bwd_b + size
        return tuple(gemms), sharded, (fwd_n, fwd_b), (bwd_n, bwd_b)
    for op in layer.linears:
        if op.kind == "embedding":
            if op.in_features == ir.vocab_size:  # vocab-parallel lookup: masked partial sums, all-reduced
                sharded += op.in_features * op.out_features
                fwd_n, fwd_b = fwd_n + 1, fwd_b + ir.compute_bytes * op.rows * op.out_features
            continue
        if op.out_features == ir.vocab_size:  # vocab-parallel head: input gradient all-reduced in backward
            gemms.append(Gemm(op.rows, op.in_features, op.out_features, "vocab"))
            sharded += op.in_features * op.out_features
            bwd_n, bwd_b = bwd_n + 1, bwd_b + ir.compute_bytes * op.rows * op.in_features
        else:
            gemms.append(Gemm(op.rows, op.in_features, op.out_features, "replicate"))
    return tuple(gemms), sharded, (fwd_n, fwd_b), (bwd_n, bwd_b)


def _experts(moe: MoEIR, elem_bytes: int) -> tuple[tuple[Gemm, ...], float, float]:
    """The routed experts' GEMMs (all tokens·top_k·capacity rows as one grouped GEMM per expert weight; the first
    GEMMs, which read the hidden state, column-split, the later ones row-split under tp), their parameters, and the
    bytes of the combined output that the row-split experts all-reduce (one per direction)."""
    rows = moe.tokens * max(moe.top_k, 1) * moe.capacity_factor
    hidden = moe.expert_gemms[0].in_features if moe.expert_gemms else 0
    gemms = tuple(
        Gemm(rows, g.in_features, g.out_features, "col" if g.in_features == hidden else "row", expert=True)  # type: ignore[arg-type]
        for g in moe.expert_gemms
    )
    return gemms, float(moe.routed_params), float(elem_bytes * moe.tokens * hidden)


def _block_splits(
    layer: LayerIR, tags: dict[str, str], sp: bool = False, elem_bytes: int = 2
) -> tuple[list[Split], list[float]]:
    """The tp split of each block linear, read off the op graph's tags (_region_tags): a linear whose output is
    split is column-parallel, one reading a split tensor row-parallel, any other replicated (on SP's token shard
    under sequence parallelism); and, for backward, the bytes of each distinct input feeding column-parallel
    linears. Without an op graph: GPT's pattern, alternating column/row linears and two all-reduces of the residual
    stream each way."""
    g = layer.ops
    linears = [op for op in layer.linears if op.kind == "linear"]
    residual = elem_bytes * (linears[0].rows * linears[0].in_features if linears else 0)
    if g is None or sum(1 for _, d in g.nodes(data=True) if d.get("kind") == "linear") != len(linears):
        return ["col" if i % 2 == 0 else "row" for i in range(len(linears))], [residual] * 2
    splits: list[Split] = []
    inputs: list[float] = []
    seen = set()
    ops = iter(linears)  # the op graph's linear nodes, in the same order
    for n, d in g.nodes(data=True):
        if d.get("kind") != "linear":
            continue
        op = next(ops)
        col = tags[n] == "S"
        if not col:  # a linear reading a region's tensor is row-parallel and leaves the region
            row = any(tags.get(p) == "S" for p in g.predecessors(n))
            splits.append("row" if row else "sequence" if sp else "replicate")
            continue
        splits.append("col")
        preds = tuple(sorted(g.predecessors(n)))
        if d.get("grad_free_input"):  # reads model inputs only (through param-free ops): no gradient to all-reduce
            continue
        if preds not in seen:  # the input as the linear reads it (a norm computing in fp32 casts back first)
            seen.add(preds)
            inputs.append(float(elem_bytes * op.rows * op.in_features))
    return splits, inputs


def _region_tags(layer: LayerIR, states: Mapping[str, str] | None = None) -> dict[str, str]:
    """Per op-graph node in graph order: "S" inside a tensor-parallel region (split over tp ranks: a column-parallel
    linear's output and what is computed from it), "R" on the residual stream (a row-parallel linear's output, an
    embedding, everything computed outside a region; whole, or sequence-sharded under SP). Megatron's rule, with
    the ILP's own states where `states` gives them (its S is S; R and SP's Q are R)."""
    g = layer.ops
    tags: dict[str, str] = {}
    if g is None:
        return tags
    for n, d in g.nodes(data=True):
        if states and n in states:
            tags[n] = "S" if states[n] == "S" else "R"
            continue
        inside = any(tags.get(p) == "S" for p in g.predecessors(n))
        k = d.get("kind")
        tags[n] = ("R" if inside else "S") if k == "linear" else "R" if k == "embedding" else "S" if inside else "R"
    return tags


def _resplit(layer: LayerIR, a: Activations, tags: dict[str, str]) -> Activations:
    """The layer's saved activations split by `tags` instead of Megatron's rule: the bytes the op graph attributes
    to each node (its `saved`) move between sharded and replicated where the two disagree; bytes no node holds
    (views of inputs, extra expert terms) stay where capture put them."""
    g = layer.ops
    if g is None:
        return a
    megatron = _region_tags(layer)
    to_s = sum(d.get("saved", 0.0) for n, d in g.nodes(data=True) if tags[n] == "S" and megatron[n] != "S")
    to_r = sum(d.get("saved", 0.0) for n, d in g.nodes(data=True) if tags[n] != "S" and megatron[n] == "S")
    sharded = max(a.sharded + to_s - to_r, 0.0)
    return replace(
        a, sharded=sharded, replicated=a.replicated + a.sharded - sharded, attn_core=min(a.attn_core, sharded)
    )


def _sequence_parallel_params(layer: LayerIR, tags: dict[str, str], vocab_size: int = 0) -> tuple[int, float]:
    """(tensors, elements) of the parameters that runtime/tensor_parallel.py gives SequenceParallel under SP: those
    read by a final norm layer, those read by a block's residual-stream ops (outside the tp regions: norms), and
    a replicated linear's (one that neither reads nor writes a split tensor: it computes the token shard); in a
    head layer, those read before the vocabulary projection (BERT's transform: a replicated linear and a norm on
    the token shard; a head that is one linear, a layer of its own, reads its input whole)."""
    g = layer.ops
    if g is not None and layer.kind == "head":

        def on_shard(_n: str, d: dict) -> bool:
            if d.get("kind") == "linear":
                module = d.get("module") or ""
                return module != layer.name and not (vocab_size and d["shape"] and d["shape"][-1] == vocab_size)
            return d.get("kind") == "norm"

        return _params_read(layer, on_shard)
    if g is None or layer.kind not in ("block", "norm"):
        return 0, 0.0

    def kept(n: str, d: dict) -> bool:
        k = d.get("kind")
        whole = tags[n] == "R" and not any(tags.get(p) == "S" for p in g.predecessors(n))
        return (
            layer.kind == "norm" or (tags[n] == "R" and k != "linear" and k != "embedding") or (k == "linear" and whole)
        )

    return _params_read(layer, kept)


def _head_params(layer: LayerIR, tags: dict[str, str]) -> tuple[int, float]:
    """(tensors, elements) of the parameters read by non-linear ops inside a tp region (a per-head norm's weight),
    which runtime/tensor_parallel.py replicates with style "heads"."""
    if layer.ops is None or layer.kind != "block":
        return 0, 0.0
    return _params_read(layer, lambda n, d: tags.get(n) == "S" and d.get("kind") not in ("linear", "embedding"))


def _params_read(layer: LayerIR, kept: Callable[[str, dict], bool]) -> tuple[int, float]:
    """(tensors, elements) of the distinct parameters read by the op-graph nodes `kept` selects; a batch-independent
    node (Gemma's 1 + weight) is skipped: the op that uses its result decides."""
    assert layer.ops is not None
    found: dict[str, int] = {}
    for n, d in layer.ops.nodes(data=True):
        if not d.get("constant") and kept(n, d):
            found.update(d.get("params", ()))
    return len(found), float(sum(found.values()))


def _memory_split(layer: LayerIR, seq: int, kind: str, tags: dict[str, str]) -> tuple[float, float]:
    """Fraction of memory-bound bytes inside the tp region, and the attention core's memory-bound bytes.

    The IR gives one bytes_moved per layer; the op graph gives each op's output bytes and region, which we use as
    weights for the split. Core bytes: ops on seq x seq tensors (scale, mask, softmax, dropout), read + write."""
    g = layer.ops
    if g is None or kind != "block":
        total = layer.activations.total
        return (layer.activations.sharded / total if total else 0.0), 0.0
    moved = {"S": 0.0, "R": 0.0}
    core = 0.0
    for n, d in g.nodes(data=True):
        k = d.get("kind")
        if k in ("linear", "matmul", "embedding"):
            continue
        moved[tags[n]] += d.get("bytes", 0.0)
        shape = d.get("shape", ())
        if k != "attention" and len(shape) >= 4 and shape[-1] == seq and shape[-2] == seq:
            core += 2.0 * d.get("bytes", 0.0)
    total = moved["S"] + moved["R"]
    return (moved["S"] / total if total else 0.0), core


# ---- merging -----------------------------------------------------------------------------------------------------


def _numbers(c: LayerCost) -> tuple:
    return tuple(getattr(c, f.name) for f in fields(c) if f.name != "names")


def _merge(costs: list[LayerCost]) -> LayerCost:
    """Sum several layers into one (their GEMMs concatenated)."""
    out = LayerCost(names=())
    for c in costs:
        out = replace(
            out,
            names=out.names + c.names,
            gemms=out.gemms + c.gemms,
            attn_materialized=out.attn_materialized or c.attn_materialized,
            head_dim=max(out.head_dim, c.head_dim),
            vocab_size=max(out.vocab_size, c.vocab_size),
            **{
                f.name: getattr(out, f.name) + getattr(c, f.name)
                for f in fields(c)
                if f.name not in ("names", "gemms", "attn_materialized", "head_dim", "vocab_size")
            },
        )
    return out


def _mean(costs: list[LayerCost]) -> LayerCost:
    """Average of differing blocks (for the parts of the cost model that treat blocks as interchangeable): every
    block's GEMMs are kept, identical ones pooled, with rows scaled by the share of blocks that run them."""
    total = _merge(costs)
    n = len(costs)
    numeric = {
        f.name: getattr(total, f.name) / n
        for f in fields(total)
        if f.name not in ("names", "gemms", "attn_materialized", "head_dim", "vocab_size")
        and not f.name.endswith("_count")
    }
    pooled: dict[tuple, int] = {}
    for g in total.gemms:
        key = (g.rows, g.k, g.n, g.split, g.expert)
        pooled[key] = pooled.get(key, 0) + 1
    gemms = tuple(
        Gemm(rows * count / n, k, m, split, expert)  # type: ignore[arg-type]
        for (rows, k, m, split, expert), count in pooled.items()
    )
    return replace(
        costs[0],
        **numeric,
        gemms=gemms,
        attn_materialized=total.attn_materialized,
        **{f.name: round(getattr(total, f.name) / n) for f in fields(total) if f.name.endswith("_count")},
    )


def cp_share(inputs: ModelCostInputs, cp: int) -> ModelCostInputs:
    """What one of cp context-parallel ranks computes, moves and keeps of each sample: every token-proportional
    term ÷cp (GEMM rows; attention score work, balanced by the 2·cp causal chunks; bytes; activations, but the
    gathered K/V the attention saves; tp, pp, all-to-all and K/V traffic); parameters, collective counts and the
    model FLOPs (what MFU counts) stay whole, and so do the layers before the first block (the embeddings, which
    mlm-run runs on the whole sequence before cutting it)."""
    if cp == 1:
        return inputs

    def local(c: LayerCost) -> LayerCost:
        scaled = {name: getattr(c, name) / cp for name in _TOKEN_FIELDS}
        # the attention saves the all-gathered K/V of the whole sequence, not its chunk (runtime/context_parallel.py)
        scaled["act_sharded"] += c.kv_bytes * (cp - 1) / cp
        gemms = tuple(replace(g, rows=g.rows / cp) for g in c.gemms)  # type: ignore[arg-type]
        return replace(c, gemms=gemms, **scaled)

    return replace(
        inputs,
        block=local(inputs.block),
        # the embeddings run on the whole sequence (runtime/context_parallel.py); the first block's input is cut to
        # the rank's part before sequence parallelism scatters it, so the backward gathers that part
        pre=replace(inputs.pre, sp_gather_bytes=inputs.pre.sp_gather_bytes / cp),
        post=local(inputs.post),
        block_costs=tuple(local(c) for c in inputs.block_costs),
    )


_TOKEN_FIELDS = (
    "attn_flops",
    "attn_full_flops",
    "mem_sharded",
    "mem_replicated",
    "core_bytes",
    "act_sharded",
    "act_replicated",
    "act_gathered",
    "act_core",
    "act_input",
    "output_bytes",
    "output_fixed_bytes",
    "tp_fwd_bytes",
    "tp_bwd_bytes",
    "tp_fixed_bytes",
    "sp_gather_bytes",
    "dispatch_bytes",
    "kv_bytes",
    "expert_act",
    "expert_mem",
    "expert_tp_bytes",
    "loss_logits_bytes",
)
