"""mlm-calibrate: refit a GPU profile's compute factor from `mlm-run --log` step logs and write the new profile."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from mlm.cli.common import run_command, stderr_console

_EPILOG = """\
Each RUN.jsonl is a log written by `mlm-run PLAN --log RUN.jsonl` for a plan priced with PROFILE (mlm-plan --gpu
PROFILE); logs priced for another profile are refused. The first --warmup steps of every run are skipped and each
run counts once, by its median step time. One factor multiplies every kernel efficiency of the profile (GEMM and
attention curves, memory_bound_efficiency): see mlm/planner/cost/fit.py. The new profile, with a [calibration]
table naming the logs, goes to --out (or stdout); use it as `mlm-plan MODEL --gpu FILE`. The report goes to stderr.
Exit codes: 0 ok, 1 internal error, 2 bad input."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlm-calibrate",
        description=__doc__,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("logs", nargs="+", type=Path, metavar="RUN.jsonl", help="mlm-run --log files")
    p.add_argument("--gpu", required=True, metavar="PROFILE", help="the GPU profile (name or TOML path) the runs used")
    p.add_argument("--out", type=Path, metavar="FILE", help="write the refitted profile here (default: stdout)")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="steps skipped at the start of each run (1)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _body(args: argparse.Namespace) -> int:
    from mlm.planner.cost.fit import CalibrationError, calibrated_profile, fit, read_runs, rebased_cluster
    from mlm.planner.cost.hardware import load_gpu, to_toml

    if args.warmup < 0:
        raise CalibrationError(f"--warmup must be >= 0, got {args.warmup}")
    gpu = load_gpu(args.gpu)
    runs = [r for path in args.logs for r in read_runs(path, args.warmup)]
    result = fit(runs, gpu)
    console = stderr_console()
    table = Table(title=f"mlm-calibrate: {escape(gpu.name)}, factor {result.factor:.4f} on its efficiencies")
    for col in ("run", "layout", "steps", "measured", "before", "err", "after", "err"):
        table.add_column(col, justify="left" if col in ("run", "layout") else "right")
    for r in runs:
        lo = r.layout
        desc = (
            f"tp{lo['tp']} pp{lo['pp']} dp{lo['dp']} mb{lo['micro_batch']}x{lo['num_microbatches']} vpp{lo['vpp']}"
            f" rc={lo['recompute']} z{lo['zero']}"
        )
        m, before, after = r.measured_median_s, r.predicted_s, r.predict(result.factor)
        table.add_row(
            escape(r.source),
            desc,
            str(len(r.measured_s)),
            f"{m * 1e3:.1f} ms",
            f"{before * 1e3:.1f} ms",
            f"{100 * (before / m - 1):+.1f}%",
            f"{after * 1e3:.1f} ms",
            f"{100 * (after / m - 1):+.1f}%",
        )
    console.print(table)
    console.print(
        f"mean |error| {result.mean_error_before_pct:.1f}% before, {result.mean_error_after_pct:.1f}% after "
        f"(worst {result.worst_error_after_pct:.1f}%) over {len(runs)} run(s), {result.rows} steps; "
        f"compute_factor {result.compute_factor:.4f}"
    )
    if result.clamped:
        console.print(
            "warning: some efficiencies would exceed 1 and are held at 1, so the new profile predicts slower steps "
            "than the fit; the profile's peak rates are below what these runs reached (re-run mlm-profile)"
        )
    gpu_path = Path(args.gpu) if args.gpu.endswith(".toml") or "/" in args.gpu else None
    cluster = rebased_cluster(gpu.default_cluster, gpu_path, args.out)
    new = calibrated_profile(gpu, result, [str(p) for p in args.logs], cluster)
    header = f"{gpu.name} refitted by mlm-calibrate from {len(runs)} run(s); see [calibration] at the end."
    text = to_toml(new, header=header)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text, encoding="utf-8")
        console.print(f"wrote {escape(str(args.out))}; use: mlm-plan MODEL --gpu {escape(str(args.out))}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of mlm-calibrate."""
    args = _parser().parse_args(argv)
    return run_command(lambda: _body(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
