"""Pipeline plans of stacks whose blocks differ: each block priced as itself versus the mean block.

Run: python benchmarks/bench_mixed_blocks.py

tests/models/mixed_stack.py (6 narrow-FFN, 6 wide-FFN, 4 windowed-attention blocks, d=2048) and a Gemma-like stack
(5 windowed : 1 global attention, 24 blocks) on A100-80GB. Each row: the search as it is (real per-block costs
in the stage MILP and its bounds) and the same search with the per-block tuples stripped from the MILP's
coefficients (what the planner did before: the mean block balanced, bounds from the mean). Both are scored by
the same cost model, which prices every block as itself, so the step times compare directly.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import mlm.planner.search.layouts as layouts
from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.hardware import resolve
from mlm.planner.search.layouts import PlanRequest, search

MODEL = str(Path(__file__).resolve().parents[1] / "tests" / "models" / "mixed_stack.py")
TUPLES = ("block_times_s", "block_recompute_extras_s", "block_statics_bytes", "block_acts_bytes")


def _mean_block(real):
    """stage_coefficients without the per-block tuples: the MILP and the bounds see the mean block only."""

    def stripped(*args, **kwargs):
        c = real(*args, **kwargs)
        return replace(c, **{name: () for name in (*TUPLES, "block_acts_recompute_bytes")})

    return stripped


def main() -> None:
    gpu, cluster = resolve("a100-80gb", None)
    models = [
        ("mixed_stack 6n+6w+4l", {}),
        ("gemma-like 20l+4g", dict(narrow=0, wide=0, local=0, pattern=24)),
    ]
    requests = [
        PlanRequest(num_gpus=32, global_batch=256, tp=1, pp=4),
        PlanRequest(num_gpus=32, global_batch=256, tp=2, pp=4),
        PlanRequest(num_gpus=64, global_batch=512, pp=8),
    ]
    real = layouts.stage_coefficients
    for label, args in models:
        ir = capture(load_model_spec(MODEL, "build_model", args), seq_len=2048)
        for request in requests:
            rows = []
            for how in ("per-block", "mean-block"):
                layouts.stage_coefficients = real if how == "per-block" else _mean_block(real)
                start = time.perf_counter()
                best = search(ir, request, gpu, cluster).best
                seconds = time.perf_counter() - start
                layouts.stage_coefficients = real
                split = best.assignment.blocks_per_stage if best.assignment else "balanced"
                rows.append((how, best.layout.describe(), best.evaluation.step_time_s, split, seconds))
            pins = f"tp={request.tp} pp={request.pp} gpus={request.num_gpus}"
            for how, layout, step, split, seconds in rows:
                print(f"{label:22s} {pins:22s} {how:10s} {step * 1e3:9.2f} ms  {layout}  {split}  ({seconds:.1f} s)")
            print(f"{'':46s} per-block / mean-block: {rows[0][2] / rows[1][2]:.4f}")


if __name__ == "__main__":
    main()
