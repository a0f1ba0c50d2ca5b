"""Reliability of saves and steps, in forked gloo workers: a kill at any point of a save leaves a loadable latest
checkpoint, a full disk is reported and keeps the previous one, non-finite steps stop (or are skipped) without a
NaN reaching a checkpoint, and loading a checkpoint never runs code from it."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import pickle
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_runtime_harness import GPT_ARGS, free_port, make_plan, run_workers

from mlm.planner.errors import PlanError
from mlm.runtime import checkpoint as ckpt
from mlm.runtime.train import RunOptions, full_parameters, save_checkpoint, setup, train

ARGS = dict(GPT_ARGS, n_layer=2)
PLAN1 = make_plan("gpt", micro_batch=4, num_microbatches=1, args=ARGS)
PLAN_DP2 = make_plan("gpt", dp=2, micro_batch=2, num_microbatches=1, args=ARGS)
BASE = RunOptions(steps=4, optimizer="adamw", lr=1e-2, seed=0)


# ---- a kill in the middle of a save ----


def _die_during_save(point: str, opts: RunOptions, port: int) -> None:
    """Child: train 2 steps (saved), then save step 3 and die by os._exit at `point`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=30))
    rt = train(PLAN1, dataclasses.replace(opts, steps=2))
    if point == "write":  # half the shards written, no metadata, no meta file
        real = ckpt.dcp.save

        def partial(state: dict, checkpoint_id: str) -> None:
            half = dict(list(state.items())[: len(state) // 2])
            real(half, checkpoint_id=checkpoint_id)
            os._exit(9)

        ckpt.dcp.save = partial
    else:  # "rename": after DIR -> DIR.old, before DIR.tmp -> DIR
        real_rename = Path.rename

        def rename(self: Path, target: Any) -> Any:
            if self.name == f"{opts.save.name}.tmp-3":  # DIR -> DIR.old has happened
                os._exit(9)
            return real_rename(self, target)

        Path.rename = rename  # type: ignore[method-assign]
    save_checkpoint(rt, 3)
    os._exit(0)


def _fork(target: Any, *args: Any) -> int:
    proc = mp.get_context("fork").Process(target=target, args=args)
    proc.start()
    proc.join(120)
    return proc.exitcode


def _resume_losses(rank: int, opts: RunOptions) -> tuple[int, list[float]]:
    rt = train(PLAN1, opts)
    return rt.start_step, [r.loss for r in rt.records]


@pytest.mark.parametrize("point", ["write", "rename"])
def test_a_kill_during_save_leaves_the_previous_checkpoint_latest(tmp_path: Path, point: str) -> None:
    ck = tmp_path / "ck"
    opts = dataclasses.replace(BASE, save=ck, lr_decay_steps=4)
    assert _fork(_die_during_save, point, opts, free_port()) == 9
    assert ckpt.latest_step(ck) == 2  # DIR (or DIR.old after a kill between the renames) holds step 2
    if point == "rename":
        assert not ck.exists() and (tmp_path / "ck.old").is_dir()
    straight = run_workers(1, _resume_losses, dataclasses.replace(BASE))[0][1]
    # resume from what the kill left, then save again: the next save recovers DIR.old and cleans up
    start, losses = run_workers(1, _resume_losses, dataclasses.replace(opts, resume=ck))[0]
    assert start == 2 and losses == straight[2:]
    assert ckpt.latest_step(ck) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


# ---- a full disk ----


def _full_disk_on_rank1(rank: int, opts: RunOptions) -> str:
    from torch.distributed.checkpoint import filesystem

    rt = train(PLAN_DP2, opts)  # a good checkpoint of step 2
    real = filesystem.FileSystem.create_stream

    def full(self: Any, path: Any, mode: str) -> Any:
        if rank == 1 and "w" in mode and str(path).endswith(".distcp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, path, mode)

    filesystem.FileSystem.create_stream = full  # type: ignore[method-assign]
    try:
        save_checkpoint(rt, 3)
    except PlanError as e:
        return str(e)
    finally:
        filesystem.FileSystem.create_stream = real  # type: ignore[method-assign]
    return "saved"


def test_a_full_disk_is_reported_and_the_previous_checkpoint_is_kept(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    messages = run_workers(2, _full_disk_on_rank1, dataclasses.replace(BASE, steps=2, save=ck))
    for msg in messages:  # every rank knows, none hangs
        assert "cannot write the checkpoint of step 3" in msg and "No space left on device" in msg, msg
        assert "the previous checkpoint (step 2)" in msg and "is kept" in msg
    assert ckpt.latest_step(ck) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # the partial write was removed


# ---- non-finite steps ----


def _train_with(rank: int, plan: Any, opts: RunOptions, inject: str) -> tuple[str, list, dict]:
    os.environ["MLM_INJECT_NONFINITE"] = inject
    try:
        rt = setup(plan, opts)
        try:
            from mlm.runtime.train import run_steps

            run_steps(rt)
            outcome = "ok"
        except PlanError as e:
            outcome = str(e)
        return outcome, [(r.step, r.loss, r.skipped) for r in rt.records], full_parameters(rt)
    finally:
        os.environ.pop("MLM_INJECT_NONFINITE", None)


def test_a_nan_gradient_on_one_rank_stops_every_rank_before_the_update(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    opts = dataclasses.replace(BASE, steps=6, save=ck, save_every=2)
    results = run_workers(2, _train_with, PLAN_DP2, opts, "3:grad:1")
    for outcome, records, params in results:
        assert outcome.startswith("step 3: non-finite gradient norm"), outcome
        assert "stopped before the optimizer step" in outcome and "(step 2) is untouched" in outcome
        assert [r[0] for r in records] == [1, 2]
        assert all(torch.isfinite(v).all() for v in params.values())
    assert ckpt.latest_step(ck) == 2


def test_skip_nonfinite_drops_the_step_and_counts_it(tmp_path: Path) -> None:
    opts = dataclasses.replace(BASE, steps=4, skip_nonfinite=True, save=tmp_path / "ck")
    results = run_workers(2, _train_with, PLAN_DP2, opts, "2:loss")
    for outcome, records, params in results:
        assert outcome == "ok"
        assert [(s, sk) for s, _, sk in records] == [(1, False), (2, True), (3, False), (4, False)]
        assert records[1][1] != records[1][1]  # the skipped step logs its NaN loss
        assert all(torch.isfinite(v).all() for v in params.values())
    for name, value in results[0][2].items():  # the ranks stayed in step with each other
        assert torch.equal(value, results[1][2][name]), name
    assert ckpt.latest_step(tmp_path / "ck") == 4


def test_cli_nonfinite_loss_exits_2_naming_the_step(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlm.cli.run import main
    from mlm.planner.plan import save_plan

    save_plan(PLAN1, tmp_path / "p.json")
    monkeypatch.setenv("MLM_INJECT_NONFINITE", "2")
    common = [str(tmp_path / "p.json"), "--steps", "3", "--device", "cpu", "--log", str(tmp_path / "log.jsonl")]
    assert main(common) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "step 2: non-finite loss" in err and "--skip-nonfinite" in err
    assert main([*common, "--skip-nonfinite"]) == 0
    err = capsys.readouterr().err
    assert "1 non-finite step(s) skipped: [2]" in err
    records = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records[-3:]] == [False, True, False]


def _save_nan_state(rank: int, opts: RunOptions) -> str:
    rt = train(PLAN1, opts)
    with torch.no_grad():
        rt.params[0].fill_(float("nan"))
    try:
        save_checkpoint(rt, 99)
    except PlanError as e:
        return str(e)
    return "saved"


def test_a_nan_state_is_never_saved_over_a_checkpoint(tmp_path: Path) -> None:
    [msg] = run_workers(1, _save_nan_state, dataclasses.replace(BASE, steps=1, save=tmp_path / "ck"))
    assert "NaN or infinite" in msg and "not saving" in msg
    assert ckpt.latest_step(tmp_path / "ck") == 1


# ---- loading runs no code from the checkpoint ----


class _Boom:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch PWNED",))


def _load(rank: int, opts: RunOptions) -> str:
    try:
        train(PLAN1, opts)
    except PlanError as e:
        return str(e)
    return "loaded"


def test_loading_a_checkpoint_never_unpickles_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ck = tmp_path / "ck"
    run_workers(1, _load, dataclasses.replace(BASE, steps=1, save=ck))
    (ck / ".metadata").write_bytes(pickle.dumps(_Boom()))
    [msg] = run_workers(1, _load, dataclasses.replace(BASE, steps=2, resume=ck))
    assert "cannot load" in msg and "posix.system" in msg, msg
    assert not (tmp_path / "PWNED").exists()


def test_a_pickled_object_entry_is_refused_not_unpickled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    monkeypatch.chdir(tmp_path)
    ck = tmp_path / "ck"
    with pytest.warns(UserWarning):  # DCP without a process group: one process
        dcp.save({"model/x": _Boom()}, checkpoint_id=str(ck))
    (ck / ckpt.META_FILE).write_text(json.dumps({"step": 1}))
    with pytest.raises(ckpt.CheckpointError, match="not a tensor"), pytest.warns(UserWarning):
        ckpt.load(ck, {"model/x": torch.zeros(1)})
    assert not (tmp_path / "PWNED").exists()
