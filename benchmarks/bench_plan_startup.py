"""End-to-end wall time of `mlm-plan MODEL --gpus N`: a first run (empty capture cache) and repeat runs (cache hit,
torch never imported), each in a fresh process as a user runs it.

python benchmarks/bench_plan_startup.py [MODEL] [--gpus N] [--repeats K]

Targets (issue 13): repeat run <= 2 s, first run <= 5 s on 2 cores for gpt3-175b --gpus 1024.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time


def run(model: str, gpus: int, cache: str) -> tuple[float, bool]:
    env = {**os.environ, "MLM_CACHE_DIR": cache}
    code = (
        "import sys, runpy; sys.argv = ['mlm-plan', *sys.argv[1:]]; "
        "from mlm.cli.plan import main; rc = main(sys.argv[1:]); "
        "print('TORCH_IMPORTED' if 'torch' in sys.modules else 'NO_TORCH', file=sys.stderr); sys.exit(rc)"
    )
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code, model, "--gpus", str(gpus), "--out", os.path.join(cache, "plan.json")],
        capture_output=True,
        text=True,
        env=env,
    )
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-2000:])
    return elapsed, "TORCH_IMPORTED" in proc.stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="gpt3-175b")
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        first, torch_first = run(args.model, args.gpus, cache)
        print(f"first run (capture):    {first:6.2f} s   torch imported: {torch_first}")
        for i in range(args.repeats):
            t, imported = run(args.model, args.gpus, cache)
            print(f"repeat run {i + 1} (cached):  {t:6.2f} s   torch imported: {imported}")


if __name__ == "__main__":
    main()
