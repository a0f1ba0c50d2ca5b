"""Does one source want a different attention-kernel efficiency than GEMM efficiency? A diagnostic for the
calibration (docs/calibration.md), not a fit that any profile uses.

For the rows of one measurement file, scale the GPU profile's prior GEMM curve by g and its prior attention curves
(SDPA's, and the fused kernel's that rows with attention "te" run) by a separately, over a grid, and print the pairs
that fit the file's train rows best with the held-out error at each. The profile fit (benchmarks/fit_profiles.py)
uses one factor for all of them; a stack whose kernels differ from the priors wants them apart.

    python benchmarks/kernel_factor_grid.py dgxc_benchmarking_h100.csv [--gemm 0.8,0.85,...] [--attention 0.72,1,...]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from mlm.planner.cost.calibration import RowEvaluator, read_measurements, table_path
from mlm.planner.cost.hardware import GPUProfile, load_gpu


def profile(gpu: GPUProfile, gemm: float, attention: float) -> GPUProfile:
    """The prior GEMM curve x gemm, both prior attention curves (SDPA's and the fused kernel's) x attention."""
    return replace(gpu.with_compute_factor(attention), gemm_curve=gpu.with_compute_factor(gemm).gemm_curve)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help="a CSV in profiles/calibration/")
    ap.add_argument("--gemm", default="0.7,0.75,0.8,0.85,0.9,0.95,1.0,1.05,1.1")
    ap.add_argument("--attention", default="0.72,1.0,1.3,1.6,2.0")
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    rows = read_measurements(table_path(args.file))
    gpu = load_gpu(rows[0].gpu)
    evaluator = RowEvaluator(rows, gpu.with_compute_factor(gpu.calibration.compute_factor if gpu.calibration else 1.0))
    results = []
    for g in (float(x) for x in args.gemm.split(",")):
        for a in (float(x) for x in args.attention.split(",")):
            preds = evaluator.predict(profile(gpu, g, a))
            train = [abs(p.error) for p in preds if p.measurement.split == "train"]
            test = [abs(p.error) for p in preds if p.measurement.split == "test"]
            if train and test:
                results.append((sum(train) / len(train), g, a, sum(test) / len(test), max(test)))
    print(f"{args.file} on {gpu.name}: prior curves x (gemm factor, attention factor), best train fits first")
    for train, g, a, mean, worst in sorted(results)[: args.top]:
        print(f"  gemm {g:.3f}  attention {a:.3f}  train mean {100 * train:5.1f}%  test mean {100 * mean:5.1f}%"
              f"  worst {100 * worst:5.1f}%")  # fmt: skip


if __name__ == "__main__":
    main()
