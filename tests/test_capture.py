"""Capture on the meta device: exact parameter counts, analytic FLOPs, activations, replication, real model code."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import MODELS, megatron_rows

from mlm.planner.capture.loader import instantiate, load_model_spec
from mlm.planner.capture.presets.registry import PRESETS
from mlm.planner.capture.trace import capture, find_block_group


def exact_params(spec) -> int:
    return sum(p.numel() for p in instantiate(spec, "meta").parameters())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_captures_with_exact_parameter_count(name: str) -> None:
    spec = load_model_spec(name)
    ir = capture(spec)
    assert ir.num_params == exact_params(spec)
    assert sum(layer.params for layer in ir.layers) == ir.num_params
    assert "replicated" in ir.capture_method
    assert ir.layers[-1].name == "loss"


def test_gpt3_175b_matches_narayanan_eq2() -> None:
    ir = capture(load_model_spec("gpt3-175b"))
    l, h, V, s = 96, 12288, 51200, 2048
    eq2 = 12 * l * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
    assert abs(ir.num_params - eq2) / eq2 < 0.005
    assert abs(ir.num_params / 1e9 - 174.6) < 0.005 * 174.6


@pytest.mark.parametrize("row", megatron_rows(), ids=lambda r: r["params_b"])
def test_megatron_presets_match_table1(row: dict[str, str]) -> None:
    name = "megatron-1t" if row["params_b"] == "1008.0" else f"megatron-{row['params_b']}b"
    spec = load_model_spec(name)
    assert (spec.args["n_head"], spec.args["n_embd"], spec.args["n_layer"]) == (
        int(row["heads"]),
        int(row["hidden"]),
        int(row["layers"]),
    )
    params = exact_params(spec)
    l, h, V, seq = int(row["layers"]), int(row["hidden"]), 51200, 2048
    eq2 = 12 * l * h**2 * (1 + 13 / (12 * h) + (V + seq) / (12 * l * h))  # Narayanan et al. 2021, Eq. 2
    assert params == pytest.approx(eq2, rel=1e-5)  # Eq. 2 omits only the final LayerNorm (2h)
    # Table 1 prints one decimal: 1.652B appears as 1.7
    assert abs(params / 1e9 - float(row["params_b"])) <= 0.05 + 1e-3 * float(row["params_b"])


def test_llama_presets_parameter_counts() -> None:
    # Llama 3 herd paper: 8.03B, 70.6B, 405.9B (untied embeddings, vocabulary 128256, GQA with 8 kv heads)
    for name, billions in (("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85)):
        assert abs(exact_params(load_model_spec(name)) / 1e9 - billions) < 0.01


def test_gpt_block_flops_equal_the_analytic_formula() -> None:
    ir = capture(load_model_spec("gpt2", args={"n_layer": 2}), seq_len=256)
    s, h = 256, 768
    block = ir.blocks[0]
    assert block.flops_matmul == 24 * s * h * h  # Narayanan et al. 2021: 24·b·s·h² (+ 4·b·s²·h) per forward
    assert block.flops_attention == 4 * s * s * h


def test_saved_activations_match_korthikanti_for_a_plain_gpt_block() -> None:
    """Korthikanti et al. 2022 count s·b·h·(34 + 5·a·s/h) bytes per layer for a block with materialised attention
    and dropout 0.1 in 16-bit precision. Our rules count the same tensors plus the fp32 mean/rstd LayerNorm keeps
    per row (8 bytes x 2 norms x s), which the paper omits: 0.17·sbh at h=768... so the match is within 1%. The
    block also keeps the s x s boolean causal mask it makes each forward (`bias[..., :T, :T] == 0`, saved by
    masked_fill for backward), which the paper omits too: s² bytes, replicated over tp."""
    a, s, h = 12, 512, 768
    ir = capture(load_model_spec("gpt2", args={"n_layer": 2, "attention": "manual", "dropout": 0.1}), seq_len=s)
    acts = ir.blocks[0].activations
    korthikanti = s * h * (34 + 5 * a * s / h)
    assert acts.total == pytest.approx(korthikanti + s * s, rel=0.01)
    # 24·sbh + 5as² of it lies inside the tensor-parallel region, 10·sbh and the mask on the residual stream
    assert acts.sharded == pytest.approx(s * h * 24 + 5 * a * s * s, rel=0.01)
    assert acts.replicated == pytest.approx(10 * s * h + s * s, rel=0.02)
    assert acts.attn_core == pytest.approx(5 * a * s * s, rel=0.01)
    assert acts.layer_input == 2 * s * h


def test_flash_attention_block_saves_no_score_matrix() -> None:
    """With scaled_dot_product_attention and no dropout the seq x seq terms vanish: q, k, v (6·sbh), the
    attention output (2), its contiguous copy read by the projection (2), GELU input and output (16) inside the
    TP region; the two LayerNorm inputs and outputs (8) on the residual stream; plus fp32 log-sum-exp per row."""
    s, h, a = 512, 768, 12
    acts = capture(load_model_spec("gpt2", args={"n_layer": 2}), seq_len=s).blocks[0].activations
    assert acts.attn_core == 0
    assert acts.sharded == pytest.approx(26 * s * h + 4 * a * s, rel=1e-6)
    assert acts.replicated == pytest.approx(8 * s * h + 2 * 8 * s, rel=1e-6)


def test_block_replication_equals_whole_model_capture() -> None:
    spec = load_model_spec("gpt2", args={"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 512, "block_size": 64})
    cut = capture(spec, seq_len=64)
    whole = capture(spec, seq_len=64, replicate=False)
    assert "replicated x4" in cut.capture_method and "replicated" not in whole.capture_method
    assert [layer.name for layer in cut.layers] == [layer.name for layer in whole.layers]
    for a, b in zip(cut.layers, whole.layers):
        assert (a.params, a.flops_matmul, a.flops_attention, a.flops_elementwise) == (
            b.params,
            b.flops_matmul,
            b.flops_attention,
            b.flops_elementwise,
        ), a.name
        assert a.activations == b.activations, a.name
        assert [op.fqn for op in a.linears] == [op.fqn for op in b.linears]


def test_capture_does_not_grow_with_depth() -> None:
    shallow = capture(load_model_spec("gpt2", args={"n_layer": 2}))
    deep = capture(load_model_spec("gpt2", args={"n_layer": 48}))
    assert deep.num_layers == 48
    # the traced graph is one block either way; only instantiation on meta grows (microseconds per layer)
    assert deep.capture_seconds < shallow.capture_seconds + 2.0


def test_nanogpt_style_code_with_shape_control_flow_and_optional_targets() -> None:
    spec = load_model_spec(str(MODELS / "nanogpt_style.py"))
    ir = capture(spec)
    assert ir.capture_method.startswith("torch.export")
    assert ir.num_params == exact_params(spec)
    assert ir.tied_embeddings
    assert ir.num_heads == 2 and ir.hidden_size == 32 and ir.num_layers == 3
    # targets were passed, so the head ran on every position (not nanoGPT's last-position inference path)
    head = next(layer for layer in ir.layers if layer.name == "lm_head")
    assert head.flops_matmul == 2 * 16 * 32 * 64


def test_symbolic_trace_fast_path_with_custom_inputs_and_loss() -> None:
    spec = load_model_spec(str(MODELS / "mlp_sequential.py"))
    ir = capture(spec, seq_len=8)
    assert ir.capture_method.startswith("symbolic_trace")
    assert ir.num_params == exact_params(spec)
    assert ir.layers[-1].kind == "loss"


@pytest.mark.parametrize("entry, layers_name", [("build_gpt2", "transformer.h"), ("build_llama", "model.layers")])
def test_hugging_face_models_from_configs(entry: str, layers_name: str) -> None:
    pytest.importorskip("transformers")
    spec = load_model_spec(str(MODELS / "hf_models.py"), entry)
    model = instantiate(spec, "meta")
    ir = capture(spec)
    assert ir.num_params == sum(p.numel() for p in model.parameters())
    assert find_block_group(model).fqn == layers_name
    assert ir.num_layers == 2 and ir.hidden_size == 64
    linear_fqns = {op.fqn for layer in ir.blocks for op in layer.linears}
    assert f"{layers_name}.1" in {
        fqn.rsplit(".", 2)[0] if "attn" in fqn or "mlp" in fqn else fqn for fqn in linear_fqns
    } or any(f.startswith(f"{layers_name}.1.") for f in linear_fqns)


def test_model_args_override_preset_defaults() -> None:
    ir = capture(load_model_spec("gpt3-175b", args={"n_layer": 4}))
    assert ir.num_layers == 4
    assert ir.hidden_size == 12288


def test_ir_totals_give_six_n_flops_per_token() -> None:
    ir = capture(load_model_spec("gpt3-175b"))
    # training FLOPs per token ≈ 6·N + 12·l·s·h (attention) — within 2% for GPT-3 (Kaplan et al. 2020, 2.1)
    approx = 6 * ir.num_params + 12 * 96 * 2048 * 12288
    assert ir.model_flops_per_token() == pytest.approx(approx, rel=0.02)
    assert math.isfinite(ir.flops_forward_per_sample)
    assert torch.device("meta")  # nothing was allocated: the capture ran on the meta device
