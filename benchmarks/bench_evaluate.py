"""Time one cost-model evaluation (target: under 1 ms per layout, so the search scores thousands per second).

python benchmarks/bench_evaluate.py [--model gpt3-175b] [--repeat 2000]
"""

from __future__ import annotations

import argparse
import time

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.hardware import resolve
from mlm.planner.cost.step_time import evaluate, stage_coefficients, summarize
from mlm.planner.layout import Layout

LAYOUTS = (
    Layout(tp=8, pp=8, dp=16, micro_batch=1, num_microbatches=96, vpp=1, recompute="full"),
    Layout(
        tp=8,
        pp=16,
        dp=8,
        micro_batch=1,
        num_microbatches=192,
        vpp=3,
        sequence_parallel=True,
        recompute="selective",
        zero=1,
    ),
    Layout(tp=4, pp=32, dp=8, micro_batch=2, num_microbatches=96, vpp=3, recompute="none", zero=3),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt3-175b")
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    gpu, cluster = resolve("a100-80gb", "dgx-a100")
    ir = capture(load_model_spec(args.model))
    start = time.perf_counter()
    inputs = summarize(ir)
    print(f"summarize: {1e3 * (time.perf_counter() - start):.2f} ms (once per model)")
    for layout in LAYOUTS:
        start = time.perf_counter()
        for _ in range(args.repeat):
            evaluate(inputs, layout, gpu, cluster)
        per = (time.perf_counter() - start) / args.repeat
        start = time.perf_counter()
        for _ in range(args.repeat):
            stage_coefficients(inputs, layout, gpu, cluster)
        coef = (time.perf_counter() - start) / args.repeat
        print(
            f"evaluate {layout.describe():<60} {1e6 * per:7.1f} µs/call  ({1 / per:,.0f}/s)   "
            f"stage_coefficients {1e6 * coef:5.1f} µs"
        )


if __name__ == "__main__":
    main()
