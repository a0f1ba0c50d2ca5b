"""mlm-run PLAN.json: train the plan's model with the plan's layout (thin: arguments, launch, print)."""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from rich.console import Console

from mlm.planner.errors import PlanError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mlm-run", description="Train a model with a plan made by mlm-plan.")
    p.add_argument("plan", type=Path, help="plan.json written by mlm-plan --out")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--data", type=Path, default=None, help="flat binary file of token ids (default: synthetic)")
    p.add_argument("--data-dtype", choices=("uint16", "uint32"), default="uint16")
    p.add_argument("--save", type=Path, default=None, help="checkpoint directory (written atomically)")
    p.add_argument("--save-every", type=int, default=0, help="also save every K steps")
    p.add_argument("--resume", type=Path, default=None, help="checkpoint directory to continue from")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--lr-decay-steps", type=int, default=None, help="cosine horizon (default: --steps)")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", type=Path, default=None, help="append one JSON line per step")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    console = Console(stderr=True)
    try:
        from mlm.runtime.launch import under_launcher

        if under_launcher():
            return _worker(args, console)
        return _parent(args, raw, console)
    except PlanError as e:
        if args.debug:
            traceback.print_exc()
        console.print(f"[bold red]mlm-run: error:[/] {e}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        return 130


def _options(args: argparse.Namespace, device: str):  # -> RunOptions
    from mlm.runtime.train import RunOptions

    return RunOptions(steps=args.steps, data=args.data, data_dtype=args.data_dtype, save=args.save,
                      save_every=args.save_every, resume=args.resume, device=device, optimizer=args.optimizer,
                      lr=args.lr, seed=args.seed, max_grad_norm=args.max_grad_norm, warmup_steps=args.warmup_steps,
                      lr_decay_steps=args.lr_decay_steps)


def _device(args: argparse.Namespace) -> str:
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _parent(args: argparse.Namespace, raw: list[str], console: Console) -> int:
    """Check everything that can be checked before starting processes, then launch (or explain how)."""
    import torch

    from mlm.planner.plan import load_plan
    from mlm.runtime.data import TokenSource
    from mlm.runtime.launch import cluster_commands, launch_local
    from mlm.runtime.model_build import load_checked_spec
    from mlm.runtime.train import check_plan_runnable

    plan = load_plan(args.plan)
    check_plan_runnable(plan)
    load_checked_spec(plan)
    TokenSource(plan.model.vocab_size, plan.training.seq_len, plan.training.global_batch, args.seed, args.data,
                args.data_dtype).check()
    device = _device(args)
    world = plan.layout.world_size
    if device == "cuda" and torch.cuda.device_count() < world:
        torchrun, sbatch = cluster_commands(world, plan.cluster.gpus_per_node, raw)
        console.print(f"mlm-run: the plan needs {world} GPUs; this machine has {torch.cuda.device_count()}. "
                      f"Launch it on the cluster:\n  on every node: {torchrun}\n  with SLURM:    {sbatch}",
                      highlight=False, soft_wrap=True)
        return 2
    if world == 1:
        from mlm.runtime.launch import init_single_process

        init_single_process(device)
        return _run(args, device, console)
    worker_argv = raw if args.device else [*raw, "--device", device]
    code = launch_local(world, worker_argv)
    return 0 if code == 0 else (2 if code == 2 else 1)


def _worker(args: argparse.Namespace, console: Console) -> int:
    from mlm.runtime.launch import init_distributed

    device = _device(args)
    init_distributed(device)
    return _run(args, device, console)


def _run(args: argparse.Namespace, device: str, console: Console) -> int:
    import torch.distributed as dist

    from mlm.planner.plan import load_plan
    from mlm.runtime.progress import StepReporter
    from mlm.runtime.train import run_steps, setup

    rank0 = dist.get_rank() == 0
    try:
        plan = load_plan(args.plan)
        rt = setup(plan, _options(args, device))
        if rank0:
            console.print(f"mlm-run: {plan.layout.describe()} on {dist.get_world_size()} process(es), {device}, "
                          f"schedule {plan.layout.schedule}, from step {rt.start_step}", highlight=False)
        with StepReporter(args.steps, rt.start_step, args.log if rank0 else None, show=rank0,
                          console=console) as report:
            run_steps(rt, report)
        if rank0 and rt.records:
            last = rt.records[-1]
            console.print(f"mlm-run: done, final loss {last.loss:.4f}"
                          + (f", checkpoint in {args.save}" if args.save else ""), highlight=False)
        return 0
    except PlanError as e:
        if args.debug:
            traceback.print_exc()
        if rank0:
            console.print(f"[bold red]mlm-run: error:[/] {e}", highlight=False, soft_wrap=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
