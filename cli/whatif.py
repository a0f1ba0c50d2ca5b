"""mlm-whatif: capacity questions (time to train, GPUs for a deadline, what fits, sweeps)."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from mlm.cli.common import run_command, stderr_console
from mlm.cli.format import gib, seconds, si
from mlm.cli.plan import layout_arguments, model_arguments
from mlm.planner.capture.graph import ModelIR
from mlm.planner.capture.loader import load_model_spec, parse_model_args
from mlm.planner.cost.hardware import resolve
from mlm.planner.errors import PlanError
from mlm.planner.search.layouts import PlanRequest
from mlm.planner.whatif.arithmetic import parse_count, parse_sweep
from mlm.planner.whatif.questions import Point, capture_args, gpus_for_deadline, largest_model, sweep, time_to_train
from mlm.planner.whatif.report import ROW_FIELDS, assumptions, eq4_check, layout_dict, memory_rows, point_row
from mlm.planner.whatif.scale import SCALE_CHOICES

DEFAULT_MAX_GPUS = 1 << 17

EPILOG = """questions (one per run):
  time to train     mlm-whatif gpt3-175b --gpus 1024 --gpu a100-80gb --tokens 300e9
  GPUs for deadline mlm-whatif llama3-405b --gpu h100-sxm --tokens 15e12 --days 60
  largest model     mlm-whatif gpt3-175b --gpus 512 --max-params [--scale both|layers|hidden] [--tokens 300e9]
  memory per GPU    mlm-whatif llama3-70b --gpus 64 --memory
  sweeps            mlm-whatif gpt3-175b --tokens 300e9 --sweep gpus=256,512,1024,2048 --plot scaling.png
                    mlm-whatif llama3-70b --gpus 512 --tokens 2e12 --sweep gpu=a100-80gb,h100-sxm,h200,b200
                    mlm-whatif gpt3-175b --gpus 1024 --sweep global_batch=512,1024,1536,2048 --csv batch.csv

