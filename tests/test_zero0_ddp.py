"""zero 0 runs DDP's semantics on every path (runtime/data_parallel.py): the data-parallel group carries only
gradient all-reduces (no FSDP all-gather or reduce-scatter), once per step per gradient group, and the bf16 path
(fp32 master weights, fp32 reduction) trains what one bf16 process trains.

Collectives are counted by wrapping the torch.distributed entry points FSDP2 calls (all_gather_single,
reduce_scatter_single, all_reduce, ...); DDP's own reducer calls the process group from C++, so the DDP cases are
identified by their wrapper type and their gradients by the parity tests (tests/test_runtime_parity.py)."""

from __future__ import annotations

import collections
import dataclasses
from functools import partial
from typing import Any

import pytest
import torch.distributed as dist
from test_runtime_harness import make_plan, run_workers

from mlm.runtime.train import RunOptions, run_steps, setup, train

COLLECTIVES = (
    "all_reduce",
    "all_gather_single",
    "reduce_scatter_single",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
)
OPTS = RunOptions(steps=2, optimizer="adamw", lr=1e-3, seed=0)


def _count(rank: int, runs: list[tuple[Any, RunOptions]]) -> list[tuple[str, dict[str, int], list[float]]]:
    """Per run: the wrapper type of the first stage, calls per collective over dp in step 2, the losses."""
    out = []
    for plan, opts in runs:
        rt = setup(plan, dataclasses.replace(opts, steps=1))
        run_steps(rt)  # step 1: the pipeline's shape inference, bucket rebuild
        dp_ranks = {rt.info.global_rank(rt.info.pp_rank, d, rt.info.tp_rank) for d in range(plan.layout.dp)}
        rt.opts = dataclasses.replace(opts, steps=2)
        rt.start_step = 1
        counts = _counted_step(rt, dp_ranks)
        out.append((type(rt.runners[0]).__name__, dict(counts), [r.loss for r in rt.records]))
    return out


def _counted_step(rt: Any, dp_ranks: set[int]) -> dict[str, int]:
    """Run the remaining steps with the torch.distributed collectives over the dp group counted by name."""
    counts: collections.Counter[str] = collections.Counter()
    originals = {n: getattr(dist, n) for n in COLLECTIVES}

    def wrapped(*args: Any, _name: str = "", **kwargs: Any) -> Any:
        group = kwargs.get("group")
        if group is not None and set(dist.get_process_group_ranks(group)) == dp_ranks:
            counts[_name] += 1
        return originals[_name](*args, **kwargs)

    try:
        for n in COLLECTIVES:
            setattr(dist, n, partial(wrapped, _name=n))
        run_steps(rt)
    finally:
        for n, f in originals.items():
            setattr(dist, n, f)
    return dict(counts)


def _losses(rank: int, runs: list[tuple[Any, RunOptions]]) -> list[list[float]]:
    return [[r.loss for r in train(plan, opts).records] for plan, opts in runs]


def test_zero0_reduces_with_all_reduce_only() -> None:
    """pp2 x dp2 under bf16 (replicate(), one group per layer) and tp2 x dp2 in fp32 (replicate() over TP
    DTensors) issue only all-reduces over dp; pp2 x dp2 in fp32 runs torch's DDP (it crashed at step 2 before)."""
    bf16 = dataclasses.replace(OPTS, compute_dtype="bf16")
    pp_dp = make_plan("gpt", pp=2, dp=2, micro_batch=1, num_microbatches=2)
    tp_dp = make_plan("gpt", tp=2, dp=2, micro_batch=1, num_microbatches=2)
    runs = [(pp_dp, bf16), (tp_dp, OPTS), (pp_dp, OPTS)]
    result = run_workers(4, _count, runs)
    for rank, per_run in enumerate(result):
        (w1, c1, l1), (w2, c2, _), (w3, _, l3) = per_run
        assert (w1, w2, w3) == ("ReplicateStageModule", "ReplicateStageModule", "DistributedDataParallel"), rank
        for counts in (c1, c2):
            assert set(counts) == {"all_reduce"}, (rank, counts)  # no FSDP all-gather / reduce-scatter
        # one all-reduce per gradient group in the step: every parameter-holding layer of the stage
        stage_layers = len(pp_dp.stages[rank // 2].layers) - (rank // 2 == 1)  # the last stage's "loss" has none
        assert c1["all_reduce"] <= stage_layers + 1, (rank, c1)
        assert len(l1) == len(l3) == 2
    one = make_plan("gpt", micro_batch=1, num_microbatches=4)
    (ref_bf16,) = run_workers(1, _losses, [(one, bf16)])[0][:1]
    assert result[0][0][2] == pytest.approx(ref_bf16, abs=2e-2)  # bf16 sums in another order
    assert result[0][2][2] == pytest.approx(run_workers(1, _losses, [(one, OPTS)])[0][0], abs=1e-5)
