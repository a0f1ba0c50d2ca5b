"""What-if arithmetic: time and cost to train on T tokens, Narayanan et al. 2021 Eq. 4, sweep parsing.

Pure functions on numbers and frozen dataclasses; the searches that produce the numbers live in
planner/whatif/questions.py, the integer searches (deadline, largest model) in planner/whatif/integer_search.py.

Time to train: steps = ceil(T / tokens_per_step), time = steps · step_time (the steady-state step the cost model
predicts: no restarts, evaluation, checkpoint stalls or data-loading stalls). GPU-hours = N · time / 3600;
cost = GPU-hours · price per GPU-hour (the GPU profile's `usd_per_gpu_hour`, or the user's).

Eq. 4 (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"):
end-to-end time ≈ 8·T·P / (n·X), X the achieved FLOP/s per GPU counted with activation recomputation (one extra
forward pass: 2 + 4 + 2 = 8 FLOPs per parameter and token). mlm counts model FLOPs (no recompute, DESIGN.md), so
the same estimate in mlm's accounting is 6·T·P / (n·X_model); `eq4_seconds` takes the factor explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlm.planner.errors import PlanError

SECONDS_PER_DAY = 86400.0
EQ4_FLOPS_PER_PARAM_TOKEN = 8.0  # the paper's count, activation recomputation included
MODEL_FLOPS_PER_PARAM_TOKEN = 6.0  # forward + backward, as mlm's MFU counts them
SWEEP_KEYS = ("gpus", "gpu", "global_batch")


@dataclass(frozen=True)
class Price:
    """A price per GPU-hour and where it came from (None: no price known)."""

    usd_per_gpu_hour: float | None
    source: str


@dataclass(frozen=True)
class TrainingTime:
    """How long T tokens take at a predicted step time, and what it costs."""

    tokens: float
    tokens_per_step: int
    steps: int
    seconds: float
    num_gpus: int
    usd_per_gpu_hour: float | None

    @property
    def days(self) -> float:
        return self.seconds / SECONDS_PER_DAY

    @property
    def gpu_hours(self) -> float:
        return self.num_gpus * self.seconds / 3600.0

    @property
    def cost_usd(self) -> float | None:
        return None if self.usd_per_gpu_hour is None else self.gpu_hours * self.usd_per_gpu_hour

    def to_dict(self) -> dict[str, float | int | None]:
        return {
            "tokens": self.tokens,
            "tokens_per_step": self.tokens_per_step,
            "steps": self.steps,
            "seconds": self.seconds,
            "days": self.days,
            "gpu_hours": self.gpu_hours,
            "usd_per_gpu_hour": self.usd_per_gpu_hour,
            "cost_usd": self.cost_usd,
        }


@dataclass(frozen=True)
class SweepSpec:
    """`--sweep key=v1,v2,...`: which request field varies and its values (ints for gpus/global_batch)."""

    key: str
    values: tuple[str | int, ...]


def check_tokens(tokens: float) -> float:
    if not math.isfinite(tokens) or tokens <= 0:
        raise PlanError(f"--tokens must be a positive number of tokens (e.g. 300e9), got {tokens:g}")
    return tokens


def training_time(
    tokens: float,
    global_batch: int,
    seq_len: int,
    step_time_s: float,
    num_gpus: int,
    usd_per_gpu_hour: float | None = None,
) -> TrainingTime:
    """Whole steps of global_batch·seq_len tokens until `tokens` are seen, at `step_time_s` each."""
    check_tokens(tokens)
    assert global_batch >= 1 and seq_len >= 1 and step_time_s > 0 and num_gpus >= 1
    per_step = global_batch * seq_len
    steps = math.ceil(tokens / per_step)
    return TrainingTime(
        tokens=tokens,
        tokens_per_step=per_step,
        steps=steps,
        seconds=steps * step_time_s,
        num_gpus=num_gpus,
        usd_per_gpu_hour=usd_per_gpu_hour,
    )


def required_tokens_per_s(tokens: float, days: float) -> float:
    """The throughput that sees `tokens` within `days`."""
    check_tokens(tokens)
    if not math.isfinite(days) or days <= 0:
        raise PlanError(f"--days must be a positive number of days, got {days:g}")
    return tokens / (days * SECONDS_PER_DAY)


def eq4_seconds(
    tokens: float,
    params: float,
    num_gpus: int,
    tflops_per_gpu: float,
    flops_per_param_token: float = EQ4_FLOPS_PER_PARAM_TOKEN,
) -> float:
    """Narayanan et al. 2021 Eq. 4: c·T·P / (n·X) seconds, X in TFLOP/s per GPU (c = 8 in the paper)."""
    assert tokens > 0 and params > 0 and num_gpus >= 1 and tflops_per_gpu > 0
    return flops_per_param_token * tokens * params / (num_gpus * tflops_per_gpu * 1e12)


def resolve_price(profile_name: str, profile_usd_per_gpu_hour: float, override: float | None) -> Price:
    """The user's price if given, else the GPU profile's (0 in a profile means unknown)."""
    if override is not None:
        if not math.isfinite(override) or override < 0:
            raise PlanError(f"--usd-per-gpu-hour must be >= 0, got {override:g}")
        return Price(override, "--usd-per-gpu-hour")
    if profile_usd_per_gpu_hour > 0:
        return Price(
            profile_usd_per_gpu_hour,
            f"GPU profile {profile_name} (usd_per_gpu_hour, a rough on-demand "
            "list price; override with --usd-per-gpu-hour)",
        )
    return Price(None, f"GPU profile {profile_name} has no price; pass --usd-per-gpu-hour for costs")


def parse_sweep(text: str) -> SweepSpec:
    """Parse `gpus=64,128`, `gpu=a100-80gb,h100-sxm` or `global_batch=512,1024` (also `global-batch=`)."""
    key, sep, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or key not in SWEEP_KEYS:
        raise PlanError(f"--sweep {text!r}: expected KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}")
    items = [v.strip() for v in raw.split(",") if v.strip()]
    if not items:
        raise PlanError(f"--sweep {text!r} lists no values")
    if key == "gpu":
        values: tuple[str | int, ...] = tuple(dict.fromkeys(items))
    else:
        try:
            ints = [int(float(v)) if float(v).is_integer() else None for v in items]
        except ValueError:
            raise PlanError(f"--sweep {key}= needs whole numbers, got {raw!r}") from None
        if any(v is None or v < 1 for v in ints):
            raise PlanError(f"--sweep {key}= needs positive whole numbers, got {raw!r}")
        values = tuple(dict.fromkeys(v for v in ints if v is not None))
    return SweepSpec(key, values)


def parse_count(text: str) -> float:
    """A token count such as 300e9, 1.5T, 450B, 15e12 (K/M/B/G/T suffixes)."""
    raw = text.strip().replace("_", "").replace(",", "")
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(raw[-1:].lower(), 1.0)
    try:
        value = float(raw[:-1] if scale != 1.0 else raw) * scale
    except ValueError:
        raise PlanError(f"not a token count: {text!r} (examples: 300e9, 450B, 15T)") from None
    return check_tokens(value)
