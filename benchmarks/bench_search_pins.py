"""The free search against the best of every pinned (tp, pp) on large cases, under the same cost model.

Run: python benchmarks/bench_search_pins.py [--quick]

For each case: the free search's layout, step time and search seconds; then every runnable (tp, pp) pinned with
everything else searched. A pin only removes candidates, so with valid pruning no pinned row may be faster than the
free one (flagged BEATS FREE). tests/test_search_optimality.py runs a small subset of this.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.hardware import resolve
from mlm.planner.errors import PlanError
from mlm.planner.search.layouts import PlanRequest, _divisors, _tp_options, search

CASES = [
    # model, seq_len, gpus, gpu, global batch
    ("llama3-405b", 8192, 16384, "h100-sxm", 2048),
    ("gpt3-175b", None, 1024, "a100-80gb", 1536),
    ("llama3-70b", 8192, 1024, "h100-sxm", 1024),
    ("megatron-1t", None, 3072, "a100-80gb", 3072),
]


def run_case(name: str, seq: int | None, gpus: int, gpu_name: str, batch: int) -> int:
    ir = capture(load_model_spec(name), seq_len=seq)
    gpu, cluster = resolve(gpu_name, None)
    request = PlanRequest(num_gpus=gpus, global_batch=batch)
    t0 = time.perf_counter()
    free = search(ir, request, gpu, cluster)
    best = free.best.evaluation.step_time_s
    print(
        f"{name} on {gpus} x {gpu_name}, batch {batch}: free {free.best.layout.describe()} {best:.3f} s/step "
        f"(search {time.perf_counter() - t0:.1f} s, {free.milp_solves} MILPs)"
    )
    for note in free.notes:
        print(f"  warning: {note}")
    beaten = 0
    for tp in _tp_options(ir, request, cluster):
        for pp in _divisors(gpus // tp):
            if pp > ir.num_layers:
                continue
            t0 = time.perf_counter()
            try:
                res = search(ir, replace(request, tp=tp, pp=pp), gpu, cluster)
            except PlanError:
                continue
            step = res.best.evaluation.step_time_s
            flag = "  <<< BEATS FREE" if step < best * (1 - 1e-9) else ""
            beaten += bool(flag)
            print(
                f"  tp{tp:<2} pp{pp:<3} {res.best.layout.describe():64s} {step:8.3f} s "
                f"({time.perf_counter() - t0:.1f} s){flag}"
            )
    return beaten


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first case")
    args = parser.parse_args()
    beaten = sum(run_case(*case) for case in (CASES[:1] if args.quick else CASES))
    print(f"pinned searches faster than the free one: {beaten}")


if __name__ == "__main__":
    main()
