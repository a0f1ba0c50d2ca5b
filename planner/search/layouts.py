"""Search for the fastest layout that fits, pruned only by valid bounds, so that pinning a field can never
find a faster layout than leaving it free.

Outer choices (tp, pp, dp, cp, ep, micro-batch, vpp, sequence parallelism, recompute, zero) are enumerated once
divisibility rules are applied: every micro-batch dividing the per-replica batch, every vpp that splits the blocks
evenly, every cp dividing the GPUs whose 2·cp causal chunks split the sequence, every ep dividing dp·cp and the
experts (ep = 1 for a dense model). A (tp, pp, dp, cp, ep, zero) group is dropped only when its least memory-hungry
variant (micro-batch 1, vpp 1, sequence parallelism, full or selective recompute) fits under no assignment of blocks
to stages (stage_milp.memory_may_fit). Every other variant is queued with a lower bound on its step time (the
pipeline time with the blocks' work spread evenly, no recompute; dp and optimizer time ≥ 0) and processed best
first: evaluated with balanced stages, then given the stage MILP (planner/search/stage_milp.py: uneven blocks per
stage, per-stage recompute counts) unless a bound shows the MILP cannot beat the best found: integer blocks without
memory (_integer_bound), the LP relaxation (stage_milp.pipeline_lower_bound), or balanced stages that already give a
recompute-free layout the shortest busiest rank possible (then recompute only adds time). Processing stops when the
next bound reaches the best step time. Afterwards enough of the rest is evaluated for the report (the top-k runners-
up, the best rival per mesh dimension). A MILP stopped at its time limit is reported in SearchResult.notes
(plan.json warnings)."""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from mlm.planner.capture.graph import HAND_WRITTEN_ATTENTION, ModelIR, MoEIR
from mlm.planner.cost.hardware import ClusterProfile, GPUProfile
from mlm.planner.cost.inputs import ModelCostInputs
from mlm.planner.cost.step_time import (
    Evaluation,
    StageAssignment,
    StageCoefficients,
    evaluate,
    stage_coefficients,
    summarize,
)
from mlm.planner.errors import Infeasible, PlanError
from mlm.planner.layout import RECOMPUTE_CHOICES, ZERO_CHOICES, Layout
from mlm.planner.search.sharder import Sharder
from mlm.planner.search.stage_milp import (
    StageProblem,
    integer_lower_bound,
    memory_may_fit,
    pipeline_lower_bound,
    solve_stages_status,
)

UNLIMITED = 1 << 30
Group = tuple[int, int, int, int, int, int]  # tp, pp, dp, cp, ep, zero


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for: GPU count, batch, and any pinned dimensions (None = search). cp defaults to 1, not
    to search: no measured cp run calibrates its cost. ep is searched (1 for a dense model), with any tp: mlm-run
    keeps each tp rank's experts whole (runtime/expert_parallel.py), as the cost model prices them."""

    num_gpus: int
    global_batch: int
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = 1
    ep: int | None = None
    micro_batch: int | None = None
    vpp: int | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    zero: int | None = None
    top_k: int = 5
    solver: str = "cbc"
    time_limit_s: float = 10.0
    refine: int = UNLIMITED  # a cap on refining MILPs (mlm-whatif screening); by default only bounds prune
    milp_budget_s: float = 60.0  # wall time for all stage MILPs of one search; past it the rest keep balanced
    # stages, and the plan's warnings say how many could still have won

    @property
    def fully_pinned(self) -> bool:
        """Every dimension but cp and ep pinned: that one layout is evaluated, with cp and ep as pinned or 1
        (pinned_layout; make_plan says so in the warnings when they were not pinned)."""
        return None not in (
            self.tp,
            self.pp,
            self.micro_batch,
            self.vpp,
            self.recompute,
            self.sequence_parallel,
            self.zero,
        )


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    evaluation: Evaluation
    assignment: StageAssignment | None = None  # None: balanced stages


@dataclass(frozen=True)
class SearchResult:
    best: Candidate
    ranked: list[Candidate]  # feasible candidates, fastest first (best included), one per distinct layout
    infeasible: list[Candidate]  # the closest misses, for "why not"
    evaluated: int
    seconds: float
    milp_solves: int = 0
    notes: list[str] = field(default_factory=list)


def search(
    ir: ModelIR,
    request: PlanRequest,
    gpu: GPUProfile,
    cluster: ClusterProfile,
    sharder: Sharder | None = None,
    exclude: frozenset[tuple[int, bool]] = frozenset(),
) -> SearchResult:
    """The fastest fitting layout for `request`; raises Infeasible with what would make it feasible. Every
    candidate is priced with the tensor-parallel styles the sharding ILP chooses for its (tp, sp) (`sharder`,
    shared with the caller that writes those styles into plan.json).

    Two passes. Enumeration: every runnable (tp, pp, dp, zero, micro-batch, vpp, sp, recompute) is scored with
    balanced stages, except what a monotonicity fact rules out: a (tp, pp, dp, zero) group whose least-memory
    probe fits under no assignment (memory_may_fit), micro-batches above one at which a (vpp, sp) fits under no
    assignment at any recompute level (memory grows with the micro-batch), and recompute levels above the first
    that fits balanced (queued unevaluated: their lower bound is the same). Refinement, best first by
    stage_lower_bound: each queued layout gets the stage MILP (uneven stages, per-stage recompute counts) until
    the bound reaches the best step time found; no other cut is made, so a pin can only remove candidates.
    `exclude`: (tp, sequence parallelism) pairs not to consider (the sharding ILP found no runnable sharding)."""
    start = time.perf_counter()
    validate_request(ir, request, cluster)
    s = _Search(priced_inputs(ir, request, gpu, cluster, sharder), ir, request, gpu, cluster, exclude=exclude)
    for group in _groups(ir, request, cluster):
        s.enumerate_group(group)
    s.refine()
    s.fill(request.top_k)
    if not s.feasible:
        raise Infeasible(_no_fit_message(ir, request, gpu, cluster, s.misses) + s.unsolved_hint())
    ranked = _distinct(sorted(s.feasible.values(), key=lambda c: c.evaluation.step_time_s))
    s.misses.sort(key=lambda c: c.evaluation.peak_memory_bytes - c.evaluation.capacity_bytes)
    return SearchResult(
        best=ranked[0],
        ranked=ranked,
        infeasible=s.misses[:3],
        evaluated=s.evaluated,
        seconds=time.perf_counter() - start,
        milp_solves=s.solves,
        notes=s.notes(),
    )


