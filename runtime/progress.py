"""Rank 0's view of training: a rich progress line per step and an optional JSON-lines log.

Each log line is the StepRecord plus what `mlm-calibrate` needs to refit the GPU profile from this run: the
layout, the profile the plan was priced for (name and fingerprint), the predicted step-time breakdown and the
predicted and measured peak memory (measured: torch.cuda.max_memory_allocated on CUDA, null elsewhere)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from mlm.planner.cost.fit import profile_fingerprint
from mlm.planner.plan import Plan
from mlm.runtime.train import StepRecord


def plan_fields(plan: Plan | None) -> dict[str, Any]:
    """The plan's side of a log line: layout, GPU profile, predicted breakdown and peak memory (null without one)."""
    if plan is None:
        return {}
    pred = plan.predicted
    gpu = plan.cluster.profile.get("gpu")
    return {
        "layout": dataclasses.asdict(plan.layout),
        "world_size": plan.layout.world_size,
        "gpu_profile": plan.cluster.gpu,
        "gpu_profile_sha256": profile_fingerprint(gpu) if isinstance(gpu, dict) else None,
        "predicted_breakdown": dict(pred.breakdown) if pred is not None else None,
        "predicted_peak_memory_bytes": pred.peak_memory_bytes if pred is not None else None,
    }


def peak_memory_bytes(device: torch.device | None) -> int | None:
    """This process's peak allocated device memory so far (CUDA only; None on CPU, where no allocator counts it)."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.max_memory_allocated(device))


class StepReporter:
    """Context manager; call it with each StepRecord. Shows step, loss, tokens/s, TFLOP/s per GPU, MFU (when the
    plan has a GPU profile) and the measured step time beside the plan's prediction. With `log`, appends one JSON
    line per step (see the module docstring); `plan` and `device` fill its plan and peak-memory fields."""

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        log: Path | None = None,
        show: bool = True,
        console: Console | None = None,
        plan: Plan | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.total, self.start = total_steps, start_step
        self.console = console or Console(stderr=True)
        self.log_path = log
        self.show = show
        self._log: IO[str] | None = None
        self._progress: Progress | None = None
        self._task = None
        self._static = plan_fields(plan)
        self.device = device

    def __enter__(self) -> StepReporter:
        if self.log_path is not None:
            self._log = open(self.log_path, "a")
        if self.show:
            self._progress = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self._progress.__enter__()
            self._task = self._progress.add_task("train", total=self.total, completed=self.start, stats="")
        return self

    def __call__(self, rec: StepRecord) -> None:
        if self._log is not None:
            line = {**dataclasses.asdict(rec), **self._static, "peak_memory_bytes": peak_memory_bytes(self.device)}
            self._log.write(json.dumps(line) + "\n")
            self._log.flush()
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=rec.step, stats=describe(rec))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.__exit__(exc_type, exc, tb)
        if self._log is not None:
            self._log.close()


def describe(rec: StepRecord) -> str:
    parts = [f"loss {rec.loss:.4f}", f"{rec.tokens_per_s:,.0f} tok/s", f"{rec.tflops_per_gpu:.2f} TFLOP/s/GPU"]
    if rec.mfu is not None:
        parts.append(f"MFU {100 * rec.mfu:.1f}%")
    step = f"{rec.step_time_s * 1e3:.0f} ms/step"
    if rec.predicted_step_time_s:
        step += f" (plan {rec.predicted_step_time_s * 1e3:.0f} ms)"
    parts.append(step)
    return " · ".join(parts)
