"""Tensor-parallel sharding decided from the graph: a small ILP per distinct block (Alpa-style intra-op search).

Each compute op of a block's dataflow graph (LayerIR.ops) picks a *strategy*: the sharding state it wants its
activation inputs in and the state its output comes out in. Tensor states:

    R  replicated on every tp rank
    S  split on the feature / head dimension (the output of a column-split linear; attention on local heads)
    Q  split on the sequence dimension (sequence parallelism only; the residual stream and norms)

Strategies are restricted to what the runtime can execute from the plan's styles (torch's ColwiseParallel /
RowwiseParallel / SequenceParallel with their input and output layouts): collectives happen only at a linear's
input or output; between other ops (user code: adds, activations, rotary, attention) tensors pass unchanged, so
producer and consumer states must agree.

    linear  colwise   R -> S          (SP: Q -> S, one all-gather of the input, shared by all colwise readers)
            rowwise   S -> R  all-reduce of the partial sum      (SP: S -> Q, reduce-scatter)
            replicate R -> R  (SP: also Q -> Q; a linear is tokenwise)
            colwise+gather R -> S -> R  all-gather of the output (only with allow_gather; needs `layouts`, which
                      the plan's style names cannot express)
    attention / activation-activation matmul: S (local heads: num_heads and num_kv_heads divisible by tp) or R
    norms, reductions, ops with a weight (norm scale): R or Q;  other elementwise ops: R, S or Q

Formulation. V: the block's non-constant ops, E: dataflow edges between them, K(v): the strategies of v, each k
with states in(k), out(k) and cost c(v, k); G: the tensors read by a linear (the block input counted as one).

    min   sum_{v, k} c(v, k) x[v, k]  +  sum_{u in G} AG(u) g[u]
    s.t.  sum_k x[v, k] = 1                                         for all v              (one strategy)
          sum_{k: out(k)=s} x[u, k] = sum_{k: in(k)=s} x[v, k]      for all (u, v) in E, s (edge consistency)
          sum_{k: in(k)=r0} x[v, k] = 1                              v reads the block input (boundary)
          sum_{k: out(k)=r0} x[t, k] = 1                             t the block output     (boundary)
          g[u] >= x[v, k]                   (u, v) in E, k a strategy of v that all-gathers u  (shared gather)
          family(x[v, .]) = family(x[w, .])                          v, w calls of one module (one style)
          x[v, k] in {0, 1},  g[u] in {0, 1};   r0 = Q with sequence parallelism, else R

Infeasible strategies (features or heads not divisible by tp) are not created. The cost, in seconds per sample of
forward + backward, is  c(v, k) = 2 * comm(k) / link  +  (1 - 1/tp) * [3 * flops(v) / peak  +  3 * bytes(v) / hbm]
for a replicated op  +  (1 - 1/tp) * 16 * params(v) * memory_weight  for a replicated linear, with ring collectives:
all-reduce 2 (tp-1)/tp N bytes, all-gather and reduce-scatter (tp-1)/tp N (backward repeats the volume).

What the runtime executes (runtime/tensor_parallel.py) for these styles: a block's attention and MLP modules are
tensor-parallel regions whose input is gathered once (the shared gather above), colwise linears return this rank's
columns as local tensors and attention runs on local heads; a colwise linear whose output is split into equal
chunks (fused q|k|v, gate|up; shard_splits) is sharded per chunk, so "colwise" needs no separate fused style;
unequal chunks (a fused q|k|v under grouped-query attention, Phi-3's qkv_proj) too, with the rows reordered.

Capture marks the ops that read the block's input (`reads_input`) and those that do not depend on the batch
(`constant`). For graphs without those marks, which ops read the input is inferred: roots of full activation size,
ops whose output is larger than all their graph inputs (x * rsqrt(mean(x^2))), and single-input binary ops of
the residual's shape (x + f(x)). Ops fed only by constants (rotary tables, masks) are left out: replicated, broadcast.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import networkx as nx
import pulp

from mlm.planner.capture.graph import LayerIR, ModelIR
from mlm.planner.errors import Infeasible, PlanError

Style = Literal["colwise", "rowwise", "replicate", "vocab", "sequence", "heads", "rows"]
R, S, Q = "R", "S", "Q"
REDUCTIONS = frozenset(
    {
        "mean",
        "sum",
        "var",
        "std",
        "amax",
        "amin",
        "max",
        "min",
        "norm",
        "logsumexp",
        "prod",
        "var_mean",
        "argmax",
        "argmin",
        "cumsum",
    }
)
BINARY = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "where",
        "maximum",
        "minimum",
        "masked_fill",
        "addcmul",
        "addcdiv",
        "lerp",
        "rsub",
        "true_divide",
        "pow_tensor",
        "copysign",
        "atan2",
        "fmod",
    }
)
STATE_BYTES_PER_PARAM = 16  # bf16 weight + grad, fp32 master weight and two Adam moments


@dataclass(frozen=True)
class TPCost:
    """Hardware numbers the objective converts bytes and FLOPs with (defaults: A100 SXM on NVLink)."""

    bf16_tflops: float = 312.0
    hbm_gbps: float = 2039.0
    link_gbps: float = 300.0  # the tp group's per-GPU collective bandwidth
    memory_weight_s_per_gib: float = 1e-3  # seconds charged per GiB of per-GPU parameter state left unsharded

    @classmethod
    def from_profiles(cls, gpu: Any, link_gbps: float | None = None, **kw: float) -> TPCost:
        """From a profiles.GPUProfile (bf16_tflops, hbm_gbps, nvlink_gbps)."""
        return cls(
            bf16_tflops=gpu.bf16_tflops,
            hbm_gbps=gpu.hbm_gbps,
            link_gbps=link_gbps if link_gbps is not None else gpu.nvlink_gbps,
            **kw,
        )


@dataclass(frozen=True)
class Collective:
    """One forward collective of a layer; tensor_bytes is the full (unsharded) tensor at micro-batch 1."""

    kind: Literal["all-reduce", "all-gather", "reduce-scatter"]
    module: str  # the linear whose input or output it converts
    tensor_bytes: float


@dataclass(frozen=True)
class Strategy:
    name: str  # col, row, rep, colg (colwise + gathered output), or a state letter for non-linear ops
    style: str  # the plan style of a linear: colwise | rowwise | replicate
    inp: str
    out: str
    gathers_input: bool = False  # all-gathers its Q input (cost shared among the readers of that tensor)
    collective: str | None = None  # a collective on its own output


@dataclass(frozen=True)
class TPSharding:
    """The solved tensor-parallel layout of a model; styles go into plan.json's tensor_parallel map."""

    tp: int
    sequence_parallel: bool
    styles: dict[str, str]  # module FQN -> colwise | rowwise | replicate | vocab | sequence, every block
    collectives: dict[str, tuple[Collective, ...]]  # forward collectives per solved layer (FQN of the layer)
    layouts: dict[str, tuple[str, str]] = field(default_factory=dict)  # linear FQN -> (input, output) state
    shard_splits: dict[str, tuple[int, ...]] = field(default_factory=dict)  # fused outputs: shard each chunk
    # block name -> op-graph node -> the state its output is in (R, S or Q): what the cost model prices the block
    # with (cost/inputs.py with_tp_styles), so the layout is costed with the styles plan.json carries
    states: dict[str, dict[str, str]] = field(default_factory=dict)
    solve_seconds: float = 0.0
    solver: str = ""
    explanation: str = ""
    notes: tuple[str, ...] = ()  # what a user should know (attention left replicated, and why): plan warnings

    def block_collectives(self, ir: ModelIR) -> tuple[Collective, ...]:
        blocks = ir.blocks
        return self.collectives.get(blocks[0].name, ()) if blocks else ()

    def collectives_per_block(self, ir: ModelIR) -> int:
        return len(self.block_collectives(ir))

    def comm_bytes_per_block(self, ir: ModelIR) -> float:
        return sum(c.tensor_bytes for c in self.block_collectives(ir))

    def patterns(self, ir: ModelIR) -> dict[str, str]:
        """The styles with block indices replaced by '*' where every block agrees (a compact tensor_parallel)."""
        out: dict[str, str] = {}
        blocks = ir.blocks
        if not blocks:
            return dict(self.styles)
        group = blocks[0].block_group or blocks[0].name.rsplit(".", 1)[0]
        names = [b.name for b in blocks]
        seen: dict[str, set[str]] = {}
        for fqn, style in self.styles.items():
            owner = next((n for n in names if fqn.startswith(n + ".")), None)
            key = f"{group}.*{fqn[len(owner) :]}" if owner else fqn
            seen.setdefault(key, set()).add(style)
        for fqn, style in self.styles.items():
            owner = next((n for n in names if fqn.startswith(n + ".")), None)
            key = f"{group}.*{fqn[len(owner) :]}" if owner else fqn
            if owner and len(seen[key]) == 1:
                out[key] = style
            else:
                out[fqn] = style
        return out


