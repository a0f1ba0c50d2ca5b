"""A hand-written sparse top-k MoE language model, as people write one (Mixtral's first public PyTorch code): a
router Linear, softmax, top-k renormalised, experts in an nn.ModuleList, a loop over the experts that picks each
one's tokens with torch.where and adds its weighted output back with index_add_; an optional shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, f, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    def __init__(self, d: int, f: int, experts: int, top_k: int, shared: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, f) for _ in range(experts))
        self.shared = Expert(d, f) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = x.reshape(-1, d)
        probs = self.gate(h).softmax(-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, expert(h[token]) * weights[token, slot, None])
        if self.shared is not None:
            out = out + self.shared(h)
        return out.reshape(b, t, d)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, moe: SparseMoE) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.moe(self.ln2(x))


class MoELM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, f: int, experts: int, top_k: int, shared: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads, SparseMoE(d, f, experts, top_k, shared)) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(vocab=128, d=64, heads=4, layers=2, f=64, experts=4, top_k=2, shared=True):
    return MoELM(vocab, d, heads, layers, f, experts, top_k, shared)
