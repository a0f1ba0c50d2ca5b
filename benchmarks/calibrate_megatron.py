"""Print predicted vs published TFLOP/s per GPU for Narayanan et al. 2021 Table 1 (see mlm.planner.cost.calibration).

python benchmarks/calibrate_megatron.py [--csv PATH] [--gpu a100-80gb] [--cluster dgx-a100]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from mlm.planner.cost.calibration import calibrate, table_path
from mlm.planner.cost.hardware import resolve

DEFAULT_CSV = table_path("megatron_2021_table1.csv")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--gpu", default="a100-80gb")
    ap.add_argument("--cluster", default="dgx-a100")
    args = ap.parse_args()
    gpu, cluster = resolve(args.gpu, args.cluster)
    start = time.perf_counter()
    rows = calibrate(args.csv, gpu, cluster)
    print(
        f"{'params':>8} {'tp':>3} {'pp':>3} {'dp':>4} {'mb':>3} {'vpp':>3} {'published':>9} {'predicted':>9} "
        f"{'error':>7}  {'mem GiB':>7}  breakdown (s)"
    )
    for r in rows:
        lo, ev = r.layout, r.evaluation
        bd = " ".join(f"{k.removesuffix('_s')}={v:.2f}" for k, v in ev.breakdown.items())
        print(
            f"{r.params_b:>7.1f}B {lo.tp:>3} {lo.pp:>3} {lo.dp:>4} {lo.micro_batch:>3} {lo.vpp:>3} "
            f"{r.published_tflops:>9.1f} {r.predicted_tflops:>9.1f} {100 * r.error:>+6.1f}%  "
            f"{ev.peak_memory_bytes / 2**30:>7.1f}  {bd}"
        )
    errors = [abs(r.error) for r in rows]
    print(
        f"mean |error| {100 * statistics.mean(errors):.2f}%   worst {100 * max(errors):.2f}%   "
        f"({len(rows)} rows, {time.perf_counter() - start:.1f} s)"
    )


if __name__ == "__main__":
    main()
