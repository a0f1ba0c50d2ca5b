"""A Llama in the style of Meta's reference code: RMSNorm, SwiGLU MLP, rotary embeddings, grouped-query attention.

Options for the other decoders of this family: `mlp="relu2"` replaces the SwiGLU MLP by two linears around a
squared ReLU (Nemotron-4); `head_dim` sets the heads' width apart from dim // n_heads and `qk_norm` adds an RMSNorm
over each head's queries and keys (Qwen3). With `n_experts > 0` every block's MLP is a routed mixture of SwiGLU
experts (Mixtral's design, Jiang et al. 2024): a linear router, softmax over the experts, the top_k kept and
renormalised, the experts stored as one fused bank of 3-D weights called as `experts(tokens, top_k_index,
top_k_weights)`, the convention transformers >= 5 uses and mlm-run's expert parallelism exchanges tokens for
(runtime/expert_parallel.py).

A model.py-convention file: `build_model(**kwargs)` returns the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    ffn_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    head_dim: int = 0  # 0: dim // n_heads
    qk_norm: bool = False  # RMSNorm of each head's queries and keys before rotary (Qwen3)
    mlp: str = "swiglu"  # or "relu2": w2(relu(w1 x)^2), Nemotron-4
    n_experts: int = 0  # routed experts per MoE block; 0: a dense SwiGLU MLP in every block
    top_k: int = 2  # experts per token
    moe_ffn_dim: int = 0  # each expert's hidden size (0: ffn_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs of channels of x (B, T, H, D) by position-dependent angles."""
    t, d = x.shape[1], x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), freqs)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
        self.theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = rotary(self.q_norm(q), self.theta), rotary(self.k_norm(k), self.theta)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.mlp not in ("swiglu", "relu2"):
            raise ValueError(f"mlp must be 'swiglu' or 'relu2', not {cfg.mlp!r}")
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False) if cfg.mlp == "swiglu" else None
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.relu(self.w1(x)).square())
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """A bank of SwiGLU experts as 3-D weights: gate and up projections fused (E, 2F, D), down (E, D, F)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        ffn = cfg.moe_ffn_dim or cfg.ffn_dim
        self.num_experts = cfg.n_experts
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.n_experts, 2 * ffn, cfg.dim))
        self.down_proj = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, ffn))
        for w in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """x (N, D), top_k_index / top_k_weights (N, k): sum_k weight_k * expert_{index_k}(x) per row."""
        out = torch.zeros_like(x)
        # On the meta device (mlm's capture) routing has no values, so no expert receives a known set of rows and the
        # loop is skipped, as transformers' expert loop over `nonzero()` runs zero times there; capture prices the
        # experts from their weights (planner/capture/moe.py). Looping over all experts instead would trace
        # num_experts data-dependent branches (20 s for Qwen3-30B-A3B's 128).
        for e in () if x.is_meta else range(self.num_experts):
            rows, slot = torch.where(top_k_index == e)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, rows, y * top_k_weights[rows, slot, None].to(y.dtype))
        return out


class MoEFeedForward(nn.Module):
    """Router (a linear over the experts), softmax, top_k renormalised, then the expert bank."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.gate(tokens), dim=-1, dtype=torch.float32)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        return self.experts(tokens, index, weights).reshape(x.shape)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoEFeedForward(cfg) if cfg.n_experts else FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def build_model(**kwargs: object) -> Llama:
    return Llama(LlamaConfig(**kwargs))  # type: ignore[arg-type]
