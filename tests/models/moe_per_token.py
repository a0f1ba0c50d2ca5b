"""A top-2 mixture of experts whose dispatch keeps batch and sequence apart: every expert runs on every (batch, seq)
position and is weighted by its routing gate (dense one-hot), experts in an nn.ModuleList."""

import torch
import torch.nn as nn
import torch.nn.functional as F

V, D, H, E, K, L = 128, 32, 4, 4, 2, 2


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, 2 * D, bias=False)
        self.down = nn.Linear(2 * D, D, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))
        self.top_k = K

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        w, idx = probs.topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            gate = (w * (idx == e)).sum(-1, keepdim=True)
            out = out + gate * expert(x)
        return out


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, -1, D // H).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        return self.proj(a)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(D)
        self.moe = MoE()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def build_model():
    return Model()
