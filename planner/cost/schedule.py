"""Pipeline schedules: in-flight micro-batches per virtual stage, and the step time of 1F1B / interleaved 1F1B.

Virtual stage i (of S = pp·vpp) runs on pipeline rank i mod pp as its model chunk i // pp (Narayanan et al. 2021,
Sec. 2.2.2). m is the number of micro-batches per step.
"""

from __future__ import annotations


def inflight(pp: int, vpp: int, m: int) -> tuple[float, ...]:
    """Micro-batches whose activations virtual stage i holds at its rank's peak (length pp·vpp).

    1F1B (vpp = 1): rank r runs pp−r−1 warm-up forwards, then one more before its first backward, so it holds
    min(m, pp−r) (Narayanan et al. 2021; Korthikanti et al. 2022, Sec. 4.1: the first stage holds pp).
    Interleaved: Megatron-LM's schedule runs (pp−r−1)·2 + (vpp−1)·pp warm-up forwards on rank r, visiting the
    chunks in groups of pp micro-batches; at the peak (one more forward) we count how many of those forwards belong
    to each chunk. Summed over rank 0's chunks and divided by vpp (a chunk holds 1/vpp of the rank's layers) this is
    pp·(1 + (pp−1)/(pp·vpp)) micro-batches of the whole rank's layers, Korthikanti et al.'s figure.
    """
    out = [0.0] * (pp * vpp)
    for r in range(pp):
        if vpp == 1:
            out[r] = float(min(m, pp - r))
            continue
        n = min((pp - r - 1) * 2 + (vpp - 1) * pp + 1, m * vpp)
        cycles, rest = divmod(n, pp * vpp)
        for c in range(vpp):
            out[c * pp + r] = float(min(m, cycles * pp + min(max(rest - c * pp, 0), pp)))
    return tuple(out)


def pipeline_time(rank_times: list[float], m: int, vpp: int) -> tuple[float, float]:
    """Time of the forward/backward part of a step and the bubble within it, given each rank's time per
    micro-batch (all of its chunks, forward + backward + recompute + communication).

    The busiest rank works m·t_max; filling and draining the pipeline adds the other ranks' time once, divided by
    vpp for the interleaved schedule. With equal ranks the bubble is (pp−1)/(vpp·m) of the ideal m·t
    (Narayanan et al. 2021, Sec. 2.2.1-2.2.2).
    """
    t_max = max(rank_times)
    bubble = (sum(rank_times) - t_max) / vpp
    return m * t_max + bubble, bubble


def bubble_fraction(pp: int, vpp: int, m: int) -> float:
    """The bubble over the ideal time for balanced stages: (pp−1)/(vpp·m)."""
    return (pp - 1) / (vpp * m)
