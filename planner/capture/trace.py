"""Capture a model's graph on the meta device and turn it into the layer IR.

Transformers repeat one block many times, and tracing time grows with depth (about 0.2 s per layer with
torch.export at GPT-3 scale), so capture finds the repeated container (an nn.ModuleList / nn.Sequential of
structurally identical blocks), cuts it to its first block, captures that model (embedding + one block + head +
loss) and replicates the block's costs. When blocks differ, or the cut model does not run, the whole model is
captured. symbolic_trace is tried first as the fast path; real model code (shape control flow, optional targets)
usually needs torch.export's non-strict mode, which is the fallback. Nothing is decomposed: attention stays one
scaled_dot_product_attention op rather than a materialised seq x seq score matrix.

The architecture facts (heads, kv heads, head_dim, hidden size, vocabulary, attention kind) are read from the
same graph (facts.py), attribute names only cross-check them (attributes.py), and every choice capture makes
for the user (the default sequence length, replicated blocks, the whole-model fallback, a disagreement, a fact
not found) is one sentence in ModelIR.warnings.
"""

from __future__ import annotations

import inspect
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import networkx as nx
import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_leaves

from mlm.planner.capture import blocks as stacks
from mlm.planner.capture import masks
from mlm.planner.capture.attributes import Attribute, attribute_facts, resolve
from mlm.planner.capture.blocks import BlockGroup
from mlm.planner.capture.experts import with_experts
from mlm.planner.capture.facts import GraphFacts, graph_facts, unused_parameters
from mlm.planner.capture.graph import Activations, BlockKind, LayerIR, LinearOp, ModelIR, MoEIR
from mlm.planner.capture.hf_positions import unpacked_positions
from mlm.planner.capture.loader import ModelSpec, for_training, instantiate
from mlm.planner.capture.moe import MoESite, clean_path, find_moe, top_k_from_graph
from mlm.planner.capture.ops import OpCost, classify, nbytes, op_name, param_view, tensor_args, val
from mlm.planner.capture.training_step import TrainingModule, default_batch, example_batch
from mlm.planner.errors import ModelLoadError, TraceError

ROOT = "model"  # the user model's path inside TrainingModule
LOSS_LAYER = "loss"


DEFAULT_CAPACITY_FACTOR = 1.0  # tokens per routed expert over the perfectly balanced share (an option)
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # the compute dtypes a plan prices
DEFAULT_SEQ_CAP = 4096  # default --seq-len cap: a first plan at a model's full 32K-131K context is a minutes-long step


def capture(
    spec: ModelSpec,
    seq_len: int | None = None,
    method: str = "auto",
    replicate: bool = True,
    capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
    dtype: str = "bf16",
) -> ModelIR:
    """Build `spec` without weights and capture it into a ModelIR (costs for one sample of `seq_len` tokens).

    Without `seq_len` the length is min(model context, DEFAULT_SEQ_CAP); when that guess does not run and the
    model has a shorter position table, capture retries once at the table's length. Every such choice, and every
    assumption the capture makes, is one sentence in ModelIR.warnings. `capacity_factor` scales the tokens each
    routed expert of an MoE layer processes (1.0: perfectly balanced routing, no padding or dropped tokens).
    `dtype` is the compute dtype the plan prices ("bf16"; "fp32" where mlm-run computes in fp32, on CPU): the
    activations are captured in it."""
    start = time.perf_counter()
    torch_dtype = _TORCH_DTYPES[dtype]
    options = (replicate, capacity_factor, torch_dtype)
    model = build_meta(spec, torch_dtype)
    num_params = count_params(model)
    tied = _has_tied_embedding(model)
    attrs = attribute_facts(model)
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    token_inputs = inputs_follow_seq_len(spec, seq_len or DEFAULT_SEQ_CAP)
    if not token_inputs:
        captured, seq, seq_note = _capture_per_sample(spec, model, seq_len, method, options)
    elif seq_len is not None:
        seq, seq_note = seq_len, None
        captured = _capture_model(spec, model, seq, method, options)
    else:
        seq, seq_note = default_seq_len(attrs)
        try:
            captured = _capture_model(spec, model, seq, method, options)
        except TraceError as e:
            shorter = _position_limit(model, seq, attrs)
            if shorter is None:
                raise TraceError(f"{e} [at the default seq_len {seq}; pass --seq-len N if fewer fit]") from None
            try:
                captured = _capture_model(spec, build_meta(spec, torch_dtype), shorter, method, options)
            except TraceError as retry:
                if str(retry) == str(e):  # the same failure at both lengths: the length is not the cause
                    raise
                raise TraceError(f"{e} [at the default seq_len {seq}, and at {shorter}; pass --seq-len N]") from None
            seq_note = (
                f"seq_len {shorter}: capture at the default {seq} failed and the model holds {shorter} positions "
                f"(pass --seq-len to change)"
            )
            seq = shorter
    short = captured[2].short_table if token_inputs and seq_len is None else None
    if short is not None and short[0] < seq:  # runs on meta, would index past the table on a GPU
        captured = _capture_model(spec, build_meta(spec, torch_dtype), short[0], method, options)
        seq_note = (
            f"seq_len {short[0]}: the position table of {short[2] or 'the model'} holds {short[0]} positions, "
            f"fewer than the default {seq} (pass --seq-len to change)"
        )
        seq = short[0]
    layers, how, found, notes, kinds = captured
    if found.data_dependent:
        notes.append(
            f"data-dependent sizes (torch.where / nonzero) in {_first(list(found.data_dependent))}: priced at their "
            f"upper bound, divided over the experts inside an MoE layer (balanced routing)"
        )
    if found.short_table is not None:
        rows, read, where = found.short_table
        notes.append(
            f"seq_len {seq} reads position {read - 1} of {where or 'a position table'}, which holds {rows}: the "
            f"model cannot run at this length on a GPU (pass --seq-len {rows} or less)"
        )
    causal = [layer.name for layer in layers if _causal_mask(layer)]
    if causal:
        notes.append(
            f"attention in {_first(causal)} receives a mask tensor with the causal pattern: torch's SDPA kernels "
            f"compute every (query, key) block under a mask, and it is priced so (is_causal=True instead of the mask "
            f"would skip the blocks above the diagonal)"
        )
    if found.pipeline_skips:
        more = f" (and {len(found.pipeline_skips) - 1} more)" if len(found.pipeline_skips) > 1 else ""
        notes.append(
            f"{found.pipeline_skips[0]}{more}: connections that skip over blocks; pipeline stages carry them beside "
            f"the next block's input, priced at up to {found.carried_bytes / 2**20:.2f} MiB per sample on every stage "
            f"boundary"
        )
    if found.reused_modules:
        notes.append(
            f"{_first(list(found.reused_modules))} is also called outside that block: its work there is priced with "
            f"the block, and plans keep the two on one pipeline stage and do not shard the block with ZeRO-3"
        )
    windowed = [layer.name for layer in layers if layer.flops_attention_full and _windowed(layer.attention)]
    if windowed:
        notes.append(
            f"attention in {_first(windowed)} passes a sliding-window mask: torch's SDPA kernels compute every "
            f"(query, key) block under a mask, and it is priced so (a block-sparse kernel would skip most of them)"
        )
    facts = resolve(found, attrs, emb.embedding_dim if emb is not None else None, token_inputs)
    return ModelIR(
        layers=tuple(layers),
        num_params=num_params,
        seq_len=seq,
        hidden_size=facts.hidden_size,
        num_heads=facts.num_heads,
        num_kv_heads=facts.num_kv_heads,
        vocab_size=facts.vocab_size,
        capture_method=how,
        capture_seconds=time.perf_counter() - start,
        tied_embeddings=tied,
        tied_layers=_tied_layers(model, [x.name for x in layers]) if tied else (),
        head_dim=facts.head_dim,
        attention_kinds=facts.attention_kinds,
        attention_ops=tuple(dict.fromkeys(site.how for site in found.attention)),
        warnings=tuple(n for n in (seq_note, *notes, *facts.warnings) if n),
        block_kinds=kinds,
        compute_bytes=torch_dtype.itemsize,
        token_inputs=token_inputs,
        pipeline_skips=found.pipeline_skips,
        carried_bytes=found.carried_bytes,
        carried_by_boundary=found.carried_by_boundary,
        reused_modules=found.reused_modules,
        root_params=found.root_params,
        root_param_numels=found.root_param_numels,
        batch_bytes=_batch_bytes(spec, seq),
    )


