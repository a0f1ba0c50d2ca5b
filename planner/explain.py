"""Why the chosen layout won: the reason each alternative lost, and why each dimension took its value."""
from __future__ import annotations

from mlm.planner.layout import Layout
from mlm.planner.search import Candidate, SearchResult

BREAKDOWN_LABELS = {
    "compute_s": "compute", "tp_comm_s": "tensor-parallel communication", "pp_comm_s": "pipeline send/recv",
    "dp_comm_s": "data-parallel gradient sync", "bubble_s": "pipeline bubble", "recompute_s": "recompute",
    "optimizer_s": "optimizer step",
}
DIMENSIONS = ("tp", "pp", "dp", "micro_batch", "vpp", "sequence_parallel", "recompute", "zero")


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
    for cand in result.ranked[1: k + 1]:
        rows.append({"layout": _layout_dict(cand.layout), "step_time_s": cand.evaluation.step_time_s,
                     "mfu": cand.evaluation.mfu, "why": why_slower(cand, best)})
    for cand in result.infeasible[:2]:
        rows.append({"layout": _layout_dict(cand.layout), "step_time_s": None, "mfu": None,
                     "why": f"does not fit: {cand.evaluation.reason}"})
    return rows


def explain_dimensions(result: SearchResult) -> dict[str, str]:
    """For each dimension: the best layout that differs there, and what it would cost."""
    best = result.best
    out: dict[str, str] = {}
    for dim in DIMENSIONS:
        chosen = getattr(best.layout, dim)
        rival = next((c for c in result.ranked if getattr(c.layout, dim) != chosen), None)
        if rival is None:
            out[dim] = f"{dim}={chosen}: the only value that fits or is allowed (pinned or forced by divisibility)"
            continue
        other = getattr(rival.layout, dim)
        out[dim] = f"{dim}={chosen}: the best layout with {dim}={other} is {why_slower(rival, best)}"
    return out


def _layout_dict(layout: Layout) -> dict[str, object]:
    from dataclasses import asdict

    return asdict(layout)