@dataclass
class _Search:
    """The state of one search: feasible candidates, the refinement queue, counters and what to warn about."""

    inputs: ModelCostInputs
    ir: ModelIR
    request: PlanRequest
    gpu: GPUProfile
    cluster: ClusterProfile
    feasible: dict[Layout, Candidate] = field(default_factory=dict)
    queue: list[tuple[float, int, Layout, Evaluation | None]] = field(default_factory=list)
    misses: list[Candidate] = field(default_factory=list)
    evaluated: int = 0
    solves: int = 0
    refined: int = 0
    bounds: int = 0
    capped: int = 0
    over_budget: int = 0
    milp_s: float = 0.0
    limit_stops: list[tuple[Layout, str]] = field(default_factory=list)
    rest: list[tuple[float, int, Layout, Evaluation | None]] = field(default_factory=list)  # not refined
    settled: set[Layout] = field(default_factory=set)  # recompute-free layouts whose balanced stages are optimal
    exclude: frozenset[tuple[int, bool]] = frozenset()  # (tp, sp) pairs search() was told to leave out

    def evaluate(self, layout: Layout) -> Evaluation:
        self.evaluated += 1
        return evaluate(self.inputs, layout, self.gpu, self.cluster)

    def enumerate_group(self, group: Group) -> None:
        """Queue every variant of a group with its lower bound (evaluated later, only if the bound can win),
        unless the group's least-memory probe proves that nothing in it fits."""
        probe = _least_memory_layout(self.request, group, self.ir)
        if probe is None:
            return
        ev = self.evaluate(probe)
        if not ev.fits and self.request.recompute is None:
            ev = _second_probe(self.inputs, probe, ev, self.gpu, self.cluster)
            self.evaluated += 1
        if not ev.fits and not self._may_fit(probe, ev):
            self.misses.append(Candidate(probe, ev))
            return
        for _, levels in _variants(self.ir, self.request, group, self.exclude):
            bound = self._cheap_bound(levels[0])  # recompute does not enter the bound: one for all levels
            for layout in levels:
                self._push(bound, layout, None)

    def _cheap_bound(self, layout: Layout) -> float:
        """stage_lower_bound from the cost model's per-block coefficients, without evaluating the layout."""
        c = stage_coefficients(self.inputs, layout, self.gpu, self.cluster)
        stages = layout.pp * layout.vpp
        work = _blocks_work(c) + c.pre_time_s + c.post_time_s + stages * c.p2p_time_s
        pp, m, vpp = layout.pp, layout.num_microbatches, layout.vpp
        return m * work / pp + work * (1 - 1 / pp) / vpp

    def _may_fit(self, layout: Layout, ev: Evaluation | None) -> bool:
        """Whether some assignment of blocks to stages could fit (False is a proof that none does)."""
        if ev is not None and ev.fits:
            return True
        if layout.pp == 1 and layout.recompute == "none":
            return False  # nothing to place or recompute: balanced is the only assignment
        return memory_may_fit(self._problem(layout))

    def _problem(self, layout: Layout) -> StageProblem:
        return _pinned_problem(self.inputs, layout, self.gpu, self.cluster, self.request)

    def _push(self, bound: float | None, layout: Layout, ev: Evaluation | None) -> None:
        assert bound is not None
        self.queue.append((bound, len(self.queue), layout, ev))

    def best_s(self) -> float:
        return min((c.evaluation.step_time_s for c in self.feasible.values()), default=math.inf)

    def refine(self) -> None:
        """Evaluate queued layouts in order of their lower bound and give each the stage MILP where it can
        still win (LP bound first), until no queued layout can beat the best found."""
        best = self.best_s()
        self.queue.sort(key=lambda q: (q[0], q[1]))
        for at, (bound, _, layout, ev) in enumerate(self.queue):
            if bound >= best:
                self.rest = self.queue[at:]
                return  # bounds are sorted: no later layout can win either
            if ev is None:
                ev = self.evaluate(layout)
                if ev.fits:
                    self.feasible.setdefault(layout, Candidate(layout, ev))
                    best = min(best, ev.step_time_s)
                    if layout.recompute == "none" and _balanced_is_shortest(
                        self.inputs, layout, ev, self.gpu, self.cluster
                    ):
                        self.settled.add(layout)
            if replace(layout, recompute="none") in self.settled:
                continue  # no assignment has a shorter pipeline, and recompute only adds time: nothing to refine
            if not _refinable(layout) or (not ev.fits and not self._may_fit(layout, ev)):
                if not ev.fits:
                    self.misses.append(Candidate(layout, ev))
                continue
            if self.refined >= self.request.refine and (ev.fits or best < math.inf):
                self.capped += 1  # a cap the caller asked for (screening); without one nothing is skipped
                continue
            if self.milp_s >= self.request.milp_budget_s and best < math.inf:
                self.over_budget += 1
                continue
            if self._relaxed_bound(layout, best) >= best:
                if not ev.fits:
                    self.misses.append(Candidate(layout, ev))
                continue  # no assignment the MILP can return beats the best: a valid cut
            cand, status = self._solve(layout)
            if ev.fits:
                self.refined += 1
            if cand is None:
                if not ev.fits:
                    self.misses.append(Candidate(layout, ev))
                continue
            known = self.feasible.get(layout)
            if known is None or cand.evaluation.step_time_s < known.evaluation.step_time_s:
                self.feasible[layout] = cand
                best = min(best, cand.evaluation.step_time_s)
        self.rest = []

    def fill(self, k: int) -> None:
        """Evaluate (balanced) enough of the layouts the refinement did not need for the report: the k runners-up
        and, for --explain, the best layout with another tp, pp and dp than the chosen one. In bound order, so
        a layout is left out only when its bound shows it cannot be among them."""
        if not self.feasible:
            return
        best = min(self.feasible.values(), key=lambda c: c.evaluation.step_time_s).layout
        dims = ("tp", "pp", "dp", "cp", "ep")
        times = sorted(c.evaluation.step_time_s for c in self.feasible.values())
        rivals = {d: math.inf for d in dims}
        for c in self.feasible.values():
            for d in dims:
                if getattr(c.layout, d) != getattr(best, d):
                    rivals[d] = min(rivals[d], c.evaluation.step_time_s)
        for bound, _, layout, _ in self.rest:
            kth = times[k] if len(times) > k else math.inf
            if bound >= max(kth, *rivals.values()):
                return
            other = [d for d in dims if getattr(layout, d) != getattr(best, d)]
            if bound >= kth and not any(bound < rivals[d] for d in other):
                continue
            ev = self.evaluate(layout)
            if ev.fits and layout not in self.feasible:
                self.feasible[layout] = Candidate(layout, ev)
                bisect.insort(times, ev.step_time_s)
                for d in other:
                    rivals[d] = min(rivals[d], ev.step_time_s)

    def _relaxed_bound(self, layout: Layout, best: float) -> float:
        """The LP relaxation's bound on the step time of any assignment the stage MILP can return (dp and
        optimizer time left out, ≥ 0)."""
        self.bounds += 1
        p2p = stage_coefficients(self.inputs, layout, self.gpu, self.cluster).p2p_time_s
        problem = self._problem(layout)
        integer = max(
            _integer_bound(self.inputs, layout, self.gpu, self.cluster),
            integer_lower_bound(problem, layout.num_microbatches, p2p),
        )
        if integer >= best:
            return integer
        lp = pipeline_lower_bound(problem, layout.num_microbatches, p2p, self.request.solver, self.request.time_limit_s)
        return max(lp, integer)

    def _solve(self, layout: Layout) -> tuple[Candidate | None, str]:
        start = time.perf_counter()
        cand, status = solve_layout(self.inputs, layout, self.gpu, self.cluster, self.request, self._problem(layout))
        self.milp_s += time.perf_counter() - start
        if status != "infeasible" or cand is not None:
            self.solves += 1
        if status.startswith("time-limit"):
            self.limit_stops.append((layout, status))
        return cand, status

    def notes(self) -> list[str]:
        """One sentence per assumption or shortcut of this search (plan.json warnings)."""
        out = []
        limit = self.request.time_limit_s
        for status, what in (
            ("time-limit", "kept the best assignment found, which may not be optimal"),
            ("time-limit-none", "found no assignment, so the layout was treated as not fitting"),
        ):
            hit = [lay for lay, st in self.limit_stops if st == status]
            if hit:
                more = f" and {len(hit) - 1} more" if len(hit) > 1 else ""
                out.append(
                    f"the stage MILP stopped at its {limit:g} s time limit on {hit[0].describe()}{more} and "
                    f"{what}; raise --time-limit for a proved optimum"
                )
        if self.over_budget:
            out.append(
                f"the stage MILPs used up the search's {self.request.milp_budget_s:g} s budget: {self.over_budget} "
                f"layouts whose lower bound could still beat the best kept balanced stages, so a pinned search "
                f"may find a faster layout"
            )
        if self.capped:
            out.append(
                f"stage MILP refinement was capped at {self.request.refine} solves: {self.capped} layouts whose "
                f"lower bound could still beat the best kept balanced stages"
            )
        return out

    def unsolved_hint(self) -> str:
        n = sum(1 for _, st in self.limit_stops if st == "time-limit-none")
        return f"; {n} stage MILPs stopped at the time limit without an answer: raise --time-limit" if n else ""


