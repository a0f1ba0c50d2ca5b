"""Search speed and quality on Narayanan et al. 2021 Table 1.

Run: python benchmarks/bench_search.py [--rows N]

1. Speed: wall time of the whole `mlm-plan` command (new process: imports, capture, search, TP ILP, printing) for
   gpt3-175b on 1024 GPUs (target < 5 s) and megatron-1t on 3072 GPUs (target < 10 s).
2. Quality: for every row, the planner's free choice (model, GPU count, global batch, dgx-a100) against the
   paper's (tp, pp) pinned with everything else searched, both under the same cost model. The free choice must be
   no slower; rows where it chose differently are listed with the reason.
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import time

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.calibration import table_path
from mlm.planner.cost.hardware import resolve
from mlm.planner.search.explain import why_slower
from mlm.planner.search.layouts import PlanRequest, search

TABLE = table_path("megatron_2021_table1.csv")


def timed_cli(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mlm.cli.plan", *args, "--json"], check=True, capture_output=True)
    return time.perf_counter() - t0


def preset_name(params_b: str) -> str:
    return "megatron-1t" if params_b == "1008.0" else f"megatron-{params_b}b"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10)
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    if not args.skip_speed:
        for model, gpus, target in (("gpt3-175b", 1024, 5.0), ("megatron-1t", 3072, 10.0)):
            runs = [timed_cli([model, "--gpus", str(gpus)]) for _ in range(3)]
            print(
                f"speed  mlm-plan {model} --gpus {gpus}: best {min(runs):.2f} s, mean {sum(runs) / 3:.2f} s "
                f"(target < {target:.0f} s)"
            )
    gpu, cluster = resolve("a100-80gb", "dgx-a100")
    lines = [line for line in TABLE.read_text().splitlines() if not line.startswith("#")]
    print(
        f"\n{'model':>8} {'gpus':>5} {'paper tp,pp':>11} {'pinned s':>9} {'free layout':<42}{'free s':>8} {'gain':>6}"
    )
    worse = 0
    for row in list(csv.DictReader(lines))[: args.rows]:
        ir = capture(load_model_spec(preset_name(row["params_b"])))
        base = PlanRequest(num_gpus=int(row["gpus"]), global_batch=int(row["global_batch"]))
        pinned = search(
            ir,
            PlanRequest(num_gpus=base.num_gpus, global_batch=base.global_batch, tp=int(row["tp"]), pp=int(row["pp"])),
            gpu,
            cluster,
        ).best
        free = search(ir, base, gpu, cluster).best
        gain = pinned.evaluation.step_time_s / free.evaluation.step_time_s - 1
        worse += free.evaluation.step_time_s > pinned.evaluation.step_time_s * (1 + 1e-9)
        print(
            f"{row['params_b']:>8} {row['gpus']:>5} {row['tp'] + ',' + row['pp']:>11} "
            f"{pinned.evaluation.step_time_s:>9.2f} {free.layout.describe():<42}{free.evaluation.step_time_s:>8.2f}"
            f" {100 * gain:>5.1f}%"
        )
        if (free.layout.tp, free.layout.pp) != (int(row["tp"]), int(row["pp"])):
            print(f"{'':>9}differs from the paper's split; the paper's split is {why_slower(pinned, free)}")
    print(f"\nrows where the free search is slower than the paper's split: {worse}")


if __name__ == "__main__":
    main()
