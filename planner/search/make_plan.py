"""One entry point from (model, request, profiles) to a Plan: search or pinned evaluation, TP map, plan.json."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlm.planner.capture.graph import ModelIR
from mlm.planner.capture.loader import ModelSpec
from mlm.planner.cost.hardware import ClusterProfile, GPUProfile, resolve
from mlm.planner.cost.step_time import Evaluation, StageAssignment, evaluate, summarize
from mlm.planner.layout import Layout
from mlm.planner.plan import Plan
from mlm.planner.search.explain import alternatives, explain_dimensions
from mlm.planner.search.layouts import Candidate, PlanRequest, SearchResult, evaluate_pinned, layout_problem, search
from mlm.planner.search.plan_document import build_plan
from mlm.planner.search.tp_sharding import plan_tensor_parallel


@dataclass(frozen=True)
class PlanOutcome:
    plan: Plan
    result: SearchResult | None  # None when every dimension was pinned
    summary: dict[str, Any]
    explanations: dict[str, str] = field(default_factory=dict)


def make_plan(
    spec: ModelSpec, ir: ModelIR, request: PlanRequest, gpu_name: str | None = None, cluster_name: str | None = None
) -> PlanOutcome:
    gpu, cluster = resolve(gpu_name, cluster_name)
    result: SearchResult | None = None
    if request.fully_pinned:
        best: Candidate = evaluate_pinned(ir, request, gpu, cluster)
        alts: list[dict[str, object]] = []
        how = "evaluated the pinned layout"
        explanations = {"layout": "every dimension was pinned on the command line"}
    else:
        result = search(ir, request, gpu, cluster)
        best = result.best
        alts = alternatives(result, request.top_k)
        how = (
            f"searched {result.evaluated} layouts and {result.milp_solves} stage MILPs in "
            f"{result.seconds:.2f} s; captured with {ir.capture_method} in {ir.capture_seconds:.2f} s"
        )
        explanations = explain_dimensions(result, _what_if(ir, request, gpu, cluster), _pinned(request))
    sharding = plan_tensor_parallel(ir, best.layout.tp, best.layout.sequence_parallel)
    plan = build_plan(spec, ir, best.layout, best.evaluation, best.assignment, gpu, cluster, sharding.styles, alts)
    summary = {
        "model": spec.display_name,
        "cluster": cluster.name,
        "capacity_bytes": best.evaluation.capacity_bytes,
        "block_names": {layer.name for layer in ir.blocks},
        "search": how,
    }
    return PlanOutcome(plan=plan, result=result, summary=summary, explanations=explanations)


def _pinned(request: PlanRequest) -> frozenset[str]:
    dims = ("tp", "pp", "dp", "micro_batch", "vpp", "sequence_parallel", "recompute", "zero")
    return frozenset(d for d in dims if getattr(request, d) is not None)


def _what_if(
    ir: ModelIR, request: PlanRequest, gpu: GPUProfile, cluster: ClusterProfile
) -> Callable[[Layout, tuple[int, ...] | None], Evaluation | str]:
    """Evaluate one layout for --explain (on the given blocks per stage, every block under layout.recompute;
    None: balanced), or say why it cannot run."""
    inputs = summarize(ir)

    def what_if(layout: Layout, blocks: tuple[int, ...] | None) -> Evaluation | str:
        problem = layout_problem(ir, layout, request.global_batch)
        if problem:
            return problem
        return evaluate(inputs, layout, gpu, cluster, StageAssignment(blocks) if blocks else None)

    return what_if
