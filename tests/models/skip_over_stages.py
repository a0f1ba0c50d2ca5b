"""A tiny token model with a root-level residual from the embedding to the head: a connection that skips over
every block, so no pipeline cut between the embedding and the head can carry it (tests/test_runtime_stages.py)."""

import torch
from torch import nn


class SkipModel(nn.Module):
    def __init__(self, vocab_size: int = 64, dim: int = 32, n_layer: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(n_layer)])
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        e = self.emb(idx)
        x = e
        for block in self.blocks:
            x = block(x)
        return self.head(x + e)


def build_model(**kwargs: object) -> SkipModel:
    return SkipModel(**kwargs)  # type: ignore[arg-type]
