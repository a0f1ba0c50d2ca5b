"""Search for the fastest layout that fits: enumeration of the outer choices, pruned by memory, with the stage
MILP refining the best candidates.

Outer choices (tp, pp, dp, micro-batch, vpp, sequence parallelism, recompute, zero) are few enough to enumerate
once divisibility rules are applied. Each is scored by the cost model with balanced stages (pure arithmetic,
microseconds), pruned with two monotonicity facts of the memory model: if the least memory-hungry variant of a
(tp, pp, zero) group (micro-batch 1, vpp 1, full recompute, sequence parallelism; selective recompute is tried as
well, since a GPU with one block and one in-flight micro-batch needs more memory under full recompute) does not
fit, no variant does; and for fixed other choices, more recompute only adds time, so the first recompute level
that fits is the only one kept. A group whose probe overflows with balanced stages gets the stage MILP before it
is discarded (uneven stages can move blocks off the embedding's / head's stage); there each (vpp, sp) is tried
at its most memory-saving recompute level, the MILP choosing the per-stage recompute counts. The top candidates
then get the stage MILP (planner/search/stage_milp.py): uneven blocks per stage and per-stage recompute counts,
re-scored by the same cost model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from mlm.planner.capture.graph import ModelIR
from mlm.planner.cost.hardware import ClusterProfile, GPUProfile
from mlm.planner.cost.inputs import ModelCostInputs
from mlm.planner.cost.step_time import Evaluation, StageAssignment, evaluate, stage_coefficients, summarize
from mlm.planner.errors import Infeasible, PlanError
from mlm.planner.layout import RECOMPUTE_CHOICES, ZERO_CHOICES, Layout
from mlm.planner.search.stage_milp import StageProblem, solve_stages

VPP_CHOICES = (1, 2, 3, 4, 6, 8)
MAX_MICRO_BATCH = 16


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for: GPU count, batch, and any pinned dimensions (None = search)."""

    num_gpus: int
    global_batch: int
    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    micro_batch: int | None = None
    vpp: int | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    zero: int | None = None
    top_k: int = 5
    solver: str = "cbc"
    time_limit_s: float = 10.0
    refine: int = 6  # at most this many stage MILPs, taken in order of their lower bound

    @property
    def fully_pinned(self) -> bool:
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


def search(ir: ModelIR, request: PlanRequest, gpu: GPUProfile, cluster: ClusterProfile) -> SearchResult:
    """The fastest fitting layout for `request`; raises Infeasible with what would make it feasible."""
    start = time.perf_counter()
    validate_request(ir, request, cluster)
    inputs = summarize(ir)
    feasible: dict[Layout, Candidate] = {}
    misses: list[Candidate] = []
    evaluated = 0
    solves = 0
    for group in _groups(ir, request, cluster):
        tp, pp, dp, zero = group
        probe = _least_memory_layout(request, tp, pp, dp, zero, ir)
        if probe is None:
            continue
        ev = evaluate(inputs, probe, gpu, cluster)
        evaluated += 1
        if not ev.fits and request.recompute is None:
            ev = _second_probe(inputs, probe, ev, gpu, cluster)
            evaluated += 1
        if not ev.fits:
            # balanced stages overflow; uneven ones (fewer blocks where the embedding / head sit) may not
            uneven, tried = fit_uneven(inputs, probe, ev, gpu, cluster, request)
            solves += tried
            if uneven is None:
                misses.append(Candidate(probe, ev))
                continue
            solves += _tight_group(inputs, ir, request, group, gpu, cluster, feasible)
            continue
        for layout_rc in _variants(ir, request, tp, pp, dp, zero):
            for layout in layout_rc:  # recompute levels, cheapest first: keep the first that fits
                ev = evaluate(inputs, layout, gpu, cluster)
                evaluated += 1
                if ev.fits:
                    feasible[layout] = Candidate(layout, ev)
                    break
    if not feasible:
        raise Infeasible(_no_fit_message(ir, request, gpu, cluster, misses))
    ranked = sorted(feasible.values(), key=lambda c: c.evaluation.step_time_s)
    # Branch and bound over the MILP: refine only candidates whose bound can still beat the best so far.
    best_s = ranked[0].evaluation.step_time_s
    improved: dict[int, Candidate] = {}
    order = sorted(range(len(ranked)), key=lambda i: stage_lower_bound(ranked[i]))
    for i in order:
        if solves >= request.refine or stage_lower_bound(ranked[i]) >= best_s:
            break  # bounds are sorted: no later candidate can win either
        better, tried = refine_stages(inputs, ranked[i], gpu, cluster, request)
        solves += tried
        improved[i] = better
        best_s = min(best_s, better.evaluation.step_time_s)
    refined = [improved.get(i, cand) for i, cand in enumerate(ranked)]
    ranked = _distinct(sorted(refined, key=lambda c: c.evaluation.step_time_s))
    misses.sort(key=lambda c: c.evaluation.peak_memory_bytes - c.evaluation.capacity_bytes)
    return SearchResult(
        best=ranked[0],
        ranked=ranked,
        infeasible=misses[:3],
        evaluated=evaluated,
        seconds=time.perf_counter() - start,
        milp_solves=solves,
    )


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
    if cand.assignment is not None or (layout.pp == 1 and layout.recompute == "none"):
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
    Skipped when no assignment can fit: the static bytes (weights, gradients, optimizer state) and the reserve
    do not depend on where the blocks go, so if their total exceeds pp GPUs' memory nothing helps."""
    if layout.pp == 1:
        return None, 0
    static = sum(m.static + m.reserve for m in balanced.rank_memory)
    if static > layout.pp * balanced.capacity_bytes:
        return None, 0
    return _solve(inputs, layout, gpu, cluster, request), 1