def _shortest_rank(
    inputs: ModelCostInputs, layout: Layout, gpu: GPUProfile, cluster: ClusterProfile
) -> tuple[float, float]:
    """(T*, W): a busiest-rank time per micro-batch that no assignment of the blocks can beat without recompute
    (memory ignored), and the ranks' total W. Identical blocks: exactly the shortest (integer blocks, at least one
    per virtual stage), found by giving the next block to the rank it lengthens least until the ranks hold them
    all. Differing blocks: _shortest_mixed_rank, a lower bound."""
    c = stage_coefficients(inputs, layout, gpu, cluster)
    pp, vpp, S = layout.pp, layout.vpp, layout.pp * layout.vpp
    fixed = [vpp * c.p2p_time_s for _ in range(pp)]
    fixed[0] += c.pre_time_s
    fixed[(S - 1) % pp] += c.post_time_s
    if c.block_times_s:
        return _shortest_mixed_rank(c.block_times_s, fixed, vpp), sum(fixed) + _blocks_work(c)
    t_b = c.block_time_s
    counts = [vpp] * pp
    while sum(counts) < c.num_blocks:
        r = min(range(pp), key=lambda i: fixed[i] + (counts[i] + 1) * t_b)
        counts[r] += 1
    return max(f + n * t_b for f, n in zip(fixed, counts)), sum(fixed) + c.num_blocks * t_b


def _blocks_work(c: StageCoefficients) -> float:
    """All blocks' time per micro-batch without recompute: the exact per-block sum when blocks differ."""
    return sum(c.block_times_s) if c.block_times_s else c.num_blocks * c.block_time_s


