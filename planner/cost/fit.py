"""Refit a GPU profile's compute factor from `mlm-run --log` step logs (the engine of `mlm-calibrate`).

Pure: no torch. A log line holds the measured step time, the plan's predicted step time and its breakdown. One
factor f multiplies every kernel efficiency of the profile (the GEMM and attention curves and
memory_bound_efficiency), so the compute-bound part of a prediction scales by 1/f and the rest does not:

    predicted(f) = S / f + F,   S = compute_s + recompute_s − R + optimizer_s + bubble_s · c,   F = the other terms

where R is the tp communication a fully recomputed forward repeats (half of tp_comm_s under recompute="full",
else 0) and c the compute share of the bottleneck rank's busy time (compute + recompute − R over compute +
recompute + tp + pp communication), which is how the bubble scales when every rank has the bottleneck rank's mix.
Communication is taken as priced: an exposed dp term that hides under compute (mlm-run's DDP/FSDP overlap) would
shrink as compute slows, which this model does not follow. Each run
(a file, or a segment of one when the step index restarts) counts once, by its median post-warm-up step time M:
x = 1/f minimises Σ ((S x + F − M) / M)², a least-squares fit in relative error with the closed form
x = Σ a·b / Σ a², a = S/M, b = (M − F)/M.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlm.planner.cost.hardware import Calibration, GPUProfile
from mlm.planner.errors import PlanError

SCALED_TERMS = ("compute_s", "recompute_s", "optimizer_s")  # priced from the kernel efficiencies f multiplies
BUSY_COMM_TERMS = ("tp_comm_s", "pp_comm_s")  # the rest of a rank's busy time, which the bubble also holds


class CalibrationError(PlanError):
    """A log mlm-calibrate cannot use: empty, malformed, priced for another profile, or too short."""


def profile_fingerprint(gpu: dict[str, Any]) -> str:
    """sha256 of a GPU profile's values (plan.json's cluster.profile.gpu, or GPUProfile.to_dict())."""
    return hashlib.sha256(json.dumps(gpu, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Run:
    """The post-warm-up steps of one mlm-run, as its log holds them."""

    source: str  # file name, with #k for the k-th run appended to the same file
    gpu_profile: str
    gpu_profile_sha256: str | None
    layout: dict[str, Any]
    predicted_s: float
    breakdown: dict[str, float]
    measured_s: tuple[float, ...]
    peak_memory_bytes: float | None
    predicted_peak_memory_bytes: float | None

    @property
    def measured_median_s(self) -> float:
        return statistics.median(self.measured_s)

    @property
    def scaled_s(self) -> float:
        """S: the part of the prediction that scales by 1/f."""
        b = self.breakdown
        # a fully recomputed forward repeats the forward's tp collectives: half of tp_comm_s (a Megatron-style
        # block has as many tp collectives forward as backward), which the compute factor does not scale
        recomputed_tp = b.get("tp_comm_s", 0.0) / 2 if self.layout.get("recompute") == "full" else 0.0
        recomputed_tp = min(recomputed_tp, b.get("recompute_s", 0.0))
        busy_compute = b.get("compute_s", 0.0) + b.get("recompute_s", 0.0) - recomputed_tp
        busy = busy_compute + recomputed_tp + sum(b.get(k, 0.0) for k in BUSY_COMM_TERMS)
        share = busy_compute / busy if busy > 0 else 1.0
        scaled = sum(b.get(k, 0.0) for k in SCALED_TERMS) - recomputed_tp
        return scaled + b.get("bubble_s", 0.0) * share

    @property
    def fixed_s(self) -> float:
        """F: the prediction's terms that f leaves alone (communication)."""
        return self.predicted_s - self.scaled_s

    def predict(self, factor: float) -> float:
        """Step time predicted with every kernel efficiency times `factor` (relative to the plan's profile)."""
        return self.scaled_s / factor + self.fixed_s


_NEEDED = ("step", "step_time_s", "predicted_step_time_s", "gpu_profile", "layout", "predicted_breakdown")


def _number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _record(line: str, where: str) -> dict[str, Any]:
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise CalibrationError(f"{where}: not a JSON line ({e.msg})") from None
    if not isinstance(rec, dict):
        raise CalibrationError(f"{where}: not a JSON object")
    missing = [k for k in _NEEDED if rec.get(k) is None]
    if missing:
        raise CalibrationError(
            f"{where}: no {', '.join(missing)}; write the log with this mlm-run's --log from a plan with a prediction"
        )
    if not (_number(rec["step_time_s"]) and rec["step_time_s"] > 0 and _number(rec["predicted_step_time_s"])):
        raise CalibrationError(f"{where}: step_time_s and predicted_step_time_s must be positive numbers")
    bd = rec["predicted_breakdown"]
    if not isinstance(bd, dict) or not all(_number(v) and v >= 0 for v in bd.values()):
        raise CalibrationError(f"{where}: predicted_breakdown must map terms to non-negative seconds")
    return rec