Token counts accept 300e9, 450B, 15T. Every answer uses the same capture, cost model and layout search as
mlm-plan; pin dimensions (--tp 8 ...) to ask about one layout or to make long searches faster. Costs use the GPU
profile's usd_per_gpu_hour (a rough list price) unless --usd-per-gpu-hour is given."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlm-whatif",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
        description="Answer capacity questions about training MODEL from its captured graph and mlm's cost "
        "model: how long T tokens take on N GPUs and what it costs, how many GPUs meet a deadline, "
        "the largest model of the family that fits, per-GPU memory, and sweeps over GPU count, GPU "
        "type or global batch.",
    )
    model_arguments(parser)
    parser.add_argument("--gpus", type=int, help="number of GPUs (whole nodes beyond one node)")
    layout_arguments(parser)
    q = parser.add_argument_group("questions")
    q.add_argument("--tokens", help="training tokens, e.g. 300e9 or 15T: gives days, GPU-hours and cost")
    q.add_argument("--days", type=float, help="deadline in days: find the smallest GPU count (needs --tokens)")
    q.add_argument(
        "--max-gpus",
        type=int,
        default=DEFAULT_MAX_GPUS,
        help=f"largest GPU count the deadline search may try (default {DEFAULT_MAX_GPUS})",
    )
    q.add_argument(
        "--max-params", action="store_true", help="find the largest model of MODEL's family that fits on --gpus"
    )
    q.add_argument(
        "--scale",
        choices=SCALE_CHOICES,
        default="both",
        help="how --max-params grows the model: depth and width together (default), layers only, or "
        "hidden size only (heads of the base head dimension)",
    )
    q.add_argument("--memory", action="store_true", help="print the per-GPU memory breakdown of the best plan")
    q.add_argument("--sweep", metavar="KEY=V1,V2,...", help="gpus=..., gpu=NAME,... or global_batch=...")
    q.add_argument("--usd-per-gpu-hour", type=float, help="price per GPU-hour (default: the GPU profile's)")
    out = parser.add_argument_group("output")
    out.add_argument("--plot", metavar="FILE.png", help="with --sweep: write a chart (throughput, MFU, cost vs time)")
    out.add_argument("--csv", metavar="FILE", help="with --sweep: write the table as CSV")
    out.add_argument("--json", action="store_true", help="print only a JSON document on stdout")
    out.add_argument("--out", metavar="plan.json", help="write the plan the answer assumed (not with --sweep)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: _run(args), args.debug)


def check_flags(args: argparse.Namespace) -> str:
    """The question asked ('time', 'deadline', 'fit', 'sweep'); PlanError for conflicting or missing flags."""

    def conflict(a: str, b: str, why: str) -> PlanError:
        return PlanError(f"conflicting flags {a} and {b}: {why}")

    if args.days is not None:
        for flag, on in (
            ("--gpus", args.gpus is not None),
            ("--max-params", args.max_params),
            ("--sweep", args.sweep),
            ("--dp", args.dp is not None),
        ):
            if on:
                raise conflict("--days", flag, "--days asks for the GPU count; drop one of them")
        if args.tokens is None:
            raise PlanError("--days needs --tokens (how many tokens must be trained by the deadline)")
        question = "deadline"
    elif args.max_params:
        if args.sweep:
            raise conflict("--max-params", "--sweep", "ask one question per run")
        question = "fit"
    elif args.sweep:
        question = "sweep"
    else:
        question = "time"
    if question != "sweep":
        for flag, on in (("--plot", args.plot), ("--csv", args.csv)):
            if on:
                raise PlanError(f"{flag} needs --sweep (it charts or tabulates several points)")
    if question in ("time", "fit") and args.gpus is None:
        raise PlanError("--gpus N is required (or use --days D with --tokens T to find the GPU count)")
    if question == "time" and args.tokens is None and not args.memory:
        raise PlanError(
            "nothing asked: add --tokens T (time to train), --days D (GPUs for a deadline), "
            "--max-params, --memory or --sweep KEY=V1,V2 (see --help)"
        )
    if question == "sweep":
        key = parse_sweep(args.sweep).key
        pinned = {
            "gpus": args.gpus is not None,
            "gpu": args.gpu is not None,
            "global_batch": args.global_batch is not None,
        }
        if pinned[key]:
            raise conflict(f"--sweep {key}=", f"--{key.replace('_', '-')}", "the sweep sets it")
        if key != "gpus" and args.gpus is None:
            raise PlanError(f"--sweep {key}= needs --gpus N")
        if key == "gpus" and args.dp is not None:
            raise conflict("--sweep gpus=", "--dp", "dp follows the GPU count")
        if args.memory or args.out:
            raise PlanError("--memory and --out describe one plan: not with --sweep")
    return question


def request_for(args: argparse.Namespace, global_batch: int, num_gpus: int) -> PlanRequest:
    return PlanRequest(
        num_gpus=num_gpus,
        global_batch=global_batch,
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        cp=args.cp or None,  # 0 on the command line: search it
        ep=args.ep or None,
        micro_batch=args.micro_batch,
        vpp=args.vpp,
        recompute=args.recompute,
        sequence_parallel=args.sequence_parallel,
        zero=args.zero,
        solver=args.solver,
        time_limit_s=args.time_limit,
    )


def _run(args: argparse.Namespace) -> int:
    question = check_flags(args)
    tokens = parse_count(args.tokens) if args.tokens is not None else None
    model_args = parse_model_args(args.model_arg)
    spec = load_model_spec(args.model, args.entry, model_args)
    with stderr_console().status(f"capturing {spec.display_name} on the meta device…"):
        dtype = resolve(args.gpu, args.cluster)[0].compute_dtype  # bf16 on GPUs, fp32 on a CPU profile
        ir = capture_args(args.model, args.entry, model_args, args.seq_len, args.capture, dtype)
    global_batch = args.global_batch or (spec.preset.global_batch if spec.preset else 512)
    request = request_for(args, global_batch, args.gpus or 1)
    if question == "sweep":
        return _sweep(args, ir, request, tokens, spec.display_name)
    doc: dict[str, Any] = {"question": question, "model": spec.display_name}
    console = _stdout()
    if question == "time":
        with _progress(None) as step:
            step("searching layouts")
            point = time_to_train(ir, request, args.gpu, args.cluster, tokens, args.usd_per_gpu_hour)
        headline = _time_headline(point)
    elif question == "deadline":
        assert tokens is not None
        with _progress(None) as step:
            answer = gpus_for_deadline(
                ir,
                request,
                args.gpu,
                args.cluster,
                tokens,
                args.days,
                args.usd_per_gpu_hour,
                args.max_gpus,
                on_step=step,
            )
        point = answer.point
        nodes = max(1, point.num_gpus // point.cluster.gpus_per_node)
        headline = (
            f"[bold]{point.num_gpus} GPUs[/] ({nodes} node{'s' if nodes > 1 else ''}) is the "
            f"smallest whole-node count that trains {si(tokens)} tokens within {args.days:g} days: "
            + _time_headline(point)
        )
        doc["search"] = {
            "evaluated": {str(k): v for k, v in sorted(answer.search.evaluated.items())},
            "required_tokens_per_s": answer.search.required_tokens_per_s,
            "notes": answer.search.notes,
        }
    else:
        with _progress(None) as step:
            fit = largest_model(
                args.model,
                args.entry,
                dict(spec.args),
                ir,
                args.scale,
                request,
                args.gpu,
                args.cluster,
                tokens,
                args.usd_per_gpu_hour,
                args.seq_len,
                args.capture,
                on_step=step,
            )
        point, ir, model_args = fit.point, fit.ir, fit.args
        capped = " (the largest size searched; it may grow further)" if fit.capped else ""
        headline = (
            f"largest {args.scale}-scaled model that fits on {point.num_gpus} × {point.gpu.name}: "
            f"[bold]{si(ir.num_params)} params[/] ({fit.description}){capped}"
            + (f"; {_time_headline(point)}" if point.time else "")
        )
        doc["fit"] = {
            "num_params": ir.num_params,
            "args": fit.args,
            "scale": fit.scale,
            "tried": {str(k): v for k, v in sorted(fit.growth.tried.items())},
            "capped": fit.capped,
        }
    doc.update(_point_doc(point, ir))
    if args.out:
        _write_plan(args, model_args, ir, replace(request, num_gpus=point.num_gpus), args.out)
    if args.json:
        print(json.dumps(doc, indent=2, default=str))
        return 0
    _print_point(console, spec.display_name, ir, point, headline, args.memory)
    if args.out:
        console.print(f"wrote {args.out}")
    return 0


def _point_doc(point: Point, ir: ModelIR) -> dict[str, Any]:
    assert point.best is not None
    doc: dict[str, Any] = {
        "num_params": ir.num_params,
        "answer": point_row(point),
        "layout": layout_dict(point.best.layout),
        "assumptions": assumptions(point, ir),
        "memory_per_gpu": memory_rows(point),
    }
    if point.time is not None:
        doc["training"] = point.time.to_dict()
        doc["eq4"] = eq4_check(point, ir)
    return doc


def _write_plan(
    args: argparse.Namespace, model_args: dict[str, Any], ir: ModelIR, request: PlanRequest, path: str
) -> None:
    from mlm.planner.plan import save_plan
    from mlm.planner.search.make_plan import make_plan

    spec = load_model_spec(args.model, args.entry, model_args)
    save_plan(make_plan(spec, ir, request, args.gpu if args.gpu else None, args.cluster).plan, path)


def _time_headline(point: Point) -> str:
    t = point.time
    if t is None:
        return "pass --tokens T for the time to train"
    cost = f" · [bold]${si(t.cost_usd)}[/]" if t.cost_usd is not None else ""
    return f"[bold]{t.days:.1f} days[/] for {si(t.tokens)} tokens · {si(t.gpu_hours)} GPU-hours{cost}"


def _print_point(console: Console, name: str, ir: ModelIR, point: Point, headline: str, memory: bool) -> None:
    assert point.best is not None
    lay, ev = point.best.layout, point.best.evaluation
    console.print(
        f"[bold]{name}[/] ({si(ir.num_params)} params) on {point.num_gpus} × {point.gpu.name} ({point.cluster.name})"
    )
    console.print(headline)
    console.print(
        f"[bold green]plan[/]  pp {lay.pp} × dp {lay.dp} × tp {lay.tp}"
        f"{' + sequence parallel' if lay.sequence_parallel else ''} · micro-batch {lay.micro_batch} × "
        f"{lay.num_microbatches} · vpp {lay.vpp} · recompute {lay.recompute} · zero {lay.zero}"
    )
    console.print(
        f"[bold green]predicted[/]  step {seconds(ev.step_time_s)} · {si(ev.tokens_per_s)} tokens/s · "
        f"{ev.model_tflops_per_gpu:.0f} TFLOP/s per GPU · MFU {100 * ev.mfu:.1f}% · peak "
        f"{gib(ev.peak_memory_bytes)} of {gib(ev.capacity_bytes)}"
    )
    if point.time is not None:
        eq = eq4_check(point, ir)
        console.print(
            f"[dim]cross-check: Narayanan et al. 2021 Eq. 4 in mlm's FLOP count, 6·T·P/(n·X) at mlm's "
            f"X = {eq['mlm_tflops_per_gpu']:.0f} TFLOP/s = {eq['eq4_days_at_mlm_rate']:.1f} days (the paper "
            f"writes 8·T·P/(n·X) with the recompute forward counted in X)[/]"
        )
    if memory:
        _print_memory(console, point)
    console.print("[bold]assumptions[/]")
    for key, line in assumptions(point, ir).items():
        console.print(f"  {key}: {line}", soft_wrap=True)


def _print_memory(console: Console, point: Point) -> None:
    rows = memory_rows(point)
    assert point.best is not None
    table = Table(title=f"memory per GPU (of {gib(point.best.evaluation.capacity_bytes)})", show_edge=False)
    cols = ("params", "grads", "optimizer", "activations", "reserve", "total")
    table.add_column("pipeline rank")
    for col in cols:
        table.add_column(col, justify="right")
    shown = rows if len(rows) <= 8 else rows[:4] + rows[-4:]
    for row in shown:
        table.add_row(str(row["rank"]), *(gib(row[c]) for c in cols))
    console.print(table)


def _sweep(args: argparse.Namespace, ir: ModelIR, request: PlanRequest, tokens: float | None, name: str) -> int:
    spec = parse_sweep(args.sweep)
    with _progress(len(spec.values)) as step:
        points = sweep(ir, request, args.gpu, args.cluster, spec, tokens, args.usd_per_gpu_hour, on_step=step)
    rows = [point_row(p) for p in points]
    if not any(p.best for p in points):
        raise PlanError(f"no point of --sweep {args.sweep} has a fitting layout: {points[0].error}")
    if args.csv:
        with open(args.csv, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=ROW_FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    if args.plot:
        from mlm.cli.whatif_plot import plot_sweep

        plot_sweep(
            rows,
            spec.key,
            f"{name} ({si(ir.num_params)} params)" + (f", {si(tokens)} tokens" if tokens else ""),
            args.plot,
        )
    first = next(p for p in points if p.best)
    if args.json:
        print(
            json.dumps(
                {
                    "question": "sweep",
                    "model": name,
                    "num_params": ir.num_params,
                    "sweep": spec.key,
                    "rows": rows,
                    "assumptions": assumptions(first, ir),
                },
                indent=2,
            )
        )
        return 0
    console = _stdout()
    _print_sweep(console, name, ir, spec.key, rows)
    console.print("[bold]assumptions[/] (MFU per row above)")
    shown = [p for p in points if p.best] if spec.key == "gpu" else [first]
    for point in shown:
        for key, line in assumptions(point, ir).items():
            if key not in ("achieved", "time") and (key == "tokens per step") <= (point is first):
                console.print(f"  {key}: {line}", soft_wrap=True)
    if tokens is None:
        console.print("  days and cost: pass --tokens T")
    for path in (args.csv, args.plot):
        if path:
            console.print(f"wrote {path}")
    return 0


def _stdout() -> Console:
    """The answer console: the terminal's width, or 120 columns when writing to a file or pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=120)


def _print_sweep(console: Console, name: str, ir: ModelIR, key: str, rows: list[dict[str, Any]]) -> None:
    table = Table(title=f"{name} ({si(ir.num_params)} params): sweep over {key}", show_edge=False)
    cols = ("GPUs", "GPU", "batch", "layout", "step", "tokens/s", "MFU", "days", "cost")
    for col in cols:
        table.add_column(col, justify="left" if col in ("GPU", "layout") else "right")
    for r in rows:
        if r["error"]:
            table.add_row(str(r["num_gpus"]), r["gpu"], str(r["global_batch"]), f"[red]{r['error']}[/]", *([""] * 5))
            continue
        table.add_row(
            str(r["num_gpus"]),
            r["gpu"],
            str(r["global_batch"]),
            r["layout_short"],
            seconds(r["step_time_s"]),
            si(r["tokens_per_s"]),
            f"{100 * r['mfu']:.1f}%",
            f"{r['days']:.1f}" if r["days"] is not None else "—",
            f"${si(r['cost_usd'])}" if r["cost_usd"] is not None else "—",
        )
    console.print(table)


@contextmanager
def _progress(total: int | None) -> Iterator[Callable[[str], None]]:
    """A rich progress bar on stderr; the yielded callback names the point being evaluated and advances."""
    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn()]
    with Progress(*columns, TimeElapsedColumn(), console=stderr_console(), transient=True) as progress:
        task = progress.add_task("starting", total=total)
        done = [0]

        def step(what: str) -> None:
            progress.update(task, description=f"evaluating {what}", completed=done[0])
            done[0] += 1

        yield step


if __name__ == "__main__":
    sys.exit(main())