def _shortest_mixed_rank(times: tuple[float, ...], fixed: list[float], vpp: int) -> float:
    """A lower bound on the busiest rank's time when block j takes times[j] and rank r has fixed[r] besides its
    blocks, valid for every contiguous assignment: the largest of
      - the water level: every rank r holds at least vpp blocks, so at least lo_r = fixed[r] + the vpp cheapest
        blocks, and the ranks together hold W = Σ_j times[j]: T ≥ the level T with Σ_r max(lo_r, T) − fixed[r] = W
        (work spread as if divisible);
      - the heaviest block on the lightest rank's fixed time;
      - (vpp = 1) the shortest busiest stage over contiguous splits that may leave stages empty (a relaxation of
        at least one block per stage), by bisection on T with a greedy fill, which is exact for that relaxation."""
    pp = len(fixed)
    cheapest = sum(sorted(times)[:vpp])
    lows = [f + cheapest for f in fixed]
    total = sum(times)

    def spare(level: float) -> float:
        """Σ_r max(lo_r, level) − fixed[r] − W: ≥ 0 once the ranks below `level` can hold all the work."""
        return sum(max(lo, level) - f for lo, f in zip(lows, fixed)) - total

    lo, hi = max(lows), max(lows) + total
    if spare(lo) < 0:
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if spare(mid) < 0 else (lo, mid)
    bound = max(lo, min(fixed) + max(times))
    if vpp == 1 and pp > 1:
        bound = max(bound, _contiguous_level(times, fixed, bound))
    return bound


def _contiguous_level(times: tuple[float, ...], fixed: list[float], start: float) -> float:
    """The largest T (to bisection precision, from below) at which stages 0..pp−1 in order, stage r taking blocks
    while it stays within T − fixed[r], cannot hold every block: any split whose busiest stage is ≤ T' lets the
    greedy fill reach at least as far at every stage, so the shortest busiest stage exceeds the returned T."""

    def fits(level: float) -> bool:
        j = 0
        for f in fixed:
            room = level - f
            while j < len(times) and times[j] <= room:
                room -= times[j]
                j += 1
        return j == len(times)

    lo, hi = start, start + sum(times) + max(fixed)
    if fits(lo):
        return lo
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if not fits(mid) else (lo, mid)
    return lo


def _integer_bound(inputs: ModelCostInputs, layout: Layout, gpu: GPUProfile, cluster: ClusterProfile) -> float:
    """A pipeline time no assignment can beat: m·T* + (W − T*)/vpp is increasing in the busiest rank's time, and
    recompute only lengthens ranks."""
    t_star, work = _shortest_rank(inputs, layout, gpu, cluster)
    return layout.num_microbatches * t_star + (work - t_star) / layout.vpp


def _balanced_is_shortest(
    inputs: ModelCostInputs, layout: Layout, ev: Evaluation, gpu: GPUProfile, cluster: ClusterProfile
) -> bool:
    """Whether balanced stages already give `layout` (no recompute) the shortest busiest rank of any assignment:
    then no assignment has a shorter pipeline time, which without recompute depends on that rank alone."""
    t_star, _ = _shortest_rank(inputs, layout, gpu, cluster)
    balanced = max(sum(st.time_s for st in ev.stages[r :: layout.pp]) for r in range(layout.pp))
    return balanced <= t_star * (1 + 1e-9)


def _refinable(layout: Layout) -> bool:
    """Whether the stage MILP has anything to choose: where blocks go (pp > 1) or how many recompute."""
    return layout.pp > 1 or layout.recompute != "none"


def stage_lower_bound(cand: Candidate) -> float:
    """A step time no assignment of this layout's blocks to stages can beat.

    The cost model's pipeline part is m·t_max + (Σ_r t_r − t_max)/vpp (planner/cost/schedule.py), increasing in t_max,
    and t_max ≥ W/pp where W, the work of all stages per micro-batch without recompute, does not depend on where
    the blocks go. Data-parallel and optimizer time are left out (≥ 0), so the bound is valid, if loose.
    """
    layout, ev = cand.layout, cand.evaluation
    work = sum(st.time_s - st.recompute_s for st in ev.stages)
    pp, m, vpp = layout.pp, layout.num_microbatches, layout.vpp
    return m * work / pp + work * (1 - 1 / pp) / vpp


def refine_stages(
    inputs: ModelCostInputs, cand: Candidate, gpu: GPUProfile, cluster: ClusterProfile, request: PlanRequest
) -> tuple[Candidate, int]:
    """Re-place blocks (uneven) and choose per-stage recompute counts with the MILP; keep what is faster."""
    layout = cand.layout
    if cand.assignment is not None or not _refinable(layout):
        return cand, 0  # already placed by the MILP, or nothing to place
    better = _solve(inputs, layout, gpu, cluster, request)
    if better is not None and better.evaluation.step_time_s < cand.evaluation.step_time_s:
        return better, 1
    return cand, 1


def fit_uneven(
    inputs: ModelCostInputs,
    layout: Layout,
    balanced: Evaluation,
    gpu: GPUProfile,
    cluster: ClusterProfile,
    request: PlanRequest,
) -> tuple[Candidate | None, int]:
    """`layout` with the stage MILP's assignment when balanced stages overflow but uneven ones fit, else None.
    Skipped (0 solves) when memory_may_fit proves that no assignment fits."""
    if not _refinable(layout):
        return None, 0
    problem = _pinned_problem(inputs, layout, gpu, cluster, request)
    if not memory_may_fit(problem):
        return None, 0
    return solve_layout(inputs, layout, gpu, cluster, request, problem)[0], 1


def _pinned_problem(
    inputs: ModelCostInputs, layout: Layout, gpu: GPUProfile, cluster: ClusterProfile, request: PlanRequest
) -> StageProblem:
    problem = stage_problem(inputs, layout, gpu, cluster)
    if request.recompute is not None and layout.recompute != "none":  # a pin holds: no block left out
        problem = replace(problem, recompute_all=True)
    return problem


def _solve(
    inputs: ModelCostInputs, layout: Layout, gpu: GPUProfile, cluster: ClusterProfile, request: PlanRequest
) -> Candidate | None:
    """The stage MILP's assignment for `layout`, scored by the cost model; None if it does not fit."""
    problem = _pinned_problem(inputs, layout, gpu, cluster, request)
    return solve_layout(inputs, layout, gpu, cluster, request, problem)[0]


