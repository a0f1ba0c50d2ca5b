"""Capture time does not grow with depth: megatron-1.7b (24 layers) vs megatron-1t (128 layers, h=25600).

Run: python benchmarks/bench_capture.py [--repeat 3]
Prints instantiation-on-meta, graph capture and total seconds per model, and the process peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import time

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("models", nargs="*", default=["megatron-1.7b", "megatron-1t", "gpt3-175b", "llama3-405b"])
    args = parser.parse_args()
    capture(load_model_spec("gpt2"))  # warm up torch's lazy imports once, as a long-lived process would
    print(f"{'model':<16}{'params':>12}{'layers':>8}{'best s':>9}{'mean s':>9}  method")
    for name in args.models:
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            ir = capture(load_model_spec(name))
            times.append(time.perf_counter() - t0)
        print(
            f"{name:<16}{ir.num_params / 1e9:>11.1f}B{ir.num_layers:>8}{min(times):>9.2f}"
            f"{sum(times) / len(times):>9.2f}  {ir.capture_method}"
        )
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