def plan_tensor_parallel(
    ir: ModelIR,
    tp: int,
    sequence_parallel: bool = False,
    solver: str = "cbc",
    time_limit_s: float = 10.0,
    allow_gather: bool = False,
    cost: TPCost | None = None,
) -> TPSharding:
    """Choose colwise / rowwise / replicate for every linear of every block by the ILP in the module docstring;
    vocab-parallel embedding and output head when the vocabulary divides by tp; norms 'sequence' under SP."""
    if tp < 1:
        raise PlanError(f"tensor-parallel size must be >= 1, got {tp}")
    cost = cost or TPCost()
    start = time.perf_counter()
    styles: dict[str, str] = {}
    collectives: dict[str, tuple[Collective, ...]] = {}
    layouts: dict[str, tuple[str, str]] = {}
    splits: dict[str, tuple[int, ...]] = {}
    states: dict[str, dict[str, str]] = {}
    notes: dict[str, list[str]] = {}  # note -> the layers it is about
    solved: dict[int, tuple[LayerIR, _BlockSolution]] = {}
    for layer in ir.layers:
        if layer.kind == "embedding":
            for op in layer.linears:
                vocab = op.kind == "embedding" and op.token_ids and op.in_features == ir.vocab_size
                vocab = vocab and op.in_features % tp == 0
                styles[op.fqn] = "vocab" if vocab and tp > 1 else "replicate"
        elif layer.kind == "head":
            for op in layer.linears:
                vocab = op.out_features == ir.vocab_size and op.out_features % tp == 0
                styles[op.fqn] = "vocab" if vocab and tp > 1 else "replicate"
            if sequence_parallel and tp > 1 and layer.ops is not None:
                # a head that transforms the residual before its projection (BERT's dense, GELU, LayerNorm) runs
                # that on the token shard: its norms are sequence-parallel (their gradients summed over tp)
                for _, d in layer.ops.nodes(data=True):
                    if d["kind"] == "norm" and d["module"] and not d.get("constant"):
                        styles[d["module"]] = "sequence"
        elif layer.kind == "norm":
            if sequence_parallel and tp > 1:
                styles[layer.name] = "sequence"
        elif layer.ops is not None and layer.linears:
            key = id(layer.ops)
            if key not in solved:
                sol = _solve_layer(layer, ir, tp, sequence_parallel, solver, time_limit_s, allow_gather, cost)
                solved[key] = (layer, sol)
            owner, sol = solved[key]
            for note in sol.notes:
                notes.setdefault(note, []).append(layer.name)
            rename = _renamer(owner.name, layer.name)
            styles.update({rename(m): s for m, s in sol.styles.items()})
            layouts.update({rename(m): lay for m, lay in sol.layouts.items()})
            splits.update({rename(m): sp for m, sp in sol.splits.items()})
            states[layer.name] = sol.states  # node names are the shared graph's: no renaming
            moe = getattr(layer, "moe", None)
            if sequence_parallel and moe is not None:
                # routed experts stay whole on every tp rank; under SP they run on the rank's token shard, so
                # each expert weight's gradient is a partial sum over tp: style "rows" (replicated weights applied
                # to the rank's local rows, gradients summed over tp)
                styles.update(dict.fromkeys(moe.expert_modules, "rows"))
            collectives[layer.name] = tuple(
                Collective(c.kind, rename(c.module), c.tensor_bytes) for c in sol.collectives
            )
    elapsed = time.perf_counter() - start
    result = TPSharding(
        tp=tp,
        sequence_parallel=sequence_parallel,
        styles=styles,
        collectives=collectives,
        layouts=layouts,
        shard_splits=splits,
        states=states,
        solve_seconds=elapsed,
        solver=solver,
        notes=tuple(_about(layers, note) for note, layers in notes.items()),
    )
    return _with_explanation(result, ir, list(result.notes))


