"""The GPU check of issue 11: plan a ~1.3B GPT for one GPU of a profile, train it with `mlm-run --log` in bf16, and
print the measured step time (median after warm-up) and torch.cuda.max_memory_allocated beside the plan's
predictions. One script, so that a GPU task spends its device minutes on the run, not on typing:

    python benchmarks/gpu_check.py --gpu h200                  # on the GPU machine (30 steps)
    python benchmarks/gpu_check.py --tiny --device cpu --steps 3 --gpu cpu-profile.json   # smoke test without a GPU

Predicted peak memory is shown without the profile's reserve (allocator fragmentation and the CUDA context are not
in max_memory_allocated), as `mlm-run --dry-run` compares it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

GPT_1B = {"n_layer": 24, "n_embd": 2048, "n_head": 16, "vocab_size": 50304, "block_size": 2048}
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "block_size": 64}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="h200", help="GPU profile the plan is priced for (name or file)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer GPT (smoke test of the script)")
    args = ap.parse_args()
    shape = TINY if args.tiny else GPT_1B
    seq = shape["block_size"]
    with tempfile.TemporaryDirectory() as tmp:
        plan, log = Path(tmp) / "plan.json", Path(tmp) / "run.jsonl"
        model_args = [x for k, v in shape.items() for x in ("--model-arg", f"{k}={v}")]
        cmd = [sys.executable, "-m", "mlm.cli.plan", "gpt2", *model_args, "--seq-len", str(seq)]
        cmd += ["--global-batch", str(args.global_batch), "--gpus", "1", "--gpu", args.gpu, "--out", str(plan)]
        subprocess.run(cmd, check=True)
        run = [sys.executable, "-m", "mlm.cli.run", str(plan), "--steps", str(args.steps), "--device", args.device]
        subprocess.run([*run, "--log", str(log)], check=True)
        doc = json.loads(plan.read_text())
        lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    steady = [x["step_time_s"] for x in lines[args.warmup :]] or [x["step_time_s"] for x in lines]
    measured = statistics.median(steady)
    predicted = doc["predicted"]["step_time_s"]
    reserve = sum(s["memory_by_category"].get("reserve", 0.0) for s in doc["stages"])
    want = doc["predicted"]["peak_memory_bytes"] - reserve
    peak = max((x["peak_memory_bytes"] or 0 for x in lines), default=0) or None
    print(f"layout: {doc['layout']}")
    off = (measured / predicted - 1) * 100
    print(f"step time: measured {measured * 1e3:.1f} ms (median of {len(steady)} steps), ", end="")
    print(f"predicted {predicted * 1e3:.1f} ms ({off:+.1f}%)")
    if peak is None:
        print(f"peak memory: not measured on {args.device}; predicted {want / 2**30:.2f} GiB without the reserve")
    else:
        off = (peak / want - 1) * 100
        print(f"peak memory: torch.cuda.max_memory_allocated {peak / 2**30:.2f} GiB, ", end="")
        print(f"predicted {want / 2**30:.2f} GiB without the reserve ({off:+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