def _solve(
    inputs: ModelCostInputs, layout: Layout, gpu: GPUProfile, cluster: ClusterProfile, request: PlanRequest
) -> Candidate | None:
    """The stage MILP's assignment for `layout`, scored by the cost model; None if it does not fit. A solution
    that recomputes no block is reported as recompute "none" (the same time and memory, and what it really is)."""
    problem = stage_problem(inputs, layout, gpu, cluster)
    if request.recompute is not None and layout.recompute != "none":  # a pin holds: no block left out
        problem = replace(problem, recompute_all=True)
    solution = solve_stages(problem, request.solver, request.time_limit_s)
    if solution is None:
        return None
    recompute: tuple[int, ...] | None = solution.recompute_blocks
    if layout.recompute != "none" and not any(solution.recompute_blocks):
        layout, recompute = replace(layout, recompute="none"), None
    assignment = StageAssignment(blocks_per_stage=solution.blocks_per_stage, recompute_blocks=recompute)
    ev = evaluate(inputs, layout, gpu, cluster, assignment)
    return Candidate(layout, ev, assignment) if ev.fits else None


def _second_probe(
    inputs: ModelCostInputs, probe: Layout, ev: Evaluation, gpu: GPUProfile, cluster: ClusterProfile
) -> Evaluation:
    """Full recompute is not always the least memory: a GPU holding one block and one in-flight micro-batch keeps
    that block's input and, while recomputing it, all its activations: more than selective recompute keeps.
    Returns the selective probe's evaluation when it fits, else `ev`."""
    other = evaluate(inputs, replace(probe, recompute="selective"), gpu, cluster)
    return other if other.fits else ev


def _tight_group(
    inputs: ModelCostInputs,
    ir: ModelIR,
    request: PlanRequest,
    group: tuple[int, int, int, int],
    gpu: GPUProfile,
    cluster: ClusterProfile,
    feasible: dict[Layout, Candidate],
) -> int:
    """A group whose least-memory probe fits only with uneven stages: give each (vpp, sp) its most memory-saving
    recompute level, placed by the MILP, for growing micro-batches until one does not fit (memory grows with the
    micro-batch). The MILP still picks how many blocks per stage actually recompute. Returns the solves made."""
    solves = 0
    dead: set[tuple[int, bool]] = set()
    for levels in _variants(ir, request, *group):
        layout = levels[-1]
        key = (layout.vpp, layout.sequence_parallel)
        if key in dead:
            continue
        cand = _solve(inputs, layout, gpu, cluster, request)
        solves += 1
        if cand is None:
            dead.add(key)
        else:
            feasible.setdefault(cand.layout, cand)
    return solves


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
    )


def evaluate_pinned(ir: ModelIR, request: PlanRequest, gpu: GPUProfile, cluster: ClusterProfile) -> Candidate:
    """Every dimension pinned: evaluate exactly that layout (balanced stages). Raises Infeasible if it does not
    fit, naming the stage and the overflow."""
    validate_request(ir, request, cluster)
    layout = pinned_layout(ir, request)
    ev = evaluate(summarize(ir), layout, gpu, cluster)
    if not ev.fits:
        raise Infeasible(f"layout {layout.describe()} does not fit: {ev.reason}")
    return Candidate(layout, ev)


