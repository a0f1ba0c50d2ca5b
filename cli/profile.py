"""mlm-profile: measure this machine and write a GPU profile (and its cluster profile) for mlm-plan --gpu FILE."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mlm.planner.errors import PlanError

if TYPE_CHECKING:
    from mlm.runtime.profiling.machine import Measurement

_EPILOG = """\
With --out FILE, two files are written: FILE (the GPU profile) and FILE's stem + ".cluster.toml" (the measured
cluster profile: link bandwidth, latency, collective efficiency, memory reserve). The GPU profile's
default_cluster names that file, so `mlm-plan MODEL --gpu FILE` uses both; `--cluster` still overrides it.
Without --out the GPU profile alone is printed on stdout; its default_cluster then names a file that was not
written, so pass --cluster NAME|PATH to mlm-plan (or use --out). Progress goes to stderr.
Exit codes: 0 ok, 1 internal error, 2 bad input or a failed measurement."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlm-profile", description=__doc__, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", metavar="FILE", help="write the GPU profile here (and FILE.cluster.toml next to it)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="what to measure (default: cuda if available)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer, smaller sizes (seconds on a small CPU; the full run takes ~20 s there)",
    )
    p.add_argument("--name", help="profile name (default: cpu-<hostname>, or the CUDA device name)")
    p.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="processes for the collective test (default: 2 on CPU, every GPU up to 8 on CUDA)",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _cluster_path(out: Path) -> Path:
    stem = out.name[: -len(".toml")] if out.name.endswith(".toml") else out.name
    return out.with_name(stem + ".cluster.toml")


def _summary(m: Measurement, console: Console) -> None:
    c = m.collectives
    t = Table(title=escape(m.device_name))
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_row(f"matmul peak ({m.dtype})", f"{max(r for _, r in m.matmul_tflops) * 1e3:.1f} GFLOP/s")
    t.add_row("memory copy", f"{m.copy_gbps:.1f} GB/s")
    t.add_row("elementwise add", f"{m.elementwise_gbps:.1f} GB/s")
    t.add_row("attention (longest s)", f"{m.attention_tflops[-1][1] * 1e3:.1f} GFLOP/s")
    t.add_row(f"all-reduce bus bw ({c.backend}, {c.world_size})", f"{c.all_reduce_gbps:.2f} GB/s")
    t.add_row("all-gather bus bw", f"{c.all_gather_gbps:.2f} GB/s")
    t.add_row("send/recv", f"{c.send_recv_gbps:.2f} GB/s")
    t.add_row("collective latency", f"{c.latency_us:.0f} us")
    t.add_row("collective hidden under compute", f"{100 * c.overlap:.0f}%")
    console.print(t)


def _run(args: argparse.Namespace, console: Console) -> int:
    import torch

    from mlm.planner.cost.hardware import load_cluster, load_gpu
    from mlm.runtime.profiling import machine as mprof

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    world = args.world_size if args.world_size is not None else mprof.default_world_size(device)
    mprof.check_request(device, world)
    name = args.name or mprof.default_name(device)
    out = Path(args.out) if args.out else None
    cluster_file = _cluster_path(out) if out else Path(f"{name}.cluster.toml")
    gpu_ref = out.name if out else f"{name}.toml"
    if out and out.is_dir():
        raise PlanError(f"--out {out}: is a directory; give a file name such as {out / (name + '.toml')}")

    console.print(f"[bold]mlm-profile[/]: measuring {device}{' (quick)' if args.quick else ''}")
    log = lambda msg: console.print(f"  {escape(msg)}", highlight=False, soft_wrap=True)  # noqa: E731
    m = mprof.measure(device, args.quick, world, log)
    gpu, cluster = mprof.build_profiles(m, name, cluster_file.name, gpu_ref)
    gpu_text, cluster_text = mprof.render(m, gpu, cluster)
    _summary(m, console)
    if out is None:
        sys.stdout.write(gpu_text)
        console.print(
            f"[yellow]note[/]: only the GPU profile was printed; use --out FILE to also save "
            f"{cluster_file.name}, which its default_cluster names"
        )
        return 0
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(gpu_text, encoding="utf-8")
        cluster_file.write_text(cluster_text, encoding="utf-8")
    except OSError as e:
        raise PlanError(f"--out {out}: cannot write: {e.strerror or e}") from None
    load_gpu(str(out))  # what mlm-plan --gpu FILE will read
    load_cluster(str(cluster_file))
    console.print(
        escape(f"wrote {out} and {cluster_file}; use: mlm-plan MODEL --gpu {out}"), highlight=False, soft_wrap=True
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of mlm-profile."""
    args = _parser().parse_args(argv)
    console = Console(stderr=True)
    try:
        return _run(args, console)
    except PlanError as e:
        console.print(f"[bold red]error[/]: {escape(str(e))}", highlight=False, soft_wrap=True)
        return 2
    except Exception as e:  # an internal bug: one line unless --debug
        if args.debug:
            console.print_exception()
        else:
            msg = escape(f"{type(e).__name__}: {e}")
            console.print(f"[bold red]internal error[/]: {msg} (rerun with --debug)", highlight=False, soft_wrap=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
