"""Mixture-of-experts capture against hand counts from the configs (not from mlm): experts, top-k, shared experts,
which blocks are dense or MoE, total and active parameters exactly, block FLOPs within 5%; MLA's real head dims;
Mixtral 8x7B at full size against its published 46.7B total / 12.9B active parameters."""

from __future__ import annotations

import pytest
from conftest import MODELS

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.inputs import summarize

M = str(MODELS / "block_kinds.py")
C = str(MODELS / "moe_configs.py")
S = 32
V, D, H = 128, 64, 4  # block_kinds.build_hf_moe's vocabulary, hidden size and heads


def _ir(entry, path=M, **args):
    return capture(load_model_spec(path, entry, args), seq_len=S)


def _attn_linears(d, heads, kv, hd):
    """q, k, v and o projections of grouped-query attention (no bias)."""
    return d * heads * hd + 2 * d * kv * hd + heads * hd * d


def _swiglu(d, f):
    return 3 * d * f


def _check(ir, blocks):
    """`blocks`: one (params, active params, forward matmul params per token, attention FLOPs per sample,
    routed (experts, top_k, shared params) or None) per block, in order."""
    assert len(ir.blocks) == len(blocks)
    for layer, (params, _active, _mm, attn, moe) in zip(ir.blocks, blocks):
        assert layer.params == params, layer.name
        if moe is None:
            assert layer.moe is None, layer.name
        else:
            experts, top_k, shared = moe
            assert (layer.moe.num_experts, layer.moe.top_k, layer.moe.shared_params) == (experts, top_k, shared)
        hand = 2 * S * _mm + attn
        assert layer.flops_matmul + layer.flops_attention == pytest.approx(hand, rel=0.05), layer.name
    outside = 2 * V * D + D  # embedding, untied head, final RMSNorm
    assert ir.num_params == outside + sum(b[0] for b in blocks)
    assert ir.active_params == outside + sum(b[1] for b in blocks)
    assert [kind.moe for kind in ir.block_kinds] == sorted({b[4] is not None for b in blocks}, key=[False, True].index)


def test_hf_mixtral_tiny() -> None:
    """MixtralConfig: 4 experts of SwiGLU 96, top-2, 2 kv heads, head_dim 16; every block MoE."""
    ir = _ir("build_hf_moe", kind="mixtral", layers=2)
    hd, e, k, f = D // H, 4, 2, 96
    attn_p, norms, router = _attn_linears(D, H, 2, hd), 2 * D, e * D
    params = attn_p + norms + router + e * _swiglu(D, f)
    active = attn_p + norms + router + k * _swiglu(D, f)
    block = (params, active, attn_p + router + k * _swiglu(D, f), 4 * H * S * S * hd, (e, k, 0))
    _check(ir, [block, block])
    assert (ir.num_experts, ir.experts_top_k) == (e, k)


def test_hf_qwen3_moe_tiny_with_a_dense_first_block() -> None:
    """Qwen3MoeConfig with mlp_only_layers=[0]: a dense SwiGLU-96 block, then MoE blocks of 8 experts of 32, top-2;
    per-head q/k RMSNorms of head_dim 16."""
    ir = _ir("build_qwen3_moe", C, layers=3, mlp_only_layers=[0])
    hd, e, k, f, fm = 16, 8, 2, 96, 32
    attn_p = _attn_linears(D, H, 2, hd)
    common = attn_p + 2 * D + 2 * hd  # + input/post-attention norms, q_norm and k_norm
    attn = 4 * H * S * S * hd
    dense = (common + _swiglu(D, f), common + _swiglu(D, f), attn_p + _swiglu(D, f), attn, None)
    moe_mm = attn_p + e * D + k * _swiglu(D, fm)
    moe = (common + e * D + e * _swiglu(D, fm), common + e * D + k * _swiglu(D, fm), moe_mm, attn, (e, k, 0))
    _check(ir, [dense, moe, moe])


