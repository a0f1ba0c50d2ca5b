"""One entry point from (model, request, profiles) to a Plan: search or pinned evaluation, TP map, plan.json.

The layout search ranks candidates by the cost model; the tensor-parallel sharding ILP then shards the best one.
A candidate the ILP cannot shard (e.g. per-head q/k norms under sequence parallelism) is skipped with its reason,
and the next one is tried; only when none is left does planning fail, naming the reasons grouped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from mlm.planner.capture.graph import ModelIR
from mlm.planner.cost.hardware import ClusterProfile, GPUProfile, resolve
from mlm.planner.cost.step_time import Evaluation, StageAssignment, evaluate
from mlm.planner.errors import Infeasible
from mlm.planner.layout import Layout
from mlm.planner.plan import Plan
from mlm.planner.search.explain import DIMENSIONS, alternatives, explain_dimensions
from mlm.planner.search.layouts import (
    Candidate,
    PlanRequest,
    SearchResult,
    evaluate_pinned,
    layout_problem,
    priced_inputs,
    search,
    tp_ruled_out_by_heads,
)
from mlm.planner.search.plan_document import build_plan
from mlm.planner.search.sharder import Sharder
from mlm.planner.search.tp_sharding import TPSharding

if TYPE_CHECKING:  # ModelSpec imports torch; a cache hit passes a CachedSpec instead
    from mlm.planner.capture.loader import ModelSpec


@dataclass(frozen=True)
class PlanOutcome:
    plan: Plan
    result: SearchResult | None  # None when every dimension was pinned
    summary: dict[str, Any]
    explanations: dict[str, str] = field(default_factory=dict)


def make_plan(
    spec: ModelSpec,
    ir: ModelIR,
    request: PlanRequest,
    gpu_name: str | None = None,
    cluster_name: str | None = None,
    assumptions: Sequence[str] = (),
) -> PlanOutcome:
    """`assumptions`: the caller's own defaults (one sentence each), listed first among the plan's warnings."""
    gpu, cluster = resolve(gpu_name, cluster_name)
    result: SearchResult | None = None
    shard = _Sharder(ir, gpu, cluster, request)
    if request.fully_pinned:
        best: Candidate = evaluate_pinned(ir, request, gpu, cluster, shard)
        sharding = shard(best.layout)
        if isinstance(sharding, str):
            raise Infeasible(f"layout {best.layout.describe()} cannot be sharded: {sharding}")
        alts: list[dict[str, object]] = []
        how = "evaluated the pinned layout"
        explanations = {"layout": "every dimension was pinned on the command line"}
        notes = _unpinned_mesh_notes(ir, request)
    else:
        result = search(ir, request, gpu, cluster, shard)
        try:
            result, sharding = _first_shardable(result, shard, request.top_k)
        except Infeasible as every_ranked:
            # every ranked layout had a (tp, sp) the sharding ILP cannot run (a search prices layouts before they
            # are sharded): search again without those pairs; the skipped ones stay in shard.skipped for --explain
            bad = shard.bad_keys()
            if not bad:
                raise
            try:
                result = search(ir, request, gpu, cluster, shard, exclude=bad)
            except Infeasible:
                raise every_ranked from None
            result, sharding = _first_shardable(result, shard, request.top_k)
        best = result.best
        alts = alternatives(result, request.top_k)
        how = (
            f"searched {result.evaluated} layouts and {result.milp_solves} stage MILPs in "
            f"{result.seconds:.2f} s; captured with {ir.capture_method} in {ir.capture_seconds:.2f} s"
        )
        explanations = explain_dimensions(result, _what_if(ir, request, gpu, cluster, shard), _pinned(request))
        notes = list(result.notes)
        if (ruled_out := tp_ruled_out_by_heads(ir, request, cluster)) is not None:
            notes.append(ruled_out)
        if not ir.num_experts and "ep" not in _pinned(request):
            explanations["ep"] = "ep=1: the model has no routed experts for expert parallelism to split"
        if shard.skipped:
            explanations["skipped"] = skipped_summary(shard.skipped)
            notes.append(explanations["skipped"])
    inputs = priced_inputs(ir, request, gpu, cluster, shard)
    plan = build_plan(
        spec, ir, best.layout, best.evaluation, best.assignment, gpu, cluster, sharding.styles, alts, inputs
    )
    warnings = [*assumptions, *getattr(ir, "warnings", ()), *notes, *sharding.notes]
    pinned = [d for d in DIMENSIONS if d in _pinned(request)]
    plan = replace(plan, pinned=pinned, warnings=list(dict.fromkeys(warnings)))
    summary = {
        "model": spec.display_name,
        "cluster": cluster.name,
        "capacity_bytes": best.evaluation.capacity_bytes,
        "block_names": {layer.name for layer in ir.blocks},
        "search": how,
        "calibration": (
            f"{gpu.name} profile {gpu.calibration.summary()}"
            if gpu.calibration is not None
            else f"{gpu.name} profile: uncalibrated (no [calibration] table)"
        ),
    }
    return PlanOutcome(plan=plan, result=result, summary=summary, explanations=explanations)


def _unpinned_mesh_notes(ir: ModelIR, request: PlanRequest) -> list[str]:
    """Sentences for a fully pinned request that left cp or ep out (evaluated at 1, or cp as a pinned dp implies)."""
    out = []
    if request.cp is None and not request.dp:
        out.append("--cp not pinned while every other dimension was: evaluated cp 1 (pin --cp to change)")
    if request.ep is None and ir.num_experts:
        out.append("--ep not pinned while every other dimension was: evaluated ep 1 (pin --ep to change)")
    return out


class _Sharder(Sharder):
    """The search's Sharder, keyed by layouts, with the candidates it could not shard."""

    def __init__(self, ir: ModelIR, gpu: GPUProfile, cluster: ClusterProfile, request: PlanRequest) -> None:
        super().__init__(ir, gpu, cluster, request.solver, request.time_limit_s)
        self.skipped: list[tuple[Candidate, str]] = []

    def __call__(self, layout: Layout) -> TPSharding | str:
        return self.solve(layout.tp, layout.sequence_parallel)

    def known_bad_layout(self, layout: Layout) -> bool:
        return self.known_bad(layout.tp, layout.sequence_parallel)


