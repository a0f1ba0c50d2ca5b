"""Plain-data views of what-if answers for the CLI to print, chart and write (no printing here)."""

from __future__ import annotations

from typing import Any

from mlm.planner.capture.graph import ModelIR
from mlm.planner.layout import Layout
from mlm.planner.whatif.arithmetic import MODEL_FLOPS_PER_PARAM_TOKEN, eq4_seconds
from mlm.planner.whatif.questions import Point

ROW_FIELDS = (
    "num_gpus",
    "gpu",
    "cluster",
    "global_batch",
    "layout",
    "layout_short",
    "step_time_s",
    "tokens_per_s",
    "model_tflops_per_gpu",
    "mfu",
    "peak_memory_gib",
    "days",
    "gpu_hours",
    "cost_usd",
    "error",
)


def layout_dict(layout: Layout) -> dict[str, Any]:
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "dp": layout.dp,
        "micro_batch": layout.micro_batch,
        "num_microbatches": layout.num_microbatches,
        "vpp": layout.vpp,
        "sequence_parallel": layout.sequence_parallel,
        "recompute": layout.recompute,
        "zero": layout.zero,
    }


def short_layout(layout: Layout) -> str:
    """'tp4 pp8 dp32 sp mb1 vpp6 rc=none z1': a layout in one table cell."""
    return (
        f"tp{layout.tp} pp{layout.pp} dp{layout.dp}{' sp' if layout.sequence_parallel else ''} "
        f"mb{layout.micro_batch} vpp{layout.vpp} rc={layout.recompute} z{layout.zero}"
    )


def point_row(point: Point) -> dict[str, Any]:
    """One flat row (table, CSV, JSON): the fields of ROW_FIELDS, None where unknown."""
    ev = point.best.evaluation if point.best else None
    t = point.time
    return {
        "num_gpus": point.num_gpus,
        "gpu": point.gpu.name,
        "cluster": point.cluster.name,
        "global_batch": point.global_batch,
        "layout": point.best.layout.describe() if point.best else None,
        "layout_short": short_layout(point.best.layout) if point.best else None,
        "step_time_s": ev.step_time_s if ev else None,
        "tokens_per_s": ev.tokens_per_s if ev else None,
        "model_tflops_per_gpu": ev.model_tflops_per_gpu if ev else None,
        "mfu": ev.mfu if ev else None,
        "peak_memory_gib": ev.peak_memory_bytes / 2**30 if ev else None,
        "days": t.days if t else None,
        "gpu_hours": t.gpu_hours if t else None,
        "cost_usd": t.cost_usd if t else None,
        "error": point.error,
    }


def memory_rows(point: Point) -> list[dict[str, float]]:
    """Per pipeline rank (one GPU each): bytes of parameters, gradients, optimizer, activations, reserve, total."""
    assert point.best is not None
    return [
        {
            "rank": r,
            "params": m.params,
            "grads": m.grads,
            "optimizer": m.optimizer,
            "activations": m.activations,
            "reserve": m.reserve,
            "total": m.total,
        }
        for r, m in enumerate(point.best.evaluation.rank_memory)
    ]


def assumptions(point: Point, ir: ModelIR) -> dict[str, str]:
    """What the answer rests on, one line each, so a reader can judge it."""
    out = {
        "tokens per step": f"{point.global_batch} sequences × {point.seq_len} tokens = {point.tokens_per_step:,} tokens"
    }
    if point.best is not None:
        ev = point.best.evaluation
        out["achieved"] = (
            f"{ev.model_tflops_per_gpu:.0f} TFLOP/s per GPU of model FLOPs "
            f"({ir.model_flops_per_token() / ir.num_params:.2f} per parameter and token, no "
            f"recompute counted) = MFU {100 * ev.mfu:.1f}% of the {point.gpu.bf16_tflops:g} TFLOP/s "
            f"dense bf16 peak"
        )
    c = point.cluster
    out["cluster"] = (
        f"{c.name}: {c.gpus_per_node} × {point.gpu.name} per node, {c.intra_node_gbps:g} GB/s "
        f"NVLink and {c.inter_node_gbps:g} GB/s inter-node per GPU (profiles/clusters/{c.name}.toml)"
    )
    out["price"] = (
        f"${point.price.usd_per_gpu_hour:g}/GPU-hour from {point.price.source}"
        if point.price.usd_per_gpu_hour is not None
        else point.price.source
    )
    if point.time is not None:
        out["time"] = (
            f"{point.time.steps:,} steady-state steps at the predicted step time; no failures, "
            f"restarts, evaluation or checkpoint stalls"
        )
    return out


def eq4_check(point: Point, ir: ModelIR) -> dict[str, float]:
    """mlm's days against Narayanan et al. 2021 Eq. 4 at mlm's own achieved rate.

    The paper's X counts the recompute forward (8 FLOPs per parameter and token); mlm's X does not (6), so
    Eq. 4 at X_paper = X_mlm · 8/6 equals 6·T·P/(n·X_mlm); the remaining gap is the attention and logit FLOPs
    that 6·P leaves out and mlm counts."""
    assert point.best is not None and point.time is not None
    x = point.best.evaluation.model_tflops_per_gpu
    eq4 = eq4_seconds(point.time.tokens, ir.num_params, point.num_gpus, x, MODEL_FLOPS_PER_PARAM_TOKEN)
    return {
        "mlm_days": point.time.days,
        "eq4_days_at_mlm_rate": eq4 / 86400.0,
        "mlm_tflops_per_gpu": x,
        "paper_equivalent_tflops": x * 8.0 / 6.0,
    }
