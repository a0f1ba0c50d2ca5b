"""The what-if questions answered with the real search (planner/search/) and cost model (planner/cost/).

Each question returns a frozen answer dataclass; cli/whatif.py prints it. `on_step` callbacks let the CLI drive a
progress bar without this module printing anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from mlm.planner.capture.graph import ModelIR
from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.hardware import ClusterProfile, GPUProfile, resolve
from mlm.planner.errors import Infeasible, PlanError
from mlm.planner.search.layouts import Candidate, PlanRequest, evaluate_pinned, search
from mlm.planner.whatif.arithmetic import (
    Price,
    SweepSpec,
    TrainingTime,
    required_tokens_per_s,
    resolve_price,
    training_time,
)
from mlm.planner.whatif.integer_search import DeadlineSearch, GrowthSearch, largest_fitting, smallest_count_for_rate
from mlm.planner.whatif.scale import Base, describe, find_family, knob_range, scaled_args

Step = Callable[[str], None]
SCREEN_REFINE = 1  # stage MILPs per GPU count while the deadline search screens counts
SCREEN_TIME_LIMIT_S = 1.0  # per screening MILP; the final answer gets the full search


@dataclass(frozen=True)
class Point:
    """One evaluated question: the best plan on num_gpus × gpu (or why there is none) and the training time."""

    num_gpus: int
    gpu: GPUProfile
    cluster: ClusterProfile
    global_batch: int
    seq_len: int
    best: Candidate | None
    error: str | None
    time: TrainingTime | None
    price: Price

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class DeadlineAnswer:
    point: Point
    search: DeadlineSearch
    days: float


@dataclass(frozen=True)
class FitAnswer:
    point: Point
    ir: ModelIR
    args: dict[str, Any]
    description: str
    scale: str
    growth: GrowthSearch
    capped: bool  # the largest size the search may try still fits


def best_candidate(ir: ModelIR, request: PlanRequest, gpu: GPUProfile, cluster: ClusterProfile) -> Candidate:
    """The fastest fitting layout (the pinned one when every dimension is pinned); raises Infeasible."""
    if request.fully_pinned:
        return evaluate_pinned(ir, request, gpu, cluster)
    return search(ir, request, gpu, cluster).best


def evaluate_point(
    ir: ModelIR,
    request: PlanRequest,
    gpu: GPUProfile,
    cluster: ClusterProfile,
    tokens: float | None,
    usd_per_gpu_hour: float | None,
) -> Point:
    """Best plan and training time for one request; an infeasible request becomes Point.error, not an exception."""
    price = resolve_price(gpu.name, gpu.usd_per_gpu_hour, usd_per_gpu_hour)
    try:
        best: Candidate | None = best_candidate(ir, request, gpu, cluster)
        error = None
    except PlanError as e:
        best, error = None, str(e)
    time = None
    if best is not None and tokens is not None:
        time = training_time(
            tokens,
            request.global_batch,
            ir.seq_len,
            best.evaluation.step_time_s,
            request.num_gpus,
            price.usd_per_gpu_hour,
        )
    return Point(request.num_gpus, gpu, cluster, request.global_batch, ir.seq_len, best, error, time, price)


def time_to_train(
    ir: ModelIR,
    request: PlanRequest,
    gpu_name: str | None,
    cluster_name: str | None,
    tokens: float | None,
    usd_per_gpu_hour: float | None,
) -> Point:
    """Days, GPU-hours and cost on request.num_gpus GPUs; raises the search's error when nothing fits."""
    gpu, cluster = resolve(gpu_name, cluster_name)
    point = evaluate_point(ir, request, gpu, cluster, tokens, usd_per_gpu_hour)
    if point.best is None:
        raise Infeasible(point.error or "no layout fits")
    return point


