"""The tensor-parallel collectives one transformer block issues per micro-batch, as mlm-run runs them.

Megatron's f and g operators (Shoeybi et al. 2019; with sequence parallelism Korthikanti et al. 2022): each
tensor-parallel region of a block (attention, MLP) gathers its input once and reduces its output once.

    no SP   forward:  one all-reduce of the row-parallel output per region (g)
            backward: one all-reduce of the input gradient, summed over all column-parallel readers (f)
    SP      forward:  one all-gather of the sequence-sharded input + one reduce-scatter of the output per region
            backward: the same pair (the all-gather's backward is a reduce-scatter and vice versa)

Full recompute re-runs the block's forward in its backward with torch's non-reentrant checkpoint, which stops
once the last tensor the backward needs is recomputed: the last region's output reduction (whose result only
feeds the block output, not saved) is not repeated. So the backward adds regions - 1 all-reduces, or regions
all-gathers + regions - 1 reduce-scatters with SP. Selective recompute saves the collectives' outputs (no extra).
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
    recompute: see the module doc; tp == 1: none."""
    if phase not in ("forward", "backward"):
        raise ValueError(f"phase must be 'forward' or 'backward', got {phase!r}")
    if tp <= 1 or regions <= 0:
        return {}
    again = phase == "backward" and recompute == "full"
    gathers = regions * (2 if again else 1)  # SP: the regions' input all-gathers (forward; backward of a RS)
    reduces = regions + (regions - 1 if again else 0)  # SP: output reduce-scatters (forward; backward of an AG)
    nbytes = float(micro_batch * seq_len * hidden) * dtype_bytes
    if sequence_parallel:
        return {ALL_GATHER: (gathers, gathers * nbytes), REDUCE_SCATTER: (reduces, reduces * nbytes)}
    calls = regions + (regions - 1 if again else 0)
    return {ALL_REDUCE: (calls, calls * nbytes)}