def test_hf_deepseek_v3_tiny_mla_shared_expert_and_dense_first_block() -> None:
    """DeepseekV3Config: first_k_dense_replace=1, 8 routed experts of 32 (top-2) and 1 shared; multi-head latent
    attention with q_lora_rank 32, kv_lora_rank 16, qk head dim 8 + 8 (nope + rope), v head dim 8."""
    ir = _ir("build_deepseek_v3", C, layers=3)
    e, k, f, fm = 8, 2, 96, 32
    q_lora, kv_lora, nope, rope, vd = 32, 16, 8, 8, 8
    qk = nope + rope
    mla = D * q_lora + q_lora * H * qk + D * (kv_lora + rope) + kv_lora * H * (nope + vd) + H * vd * D
    norms = 2 * D + q_lora + kv_lora  # input, post-attention, q_a_layernorm, kv_a_layernorm
    attn = 2 * H * S * S * (qk + vd)  # QK^T over the qk head dim, PV over the (different) v head dim
    shared = _swiglu(D, fm)
    dense = (mla + norms + _swiglu(D, f), mla + norms + _swiglu(D, f), mla + _swiglu(D, f), attn, None)
    routed_mm = mla + e * D + shared + k * _swiglu(D, fm)
    moe = (
        mla + norms + e * D + shared + e * _swiglu(D, fm),
        mla + norms + e * D + shared + k * _swiglu(D, fm),
        routed_mm,
        attn,
        (e, k, shared),
    )
    _check(ir, [dense, moe, moe])


def test_mla_attention_uses_its_own_head_dims() -> None:
    """MLA's attention FLOPs, saved activations and the K/V that context parallelism exchanges follow its qk head
    dim (nope + rope = 16) and v head dim, not hidden/heads = 16 for both: narrowing v from 16 to 8 lowers them."""
    narrow, square = (_ir("build_deepseek_v3", C, layers=2, v_head_dim=v) for v in (8, 16))
    for ir, vd in ((narrow, 8), (square, 16)):
        assert ir.blocks[0].flops_attention == 2 * H * S * S * (16 + vd)
        assert summarize(ir).block_costs[0].kv_bytes == 2 * H * S * (16 + vd)  # bf16 K and V of every head
    saved = [ir.blocks[0].activations.total for ir in (narrow, square)]
    assert saved[0] + 2 * H * S * 8 <= saved[1]  # at least the V tensor shrinks by 8 dims per head


def test_hand_written_top_k_moe_with_shared_expert() -> None:
    """block_kinds.TopKMoE: a router Linear, experts in a ModuleList, one-hot dispatch (every expert runs on meta),
    top-k from torch.topk, a shared expert; 2 dense blocks then 3 MoE blocks."""
    d, f, e, k = 64, 128, 4, 2
    ir = capture(
        load_model_spec(
            M, "build_dense_then_moe", {"dense": 2, "moe": 3, "d": d, "f": f, "experts": e, "top_k": k, "shared": True}
        ),
        seq_len=S,
    )
    fe = f // 2
    attn_p, norms = 4 * d * d, 4 * d  # qkv + proj; two LayerNorms (weight + bias)
    expert = 2 * d * fe
    dense_p = attn_p + norms + 2 * d * f
    moe_p = attn_p + norms + d * e + e * expert + expert
    moe_active = attn_p + norms + d * e + k * expert + expert
    assert [b.moe is not None for b in ir.blocks] == [False, False, True, True, True]
    for b in ir.blocks[2:]:
        assert (b.moe.num_experts, b.moe.top_k, b.moe.shared_params) == (e, k, expert)
    outside = 96 * d + 2 * d + d * 96  # embedding, final LayerNorm, head
    assert ir.num_params == outside + 2 * dense_p + 3 * moe_p
    assert ir.active_params == outside + 2 * dense_p + 3 * moe_active
    attn = 4 * S * S * d
    for b in ir.blocks:
        mm = 4 * d * d + (2 * d * f if b.moe is None else d * e + (k + 1) * expert)
        assert b.flops_matmul + b.flops_attention == pytest.approx(2 * S * mm + attn, rel=0.05), b.name


def test_mixtral_8x7b_active_parameters_match_the_published_figures() -> None:
    """Mistral AI's announcement: 46.7B total parameters, 12.9B used per token (2 of 8 experts)."""
    ir = capture(load_model_spec(M, "build_mixtral_8x7b", {}), seq_len=128)
    assert ir.num_params / 1e9 == pytest.approx(46.7, rel=0.005)
    assert ir.active_params / 1e9 == pytest.approx(12.9, rel=0.005)
    assert (ir.num_experts, ir.experts_top_k) == (8, 2)


