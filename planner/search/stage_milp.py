"""Assign blocks to pipeline stages and choose how many to recompute: a small MILP solved with pulp.

Formulation (S = pp·vpp virtual stages; virtual stage i runs on pipeline rank ρ(i) = i mod pp):

    variables   n_i ∈ ℤ≥0   blocks on virtual stage i          r_i ∈ ℤ≥0   of them recomputed
                T ≥ 0       the busiest pipeline rank's time per micro-batch (or vpp × the heaviest chunk)
                U, M_p ≥ 0  (vpp > 1) the busiest rank's time; rank p's heaviest chunk
    minimise    T + ε·Σ r_i + δ·(U + Σ_p M_p)     (ε: recompute only where memory needs it; δ: tie-breaks)
    subject to  Σ_i n_i = L                                         (every block placed once)
                1 ≤ n_i (when L ≥ S),   r_i ≤ n_i  (= n_i when the user pinned recompute: a pin holds)
                τ_i = n_i·t_b + r_i·t_r + [i=0]·t_pre + [i=S−1]·t_post     (virtual stage time)
                Σ_{i: ρ(i)=p} τ_i ≤ T  ∀ ranks p,     vpp·τ_i ≤ T  ∀ i (interleaved: chunks balanced)
                Σ_{i: ρ(i)=p} τ_i ≤ U,   τ_i ≤ M_ρ(i)                     (vpp > 1 only)
                Σ_{i: ρ(i)=p} (n_i·w_b + [i=0]·w_pre + [i=S−1]·w_post
                               + f_i·(n_i·a_b − r_i·(a_b − a_r) + [i=0]·a_pre + [i=S−1]·a_post)) ≤ C   ∀ ranks p

t_b / t_r: forward+backward time of one block per micro-batch / the extra time when it is recomputed; w: static
bytes (weights, gradients, optimizer state); a_b / a_r: activation bytes one in-flight micro-batch keeps per block
without / with recompute; f_i: in-flight micro-batches of virtual stage i under the schedule; C: capacity minus
reserve. With vpp > 1 one heavy chunk (the head's) can set T by itself, leaving every other assignment optimal,
including ones that pile blocks on one chunk or leave a rank heavier than needed; the δ terms (δ = 1e-4, far
below one block's time) then pick the one with the lightest busiest rank (what the cost model's pipeline time
reads) and each rank's chunks as even as the blocks allow. When blocks are identical, integer counts replace a
binary per layer and the model stays tiny (2S+1 variables, pp+2 more when vpp > 1) whatever the depth; when they
differ (StageProblem.mixed), the contiguous-cut formulation at the end of this module prices each block as itself
in τ_i and the memory rows, over runs of identical blocks (about 4S variables per run). The step
time follows as (m + (pp−1)/vpp)·T plus what does not overlap, which the cost model's evaluate() computes on
the resulting assignment.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import pulp

from mlm.planner.errors import PlanError


@dataclass(frozen=True)
class StageProblem:
    """The coefficients of one MILP instance (all per micro-batch; bytes and seconds)."""

    num_blocks: int
    pp: int
    vpp: int
    block_time_s: float
    recompute_time_s: float  # extra time per recomputed block
    pre_time_s: float  # layers before the blocks (embedding), on virtual stage 0
    post_time_s: float  # layers after the blocks (final norm, head, loss), on the last virtual stage
    block_static_bytes: float
    pre_static_bytes: float
    post_static_bytes: float
    block_act_bytes: float  # per in-flight micro-batch, no recompute
    block_act_recompute_bytes: float  # per in-flight micro-batch, recomputed
    pre_act_bytes: float
    post_act_bytes: float
    inflight: tuple[float, ...]  # per virtual stage
    capacity_bytes: float  # HBM less the rank-wide terms, full recompute's working block among them
    allow_recompute: bool = True
    recompute_all: bool = False  # recompute pinned by the user: every block recomputes (r_i = n_i)
    # per block, in order, when blocks differ (StageCoefficients' tuples; the block_* scalars are then their means)
    block_times_s: tuple[float, ...] = ()
    block_recompute_extras_s: tuple[float, ...] = ()
    block_statics_bytes: tuple[float, ...] = ()
    block_acts_bytes: tuple[float, ...] = ()
    block_acts_recompute_bytes: tuple[float, ...] = ()
    # full recompute's working block (one block's activations while it is recomputed): evaluate() counts it only on
    # ranks that recompute, so a rank that recomputes nothing has this much more room than capacity_bytes
    recompute_working_bytes: float = 0.0
    # per virtual stage: torch's PipelineStage receive buffers (one per micro-batch and direction), block-independent
    stage_buffer_bytes: tuple[float, ...] = ()

    @property
    def mixed(self) -> bool:
        """Whether blocks differ: then each is placed as itself (the contiguous-cut formulation below)."""
        return bool(self.block_times_s)


@dataclass(frozen=True)
class StageSolution:
    blocks_per_stage: tuple[int, ...]
    recompute_blocks: tuple[int, ...]
    bottleneck_s: float
    status: str  # "optimal", or "time-limit" (the best assignment found when the solver was stopped)


def solve_stages(problem: StageProblem, solver: str = "cbc", time_limit_s: float = 10.0) -> StageSolution | None:
    """Solve the MILP; None when no assignment fits in memory (or none was found within the time limit)."""
    return solve_stages_status(problem, solver, time_limit_s)[0]


def memory_may_fit(p: StageProblem) -> bool:
    """A necessary condition for the MILP to be feasible, without a solver: each rank holds at least one block per
    virtual stage, and at most as many more as its remaining capacity allows at the cheapest per-block bytes among
    its stages (every block recomputed when recompute is allowed); together the ranks must hold every block.
    False proves that no assignment fits (a relaxation of _rank_memory's constraints); True proves nothing."""
    S = p.pp * p.vpp
    if p.num_blocks < S:
        return False
    if p.mixed:
        return _mixed_may_fit(p)
    act = p.block_act_bytes
    if p.recompute_all:
        act = p.block_act_recompute_bytes
    elif p.allow_recompute:
        act = min(act, p.block_act_recompute_bytes)
    room = 0
    for stages in _ranks(p):
        # a rank that recomputes saves activations but holds the working block; one that does not, the reverse
        options = [(act, p.capacity_bytes), (p.block_act_bytes, p.capacity_bytes + _idle_room(p))]
        held = [_uniform_rank_room(p, stages, a, cap) for a, cap in options]
        if max(held) < 0:
            return False
        room += max(held)
        if room >= p.num_blocks:
            return True
    return room >= p.num_blocks


def _idle_room(p: StageProblem) -> float:
    """The room a rank that recomputes nothing has beyond capacity_bytes (none when every block recomputes)."""
    return 0.0 if p.recompute_all else p.recompute_working_bytes


def _uniform_rank_room(p: StageProblem, stages: list[int], act: float, capacity: float) -> int:
    """How many blocks a rank can hold at most at `act` activation bytes per block and micro-batch (at least one
    per chunk); −1 when not even one per chunk fits."""
    fixed = 0.0
    for i in stages:
        fixed += p.block_static_bytes + p.inflight[i] * act + _edge_bytes(p, i)
    spare = capacity - fixed
    if spare < 0:
        return -1
    per_block = p.block_static_bytes + min(p.inflight[i] for i in stages) * act
    return len(stages) + (int(spare // per_block) if per_block > 0 else p.num_blocks)


def pipeline_lower_bound(
    p: StageProblem, num_microbatches: int, p2p_time_s: float, solver: str = "cbc", time_limit_s: float = 10.0
) -> float:
    """A pipeline time (the cost model's m·t_max + (Σ_r t_r − t_max)/vpp) that no assignment fitting in memory
    can beat: the LP relaxation of the MILP's placement and memory constraints with that time as objective
    (linear: (m − 1/vpp)·T + Σ_i τ_i / vpp, T ≥ every rank's time). It leaves out the chunk constraints, which
    the cost model does not impose. math.inf when even the relaxation does not fit; 0.0 when the LP is not
    solved (no bound)."""
    S = p.pp * p.vpp
    if p.num_blocks < S or not memory_may_fit(p):
        return math.inf
    m = num_microbatches
    if p.mixed:
        return _mixed_pipeline_bound(p, m, p2p_time_s, solver, time_limit_s)
    prob = pulp.LpProblem("stage_bound", pulp.LpMinimize)
    n = [pulp.LpVariable(f"n{i}", lowBound=1, upBound=p.num_blocks) for i in range(S)]
    r = [pulp.LpVariable(f"r{i}", lowBound=0, upBound=p.num_blocks if p.allow_recompute else 0) for i in range(S)]
    T = pulp.LpVariable("T", lowBound=0)
    total = pulp.lpSum(_stage_time(p, n, r, i) for i in range(S))
    prob += (m - 1.0 / p.vpp) * T + total / p.vpp
    for stages in _ranks(p):
        prob += pulp.lpSum(_stage_time(p, n, r, i) for i in stages) <= T
    _placement(prob, p, n, r)
    _rank_memory(prob, p, n, r, integer=False)
    status = pulp.LpStatus[prob.solve(_solver(solver, time_limit_s))]
    if status == "Infeasible":
        return math.inf
    if status != "Optimal" or pulp.value(prob.objective) is None:
        return 0.0
    # every rank also sends and receives once per chunk and micro-batch: vpp·p2p per rank, S·p2p in all
    return float(pulp.value(prob.objective)) + (m - 1.0 / p.vpp) * p.vpp * p2p_time_s + S * p2p_time_s / p.vpp


def integer_lower_bound(p: StageProblem, num_microbatches: int, p2p_time_s: float) -> float:
    """A pipeline time (m·t_max + (Σ_r t_r − t_max)/vpp) that no integer assignment satisfying the MILP's memory
    constraints can beat, without a solver. Per rank r holding n blocks: its memory is at least every chunk's one
    block plus the rest on its chunk with the fewest in-flight micro-batches, and a recomputed block saves at most
    what it saves on its chunk with the most; that gives the fewest recomputes k_r(n) it needs, hence a rank time
    t_r(n) = fixed + n·t_b + k_r(n)·t_rc, non-decreasing in n. Handing blocks one by one to the rank whose time
    grows least minimises max_r t_r (standard for non-decreasing costs); W, the ranks' total without recompute,
    bounds Σ_r t_r. math.inf when no rank split can hold the blocks."""
    S = p.pp * p.vpp
    if p.num_blocks < S:
        return math.inf
    if p.mixed:
        return _mixed_integer_bound(p, num_microbatches, p2p_time_s)
    last = S - 1
    saved = p.block_act_bytes - p.block_act_recompute_bytes
    ranks = _ranks(p)
    fixed_t, fixed_m, f_min, f_max, first = [], [], [], [], []
    for stages in ranks:
        t = p.vpp * p2p_time_s
        m = 0.0
        for i in stages:
            m += p.block_static_bytes + p.inflight[i] * p.block_act_bytes + _edge_bytes(p, i)
            if i == 0:
                t += p.pre_time_s
            if i == last:
                t += p.post_time_s
        fixed_t.append(t)
        fixed_m.append(m)
        f_min.append(min(p.inflight[i] for i in stages))
        f_max.append(max(p.inflight[i] for i in stages))
        first.append(len(stages))

    def rank_time(r: int, n: int) -> float:
        memory = fixed_m[r] + (n - first[r]) * (p.block_static_bytes + f_min[r] * p.block_act_bytes)
        need = 0
        over = memory - p.capacity_bytes
        if not p.recompute_all and over <= _idle_room(p):
            over = 0.0  # fits without recomputing, in the room the working block would take
        if p.recompute_all:
            need = n
            over -= n * f_max[r] * saved
        elif over > 0:
            per = f_max[r] * saved if p.allow_recompute else 0.0
            need = math.ceil(over / per - 1e-9) if per > 0 else n + 1
            over = 0.0 if need <= n else over
        if over > 1e-6 * max(p.capacity_bytes, 1.0) or need > n:
            return math.inf
        return fixed_t[r] + n * p.block_time_s + need * p.recompute_time_s

    counts = list(first)
    times = [rank_time(r, counts[r]) for r in range(p.pp)]
    if math.isinf(max(times)):
        return math.inf
    for _ in range(p.num_blocks - sum(counts)):
        r = min(range(p.pp), key=lambda j: rank_time(j, counts[j] + 1))
        counts[r] += 1
        times[r] = rank_time(r, counts[r])
        if math.isinf(times[r]):
            return math.inf
    t_max = max(times)
    work = sum(fixed_t) + p.num_blocks * p.block_time_s
    m = num_microbatches
    return m * t_max + (work - t_max) / p.vpp


def solve_stages_status(
    problem: StageProblem, solver: str = "cbc", time_limit_s: float = 10.0, screen: bool = True
) -> tuple[StageSolution | None, str]:
    """The MILP's solution and how the solver ended: "optimal", "infeasible" (proved, or by memory_may_fit),
    "time-limit" (stopped with an assignment that may not be optimal) or "time-limit-none" (stopped before it
    found any assignment: whether one fits is unknown). screen=False skips the memory_may_fit shortcut."""
    S = problem.pp * problem.vpp
    if problem.num_blocks < S or (screen and not memory_may_fit(problem)):
        return None, "infeasible"
    if problem.mixed:
        return _solve_mixed(problem, solver, time_limit_s)
    prob = pulp.LpProblem("stages", pulp.LpMinimize)
    n = [pulp.LpVariable(f"n{i}", lowBound=1, upBound=problem.num_blocks, cat="Integer") for i in range(S)]
    r = [
        pulp.LpVariable(
            f"r{i}", lowBound=0, upBound=problem.num_blocks if problem.allow_recompute else 0, cat="Integer"
        )
        for i in range(S)
    ]
    T = pulp.LpVariable("T", lowBound=0)
    eps = 1e-3 * max(problem.recompute_time_s, 1e-12) / problem.num_blocks
    objective = T + eps * pulp.lpSum(r)
    if problem.vpp > 1:
        U = pulp.LpVariable("U", lowBound=0)
        M = [pulp.LpVariable(f"M{p}", lowBound=0) for p in range(problem.pp)]
        objective += TIE_BREAK * (U + pulp.lpSum(M))
        _tie_breaks(prob, problem, n, r, U, M)
    prob += objective
    _placement(prob, problem, n, r)
    _rank_time(prob, problem, n, r, T)
    _rank_memory(prob, problem, n, r)
    return _outcome(prob, solver, time_limit_s, n, r, T)


def _outcome(
    prob: pulp.LpProblem, solver: str, time_limit_s: float, n: list, r: list, T: pulp.LpVariable
) -> tuple[StageSolution | None, str]:
    """Solve `prob` and read blocks and recomputes per virtual stage (variables or expressions) and T."""
    start = time.perf_counter()
    status = prob.solve(_solver(solver, time_limit_s))
    stopped = time.perf_counter() - start >= 0.95 * time_limit_s
    # CBC stopped at its limit reports "Not Solved" without an assignment, and an integer-feasible one as optimal
    found = pulp.LpStatus[status] == "Optimal" and getattr(prob, "sol_status", 1) in (1, 2)
    if not found:
        return None, ("time-limit-none" if stopped or pulp.LpStatus[status] == "Not Solved" else "infeasible")
    proved = getattr(prob, "sol_status", 1) == 1 and not stopped
    blocks = tuple(int(round(pulp.value(v))) for v in n)
    recompute = tuple(int(round(pulp.value(v))) for v in r)
    how = "optimal" if proved else "time-limit"
    return StageSolution(blocks, recompute, float(T.value()), how), how


def _placement(prob: pulp.LpProblem, p: StageProblem, n: list, r: list) -> None:
    """Every block on exactly one stage; recomputed blocks are a subset of a stage's blocks."""
    prob += pulp.lpSum(n) == p.num_blocks
    for ni, ri in zip(n, r):
        prob += ri <= ni
        if p.recompute_all:
            prob += ri == ni


def _ranks(p: StageProblem) -> list[list[int]]:
    return [[i for i in range(p.pp * p.vpp) if i % p.pp == rank] for rank in range(p.pp)]


TIE_BREAK = 1e-4


def _stage_time(p: StageProblem, n: list, r: list, i: int) -> pulp.LpAffineExpression:
    """τ_i: virtual stage i's forward+backward(+recompute) time per micro-batch."""
    last = p.pp * p.vpp - 1
    return (
        n[i] * p.block_time_s
        + r[i] * p.recompute_time_s
        + (p.pre_time_s if i == 0 else 0.0)
        + (p.post_time_s if i == last else 0.0)
    )


def _tie_breaks(prob: pulp.LpProblem, p: StageProblem, n: list, r: list, U: pulp.LpVariable, M: list) -> None:
    """U bounds every rank's time and M_p each chunk of rank p (interleaved only; they enter the objective
    with weight δ, so they choose among the assignments that minimise T)."""
    for rank, stages in enumerate(_ranks(p)):
        prob += pulp.lpSum(_stage_time(p, n, r, i) for i in stages) <= U
        for i in stages:
            prob += _stage_time(p, n, r, i) <= M[rank]


def _rank_time(prob: pulp.LpProblem, p: StageProblem, n: list, r: list, T: pulp.LpVariable) -> None:
    """T bounds every pipeline rank's forward+backward(+recompute) time per micro-batch. Under the interleaved
    schedule every chunk is on the critical path in turn, so vpp times each chunk's time is bounded as well
    (otherwise one heavy chunk per rank would pass as balanced)."""
    last = p.pp * p.vpp - 1

    def stage_time(i: int) -> pulp.LpAffineExpression:
        return (
            n[i] * p.block_time_s
            + r[i] * p.recompute_time_s
            + (p.pre_time_s if i == 0 else 0.0)
            + (p.post_time_s if i == last else 0.0)
        )

    for stages in _ranks(p):
        prob += pulp.lpSum(stage_time(i) for i in stages) <= T
    if p.vpp > 1:
        for i in range(p.pp * p.vpp):
            prob += p.vpp * stage_time(i) <= T


def _rank_memory(prob: pulp.LpProblem, p: StageProblem, n: list, r: list, integer: bool = True) -> None:
    """Static bytes plus in-flight activations fit each rank's capacity (see _idle_capacity)."""
    saved = p.block_act_bytes - p.block_act_recompute_bytes
    scale = 1.0 / 2**30  # GiB keeps the coefficients well conditioned for the solver
    for stages in _ranks(p):
        terms = []
        for i in stages:
            f = p.inflight[i]
            terms.append(n[i] * (p.block_static_bytes + f * p.block_act_bytes) * scale - r[i] * f * saved * scale)
            terms.append(_edge_bytes(p, i) * scale)
        prob += pulp.lpSum(terms) <= _idle_capacity(prob, p, [r[i] for i in stages], integer) * scale


def _idle_capacity(prob: pulp.LpProblem, p: StageProblem, recomputed: list, integer: bool) -> Any:
    """A rank's capacity: capacity_bytes, plus the working block's bytes when it recomputes none of its blocks
    (a binary y per rank, Σ r ≤ L·y; continuous in [0, 1] for the LP relaxation)."""
    extra = _idle_room(p)
    if extra <= 0 or not p.allow_recompute:
        return p.capacity_bytes + (extra if not p.allow_recompute else 0.0)
    y = pulp.LpVariable(f"y{len(prob.variables())}", lowBound=0, upBound=1, cat="Integer" if integer else "Continuous")
    prob += pulp.lpSum(recomputed) <= p.num_blocks * y
    return p.capacity_bytes + extra * (1 - y)


def _solver(name: str, time_limit_s: float) -> pulp.LpSolver:
    if name == "highs":
        for cls in (getattr(pulp, "HiGHS", None), getattr(pulp, "HiGHS_CMD", None)):
            if cls is not None:
                solver = cls(msg=False, timeLimit=time_limit_s)
                if solver.available():
                    return solver
        raise PlanError("--solver highs: HiGHS is not installed (pip install highspy), use --solver cbc")
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=1e-7)


# ---- blocks that differ: each placed as itself -------------------------------------------------------------------
#
# With differing blocks (dense-then-MoE, sliding/full attention, encoder/decoder) a count per stage no longer says
# what a stage costs: which blocks it holds does. Virtual stage i holds the contiguous blocks [b_i, b_{i+1}) and
# recomputes the first of them, [b_i, c_i) (as evaluate() and plan.json's recompute_layers do), with
# 0 = b_0 ≤ c_0 ≤ b_1 ≤ c_1 ≤ … ≤ b_S = L. Consecutive identical blocks form runs k = 1..K of length ℓ_k; a cut x
# (any b_i or c_i) is written as how many blocks of each run lie before it, a_{x,k} ∈ {0..ℓ_k}, with binaries
# φ_{x,k} (run k wholly before x): a_{x,k} ≥ ℓ_k·φ_{x,k} and a_{x,k+1} ≤ ℓ_{k+1}·φ_{x,k}, so a cut takes a prefix of
# the stack. Cuts in order: a_{x,k} ≤ a_{x',k} for consecutive cuts x, x'. Every per-block quantity q (time,
# recompute extra, static and activation bytes) of the blocks between two cuts is Σ_k q_k·(a_{x',k} − a_{x,k}):
# linear, so the time, memory and objective above keep their form with n_i·t_b replaced by the stage's own sum.
# Identical blocks never take this path: one run makes it the count formulation above.


@dataclass(frozen=True)
class _Run:
    """Consecutive identical blocks and the per-block numbers they share."""

    length: int
    time_s: float
    extra_s: float
    static_bytes: float
    act_bytes: float
    act_recompute_bytes: float


def _runs(p: StageProblem) -> list[_Run]:
    """The stack as runs of identical blocks, in order."""
    runs: list[_Run] = []
    for key in zip(
        p.block_times_s,
        p.block_recompute_extras_s,
        p.block_statics_bytes,
        p.block_acts_bytes,
        p.block_acts_recompute_bytes,
    ):
        last = runs[-1] if runs else None
        if (
            last is not None
            and (
                last.time_s,
                last.extra_s,
                last.static_bytes,
                last.act_bytes,
                last.act_recompute_bytes,
            )
            == key
        ):
            runs[-1] = _Run(last.length + 1, *key)
        else:
            runs.append(_Run(1, *key))
    assert sum(run.length for run in runs) == p.num_blocks, "per-block tuples must cover every block"
    return runs


def _span(per_block: list[float], lo: list, hi: list) -> pulp.LpAffineExpression:
    """Σ_k q_k·(hi_k − lo_k): a per-block quantity q (one value per run) summed over the blocks between cuts."""
    return pulp.lpSum(q * (h - low) for q, low, h in zip(per_block, lo, hi))


def _mixed_model(prob: pulp.LpProblem, p: StageProblem, integer: bool) -> tuple[list, list, list]:
    """Add the cuts, placement and memory constraints of the contiguous-cut formulation; return each virtual
    stage's block count, recompute count and time τ_i (expressions). integer=False gives its LP relaxation."""
    runs = _runs(p)
    S = p.pp * p.vpp
    cat = "Integer" if integer else "Continuous"

    def cut(name: str) -> list:
        a = [pulp.LpVariable(f"{name}_{k}", lowBound=0, upBound=run.length, cat=cat) for k, run in enumerate(runs)]
        for k in range(len(runs) - 1):
            whole = pulp.LpVariable(f"{name}_w{k}", lowBound=0, upBound=1, cat=cat)
            prob.addConstraint(a[k] >= runs[k].length * whole)
            prob.addConstraint(a[k + 1] <= runs[k + 1].length * whole)
        return a

    starts = [[0.0] * len(runs)] + [cut(f"b{i}") for i in range(1, S)] + [[float(run.length) for run in runs]]
    if p.recompute_all:
        ends = starts[1:]
    elif not p.allow_recompute:
        ends = starts[:-1]
    else:
        ends = [cut(f"c{i}") for i in range(S)]
    order = [starts[0]]
    for i in range(S):
        order += [ends[i], starts[i + 1]]
    for before, after in zip(order, order[1:]):
        if before is not after:
            for x, y in zip(before, after):
                if isinstance(x, pulp.LpVariable) or isinstance(y, pulp.LpVariable):
                    prob += x <= y
    ones = [1.0] * len(runs)
    time_s = [run.time_s for run in runs]
    extra_s = [run.extra_s for run in runs]
    scale = 1.0 / 2**30  # GiB keeps the coefficients well conditioned for the solver
    last = S - 1
    n, r, tau, memory = [], [], [], []
    for i in range(S):
        lo, hi, rc = starts[i], starts[i + 1], ends[i]
        f = p.inflight[i]
        held = [(run.static_bytes + f * run.act_bytes) * scale for run in runs]
        saved = [f * (run.act_bytes - run.act_recompute_bytes) * scale for run in runs]
        n.append(_span(ones, lo, hi))
        r.append(_span(ones, lo, rc))
        t = _span(time_s, lo, hi) + _span(extra_s, lo, rc)
        mem = _span(held, lo, hi) - _span(saved, lo, rc) + _edge_bytes(p, i) * scale
        if i == 0:
            t += p.pre_time_s
        if i == last:
            t += p.post_time_s
        prob += n[i] >= 1
        tau.append(t)
        memory.append(mem)
    for stages in _ranks(p):
        capacity = _idle_capacity(prob, p, [r[i] for i in stages], integer)
        prob += pulp.lpSum(memory[i] for i in stages) <= capacity * scale
    return n, r, tau


def _solve_mixed(p: StageProblem, solver: str, time_limit_s: float) -> tuple[StageSolution | None, str]:
    """The stage MILP over contiguous cuts (same objective, time and tie-break constraints as for counts)."""
    prob = pulp.LpProblem("stages", pulp.LpMinimize)
    n, r, tau = _mixed_model(prob, p, integer=True)
    T = pulp.LpVariable("T", lowBound=0)
    eps = 1e-3 * max(p.recompute_time_s, 1e-12) / p.num_blocks
    objective = T + eps * pulp.lpSum(r)
    for stages in _ranks(p):
        prob += pulp.lpSum(tau[i] for i in stages) <= T
    if p.vpp > 1:
        U = pulp.LpVariable("U", lowBound=0)
        M = [pulp.LpVariable(f"M{rank}", lowBound=0) for rank in range(p.pp)]
        objective += TIE_BREAK * (U + pulp.lpSum(M))
        for rank, stages in enumerate(_ranks(p)):
            prob += pulp.lpSum(tau[i] for i in stages) <= U
            for i in stages:
                prob += p.vpp * tau[i] <= T
                prob += tau[i] <= M[rank]
    prob += objective
    return _outcome(prob, solver, time_limit_s, n, r, T)


def _mixed_pipeline_bound(p: StageProblem, m: int, p2p_time_s: float, solver: str, time_limit_s: float) -> float:
    """pipeline_lower_bound over the LP relaxation of the contiguous-cut formulation."""
    S = p.pp * p.vpp
    prob = pulp.LpProblem("stage_bound", pulp.LpMinimize)
    _, _, tau = _mixed_model(prob, p, integer=False)
    T = pulp.LpVariable("T", lowBound=0)
    prob += (m - 1.0 / p.vpp) * T + pulp.lpSum(tau) / p.vpp
    for stages in _ranks(p):
        prob += pulp.lpSum(tau[i] for i in stages) <= T
    status = pulp.LpStatus[prob.solve(_solver(solver, time_limit_s))]
    if status == "Infeasible":
        return math.inf
    if status != "Optimal" or pulp.value(prob.objective) is None:
        return 0.0
    return float(pulp.value(prob.objective)) + (m - 1.0 / p.vpp) * p.vpp * p2p_time_s + S * p2p_time_s / p.vpp


def _mixed_act(p: StageProblem) -> list[float]:
    """Each block's least activation bytes per in-flight micro-batch the MILP may choose for it."""
    if p.recompute_all:
        return list(p.block_acts_recompute_bytes)
    if p.allow_recompute:
        return [min(a, b) for a, b in zip(p.block_acts_bytes, p.block_acts_recompute_bytes)]
    return list(p.block_acts_bytes)


def _cheapest_block(p: StageProblem, act: list[float], inflight: float) -> float:
    """The fewest bytes any one block takes on a chunk with `inflight` micro-batches in flight."""
    return min(s + inflight * a for s, a in zip(p.block_statics_bytes, act))


def _edge_bytes(p: StageProblem, i: int) -> float:
    """Bytes of virtual stage i that do not depend on its blocks: the layers before / after the blocks it holds,
    and its pipeline receive buffers."""
    out = p.stage_buffer_bytes[i] if p.stage_buffer_bytes else 0.0
    if i == 0:
        out += p.pre_static_bytes + p.inflight[i] * p.pre_act_bytes
    if i == p.pp * p.vpp - 1:
        out += p.post_static_bytes + p.inflight[i] * p.post_act_bytes
    return out


def _mixed_may_fit(p: StageProblem) -> bool:
    """memory_may_fit with each block as itself: every chunk's one block and every further block at the cheapest
    bytes any block has on that rank (a relaxation, as for identical blocks)."""
    options = [(_mixed_act(p), p.capacity_bytes), (list(p.block_acts_bytes), p.capacity_bytes + _idle_room(p))]
    room = 0
    for stages in _ranks(p):
        held = -1
        for act, capacity in options:  # recomputing (fewer activations) or not (the working block's room)
            spare = capacity - sum(_cheapest_block(p, act, p.inflight[i]) + _edge_bytes(p, i) for i in stages)
            if spare >= 0:
                per_block = _cheapest_block(p, act, min(p.inflight[i] for i in stages))
                held = max(held, len(stages) + (int(spare // per_block) if per_block > 0 else p.num_blocks))
        if held < 0:
            return False
        room += held
        if room >= p.num_blocks:
            return True
    return room >= p.num_blocks


def _prefix(values: list[float]) -> list[float]:
    """Sums of the k smallest values, k = 0..len."""
    out = [0.0]
    for v in sorted(values):
        out.append(out[-1] + v)
    return out


def _mixed_integer_bound(p: StageProblem, m: int, p2p_time_s: float) -> float:
    """integer_lower_bound with each block as itself. A rank holding n blocks takes at least the n cheapest blocks'
    time; its memory is at least, per chunk, the cheapest block there, plus the n − vpp smallest per-block bytes at
    its fewest in-flight micro-batches; a recomputed block saves at most the largest saving at its most, and
    costs at least the smallest recompute extra. Each t_r(n) is a lower bound on any rank holding n blocks and is
    non-decreasing in n, so the same greedy split of counts gives a bound."""
    S = p.pp * p.vpp
    act = _mixed_act(p)
    times = _prefix(list(p.block_times_s))
    extras = _prefix(list(p.block_recompute_extras_s))
    most_saved = max(a - b for a, b in zip(p.block_acts_bytes, p.block_acts_recompute_bytes))
    ranks = _ranks(p)
    fixed_t, fixed_m, rest_m, f_max, first = [], [], [], [], []
    plain_m, plain_rest = [], []  # the same without recompute (every block at its full activation bytes)

    def least(act_of: list[float], stages: list[int]) -> tuple[float, list[float]]:
        f_min = min(p.inflight[i] for i in stages)
        fixed = sum(_cheapest_block(p, act_of, p.inflight[i]) + _edge_bytes(p, i) for i in stages)
        return fixed, _prefix([s + f_min * a for s, a in zip(p.block_statics_bytes, act_of)])

    for stages in ranks:
        t = p.vpp * p2p_time_s + (p.pre_time_s if 0 in stages else 0.0) + (p.post_time_s if S - 1 in stages else 0.0)
        fixed_t.append(t)
        fixed, rest = least(act, stages)
        fixed_m.append(fixed)
        rest_m.append(rest)
        fixed, rest = least(list(p.block_acts_bytes), stages)
        plain_m.append(fixed)
        plain_rest.append(rest)
        f_max.append(max(p.inflight[i] for i in stages))
        first.append(len(stages))

    def rank_time(r: int, n: int) -> float:
        if n - first[r] >= len(rest_m[r]):
            return math.inf
        idle = _idle_room(p)
        if not p.recompute_all and plain_m[r] + plain_rest[r][n - first[r]] - p.capacity_bytes <= idle:
            return fixed_t[r] + times[n]  # fits without recomputing, in the room the working block would take
        over = fixed_m[r] + rest_m[r][n - first[r]] - p.capacity_bytes
        need = n if p.recompute_all else 0
        if over > 1e-6 * max(p.capacity_bytes, 1.0):
            per = f_max[r] * most_saved if p.allow_recompute and not p.recompute_all else 0.0
            if per <= 0:
                return math.inf
            need = math.ceil(over / per - 1e-9)
        if need > n:
            return math.inf
        return fixed_t[r] + times[n] + extras[need]

    counts = list(first)
    times_r = [rank_time(r, counts[r]) for r in range(p.pp)]
    if math.isinf(max(times_r)):
        return math.inf
    for _ in range(p.num_blocks - sum(counts)):
        r = min(range(p.pp), key=lambda j: rank_time(j, counts[j] + 1))
        counts[r] += 1
        times_r[r] = rank_time(r, counts[r])
        if math.isinf(times_r[r]):
            return math.inf
    t_max = max(times_r)
    work = sum(fixed_t) + sum(p.block_times_s)
    return m * t_max + (work - t_max) / p.vpp
