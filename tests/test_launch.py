"""Launches that cannot hurt: SLURM host lists, refusing plans this machine cannot host, workers that die with
the launcher, and a two-agent multi-node torchrun on localhost matching one process."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_runtime_harness import free_port, make_plan

from mlm.planner.plan import save_plan
from mlm.runtime.launch import HostTooSmall, adopt_slurm_env, check_host, expand_hostlist

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MLM_PG_TIMEOUT_S": "30"}
GIB = 2**30


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node[001-004,010]", ["node001", "node002", "node003", "node004", "node010"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("gpu7", ["gpu7"]),
        ("r[1-2]-n[08-09]", ["r1-n08", "r1-n09", "r2-n08", "r2-n09"]),
        ("x[9-11],y[01,03]", ["x9", "x10", "x11", "y01", "y03"]),
    ],
)
def test_slurm_host_lists_expand(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["node[1-2", "node]1[", "node[a-b]", ""])
def test_malformed_host_lists_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(bad)


def test_master_addr_is_the_first_host(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "MASTER_ADDR", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        # set, then delete: monkeypatch records only keys that exist, and adopt_slurm_env writes these five
        # into os.environ, where they would make every later in-process run rendezvous with node001
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_NODELIST", "node[001-004,010]")
    adopt_slurm_env()
    assert os.environ["MASTER_ADDR"] == "node001"
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("3", "8")


def test_host_check_rule() -> None:
    """A CPU plan may oversubscribe cores; a GPU plan may not; no plan may need more memory than is available."""
    cpu_plan = make_plan("gpt", pp=2, dp=4, micro_batch=1, num_microbatches=2)  # 8 ranks, made for "cpu"
    check_host(cpu_plan, "cpu", ["p.json"])
    gpu_plan = dataclasses.replace(cpu_plan, cluster=dataclasses.replace(cpu_plan.cluster, gpu="a100-80gb"))
    cores = len(os.sched_getaffinity(0))
    if cores < 8:
        with pytest.raises(HostTooSmall, match="no GPU and"):
            check_host(gpu_plan, "cpu", ["p.json"])
    huge = [dataclasses.replace(s, memory_bytes=1e15) for s in cpu_plan.stages]  # 1 PB per rank
    with pytest.raises(HostTooSmall, match="GiB by its own prediction") as e:
        check_host(dataclasses.replace(cpu_plan, stages=huge), "cpu", ["p.json", "--simulate-locally"])
    assert "torchrun --nnodes=1 --nproc-per-node=8" in str(e.value) and "--simulate-locally'" not in str(e.value)


def test_readme_1024_gpu_plan_is_refused_quickly(tmp_path: Path) -> None:
    plan = tmp_path / "p.json"
    proc = subprocess.run(
        [sys.executable, "-m", "mlm.cli.plan", "gpt3-175b", "--gpus", "1024", "--out", str(plan)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "mlm.cli.run", str(plan)], env=ENV, capture_output=True, text=True, timeout=60
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "error" in lines[0] and "1024" in lines[0] and "--simulate-locally" in lines[0]
    assert any("torchrun --nnodes=128 --nproc-per-node=8" in ln for ln in lines[1:])
    assert any(ln.strip().startswith("with SLURM:    sbatch --nodes=128") for ln in lines[1:])
    assert "Traceback" not in proc.stderr
    assert elapsed < 30, elapsed  # seconds, not the minute it took 1024 processes to exhaust memory
    assert (
        "--simulate-locally"
        in subprocess.run(
            [sys.executable, "-m", "mlm.cli.run", "--help"], env=ENV, capture_output=True, text=True, timeout=60
        ).stdout
    )


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_workers_die_with_a_killed_launcher(tmp_path: Path) -> None:
    save_plan(make_plan("gpt", dp=2, micro_batch=2, num_microbatches=1), tmp_path / "dp2.json")
    log = tmp_path / "log.jsonl"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "mlm.cli.run", str(tmp_path / "dp2.json"), "--steps", "100000", "--device", "cpu"]
        + ["--log", str(log)],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
            assert launcher.poll() is None, "mlm-run ended before training"
            time.sleep(0.5)
        workers = _children(launcher.pid)
        assert len(workers) == 2, workers  # torchrun's agent runs inside mlm-run; the workers are its children
    finally:
        launcher.send_signal(signal.SIGKILL)  # no handler can run: only the kernel can clean up
        launcher.wait()
    deadline = time.monotonic() + 15
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [w for w in workers if _alive(w)]
    for w in left:
        os.kill(w, signal.SIGKILL)
    assert not left, f"workers {left} outlived the launcher"


def test_two_torchrun_agents_on_localhost_match_one_process(tmp_path: Path) -> None:
    """--nnodes 2 with c10d rendezvous: two agents, one worker each (pp = 2 over 'two nodes'), log the losses of
    one process."""
    save_plan(make_plan("gpt", pp=2, micro_batch=2, num_microbatches=2), tmp_path / "pp2.json")
    save_plan(make_plan("gpt", micro_batch=4, num_microbatches=1), tmp_path / "one.json")
    common = ["--steps", "2", "--device", "cpu", "--optimizer", "sgd", "--lr", "0.1"]
    port = free_port()
    logs = [tmp_path / "node0.jsonl", tmp_path / "node1.jsonl"]
    agents = []
    for i, log in enumerate(logs):
        # a script rather than `-m mlm.cli.run ARGS`: torchrun's own parser takes --log for its --log-dir
        script = tmp_path / f"worker{i}.py"
        argv = [str(tmp_path / "pp2.json"), *common, "--log", str(log)]
        script.write_text(f"import sys\nfrom mlm.cli.run import main\nsys.exit(main({argv!r}))\n")
        agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
        agent += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=mlm-test", str(script)]
        agents.append(subprocess.Popen(agent, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    errs = [a.communicate(timeout=240)[1] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(e[-2000:] for e in errs)
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlm.cli.run",
            str(tmp_path / "one.json"),
            *common,
            "--log",
            str(tmp_path / "one.jsonl"),
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    written = [log for log in logs if log.exists()]
    assert len(written) == 1  # only global rank 0 logs, on whichever agent got it
    two = [json.loads(x)["loss"] for x in written[0].read_text().splitlines()]
    ref = [json.loads(x)["loss"] for x in (tmp_path / "one.jsonl").read_text().splitlines()]
    assert len(two) == 2 and two == pytest.approx(ref, abs=1e-5)
