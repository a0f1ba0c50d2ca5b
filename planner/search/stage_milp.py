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
reads) and each rank's chunks as even as the blocks allow. Blocks are identical, so integer counts replace a
binary per layer and the model stays tiny (2S+1 variables, pp+2 more when vpp > 1) whatever the depth. The step
time follows as (m + (pp−1)/vpp)·T plus what does not overlap, which the cost model's evaluate() computes on
the resulting assignment.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

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
    capacity_bytes: float
    allow_recompute: bool = True
    recompute_all: bool = False  # recompute pinned by the user: every block recomputes (r_i = n_i)


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
    last = S - 1
    act = p.block_act_bytes
    if p.recompute_all:
        act = p.block_act_recompute_bytes
    elif p.allow_recompute:
        act = min(act, p.block_act_recompute_bytes)
    room = 0
    for stages in _ranks(p):
        fixed = 0.0
        for i in stages:
            fixed += p.block_static_bytes + p.inflight[i] * act
            if i == 0:
                fixed += p.pre_static_bytes + p.inflight[i] * p.pre_act_bytes
            if i == last:
                fixed += p.post_static_bytes + p.inflight[i] * p.post_act_bytes
        spare = p.capacity_bytes - fixed
        if spare < 0:
            return False
        per_block = p.block_static_bytes + min(p.inflight[i] for i in stages) * act
        room += len(stages) + (int(spare // per_block) if per_block > 0 else p.num_blocks)
        if room >= p.num_blocks:
            return True
    return room >= p.num_blocks


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
    prob = pulp.LpProblem("stage_bound", pulp.LpMinimize)
    n = [pulp.LpVariable(f"n{i}", lowBound=1, upBound=p.num_blocks) for i in range(S)]
    r = [pulp.LpVariable(f"r{i}", lowBound=0, upBound=p.num_blocks if p.allow_recompute else 0) for i in range(S)]
    T = pulp.LpVariable("T", lowBound=0)
    total = pulp.lpSum(_stage_time(p, n, r, i) for i in range(S))
    prob += (m - 1.0 / p.vpp) * T + total / p.vpp
    for stages in _ranks(p):
        prob += pulp.lpSum(_stage_time(p, n, r, i) for i in stages) <= T
    _placement(prob, p, n, r)
    _rank_memory(prob, p, n, r)
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
    last = S - 1
    saved = p.block_act_bytes - p.block_act_recompute_bytes
    ranks = _ranks(p)
    fixed_t, fixed_m, f_min, f_max, first = [], [], [], [], []
    for stages in ranks:
        t = p.vpp * p2p_time_s
        m = 0.0
        for i in stages:
            m += p.block_static_bytes + p.inflight[i] * p.block_act_bytes
            if i == 0:
                t += p.pre_time_s
                m += p.pre_static_bytes + p.inflight[i] * p.pre_act_bytes
            if i == last:
                t += p.post_time_s
                m += p.post_static_bytes + p.inflight[i] * p.post_act_bytes
        fixed_t.append(t)
        fixed_m.append(m)
        f_min.append(min(p.inflight[i] for i in stages))
        f_max.append(max(p.inflight[i] for i in stages))
        first.append(len(stages))

    def rank_time(r: int, n: int) -> float:
        memory = fixed_m[r] + (n - first[r]) * (p.block_static_bytes + f_min[r] * p.block_act_bytes)
        need = 0
        over = memory - p.capacity_bytes
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
    start = time.perf_counter()
    status = prob.solve(_solver(solver, time_limit_s))
    stopped = time.perf_counter() - start >= 0.95 * time_limit_s
    # CBC stopped at its limit reports "Not Solved" without an assignment, and an integer-feasible one as optimal
    found = pulp.LpStatus[status] == "Optimal" and getattr(prob, "sol_status", 1) in (1, 2)
    if not found:
        return None, ("time-limit-none" if stopped or pulp.LpStatus[status] == "Not Solved" else "infeasible")
    proved = getattr(prob, "sol_status", 1) == 1 and not stopped
    blocks = tuple(int(round(v.value())) for v in n)
    recompute = tuple(int(round(v.value())) for v in r)
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


def _rank_memory(prob: pulp.LpProblem, p: StageProblem, n: list, r: list) -> None:
    """Static bytes plus in-flight activations fit each rank's capacity."""
    last = p.pp * p.vpp - 1
    saved = p.block_act_bytes - p.block_act_recompute_bytes
    scale = 1.0 / 2**30  # GiB keeps the coefficients well conditioned for the solver
    for stages in _ranks(p):
        terms = []
        for i in stages:
            f = p.inflight[i]
            terms.append(n[i] * (p.block_static_bytes + f * p.block_act_bytes) * scale - r[i] * f * saved * scale)
            if i == 0:
                terms.append((p.pre_static_bytes + f * p.pre_act_bytes) * scale)
            if i == last:
                terms.append((p.post_static_bytes + f * p.post_act_bytes) * scale)
        prob += pulp.lpSum(terms) <= p.capacity_bytes * scale


def _solver(name: str, time_limit_s: float) -> pulp.LpSolver:
    if name == "highs":
        for cls in (getattr(pulp, "HiGHS", None), getattr(pulp, "HiGHS_CMD", None)):
            if cls is not None:
                solver = cls(msg=False, timeLimit=time_limit_s)
                if solver.available():
                    return solver
        raise PlanError("--solver highs: HiGHS is not installed (pip install highspy), use --solver cbc")
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=1e-7)
