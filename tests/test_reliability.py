"""Reliability with real processes on gloo: a rank killed mid-step, preemption (SIGTERM / Ctrl-C), automatic
restart through torchrun's elastic agent, and nothing lost: resumed loss trajectories equal uninterrupted ones.

The model is the gpt preset slowed by a sleep in its first block (tests/models/slow_gpt.py) so that a signal lands
in the middle of a step. Each test prints how long the fault took to resolve (pytest -s shows it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_runtime_harness import GPT_ARGS, make_plan

from mlm.planner.plan import save_plan
from mlm.runtime import checkpoint as ckpt

SLOW = Path(__file__).resolve().parent / "models" / "slow_gpt.py"
ARGS = dict(GPT_ARGS, n_layer=2)
STEPS = 8
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MLM_PG_TIMEOUT_S": "30", "MLM_TEST_SLEEP_S": "0.25"}
COMMON = ["--steps", str(STEPS), "--device", "cpu", "--lr", "1e-2"]


def _dp2(tmp: Path) -> Path:
    path = tmp / "dp2.json"
    save_plan(make_plan("gpt", dp=2, micro_batch=2, num_microbatches=1, model_file=SLOW, args=ARGS), path)
    return path


def _start(*args: str, new_session: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mlm.cli.run", *args],
        env=ENV,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=new_session,
    )


def _log(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait_for_steps(proc: subprocess.Popen, log: Path, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(_log(log)) < n:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.02)


def _workers(pid: int) -> dict[int, int]:
    """rank -> pid of mlm-run's worker processes (its children, read from /proc)."""
    kids: list[str] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            kids += Path(f"/proc/{pid}/task/{task}/children").read_text().split()
        except OSError:
            pass
    out = {}
    for kid in kids:
        try:
            env = dict(x.split(b"=", 1) for x in Path(f"/proc/{kid}/environ").read_bytes().split(b"\0") if b"=" in x)
        except OSError:
            continue
        if b"RANK" in env:
            out[int(env[b"RANK"])] = int(kid)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, float]:
    start = time.monotonic()
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err, time.monotonic() - start


