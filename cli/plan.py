"""mlm-plan: capture a model and choose (or evaluate) its parallel layout; --inspect shows the captured layers."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console

from mlm.cli.common import run_command, stderr_console
from mlm.cli.format import gib, si
from mlm.planner.capture import cache
from mlm.planner.capture.graph import ModelIR
from mlm.planner.capture.presets.registry import PRESETS
from mlm.planner.cost.hardware import resolve
from mlm.planner.errors import PlanError

EPILOG = """examples:
  mlm-plan gpt3-175b --gpus 1024                 choose the fastest layout on 1024 A100-80GB GPUs
  mlm-plan gpt3-175b --gpus 1024 --tp 8 --pp 16  pin some dimensions, search the rest
  mlm-plan model.py --model-arg n_layer=4 --inspect   show the captured layers of your own model
presets: """ + ", ".join(PRESETS)


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """MODEL and the flags that say how to build it (shared with mlm-whatif)."""
    parser.add_argument(
        "model", metavar="MODEL", help="a model.py file (build_model(**kwargs) -> nn.Module) or a preset name"
    )
    parser.add_argument("--entry", help="name of the model factory in MODEL (default: build_model, or `model`)")
    parser.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the factory; VALUE is a Python literal (repeatable)",
    )
    parser.add_argument("--seq-len", type=int, help="training sequence length (default: from the model config)")
    parser.add_argument(
        "--capture",
        choices=("auto", "export", "symbolic_trace"),
        default="auto",
        help="tracer: symbolic_trace fast path then torch.export (auto), or force one",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def layout_arguments(parser: argparse.ArgumentParser) -> None:
    """Cluster, batch and the layout dimensions a user may pin (shared with mlm-whatif)."""
    parser.add_argument("--gpu", help="GPU profile name or TOML path (default a100-80gb)")
    parser.add_argument("--cluster", help="cluster profile name or TOML path (default: the GPU's cluster)")
    parser.add_argument("--global-batch", type=int, help="sequences per step (default: the preset's, or 512)")
    parser.add_argument("--tp", type=int, help="pin tensor-parallel size")
    parser.add_argument("--pp", type=int, help="pin pipeline-parallel size")
    parser.add_argument("--dp", type=int, help="pin data-parallel size")
    parser.add_argument("--micro-batch", type=int, help="pin the micro-batch size")
    parser.add_argument("--vpp", type=int, help="pin virtual pipeline stages per rank (1 = plain 1F1B)")
    parser.add_argument("--recompute", choices=("none", "selective", "full"), help="pin activation recompute")
    parser.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pin sequence parallelism on or off",
    )
    parser.add_argument("--zero", type=int, choices=(0, 1, 3), help="pin optimizer sharding (ZeRO stage)")
    parser.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel size (each sequence split over cp ranks in 2·cp load-balanced chunks, K/V "
        "all-gathered per attention layer, as mlm-run runs it); default 1 because no measured cp run calibrates its "
        "cost yet; 0 = search it",
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=0,
        help="expert-parallel size (MoE: the routed experts split over ep of the dp·cp ranks); default 0 = search "
        "it; a dense model gets 1",
    )
    parser.add_argument("--solver", choices=("cbc", "highs"), default="cbc", help="MILP solver (default cbc)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="solver time limit per MILP, seconds")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlm-plan",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
        description="Capture MODEL on the meta device (no weights), estimate compute, memory and communication on "
        "the target cluster, and choose tensor/pipeline/data/context/expert parallel sizes, micro-batch, recompute, "
        "sequence parallelism and optimizer sharding. Prints the layout; --out writes plan.json.",
    )
    model_arguments(parser)
    parser.add_argument("--gpus", type=int, help="number of GPUs to plan for")
    layout_arguments(parser)
    parser.add_argument("--top", type=int, default=5, help="alternatives to show and store (default 5)")
    parser.add_argument("--out", help="write plan.json here")
    parser.add_argument("--json", action="store_true", help="print only the JSON document on stdout")
    parser.add_argument("--explain", action="store_true", help="say why each dimension took its value")
    parser.add_argument("--inspect", action="store_true", help="show the captured layers and stop")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="after planning, dry-run the chosen plan (as mlm-run --dry-run: one step per pipeline rank at full "
        "size on fake tensors) and print measured memory and collectives beside the prediction",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="capture afresh, neither reading nor writing the capture cache ($MLM_CACHE_DIR, else ~/.cache/mlm)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return run_command(lambda: _run(args), args.debug)


def load_or_capture(args: argparse.Namespace) -> tuple[Any, ModelIR, bool]:
    """(spec, IR, from_cache): the cached capture when there is one (torch is not imported then), else a fresh
    capture, stored for next time. --no-cache bypasses the cache."""
    if args.seq_len is not None and args.seq_len < 1:
        raise PlanError("--seq-len must be >= 1")
    use_cache = not getattr(args, "no_cache", False)
    # the target's compute dtype (bf16 on GPUs, fp32 on a CPU profile), which the activations are captured in
    dtype = resolve(args.gpu, args.cluster)[0].compute_dtype
    key = cache.capture_key(args.model, args.entry, args.model_arg, args.seq_len, args.capture, dtype)
    key = key if use_cache else None
    hit = cache.load(key) if key else None
    if hit is not None:
        return hit[0], hit[1], True
    from mlm.planner.capture.loader import load_model_spec, parse_model_args  # imports torch: only on a miss
    from mlm.planner.capture.trace import capture

    spec = load_model_spec(args.model, args.entry, parse_model_args(args.model_arg))
    with stderr_console().status(f"capturing {spec.display_name} on the meta device…"):
        ir = capture(spec, seq_len=args.seq_len, method=args.capture, dtype=dtype)
    if key:
        cache.store(key, spec, ir)
    return spec, ir, False


def _run(args: argparse.Namespace) -> int:
    spec, ir, cached = load_or_capture(args)
    if args.inspect:
        from mlm.planner.capture.inspect import inspect_summary

        summary = inspect_summary(ir)
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            print_inspect(summary, spec.display_name, Console(), cached)
        return 0
    from mlm.cli.plan_output import plan_command  # the search, imported only when planning

    return plan_command(args, spec, ir)


def print_inspect(summary: dict[str, Any], name: str, console: Console, cached: bool = False) -> None:
    from rich.table import Table

    unit = summary["unit"]
    per = f"per sample of {summary['seq_len']} tokens" if unit == "token" else "per sample"
    table = Table(title=f"{name}: captured layers ({per})")
    for col, justify in (
        ("layer", "left"),
        ("kind", "left"),
        ("params", "right"),
        (f"FLOPs/{unit}", "right"),
        ("activations", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    rows = summary["layers"]
    shown = rows if len(rows) <= 12 else rows[:6] + [None] + rows[-5:]
    for row in shown:
        if row is None:
            table.add_row(f"… {len(rows) - 11} more identical rows …", "", "", "", "")
            continue
        table.add_row(
            row["name"],
            row["kind"],
            si(row["params"]),
            si(row["flops_per_token"], "FLOP"),
            gib(row["activation_bytes_per_sample"]),
        )
    t = summary["totals"]
    table.add_section()
    table.add_row(
        "total", "", si(summary["num_params"]), si(t["flops_per_token"], "FLOP"), gib(t["activation_bytes_per_sample"])
    )
    console.print(table)
    console.print(
        f"parameters: {summary['num_params']:,} ({si(summary['num_params'])}); {summary['num_layers']} "
        f"blocks, hidden {summary['hidden_size']}, heads {summary['num_heads']}"
        f" (kv {summary['num_kv_heads']}), vocab {summary['vocab_size']}"
        f"{', tied embedding/head' if summary['tied_embeddings'] else ''}"
    )
    moe = summary["moe"]
    if moe is not None:
        active = moe["active_params"]
        console.print(
            f"MoE: {moe['layers']} layers of {moe['num_experts']} routed experts, top-{moe['top_k']}; active "
            f"parameters per token {active:,} ({si(active)}, {active / summary['num_params']:.1%} of all)"
        )
    console.print(f"training FLOPs per {unit} (6N-style, no recompute): {si(t['training_flops_per_token'], 'FLOP')}")
    console.print(
        f"captured with {summary['capture_method']} in {summary['capture_seconds']:.2f} s"
        + (" (read from the capture cache; --no-cache captures afresh)" if cached else "")
    )
    for line in summary["warnings"]:  # every assumption the capture made, as mlm-plan prints them
        console.print(f"[yellow]warning[/] {line}")


if __name__ == "__main__":
    sys.exit(main())
