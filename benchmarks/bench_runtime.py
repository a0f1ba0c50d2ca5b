"""mlm-run's single-process step time beside a plain PyTorch loop on the same model, batch, micro-batches and
optimizer (a 4-layer GPT, 8 x 128 tokens in 4 micro-batches of 2, AdamW, gradient clipping), both on CPU fp32, one
thread, timed in process CPU time (wall time on a shared machine measures the other jobs). mlm-run's steps are timed
from one on_step callback to the next (everything the loop does, setup excluded; its first step is dropped).

The overhead is what the runtime adds to a hand-written gradient-accumulation loop (stage wrapper, the per-step
all-reduce of loss and flags, the global-norm computation, data slicing). Prints each run's median step and the best
median of each side over the rounds.

    python benchmarks/bench_runtime.py [--steps 12] [--warmup 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_runtime_harness import GPT_FILE, make_plan  # noqa: E402

from mlm.planner.capture.loader import load_model_spec  # noqa: E402
from mlm.planner.capture.training_step import TrainingModule  # noqa: E402
from mlm.runtime.data import TokenSource  # noqa: E402
from mlm.runtime.model_build import build_model  # noqa: E402
from mlm.runtime.optim import lr_factor  # noqa: E402
from mlm.runtime.train import RunOptions, train  # noqa: E402

SEQ, BATCH, MICRO = 128, 8, 4
ARGS = dict(n_layer=4, n_head=4, n_embd=256, vocab_size=2048, block_size=SEQ, dropout=0.0)


def plain_loop(opts: RunOptions) -> tuple[list[float], list[float]]:
    """The same training step written by hand: accumulate 4 micro-batch gradients, clip, AdamW."""
    spec = load_model_spec(str(GPT_FILE), "build_model", ARGS)
    step_fn = TrainingModule(build_model(spec, opts.seed))  # the same initial weights as mlm-run's
    params = list(step_fn.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95))
    source = TokenSource(vocab=ARGS["vocab_size"], seq_len=SEQ, global_batch=BATCH, seed=opts.seed)
    warmup = max(1, opts.steps // 10)
    times, losses = [], []
    for step in range(opts.steps):
        start = time.process_time()
        for g in opt.param_groups:
            g["lr"] = opts.lr * lr_factor(step, warmup, opts.steps)
        inputs, targets = source.batch(step, 0, 1, torch.device("cpu"))
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for inp, tgt in zip(inputs.chunk(MICRO), targets.chunk(MICRO)):
            loss = step_fn(inp, tgt)
            (loss / MICRO).backward()
            total += loss.item() / MICRO
        torch.nn.utils.clip_grad_norm_(params, opts.max_grad_norm)
        opt.step()
        times.append(time.process_time() - start)
        losses.append(total)
    return times, losses


def runtime_loop(opts: RunOptions) -> tuple[list[float], list[float]]:
    plan = make_plan("gpt", micro_batch=BATCH // MICRO, num_microbatches=MICRO, args=ARGS)
    plan = dataclasses.replace(
        plan,
        training=dataclasses.replace(plan.training, seq_len=SEQ),
        model=dataclasses.replace(plan.model, vocab_size=ARGS["vocab_size"], hidden_size=ARGS["n_embd"]),
    )
    marks = [time.process_time()]
    rt = train(plan, opts, on_step=lambda _record: marks.append(time.process_time()))
    return [b - a for a, b in zip(marks[1:], marks[2:])], [r.loss for r in rt.records][1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    torch.set_num_threads(1)  # CPU time per step on one thread: comparable on a machine shared with other jobs
    dist.init_process_group("gloo", rank=0, world_size=1)
    opts = RunOptions(steps=args.steps, optimizer="adamw", lr=3e-4, seed=0, max_grad_norm=1.0)
    results: dict[str, list[float]] = {"plain": [], "mlm-run": []}
    losses: dict[str, list[float]] = {}
    for _ in range(args.rounds):  # alternated, so load from other processes on the machine hits both alike
        for name, fn in (("plain", plain_loop), ("mlm-run", runtime_loop)):
            times, losses[name] = fn(opts)
            results[name].append(statistics.median(times[args.warmup :]))
            print(f"{name:8s} median step {results[name][-1] * 1e3:8.1f} ms", flush=True)
    worst = max(abs(a - b) for a, b in zip(losses["plain"][1:], losses["mlm-run"]))
    print(f"same computation: largest loss difference over {args.steps} steps {worst:.2e}")
    plain, ours = min(results["plain"]), min(results["mlm-run"])
    print(
        f"best of {args.rounds}: plain {plain * 1e3:.1f} ms, mlm-run {ours * 1e3:.1f} ms, "
        f"overhead {100 * (ours / plain - 1):+.1f}%"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
