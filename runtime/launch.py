"""Process launch: under torchrun / SLURM use their environment; otherwise start the plan's processes locally
with torch's own launcher (torch.distributed.run, i.e. torchrun), or say how to launch on a cluster."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "MLM_PG_TIMEOUT_S"  # tests set 30 so that a hang becomes an error


def under_launcher() -> bool:
    """True inside torchrun (or any launcher that sets RANK / WORLD_SIZE), or in a multi-task SLURM step."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def adopt_slurm_env() -> None:
    """Map srun's variables to torch.distributed's when torchrun is not in between."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_PORT", "29500")
    if "MASTER_ADDR" not in os.environ:
        nodes = os.environ.get("SLURM_NODELIST", os.environ.get("SLURM_JOB_NODELIST", "localhost"))
        os.environ["MASTER_ADDR"] = nodes.split(",")[0].split("[")[0]


def init_distributed(device: str) -> None:
    """Initialize the default process group from the environment (NCCL on GPUs, gloo on CPU)."""
    adopt_slurm_env()
    timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    backend = "nccl" if device == "cuda" else "gloo"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent keeps one store across restarts, and the env:// rendezvous adds no per-attempt prefix:
        # a restarted group could read the dead group's addresses (gloo: "connectFullMesh failed ... Connection
        # refused"). A prefix per restart keeps attempts apart.
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout
        )
        prefixed = dist.PrefixStore(f"mlm/attempt_{restart_count()}", store)
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
        return
    dist.init_process_group(backend, timeout=timeout)


def init_single_process(device: str) -> None:
    """A world of one, in this process (no launcher needed). Leaves os.environ alone, so that a later mlm-run in
    the same process (tests, notebooks) is not mistaken for a torchrun worker."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=timeout,
    )


STATE_ENV = "MLM_RUN_STATE"  # a directory where workers leave one JSON note each on how they ended


@dataclass
class LaunchResult:
    """How a local torchrun launch ended: its exit code, the failed ranks (rank -> (exit code, pid)), and the signal
    that stopped the launcher itself (SIGTERM / SIGINT), if any."""

    code: int
    failures: dict[int, tuple[int, int]] = field(default_factory=dict)
    signal: str | None = None


def launch_local(nproc: int, worker_argv: list[str], max_restarts: int = 0) -> LaunchResult:
    """torchrun --standalone --nproc-per-node N [--max-restarts R] -m mlm.cli.run ARGS, through
    torch.distributed.run's own API (its command line would try to parse the worker's --log as an abbreviation of
    its --log-dir). torchrun's agent restarts the whole worker group up to R times when a worker fails, and on
    SIGTERM / SIGINT forwards the signal to the workers and waits up to 30 s for them."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "-m", "mlm.cli.run"]
    )
    args.training_script_args = list(worker_argv)
    try:
        run(args)
    except ChildFailedError as e:
        failures = {rank: (f.exitcode, f.pid) for rank, f in e.failures.items()}
        codes = {c for c, _ in failures.values()}
        return LaunchResult(2 if codes == {2} else 1, failures)
    except SignalException as e:
        return LaunchResult(1, {}, signal.Signals(e.sigval).name)
    return LaunchResult(0)


def restart_count() -> int:
    """How many times torchrun's agent has restarted this worker group (0 on the first start)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def write_note(kind: str, message: str, **extra: object) -> None:
    """Leave this rank's note for the launching mlm-run (no-op when not launched by it)."""
    directory = os.environ.get(STATE_ENV)
    if not directory:
        return
    rank = os.environ.get("RANK", "0")
    note = {"kind": kind, "message": message, "rank": int(rank), "restart": restart_count(), **extra}
    path = Path(directory) / f"rank-{rank}.json"
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(note))
        tmp.replace(path)
    except OSError:
        pass


def read_notes(directory: str | Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for path in Path(directory).glob("rank-*.json"):
        try:
            note = json.loads(path.read_text())
            out[int(note["rank"])] = note
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def cluster_commands(world: int, gpus_per_node: int, worker_argv: list[str]) -> tuple[str, str]:
    """The torchrun line to run on every node and an sbatch line that does it, for a plan of `world` GPUs."""
    per_node = max(1, min(gpus_per_node, world))
    nodes = math.ceil(world / per_node)
    args = " ".join(shlex.quote(a) for a in worker_argv)
    torchrun = (
        f"torchrun --nnodes={nodes} --nproc-per-node={per_node} --rdzv-backend=c10d "
        f"--rdzv-endpoint=$MASTER_ADDR:29500 -m mlm.cli.run {args}"
    )
    inner = (
        f"srun torchrun --nnodes={nodes} --nproc-per-node={per_node} --rdzv-backend=c10d "
        f"--rdzv-endpoint=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1):29500 "
        f"-m mlm.cli.run {args}"
    )
    sbatch = f"sbatch --nodes={nodes} --ntasks-per-node=1 --gpus-per-node={per_node} --wrap {shlex.quote(inner)}"
    return torchrun, sbatch