def _within(fqn: str, block: str) -> str:
    """`fqn` relative to `block` when inside it."""
    return fqn[len(block) + 1 :] if fqn.startswith(block + ".") else fqn


def _about(layers: list[str], note: str) -> str:
    more = f" and {len(layers) - 1} more layer{'s' * (len(layers) > 2)} like it" if len(layers) > 1 else ""
    return f"{layers[0]}{more}: {note}"


def _renamer(owner: str, name: str):
    def rename(fqn: str) -> str:
        return name + fqn[len(owner) :] if fqn.startswith(owner + ".") or fqn == owner else fqn

    return rename


@dataclass
class _BlockSolution:
    styles: dict[str, str]
    layouts: dict[str, tuple[str, str]]
    splits: dict[str, tuple[int, ...]]
    collectives: list[Collective]
    notes: list[str]
    states: dict[str, str] = field(default_factory=dict)  # node -> output state


# ---------------------------------------------------------------------------------------------------- the graph


def _numel(shape: Iterable[int]) -> int:
    return math.prod(shape) if shape else 0


def _linear_module(d: dict[str, Any]) -> str:
    return d["module"] or (d["weight"] or "?").rsplit(".", 1)[0]


def _classify_nodes(g: nx.DiGraph) -> tuple[set[str], set[str], tuple[int, ...]]:
    """(constants, readers of the block input, residual shape): see the module docstring."""
    order = list(g.nodes)
    residual = tuple(g.nodes[order[-1]]["shape"]) if order else ()
    full = _numel(residual)
    constants: set[str] = set()
    readers: set[str] = set()
    for n in order:
        d = g.nodes[n]
        preds = list(g.predecessors(n))
        live = [p for p in preds if p not in constants]
        size = _numel(d["shape"])
        if "reads_input" in d:  # capture marks where the block input enters; no guessing needed
            if d.get("constant"):
                constants.add(n)
            elif d["reads_input"]:
                readers.add(n)
            continue
        if d["kind"] == "linear":
            if not preds:
                readers.add(n)
            continue
        if not live:  # a root, or fed by constants only: the block input if it is activation-sized
            (readers if size >= full > 0 else constants).add(n)
            continue
        bigger = size > max(_numel(g.nodes[p]["shape"]) for p in preds)
        residual_binary = len(preds) == 1 and d["op"] in BINARY and tuple(d["shape"]) == residual
        if bigger or residual_binary:
            readers.add(n)
    return constants, readers, residual