def read_runs(path: Path, warmup: int = 1) -> list[Run]:
    """The runs in one log (a new run starts where the step index does not grow), first `warmup` steps dropped."""
    try:
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    except OSError as e:
        raise CalibrationError(f"cannot read {path}: {e.strerror or e}") from None
    if not lines:
        raise CalibrationError(f"{path}: empty log (no steps); run mlm-run --log {path} first")
    segments: list[list[dict[str, Any]]] = []
    for i, line in enumerate(lines, 1):
        rec = _record(line, f"{path}:{i}")
        if not segments or rec["step"] <= segments[-1][-1]["step"]:
            segments.append([])
        segments[-1].append(rec)
    runs = []
    for k, seg in enumerate(segments, 1):
        name = path.name if len(segments) == 1 else f"{path.name}#{k}"
        first = seg[0]
        for rec in seg[1:]:
            for key in ("gpu_profile", "gpu_profile_sha256", "layout", "predicted_step_time_s"):
                if rec.get(key) != first.get(key):
                    raise CalibrationError(f"{name}: step {rec['step']} has another {key} than step {first['step']}")
        kept = seg[warmup:]
        if not kept:
            raise CalibrationError(
                f"{name}: {len(seg)} step(s), all warm-up (--warmup {warmup}); run more steps or lower --warmup"
            )
        peaks = [r["peak_memory_bytes"] for r in kept if _number(r.get("peak_memory_bytes"))]
        runs.append(
            Run(
                source=name,
                gpu_profile=first["gpu_profile"],
                gpu_profile_sha256=first.get("gpu_profile_sha256"),
                layout=first["layout"],
                predicted_s=float(first["predicted_step_time_s"]),
                breakdown={k: float(v) for k, v in first["predicted_breakdown"].items()},
                measured_s=tuple(float(r["step_time_s"]) for r in kept),
                peak_memory_bytes=max(peaks) if peaks else None,
                predicted_peak_memory_bytes=first.get("predicted_peak_memory_bytes"),
            )
        )
    return runs


def check_profile(runs: list[Run], gpu: GPUProfile) -> None:
    """Refuse runs priced for another profile than `gpu` (another name, or the same name with other numbers)."""
    mine = profile_fingerprint(gpu.to_dict())
    for r in runs:
        if r.gpu_profile != gpu.name:
            raise CalibrationError(
                f"{r.source}: the run was planned for GPU profile '{r.gpu_profile}', not '{gpu.name}'; refit the "
                f"profile the plans were priced with (mlm-calibrate ... --gpu {r.gpu_profile})"
            )
        if r.gpu_profile_sha256 is not None and r.gpu_profile_sha256 != mine:
            raise CalibrationError(
                f"{r.source}: the run was planned with another '{gpu.name}' profile (its numbers differ from the "
                f"--gpu file); pass the profile file the plan was made with"
            )


def fit_factor(runs: list[Run]) -> float:
    """f, the factor on the kernel efficiencies that best explains the runs' median step times (module docstring)."""
    if not runs:
        raise CalibrationError("no runs to fit")
    a = [r.scaled_s / r.measured_median_s for r in runs]
    b = [(r.measured_median_s - r.fixed_s) / r.measured_median_s for r in runs]
    den = sum(x * x for x in a)
    if den <= 0:
        raise CalibrationError("the predictions hold no compute time: nothing for a compute factor to scale")
    x = sum(p * q for p, q in zip(a, b)) / den
    if x <= 0:
        raise CalibrationError(
            "the predicted communication alone exceeds the measured step times: a compute factor cannot explain "
            "these runs (check the cluster profile's link numbers)"
        )
    return 1.0 / x


def errors(runs: list[Run], factor: float) -> list[float]:
    """Signed relative error of each run's prediction at `factor` (predicted / measured median − 1)."""
    return [r.predict(factor) / r.measured_median_s - 1.0 for r in runs]


@dataclass(frozen=True)
class Fit:
    factor: float  # relative to the profile the runs were priced with
    compute_factor: float  # the written profile's [calibration].compute_factor (prior curves times this)
    rows: int  # post-warm-up steps used
    mean_error_before_pct: float
    mean_error_after_pct: float
    worst_error_after_pct: float
    clamped: bool  # some efficiency would exceed 1 and was held at 1: the written profile is slower than the fit