def gpus_for_deadline(
    ir: ModelIR,
    request: PlanRequest,
    gpu_name: str | None,
    cluster_name: str | None,
    tokens: float,
    days: float,
    usd_per_gpu_hour: float | None,
    max_gpus: int,
    scan_limit: int = 12,
    on_step: Step | None = None,
) -> DeadlineAnswer:
    """The smallest whole-node GPU count whose best plan sees `tokens` within `days` (planner/whatif/integer_search.py).

    Counts are screened with a cheaper search (one stage MILP with a short time limit instead of several); the
    answer's plan is then searched in full, which can only be as fast or faster, so the answer is never late."""
    gpu, cluster = resolve(gpu_name, cluster_name)
    required = required_tokens_per_s(tokens, days)
    if max_gpus < 1:
        raise PlanError("--max-gpus must be >= 1")

    screen = replace(
        request, refine=min(request.refine, SCREEN_REFINE), time_limit_s=min(request.time_limit_s, SCREEN_TIME_LIMIT_S)
    )
    errors: dict[int, str] = {}

    def rate(n: int) -> float | None:
        point = evaluate_point(ir, replace(screen, num_gpus=n), gpu, cluster, None, None)
        if point.error:
            errors[n] = point.error
        return point.best.evaluation.tokens_per_s if point.best else None

    step = (lambda n: on_step(f"{n} GPUs")) if on_step else None
    found = smallest_count_for_rate(
        rate, required, cluster.gpus_per_node, max_gpus, request.global_batch, scan_limit, step
    )
    if found.num_gpus is None:
        best = found.best_seen
        most = (
            f"; the fastest count tried, {best[0]} GPUs, would take {tokens / best[1] / 86400:.0f} days"
            if best
            else "; the model fits on none of the counts tried"
        )
        beyond = [n for n in errors if best is None or n > best[0]]
        fixes = "allow more days, raise --max-gpus, or try a faster --gpu"
        if best and beyond:
            most += f"; {min(beyond)} GPUs: {errors[min(beyond)]}"
            fixes = (
                f"allow more days, raise --global-batch (now {request.global_batch}; more GPUs need more "
                f"sequences per step), or try a faster --gpu"
            )
        raise Infeasible(
            f"no GPU count up to --max-gpus {max_gpus} trains {tokens:.3g} tokens in {days:g} days "
            f"on {gpu.name}{most}. To fix: {fixes}"
        )
    point = evaluate_point(ir, replace(request, num_gpus=found.num_gpus), gpu, cluster, tokens, usd_per_gpu_hour)
    return DeadlineAnswer(point, found, days)


def capture_args(
    model: str, entry: str | None, args: dict[str, Any], seq_len: int | None, method: str = "auto", dtype: str = "bf16"
) -> ModelIR:
    """Load and capture MODEL built with `args` (meta device, no weights; activations in the compute `dtype`)."""
    return capture(load_model_spec(model, entry, args), seq_len=seq_len, method=method, dtype=dtype)


def largest_model(
    model: str,
    entry: str | None,
    args: dict[str, Any],
    base_ir: ModelIR,
    scale: str,
    request: PlanRequest,
    gpu_name: str | None,
    cluster_name: str | None,
    tokens: float | None,
    usd_per_gpu_hour: float | None,
    seq_len: int | None,
    method: str = "auto",
    on_step: Step | None = None,
) -> FitAnswer:
    """The largest model of MODEL's family (grown along `scale`) that fits on request.num_gpus GPUs."""
    gpu, cluster = resolve(gpu_name, cluster_name)
    base = Base(find_family(args), base_ir.num_layers, base_ir.num_heads, base_ir.hidden_size, dict(args))
    k_start, k_min, k_max = knob_range(base, scale)
    irs: dict[int, ModelIR] = {}

    feasibility = replace(request, refine=0)  # whether a layout fits does not depend on the stage MILP

    def fits(k: int) -> bool:
        irs[k] = capture_args(model, entry, scaled_args(base, scale, k), seq_len, method, gpu.compute_dtype)
        try:
            best_candidate(irs[k], feasibility, gpu, cluster)
        except PlanError:
            return False
        return True

    def step(k: int) -> None:
        if on_step:
            on_step(describe(base, scaled_args(base, scale, k)))

    growth = largest_fitting(fits, k_start, k_min, k_max, step)
    if growth.largest is None:
        smallest = describe(base, scaled_args(base, scale, k_min))
        raise Infeasible(
            f"not even the smallest model of the family along --scale {scale} ({smallest}) fits on "
            f"{request.num_gpus} {gpu.name} GPUs: use more GPUs or a GPU with more memory"
        )
    k = growth.largest
    ir, grown = irs[k], scaled_args(base, scale, k)
    point = evaluate_point(ir, request, gpu, cluster, tokens, usd_per_gpu_hour)
    return FitAnswer(point, ir, grown, describe(base, grown), scale, growth, capped=growth.first_failure is None)


def sweep(
    ir: ModelIR,
    request: PlanRequest,
    gpu_name: str | None,
    cluster_name: str | None,
    spec: SweepSpec,
    tokens: float | None,
    usd_per_gpu_hour: float | None,
    on_step: Step | None = None,
) -> list[Point]:
    """One Point per sweep value (infeasible values become rows with an error, not a failure)."""
    points = []
    for value in spec.values:
        if on_step:
            on_step(f"{spec.key}={value}")
        req, g_name = request, gpu_name
        if spec.key == "gpus":
            req = replace(request, num_gpus=int(value))
        elif spec.key == "global_batch":
            req = replace(request, global_batch=int(value))
        else:
            g_name = str(value)
        gpu, cluster = resolve(g_name, cluster_name)
        points.append(evaluate_point(ir, req, gpu, cluster, tokens, usd_per_gpu_hour))
    return points
