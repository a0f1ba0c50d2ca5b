"""What an attention op lets each query see: causal, full, a sliding window of w keys, or some other mask.

The mask of a captured attention is a constant of the graph (built from arange / tril / comparisons, never from
the batch), but capture runs on the meta device, where it has no values. So the mask's own subgraph is run again
on the CPU at the captured length, and the allowed (query, key) pairs are compared with the causal and sliding-
window patterns. Masks that depend on the batch (padding masks) or on parameters are not evaluated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from mlm.planner.capture.ops import op_name

MAX_EVALUATED = 8192  # longest sequence whose (s x s) mask is evaluated on the CPU (64 MiB as bool)


def sdpa_mask(node: torch.fx.Node) -> tuple[Any, bool]:
    """(attn_mask argument, is_causal flag) of a scaled_dot_product_attention call."""
    args, kwargs = node.args, node.kwargs
    mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
    causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
    return mask, bool(causal)


def computes_every_block(node: torch.fx.Node) -> bool:
    """Whether an attention kernel call does the work of every (query, key) pair: a mask tensor, or no causal flag
    (torch's SDPA kernels apply a mask after computing the block; only is_causal without a mask lets the flash and
    memory-efficient kernels skip the blocks above the diagonal, half the work)."""
    name = op_name(node)
    args, kwargs = node.args, node.kwargs

    def arg(i: int, key: str, default: Any) -> Any:
        return kwargs.get(key, args[i] if len(args) > i else default)

    if "flash" in name:  # (q, k, v, dropout_p, is_causal, ...): no mask argument
        return not arg(4, "is_causal", False)
    if "efficient" in name or "cudnn" in name:  # (q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal)
        return arg(3, "attn_bias", None) is not None or not arg(6, "is_causal", False)
    mask, causal = sdpa_mask(node)
    return mask is not None or not causal


def describe(allowed: torch.Tensor | None, causal_flag: bool) -> str:
    """'causal', 'full', 'sliding window W', 'masked' or 'masked (not evaluated)' for an (s_q, s_k) boolean
    matrix of allowed pairs (None: no mask evaluated)."""
    if allowed is None:
        return "causal" if causal_flag else "masked (not evaluated)"
    s_q, s_k = allowed.shape
    if causal_flag:
        allowed = allowed & torch.ones(s_q, s_k, dtype=torch.bool).tril(s_k - s_q)
    if bool(allowed.all()):
        return "full"
    if s_q == s_k:
        lower = torch.ones(s_q, s_k, dtype=torch.bool).tril()
        if torch.equal(allowed, lower):
            return "causal"
        window = int(allowed.sum(-1).max())
        if torch.equal(allowed, lower & ~lower.tril(-window)):
            return f"sliding window {window}"
    return "masked"


def allowed_pairs(mask: Any, meaning: str, s_q: int, s_k: int, dependent: set[torch.fx.Node]) -> torch.Tensor | None:
    """Evaluate a constant mask node into an (s_q, s_k) boolean matrix of allowed pairs, or None.

    meaning: 'allow' (bool True = may attend, as SDPA and torch.where take it), 'block' (masked_fill's True =
    hidden) or 'bias' (an additive float mask: a large negative value hides the pair)."""
    if not isinstance(mask, torch.fx.Node) or mask in dependent or max(s_q, s_k) > MAX_EVALUATED:
        return None
    value = evaluate(mask)
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    value = value.reshape(-1, *value.shape[-2:])[0] if value.dim() > 2 else value
    try:
        value = value.expand(s_q, s_k)
    except RuntimeError:
        return None
    if value.dtype == torch.bool:
        return ~value if meaning == "block" else value
    if meaning == "bias" or value.is_floating_point():
        return value > torch.finfo(value.dtype).min / 2 if value.is_floating_point() else value != 0
    return value != 0 if meaning == "allow" else value == 0


def evaluate(target: torch.fx.Node) -> Any:
    """Run the subgraph that computes `target` on the CPU; None when it reads a placeholder or parameter."""
    needed: set[torch.fx.Node] = set()
    stack = [target]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        if n.op not in ("call_function", "call_method"):
            return None
        torch.fx.node.map_arg((n.args, n.kwargs), stack.append)
    env: dict[torch.fx.Node, Any] = {}

    def on_cpu(x: Any) -> Any:
        if isinstance(x, torch.fx.Node):
            return env[x]
        if isinstance(x, torch.device) and x.type == "meta":
            return torch.device("cpu")
        if isinstance(x, str) and x == "meta":
            return "cpu"
        return x

    try:
        for n in target.graph.nodes:
            if n not in needed:
                continue
            args = torch.fx.node.map_aggregate(n.args, on_cpu)
            kwargs = torch.fx.node.map_aggregate(n.kwargs, on_cpu)
            if n.op == "call_method":
                env[n] = getattr(args[0], str(n.target))(*args[1:], **kwargs)
            elif op_name(n) == "_assert_tensor_metadata":
                env[n] = None
            else:
                env[n] = n.target(*args, **kwargs)
    except Exception:  # any op that does not run off the meta device: the mask stays unknown
        return None
    return env[target]