def _batch_bytes(spec: ModelSpec, seq: int) -> float:
    """Bytes per sample of the batch mlm-run holds on a rank (runtime/data.py): the tensors example_inputs(1, seq)
    returns, in their own dtypes, else token ids and targets (int64, seq each)."""
    if spec.example_inputs is None:
        return 2.0 * 8 * seq
    try:
        with torch.device("meta"):
            leaves = tree_leaves(example_batch(spec.example_inputs, 1, seq))
    except Exception:  # noqa: BLE001 - the capture itself ran example_inputs; a second failure prices no batch
        return 0.0
    return float(sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)))


def inputs_follow_seq_len(spec: ModelSpec, seq: int) -> bool:
    """Whether --seq-len shapes the model's inputs: the token ids mlm builds always do; a file's example_inputs do
    when their shapes change with it (images, latents or audio clips of a fixed size do not)."""
    if spec.example_inputs is None:
        return True
    try:
        with torch.device("meta"):
            shapes = [
                [tuple(t.shape) for t in tree_leaves(spec.example_inputs(1, n)) if isinstance(t, torch.Tensor)]
                for n in (seq, 2 * seq)
            ]
    except Exception:  # noqa: BLE001 - an example_inputs that refuses a length is left to the capture to report
        return True
    return shapes[0] != shapes[1]


def _capture_per_sample(
    spec: ModelSpec, model: nn.Module, asked: int | None, method: str, options: tuple[bool, float, torch.dtype]
) -> tuple[Any, int, str]:
    """Capture a model whose inputs do not follow --seq-len, once to find the sequence its self-attention runs
    over (a ViT's patches and class token), again at that length if it differs, so that its score matrices are
    recognised. With no attention, or attention at several lengths (a U-Net), the unit is the sample (length 1)."""
    probe = asked or DEFAULT_SEQ_CAP
    captured = _capture_model(spec, model, probe, method, options)
    lengths = {site.q_len for site in captured[2].attention if site.kind != "cross"}
    tokens = lengths.pop() if len(lengths) == 1 else 1
    if tokens != probe:
        captured = _capture_model(spec, build_meta(spec, options[2]), tokens, method, options)
    ignored = f" (--seq-len {asked} does not apply)" if asked else ""
    unit = (
        f"per sample of {tokens} tokens, the sequence its attention runs over"
        if tokens > 1
        else "per sample (no single sequence that its attention runs over)"
    )
    return captured, tokens, f"the inputs from example_inputs do not change with seq_len{ignored}: costed {unit}"


def default_seq_len(attrs: dict[str, Attribute]) -> tuple[int, str]:
    """min(model context, DEFAULT_SEQ_CAP) and the sentence that says why."""
    context = attrs.get("context")
    if context is None:
        return DEFAULT_SEQ_CAP, f"seq_len {DEFAULT_SEQ_CAP} (model context unknown; pass --seq-len to change)"
    value, name = context.value, context.name
    if value <= DEFAULT_SEQ_CAP:
        return value, f"seq_len {value} (the model context, {name}; pass --seq-len to change)"
    return DEFAULT_SEQ_CAP, f"seq_len {DEFAULT_SEQ_CAP} (model context {value} from {name}; pass --seq-len to change)"


def _position_limit(model: nn.Module, seq: int, attrs: dict[str, Attribute]) -> int | None:
    """The longest table shorter than `seq` that could hold positions: the middle extent of a (1, N, hidden)
    parameter or buffer (learned position tables as in ViT), else the rows of an nn.Embedding other than the
    token table (the one with config's vocab_size rows, or else the largest)."""
    hidden = attrs.get("hidden_size", (0, ""))[0]
    tables = [
        t.shape[1]
        for t in (*model.parameters(), *model.buffers())
        if t.dim() == 3 and t.shape[0] == 1 and (not hidden or t.shape[2] == hidden)
    ]
    rows = sorted(m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding))
    vocab = attrs.get("vocab_size", (rows[-1] if rows else 0, ""))[0]
    rows = [n for n in rows if n != vocab]
    shorter = [int(n) for n in (*tables, *rows) if 1 < n < seq]
    return max(shorter) if shorter else None


Captured = tuple[list[LayerIR], str, GraphFacts, list[str], tuple[BlockKind, ...]]


def _capture_model(
    spec: ModelSpec, model: nn.Module, seq: int, method: str, options: tuple[bool, float, torch.dtype]
) -> Captured:
    """Capture the first two blocks of each kind and copy each kind's costs to its other blocks; else (no stack,
    replicate off, the cut does not run, or two blocks of a kind capture differently) the whole model, on a fresh
    instance (the cut edits the containers in place)."""
    replicate, capacity, dtype = options
    notes: list[str] = []
    moe = find_moe(model, capacity)
    groups = _stacks(model, moe)
    kept = [g.representatives(stacks.PER_KIND) for g in groups]
    if replicate and groups and any(len(g.children) > len(k) for g, k in zip(groups, kept)):
        try:
            layers, how, found = _capture_graph(
                spec, stacks.cut_to_representatives(model, groups), groups, seq, method, moe
            )
        except TraceError as e:  # the cut model does not run (e.g. it indexes blocks by config.n_layer)
            notes.append(
                f"whole-model fallback: the model cut to {sum(map(len, kept))} blocks (the first two of each kind) did "
                f"not capture ({_first_line(e)[:200]}); captured all blocks of a fresh instance instead"
            )
        else:
            mismatch = _kind_mismatch(layers, groups)
            if mismatch is None:
                layers, kinds = expand_kinds(layers, groups)
                notes.extend(_kind_notes(kinds))
                notes.extend(_moe_notes(layers))
                total = sum(len(g.children) for g in groups)
                label = f"{len(kinds)} block kind{'s' if len(kinds) > 1 else ''} captured once each"
                return layers, how + f" ({label}, replicated x{total})", found, notes, kinds
            notes.append(
                f"whole-model fallback: {mismatch}, so blocks of one structure do not all behave alike; captured "
                f"all blocks of a fresh instance"
            )
        model = build_meta(spec, dtype)
        moe = find_moe(model, capacity)
        groups = _stacks(model, moe)
    layers, how, found = _capture_graph(spec, model, groups, seq, method, moe)
    kinds = _whole_model_kinds(layers, groups)
    notes.extend(_moe_notes(layers))
    return layers, how, found, notes, kinds


