"""Plain-data summaries of the IR for the CLI to print (no printing here)."""

from __future__ import annotations

from typing import Any

from mlm.planner.capture.graph import ModelIR


def inspect_summary(ir: ModelIR) -> dict[str, Any]:
    """Per-layer params, forward FLOPs per token and saved-activation bytes per sample, with totals."""
    rows = []
    for layer in ir.layers:
        rows.append(
            {
                "name": layer.name,
                "kind": layer.kind,
                "params": layer.params,
                "flops_per_token": layer.flops_forward / ir.seq_len,
                "matmul_flops_per_token": layer.flops_matmul / ir.seq_len,
                "attention_flops_per_token": layer.flops_attention / ir.seq_len,
                "activation_bytes_per_sample": layer.activations.total,
                "output_bytes_per_sample": layer.output_bytes,
            }
        )
    return {
        "capture_method": ir.capture_method,
        "capture_seconds": round(ir.capture_seconds, 3),
        "seq_len": ir.seq_len,
        "token_inputs": ir.token_inputs,
        "unit": "token" if ir.token_inputs or ir.seq_len > 1 else "sample",  # what the per-token figures count
        "hidden_size": ir.hidden_size,
        "num_heads": ir.num_heads,
        "num_kv_heads": ir.num_kv_heads,
        "head_dim": ir.head_dim,
        "attention_kinds": list(ir.attention_kinds),
        "vocab_size": ir.vocab_size,
        "num_layers": ir.num_layers,
        "num_params": ir.num_params,
        "tied_embeddings": ir.tied_embeddings,
        "moe": (
            {
                "layers": len(ir.moe_layers),
                "num_experts": ir.num_experts,
                "top_k": ir.experts_top_k,
                "active_params": ir.active_params,
            }
            if ir.moe_layers
            else None
        ),
        "warnings": list(ir.warnings),
        "layers": rows,
        "totals": {
            "params": sum(r["params"] for r in rows),
            "flops_per_token": sum(r["flops_per_token"] for r in rows),
            "training_flops_per_token": ir.model_flops_per_token(),
            "activation_bytes_per_sample": sum(r["activation_bytes_per_sample"] for r in rows),
        },
    }
