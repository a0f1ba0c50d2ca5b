"""Models that exercise capture's choices rather than its arithmetic.

- `Capped`: refuses sequences longer than it was built for and names no context attribute.
- `CountedBlocks`: iterates its blocks by a stored count (cutting the container to one block breaks it), so
  capture falls back to the whole model.
- `TwoInputs`: a forward with two required tensors mlm cannot guess.
- `AuxHead`: parameters the captured forward never reads.
- `TablePositions`: an nn.Embedding position table shorter than the default sequence length.
"""

import torch
from torch import nn


class Capped(nn.Module):
    def __init__(self, vocab=50, width=16, limit=100):
        super().__init__()
        self.limit = limit
        self.emb = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, vocab)

    def forward(self, ids):
        if ids.shape[1] > self.limit:
            raise ValueError(f"sequence of {ids.shape[1]} tokens exceeds {self.limit}")
        return self.proj(self.emb(ids))


def build_capped(**kwargs):
    return Capped(**kwargs)


class CountedBlocks(nn.Module):
    def __init__(self, vocab=40, width=16, count=3):
        super().__init__()
        self.count = count
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(count))
        self.proj = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        for i in range(self.count):
            x = x + self.blocks[i](x)
        return self.proj(x)


def build_counted(**kwargs):
    return CountedBlocks(**kwargs)


class TwoInputs(nn.Module):
    def __init__(self, vocab=40, width=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, vocab)

    def forward(self, source_ids, target_ids):
        return self.proj(self.emb(source_ids) + self.emb(target_ids))


def build_two_inputs(**kwargs):
    return TwoInputs(**kwargs)


class AuxHead(nn.Module):
    """A language model with a value head its training forward does not run (as RLHF policy models carry)."""

    def __init__(self, vocab=40, width=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, vocab)
        self.value_head = nn.Linear(width, 1)

    def forward(self, ids, with_value=False):
        x = self.emb(ids)
        return (self.proj(x), self.value_head(x)) if with_value else self.proj(x)


def build_aux_head(**kwargs):
    return AuxHead(**kwargs)


class TablePositions(nn.Module):
    """Learned positions looked up by index (nn.Embedding) and named by no context attribute: on the meta device
    a lookup past the table's end runs; on a GPU it fails."""

    def __init__(self, vocab=40, width=16, positions=20):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.where = nn.Embedding(positions, width)
        self.proj = nn.Linear(width, vocab)

    def forward(self, ids):
        return self.proj(self.emb(ids) + self.where(torch.arange(ids.shape[1], device=ids.device)))


def build_table_positions(**kwargs):
    return TablePositions(**kwargs)