def _linear_strategies(
    d: dict[str, Any], in_f: int, out_f: int, tp: int, sp: bool, allow_gather: bool
) -> list[Strategy]:
    """Under SP the runtime gives every colwise linear a sequence-sharded input and every rowwise one a
    sequence-sharded output, and leaves replicated linears alone (tokenwise: R -> R, Q -> Q)."""
    ks = [Strategy("rep", "replicate", R, R)]
    if sp:
        ks.append(Strategy("rep", "replicate", Q, Q))
    if tp == 1:
        return ks
    if out_f % tp == 0:
        ks.append(Strategy("col", "colwise", Q, S, gathers_input=True) if sp else Strategy("col", "colwise", R, S))
        if allow_gather:
            ks.append(
                Strategy("colg", "colwise", Q, R, gathers_input=True, collective="all-gather")
                if sp
                else Strategy("colg", "colwise", R, R, collective="all-gather")
            )
    if in_f % tp == 0:
        ks.append(
            Strategy("row", "rowwise", S, Q, collective="reduce-scatter")
            if sp
            else Strategy("row", "rowwise", S, R, collective="all-reduce")
        )
    return ks


def _op_states(d: dict[str, Any], heads_ok: bool, sp: bool, heads: set[int] | None = None) -> list[str]:
    """The states a non-linear op can run in (input state = output state). A norm, reduction or weighted op on a
    4-d tensor with a heads dimension (Qwen3's and Gemma 3's per-head q/k norms, over the head width) can run on
    this rank's heads: S splits the heads, not the dimension it reduces over (its weight's gradient is then a
    partial sum over the ranks' heads: style "heads", all-reduced over tp)."""
    kind, op, shape = d["kind"], d["op"], tuple(d["shape"])
    seq = [Q] if sp else []
    if kind in ("attention", "matmul"):
        return [R, S] if heads_ok else [R]
    if kind == "softmax":
        return [R, S] if len(shape) == 4 and heads_ok else [R] + seq
    if kind == "norm" or op in REDUCTIONS or d["weight"] is not None:
        per_head = heads_ok and len(shape) == 4 and bool({shape[-2], shape[-3]} & {h for h in heads or () if h > 1})
        return [R, S] + seq if per_head else [R] + seq
    if kind in ("elementwise", "dropout"):
        return [R, S] + seq
    return [R]  # loss, embedding inside a block


# ------------------------------------------------------------------------------------------------------ the ILP


