"""Architecture facts read from the captured graph rather than guessed from attribute names.

Heads, kv heads and head_dim come from each attention op as it runs: a scaled_dot_product_attention call or the
matmul -> (scale, mask) -> softmax pattern of a hand-written attention. The capture runs one sample (batch 1),
so a query of numel heads*s_q*d has heads = numel / (s_q*d) whatever its layout ((b, h, s, d), (b*h, s, d)).
kv heads are read from the key *before* any repeat/expand (grouped-query and multi-query attention broadcast the
key to all query heads just before the op): the walk goes back from the key through views and elementwise ops
(rotary embeddings) that depend on the batch, stopping at the op that produced it (a linear, a norm), and takes
the fewest heads of any tensor on the way that still has the key's (s_k, head_dim) extents. The hidden size is
the last extent of the residual stream entering the first block; the vocabulary is the row count of the
embedding that reads the token ids and the output width of the linear feeding the cross-entropy loss.

Each attention op's kind (causal, full, sliding window, cross) comes from its mask (masks.py) and from where its
keys come from. attributes.py compares all of this with the model's attribute names.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn

from mlm.planner.capture import masks
from mlm.planner.capture.graph import HAND_WRITTEN_ATTENTION
from mlm.planner.capture.ops import ATTENTION_OPS, OpCost, op_name, val

# kinds the key walk passes through (they keep the key a key); anything else produced it
_WALK_KINDS = frozenset({"view", "elementwise", "dropout"})
_CE_LOSSES = frozenset({"cross_entropy_loss", "cross_entropy", "nll_loss", "nll_loss_forward"})


@dataclass(frozen=True)
class AttentionSite:
    """One attention op found in the graph."""

    layer: str  # the layer (block FQN) that runs it
    module: str  # module path of the op ("" at the root)
    how: str  # "scaled_dot_product_attention" or "matmul-softmax-matmul"
    heads: int
    kv_heads: int
    head_dim: int
    q_len: int
    kv_len: int
    kind: str = "full"  # "causal", "full", "sliding window W", "cross", "masked", "masked (not evaluated)"

    @property
    def is_self_attention(self) -> bool:
        return self.kind != "cross" and self.q_len == self.kv_len


@dataclass(frozen=True)
class GraphFacts:
    """What the captured graph shows; None where it shows nothing."""

    attention: tuple[AttentionSite, ...]
    hidden: int | None
    hidden_from: str
    vocab_in: int | None  # rows of the embedding that reads the token ids
    vocab_out: int | None  # output width of the linear feeding the cross-entropy loss
    unused_params: tuple[tuple[str, int], ...] = ()  # (name, elements) of parameters no captured op reads
    short_table: tuple[int, int, str] | None = None  # (rows, positions read, module) of a too-short position table
    data_dependent: tuple[str, ...] = ()  # modules whose ops have sizes that depend on tensor values (see trace.py)
    # "<reader> reads the output of <layer>" for each connection that skips over a block (trace.pipeline_skips)
    pipeline_skips: tuple[str, ...] = ()
    carried_bytes: float = 0.0  # per sample: the most those connections carry across one block boundary
    carried_by_boundary: tuple[float, ...] = ()  # per sample, across the boundary before each block but the first
    reused_modules: tuple[str, ...] = ()  # "<module> of <block>": a block's submodule called outside the block
    root_params: tuple[str, ...] = ()  # parameters outside every layer (a ViT's class token on the root module)
    root_param_numels: tuple[int, ...] = ()  # their element counts, in the same order


def graph_facts(
    calls: list[torch.fx.Node],
    owner: dict[torch.fx.Node, str],
    costs: dict[torch.fx.Node, OpCost],
    dependent: set[torch.fx.Node],
    params: set[torch.fx.Node],
    first_block: str | None,
) -> GraphFacts:
    """Read the facts from the captured calls (`dependent`: nodes computed from the batch)."""
    sites = tuple(_attention_sites(calls, owner, costs, dependent))
    hidden, hidden_from = _hidden(calls, owner, dependent, params, first_block)
    head = _output_projection(calls, costs)
    head_out, head_in = (val(head), _activation_in(head, params)) if head is not None else (None, None)
    if hidden is None and head_in is not None:
        hidden, hidden_from = int(head_in.shape[-1]), "the input of the output projection"
    return GraphFacts(
        attention=sites,
        hidden=hidden,
        hidden_from=hidden_from,
        vocab_in=_vocab_in(calls, dependent, params),
        vocab_out=int(head_out.shape[-1]) if head_out is not None else None,
        short_table=_short_table(calls, dependent, params),
    )


_LOOKUPS = frozenset({"embedding", "index", "index_select"})


def _short_table(
    calls: list[torch.fx.Node], dependent: set[torch.fx.Node], params: set[torch.fx.Node]
) -> tuple[int, int, str] | None:
    """A table lookup with constant indices (positions from an arange) reading past the table's rows: on the meta
    device it runs, on a GPU it would fail. The indices are re-run on the CPU to find the largest one."""
    for n in calls:
        if op_name(n) not in _LOOKUPS:
            continue
        tensors = [a for a in _inputs(n) if val(a) is not None]
        weight = next((a for a in tensors if a in params and val(a).dim() == 2), None)  # type: ignore[union-attr]
        index = next((a for a in tensors if a not in params and not val(a).is_floating_point()), None)  # type: ignore[union-attr]
        if weight is None or index is None or index in dependent:
            continue
        rows = int(val(weight).shape[0])  # type: ignore[union-attr]
        idx = val(index)
        if idx is None or idx.numel() <= rows or idx.numel() > masks.MAX_EVALUATED**2:
            continue  # positions 0..numel-1 of an arange fit the table
        values = masks.evaluate(index)
        if isinstance(values, torch.Tensor) and values.numel() and int(values.max()) >= rows:
            return rows, int(values.max()) + 1, _module(n).removeprefix("model.")
    return None


def unused_parameters(model: nn.Module, used: set[str]) -> tuple[tuple[str, int], ...]:
    """Parameters (by any of their tied names) that no captured op reads: their compute is not costed."""
    names: dict[int, list[str]] = {}
    sizes: dict[int, int] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        sizes[id(p)] = p.numel()
    return tuple(
        (aliases[0], sizes[key]) for key, aliases in names.items() if not any(name in used for name in aliases)
    )


def _activation_in(n: torch.fx.Node, params: set[torch.fx.Node]) -> torch.Tensor | None:
    return next((t for a in _inputs(n) if a not in params and (t := val(a)) is not None), None)


def _inputs(n: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((n.args, n.kwargs), found.append)
    return found


def _attention_sites(
    calls: list[torch.fx.Node],
    owner: dict[torch.fx.Node, str],
    costs: dict[torch.fx.Node, OpCost],
    dependent: set[torch.fx.Node],
) -> Iterator[AttentionSite]:
    for n in calls:
        name = op_name(n)
        if name in ATTENTION_OPS:
            tensors = [a for a in _inputs(n) if val(a) is not None]
            if len(tensors) < 3:
                continue
            q, k = val(tensors[0]), val(tensors[1])
            assert q is not None and k is not None
            s_q, d, s_k = int(q.shape[-2]), int(q.shape[-1]), int(k.shape[-2])
            heads = q.numel() // max(s_q * d, 1)
            kv = _heads_before_broadcast(tensors[1], s_k, int(k.shape[-1]), costs, dependent)
            mask, causal = masks.sdpa_mask(n)
            if mask is None:
                kind = "causal" if causal else "full"
            else:
                kind = masks.describe(masks.allowed_pairs(mask, "allow", s_q, s_k, dependent), causal)
            if _is_cross(tensors[0], tensors[1], _module(n), dependent):
                kind = "cross"
            yield AttentionSite(
                owner.get(n, ""), _module(n), "scaled_dot_product_attention", heads, kv, d, s_q, s_k, kind
            )
        elif costs[n].kind == "softmax":
            site = _softmax_site(n, owner, costs, dependent)
            if site is not None:
                yield site


def _softmax_site(
    softmax: torch.fx.Node,
    owner: dict[torch.fx.Node, str],
    costs: dict[torch.fx.Node, OpCost],
    dependent: set[torch.fx.Node],
) -> AttentionSite | None:
    """matmul(q, k^T) -> scale/mask/cast -> softmax -> ... -> matmul(p, v): the hand-written attention core."""
    scores = _producer(softmax, costs, dependent, lambda m: costs[m].kind == "matmul")
    if scores is None or not _feeds_matmul(softmax, costs):
        return None
    operands = [a for a in _inputs(scores) if val(a) is not None and a in dependent]
    if op_name(scores) in ("baddbmm", "addmm"):
        operands = operands[-2:]
    s = val(scores)
    if len(operands) != 2 or s is None or s.dim() < 2:
        return None
    q, kt = val(operands[0]), val(operands[1])
    assert q is not None and kt is not None
    s_q, s_k = int(s.shape[-2]), int(s.shape[-1])
    heads = s.numel() // max(s_q * s_k, 1)
    d = q.numel() // max(heads * s_q, 1)
    if heads < 1 or d < 1:
        return None
    kv = _heads_before_broadcast(operands[1], s_k, d, costs, dependent)
    kind = (
        "cross"
        if _is_cross(operands[0], operands[1], _module(scores), dependent)
        else _score_mask(softmax, scores, costs, dependent)
    )
    return AttentionSite(owner.get(scores, ""), _module(scores), HAND_WRITTEN_ATTENTION, heads, kv, d, s_q, s_k, kind)


def _score_mask(
    softmax: torch.fx.Node, scores: torch.fx.Node, costs: dict[torch.fx.Node, OpCost], dependent: set[torch.fx.Node]
) -> str:
    """The mask applied between the score matmul and the softmax (masked_fill, where, or an added bias)."""
    s = val(scores)
    assert s is not None
    s_q, s_k = int(s.shape[-2]), int(s.shape[-1])
    allowed = torch.ones(s_q, s_k, dtype=torch.bool)
    stack, seen, found = [softmax], set(), False
    while stack:
        n = stack.pop()
        if n in seen or n is scores or n not in costs:
            continue
        seen.add(n)
        args = [a for a in _inputs(n)]
        name = op_name(n)
        masks_here: list[tuple[torch.fx.Node, str]] = []
        if name == "masked_fill" and len(args) >= 2:
            masks_here = [(args[1], "block")]
        elif name == "where" and len(args) >= 1 and args[0] not in dependent:
            on_true = len(n.args) > 1 and isinstance(n.args[1], torch.fx.Node) and n.args[1] in dependent
            masks_here = [(args[0], "allow" if on_true else "block")]
        elif name in ("add", "sub"):
            masks_here = [(a, "bias") for a in args if a not in dependent and val(a) is not None]
        for mask, meaning in masks_here:
            found = True
            pairs = masks.allowed_pairs(mask, meaning, s_q, s_k, dependent)
            if pairs is None:
                return "masked (not evaluated)"
            allowed &= pairs
        if n is softmax or costs[n].kind in _WALK_KINDS:
            stack.extend(a for a in args if a in dependent)
    return masks.describe(allowed, False) if found else "full"


def _is_cross(q: torch.fx.Node, k: torch.fx.Node, scope: str, dependent: set[torch.fx.Node]) -> bool:
    """Whether keys come from other activations than queries (a decoder reading an encoder's output): inside
    the attention op's module `scope`, the batch-dependent tensors that feed q share none with those feeding k."""
    if not scope:
        return False

    def sources(n: torch.fx.Node) -> set[torch.fx.Node]:
        out: set[torch.fx.Node] = set()
        stack, seen = [n], set()
        while stack:
            a = stack.pop()
            if a in seen or a not in dependent:
                continue
            seen.add(a)
            out.add(a)
            if _in_scope(a, scope):
                stack.extend(_inputs(a))
        return out

    return not (sources(q) & sources(k))


def _in_scope(n: torch.fx.Node, scope: str) -> bool:
    stack = n.meta.get("nn_module_stack") or {}
    return any(str(path) == scope for path, _ in stack.values())


def _producer(
    n: torch.fx.Node, costs: dict[torch.fx.Node, OpCost], dependent: set[torch.fx.Node], want: Any
) -> torch.fx.Node | None:
    """Walk back from n through views and elementwise ops (scale, mask, cast) to the op `want` accepts."""
    stack = [a for a in _inputs(n) if a in dependent]
    seen: set[torch.fx.Node] = set()
    while stack:
        a = stack.pop()
        if a in seen or a not in costs:
            continue
        seen.add(a)
        if want(a):
            return a
        if costs[a].kind in _WALK_KINDS:
            stack.extend(x for x in _inputs(a) if x in dependent)
    return None


def _feeds_matmul(n: torch.fx.Node, costs: dict[torch.fx.Node, OpCost]) -> bool:
    """Whether n's output reaches an activation matmul through views, casts and dropout only."""
    stack = list(n.users)
    seen: set[torch.fx.Node] = set()
    while stack:
        u = stack.pop()
        if u in seen or u not in costs:
            continue
        seen.add(u)
        kind = costs[u].kind
        if kind == "matmul":
            return True
        if kind in ("view", "dropout") or (kind == "elementwise" and op_name(u) in ("to", "float", "type_as")):
            stack.extend(u.users)
    return False


def _heads_before_broadcast(
    key: torch.fx.Node, s_k: int, d: int, costs: dict[torch.fx.Node, OpCost], dependent: set[torch.fx.Node]
) -> int:
    """Fewest heads of any batch-dependent tensor from which the key is made by views/elementwise ops, counting
    only tensors that still have the (s_k, d) extents (so rotary halves and fused projections do not count)."""
    best = None
    stack = [key]
    seen: set[torch.fx.Node] = set()
    while stack:
        a = stack.pop()
        if a in seen:
            continue
        seen.add(a)
        t = val(a)
        if t is not None and _has_extents(t, s_k, d) and t.numel() % (s_k * d) == 0:
            h = t.numel() // (s_k * d)
            best = h if best is None else min(best, h)
        if a in costs and costs[a].kind in _WALK_KINDS:
            stack.extend(x for x in _inputs(a) if x in dependent)
    return best or 0


def _has_extents(t: torch.Tensor, s: int, d: int) -> bool:
    dims = list(t.shape)
    if s not in dims:
        return False
    dims.remove(s)
    return d in dims


def _module(n: torch.fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return str(path)


def _hidden(
    calls: list[torch.fx.Node],
    owner: dict[torch.fx.Node, str],
    dependent: set[torch.fx.Node],
    params: set[torch.fx.Node],
    first_block: str | None,
) -> tuple[int | None, str]:
    """Last extent of the largest float activation entering the first block (the residual stream)."""
    if first_block is None:
        return None, ""
    members = [n for n in calls if owner.get(n) == first_block]
    inside = set(members)
    entering = {
        a
        for n in members
        for a in _inputs(n)
        if a not in inside and a in dependent and a not in params and _is_float(val(a))
    }
    if not entering:
        return None, ""
    stream = max(entering, key=lambda a: val(a).numel())  # type: ignore[union-attr]
    t = val(stream)
    assert t is not None
    if t.dim() == 4 and {op_name(n) for n in members} & _CHANNELS_FIRST:  # a conv block's (N, C, H, W) input
        return int(t.shape[1]), f"the channels of {first_block}'s input, shape {tuple(t.shape)}"
    return int(t.shape[-1]), f"the input of {first_block}, shape {tuple(t.shape)}"


# ops that read dimension 1 of a 4-d tensor as channels: a block that runs them takes (N, C, H, W)
_CHANNELS_FIRST = frozenset({"convolution", "conv2d", "group_norm", "native_group_norm", "batch_norm"})


def _numel(t: torch.Tensor | None) -> int:
    return t.numel() if t is not None else 0


def _is_float(t: torch.Tensor | None) -> bool:
    return t is not None and t.is_floating_point()


def _vocab_in(calls: list[torch.fx.Node], dependent: set[torch.fx.Node], params: set[torch.fx.Node]) -> int | None:
    """Rows of the first embedding whose indices are a sequence from the batch (position tables read an arange;
    one id per sample, a class label as a DiT embeds it, is not a token sequence)."""
    for n in calls:
        if op_name(n) != "embedding":
            continue
        tensors = [a for a in _inputs(n) if val(a) is not None]
        weight = next((a for a in tensors if a in params), None)
        index = next((a for a in tensors if a not in params), None)
        if weight is not None and index is not None and index in dependent and _numel(val(index)) > 1:
            w = val(weight)
            assert w is not None
            return int(w.shape[0])
    return None


def _output_projection(calls: list[torch.fx.Node], costs: dict[torch.fx.Node, OpCost]) -> torch.fx.Node | None:
    """The linear whose output, through views and casts, is the cross-entropy's input (the logits)."""
    for n in calls:
        if op_name(n) not in _CE_LOSSES:
            continue
        tensors = [a for a in _inputs(n) if val(a) is not None]
        if not tensors:
            continue
        logits = _producer_from(tensors[0], costs, lambda m: costs[m].kind == "linear")
        if logits is not None and val(logits) is not None:
            return logits
    return None


def _producer_from(n: torch.fx.Node, costs: dict[torch.fx.Node, OpCost], want: Any) -> torch.fx.Node | None:
    """n itself or the first op behind its views / elementwise ops (logit soft-capping, casts) that `want`
    accepts; a log_softmax before nll_loss is passed through too."""
    stack = [n]
    seen: set[torch.fx.Node] = set()
    while stack:
        a = stack.pop()
        if a in seen or a not in costs:
            continue
        seen.add(a)
        if want(a):
            return a
        if costs[a].kind in _WALK_KINDS or op_name(a) in ("log_softmax", "_log_softmax"):
            stack.extend(x for x in _inputs(a) if x in costs)
    return None