def _stacks(model: nn.Module, moe: dict[str, MoESite]) -> list[BlockGroup]:
    experts = tuple(m for site in moe.values() for m in site.expert_modules)
    return stacks.find_block_groups(model, exclude=experts)


def _kind_key(layer: LayerIR) -> tuple:
    """What two blocks of one kind must share once captured."""
    a = layer.activations
    m = layer.moe
    return (
        layer.params,
        layer.flops_matmul,
        layer.flops_attention,
        layer.flops_elementwise,
        round(a.total),
        layer.attention,
        len(layer.linears),
        (m.num_experts, m.top_k, m.expert_params) if m else None,
    )


def _kind_mismatch(layers: list[LayerIR], groups: list[BlockGroup]) -> str | None:
    """The first pair of same-kind blocks whose captured costs differ, in words; None when all agree."""
    by_name = {layer.name: layer for layer in layers}
    for g in groups:
        for kind in dict.fromkeys(g.kinds):
            pair = [by_name.get(f"{g.fqn}.{c}") for c in g.members(kind)[: stacks.PER_KIND]]
            if len(pair) == 2 and pair[0] is not None and pair[1] is not None:
                if _kind_key(pair[0]) != _kind_key(pair[1]):
                    return f"{pair[0].name} and {pair[1].name} share module structure but captured differently"
    return None


def expand_kinds(layers: list[LayerIR], groups: list[BlockGroup]) -> tuple[list[LayerIR], tuple[BlockKind, ...]]:
    """Expand each stack's captured blocks into one layer per child, each a renamed copy of its kind's first
    captured block; returns the layers and the kinds."""
    out = list(layers)
    kinds: list[BlockKind] = []
    for g in groups:
        captured = {layer.name: layer for layer in out if layer.block_group == g.fqn}
        reps: dict[int, LayerIR] = {}
        for kind in dict.fromkeys(g.kinds):
            first = next((captured[f"{g.fqn}.{c}"] for c in g.members(kind) if f"{g.fqn}.{c}" in captured), None)
            if first is not None:
                reps[kind] = first
        copies = [_renamed(reps[k], f"{g.fqn}.{c}", f"{g.fqn}#{k}") for c, k in zip(g.children, g.kinds) if k in reps]
        positions = [i for i, layer in enumerate(out) if layer.name in captured]
        if not positions:
            continue
        at = positions[0]
        out = [layer for i, layer in enumerate(out) if i not in positions]
        out[at:at] = copies
        for k, rep in reps.items():
            kinds.append(_block_kind(g, k, rep))
    return out, tuple(kinds)


def _whole_model_kinds(layers: list[LayerIR], groups: list[BlockGroup]) -> tuple[BlockKind, ...]:
    """Kinds of a whole-model capture: every block was captured as itself; kinds group them for the report."""
    by_name = {layer.name: layer for layer in layers}
    kinds = []
    for g in groups:
        for k in dict.fromkeys(g.kinds):
            rep = next((by_name[f"{g.fqn}.{c}"] for c in g.members(k) if f"{g.fqn}.{c}" in by_name), None)
            if rep is not None:
                kinds.append(_block_kind(g, k, rep))
    names = {f"{k.container}.{c}": k.name for k in kinds for c in k.members}
    for i, layer in enumerate(layers):
        if layer.name in names:
            layers[i] = replace(layer, block_kind=names[layer.name])
    return tuple(kinds)


def _block_kind(g: BlockGroup, k: int, rep: LayerIR) -> BlockKind:
    return BlockKind(
        name=f"{g.fqn}#{k}",
        container=g.fqn,
        representative=rep.name,
        members=tuple(f"{g.fqn}.{c}" for c in g.members(k)),
        module_type=rep.module_type,
        params=rep.params,
        attention=rep.attention,
        moe=rep.moe is not None,
        flops_forward=rep.flops_forward,
    )


def _renamed(block: LayerIR, name: str, kind: str) -> LayerIR:
    """A copy of a captured block under another block's FQN (linears and the MoE module renamed with it)."""
    first = block.name

    def move(fqn: str) -> str:
        return name + fqn[len(first) :] if fqn == first or fqn.startswith(first + ".") else fqn

    linears = tuple(replace(op, fqn=move(op.fqn)) for op in block.linears)
    moe = block.moe
    if moe is not None:
        moe = replace(
            moe,
            module=move(moe.module),
            router=move(moe.router),
            shared_modules=tuple(move(m) for m in moe.shared_modules),
            expert_modules=tuple(move(m) for m in moe.expert_modules),
        )
    return replace(block, name=name, linears=linears, moe=moe, block_kind=kind)


def _kind_notes(kinds: tuple[BlockKind, ...]) -> list[str]:
    notes = []
    for k in kinds:
        if len(k.members) < 2:
            continue
        checked = f", checked against {k.members[1]}" if len(k.members) > 1 else ""
        what = ", ".join(k.attention) or "no attention"
        notes.append(
            f"blocks of one kind costed from one instance: {len(k.members)} blocks of {k.container} "
            f"({k.module_type}, {what}, {'MoE' if k.moe else 'dense'}) take the costs of {k.representative}"
            f"{checked} (same module type, parameter shapes and layer attributes)"
        )
    if len(kinds) > 1:
        listed = "; ".join(f"{k.name}: {len(k.members)} x {k.flops_forward:.3g} FLOP" for k in kinds)
        notes.append(f"{len(kinds)} kinds of block, each captured and costed as itself ({listed} per sample)")
    return notes


def _moe_notes(layers: list[LayerIR]) -> list[str]:
    sites: dict[tuple, list[str]] = {}
    for layer in layers:
        if layer.moe is not None:
            m = layer.moe
            key = (
                m.how.split(":")[-1].strip(),
                m.num_experts,
                m.top_k,
                m.top_k_from,
                m.expert_params,
                m.capacity_factor,
                m.shared_params,
            )
            sites.setdefault(key, []).append(layer.name)
    notes = []
    for (how, num, k, k_from, per, cf, shared), names in sites.items():
        top = f"top-{k} ({k_from})" if k else "top-k not found, 1 assumed (set the model's top_k attribute)"
        notes.append(
            f"MoE recognised heuristically in {len(names)} layers ({names[0]}...: {how}, a router of {num} outputs): "
            f"{num} experts of {per:,} parameters, {top}{f', {shared:,} shared-expert parameters' if shared else ''}; "
            f"the routed experts are priced analytically from their GEMMs (top_k experts per token) at capacity "
            f"factor {cf:g} (default 1.0: perfectly balanced routing, no dropped or padded tokens)"
        )
    return notes


