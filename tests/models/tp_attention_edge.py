"""An attention whose head count lives in a config object, not in an integer attribute of the module: the
tensor-parallel region check finds no per-rank setting and must say so in one line."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, cfg: SimpleNamespace) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, self.cfg.n_head, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1))
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


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


def build_model(dim: int = 32, n_head: int = 4, n_layer: int = 2, vocab: int = 64) -> nn.Module:
    return Net(SimpleNamespace(dim=dim, n_head=n_head, n_layer=n_layer, vocab=vocab))