def solve_layout(
    inputs: ModelCostInputs,
    layout: Layout,
    gpu: GPUProfile,
    cluster: ClusterProfile,
    request: PlanRequest,
    problem: StageProblem,
) -> tuple[Candidate | None, str]:
    """The stage MILP's assignment for `layout` scored by the cost model (None if it does not fit) and the
    solver's status (solve_stages_status). A solution that recomputes no block is reported as recompute "none"
    (the same time and memory, and what it really is), unless recompute was pinned."""
    solution, status = solve_stages_status(problem, request.solver, request.time_limit_s)
    if solution is None:
        return None, status
    recompute: tuple[int, ...] | None = solution.recompute_blocks
    if layout.recompute != "none" and not any(solution.recompute_blocks):
        layout, recompute = replace(layout, recompute="none"), None
    assignment = StageAssignment(blocks_per_stage=solution.blocks_per_stage, recompute_blocks=recompute)
    ev = evaluate(inputs, layout, gpu, cluster, assignment)
    return (Candidate(layout, ev, assignment) if ev.fits else None), status


def _second_probe(
    inputs: ModelCostInputs, probe: Layout, ev: Evaluation, gpu: GPUProfile, cluster: ClusterProfile
) -> Evaluation:
    """Full recompute is not always the least memory: a GPU holding one block and one in-flight micro-batch keeps
    that block's input and, while recomputing it, all its activations: more than selective recompute keeps.
    Returns the selective probe's evaluation when it fits, else `ev`."""
    other = evaluate(inputs, replace(probe, recompute="selective"), gpu, cluster)
    return other if other.fits else ev


def _distinct(ranked: list[Candidate]) -> list[Candidate]:
    """Keep the fastest candidate of each layout (refinement can turn two entries into the same layout)."""
    seen: set[Layout] = set()
    out = []
    for cand in ranked:
        if cand.layout not in seen:
            seen.add(cand.layout)
            out.append(cand)
    return out


def stage_problem(inputs: ModelCostInputs, layout: Layout, gpu: GPUProfile, cluster: ClusterProfile) -> StageProblem:
    """The MILP's coefficients, from the cost model's own per-block numbers (so both agree)."""
    c = stage_coefficients(inputs, layout, gpu, cluster)
    return StageProblem(
        num_blocks=c.num_blocks,
        pp=layout.pp,
        vpp=layout.vpp,
        block_time_s=c.block_time_s,
        recompute_time_s=c.block_recompute_extra_s,
        pre_time_s=c.pre_time_s,
        post_time_s=c.post_time_s,
        block_static_bytes=c.block_static_bytes,
        pre_static_bytes=c.pre_static_bytes,
        post_static_bytes=c.post_static_bytes,
        block_act_bytes=c.block_act_bytes,
        block_act_recompute_bytes=c.block_act_recompute_bytes,
        pre_act_bytes=c.pre_act_bytes,
        post_act_bytes=c.post_act_bytes,
        inflight=tuple(c.inflight),
        capacity_bytes=c.capacity_bytes,
        allow_recompute=layout.recompute != "none",
        block_times_s=c.block_times_s,
        block_recompute_extras_s=c.block_recompute_extras_s,
        block_statics_bytes=c.block_statics_bytes,
        block_acts_bytes=c.block_acts_bytes,
        block_acts_recompute_bytes=c.block_acts_recompute_bytes,
        recompute_working_bytes=c.recompute_working_bytes,
        stage_buffer_bytes=c.stage_buffer_bytes,
    )


def priced_inputs(
    ir: ModelIR, request: PlanRequest, gpu: GPUProfile, cluster: ClusterProfile, sharder: Sharder | None = None
) -> ModelCostInputs:
    """The model's cost inputs with every (tp, sp) the request allows priced as the sharding ILP shards it."""
    if ir.compute_bytes != gpu.compute_bytes:  # activations were captured in another dtype than the device computes
        raise PlanError(
            f"the model was captured with {ir.compute_bytes}-byte activations but {gpu.name} computes in "
            f"{gpu.compute_dtype}: capture with dtype={gpu.compute_dtype!r} (mlm-plan does this from --gpu)"
        )
    sharder = sharder or Sharder(ir, gpu, cluster, request.solver, request.time_limit_s)
    sps = [request.sequence_parallel] if request.sequence_parallel is not None else [False, True]
    return sharder.priced_inputs((tp, bool(sp)) for tp in _tp_options(ir, request, cluster) for sp in sps)


def evaluate_pinned(
    ir: ModelIR, request: PlanRequest, gpu: GPUProfile, cluster: ClusterProfile, sharder: Sharder | None = None
) -> Candidate:
    """Every dimension pinned: evaluate exactly that layout (balanced stages). Raises Infeasible if it does not
    fit, naming the stage and the overflow."""
    validate_request(ir, request, cluster)
    layout = pinned_layout(ir, request)
    ev = evaluate(priced_inputs(ir, request, gpu, cluster, sharder), layout, gpu, cluster)
    if not ev.fits:
        raise Infeasible(f"layout {layout.describe()} does not fit: {ev.reason}")
    return Candidate(layout, ev)


