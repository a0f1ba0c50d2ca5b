"""Prior attention-kernel efficiency curves from published kernel benchmarks (profiles/kernels/*.csv).

A GPU profile's prior attention curve (and, where a stack runs a faster fused kernel, its prior fused-attention
curve) is the fraction of the dense bf16 peak that causal attention reaches in forward + backward, by sequence
length. The kernel papers publish forward and backward throughput separately; with the backward doing 2.5x the
forward's FLOPs (the FlashAttention papers' count), forward + backward reaches 3.5 / (1/forward + 2.5/backward).
"""

from __future__ import annotations

import csv
import importlib.resources

BACKWARD_FLOPS_PER_FORWARD = 2.5


def read_kernel_table(name: str) -> dict[str, list[tuple[int, float, float]]]:
    """kernel -> [(seq, forward TFLOP/s, backward TFLOP/s)] from one file in profiles/kernels/ (comments skipped)."""
    out: dict[str, list[tuple[int, float, float]]] = {}
    with importlib.resources.files("mlm.profiles").joinpath("kernels", name).open() as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        for r in rows:
            out.setdefault(r["kernel"], []).append(
                (int(r["seq"]), float(r["forward_causal_tflops"]), float(r["backward_tflops"]))
            )
    return out


def forward_backward_fractions(points: list[tuple[int, float, float]], peak_tflops: float) -> tuple[float, ...]:
    """Fraction of `peak_tflops` that forward + backward reaches at each point, in the points' order."""
    r = BACKWARD_FLOPS_PER_FORWARD
    return tuple((1.0 + r) / (1.0 / fwd + r / bwd) / peak_tflops for _, fwd, bwd in points)