class _Model:
    """Variables and costs of one layer's ILP; one method per family of constraints."""

    def __init__(self, layer: LayerIR, ir: ModelIR, tp: int, sp: bool, allow_gather: bool, cost: TPCost):
        self.g = layer.ops
        self.tp, self.sp, self.cost = tp, sp, cost
        self.moe_module = layer.moe.module if getattr(layer, "moe", None) is not None else None
        self.r0 = Q if sp else R
        self.constants, self.readers, residual = _classify_nodes(self.g)
        # the block input's (batch, seq, hidden), as its readers see it (OPT's block ends on flattened tokens)
        self.residual_shape = next(
            (tuple(self.g.nodes[n]["shape"]) for n in self.g.nodes if n in self.readers),
            tuple(residual),
        )
        # the token stream (batch, seq, hidden) among what the block reads, for per_sample
        reads = (tuple(self.g.nodes[n]["shape"]) for n in self.g.nodes if n in self.readers)
        self.token_stream = next((s for s in reads if len(s) == 3 and s[1] > 1), None)
        self.residual_bytes = 2.0 * _numel(residual)
        self.heads_ok = tp == 1 or (ir.num_heads % tp == 0 and (ir.num_kv_heads or ir.num_heads) % tp == 0)
        # this block's heads as its attention ops run them (a Swin stage has its own), else the model's
        attention = [d for _, d in self.g.nodes(data=True) if d["kind"] == "attention" and len(d["shape"]) == 4]
        self.heads = {d["shape"][-3] for d in attention} | {d.get("kv_heads") or d["shape"][-3] for d in attention}
        self.heads = self.heads or {ir.num_heads, ir.num_kv_heads or ir.num_heads}
        feats = {op.fqn: op for op in layer.linears}
        self.nodes = [n for n in self.g.nodes if n not in self.constants]
        heads = self.heads | {ir.num_heads, ir.num_kv_heads or ir.num_heads}  # K's heads before any repeat
        self.strategies: dict[str, list[Strategy]] = {}
        for n in self.nodes:
            d = self.g.nodes[n]
            if d["kind"] == "linear":
                op = feats.get(_linear_module(d))
                in_f = op.in_features if op else 0
                out_f = op.out_features if op else d["shape"][-1]
                self.strategies[n] = _linear_strategies(d, in_f, out_f, tp, sp, allow_gather)
            else:
                self.strategies[n] = [Strategy(s, "", s, s) for s in _op_states(d, self.heads_ok, sp, heads)]
            if sp and self.flattens(d):
                # batch and sequence flattened into rows: a gather or reduce-scatter to or from SP's token shard
                # would not follow the sequence dimension. Inside a routed MoE module (its router and experts on
                # tokens x hidden, the module's output unflattened) the shard stays a set of whole rows, and
                # tokenwise ops keep it (Q -> Q on the local rows: style "rows"); elsewhere (OPT flattens its
                # residual stream) the block's own code would mix the shapes
                rows = self.in_moe(d)
                self.strategies[n] = [
                    k for k in self.strategies[n] if Q not in (k.inp, k.out) or (rows and k.inp == k.out)
                ]
        self.prob = pulp.LpProblem("tp_sharding", pulp.LpMinimize)
        self.x = {
            (n, i): self.binary(f"x_{j}_{i}") for j, n in enumerate(self.nodes) for i in range(len(self.strategies[n]))
        }
        self.gathered: dict[str, pulp.LpVariable] = {}
        self.pinned_whole: dict[str, tuple[int, ...]] = {}  # op -> the shape of its operand that spans the heads

    def per_sample(self, n: str) -> bool:
        """A block input read per sample, with a batch dimension and no sequence dimension, beside the token stream
        (a diffusion transformer's timestep and class label, from which adaLN computes per-sample shifts and
        scales): under sequence parallelism its gradient from the sequence shards would be a partial sum that
        mlm-run's styles do not reduce."""
        if n not in self.readers:
            return False
        shape, res = tuple(self.g.nodes[n]["shape"]), self.token_stream
        if res is None or not 1 <= len(shape) <= 2 or shape[0] != res[0]:
            return False
        return len(shape) == 1 or shape[1] != res[1]  # (batch, seq) is per token (a padding mask)

    def in_moe(self, d: dict[str, Any]) -> bool:
        """Whether the op runs inside the block's routed MoE module (its router, its own code, its experts)."""
        module, moe = d.get("module") or "", self.moe_module
        return moe is not None and (module == moe or module.startswith(moe + "."))

    def flattens(self, d: dict[str, Any]) -> bool:
        """An activation with batch and sequence flattened into one dimension (OPT's decoder layer reshapes its
        residual to (tokens, hidden)): mlm-run's sequence-parallel styles split dimension 1 of (batch, seq, hidden)."""
        shape, res = tuple(d["shape"]), self.residual_shape
        return len(res) == 3 and len(shape) == 2 and shape[0] == res[0] * res[1] and res[1] > 1

    def binary(self, name: str) -> pulp.LpVariable:
        add = getattr(self.prob, "add_variable", None)  # PuLP >= 3.3; plain LpVariable is deprecated there
        return add(name, cat="Binary") if add is not None else pulp.LpVariable(name, cat="Binary")

    def is_linear(self, n: str) -> bool:
        return self.g.nodes[n]["kind"] == "linear"

    def state_in(self, n: str, s: str) -> pulp.LpAffineExpression:
        return pulp.lpSum(self.x[n, i] for i, k in enumerate(self.strategies[n]) if k.inp == s)

    def state_out(self, n: str, s: str) -> pulp.LpAffineExpression:
        return pulp.lpSum(self.x[n, i] for i, k in enumerate(self.strategies[n]) if k.out == s)

    def live_preds(self, n: str) -> list[str]:
        return [p for p in self.g.predecessors(n) if p not in self.constants]

    def states(self) -> list[str]:
        return [R, S, Q] if self.sp else [R, S]

    # constraint families
    def one_strategy(self) -> None:
        for n in self.nodes:
            self.prob += pulp.lpSum(self.x[n, i] for i in range(len(self.strategies[n]))) == 1, f"one_{n}"

    def edge_consistency(self) -> None:
        for u, v in self.g.edges:
            if u in self.constants or v in self.constants:
                continue
            for s in self.states():
                self.prob += self.state_out(u, s) == self.state_in(v, s), f"edge_{u}_{v}_{s}"

    def boundary(self) -> None:
        for n in self.readers:
            self.prob += self.state_in(n, self.r0) == 1, f"input_{n}"
        for n in self.nodes:  # a linear fed by constants only reads a replicated tensor
            if self.is_linear(n) and n not in self.readers and not self.live_preds(n):
                self.prob += self.state_in(n, R) == 1, f"const_input_{n}"
        last = list(self.g.nodes)[-1]
        if last in self.strategies:
            self.prob += self.state_out(last, self.r0) == 1, f"output_{last}"

    def full_constants(self) -> None:
        """An op cannot run split (S) when a constant operand spans the dimension S splits at full size: it would not
        broadcast against the local part (T5's relative-position bias, one row per head, added to the scores), and
        mlm-run does not slice a module's internal tensors. Rotary tables and masks have size 1 there."""
        for v in self.nodes:
            d = self.g.nodes[v]
            spans = [c for c in d.get("constant_operands", ()) if _spans_split_dim(c, tuple(d["shape"]), self.heads)]
            if d["kind"] != "linear" and spans:
                self.prob += self.state_in(v, S) == 0, f"full_constant_{v}"
                if len(d["shape"]) == 4:  # on the heads (a norm's weight on features is no reason to explain)
                    self.pinned_whole[v] = tuple(spans[0])

    def shared_gather(self) -> None:
        for n in self.nodes:
            ks = [i for i, k in enumerate(self.strategies[n]) if k.gathers_input]
            if not ks:
                continue
            for u in self.live_preds(n) or ["__input__"]:
                if u not in self.gathered:
                    self.gathered[u] = self.binary(f"g_{len(self.gathered)}")
                for i in ks:
                    self.prob += self.gathered[u] >= self.x[n, i], f"gather_{u}_{n}_{i}"

    def same_module(self) -> None:
        by_module: dict[str, list[str]] = {}
        for n in self.nodes:
            if self.is_linear(n):
                by_module.setdefault(_linear_module(self.g.nodes[n]), []).append(n)
        for calls in by_module.values():
            for a, b in zip(calls, calls[1:]):
                for style in ("colwise", "rowwise", "replicate"):
                    fa = pulp.lpSum(self.x[a, i] for i, k in enumerate(self.strategies[a]) if k.style == style)
                    fb = pulp.lpSum(self.x[b, i] for i, k in enumerate(self.strategies[b]) if k.style == style)
                    self.prob += fa == fb, f"module_{a}_{b}_{style}"

    # objective
    def comm_seconds(self, kind: str, nbytes: float) -> float:
        f = (self.tp - 1) / self.tp
        volume = (2 * f if kind == "all-reduce" else f) * nbytes
        return 2 * volume / (self.cost.link_gbps * 1e9)  # forward + backward

    def op_seconds(self, n: str, k: Strategy) -> float:
        d = self.g.nodes[n]
        replicated = k.style == "replicate" if self.is_linear(n) else k.inp == R
        if not replicated:
            return self.comm_seconds(k.collective, d["bytes"]) if k.collective else 0.0
        f = 1 - 1 / self.tp
        t = 3 * f * (d["flops"] / (self.cost.bf16_tflops * 1e12) + d["bytes"] / (self.cost.hbm_gbps * 1e9))
        if self.is_linear(n):
            t += f * STATE_BYTES_PER_PARAM * self._params(n) / 2**30 * self.cost.memory_weight_s_per_gib
        return t

    def _params(self, n: str) -> float:
        d = self.g.nodes[n]
        rows = _numel(d["shape"][:-1]) or 1
        return d["flops"] / (2 * rows)  # in * out

    def gather_bytes(self, u: str) -> float:
        return self.residual_bytes if u == "__input__" else self.g.nodes[u]["bytes"]

    def objective(self) -> None:
        terms = [self.op_seconds(n, k) * self.x[n, i] for n in self.nodes for i, k in enumerate(self.strategies[n])]
        terms += [self.comm_seconds("all-gather", self.gather_bytes(u)) * v for u, v in self.gathered.items()]
        self.prob += pulp.lpSum(terms)

    def build(self) -> pulp.LpProblem:
        self.one_strategy()
        self.edge_consistency()
        self.boundary()
        self.full_constants()
        self.shared_gather()
        self.same_module()
        self.objective()
        return self.prob


