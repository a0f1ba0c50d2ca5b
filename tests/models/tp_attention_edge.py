"""Grouped-query attention with one fused q | k | v projection cut into unequal chunks (MPT's and ChatGLM's
`qkv.split([q, kv, kv])`), its head counts read from a config object the model shares (as Hugging Face
attention reads `self.config`), or, with `heads_from="module_constant"`, from constants outside any object the
tensor-parallel region check can set (it must then say so in one line)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

N_HEAD, N_KV = 4, 2  # the heads_from="module_constant" variant's head counts


class Attention(nn.Module):
    def __init__(self, cfg: SimpleNamespace) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.dim, (cfg.n_head + 2 * cfg.n_kv) * cfg.head_dim)
        self.proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        heads, kv = (self.cfg.n_head, self.cfg.n_kv) if self.cfg.heads_from == "config" else (N_HEAD, N_KV)
        d = self.cfg.head_dim
        q, k, v = self.qkv(x).split([heads * d, kv * d, kv * d], dim=-1)
        q = q.view(b, t, -1, d).transpose(1, 2)
        k, v = (y.view(b, t, -1, d).transpose(1, 2).repeat_interleave(heads // kv, dim=1) for y in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, cfg: SimpleNamespace) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


class Net(nn.Module):
    def __init__(self, cfg: SimpleNamespace) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(dim: int = 32, n_layer: int = 2, vocab: int = 64, heads_from: str = "config") -> nn.Module:
    cfg = SimpleNamespace(dim=dim, n_head=N_HEAD, n_kv=N_KV, head_dim=dim // N_HEAD, n_layer=n_layer, vocab=vocab)
    return Net(SimpleNamespace(**vars(cfg), heads_from=heads_from))
