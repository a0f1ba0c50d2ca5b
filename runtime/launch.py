"""Process launch: under torchrun / SLURM use their environment; otherwise start the plan's processes locally
with torch's own launcher (torch.distributed.run, i.e. torchrun), or say how to launch on a cluster."""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import shlex
import signal
import socket
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from mlm.planner.errors import Infeasible
from mlm.planner.plan import Plan

DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "MLM_PG_TIMEOUT_S"  # tests set 30 so that a hang becomes an error


def under_launcher() -> bool:
    """True inside torchrun (or any launcher that sets RANK / WORLD_SIZE), or in a multi-task SLURM step."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def exit_worker(code: int) -> None:
    """End a launched worker with `code` without running the interpreter's finalisation. Gloo's worker threads can
    still hold work objects (and tensors) when Python tears itself down after destroy_process_group, and then abort
    the process ("terminate called without an active exception", SIGABRT: 2 runs in 43 of an ep2 plan on
    this CPU), which torchrun reports as a failed rank after a finished run. Every file mlm-run writes is closed by
    then; stdout and stderr are flushed here. torch has no fix (pytorch/pytorch PR 179291 was abandoned)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


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
        os.environ["MASTER_ADDR"] = expand_hostlist(nodes)[0]


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list ("node[001-004,010],gpu[1-2]-ib") as host names, in order, zero padding kept.
    Written by hand because `scontrol show hostnames` is not on every compute node's PATH inside containers."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        hosts.extend(_expand_item(item))
    if not hosts:
        raise ValueError(f"empty SLURM host list {text!r}")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"malformed SLURM host list {text!r}")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"malformed SLURM host list {text!r}")
    items.append(text[start:])
    return [x for x in items if x]


def _expand_item(item: str) -> list[str]:
    """One host pattern: the first bracket's ranges times the expansion of the rest."""
    m = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", item)
    if m is None:
        return [item]
    prefix, ranges, rest = m.groups()
    tails = _expand_item(rest) if rest else [""]
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"malformed range {part!r} in SLURM host list {item!r}")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            out.extend(f"{prefix}{n:0{width}d}{tail}" for tail in tails)
    return out


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


LAUNCHER_ENV = "MLM_LAUNCHER_PID"  # the pid of the mlm-run that started this worker
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_launcher() -> None:
    """Make the kernel SIGKILL this worker when its parent (the launching agent) dies, even by SIGKILL, so no
    worker outlives mlm-run. torch's elastic agent only cleans up when it gets to run its handlers. Linux only
    (prctl); elsewhere a no-op. If the launcher already died before prctl took effect, exit at once."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    expected = os.environ.get(LAUNCHER_ENV)
    if expected and os.getppid() != int(expected):
        os._exit(1)


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
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the agent runs in this process and is the workers' parent
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


SIMULATE_FLAG = "--simulate-locally"


class HostTooSmall(Infeasible):
    """The plan needs more of this machine than it has; the message ends with the cluster commands."""


def _available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _own_rss_bytes() -> int:
    """This process's resident memory: what one more Python + torch process costs before any model."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def targets_cpu(plan: Plan) -> bool:
    """Whether the plan was made for CPU processes (the harness's "cpu" or an mlm-profile "cpu-<host>" profile)."""
    return plan.cluster.gpu == "cpu" or plan.cluster.gpu.startswith("cpu-")


def per_rank_memory_bytes(plan: Plan) -> float:
    """The plan's own predicted peak memory of one rank (the largest stage sum per pipeline rank)."""
    predicted = plan.predicted.peak_memory_bytes if plan.predicted is not None else 0.0
    return max([predicted, *(s.memory_bytes for s in plan.stages)])


def check_host(plan: Plan, device: str, worker_argv: list[str]) -> None:
    """Refuse a local launch this machine cannot host (HostTooSmall, with the torchrun and sbatch lines):
    - on GPUs: more ranks than visible devices;
    - on CPU: a plan made for GPUs with more ranks than this machine has cores (a CPU plan may oversubscribe
      cores: slower, not harmful), or, for any plan, ranks x (the plan's predicted per-rank memory + one
      process's baseline, this process's own resident size) above the memory available now.
    mlm-run --simulate-locally skips this check."""
    world = plan.layout.world_size
    problem = None
    if device == "cuda":
        have = torch.cuda.device_count()
        if have < world:
            problem = f"the plan needs {world} GPUs; this machine has {have}"
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        need = world * (per_rank_memory_bytes(plan) + _own_rss_bytes())
        have_mem = _available_memory_bytes()
        if not targets_cpu(plan) and world > cores:
            problem = f"the plan needs {world} {plan.cluster.gpu} GPUs; this machine has no GPU and {cores} CPU cores"
        elif have_mem is not None and need > have_mem:
            problem = (
                f"the plan's {world} ranks need about {need / 2**30:.1f} GiB by its own prediction; "
                f"this machine has {have_mem / 2**30:.1f} GiB available"
            )
    if problem is None:
        return
    argv = [a for a in worker_argv if a != SIMULATE_FLAG]
    torchrun, sbatch = cluster_commands(world, plan.cluster.gpus_per_node, argv)
    raise HostTooSmall(
        f"{problem}. Launch it on the cluster (or pass {SIMULATE_FLAG} to start all {world} processes here on "
        f"CPU anyway):\n  on every node: {torchrun}\n  with SLURM:    {sbatch}"
    )
