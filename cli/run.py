"""mlm-run PLAN.json: train the plan's model with the plan's layout (thin: arguments, launch, print).

How runs end (runtime/faults.py has the mechanics): 0 done or preempted (SIGTERM / Ctrl-C: the step finishes and a
checkpoint is saved), 2 bad input or a non-finite step, 1 a rank died or a bug; each with one line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from mlm.planner.errors import PlanError

if TYPE_CHECKING:  # the runtime (and torch) load only when a run starts
    from mlm.runtime.faults import StopRequest
    from mlm.runtime.train import RunOptions


def _nonneg(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _finite(text: str) -> float:
    import math

    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _rank_list(text: str) -> list[int]:
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated pipeline ranks like 0,3, got {text!r}") from None
    if not ranks or any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"expected comma-separated pipeline ranks like 0,3, got {text!r}")
    return sorted(set(ranks))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mlm-run", description="Train a model with a plan made by mlm-plan.")
    p.add_argument("plan", type=Path, help="plan.json written by mlm-plan --out")
    p.add_argument("--steps", type=_positive, default=10)
    p.add_argument("--data", type=Path, default=None, help="flat binary file of token ids (default: synthetic)")
    p.add_argument("--data-dtype", choices=("uint16", "uint32"), default="uint16")
    p.add_argument("--save", type=Path, default=None, help="checkpoint directory (written atomically)")
    p.add_argument("--save-every", type=_nonneg, default=0, help="also save every K steps")
    p.add_argument("--resume", type=Path, default=None, help="checkpoint directory to continue from")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--lr", type=_finite, default=3e-4)
    p.add_argument("--warmup-steps", type=_nonneg, default=None)
    p.add_argument("--lr-decay-steps", type=_positive, default=None, help="cosine horizon (default: --steps)")
    p.add_argument("--max-grad-norm", type=_finite, default=1.0)
    p.add_argument("--seed", type=_nonneg, default=0)
    p.add_argument(
        "--log",
        type=Path,
        default=None,
        help="append one JSON line per step (measured and predicted step time, breakdown, layout, "
        "GPU profile, peak memory): the input of mlm-calibrate",
    )
    p.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="drop the update of a step with a NaN / infinite loss or gradient (and count it) instead of "
        "stopping with exit 2",
    )
    p.add_argument(
        "--max-restarts",
        type=_nonneg,
        default=0,
        help="restart failed workers up to N times (torchrun's elastic agent); each restart continues "
        "from the latest checkpoint in --save",
    )
    p.add_argument(
        "--simulate-locally",
        action="store_true",
        help="start all of the plan's processes on this machine's CPU even when it cannot host them (more ranks "
        "than GPUs or cores, or more memory than it has by the plan's prediction); without it such a plan is "
        "refused with the torchrun and sbatch lines for the cluster",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="run one training step of every pipeline rank's role at the plan's full size on this CPU without "
        "allocating (fake tensors, fake process group) and print measured peak memory by category and "
        "collectives per step beside the plan's prediction",
    )
    p.add_argument("--json", action="store_true", help="with --dry-run: print one JSON document on stdout")
    p.add_argument(
        "--pp-ranks",
        type=_rank_list,
        default=None,
        help="with --dry-run: only these pipeline ranks, e.g. 0,63 (default: every pipeline rank; each takes "
        "seconds to a minute at full size)",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    console = Console(stderr=True)
    try:
        from mlm.runtime.launch import under_launcher

        if args.dry_run:
            return _dry_run(args, console)
        if args.json or args.pp_ranks is not None:
            raise PlanError("--json and --pp-ranks need --dry-run")
        if under_launcher():
            return _worker(args, console)
        return _parent(args, raw, console)
    except PlanError as e:
        if args.debug:
            traceback.print_exc()
        console.print(f"[bold red]mlm-run: error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print("mlm-run: interrupted", highlight=False)
        return 130
    except Exception as e:  # a bug in mlm: one line (traceback with --debug)
        if args.debug:
            traceback.print_exc()
        console.print(
            f"[bold red]mlm-run: internal error:[/] {type(e).__name__}: {escape(str(e))} (rerun with "
            "--debug for the traceback)",
            highlight=False,
            soft_wrap=True,
        )
        return 1


def _dry_run(args: argparse.Namespace, console: Console) -> int:
    import dataclasses

    from mlm.cli.dry_run_output import dry_run_command
    from mlm.planner.plan import load_plan
    from mlm.runtime.dry_run import dry_run_options

    plan = load_plan(args.plan)
    # the program the plan priced: its compute dtype (bf16 emulates a GPU), replicate() where DDP would run
    base = dry_run_options(plan)
    opts = dataclasses.replace(_options(args, "cpu", None), compute_dtype=base.compute_dtype, allow_ddp=base.allow_ddp)
    if args.pp_ranks is not None and max(args.pp_ranks) >= plan.layout.pp:
        raise PlanError(f"--pp-ranks {max(args.pp_ranks)}: the plan has pipeline ranks 0..{plan.layout.pp - 1}")
    return dry_run_command(plan, opts, args.json, console, Console(), args.pp_ranks)


def _options(args: argparse.Namespace, device: str, resume: Path | None) -> RunOptions:
    from mlm.runtime.train import RunOptions

    return RunOptions(
        steps=args.steps,
        data=args.data,
        data_dtype=args.data_dtype,
        save=args.save,
        save_every=args.save_every,
        resume=resume,
        device=device,
        optimizer=args.optimizer,
        lr=args.lr,
        seed=args.seed,
        max_grad_norm=args.max_grad_norm,
        warmup_steps=args.warmup_steps,
        lr_decay_steps=args.lr_decay_steps,
        skip_nonfinite=args.skip_nonfinite,
    )


def _device(args: argparse.Namespace) -> str:
    import torch

    return args.device or ("cuda" if torch.cuda.is_available() else "cpu")


def _parent(args: argparse.Namespace, raw: list[str], console: Console) -> int:
    """Check everything that can be checked before starting processes, then launch (or explain how)."""
    from mlm.planner.plan import load_plan
    from mlm.runtime.data import data_source
    from mlm.runtime.launch import check_host
    from mlm.runtime.model_build import load_checked_spec
    from mlm.runtime.train import check_plan_runnable

    if args.max_restarts and args.save is None:
        raise PlanError("--max-restarts needs --save DIR: restarted workers continue from its latest checkpoint")
    plan = load_plan(args.plan)
    check_plan_runnable(plan)
    device = _device(args)
    if not args.simulate_locally:
        check_host(plan, device, raw)  # before anything slow: a plan this machine cannot host exits 2 at once
    spec = load_checked_spec(plan)
    data_source(plan, spec, args.seed, args.data, args.data_dtype).check()
    if args.resume is not None:
        from mlm.runtime.checkpoint import read_meta

        read_meta(args.resume)  # a clear error now rather than from every rank
    world = plan.layout.world_size
    if world == 1 and not args.max_restarts:
        from mlm.runtime.launch import init_single_process

        init_single_process(device)
        return _run(args, device, console)
    worker_argv = raw if args.device else [*raw, "--device", device]
    return _launch(args, world, worker_argv, console)


def _launch(args: argparse.Namespace, world: int, worker_argv: list[str], console: Console) -> int:
    """Start the workers through torchrun and turn how they ended into one line and an exit code."""
    import signal as _signal

    from mlm.runtime.launch import STATE_ENV, launch_local, read_notes

    state = tempfile.mkdtemp(prefix="mlm-run-")
    os.environ[STATE_ENV] = state
    try:
        result = launch_local(world, worker_argv, args.max_restarts)
        notes = read_notes(state)
    finally:
        os.environ.pop(STATE_ENV, None)
        shutil.rmtree(state, ignore_errors=True)
    if result.code == 0:
        return 0
    if result.signal is not None:  # the launcher itself got SIGTERM / SIGINT and forwarded it to the workers
        note = notes.get(0, {})
        if note.get("kind") == "stopped":
            return 0  # rank 0 has said where it saved
        console.print(
            escape(
                f"mlm-run: stopped by {result.signal} before the workers could finish their step"
                f"{_last_checkpoint(args)}"
            ),
            highlight=False,
            soft_wrap=True,
        )
        return 1
    if result.code == 2 or any(n.get("kind") == "bad-input" for n in notes.values()):
        return 2  # rank 0 printed the one line
    died = {r: f for r, f in result.failures.items() if f[0] < 0}
    culprits = died or {r: f for r, f in result.failures.items() if notes.get(r, {}).get("kind") != "peer-lost"}
    culprits = culprits or result.failures
    parts = []
    for rank, (code, pid) in sorted(culprits.items()):
        if code < 0:
            try:
                how = f"was killed by {_signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}" + (f" ({notes[rank]['message']})" if rank in notes else "")
        parts.append(f"rank {rank} (pid {pid}) {how}")
    others = sorted(set(result.failures) - set(culprits))
    tail = (
        f"; {'rank' if len(others) == 1 else 'ranks'} {', '.join(map(str, others))} stopped after losing contact"
        if others
        else ""
    )
    restarts = f" after {args.max_restarts} restart(s)" if args.max_restarts else ""
    console.print(
        f"[bold red]mlm-run: error:[/] {escape('; '.join(parts) + tail + restarts + _last_checkpoint(args))}",
        highlight=False,
        soft_wrap=True,
    )
    return 1


def _last_checkpoint(args: argparse.Namespace) -> str:
    if args.save is None:
        return "; nothing was saved (no --save)"
    from mlm.runtime.checkpoint import CheckpointError, latest_step

    try:
        step = latest_step(args.save)
    except CheckpointError:
        step = None
    if step is None:
        return f"; no checkpoint was written to {args.save} yet"
    return f"; the last checkpoint (step {step}) is intact in {args.save}: continue with --resume {args.save}"


def _worker(args: argparse.Namespace, console: Console) -> int:
    from mlm.runtime.launch import STATE_ENV, die_with_launcher, init_distributed, restart_count

    die_with_launcher()  # the kernel ends this worker if the launching agent dies, even by SIGKILL

    state = os.environ.get(STATE_ENV)
    if restart_count() > 0 and state and (Path(state) / "bad-input").is_file():
        return 2  # a deterministic error: restarting cannot help
    device = _device(args)
    from mlm.runtime.faults import StopRequest

    stop = StopRequest().install()  # before init: a signal during setup stops after the first step
    try:
        init_distributed(device)
        return _run(args, device, console, stop)
    finally:
        stop.uninstall()


def _run(args: argparse.Namespace, device: str, console: Console, stop: StopRequest | None = None) -> int:
    import torch
    import torch.distributed as dist

    from mlm.planner.plan import load_plan
    from mlm.runtime import checkpoint as ckpt
    from mlm.runtime.faults import StopRequest, is_peer_loss
    from mlm.runtime.launch import STATE_ENV, restart_count, write_note
    from mlm.runtime.progress import StepReporter
    from mlm.runtime.train import compute_dtype, run_steps, setup

    rank = dist.get_rank()
    rank0 = rank == 0
    own_stop = stop is None
    stop = StopRequest().install() if own_stop else stop
    try:
        plan = load_plan(args.plan)
        resume = args.resume
        restart = restart_count()
        if restart and args.save is not None and ckpt.latest_step(args.save) is not None:
            resume = args.save  # restarted by torchrun's agent: continue from the latest checkpoint
        opts = _options(args, device, resume)
        rt = setup(plan, opts)
        rt.stop = stop
        if rank0:
            again = f" (restart {restart}, from the checkpoint in {resume})" if restart and resume else ""
            console.print(
                f"mlm-run: {plan.layout.describe()} on {dist.get_world_size()} process(es), {device}, "
                f"schedule {plan.layout.schedule}, from step {rt.start_step}{again}",
                highlight=False,
            )
            ran = compute_dtype(plan, opts, rt.device)
            if plan.training.dtype == "bf16" and ran == torch.float32:
                console.print(
                    "mlm-run: note: computing in fp32 (exact parity with one process on CPU); plan.json priced bf16, "
                    "so activations and tensor/pipeline/data-parallel traffic are twice its prediction",
                    highlight=False,
                )
        log = args.log if rank0 else None
        with StepReporter(
            args.steps, rt.start_step, log, show=rank0, console=console, plan=plan, device=rt.device
        ) as report:
            run_steps(rt, report)
        last = rt.records[-1] if rt.records else None
        skipped = f", {len(rt.skipped)} non-finite step(s) skipped: {rt.skipped}" if rt.skipped else ""
        if rt.stopped_by is not None:
            step = last.step if last else rt.start_step
            where = (
                f"checkpoint of step {rt.saved_step} saved in {args.save}; continue with --resume {args.save}"
                if rt.saved_step is not None
                else "nothing saved (no --save)"
            )
            if rank0:
                console.print(
                    escape(f"mlm-run: stopped by {rt.stopped_by} after step {step}: {where}{skipped}"),
                    highlight=False,
                    soft_wrap=True,
                )
            write_note("stopped", where, step=step, saved=rt.saved_step)
        elif rank0 and last is not None:
            console.print(
                escape(
                    f"mlm-run: done, final loss {last.loss:.4f}"
                    + (f", checkpoint in {args.save}" if args.save else "")
                    + skipped
                ),
                highlight=False,
            )
        return 0
    except PlanError as e:
        if args.debug:
            traceback.print_exc()
        if rank0:
            console.print(f"[bold red]mlm-run: error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        write_note("bad-input", str(e))
        state = os.environ.get(STATE_ENV)
        if state:
            Path(state, "bad-input").touch()
        return 2
    except Exception as e:
        if args.debug:
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        if is_peer_loss(e):
            console.print(
                f"mlm-run: rank {rank}: lost contact with another rank ({escape(first)}); stopping",
                highlight=False,
                soft_wrap=True,
            )
            write_note("peer-lost", first)
        else:
            console.print(
                f"[bold red]mlm-run: rank {rank}: internal error:[/] {type(e).__name__}: "
                f"{escape(first)} (rerun with --debug for the traceback)",
                highlight=False,
                soft_wrap=True,
            )
            write_note("error", f"{type(e).__name__}: {first}")
        return 1
    finally:
        if own_stop:
            stop.uninstall()
        if dist.is_initialized():
            dist.destroy_process_group()


def entry() -> None:
    """The `mlm-run` command: main(), then an exit that skips interpreter teardown in a launched worker
    (runtime.launch.exit_worker says why)."""
    code = main()
    from mlm.runtime.launch import exit_worker, under_launcher

    if under_launcher():
        exit_worker(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
