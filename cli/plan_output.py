"""The planning half of mlm-plan: run the search (or evaluate a pinned layout) and print or write the plan."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from mlm.cli.common import stderr_console
from mlm.cli.format import gib, seconds, si
from mlm.planner.capture.graph import ModelIR
from mlm.planner.errors import PlanError
from mlm.planner.plan import Plan, Training, save_plan
from mlm.planner.search.layouts import PlanRequest
from mlm.planner.search.make_plan import make_plan

if TYPE_CHECKING:  # ModelSpec imports torch; a cache hit passes a CachedSpec instead
    from mlm.planner.capture.loader import ModelSpec


def request_from_args(args: argparse.Namespace, spec: ModelSpec, num_gpus: int) -> PlanRequest:
    global_batch = args.global_batch or (spec.preset.global_batch if spec.preset else 512)
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
        top_k=args.top,
        solver=args.solver,
        time_limit_s=args.time_limit,
    )


def assumed_defaults(args: argparse.Namespace, spec: ModelSpec, request: PlanRequest) -> list[str]:
    """The defaults this command filled in, one sentence each (they become plan.json warnings)."""
    out = []
    if not args.global_batch:
        where = "the preset's" if spec.preset else "the default"
        out.append(f"--global-batch not given: planned {where} {request.global_batch} sequences per step")
    if args.gpu is None and args.cluster is None:
        out.append("--gpu not given: planned for the default GPU profile (pass --gpu NAME)")
    return out


def plan_command(args: argparse.Namespace, spec: ModelSpec, ir: ModelIR) -> int:
    if args.gpus is None:
        raise PlanError("--gpus N is required to plan (or use --inspect to only show the captured layers)")
    request = request_from_args(args, spec, args.gpus)
    console = stderr_console()
    with console.status(f"searching layouts for {args.gpus} GPUs…"):
        outcome = make_plan(spec, ir, request, args.gpu, args.cluster, assumed_defaults(args, spec, request))
    plan = outcome.plan
    if args.out:
        save_plan(plan, args.out)
    if args.json:
        if getattr(args, "verify", False):
            raise PlanError("--verify prints a table; use mlm-run PLAN --dry-run --json for the JSON document")
        print(plan.to_json())
        return 0
    out = Console()
    print_plan(plan, outcome.summary, out)
    if args.explain:
        out.print("[bold]why these values[/]")
        for line in outcome.explanations.values():
            out.print(f"  • {line}")
    if args.out:
        out.print(f"wrote {args.out}")
    if getattr(args, "verify", False):
        from mlm.cli.dry_run_output import dry_run_command
        from mlm.runtime.dry_run import dry_run_options

        return dry_run_command(plan, dry_run_options(plan), False, console, out)
    return 0


def _batch_unit(training: Training) -> str:
    """' × 2048 tokens' for token sequences; ' samples (of 17 tokens)' for inputs that are not (images)."""
    if training.token_inputs:
        return f" × {training.seq_len} tokens"
    return " samples" + (f" of {training.seq_len} tokens" if training.seq_len > 1 else "")


def _throughput(training: Training, tokens_per_s: float) -> str:
    if training.token_inputs:
        return f"{si(tokens_per_s)} tokens/s"
    samples = f"{si(tokens_per_s / training.seq_len)} samples/s"
    return samples + (f" ({si(tokens_per_s)} tokens/s)" if training.seq_len > 1 else "")


def print_plan(plan: Plan, summary: dict[str, Any], console: Console) -> None:
    lay, pred = plan.layout, plan.predicted
    assert pred is not None
    sched = {"none": "no pipeline", "1f1b": "1F1B", "interleaved-1f1b": f"interleaved 1F1B (vpp {lay.vpp})"}
    console.print(
        f"[bold]{summary['model']}[/] ({si(plan.model.num_params)} params) on {plan.cluster.num_gpus} × "
        f"{plan.cluster.gpu} ({summary['cluster']}), global batch {plan.training.global_batch}"
        f"{_batch_unit(plan.training)}"
        + (
            f", computed in {plan.training.dtype} (the profile's compute_dtype)"
            if plan.training.dtype != "bf16"
            else ""
        )
    )
    console.print(
        f"[bold green]layout[/]  mesh pp {lay.pp} × dp {lay.dp}{f' × cp {lay.cp}' if lay.cp > 1 else ''} × tp {lay.tp}"
        f"{f' · experts over ep {lay.ep}' if lay.ep > 1 else ''}"
        f"{' + sequence parallel' if lay.sequence_parallel else ''} · micro-batch {lay.micro_batch} × "
        f"{lay.num_microbatches} · {sched[lay.schedule]} · recompute {lay.recompute} · zero {lay.zero}"
    )
    console.print(
        f"[bold green]predicted[/]  step {seconds(pred.step_time_s)} · "
        f"{_throughput(plan.training, pred.tokens_per_s)} · "
        f"{pred.model_tflops_per_gpu:.{0 if pred.model_tflops_per_gpu >= 10 else 3}f} TFLOP/s per GPU · "
        f"MFU {100 * pred.mfu:.1f}% · peak memory "
        f"{gib(pred.peak_memory_bytes)} of {gib(summary['capacity_bytes'])}"
    )
    table = Table(title="pipeline stages", show_edge=False)
    for col in ("stage", "rank", "blocks", "recompute", "memory", "time/micro-batch"):
        table.add_column(col, justify="right" if col not in ("stage",) else "left")
    rows = plan.stages if len(plan.stages) <= 16 else [*plan.stages[:8], None, *plan.stages[-8:]]
    for st in rows:
        if st is None:
            table.add_row(f"… {len(plan.stages) - 16} more stages …", "", "", "", "", "")
            continue
        blocks = sum(1 for name in st.layers if name in summary["block_names"])
        extra = [n for n in st.layers if n not in summary["block_names"]]
        label = f"{st.index}" + (
            f" (+{', '.join(extra)})" if extra and len(extra) <= 3 else f" (+{len(extra)} layers)" if extra else ""
        )
        table.add_row(
            label,
            str(st.index % lay.pp),
            str(blocks),
            str(len(st.recompute_layers)),
            f"{gib(st.memory_bytes)}",
            seconds(st.time_s),
        )
    console.print(table)
    bd = Table(title="step time breakdown", show_edge=False)
    bd.add_column("term")
    bd.add_column("time", justify="right")
    bd.add_column("share", justify="right")
    for key, value in pred.breakdown.items():
        bd.add_row(
            key.removesuffix("_s").replace("_", " "),
            seconds(value),
            f"{100 * value / pred.step_time_s:.0f}%" if pred.step_time_s else "",
        )
    console.print(bd)
    if plan.alternatives:
        alt = Table(title="alternatives", show_edge=False)
        alt.add_column("layout")
        alt.add_column("step", justify="right")
        alt.add_column("why it lost")
        for row in plan.alternatives:
            lo = row["layout"]
            desc = (
                f"pp{lo['pp']} dp{lo['dp']} tp{lo['tp']}{' sp' if lo['sequence_parallel'] else ''} "
                f"mb{lo['micro_batch']} vpp{lo['vpp']} rc={lo['recompute']} z{lo['zero']}"
            )
            alt.add_row(desc, seconds(row["step_time_s"]) if row["step_time_s"] else "—", str(row["why"]))
        console.print(alt)
    if plan.pinned:
        console.print(f"[dim]pinned: {', '.join(plan.pinned)}; everything else searched[/]")
    for line in plan.warnings:
        console.print(f"[yellow]warning[/] {line}")
    if summary.get("calibration"):
        console.print(f"[dim]calibration: {summary['calibration']} (docs/calibration.md)[/]")
    console.print(f"[dim]{summary['search']}[/]")


def to_json(obj: Any) -> str:
    return json.dumps(obj, indent=2)