def build_meta(spec: ModelSpec, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Instantiate on the meta device; where model code breaks there (.item(), .cuda()), try FakeTensorMode."""
    try:
        model = instantiate(spec, "meta")
    except ModelLoadError as meta_error:
        from torch._subclasses.fake_tensor import FakeTensorMode

        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                model = instantiate(spec, "cpu")
        except ModelLoadError:
            raise meta_error from None
    # training as the runtime runs it (no KV cache), activations in the compute dtype (bf16 mixed precision on GPUs)
    return for_training(model, cpu=False).to(dtype)


def count_params(model: nn.Module) -> int:
    """Exact parameter count; tied parameters count once, as in sum(p.numel() for p in model.parameters())."""
    return sum(p.numel() for p in model.parameters())


def _has_tied_embedding(model: nn.Module) -> bool:
    seen: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen and seen[id(p)] != name:
            return True
        seen[id(p)] = name
    return False


def _tied_layers(model: nn.Module, layer_names: list[str]) -> tuple[str, ...]:
    """The layers (of `layer_names`, in their order) holding a tied embedding weight: an nn.Embedding's weight also
    reachable under a name in another layer (an alias on the root, as T5's `shared`, counts for no layer). Other
    shared parameters are not the tied head the cost model prices (ModelCostInputs.tied_params)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in embeddings:
            names.setdefault(id(p), []).append(name)

    def layer_of(param: str) -> str | None:
        return next((x for x in layer_names if param == x or param.startswith(x + ".")), None)

    holders: set[str] = set()
    for aliases in names.values():
        layers = {layer_of(a) for a in aliases} - {None}
        if len(aliases) > 1 and len(layers) > 1:
            holders |= layers  # type: ignore[arg-type]
    return tuple(x for x in layer_names if x in holders)


def find_block_group(model: nn.Module) -> BlockGroup | None:
    """The largest block stack (blocks.find_block_groups lists them all)."""
    groups = _stacks(model, find_moe(model))
    return max(groups, key=lambda g: sum(p.numel() for p in model.get_submodule(g.fqn).parameters()), default=None)


def _example_batch(spec: ModelSpec, model: nn.Module, seq: int) -> tuple[Any, torch.Tensor]:
    """The file's example_inputs(1, seq), float tensors cast to the model's dtype, else a batch of token ids."""
    if spec.example_inputs is not None:
        with torch.device("meta"):
            inputs, targets = example_batch(spec.example_inputs, 1, seq)
        return _to_dtype(inputs, _compute_dtype(model)), _to_dtype(targets, _compute_dtype(model))
    required = _required_forward_args(model)
    if len(required) > 1 and not (len(required) == 2 and required[1] == "targets"):
        raise ModelLoadError(
            f"{type(model).__name__}.forward needs {', '.join(required)}: mlm can only guess one tensor of token "
            f"ids; define example_inputs(batch_size, seq_len) in the model file returning the forward's inputs"
        )
    try:
        return default_batch(model, 1, seq, "meta")
    except ValueError as e:
        raise ModelLoadError(str(e)) from None


def _compute_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.bfloat16)


def _to_dtype(example: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor in a tensor / tuple / list / dict of inputs (integer ids and masks stay)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, example)


def _forward_params(model: nn.Module) -> list[inspect.Parameter]:
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _required_forward_args(model: nn.Module) -> list[str]:
    return [p.name for p in _forward_params(model) if p.default is p.empty]


def _forward_hint(model: nn.Module) -> str:
    """For a capture fed guessed inputs, when the forward takes other inputs (encoder-decoders, pixel models):
    name them and the hook that supplies them. Empty when the forward takes one input."""
    others = [
        p.name
        for p in _forward_params(model)[1:]
        if re.search(r"input|ids|embed|pixel|values|features|decoder|sample|mask", p.name)
    ]
    if not others:
        return ""
    first = _forward_params(model)[0].name
    return (
        f"; mlm fed {type(model).__name__} one (1, seq_len) tensor of token ids as {first}, and its forward also "
        f"takes {', '.join(others[:8])}: define example_inputs(batch_size, seq_len) in the model file returning "
        f"the forward's inputs (a dict for keywords)"
    )


def _capture_graph(
    spec: ModelSpec, model: nn.Module, groups: list[BlockGroup], seq: int, method: str, moe: dict[str, MoESite]
) -> tuple[list[LayerIR], str, GraphFacts]:
    with unpacked_positions():  # Hugging Face decoders traced as they run in training (hf_positions.py)
        return _traced(spec, model, groups, seq, method, moe)


def _traced(
    spec: ModelSpec, model: nn.Module, groups: list[BlockGroup], seq: int, method: str, moe: dict[str, MoESite]
) -> tuple[list[LayerIR], str, GraphFacts]:
    wrapper = TrainingModule(model, spec.loss_fn)
    batch = _example_batch(spec, model, seq)
    errors = []
    if method in ("auto", "symbolic_trace"):
        try:
            graph, params = _symbolic_trace(wrapper, batch)
            layers, found = build_layers(graph, params, model, groups, seq, moe)
            return layers, "symbolic_trace", found
        except Exception as e:  # symbolic_trace fails on most real models; it is only the fast path
            errors.append(f"symbolic_trace: {type(e).__name__}: {_first_line(e)}")
            if method == "symbolic_trace":
                raise TraceError(f"torch.fx.symbolic_trace could not capture the model: {errors[-1]}") from None
    try:
        with _quiet():
            program = torch.export.export(wrapper, batch, strict=False)
    except Exception as e:  # tracer errors come in many types; report the user's construct and line
        hint = _forward_hint(model) if spec.example_inputs is None else ""
        raise TraceError(
            f"neither tracer could capture the model: torch.export: {type(e).__name__}: "
            f"{_first_line(e)}{_user_location(e, spec)}{hint}"
        ) from None
    graph = program.graph
    sig = program.graph_signature
    names = {
        **sig.inputs_to_parameters,
        **sig.inputs_to_buffers,
        **getattr(sig, "inputs_to_lifted_tensor_constants", {}),
    }
    params = {n: names[n.name] for n in graph.nodes if n.op == "placeholder" and n.name in names}
    where = concrete_data_dependent_sizes(graph, moe)
    layers, found = build_layers(graph, params, model, groups, seq, moe)
    return layers, "torch.export (non-strict)", replace(found, data_dependent=where)


def concrete_data_dependent_sizes(graph: torch.fx.Graph, moe: dict[str, MoESite]) -> tuple[str, ...]:
    """Sizes that depend on tensor values (torch.where / nonzero / masked_select: a hand-written MoE's per-expert
    token selection) are symbols in the exported graph that costs cannot count. Each node's value is replaced by a
    meta tensor of a concrete size: inside a recognised MoE layer the symbol's upper bound (all tokens·top_k) over
    the layer's experts, as balanced routing gives them (the capacity-factor assumption the MoE note states),
    elsewhere the upper bound itself. Returns the modules where this happened (a warning names them)."""
    where: list[str] = []
    for n in graph.nodes:
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or all(isinstance(s, int) for s in v.shape):
            continue
        module = _module_of(n) or ""
        site = next((s for f, s in moe.items() if module == f or module.startswith(f + ".")), None)
        shape = [s if isinstance(s, int) else _bound(s, site.ir.num_experts if site else 1) for s in v.shape]
        n.meta["val"] = torch.empty(shape, dtype=v.dtype, device="meta")
        if module not in where:
            where.append(module)
    return tuple(where)


def _bound(size: Any, share: int) -> int:
    """A symbolic size's upper bound (its value range from export; 0 when unbounded) divided by `share`."""
    expr = size.node.expr
    env = size.node.shape_env
    subs = {}
    for sym in expr.free_symbols:
        r = env.var_to_range.get(sym)
        subs[sym] = int(r.upper) if r is not None and r.upper.is_finite else 0
    return max(0, -(-int(expr.xreplace(subs)) // share))


def _symbolic_trace(wrapper: nn.Module, batch: tuple[Any, torch.Tensor]) -> tuple[torch.fx.Graph, dict]:
    """symbolic_trace through every module (no leaves), then run it on meta tensors to attach shapes."""

    class _ThroughTracer(torch.fx.Tracer):
        def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
            return False

    graph = _ThroughTracer().trace(wrapper)
    module = torch.fx.GraphModule(wrapper, graph)

    class _ShapeRecorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            result = super().run_node(n)
            n.meta["val"] = result
            return result

    inputs, targets = batch
    if not isinstance(inputs, torch.Tensor):
        raise TypeError("fast path handles a single tensor input only")
    _ShapeRecorder(module).run(inputs, targets)
    params = {n: str(n.target) for n in graph.nodes if n.op == "get_attr"}
    return graph, params


def build_layers(
    graph: torch.fx.Graph,
    params: dict[torch.fx.Node, str],
    model: nn.Module,
    groups: list[BlockGroup],
    seq: int,
    moe: dict[str, MoESite] | None = None,
) -> tuple[list[LayerIR], GraphFacts]:
    """Group graph nodes into layers and sum each layer's costs; read the architecture facts off the same graph.
    The ops of routed experts (moe) are dropped and the experts priced analytically (experts.py)."""
    moe = moe or {}
    calls = [
        n for n in graph.nodes if n.op in ("call_function", "call_method") and op_name(n) != "_assert_tensor_metadata"
    ]
    owner = assign_layers(calls, groups)
    is_param = set(params)
    costs = {n: classify(n, is_param) for n in calls}
    tags = region_tags(calls, costs, is_param)
    dependent = _input_dependent(graph, is_param)
    order = list(dict.fromkeys(owner[n] for n in calls))
    readers: dict[str, str] = {}  # parameter -> the layer of the first op that reads it
    for n in calls:
        for a in _inputs(n):
            if a in params:
                readers.setdefault(_strip_root(params[a]), owner[n])
    layer_params = _params_by_layer(model, order, readers)
    modules = dict(model.named_modules())
    sites = {fqn: top_k_from_graph(site, calls, f"{ROOT}.{fqn}" if fqn else ROOT) for fqn, site in moe.items()}
    dropped = _expert_ops(calls, params, sites)
    inert = is_param | (set(calls) - dependent) | dropped
    parameter_names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    # not buffers, nor routed experts' weights: their ops are dropped (inert), and an op computed from an expert's
    # output would otherwise count as reading them (the op graph's `params`, which price SP / per-head gradients)
    routed = {p for site in sites.values() for p in site.expert_params}
    trainable = {n for n, name in params.items() if (s := _strip_root(name)) in parameter_names and s not in routed}
    layers = []
    for name in order:
        nodes = [n for n in calls if owner[n] == name and n not in dropped]
        layer = _layer_ir(
            name, nodes, owner, costs, tags, params, inert, layer_params.get(name, 0), groups, seq, trainable
        )
        module = modules.get(name)
        layer = replace(layer, module_type=type(module).__name__ if module is not None else "")
        for fqn, site in sites.items():
            if fqn == name or fqn.startswith(name + "."):
                layer = with_experts(layer, _routed(site, calls, params, seq), _compute_dtype(model).itemsize)
                break
        layers.append(layer)
    first_block = f"{groups[0].fqn}.{groups[0].children[0]}" if groups else None
    found = graph_facts(calls, owner, costs, dependent, is_param, first_block)
    kinds: dict[str, list[str]] = {}
    for site in found.attention:
        kinds.setdefault(site.layer, []).append(site.kind)
    layers = [replace(layer, attention=tuple(kinds.get(layer.name, ()))) for layer in layers]
    read = {_strip_root(name) for node, name in params.items() if any(u in costs for u in node.users)}
    read |= {p for site in moe.values() for p in site.expert_params}  # priced analytically
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    weights = {n for n, name in params.items() if _strip_root(name) in names}  # not buffers (rotary inv_freq)
    blocks = [layer.name for layer in layers if layer.kind == "block"]
    skips, carried, by_boundary = pipeline_skips(graph, calls, owner, weights, blocks)
    inside = {id(p) for name in order if name in modules for p in modules[name].parameters()}
    roots = tuple((name, p.numel()) for name, p in model.named_parameters() if id(p) not in inside)
    containers = tuple(g.fqn for g in groups)
    reused = tuple(dict.fromkeys(r for n in calls if (r := _called_outside_block(n, containers)) is not None))
    return layers, replace(
        found,
        unused_params=unused_parameters(model, read),
        pipeline_skips=skips,
        carried_bytes=carried,
        carried_by_boundary=by_boundary,
        reused_modules=reused,
        root_params=tuple(name for name, _ in roots),
        root_param_numels=tuple(n for _, n in roots),
    )


def _called_outside_block(node: torch.fx.Node, containers: tuple[str, ...]) -> str | None:
    """'<module> of <block>' when the op runs in a block's submodule called from outside the block's forward (a
    DiT's head calls transformer_blocks[0].norm1.emb): the block's stack entry is missing."""
    paths = [_strip_root(_clean_path(str(path))) for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    for fqn in paths:
        inside = next((c for c in containers if fqn.startswith(c + ".")), None)
        if inside is None:
            continue
        block = inside + "." + fqn[len(inside) + 1 :].split(".")[0]
        if block != fqn and block not in paths:
            return f"{fqn} of {block}"
        return None
    return None


def pipeline_skips(
    graph: torch.fx.Graph,
    calls: list[torch.fx.Node],
    owner: dict[torch.fx.Node, str],
    weights: set[torch.fx.Node],
    blocks: list[str],
) -> tuple[tuple[str, ...], float, tuple[float, ...]]:
    """Connections that skip over a block: a layer reading a value computed from the weights (an activation) by a
    layer with a block between them, as a U-Net's up blocks read its down blocks and time embedding, or T5's
    decoder reads its encoder; and the most bytes per sample that such connections carry across one block
    boundary (the values read, each once, as mlm-run's stages carry those output leaves beside the next block's
    input, runtime/stages.py carry_plan), and what they carry across each boundary between two blocks (before block j,
    j >= 1: the outputs of layers before block j that block j or a later layer reads). Values computed from the
    batch and buffers alone (position ids, rotary tables, masks) are recomputed by every stage and do not count."""
    weighted: set[torch.fx.Node] = set()
    for n in graph.nodes:
        if n in weights or any(a in weighted for a in _inputs(n)):
            weighted.add(n)
    # positions are op indices, not layer positions: a module called twice (T5's stack calls one dropout after its
    # embedding and again after its final norm) makes a layer that sits before the blocks but also produces the
    # stack's output after them, which crosses no boundary inside the stack
    index = {n: i for i, n in enumerate(calls)}
    span: dict[str, list[int]] = {}
    for n in calls:
        if owner[n] in blocks:
            span.setdefault(owner[n], [index[n], index[n]])[1] = index[n]
    spans = sorted(span.values())
    found: dict[tuple[str, str], None] = {}
    crossings: list[tuple[int, int, torch.fx.Node]] = []  # (produced at, read at, value) of each skip
    for n in calls:
        reader = owner[n]
        for a in _inputs(n):
            source = owner.get(a)
            if source is None or source == reader or a not in weighted or a not in index:
                continue
            if any(index[a] < lo and hi < index[n] for lo, hi in spans):
                found[(reader, source)] = None
                crossings.append((index[a], index[n], a))

    def carried(before: Callable[[int, int], bool]) -> float:
        values = {a: None for made, read, a in crossings if before(made, read)}
        return sum(nbytes(val(a)) for a in values)

    crossing = [carried(lambda made, read, lo=lo, hi=hi: made < lo and hi < read) for lo, hi in spans]
    boundaries = tuple(carried(lambda made, read, lo=lo: made < lo <= read) for lo, _ in spans[1:])
    skips = tuple(f"{reader} reads the output of {source}" for reader, source in found)
    return skips, max(crossing, default=0.0), boundaries


def _expert_ops(
    calls: list[torch.fx.Node], params: dict[torch.fx.Node, str], sites: dict[str, MoESite]
) -> set[torch.fx.Node]:
    """Ops that compute routed experts: inside an expert module, or reading an expert weight directly."""
    if not sites:
        return set()
    modules = tuple(f"{ROOT}.{m}" for site in sites.values() for m in site.expert_modules)
    weights = {n for n, name in params.items() if any(_strip_root(name) in s.expert_params for s in sites.values())}
    out: set[torch.fx.Node] = set()
    for n in calls:
        stack = n.meta.get("nn_module_stack") or {}
        paths = [clean_path(str(path)) for path, _ in stack.values()]
        if any(p == m or p.startswith(m + ".") for p in paths for m in modules) or any(
            a in weights for a in _inputs(n)
        ):
            out.add(n)
    return out


def _routed(site: MoESite, calls: list[torch.fx.Node], params: dict[torch.fx.Node, str], seq: int) -> MoEIR:
    """The site's IR with the tokens per sample that enter its router (rows of the router GEMM; else seq)."""
    router = {n for n, name in params.items() if _strip_root(name) == site.router_param}
    for n in calls:
        out = val(n)
        if out is None or not any(a in router for a in _inputs(n)):
            continue
        if all(a in router for a in _inputs(n) if val(a) is not None):
            router.add(n)  # a cast or view of the weight itself (DeepSeek-V3 runs the router in fp32)
        elif out.shape and out.shape[-1]:
            return replace(site.ir, tokens=int(out.numel() // out.shape[-1]))
    return replace(site.ir, tokens=seq)


def _input_dependent(graph: torch.fx.Graph, is_param: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Nodes computed from the batch. Others (causal masks, rotary tables) are per-layer constants: they are
    neither activations that grow with the micro-batch nor counted as such."""
    dependent: set[torch.fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder" and n not in is_param:
            dependent.add(n)
        elif any(a in dependent for a in _inputs(n)):
            dependent.add(n)
    return dependent


def assign_layers(calls: list[torch.fx.Node], groups: list[BlockGroup] | BlockGroup | None) -> dict[torch.fx.Node, str]:
    """Layer of each call: the block ('<container>.<i>') it runs in, else the outermost module on its stack that
    is not an ancestor of a block container; ops at the root join the layer before them (or, before any
    layer, the one after), and ops after the last module-owned op form the 'loss' layer."""
    if isinstance(groups, BlockGroup):
        groups = [groups]
    containers = tuple(g.fqn for g in groups or ())
    direct: dict[torch.fx.Node, str | None] = {n: _layer_of(n, containers) for n in calls}
    last_owned = max((i for i, n in enumerate(calls) if direct[n] is not None), default=-1)
    owner: dict[torch.fx.Node, str] = {}
    previous: str | None = None
    pending: list[torch.fx.Node] = []
    for i, n in enumerate(calls):
        layer = direct[n]
        if i > last_owned:
            owner[n] = LOSS_LAYER
        elif layer is None:
            if previous is None:
                pending.append(n)
            else:
                owner[n] = previous
        else:
            for p in pending:
                owner[p] = layer
            pending.clear()
            owner[n] = previous = layer
    for p in pending:
        owner[p] = LOSS_LAYER
    return owner


def _layer_of(node: torch.fx.Node, containers: tuple[str, ...]) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in stack.values():
        fqn = _strip_root(_clean_path(str(path)))
        if not fqn:
            continue
        inside = next((c for c in containers if fqn.startswith(c + ".")), None)
        if inside is not None:
            return inside + "." + fqn[len(inside) + 1 :].split(".")[0]
        if any(c == fqn or c.startswith(fqn + ".") for c in containers):
            continue
        return fqn
    return None


def _clean_path(path: str) -> str:
    """Normalise stack paths such as "L['self'].model.layers[0]" or "layers.slice(None, 2, None).0"."""
    return clean_path(path)


def _strip_root(path: str) -> str:
    if path == ROOT:
        return ""
    return path[len(ROOT) + 1 :] if path.startswith(ROOT + ".") else path


def region_tags(
    calls: list[torch.fx.Node], costs: dict[torch.fx.Node, OpCost], is_param: set[torch.fx.Node]
) -> dict[torch.fx.Node, str]:
    """'S' for tensors inside a tensor-parallel region, 'R' for the residual stream.

    Megatron's pattern, which the TP search rediscovers: a linear reading the residual stream is split by columns
    (its output is sharded), a linear reading a sharded tensor is split by rows (its output, once all-reduced, is
    replicated); everything else is sharded when any input is. The embedding produces the residual stream.
    """
    tags: dict[torch.fx.Node, str] = {}
    for n in calls:
        inside = any(tags.get(a) == "S" for a in _inputs(n) if a not in is_param)
        kind = costs[n].kind
        if kind == "linear":
            tags[n] = "R" if inside else "S"
        elif kind == "embedding":
            tags[n] = "R"
        else:
            tags[n] = "S" if inside else "R"
    return tags


def _inputs(n: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((n.args, n.kwargs), found.append)
    return found


def _base(n: torch.fx.Node) -> torch.fx.Node:
    """Follow view-like ops back to the tensor whose storage they share (what a saved view keeps alive)."""
    while n.op in ("call_function", "call_method") and op_name(n) in _ALIASING and _inputs(n):
        n = _inputs(n)[0]
    return n


_ALIASING = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "transpose",
        "t",
        "permute",
        "expand",
        "split",
        "split_with_sizes",
        "chunk",
        "getitem",
        "unsqueeze",
        "squeeze",
        "flatten",
        "unflatten",
        "slice",
        "select",
        "narrow",
        "alias",
        "detach",
        "unbind",
        "view_as",
        "expand_as",
        "movedim",
        "numpy_T",
        "mT",
    }
)


def _params_by_layer(model: nn.Module, order: list[str], readers: dict[str, str]) -> dict[str, int]:
    """Elements of the parameters each layer's modules hold; a parameter outside every layer (a ViT's class token
    or position table on the root module) counts in the layer whose ops read it first (mlm-run keeps such
    parameters on every pipeline stage: runtime/model_build.py root_parameters)."""
    seen: set[int] = set()
    counts: dict[str, int] = {}
    modules = dict(model.named_modules())
    for name in order:
        module = modules.get(name)
        if module is None:
            continue
        total = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
        counts[name] = total
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen and readers.get(name) in counts:
            seen.add(id(p))
            counts[readers[name]] += p.numel()
    return counts


def _layer_ir(
    name: str,
    nodes: list[torch.fx.Node],
    owner: dict[torch.fx.Node, str],
    costs: dict[torch.fx.Node, OpCost],
    tags: dict[torch.fx.Node, str],
    params: dict[torch.fx.Node, str],
    is_param: set[torch.fx.Node],
    num_params: int,
    groups: list[BlockGroup],
    seq: int,
    trainable: set[torch.fx.Node] | None = None,
) -> LayerIR:
    flops = {"mm": 0.0, "attn": 0.0, "elt": 0.0, "full": 0.0}
    moved = 0.0
    saved: dict[torch.fx.Node, None] = {}
    kept_masks: set[torch.fx.Node] = set()  # attention masks / biases made in this layer, kept for backward
    extra = {"S": 0.0, "R": 0.0, "core": 0.0}
    linears: list[LinearOp] = []
    member = set(nodes)
    for n in nodes:
        c = costs[n]
        if c.kind == "linear":
            flops["mm"] += c.flops
            linears.append(_linear_op(n, params, name))
        elif c.kind == "conv":
            flops["mm"] += c.flops  # implicit-GEMM kernels: priced at the GEMM rate, never split by tp
        elif c.kind in ("attention", "matmul"):
            flops["attn"] += c.flops
            if c.kind == "attention" and masks.computes_every_block(n):
                flops["full"] += c.flops
        else:
            flops["elt"] += c.flops
            if c.kind == "embedding":
                linears.append(_embedding_op(n, params, name, is_param))
        moved += c.bytes_moved
        for i, s in enumerate(c.saved):
            if c.kind == "attention" and i >= 4:  # the attention's mask / bias (ops.classify)
                if _base(s) not in member:
                    continue  # made outside this layer (a model's causal mask, shared by every layer): counted there
                kept_masks.add(_base(s))
            saved[_base(s)] = None
        extra[tags[n]] += c.extra_saved_bytes
        if tags[n] == "S" and _is_score_matrix(val(n), seq):
            extra["core"] += c.extra_saved_bytes  # e.g. the attention-dropout mask
    acts = {"S": extra["S"], "R": extra["R"], "core": extra["core"]}
    # saved bytes per op-graph node (its own saved output, its extra saved tensors): what lets the planner split
    # the activations again under a tensor-parallel layout other than Megatron's (cost/inputs.py)
    per_node: dict[str, float] = {n.name: costs[n].extra_saved_bytes for n in nodes if costs[n].extra_saved_bytes}
    for s in saved:
        if s.op == "get_attr":
            continue
        # a seq x seq tensor made in this layer from parameters and constants alone (T5's learned position bias,
        # its bucket indices, a mask) is not a parameter: every forward makes it again and backward keeps it
        made = s in member and s.op == "call_function" and _spans_seq_squared(val(s), seq)
        if s in is_param and not made:
            continue
        b = nbytes(val(s))
        acts[tags.get(s, "R")] += b
        if s in member:
            per_node[s.name] = per_node.get(s.name, 0.0) + b
        if tags.get(s) == "S" and _is_score_matrix(val(s), seq) and s not in kept_masks and s not in is_param:
            acts["core"] += b  # a mask or bias is the core's input: selective recompute keeps it
    inputs = {
        _base(a)
        for n in nodes
        for a in _inputs(n)
        if a not in member and a not in is_param and val(a) is not None and a.op != "get_attr"
    }
    outputs = [n for n in nodes if any(owner.get(u) not in (None, name) for u in n.users)]
    kind = _layer_kind(name, groups, costs, nodes)
    group = next((g for g in groups if name.startswith(g.fqn + ".")), None)
    return LayerIR(
        name=name,
        kind=kind,
        params=num_params,
        flops_matmul=flops["mm"],
        flops_attention=flops["attn"],
        flops_attention_full=flops["full"],
        flops_elementwise=flops["elt"],
        bytes_moved=moved,
        activations=Activations(
            sharded=acts["S"],
            replicated=acts["R"],
            attn_core=acts["core"],
            layer_input=sum(nbytes(val(a)) for a in inputs),
        ),
        output_bytes=sum(nbytes(val(o)) for o in outputs if o not in is_param),
        output_fixed_bytes=sum(nbytes(val(o)) for o in outputs if o in is_param),  # inert: not from the batch
        linears=tuple(linears),
        block_group=group.fqn if group is not None else None,
        ops=_op_graph(nodes, costs, params, is_param, per_node, trainable),
    )


def _is_score_matrix(t: torch.Tensor | None, seq: int) -> bool:
    return t is not None and t.dim() >= 4 and t.shape[-1] == seq and t.shape[-2] == seq


def _spans_seq_squared(t: torch.Tensor | None, seq: int) -> bool:
    return t is not None and t.dim() >= 2 and t.shape[-1] == seq and t.shape[-2] == seq and seq > 1


def _layer_kind(
    name: str, groups: list[BlockGroup], costs: dict[torch.fx.Node, OpCost], nodes: list[torch.fx.Node]
) -> str:
    if any(name.startswith(g.fqn + ".") for g in groups):
        return "block"
    if name == LOSS_LAYER:
        return "loss"
    kinds = {costs[n].kind for n in nodes}
    if "embedding" in kinds:
        return "embedding"
    if "linear" in kinds:
        return "head"
    if "norm" in kinds or "norm" in name.rsplit(".", 1)[-1].lower():
        return "norm"
    return "other"


def _param_module(param_fqn: str) -> str:
    return _strip_root(param_fqn).rsplit(".", 1)[0]


def _linear_op(n: torch.fx.Node, params: dict[torch.fx.Node, str], layer: str) -> LinearOp:
    args = [a for a in _inputs(n) if val(a) is not None]
    keys = params.keys()
    operand = next(a for a in args if param_view(a, keys) is not None and val(a).dim() == 2)
    weight = param_view(operand, keys)
    assert weight is not None
    w = val(operand)  # as the op reads it (W.T for x @ W.T)
    assert w is not None
    module = _module_of(n) or _param_module(params[weight])
    if op_name(n) == "linear":
        out_f, in_f = w.shape
    else:  # mm / addmm / matmul(x, W) as in HF's Conv1D (W is (in, out)), or matmul(x, W.T) as in Falcon
        in_f, out_f = w.shape
    has_bias = op_name(n) in ("addmm",) or (op_name(n) == "linear" and len(args) > 2)
    out = val(n)
    rows = int(out.numel() // out.shape[-1]) if out is not None else 0
    return LinearOp(
        fqn=module, kind="linear", in_features=int(in_f), out_features=int(out_f), has_bias=has_bias, rows=rows
    )


def _embedding_op(
    n: torch.fx.Node, params: dict[torch.fx.Node, str], layer: str, inert: set[torch.fx.Node]
) -> LinearOp:
    """`inert`: parameters and ops that do not depend on the batch; an index among them (a position table reads
    an arange) is not a token id, whatever the table's row count."""
    weight = next(a for a in _inputs(n) if a in params)
    w = val(weight)
    assert w is not None
    out = val(n)
    rows = int(out.numel() // out.shape[-1]) if out is not None else 0
    index = next((a for a in _inputs(n) if a not in params and val(a) is not None), None)
    return LinearOp(
        fqn=_module_of(n) or _param_module(params[weight]),
        kind="embedding",
        in_features=int(w.shape[0]),
        out_features=int(w.shape[1]),
        has_bias=False,
        rows=rows,
        token_ids=index is not None and index not in inert,
    )


def _module_of(n: torch.fx.Node) -> str | None:
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, _ = list(stack.values())[-1]
    return _strip_root(_clean_path(str(path))) or None


def _causal_mask(layer: LayerIR) -> bool:
    """Every attention call of the layer has the causal pattern and one of them received it as a mask tensor."""
    return (
        bool(layer.attention)
        and all(k == "causal" for k in layer.attention)
        and any(d.get("masked") for _, d in (layer.ops.nodes(data=True) if layer.ops is not None else ()))
    )


def _windowed(kinds: tuple[str, ...]) -> bool:
    return any(k.startswith("sliding window") for k in kinds)


def _first(names: list[str]) -> str:
    return ", ".join(names[:3]) + (" …" if len(names) > 3 else "")


def _key_heads(attention: torch.fx.Node) -> int:
    """Heads of the key an attention call receives (0: not a (..., heads, seq, dim) key)."""
    args = tensor_args(attention)
    key = val(args[1]) if len(args) > 1 else None
    return int(key.shape[-3]) if key is not None and key.dim() >= 3 else 0


def _op_graph(
    nodes: list[torch.fx.Node],
    costs: dict[torch.fx.Node, OpCost],
    params: dict[torch.fx.Node, str],
    inert: set[torch.fx.Node],
    saved: dict[str, float] | None = None,
    trainable: set[torch.fx.Node] | None = None,
) -> nx.DiGraph:
    """Dataflow between the layer's compute ops (views folded away): what the tensor-parallel ILP works on.

    Node attributes say where data enters: `reads_input` when an operand is an activation from an earlier layer
    (the block's input), `constant` when the op does not depend on the batch (masks, rotary tables); `weight` the
    first parameter it reads, `params` (name, elements) of every parameter it reads; `saved` the bytes per sample
    autograd keeps of this op's output and its own extra tensors (a saved view's bytes go to the op it views; a
    view or creation op's to no node: `saved` sums to at most the layer's Activations.total); an attention op's
    `kv_heads`, the heads its key has as the kernel receives it (already repeated to the query's where the model
    repeats them before the call, the model's kv heads where the kernel does: enable_gqa)."""
    saved = saved or {}
    g = nx.DiGraph()
    member = set(nodes)
    for n in nodes:
        c = costs[n]
        if c.kind in ("view", "creation"):
            continue
        t = val(n)
        g.add_node(
            n.name,
            kind=c.kind,
            op=op_name(n),
            module=_module_of(n),
            flops=c.flops,
            shape=tuple(t.shape) if t is not None else (),
            bytes=nbytes(t),
            weight=next(
                (_strip_root(params[w]) for a in _inputs(n) if (w := _param_of(a, params, inert, trainable))), None
            ),
            params=tuple(
                (_strip_root(params[w]), _numel(w)) for a in _inputs(n) if (w := _param_of(a, params, inert, trainable))
            ),
            reads_input=_reads_outside(n, costs, member, inert),
            # no operand depends on a trainable parameter (T5's or a U-Net's encoder states, a DiT's sinusoidal
            # timestep features): no gradient flows back through it, so a column-parallel linear reading it needs
            # no backward all-reduce
            grad_free_input=_reads_only_model_inputs(n, params, trainable),
            constant=n in inert,
            saved=saved.get(n.name, 0.0),
            kv_heads=_key_heads(n) if c.kind == "attention" else 0,
            masked=c.kind == "attention" and masks.sdpa_mask(n)[0] is not None,
            # shapes of the operands that do not depend on the batch (masks, rotary tables, T5's position bias, and
            # parameters, such as a per-head norm weight with one row per head), as the op reads them: whether they
            # broadcast against a tensor-parallel shard (tp_sharding.py)
            constant_operands=tuple(tuple(t.shape) for a in _inputs(n) if a in inert and (t := val(a)) is not None),
        )
        for src in _compute_sources(n, costs, member):
            g.add_edge(src.name, n.name)
    return g


def _param_of(
    a: torch.fx.Node, params: dict[torch.fx.Node, str], inert: set[torch.fx.Node], trainable: set[torch.fx.Node] | None
) -> torch.fx.Node | None:
    """The parameter (or buffer) operand `a` is, or the trainable parameter it is computed from by batch-independent
    ops alone (Gemma's norm scales by `1 + weight` in fp32; rotary tables computed from a buffer do not count)."""
    if a in params:
        return a
    seen: set[torch.fx.Node] = set()
    todo = list(_inputs(a)) if a in inert and a.op in ("call_function", "call_method") else []
    while todo:
        x = todo.pop()
        if x in params:
            if trainable is not None and x in trainable:
                return x
            continue
        if x in seen or x not in inert or x.op not in ("call_function", "call_method"):
            continue
        seen.add(x)
        todo.extend(_inputs(x))
    return None


def _reads_only_model_inputs(
    n: torch.fx.Node, params: dict[torch.fx.Node, str], trainable: set[torch.fx.Node] | None
) -> bool:
    """Whether n's activation operands are computed from model inputs and constants alone (no trainable parameter
    among their ancestors in the graph), so that no gradient reaches them."""
    stack = [a for a in _inputs(n) if a not in params and val(a) is not None]
    seen: set[torch.fx.Node] = set()
    reached_input = False
    while stack:
        a = stack.pop()
        if a in seen:
            continue
        seen.add(a)
        if a in params:
            if trainable is None or a in trainable:
                return False
        elif a.op == "placeholder":
            reached_input = True
        elif a.op != "get_attr":
            stack.extend(_inputs(a))
    return reached_input


def _numel(n: torch.fx.Node) -> int:
    t = val(n)
    return int(t.numel()) if t is not None else 0


def _reads_outside(
    n: torch.fx.Node, costs: dict[torch.fx.Node, OpCost], member: set[torch.fx.Node], inert: set[torch.fx.Node]
) -> bool:
    """Whether n reads, directly or through the layer's own views, an activation produced before the layer."""
    stack = list(_inputs(n))
    seen: set[torch.fx.Node] = set()
    while stack:
        a = stack.pop()
        if a in seen or a in inert or a.op == "get_attr":
            continue
        seen.add(a)
        if a not in member:
            if val(a) is not None or a.op == "placeholder" or a.op == "call_function":
                return True
        elif costs[a].kind == "view":
            stack.extend(_inputs(a))
    return False


def _compute_sources(
    n: torch.fx.Node, costs: dict[torch.fx.Node, OpCost], member: set[torch.fx.Node]
) -> Iterator[torch.fx.Node]:
    """The nearest compute ops feeding n, looking through views."""
    stack = list(_inputs(n))
    seen: set[torch.fx.Node] = set()
    while stack:
        a = stack.pop()
        if a in seen or a not in member:
            continue
        seen.add(a)
        if costs[a].kind in ("view",):
            stack.extend(_inputs(a))
        elif costs[a].kind != "creation":
            yield a


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _user_location(e: BaseException, spec: ModelSpec) -> str:
    import traceback

    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        if frame.filename == str(spec.path):
            return f" ({spec.path.name}:{frame.lineno}: {frame.line})"
    return ""


@contextmanager
def _quiet() -> Iterator[None]:
    """torch.export logs guards and prints the partial graph when it fails; the CLI prints its own summary."""
    import contextlib
    import io
    import logging

    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)
