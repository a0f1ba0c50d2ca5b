"""Tiny models whose blocks are not all alike: dense-then-MoE stacks, layers in a ModuleDict, HF mixtures."""

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class Expert(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w1 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class TopKMoE(nn.Module):
    """Router linear, top-k, experts in a ModuleList; dispatch by one-hot masks (every expert sees every token on
    meta, which is not what a GPU runs: capture must price top_k experts per token)."""

    def __init__(self, d, f, experts, top_k, shared=False):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, f) for _ in range(experts))
        self.shared = Expert(d, f) if shared else None

    def forward(self, x):
        logits = self.router(x)
        weights, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        gate = torch.zeros_like(logits).scatter(-1, index, weights)
        out = sum(gate[..., i : i + 1] * expert(x) for i, expert in enumerate(self.experts))
        return out + self.shared(x) if self.shared is not None else out


class Block(nn.Module):
    def __init__(self, d, heads, ffn):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.ffn = ffn

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class LM(nn.Module):
    def __init__(self, blocks, vocab, d, as_dict=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)}) if as_dict else nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers:
            x = block(x)
        return self.head(self.norm(x))


def build_dense_then_moe(dense=2, moe=3, d=64, heads=4, f=128, experts=4, top_k=2, vocab=96, shared=False):
    """DeepSeek-style: `dense` dense blocks, then `moe` blocks with routed (and optionally shared) experts."""
    blocks = [Block(d, heads, Expert(d, f)) for _ in range(dense)]
    blocks += [Block(d, heads, TopKMoE(d, f // 2, experts, top_k, shared)) for _ in range(moe)]
    return LM(blocks, vocab, d)


def build_dict_layers(n=4, d=64, heads=4, vocab=96):
    """torchtitan-style: identical blocks in an nn.ModuleDict keyed "0", "1", ..."""
    return LM([Block(d, heads, Expert(d, 4 * d)) for _ in range(n)], vocab, d, as_dict=True)


def build_gemma3(layers=4, sliding_window=8):
    """Gemma 3 text: sliding-window layers and full-attention layers alternate (same parameter shapes)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    cfg = Gemma3TextConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=sliding_window,
        layer_types=types,
        max_position_embeddings=64,
        use_cache=False,
    )
    return Gemma3ForCausalLM(cfg)


def build_hf_moe(kind="mixtral", layers=2):
    """Tiny Hugging Face mixtures (fused 3-D expert weights, as transformers 5 builds them)."""
    import transformers as T

    common = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, max_position_embeddings=64, use_cache=False)
    if kind == "mixtral":
        cfg = T.MixtralConfig(
            intermediate_size=96,
            num_hidden_layers=layers,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            **common,
        )
        return T.MixtralForCausalLM(cfg)
    if kind == "qwen3_moe":
        cfg = T.Qwen3MoeConfig(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=layers,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            **common,
        )
        return T.Qwen3MoeForCausalLM(cfg)
    cfg = T.DeepseekV3Config(
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=layers + 1,
        first_k_dense_replace=1,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        **common,
    )
    return T.DeepseekV3ForCausalLM(cfg)


def build_mixtral_8x7b():
    """Mixtral 8x7B at full size from its published Hugging Face config (built on meta by mlm)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        rope_theta=1e6,
        use_cache=False,
    )
    return MixtralForCausalLM(cfg)
