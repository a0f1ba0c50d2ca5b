"""Recognise routed mixture-of-experts layers from the module tree and the captured graph.

On the meta device the expert dispatch (a loop over `torch.where(expert_mask)`, `nonzero`, index_add) runs zero
times, or, in dense one-hot formulations, every expert runs on every token: either way the graph does not show
what a GPU computes. So the MoE structure is read from the module tree, independent of how dispatch is written:

- the experts: an nn.ModuleList / nn.ModuleDict of >= 2 structurally identical modules holding GEMM weights, or
  fused 3-D weights whose leading extent is the number of experts (as transformers 5 builds them);
- the router: a sibling whose only weight is (num_experts, hidden) (an nn.Linear or a router module), or such a
  2-D parameter on the MoE module itself;
- top_k: the `k` of the graph's topk op over the router's num_experts scores inside the module, else an attribute
  (top_k, num_experts_per_tok, ...);
- shared experts: the MoE module's other children with parameters (run densely; the graph captures them).

The captured ops inside the experts are dropped and the experts priced analytically from their GEMMs
(trace.py): top_k experts per token times a capacity factor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch.fx
from torch import nn

from mlm.planner.capture.graph import ExpertGemm, MoEIR
from mlm.planner.capture.ops import op_name, val

TOP_K_ATTRIBUTES = ("top_k", "num_experts_per_tok", "topk", "moe_top_k", "router_topk", "num_selected_experts", "k")


@dataclass(frozen=True)
class MoESite:
    """A recognised MoE module before capture: the IR plus what the capture must drop from the graph."""

    ir: MoEIR
    expert_modules: tuple[str, ...]  # FQNs whose ops are the experts' compute (dropped from the graph costs)
    expert_params: frozenset[str]  # FQNs of the routed experts' parameters
    router_param: str  # FQN of the router weight


def find_moe(model: nn.Module, capacity_factor: float = 1.0) -> dict[str, MoESite]:
    """Every routed MoE module of `model` by FQN (empty for a dense model)."""
    found: dict[str, MoESite] = {}
    for fqn, module in model.named_modules():
        site = _recognise(fqn, module, capacity_factor)
        if site is not None and not any(fqn.startswith(f + ".") for f in found):
            found[fqn] = site
    return found


def _recognise(fqn: str, module: nn.Module, capacity_factor: float) -> MoESite | None:
    experts = _experts(fqn, module)
    if experts is None:
        return None
    num, names, params, per_expert, gemms, how = experts
    router = _router(fqn, module, num, names)
    if router is None:
        return None
    router_name, router_param, router_params, hidden = router
    gemms = _orient(gemms, hidden, module, names)
    top_k, top_k_from = _top_k_attribute(module, names)
    shared = [
        (f"{_join(fqn, n)}", child)
        for n, child in module.named_children()
        if _join(fqn, n) not in names and _join(fqn, n) != router_name and any(True for _ in child.parameters())
    ]
    ir = MoEIR(
        module=fqn,
        num_experts=num,
        top_k=top_k,
        top_k_from=top_k_from,
        expert_params=per_expert,
        expert_gemms=tuple(gemms),
        expert_modules=tuple(names),
        expert_tensors=len(params),
        router=router_name,
        router_params=router_params,
        shared_modules=tuple(n for n, _ in shared),
        shared_params=sum(p.numel() for _, c in shared for p in c.parameters()),
        capacity_factor=capacity_factor,
        how=how,
    )
    return MoESite(ir, tuple(names), frozenset(params), router_param)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _signature(m: nn.Module) -> tuple:
    return type(m), tuple((n, tuple(p.shape)) for n, p in m.named_parameters())


def _experts(
    fqn: str, module: nn.Module
) -> tuple[int, list[str], list[str], int, list[tuple[str, tuple[int, ...], bool]], str] | None:
    """(number, expert module FQNs, expert parameter FQNs, params per expert, raw GEMM weights, how)."""
    for name, child in module.named_children():
        path = _join(fqn, name)
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and len(child) >= 2:
            members = list(child.children())
            if len({_signature(m) for m in members}) != 1:
                continue
            first = members[0]
            weights = [(n, tuple(p.shape), _has_bias(first, n)) for n, p in first.named_parameters() if p.dim() == 2]
            if len(weights) < 2:
                continue
            params = [f"{path}.{n}" for n, _ in child.named_parameters()]
            per = sum(p.numel() for p in first.parameters())
            return len(members), [path], params, per, weights, f"{path}: a {type(child).__name__} of experts"
    fused = [(fqn, module, False)] + [(_join(fqn, n), c, True) for n, c in module.named_children()]
    for path, holder, recurse in fused:
        ps = list(holder.named_parameters(recurse=recurse))
        three = [(n, p) for n, p in ps if p.dim() == 3]
        if not three or len({p.shape[0] for _, p in three}) != 1 or three[0][1].shape[0] < 2:
            continue
        num = int(three[0][1].shape[0])
        banks = [(n, p) for n, p in ps if p.shape and p.shape[0] == num and p.dim() in (2, 3)]
        bank_size = sum(p.numel() for _, p in banks)
        if recurse and bank_size < 0.9 * sum(p.numel() for _, p in ps):
            continue
        names = {n for n, _ in banks}
        weights = [(n, tuple(p.shape[1:]), f"{n}_bias" in names or f"{n}.bias" in names) for n, p in three]
        params = [_join(path, n) for n in names]
        modules = [path] if recurse else []
        return num, modules, params, bank_size // num, weights, f"{path}: fused {num}-expert weights"
    return None


def _has_bias(module: nn.Module, weight_name: str) -> bool:
    owner, _, _ = weight_name.rpartition(".")
    try:
        sub = module.get_submodule(owner) if owner else module
    except AttributeError:
        return False
    return getattr(sub, "bias", None) is not None


def _router(fqn: str, module: nn.Module, num: int, experts: list[str]) -> tuple[str, str, int, int] | None:
    """(module FQN, weight FQN, parameters, hidden) of the router: one (num_experts, hidden) weight (+ bias)."""
    own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() == 2 and p.shape[0] == num]
    if own:
        n, p = own[0]
        return fqn, _join(fqn, n), p.numel(), int(p.shape[1])
    for name, child in module.named_children():
        path = _join(fqn, name)
        if path in experts:
            continue
        ps = list(child.named_parameters())
        mats = [(n, p) for n, p in ps if p.dim() == 2]
        if len(mats) != 1 or mats[0][1].shape[0] != num:
            continue
        if any(p.dim() > 2 or (p.dim() == 1 and p.shape[0] != num) for _, p in ps):
            continue
        n, p = mats[0]
        return path, f"{path}.{n}", sum(q.numel() for _, q in ps), int(p.shape[1])
    return None


def _orient(
    weights: list[tuple[str, tuple[int, ...], bool]], hidden: int, module: nn.Module, experts: list[str]
) -> list[ExpertGemm]:
    """GEMM (in, out) of each expert weight. nn.Linear and transformers 5 store (out, in); a module attribute
    `is_transposed` says (in, out); otherwise (out, in) unless only (in, out) makes the first GEMM read hidden."""
    transposed = None
    for m in module.modules():
        if isinstance(getattr(m, "is_transposed", None), bool):
            transposed = m.is_transposed
    if transposed is None:
        first = weights[0][1]
        transposed = first[-1] != hidden and first[-2] == hidden
    out = []
    for name, shape, bias in weights:
        rows, cols = shape[-2], shape[-1]
        i, o = (rows, cols) if transposed else (cols, rows)
        out.append(ExpertGemm(name, int(i), int(o), bias))
    return out


def _top_k_attribute(module: nn.Module, experts: list[str]) -> tuple[int, str]:
    for name, sub in module.named_modules():
        for attr in TOP_K_ATTRIBUTES:
            value = getattr(sub, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                where = f"{name}.{attr}" if name else attr
                return value, f"attribute {where}"
    return 0, "not found"


def top_k_from_graph(site: MoESite, calls: list[torch.fx.Node], scope: str) -> MoESite:
    """The k of a topk op inside `scope` (the MoE module's stack path) over num_experts scores, if any."""
    for n in calls:
        if op_name(n) != "topk" or not _in_module(n, scope):
            continue
        x = val(n.args[0]) if n.args else None
        k = n.args[1] if len(n.args) > 1 else n.kwargs.get("k")
        if x is not None and isinstance(k, int) and x.shape[-1] == site.ir.num_experts:
            return replace(site, ir=replace(site.ir, top_k=k, top_k_from="the graph's topk op"))
    return site


def _in_module(n: torch.fx.Node, fqn: str) -> bool:
    stack = n.meta.get("nn_module_stack") or {}
    return any(
        clean_path(str(path)) == fqn or clean_path(str(path)).startswith(fqn + ".") for path, _ in stack.values()
    )


def clean_path(path: str) -> str:
    """Normalise stack paths such as "L['self'].model.layers[0]" or "layers.slice(None, 2, None).0"."""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\.slice\([^)]*\)", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return path.strip(".")