def _first_shardable(result: SearchResult, shard: _Sharder, top_k: int) -> tuple[SearchResult, TPSharding]:
    """The fastest ranked candidate the sharding ILP can shard, and the result without the unshardable ones (the
    top_k alternatives after it are checked too). Candidates faster than the chosen one that were skipped go to
    shard.skipped. Raises Infeasible naming the grouped reasons when no candidate is left."""
    chosen: tuple[Candidate, TPSharding] | None = None
    kept: list[Candidate] = []
    failed: list[tuple[Candidate, str]] = []
    for i, cand in enumerate(result.ranked):
        if chosen is not None and len(kept) > top_k:
            kept.extend(c for c in result.ranked[i:] if not shard.known_bad_layout(c.layout))
            break
        got = shard(cand.layout)
        if isinstance(got, str):
            failed.append((cand, got))
            if chosen is None:
                shard.skipped.append((cand, got))
            continue
        kept.append(cand)
        if chosen is None:
            chosen = (cand, got)
    if chosen is None:
        raise Infeasible("no candidate layout can be sharded: " + _grouped(failed))
    return replace(result, best=chosen[0], ranked=kept), chosen[1]


def _grouped(skipped: list[tuple[Candidate, str]]) -> str:
    by_reason: dict[str, list[Candidate]] = {}
    for cand, why in skipped:
        by_reason.setdefault(why, []).append(cand)
    return "; ".join(
        f"{why} ({len(cands)} layout{'s' if len(cands) > 1 else ''}, e.g. {cands[0].layout.describe()})"
        for why, cands in by_reason.items()
    )


def skipped_summary(skipped: list[tuple[Candidate, str]]) -> str:
    """One sentence: how many faster layouts were skipped, and why (grouped by reason)."""
    n = len(skipped)
    return f"{n} faster candidate layout{'s were' if n > 1 else ' was'} skipped: " + _grouped(skipped)


def _pinned(request: PlanRequest) -> frozenset[str]:
    """Dimensions the user fixed. cp and ep default to 1 (PlanRequest): at 1 they count as the default, not a pin."""
    defaults = {"cp": 1, "ep": 1}
    values = {d: getattr(request, d) for d in DIMENSIONS}
    return frozenset(d for d, v in values.items() if v is not None and v != defaults.get(d))


def _what_if(
    ir: ModelIR, request: PlanRequest, gpu: GPUProfile, cluster: ClusterProfile, shard: Sharder
) -> Callable[[Layout, tuple[int, ...] | None], Evaluation | str]:
    """Evaluate one layout for --explain (on the given blocks per stage, every block under layout.recompute;
    None: balanced), or say why it cannot run."""
    inputs = priced_inputs(ir, request, gpu, cluster, shard)

    def what_if(layout: Layout, blocks: tuple[int, ...] | None) -> Evaluation | str:
        problem = layout_problem(ir, layout, request.global_batch)
        if problem:
            return problem
        return evaluate(inputs, layout, gpu, cluster, StageAssignment(blocks) if blocks else None)

    return what_if