def _spans_split_dim(const: tuple[int, ...], out: tuple[int, ...], heads: set[int]) -> bool:
    """Whether a constant of shape `const` has the full extent of the dimension that state S splits in a tensor of
    shape `out`: of a 4-d tensor, its heads dimension (-3 in (batch, heads, seq, dim), -2 in (batch, seq, heads,
    dim): the one sized as the heads); otherwise the last (features)."""
    dims = [d for d in (-3, -2) if out[d] in heads] if len(out) == 4 else [-1] if out else []
    return any(len(const) >= -d and const[d] > 1 and const[d] == out[d] for d in dims)


def _solver(name: str, time_limit_s: float) -> pulp.LpSolver:
    if name == "cbc":
        if pulp.COIN_CMD(msg=False).available():  # a system CBC; PuLP 4 drops the bundled one
            return pulp.COIN_CMD(msg=False, timeLimit=time_limit_s)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s)
    if name == "highs":
        for cls in (getattr(pulp, "HiGHS", None), getattr(pulp, "HiGHS_CMD", None)):
            if cls is not None and cls(msg=False).available():
                return cls(msg=False, timeLimit=time_limit_s)
        raise PlanError("solver 'highs' is not installed (pip install highspy); use solver='cbc'")
    raise PlanError(f"unknown ILP solver {name!r}; expected 'cbc' or 'highs'")


