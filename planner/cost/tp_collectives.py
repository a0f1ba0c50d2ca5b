"""The tensor-parallel collectives one transformer block issues per micro-batch, as mlm-run runs them.

Megatron's f and g operators (Shoeybi et al. 2019; with sequence parallelism Korthikanti et al. 2022): each
tensor-parallel region of a block (attention, MLP) gathers its input once and reduces its output once.

    no SP   forward:  one all-reduce of the row-parallel output per region (g)
            backward: one all-reduce of the input gradient, summed over all column-parallel readers (f)
    SP      forward:  one all-gather of the sequence-sharded input + one reduce-scatter of the output per region
            backward: the same pair (the all-gather's backward is a reduce-scatter and vice versa)

Under full recompute the backward also re-runs the forward, so it repeats the forward's collectives.
runtime/tensor_parallel.py issues exactly these (tests/test_tp_runtime.py counts them with CommDebugMode), and
cost/step_time.py prices the same numbers (cost/inputs.py: tp_fwd_count = row-parallel linears, tp_bwd_count =
distinct inputs of column-parallel linears; an SP all-gather + reduce-scatter pair has an all-reduce's ring bytes).
Pure: no torch import.
"""

from __future__ import annotations

from typing import Literal

ALL_REDUCE = "all_reduce"  # op names as torch's CommDebugMode reports them (c10d_functional.<name>)
ALL_GATHER = "all_gather_into_tensor"
REDUCE_SCATTER = "reduce_scatter_tensor"


def tp_block_collectives(
    tp: int,
    sequence_parallel: bool,
    micro_batch: int,
    seq_len: int,
    hidden: int,
    dtype_bytes: float = 2.0,
    phase: Literal["forward", "backward"] = "forward",
    recompute: Literal["none", "selective", "full"] = "none",
    regions: int = 2,
) -> dict[str, tuple[int, float]]:
    """Collectives of one block in one micro-batch's forward or backward: CommDebugMode op name -> (count, bytes).

    bytes is the total over the calls of the full (unsharded) tensor each one carries: micro_batch * seq_len *
    hidden * dtype_bytes per call (an all-gather's output, a reduce-scatter's input, an all-reduce's buffer), the
    dry run's convention (runtime/dry_run.py). `regions`: tensor-parallel regions per block (attention and MLP).
    Selective recompute re-runs no collective (its policy saves the collectives' outputs); tp == 1: none."""
    if phase not in ("forward", "backward"):
        raise ValueError(f"phase must be 'forward' or 'backward', got {phase!r}")
    if tp <= 1 or regions <= 0:
        return {}
    passes = 2 if phase == "backward" and recompute == "full" else 1
    calls = regions * passes
    nbytes = float(micro_batch * seq_len * hidden) * dtype_bytes
    if sequence_parallel:
        return {ALL_GATHER: (calls, calls * nbytes), REDUCE_SCATTER: (calls, calls * nbytes)}
    return {ALL_REDUCE: (calls, calls * nbytes)}