def _losses(records: list[dict]) -> dict[int, float]:
    """step -> loss, the last record of each step winning (a restarted run logs some steps twice)."""
    return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The uninterrupted run: STEPS steps of the dp = 2 plan (no sleep needed)."""
    tmp = tmp_path_factory.mktemp("ref")
    proc = subprocess.run(
        [sys.executable, "-m", "mlm.cli.run", str(_dp2(tmp)), *COMMON, "--log", str(tmp / "ref.jsonl")],
        env={**ENV, "MLM_TEST_SLEEP_S": "0"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = _losses(_log(tmp / "ref.jsonl"))
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def test_sigkill_of_one_rank_ends_every_rank_and_keeps_the_checkpoint(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    plan, log, ck = _dp2(tmp_path), tmp_path / "log.jsonl", tmp_path / "ck"
    proc = _start(str(plan), *COMMON, "--save", str(ck), "--save-every", "2", "--log", str(log))
    _wait_for_steps(proc, log, 3)
    workers = _workers(proc.pid)
    assert sorted(workers) == [0, 1]
    os.kill(workers[1], signal.SIGKILL)
    code, err, took = _finish(proc, timeout=60)
    print(f"\nSIGKILL rank 1: mlm-run exited {code} after {took:.1f} s")
    assert took < 60
    assert code == 1
    assert "Traceback" not in err
    assert f"rank 1 (pid {workers[1]}) was killed by SIGKILL" in err
    assert "intact in" in err and "--resume" in err
    assert not any(_alive(pid) for pid in workers.values())
    saved = ckpt.latest_step(ck)
    assert saved is not None and saved >= 2 and saved % 2 == 0
    assert not list(tmp_path.glob("ck.old"))
    # resumable, and under another layout (one process, in this process): the same next loss as the reference
    one = tmp_path / "one.json"
    save_plan(make_plan("gpt", micro_batch=4, num_microbatches=1, model_file=SLOW, args=ARGS), one)
    from mlm.cli.run import main

    os.environ["MLM_TEST_SLEEP_S"] = "0"
    try:
        assert (
            main(
                [
                    str(one),
                    "--steps",
                    str(saved + 1),
                    "--lr-decay-steps",
                    str(STEPS),
                    "--device",
                    "cpu",
                    "--lr",
                    "1e-2",
                    "--resume",
                    str(ck),
                    "--log",
                    str(tmp_path / "resumed.jsonl"),
                ]
            )
            == 0
        )
    finally:
        os.environ.pop("MLM_TEST_SLEEP_S", None)
    [rec] = _log(tmp_path / "resumed.jsonl")
    assert rec["step"] == saved + 1
    assert rec["loss"] == pytest.approx(reference[saved + 1], abs=1e-5)


def test_sigterm_to_mlm_run_saves_and_resume_continues_the_same_trajectory(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    plan, log, ck = _dp2(tmp_path), tmp_path / "log.jsonl", tmp_path / "ck"
    proc = _start(str(plan), *COMMON, "--save", str(ck), "--log", str(log))
    _wait_for_steps(proc, log, 3)
    workers = _workers(proc.pid)
    proc.send_signal(signal.SIGTERM)
    code, err, took = _finish(proc)
    print(f"\nSIGTERM to mlm-run: exited {code} after {took:.1f} s")
    assert code == 0, err[-3000:]
    assert "Traceback" not in err
    done = _log(log)[-1]["step"]
    assert 3 <= done < STEPS
    assert f"stopped by SIGTERM after step {done}: checkpoint of step {done} saved in {ck}" in err
    assert ckpt.latest_step(ck) == done
    assert not any(_alive(pid) for pid in workers.values())
    proc = _start(str(plan), *COMMON, "--resume", str(ck), "--log", str(log))
    code, err, _ = _finish(proc, timeout=180)
    assert code == 0, err[-3000:]
    records = _log(log)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert _losses(records) == reference  # bitwise: nothing lost, nothing changed


def test_ctrl_c_to_the_process_group_stops_every_rank_cleanly(tmp_path: Path) -> None:
    """Ctrl-C in a terminal sends SIGINT to mlm-run and to every worker at once."""
    plan, log, ck = _dp2(tmp_path), tmp_path / "log.jsonl", tmp_path / "ck"
    proc = _start(str(plan), *COMMON, "--save", str(ck), "--log", str(log), new_session=True)
    _wait_for_steps(proc, log, 2)
    workers = _workers(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    code, err, took = _finish(proc)
    print(f"\nCtrl-C (SIGINT to the process group): exited {code} after {took:.1f} s")
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    done = _log(log)[-1]["step"]
    assert "stopped by SIGINT" in err and f"checkpoint of step {done} saved" in err
    assert ckpt.latest_step(ck) == done
    assert not any(_alive(pid) for pid in workers.values())


def test_max_restarts_restarts_a_killed_worker_from_the_last_checkpoint(
    tmp_path: Path, reference: dict[int, float]
) -> None:
    plan, log, ck = _dp2(tmp_path), tmp_path / "log.jsonl", tmp_path / "ck"
    proc = _start(str(plan), *COMMON, "--save", str(ck), "--save-every", "2", "--max-restarts", "1", "--log", str(log))
    _wait_for_steps(proc, log, 3)
    first = _workers(proc.pid)
    os.kill(first[0], signal.SIGKILL)
    code, err, took = _finish(proc, timeout=180)
    print(f"\nSIGKILL rank 0 under --max-restarts 1: run completed (exit {code}) {took:.1f} s later")
    assert code == 0, err[-3000:]
    assert "restart 1, from the checkpoint in" in err
    steps = [r["step"] for r in _log(log)]
    assert steps[-1] == STEPS and len(steps) > STEPS  # some steps ran twice: from the checkpoint on
    assert _losses(_log(log)) == reference  # the redone steps equal the uninterrupted ones, bitwise
    assert ckpt.latest_step(ck) == STEPS
    assert not any(_alive(pid) for pid in first.values())


def test_max_restarts_needs_save(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from mlm.cli.run import main

    assert main([str(_dp2(tmp_path)), "--max-restarts", "2"]) == 2
    assert "--max-restarts needs --save" in capsys.readouterr().err