def _solve_layer(
    layer: LayerIR, ir: ModelIR, tp: int, sp: bool, solver: str, time_limit_s: float, allow_gather: bool, cost: TPCost
) -> _BlockSolution:
    m = _Model(layer, ir, tp, sp, allow_gather, cost)
    attention = any(d["kind"] in ("attention", "matmul") for _, d in m.g.nodes(data=True))
    notes = []
    if attention and not m.heads_ok:
        notes.append(
            f"{ir.num_heads} heads / {ir.num_kv_heads} kv heads do not divide by tp={tp}: attention runs replicated"
        )
    per_sample = [n for n in m.nodes if m.per_sample(n)]
    if sp and tp > 1 and per_sample:
        raise Infeasible(
            f"no executable tensor-parallel sharding of {layer.name} at tp={tp} with sequence parallelism: the block "
            f"computes per-sample tensors (no sequence dimension, e.g. {per_sample[0]}: a conditioning input such as "
            f"a timestep embedding), whose gradient from the sequence shards would be a partial sum mlm-run does not "
            f"reduce: plan without sequence parallelism"
        )
    if tp == 1:
        choice = {n: 0 for n in m.nodes}  # strategy 0 is replicated in every list
        gathered: set[str] = set()
    else:
        prob = m.build()
        status = prob.solve(_solver(solver, time_limit_s))
        if pulp.LpStatus[status] != "Optimal":
            hint = ""
            if sp and attention and not m.heads_ok:
                hint = (
                    "; attention must run replicated, which sequence parallelism cannot feed: use a tp dividing "
                    "the head counts or no sequence parallelism"
                )
            elif sp and any(m.flattens(m.g.nodes[n]) for n in m.nodes):
                hint = (
                    "; the block flattens batch and sequence into one dimension, which sequence parallelism's "
                    "token shard (a slice of each sequence) cannot follow: plan without sequence parallelism"
                )
            elif sp and attention and (why := _replicated_attention(m, None, layer.name)):
                hint = f"; {why[0].split(': ', 1)[1]}: attention must run replicated, which sequence parallelism "
                hint += "cannot feed: plan without sequence parallelism"
            raise Infeasible(
                f"no executable tensor-parallel sharding of {layer.name} at tp={tp}"
                f"{' with sequence parallelism' if sp else ''} (ILP {pulp.LpStatus[status]}){hint}"
            )
        choice = {n: next(i for i in range(len(m.strategies[n])) if (m.x[n, i].value() or 0) > 0.5) for n in m.nodes}
        gathered = {u for u, v in m.gathered.items() if (v.value() or 0) > 0.5}
        if attention and m.heads_ok:
            notes.extend(_replicated_attention(m, choice, layer.name))
    return _read_solution(m, choice, gathered, ir, notes)


def _replicated_attention(m: _Model, choice: dict[str, int] | None, block: str) -> list[str]:
    """Why attention that could run on local heads runs whole on every tp rank (all of it when `choice` is None:
    no sharding exists), in one line (or nothing)."""
    kinds = ("attention", "matmul")
    whole = [
        n for n in m.nodes if m.g.nodes[n]["kind"] in kinds and (choice is None or m.strategies[n][choice[n]].out == R)
    ]
    if not whole:
        return []
    blocked = [(m.g.nodes[v]["module"] or v, shape) for v, shape in m.pinned_whole.items()]
    folded = [
        n
        for n in m.nodes
        if m.g.nodes[n]["kind"] in ("matmul", "softmax") and len(m.g.nodes[n]["shape"]) == 3 and m.live_preds(n)
    ]
    if blocked:
        where, shape = blocked[0]
        where = _within(where, block)
        why = (
            f"{where} reads a tensor of shape {shape} that spans the heads, which a rank holding some of the "
            f"heads cannot broadcast against and mlm-run does not slice"
        )
    elif folded:
        d = m.g.nodes[folded[0]]
        where = _within(d["module"] or "", block)
        why = (
            f"{where or 'its attention'} computes scores of shape {tuple(d['shape'])}: the heads are folded into "
            f"the batch dimension, where the sharding cannot split them"
        )
    elif choice is None:
        return []
    else:
        why = "running it on local heads would cost more (collectives, state) than it saves under this cost model"
    return [f"attention runs on all heads on every tp rank (its linears replicated): {why}"]


