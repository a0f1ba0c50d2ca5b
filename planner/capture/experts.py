"""Analytic costs of routed experts, added to the layer that holds an MoE module.

Per sample, `tokens` tokens enter the router and each is sent to top_k experts, so the experts process
R = tokens * top_k * capacity_factor token rows in all (capacity_factor 1.0: perfectly balanced). For each expert
GEMM (in -> out) that is 2 * R * in * out forward FLOPs. Saved for backward, per routed row (in the compute
dtype): the gathered input (hidden, once however many GEMMs read it), the outputs of the GEMMs that read it (the
activation function's inputs), the inputs of the later GEMMs (for their weight gradients), and the expert output
(for the gate weight's gradient). Dispatch and combine move each routed row's hidden vector twice each (gather:
read + write; weighted combine: read + write), and the activation function reads its inputs and writes the product.
"""

from __future__ import annotations

from dataclasses import replace

from mlm.planner.capture.graph import Activations, LayerIR, MoEIR


def routed_rows(moe: MoEIR) -> float:
    """Token rows the routed experts process per sample: tokens · top_k · capacity_factor."""
    return moe.tokens * max(moe.top_k, 1) * moe.capacity_factor


def row_elements(moe: MoEIR) -> tuple[float, float]:
    """(saved, moved) elements per routed row (module doc): what backward keeps, and what the memory-bound ops
    (dispatch, activation function, combine) read and write."""
    gemms = moe.expert_gemms
    hidden = gemms[0].in_features if gemms else 0
    first = [g for g in gemms if g.in_features == hidden]
    later = [g for g in gemms if g.in_features != hidden]
    act_elems = sum(g.in_features for g in later)
    saved = hidden + sum(g.out_features for g in first) + act_elems + hidden
    moved = 4 * hidden + sum(g.out_features for g in first) + act_elems
    return float(saved), float(moved)


def with_experts(layer: LayerIR, moe: MoEIR, elem_bytes: int = 2) -> LayerIR:
    """`layer` with the routed experts of `moe` priced (the graph's expert ops were dropped before); activations of
    `elem_bytes` per element (the compute dtype's: 2 for bf16)."""
    routed = routed_rows(moe)
    gemms = moe.expert_gemms
    hidden = gemms[0].in_features if gemms else 0
    per_row_flops = sum(2.0 * g.in_features * g.out_features for g in gemms)
    act_elems = sum(g.in_features for g in gemms if g.in_features != hidden)
    saved_elems, moved_elems = row_elements(moe)
    a = layer.activations
    return replace(
        layer,
        flops_matmul=layer.flops_matmul + routed * per_row_flops,
        flops_elementwise=layer.flops_elementwise + routed * (act_elems + hidden),
        bytes_moved=layer.bytes_moved + routed * moved_elems * elem_bytes,
        activations=Activations(
            sharded=a.sharded + routed * saved_elems * elem_bytes,
            replicated=a.replicated,
            attn_core=a.attn_core,
            layer_input=a.layer_input,
        ),
        moe=moe,
    )