def fit(runs: list[Run], gpu: GPUProfile) -> Fit:
    """Check the runs against `gpu` and fit the factor; before/after errors over the runs, in percent."""
    check_profile(runs, gpu)
    f = fit_factor(runs)
    before, after = errors(runs, 1.0), errors(runs, f)
    base = gpu.calibration.compute_factor if gpu.calibration is not None else 1.0
    return Fit(
        factor=f,
        compute_factor=base * f,
        rows=sum(len(r.measured_s) for r in runs),
        mean_error_before_pct=100 * sum(map(abs, before)) / len(runs),
        mean_error_after_pct=100 * sum(map(abs, after)) / len(runs),
        worst_error_after_pct=100 * max(map(abs, after)),
        clamped=_scaled(gpu, f)[1],
    )


def _scaled(gpu: GPUProfile, factor: float) -> tuple[GPUProfile, bool]:
    """`gpu` with its curves (prior curves times the compute factor, when calibrated) and memory_bound_efficiency
    times `factor`, each held at 1; and whether any was held."""
    cal = gpu.calibration
    fused = gpu.fused_attention_curve
    curves = [
        (gpu.gemm_curve, cal.prior_gemm_fractions if cal else gpu.gemm_curve.fractions),
        (gpu.attention_curve, cal.prior_attention_fractions if cal else gpu.attention_curve.fractions),
    ]
    if fused is not None:
        curves.append((fused, cal.prior_fused_attention_fractions if cal else fused.fractions))
    base = cal.compute_factor if cal else 1.0
    raw = [[x * base * factor for x in prior] for _, prior in curves] + [[gpu.memory_bound_efficiency * factor]]
    new = [replace(c, fractions=tuple(round(min(1.0, x), 6) for x in r)) for (c, _), r in zip(curves, raw)]
    scaled = replace(
        gpu,
        gemm_curve=new[0],
        attention_curve=new[1],
        fused_attention_curve=new[2] if fused is not None else None,
        memory_bound_efficiency=round(min(1.0, raw[-1][0]), 6),
    )
    return scaled, any(x > 1.0 for r in raw for x in r)


def calibrated_profile(
    gpu: GPUProfile, result: Fit, sources: list[str], default_cluster: str | None = None
) -> GPUProfile:
    """The refitted profile: efficiencies times the fitted factor and a [calibration] table saying how
    (`sources`: the log files; `default_cluster`: the cluster reference as seen from where the file is written)."""
    cal = gpu.calibration
    scaled, _ = _scaled(gpu, result.factor)
    table = Calibration(
        status="fitted",
        method=f"mlm-calibrate {' '.join(sources)} --gpu {gpu.name}",
        fitted=(
            f"compute_factor on the GEMM and attention curves (and memory_bound_efficiency x {result.factor:.4f}), "
            f"least squares on the median step time of {len(sources)} log(s), {result.rows} steps after warm-up; "
            f"in-sample mean |error| {result.mean_error_before_pct:.1f}% before, {result.mean_error_after_pct:.1f}%"
            f" after (worst {result.worst_error_after_pct:.1f}%); no held-out rows"
        ),
        compute_factor=round(result.compute_factor, 6),
        prior_gemm_fractions=cal.prior_gemm_fractions if cal else gpu.gemm_curve.fractions,
        prior_attention_fractions=cal.prior_attention_fractions if cal else gpu.attention_curve.fractions,
        prior_fused_attention_fractions=cal.prior_fused_attention_fractions
        if cal
        else (gpu.fused_attention_curve.fractions if gpu.fused_attention_curve is not None else ()),
        prior_attention_source=cal.prior_attention_source if cal else "",
        sources=tuple(sources),
        train_rows=result.rows,
    )
    return dataclasses.replace(scaled, calibration=table, default_cluster=default_cluster or gpu.default_cluster)


def rebased_cluster(default_cluster: str, profile_path: Path | None, out_path: Path | None) -> str:
    """A GPU profile's default_cluster as seen from `out_path`: a relative .toml path is relative to the profile's
    own folder, so it is rewritten when the new profile lands elsewhere (preset names stay as they are)."""
    is_path = default_cluster.endswith(".toml") or "/" in default_cluster
    if not is_path or profile_path is None or Path(default_cluster).is_absolute():
        return default_cluster
    target = (profile_path.parent / default_cluster).resolve()
    if out_path is None:
        return str(target)
    return os.path.relpath(target, out_path.resolve().parent)