def pinned_layout(ir: ModelIR, request: PlanRequest) -> Layout:
    assert request.tp and request.pp and request.micro_batch and request.vpp is not None
    dp = request.num_gpus // (request.tp * request.pp)
    layout = Layout(
        tp=request.tp,
        pp=request.pp,
        dp=dp,
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
    for name in ("tp", "pp", "dp", "micro_batch", "vpp"):
        value = getattr(request, name)
        if value is not None and value < 1:
            raise PlanError(f"--{name.replace('_', '-')} must be >= 1")
    pinned = [getattr(request, k) for k in ("tp", "pp", "dp") if getattr(request, k)]
    product = 1
    for v in pinned:
        product *= v
    if n % product:
        raise Infeasible(f"tp·pp·dp pinned to {product} does not divide {n} GPUs")
    if request.tp and request.pp and request.dp and request.tp * request.pp * request.dp != n:
        raise Infeasible(f"tp·pp·dp = {request.tp * request.pp * request.dp} but --gpus is {n}")
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
    if layout.pp > 1 and layout.num_microbatches < layout.pp:
        return (
            f"1F1B needs at least pp = {layout.pp} micro-batches per step, got {layout.num_microbatches}: "
            f"lower the micro-batch or raise the global batch"
        )
    if layout.vpp > 1 and (layout.pp == 1 or layout.num_microbatches % layout.pp):
        return "the interleaved schedule needs pp > 1 and micro-batches divisible by pp"
    if layout.sequence_parallel and layout.tp == 1:
        return "sequence parallelism needs tp > 1"
    return None


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


def _dp_options(ir: ModelIR, request: PlanRequest, cluster: ClusterProfile) -> list[int]:
    if request.dp:
        return [request.dp]
    out = set()
    for tp in _tp_options(ir, request, cluster) or [1]:
        for pp in _divisors(request.num_gpus // tp) if request.num_gpus % tp == 0 else []:
            if (request.pp is None or pp == request.pp) and pp <= max(ir.num_layers, 1):
                out.add(request.num_gpus // (tp * pp))
    return sorted(out)


def _groups(ir: ModelIR, request: PlanRequest, cluster: ClusterProfile) -> Iterator[tuple[int, int, int, int]]:
    zeros = [request.zero] if request.zero is not None else list(ZERO_CHOICES)
    for tp in _tp_options(ir, request, cluster):
        rest = request.num_gpus // tp
        for pp in [request.pp] if request.pp else _divisors(rest):
            if rest % pp or pp > ir.num_layers:
                continue
            dp = rest // pp
            if (request.dp and dp != request.dp) or request.global_batch % dp:
                continue
            for zero in zeros:
                if zero and dp == 1:
                    continue  # nothing to shard over
                yield tp, pp, dp, zero


def _micro_batches(request: PlanRequest, dp: int) -> list[int]:
    per_replica = request.global_batch // dp
    if request.micro_batch:
        return [request.micro_batch] if per_replica % request.micro_batch == 0 else []
    return [m for m in _divisors(per_replica) if m <= MAX_MICRO_BATCH]


def _least_memory_layout(request: PlanRequest, tp: int, pp: int, dp: int, zero: int, ir: ModelIR) -> Layout | None:
    mbs = _micro_batches(request, dp)
    if not mbs:
        return None
    mb = mbs[0]
    sp = request.sequence_parallel if request.sequence_parallel is not None else tp > 1
    layout = Layout(
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch=mb,
        num_microbatches=request.global_batch // (dp * mb),
        vpp=1,
        sequence_parallel=sp and tp > 1,
        recompute=request.recompute or "full",
        zero=zero,
    )
    if layout_problem(ir, layout, request.global_batch):
        return None
    return layout


def _variants(ir: ModelIR, request: PlanRequest, tp: int, pp: int, dp: int, zero: int) -> Iterator[list[Layout]]:
    """For each (micro-batch, vpp, sp): the runnable layouts in increasing recompute order."""
    recomputes = [request.recompute] if request.recompute else list(RECOMPUTE_CHOICES)
    sps = (
        [request.sequence_parallel] if request.sequence_parallel is not None else ([False, True] if tp > 1 else [False])
    )
    # Megatron-LM's interleaved schedule needs the blocks to divide evenly into pp·vpp chunks
    vpps = (
        [request.vpp]
        if request.vpp
        else ([1] if pp == 1 else [v for v in VPP_CHOICES if v == 1 or ir.num_layers % (pp * v) == 0])
    )
    for mb in _micro_batches(request, dp):
        m = request.global_batch // (dp * mb)
        for vpp in vpps:
            for sp in sps:
                levels = []
                for rc in recomputes:
                    layout = Layout(
                        tp=tp,
                        pp=pp,
                        dp=dp,
                        micro_batch=mb,
                        num_microbatches=m,
                        vpp=vpp,
                        sequence_parallel=bool(sp),
                        recompute=rc,
                        zero=zero,
                    )  # type: ignore[arg-type]
                    if layout_problem(ir, layout, request.global_batch) is None:
                        levels.append(layout)
                if levels:
                    yield levels


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


def _no_fit_message(
    ir: ModelIR, request: PlanRequest, gpu: GPUProfile, cluster: ClusterProfile, misses: list[Candidate]
) -> str:
    closest = min(misses, key=lambda c: c.evaluation.peak_memory_bytes - c.evaluation.capacity_bytes, default=None)
    need = smallest_gpu_count(ir, request, gpu, cluster)
    pinned = any(
        getattr(request, k) is not None
        for k in ("tp", "pp", "dp", "micro_batch", "vpp", "recompute", "sequence_parallel", "zero")
    )
    with_pins = " with the pinned choices" if pinned else ""
    # smallest_gpu_count only looks above the request, so a hint never contradicts the failure it explains
    hint = f"; it fits on {need} GPUs{with_pins}" if need else ""
    if closest is None:
        why = (
            with_pins
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
        for tp, pp, dp, zero in _groups(ir, req, cluster):
            probe = _least_memory_layout(req, tp, pp, dp, zero, ir)
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
