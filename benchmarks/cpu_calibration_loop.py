"""The calibration loop on this CPU: measure the machine, plan six layouts of a small GPT with its profile, run
each with `mlm-run --log`, refit the profile with `mlm-calibrate` on three runs and report the other three.

Steps: `mlm-profile --quick` (the CPU profile and its gloo cluster profile); `mlm-plan` of a 4-layer GPT-2 shape
for 2 processes with every layout flag pinned, for dp, tp, pp, interleaved pp, full recompute and ZeRO-3;
`mlm-run PLAN --steps N --log RUN.jsonl` (CPU, gloo, one thread per process); `mlm-calibrate` on the dp, pp and
recompute runs; re-plan all six with the refitted profile. Prints predicted vs measured (median step after the
first) before and after, the held-out error, and whether the predicted ranking of the six layouts matches the
measured one (Kendall's tau). Step times are wall time: on a shared machine they include the other jobs' load.

    python benchmarks/cpu_calibration_loop.py [--steps 6] [--workdir DIR] [--width 128] [--seq 128]

--width / --seq set the GPT's hidden size (heads of 32) and sequence length: at the default 128 x 128 a GEMM takes
microseconds and the frameworks' per-call costs (FSDP2 hooks, DTensor dispatch, gloo hand-offs), which the cost
model does not price, dominate the tp and ZeRO-3 steps; at 512 x 256 compute dominates, as on the GPUs mlm plans for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from itertools import combinations
from pathlib import Path

MODEL = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 1024}
SEQ, BATCH, WORLD = 128, 8, 2
HEAD_WIDTH = 32
LAYOUTS = {  # name: pinned mlm-plan flags (2 processes, global batch 8)
    "dp": dict(tp=1, pp=1, dp=2, micro_batch=2, vpp=1, recompute="none", zero=0),
    "tp": dict(tp=2, pp=1, dp=1, micro_batch=4, vpp=1, recompute="none", zero=0),
    "pp": dict(tp=1, pp=2, dp=1, micro_batch=2, vpp=1, recompute="none", zero=0),
    "interleaved": dict(tp=1, pp=2, dp=1, micro_batch=2, vpp=2, recompute="none", zero=0),
    "recompute": dict(tp=1, pp=1, dp=2, micro_batch=2, vpp=1, recompute="full", zero=0),
    "zero3": dict(tp=1, pp=1, dp=2, micro_batch=2, vpp=1, recompute="none", zero=3),
}
TRAIN = ("dp", "pp", "recompute")


def _mlm(module: str, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", f"mlm.cli.{module}", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"mlm.cli.{module} {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc


def plan(name: str, gpu: Path, out: Path, env: dict[str, str], model: dict[str, int], seq: int) -> float:
    """Plan one pinned layout with `gpu`; its predicted step time."""
    argv = ["gpt2", "--seq-len", str(seq), "--gpus", str(WORLD), "--global-batch", str(BATCH), "--gpu", str(gpu)]
    for k, v in model.items():
        argv += ["--model-arg", f"{k}={v}"]
    for k, v in LAYOUTS[name].items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    _mlm("plan", *argv, "--no-sequence-parallel", "--out", str(out), env=env)
    return json.loads(out.read_text())["predicted"]["step_time_s"]


def measured(log: Path) -> float:
    """Median step time after the first (warm-up) step."""
    times = [json.loads(line)["step_time_s"] for line in log.read_text().splitlines()]
    return statistics.median(times[1:])


def kendall_tau(a: list[float], b: list[float]) -> float:
    pairs = list(combinations(range(len(a)), 2))
    s = sum((1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1) for i, j in pairs)
    return s / len(pairs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--width", type=int, default=MODEL["n_embd"], help="hidden size (heads of 32)")
    p.add_argument("--seq", type=int, default=SEQ, help="sequence length")
    args = p.parse_args()
    model = {**MODEL, "n_embd": args.width, "n_head": args.width // HEAD_WIDTH, "block_size": max(args.seq, 1024)}
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mlm-cal-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLM_CACHE_DIR": str(work / "cache")}
    cpu = work / "cpu.toml"
    _mlm("profile", "--quick", "--device", "cpu", "--out", str(cpu), env=env)
    before, meas = {}, {}
    for name in LAYOUTS:
        before[name] = plan(name, cpu, work / f"{name}.json", env, model, args.seq)
        log = work / f"{name}.jsonl"
        log.unlink(missing_ok=True)
        _mlm("run", str(work / f"{name}.json"), "--steps", str(args.steps), "--device", "cpu", "--log", str(log),
             env=env)  # fmt: skip
        meas[name] = measured(log)
        bd = json.loads((work / f"{name}.json").read_text())["predicted"]["breakdown"]
        terms = " ".join(f"{k[:-2]} {v * 1e3:.1f}" for k, v in bd.items() if v > 0)
        print(f"{name:12s} predicted {before[name] * 1e3:8.1f} ms  measured {meas[name] * 1e3:8.1f} ms  ({terms} ms)",
              flush=True)  # fmt: skip
    refit = work / "cpu-refit.toml"
    cal = _mlm("calibrate", *(str(work / f"{n}.jsonl") for n in TRAIN), "--gpu", str(cpu), "--out", str(refit), env=env)
    print(cal.stderr.strip().splitlines()[-3] if cal.stderr else "")
    after = {name: plan(name, refit, work / f"{name}-refit.json", env, model, args.seq) for name in LAYOUTS}
    shape = f"GPT {model['n_layer']} layers x {args.width} wide, seq {args.seq}"
    print(f"\n{shape}; fit on {', '.join(TRAIN)}; work dir {work}")
    print(f"{'layout':12s} {'split':6s} {'measured':>10s} {'before':>10s} {'err':>8s} {'after':>10s} {'err':>8s}")
    for name in LAYOUTS:
        m, b, a = meas[name], before[name], after[name]
        split = "train" if name in TRAIN else "test"
        print(
            f"{name:12s} {split:6s} {m * 1e3:8.1f}ms {b * 1e3:8.1f}ms {100 * (b / m - 1):+7.1f}% "
            f"{a * 1e3:8.1f}ms {100 * (a / m - 1):+7.1f}%"
        )
    test = [n for n in LAYOUTS if n not in TRAIN]
    for label, pred in (("before", before), ("after", after)):
        errs = [abs(pred[n] / meas[n] - 1) for n in test]
        print(f"held-out {label}: mean |error| {100 * statistics.mean(errs):.1f}%, worst {100 * max(errs):.1f}%")
    names = list(LAYOUTS)
    rank = lambda d: sorted(names, key=d.__getitem__)  # noqa: E731
    tau = kendall_tau([meas[n] for n in names], [after[n] for n in names])
    print(f"measured ranking  (fastest first): {', '.join(rank(meas))}")
    print(f"predicted ranking (after refit):   {', '.join(rank(after))}  Kendall tau {tau:+.2f}")
    tau_b = kendall_tau([meas[n] for n in names], [before[n] for n in names])
    print(f"predicted ranking (before):        {', '.join(rank(before))}  Kendall tau {tau_b:+.2f}")


if __name__ == "__main__":
    main()