def _read_solution(
    m: _Model, choice: dict[str, int], gathered: set[str], ir: ModelIR, notes: list[str]
) -> _BlockSolution:
    styles: dict[str, str] = {}
    layouts: dict[str, tuple[str, str]] = {}
    splits: dict[str, tuple[int, ...]] = {}
    colls: list[Collective] = []
    for u in gathered:  # the shared all-gather, attributed to the first linear that reads it
        reader = next(
            v
            for v in m.nodes
            if m.is_linear(v)
            and m.strategies[v][choice[v]].gathers_input
            and (u in m.live_preds(v) or (u == "__input__" and not m.live_preds(v)))
        )
        colls.append(Collective("all-gather", _linear_module(m.g.nodes[reader]), m.gather_bytes(u)))
    for n in m.nodes:
        k = m.strategies[n][choice[n]]
        d = m.g.nodes[n]
        rows = k.inp == Q and m.flattens(d)  # on flattened token rows: replicated weights applied to local rows
        if m.is_linear(n):
            module = _linear_module(d)
            styles[module] = "rows" if rows else k.style
            layouts[module] = (k.inp, k.out)
            if k.collective:
                colls.append(Collective(k.collective, module, d["bytes"]))
            if k.style == "colwise" and (sp := _splits(m, n, ir)):
                splits[module] = sp
        elif m.sp and k.inp == Q and (d["kind"] == "norm" or d["weight"] is not None) and d["module"]:
            styles[d["module"]] = "rows" if rows else "sequence"
        elif k.inp == S and d["weight"] is not None and d["module"]:
            styles[d["module"]] = "heads"  # a per-head norm's weight, replicated; its gradient summed over tp
    order = {n: i for i, n in enumerate(m.g.nodes)}
    colls.sort(
        key=lambda c: min(
            (order[n] for n in m.nodes if _linear_module(m.g.nodes[n]) == c.module and m.is_linear(n)), default=0
        )
    )
    states = {n: m.strategies[n][choice[n]].out for n in m.nodes}
    return _BlockSolution(styles, layouts, splits, colls, notes, states)


def _splits(m: _Model, n: str, ir: ModelIR) -> tuple[int, ...]:
    """Chunks of a fused colwise output (q|k|v, gate|up) that must each be split over tp, else ()."""
    width = m.g.nodes[n]["shape"][-1]
    for v in m.g.successors(n):
        dv = m.g.nodes[v]
        if dv["kind"] == "attention":
            hd = dv["shape"][-1]
            nh, nkv = ir.num_heads, ir.num_kv_heads or ir.num_heads
            if width == (nh + 2 * nkv) * hd:
                return (nh * hd, nkv * hd, nkv * hd)
            if width == 2 * nkv * hd and width != nh * hd:
                return (nkv * hd, nkv * hd)
        elif len(dv["shape"]) < 4 and dv["shape"] and dv["shape"][-1] < width and width % dv["shape"][-1] == 0:
            return (dv["shape"][-1],) * (width // dv["shape"][-1])
    return ()


# ------------------------------------------------------------------------------------------------- explanation


def _with_explanation(r: TPSharding, ir: ModelIR, notes: list[str]) -> TPSharding:
    from dataclasses import replace

    if r.tp == 1:
        return replace(r, explanation="tp=1: every module replicated, no tensor-parallel collectives")
    blocks = ir.blocks
    lines = [
        f"tp={r.tp}{' with sequence parallelism' if r.sequence_parallel else ''}: sharding chosen by an ILP "
        f"over each block's dataflow graph ({r.solver}, {r.solve_seconds * 1e3:.0f} ms)"
    ]
    if blocks:
        b = blocks[0]
        colls = r.block_collectives(ir)
        kinds: dict[str, int] = {}
        for c in colls:
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
        what = ", ".join(f"{v} {k}{'s' if v > 1 else ''}" for k, v in kinds.items()) or "no collectives"
        lines.append(f"per block forward: {what} ({sum(c.tensor_bytes for c in colls) / 2**20:.1f} MiB per sample)")
        for style in ("colwise", "rowwise", "replicate", "sequence", "heads", "rows"):
            mods = [f[len(b.name) + 1 :] for f, s in r.styles.items() if s == style and f.startswith(b.name + ".")]
            if mods:
                lines.append(f"  {style}: {', '.join(mods)}")
    vocab = [f for f, s in r.styles.items() if s == "vocab"]
    if vocab:
        lines.append(f"vocabulary-parallel: {', '.join(vocab)} (vocab {ir.vocab_size} / tp {r.tp})")
    elif ir.vocab_size % r.tp:
        lines.append(f"embedding and head replicated: vocabulary {ir.vocab_size} does not divide by tp={r.tp}")
    lines.extend(dict.fromkeys(notes))
    return replace(r, explanation="\n".join(lines))