def pinned_layout(ir: ModelIR, request: PlanRequest) -> Layout:
    """The layout a fully pinned request names (cp and ep 1 unless pinned, or cp implied by a pinned dp)."""
    assert request.tp and request.pp and request.micro_batch and request.vpp is not None
    cp = request.cp or (request.num_gpus // (request.tp * request.pp * request.dp) if request.dp else 1)
    dp = request.num_gpus // (request.tp * request.pp * max(cp, 1))
    layout = Layout(
        tp=request.tp,
        pp=request.pp,
        dp=dp,
        cp=cp,
        ep=request.ep or 1,
        micro_batch=request.micro_batch,
        num_microbatches=request.global_batch // (dp * request.micro_batch),
        vpp=request.vpp,
        sequence_parallel=bool(request.sequence_parallel),
        recompute=request.recompute or "none",
        zero=request.zero or 0,
    )
    problem = layout_problem(ir, layout, request.global_batch)
    if problem:
        raise Infeasible(f"layout {layout.describe()}: {problem}")
    return layout


def validate_request(ir: ModelIR, request: PlanRequest, cluster: ClusterProfile) -> None:
    """Errors that no layout can fix, each with what to change."""
    n, node = request.num_gpus, cluster.gpus_per_node
    if n < 1:
        raise PlanError("--gpus must be >= 1")
    if request.global_batch < 1:
        raise PlanError("--global-batch must be >= 1")
    if n > node and n % node:
        lower, upper = n // node * node, (n // node + 1) * node
        raise Infeasible(
            f"{n} GPUs is not a whole number of {cluster.name} nodes ({node} GPUs each): use {lower} or {upper}"
        )
    for name in ("tp", "pp", "dp", "cp", "ep", "micro_batch", "vpp"):
        value = getattr(request, name)
        if value is not None and value < 1:
            raise PlanError(f"--{name.replace('_', '-')} must be >= 1")
    pinned = [getattr(request, k) for k in ("tp", "pp", "dp", "cp") if getattr(request, k)]
    product = 1
    for v in pinned:
        product *= v
    if n % product:
        raise Infeasible(f"tp·pp·dp·cp pinned to {product} does not divide {n} GPUs")
    if request.tp and request.pp and request.dp and request.cp and product != n:
        raise Infeasible(f"tp·pp·dp·cp = {product} but --gpus is {n}")
    if request.ep and request.ep > 1 and not ir.num_experts:
        raise Infeasible(
            f"--ep {request.ep} needs a mixture-of-experts model, and capture found no routed experts: use --ep 1"
        )
    if request.ep and ir.num_experts and any(m.num_experts % request.ep for m in _moe(ir)):
        raise Infeasible(
            f"--ep {request.ep} does not divide the {ir.num_experts} experts of each MoE layer: use a divisor"
        )
    if request.cp and request.cp > 1 and ir.seq_len % (2 * request.cp):
        raise Infeasible(
            f"--cp {request.cp} splits each sequence into 2·cp = {2 * request.cp} load-balanced causal chunks, "
            f"which seq_len {ir.seq_len} is not divisible into: use a cp with seq_len divisible by 2·cp"
        )
    if request.tp and request.tp > node:
        raise Infeasible(
            f"--tp {request.tp} exceeds the {node} GPUs of one {cluster.name} node: tensor "
            f"parallelism needs NVLink; use --tp {node} or less"
        )
    if request.vpp and request.vpp > 1 and (request.pp == 1 or n == 1):
        raise Infeasible(
            f"--vpp {request.vpp} needs pipeline parallelism: the interleaved schedule splits each "
            f"pipeline rank's blocks into chunks; pin --pp > 1 or use --vpp 1"
        )
    if request.sequence_parallel and not any(t > 1 for t in _tp_options(ir, request, cluster)):
        raise Infeasible(
            "--sequence-parallel needs tensor parallelism (tp > 1), and "
            + (
                "--tp is pinned to 1"
                if request.tp == 1
                else f"no tp > 1 divides the heads and hidden size and {n} GPUs"
            )
            + ": drop --sequence-parallel or allow a larger --tp"
        )
    if not any(request.global_batch % dp == 0 for dp in _dp_options(ir, request, cluster)):
        raise Infeasible(_batch_message(ir, request, cluster))
    if request.recompute is not None and request.recompute not in RECOMPUTE_CHOICES:
        raise PlanError(f"--recompute must be one of {', '.join(RECOMPUTE_CHOICES)}")


def layout_problem(ir: ModelIR, layout: Layout, global_batch: int) -> str | None:
    """Why the runtime could not execute this layout, or None."""
    if layout.micro_batch * layout.num_microbatches * layout.dp != global_batch:
        return (
            f"global batch {global_batch} is not micro_batch·num_microbatches·dp "
            f"({layout.micro_batch}·{layout.num_microbatches}·{layout.dp}); choose a micro-batch dividing "
            f"{global_batch // layout.dp if global_batch % layout.dp == 0 else 'B/dp'}"
        )
    for what, size in (("heads", ir.num_heads), ("kv heads", ir.num_kv_heads), ("hidden size", ir.hidden_size)):
        if size % layout.tp:
            return f"tp {layout.tp} does not divide the {what} ({size})"
    if layout.pp * layout.vpp > ir.num_layers:
        return f"pp·vpp = {layout.pp * layout.vpp} exceeds the {ir.num_layers} blocks"
    reused = getattr(ir, "reused_modules", ())
    if layout.pp > 1 and reused:
        return (
            f"pp {layout.pp}: the model calls {reused[0]} outside that block, and a pipeline stage holds only its own "
            f"blocks' modules"
        )
    if layout.zero == 3 and layout.dp * layout.cp > 1 and reused:
        return (
            f"zero 3: the model calls {reused[0]} outside that block, where FSDP's per-block gather does not cover it"
        )
    roots = getattr(ir, "root_params", ())
    if layout.vpp > 1 and layout.dp * layout.cp > 1 and roots:
        return (
            f"vpp {layout.vpp}: {roots[0]} lies outside every layer, and mlm-run does not keep the copies of such a "
            f"parameter on two stages of one rank under a data-parallel wrapper"
        )
    unsplittable = [k for k in getattr(ir, "attention_kinds", ()) if k == "cross" or k.startswith("masked")]
    if layout.cp > 1 and unsplittable:
        return (
            f"cp {layout.cp}: the model has {unsplittable[0]} attention, which mlm-run's context parallelism cannot "
            f"split (it splits one sequence's queries and keys alike; a mask or bias built for the whole sequence, or "
            f"keys from another sequence, do not follow)"
        )
    if layout.cp > 1 and not getattr(ir, "token_inputs", True):
        return f"cp {layout.cp}: the model's inputs are not token sequences that context parallelism can split"
    if layout.pp > 1 and layout.num_microbatches < layout.pp:
        return (
            f"1F1B needs at least pp = {layout.pp} micro-batches per step, got {layout.num_microbatches}: "
            f"lower the micro-batch or raise the global batch"
        )
    if layout.vpp > 1 and (layout.pp == 1 or layout.num_microbatches % layout.pp):
        return "the interleaved schedule needs pp > 1 and micro-batches divisible by pp"
    if layout.sequence_parallel and layout.tp == 1:
        return "sequence parallelism needs tp > 1"
    if layout.cp > 1 and ir.seq_len % (2 * layout.cp):
        return f"cp {layout.cp}: seq_len {ir.seq_len} does not split into 2·cp load-balanced causal chunks"
    if layout.cp > 1 and HAND_WRITTEN_ATTENTION in ir.attention_ops:
        return (
            f"cp {layout.cp}: the model computes attention by hand ({HAND_WRITTEN_ATTENTION}), which mlm-run's "
            f"context parallelism cannot split (it replaces F.scaled_dot_product_attention)"
        )
    if (layout.dp * layout.cp) % layout.ep:
        return f"ep {layout.ep} does not divide dp·cp = {layout.dp * layout.cp} (expert ranks come from them)"
    if layout.ep > 1 and not ir.num_experts:
        return f"ep {layout.ep} needs routed experts, and the model has none"
    if any(m.num_experts % layout.ep for m in _moe(ir)):
        return f"ep {layout.ep} does not divide the {ir.num_experts} experts of each MoE layer"
    return None


def _moe(ir: ModelIR) -> list[MoEIR]:
    return [layer.moe for layer in getattr(ir, "moe_layers", ()) if layer.moe is not None]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_options(ir: ModelIR, request: PlanRequest, cluster: ClusterProfile) -> list[int]:
    if request.tp:
        return [request.tp]
    return [
        t
        for t in _divisors(cluster.gpus_per_node)
        if request.num_gpus % t == 0 and ir.num_heads % t == 0 and ir.num_kv_heads % t == 0 and ir.hidden_size % t == 0
    ]


def tp_ruled_out_by_heads(ir: ModelIR, request: PlanRequest, cluster: ClusterProfile) -> str | None:
    """Why the free search left out tensor-parallel sizes that fit a node and divide the GPUs (None when none):
    tp must divide the query heads, the key/value heads and the hidden size, so a model with one key/value head
    (multi-query attention) is searched at tp 1 only."""
    if request.tp:
        return None
    fits = [t for t in _divisors(cluster.gpus_per_node) if t > 1 and request.num_gpus % t == 0]
    searched = set(_tp_options(ir, request, cluster))
    left = [t for t in fits if t not in searched]
    if not left:
        return None
    kv = ir.num_kv_heads or ir.num_heads
    return (
        f"tp {', '.join(map(str, left))} not searched: tp must divide the {ir.num_heads} attention heads, the {kv} "
        f"key/value head{'s' if kv != 1 else ''} and the hidden size {ir.hidden_size} (each rank computes whole "
        f"heads; key/value heads are not replicated over tp)"
    )


def _dp_options(ir: ModelIR, request: PlanRequest, cluster: ClusterProfile) -> list[int]:
    if request.dp:
        return [request.dp]
    out = set()
    for tp in _tp_options(ir, request, cluster) or [1]:
        for pp in _divisors(request.num_gpus // tp) if request.num_gpus % tp == 0 else []:
            if (request.pp is None or pp == request.pp) and pp <= max(ir.num_layers, 1):
                for cp in _cp_options(ir, request, request.num_gpus // (tp * pp)):
                    out.add(request.num_gpus // (tp * pp * cp))
    return sorted(out)


def _cp_options(ir: ModelIR, request: PlanRequest, rest: int) -> list[int]:
    """Context-parallel sizes dividing `rest` GPUs whose 2·cp causal chunks split the sequence (pinned: that)."""
    if request.cp:
        return [request.cp] if rest % request.cp == 0 else []
    return [c for c in _divisors(rest) if c == 1 or ir.seq_len % (2 * c) == 0]


def _ep_options(ir: ModelIR, request: PlanRequest, dp_cp: int) -> list[int]:
    """Expert-parallel sizes: divisors of dp·cp dividing every MoE layer's experts (1 for a dense model; a pinned
    --ep is taken as asked)."""
    moe = _moe(ir)
    if request.ep:
        return [request.ep]
    if not moe:
        return [1]
    return [e for e in _divisors(dp_cp) if all(m.num_experts % e == 0 for m in moe)]


def _groups(ir: ModelIR, request: PlanRequest, cluster: ClusterProfile) -> Iterator[Group]:
    zeros = [request.zero] if request.zero is not None else list(ZERO_CHOICES)
    for tp in _tp_options(ir, request, cluster):
        rest = request.num_gpus // tp
        for pp in [request.pp] if request.pp else _divisors(rest):
            if rest % pp or pp > ir.num_layers:
                continue
            for cp in _cp_options(ir, request, rest // pp):
                dp = rest // (pp * cp)
                if (request.dp and dp != request.dp) or request.global_batch % dp:
                    continue
                for ep in _ep_options(ir, request, dp * cp):
                    for zero in zeros:
                        if zero and dp * cp == 1:
                            continue  # nothing to shard over
                        yield tp, pp, dp, cp, ep, zero


def _micro_batches(request: PlanRequest, dp: int) -> list[int]:
    """Every micro-batch dividing the per-replica batch (the search stops growing it where memory runs out)."""
    per_replica = request.global_batch // dp
    if request.micro_batch:
        return [request.micro_batch] if per_replica % request.micro_batch == 0 else []
    return _divisors(per_replica)


def _least_memory_layout(request: PlanRequest, group: Group, ir: ModelIR) -> Layout | None:
    tp, dp = group[0], group[2]
    mbs = _micro_batches(request, dp)
    if not mbs:
        return None
    sp = request.sequence_parallel if request.sequence_parallel is not None else tp > 1
    layout = _group_layout(request, group, mbs[0], 1, sp and tp > 1, request.recompute or "full")
    if layout_problem(ir, layout, request.global_batch):
        return None
    return layout


def _group_layout(request: PlanRequest, group: Group, mb: int, vpp: int, sp: bool, recompute: str) -> Layout:
    """The layout of a mesh group with this micro-batch, vpp, sequence parallelism and recompute."""
    tp, pp, dp, cp, ep, zero = group
    return Layout(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        ep=ep,
        micro_batch=mb,
        num_microbatches=request.global_batch // (dp * mb),
        vpp=vpp,
        sequence_parallel=sp,
        recompute=recompute,  # type: ignore[arg-type]
        zero=zero,
    )


def _vpp_options(ir: ModelIR, request: PlanRequest, pp: int) -> list[int]:
    """Megatron-LM's interleaved schedule needs the blocks to divide evenly into pp·vpp chunks: every such vpp."""
    if request.vpp:
        return [request.vpp]
    if pp == 1:
        return [1]
    return [v for v in range(1, ir.num_layers // pp + 1) if v == 1 or ir.num_layers % (pp * v) == 0]


def _variants(
    ir: ModelIR, request: PlanRequest, group: Group, exclude: frozenset[tuple[int, bool]] = frozenset()
) -> Iterator[tuple[tuple[int, bool], list[Layout]]]:
    """For each micro-batch (increasing), vpp and sp (but the (tp, sp) pairs in `exclude`): the key (vpp, sp) and
    the runnable layouts in increasing recompute order."""
    tp, pp, dp = group[:3]
    recomputes = [request.recompute] if request.recompute else list(RECOMPUTE_CHOICES)
    sps = (
        [request.sequence_parallel] if request.sequence_parallel is not None else ([False, True] if tp > 1 else [False])
    )
    vpps = _vpp_options(ir, request, pp)
    for mb in _micro_batches(request, dp):
        for vpp in vpps:
            for sp in sps:
                if (tp, bool(sp)) in exclude:
                    continue
                levels = []
                for rc in recomputes:
                    layout = _group_layout(request, group, mb, vpp, bool(sp), rc)
                    if layout_problem(ir, layout, request.global_batch) is None:
                        levels.append(layout)
                if levels:
                    yield (vpp, bool(sp)), levels


def _batch_message(ir: ModelIR, request: PlanRequest, cluster: ClusterProfile) -> str:
    dps = _dp_options(ir, request, cluster)
    b = request.global_batch
    if not dps:
        return f"no tensor/pipeline split of {request.num_gpus} GPUs is possible for this model"
    nearest = min((k * dp for dp in dps for k in (b // dp, b // dp + 1) if k), key=lambda x: (abs(x - b), x))
    return (
        f"global batch {b} is not divisible by any data-parallel size possible on {request.num_gpus} GPUs "
        f"({', '.join(map(str, dps[:8]))}{'…' if len(dps) > 8 else ''}): try --global-batch {nearest}"
    )


def _pinned_problems(ir: ModelIR, request: PlanRequest, cluster: ClusterProfile) -> list[str]:
    """Why the layouts the pins leave cannot run (layout_problem's distinct reasons, in search order)."""
    out: list[str] = []
    for group in _groups(ir, request, cluster):
        for mb in _micro_batches(request, group[2])[:1]:
            sp = bool(request.sequence_parallel) and group[0] > 1
            layout = _group_layout(request, group, mb, request.vpp or 1, sp, request.recompute or "none")
            problem = layout_problem(ir, layout, request.global_batch)
            if problem and problem not in out:
                out.append(problem)
    return out


def _no_fit_message(
    ir: ModelIR, request: PlanRequest, gpu: GPUProfile, cluster: ClusterProfile, misses: list[Candidate]
) -> str:
    closest = min(misses, key=lambda c: c.evaluation.peak_memory_bytes - c.evaluation.capacity_bytes, default=None)
    need = smallest_gpu_count(ir, request, gpu, cluster)
    pinned = any(
        getattr(request, k) is not None
        for k in ("tp", "pp", "dp", "cp", "ep", "micro_batch", "vpp", "recompute", "sequence_parallel", "zero")
    )
    with_pins = " with the pinned choices" if pinned else ""
    # smallest_gpu_count only looks above the request, so a hint never contradicts the failure it explains
    hint = f"; it fits on {need} GPUs{with_pins}" if need else ""
    zero_free = replace(request, zero=0)
    if (
        closest is None
        and request.zero
        and not any(_groups(ir, request, cluster))
        and any(_groups(ir, zero_free, cluster))
    ):
        return (
            f"--zero {request.zero} shards over data-parallel ranks, and the pinned choices leave dp = 1 on "
            f"{request.num_gpus} GPUs: nothing to shard; use --zero 0 (or more GPUs, or a smaller --tp / --pp)"
        )
    if closest is None:
        problems = _pinned_problems(ir, request, cluster) if pinned else []
        why = (
            with_pins + (f" ({'; '.join(problems[:3])})" if problems else "")
            if pinned
            else f" with global batch {request.global_batch} (every pipeline needs at least pp micro-batches and "
            f"the batch must split over dp): raise --global-batch or use fewer GPUs"
        )
        return f"no runnable layout for {request.num_gpus} GPUs{why}{hint}"
    layouts = "the pinned choices" if pinned else "any layout"
    return (
        f"the model does not fit on {request.num_gpus} {gpu.name} GPUs with {layouts}{hint} "
        f"(closest: {closest.layout.describe()}: {closest.evaluation.reason})"
    )


def smallest_gpu_count(
    ir: ModelIR, request: PlanRequest, gpu: GPUProfile, cluster: ClusterProfile, limit: int = 1 << 17
) -> int | None:
    """The smallest GPU count above request.num_gpus on which some least-memory layout fits (with the request's
    pins, --dp included): counts up to one node one by one, then whole nodes by doubling, then refined."""
    inputs = summarize(ir)

    def fits(n: int) -> bool:
        req = replace(request, num_gpus=n)
        try:
            validate_request(ir, req, cluster)
        except PlanError:
            return False
        for group in _groups(ir, req, cluster):
            probe = _least_memory_layout(req, group, ir)
            if probe is None:
                continue
            ev = evaluate(inputs, probe, gpu, cluster)
            if ev.fits or fit_uneven(inputs, probe, ev, gpu, cluster, req)[0] is not None:
                return True
        return False

    node = cluster.gpus_per_node
    for n in range(request.num_gpus + 1, node + 1):  # within one node any count is allowed
        if fits(n):
            return n
    lo = max(node, request.num_gpus // node * node)  # the last whole-node count known not to be the answer
    n = lo * 2
    while n <= limit and not fits(n):
        lo, n = n, n * 2
    if n > limit:
        return None
    for m in range(lo + node, n, node):  # the first whole-node count above the last failure
        if fits(m):
            return m
    return n
