"""One attention block whose scaled_dot_product_attention call is written four ways: causal (is_causal=True), with
an explicit causal mask tensor, with a sliding-window mask (a quarter of the sequence), or bidirectional (an
encoder: no mask, no causal flag).

A model.py-convention file: build_model(call="causal" | "mask" | "window" | "full", dim, heads, layers, vocab)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, call: str) -> None:
        super().__init__()
        self.heads, self.call = heads, call
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(self.norm(x)).chunk(3, -1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in qkv)
        if self.call == "causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.call in ("mask", "window"):
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            if self.call == "window":
                mask = mask & ~mask.tril(-(t // 4))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, c))


class Model(nn.Module):
    def __init__(self, call: str, dim: int, heads: int, layers: int, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, call) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(call: str = "causal", dim: int = 64, heads: int = 4, layers: int = 2, vocab: int = 128) -> Model:
    return Model(call, dim, heads, layers, vocab)