@pytest.mark.parametrize(
    ("preset", "total_b", "active_b", "experts"),
    [("mixtral-8x7b", 46.7, 12.9, (8, 2)), ("mixtral-8x22b", 141, 39, (8, 2)), ("qwen3-30b-a3b", 30.5, 3.3, (128, 8))],
)
def test_moe_presets_match_the_published_sizes(preset: str, total_b: float, active_b: float, experts: tuple) -> None:
    """Mistral AI's announcements: 8x7B 46.7B total / 12.9B active, 8x22B 141B / 39B (2 of 8 experts per token);
    Qwen3 Technical Report Table 2: 30.5B / 3.3B (8 of 128); the training FLOPs per token are 6·(active parameters
    less the embedding table) plus attention, counted non-causal as the papers do (4·s·h forward FLOPs per token and
    layer, times 3 with backward), within 5%."""
    from mlm.planner.capture.presets.registry import PRESETS

    seq = 512
    ir = capture(load_model_spec(preset), seq_len=seq)
    args = PRESETS[preset].args
    assert ir.num_params / 1e9 == pytest.approx(total_b, rel=0.01)
    assert ir.active_params / 1e9 == pytest.approx(active_b, rel=0.02)
    assert (ir.num_experts, ir.experts_top_k) == experts
    assert ir.head_dim == args.get("head_dim", args["dim"] // args["n_heads"])
    per_token = 3 * sum(layer.flops_matmul + layer.flops_attention for layer in ir.layers) / seq
    width = args["n_heads"] * ir.head_dim  # the attention's query width (not dim when head_dim is set)
    hand = 6 * (ir.active_params - args["vocab_size"] * args["dim"]) + 12 * args["n_layers"] * seq * width
    assert per_token == pytest.approx(hand, rel=0.05)


def test_experts_kept_whole_under_tp_cost_what_each_tp_rank_runs() -> None:
    """mlm-run leaves the expert banks unsharded under tensor parallelism: each tp rank holds and runs every routed
    expert on the tokens its group shares and reduces nothing over tp (CostOptions.expert_tensor_parallel False);
    Megatron-Core splits them like an MLP (True). Between the two pricings of a Qwen3-MoE at tp 2: nothing is
    created or lost (parameters, activations and bytes moved only change sides), the whole experts hold and
    compute what one device holds and computes (tp 1), the split ones half, and the split ones add one all-reduce
    of the combined output each way per MoE layer; the dense first block is the same under both."""
    from mlm.planner.cost.inputs import for_tp
    from mlm.planner.cost.step_time import rank_params

    inputs = summarize(_ir("build_qwen3_moe", C))
    one = for_tp(inputs, 1)
    whole = for_tp(inputs, 2, expert_tp=False)
    split = for_tp(inputs, 2, expert_tp=True)
    dense, moe = 0, 1
    assert whole.block_costs[dense] == split.block_costs[dense]
    w, s, o = whole.block_costs[moe], split.block_costs[moe], one.block_costs[moe]
    assert w.params_sharded + w.params_replicated == s.params_sharded + s.params_replicated
    assert w.act_sharded + w.act_replicated == pytest.approx(s.act_sharded + s.act_replicated)
    assert w.mem_sharded + w.mem_replicated == pytest.approx(s.mem_sharded + s.mem_replicated)
    experts = o.expert_params
    assert experts > 0
    assert rank_params(w, 2, 1)[1] == rank_params(o, 1, 1)[1] == experts == 2 * rank_params(s, 2, 1)[1]
    assert rank_params(w, 2, 2)[1] == experts / 2  # expert parallelism still splits them
    assert rank_params(s, 2, 1)[0] - rank_params(w, 2, 1)[0] == -experts / 2

    def expert_work(c, tp: int) -> float:  # GEMM FLOPs per rank, as step_time divides them
        return sum(g.rows * g.k * g.n / (1 if g.split == "replicate" else tp) for g in c.gemms if g.expert)

    assert expert_work(w, 2) == expert_work(o, 1) == 2 * expert_work(s, 2) > 0
    assert (s.tp_fwd_count - w.tp_fwd_count, s.tp_bwd_count - w.tp_bwd_count) == (1, 1)
    assert s.tp_fwd_bytes - w.tp_fwd_bytes == pytest.approx(w.output_bytes)  # the combined hidden state
    # under sequence parallelism the whole experts run on the rank's token shard
    sp = for_tp(inputs, 2, True, expert_tp=False).block_costs[moe]
    assert {g.split for g in sp.gemms if g.expert} == {"sequence"}
