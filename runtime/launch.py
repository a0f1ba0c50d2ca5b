"""Process launch: under torchrun / SLURM use their environment; otherwise start the plan's processes locally
with torch's own launcher (torch.distributed.run, i.e. torchrun), or say how to launch on a cluster."""
from __future__ import annotations

import math
import os
import shlex
import socket
from datetime import timedelta

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
    dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timeout)


def init_single_process(device: str) -> None:
    """A world of one, in this process (no launcher needed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed(device)


def launch_local(nproc: int, worker_argv: list[str]) -> int:
    """torchrun --standalone --nproc-per-node N -m mlm.cli.run ARGS, through torch.distributed.run's own API (its
    command line would try to parse the worker's --log as an abbreviation of its --log-dir)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "mlm.cli.run"])
    args.training_script_args = list(worker_argv)
    try:
        run(args)
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        return 2 if codes == {2} else 1
    return 0


def cluster_commands(world: int, gpus_per_node: int, worker_argv: list[str]) -> tuple[str, str]:
    """The torchrun line to run on every node and an sbatch line that does it, for a plan of `world` GPUs."""
    per_node = max(1, min(gpus_per_node, world))
    nodes = math.ceil(world / per_node)
    args = " ".join(shlex.quote(a) for a in worker_argv)
    torchrun = (f"torchrun --nnodes={nodes} --nproc-per-node={per_node} --rdzv-backend=c10d "
                f"--rdzv-endpoint=$MASTER_ADDR:29500 -m mlm.cli.run {args}")
    inner = (f"srun torchrun --nnodes={nodes} --nproc-per-node={per_node} --rdzv-backend=c10d "
             f"--rdzv-endpoint=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1):29500 "
             f"-m mlm.cli.run {args}")
    sbatch = f"sbatch --nodes={nodes} --ntasks-per-node=1 --gpus-per-node={per_node} --wrap {shlex.quote(inner)}"
    return torchrun, sbatch
