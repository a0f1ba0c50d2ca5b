"""Why the chosen layout won: the reason each alternative lost, and why each dimension took its value."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from mlm.planner.layout import RECOMPUTE_CHOICES, ZERO_CHOICES, Layout
from mlm.planner.search.layouts import Candidate, SearchResult

if TYPE_CHECKING:
    from mlm.planner.cost.step_time import Evaluation

BREAKDOWN_LABELS = {
    "compute_s": "compute",
    "tp_comm_s": "tensor-parallel communication",
    "pp_comm_s": "pipeline send/recv",
    "ep_comm_s": "expert all-to-all (dispatch + combine)",
    "cp_comm_s": "context-parallel K/V ring exchange",
    "dp_comm_s": "data-parallel gradient sync",
    "bubble_s": "pipeline bubble",
    "recompute_s": "recompute",
    "optimizer_s": "optimizer step",
}
DIMENSIONS = ("tp", "pp", "dp", "cp", "ep", "micro_batch", "vpp", "sequence_parallel", "recompute", "zero")


def why_slower(cand: Candidate, best: Candidate) -> str:
    """The breakdown terms in which `cand` spends the most extra time, relative to `best`."""
    a, b = cand.evaluation.breakdown, best.evaluation.breakdown
    deltas = sorted(((a.get(k, 0.0) - b.get(k, 0.0), k) for k in BREAKDOWN_LABELS), reverse=True)
    total = cand.evaluation.step_time_s - best.evaluation.step_time_s
    parts = [f"{BREAKDOWN_LABELS[k]} +{d * 1e3:.0f} ms" for d, k in deltas[:2] if d > 0.02 * max(total, 1e-12)]
    pct = 100.0 * total / best.evaluation.step_time_s
    return f"{pct:+.1f}% step time" + (f" ({', '.join(parts)})" if parts else "")


def alternatives(result: SearchResult, k: int) -> list[dict[str, object]]:
    """The k runners-up (distinct layouts) and the closest infeasible ones, each with the reason it lost."""
    best = result.best
    rows: list[dict[str, object]] = []
    for cand in result.ranked[1 : k + 1]:
        rows.append(
            {
                "layout": _layout_dict(cand.layout),
                "step_time_s": cand.evaluation.step_time_s,
                "mfu": cand.evaluation.mfu,
                "why": why_slower(cand, best),
            }
        )
    for cand in result.infeasible[:2]:
        rows.append(
            {
                "layout": _layout_dict(cand.layout),
                "step_time_s": None,
                "mfu": None,
                "why": f"does not fit: {cand.evaluation.reason}",
            }
        )
    return rows


MESH = ("tp", "pp", "dp", "cp")
# a layout's evaluation (with these blocks per stage, None: balanced), or why it cannot run
WhatIf = Callable[[Layout, "tuple[int, ...] | None"], "Evaluation | str"]


def explain_dimensions(
    result: SearchResult, what_if: WhatIf | None = None, pinned: frozenset[str] = frozenset()
) -> dict[str, str]:
    """For each dimension, why it took its value. Mesh sizes (tp, pp, dp, cp) move together, so they are compared with
    the best layout that has another value there (named, since it differs elsewhere too). The other dimensions
    are compared all else equal: the chosen layout with only that dimension changed, taken from the ranking or,
    when the search pruned it (e.g. more recompute than needed), evaluated through `what_if` on the chosen
    layout's blocks per stage."""
    best = result.best
    out: dict[str, str] = {}
    for dim in DIMENSIONS:
        chosen = getattr(best.layout, dim)
        if dim in pinned:
            out[dim] = f"{dim}={chosen}: pinned on the command line"
        elif dim in MESH or what_if is None:
            out[dim] = _mesh_reason(result, dim, chosen)
        else:
            out[dim] = _one_change_reason(result, dim, chosen, what_if)
    return out


def _mesh_reason(result: SearchResult, dim: str, chosen: object) -> str:
    best = result.best
    rival = next((c for c in result.ranked if getattr(c.layout, dim) != chosen), None)
    if rival is None:
        return f"{dim}={chosen}: the only value with a layout that fits and can run"
    other = getattr(rival.layout, dim)
    return (
        f"{dim}={chosen}: the best layout with {dim}={other} ({rival.layout.describe()}) is {why_slower(rival, best)}"
    )


def _one_change_reason(result: SearchResult, dim: str, chosen: object, what_if: WhatIf) -> str:
    best = result.best
    lay = best.layout
    parts = []
    for other in _other_values(lay, dim):
        changes: dict[str, object] = {dim: other}
        if dim == "micro_batch":
            changes["num_microbatches"] = lay.global_batch // (lay.dp * int(other))  # type: ignore[call-overload]
        rival_layout = replace(lay, **changes)  # type: ignore[arg-type]
        known = next((c for c in result.ranked if c.layout == rival_layout), None)
        if known is not None:
            parts.append(f"{dim}={other} is {why_slower(known, best)}")
            continue
        same_stages = rival_layout.vpp == lay.vpp and best.assignment is not None
        ev = what_if(rival_layout, best.assignment.blocks_per_stage if same_stages else None)  # type: ignore
        if isinstance(ev, str):
            parts.append(f"{dim}={other} cannot run ({ev})")
        elif not ev.fits:
            parts.append(
                f"{dim}={other} does not fit (peak {ev.peak_memory_bytes / 2**30:.1f} of "
                f"{ev.capacity_bytes / 2**30:.1f} GiB)"
            )
        else:
            parts.append(f"{dim}={other} is {why_slower(Candidate(rival_layout, ev), best)}")
    if not parts:
        why = {
            "vpp": "no pipeline (pp=1), so nothing to interleave",
            "zero": "dp=1, so nothing to shard",
            "sequence_parallel": "sequence parallelism needs tp > 1",
            "ep": "no other expert-parallel size divides dp·cp and the experts (1 for a dense model)",
        }.get(dim, "the only value possible here")
        return f"{dim}={chosen}: {why}"
    return f"{dim}={chosen}: all else equal, " + "; ".join(parts)


def _other_values(lay: Layout, dim: str) -> list[object]:
    """The values worth comparing with the chosen one, all else equal."""
    if dim == "recompute":
        return [r for r in RECOMPUTE_CHOICES if r != lay.recompute]
    if dim == "zero":
        return [z for z in ZERO_CHOICES if z != lay.zero] if lay.dp * lay.cp > 1 else []
    if dim == "ep":  # layout_problem (through what_if) says when the experts do not split that way
        return [e for e in (lay.ep // 2, lay.ep * 2) if e >= 1 and e != lay.ep and (lay.dp * lay.cp) % e == 0]
    if dim == "sequence_parallel":
        return [not lay.sequence_parallel] if lay.tp > 1 else []
    if dim == "vpp":
        return [] if lay.pp == 1 else ([1] if lay.vpp > 1 else [2])
    if dim == "micro_batch":
        per_replica = lay.global_batch // lay.dp
        return [
            m
            for m in (lay.micro_batch // 2, lay.micro_batch * 2)
            if m >= 1 and m != lay.micro_batch and per_replica % m == 0
        ]
    return []


def _layout_dict(layout: Layout) -> dict[str, object]:
    from dataclasses import asdict

    return asdict(layout)
