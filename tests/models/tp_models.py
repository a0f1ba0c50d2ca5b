"""Small models for the tensor-parallel sharding ILP: MLP blocks of unusual shape and a block with two branches."""

from __future__ import annotations

import torch
from torch import nn


class ChainBlock(nn.Module):
    """x + L_k(gelu(... gelu(L_1(norm(x))))) with widths dim -> w_1 -> ... -> dim."""

    def __init__(self, dim: int, widths: tuple[int, ...]):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        sizes = (dim, *widths, dim)
        self.fcs = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        for i, fc in enumerate(self.fcs):
            h = fc(h)
            if i < len(self.fcs) - 1:
                h = torch.nn.functional.gelu(h)
        return x + h


class BranchBlock(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))) + proj(norm(x)): an MLP branch beside a lone linear."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(h))) + self.proj(h)


class Net(nn.Module):
    def __init__(self, blocks: list[nn.Module], dim: int, vocab: int, seq: int):
        super().__init__()
        self.seq_len = seq
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_chain(
    dim: int = 1024, widths: tuple[int, ...] = (3, 5), n_layers: int = 2, vocab: int = 256, seq: int = 512
) -> nn.Module:
    """widths are multiples of dim: (3, 5) gives dim -> 3 dim -> 5 dim -> dim."""
    return Net([ChainBlock(dim, tuple(w * dim for w in widths)) for _ in range(n_layers)], dim, vocab, seq)


def build_branch(dim: int = 1024, hidden: int = 4096, n_layers: int = 2, vocab: int = 256, seq: int = 512) -> nn.Module:
    return Net([BranchBlock(dim, hidden) for _ in range(n_layers)], dim, vocab, seq)
