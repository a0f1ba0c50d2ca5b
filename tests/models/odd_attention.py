"""Attention written as authors write it, with head counts under names no config convention uses.

`HeadsGPT` keeps its head count in `self.heads` (hand-written matmul-softmax-matmul or SDPA); `NhLlama` keeps
query and kv heads in `nh` / `nkv` and broadcasts the keys to the query heads before the attention op, by
repeat_interleave or by expand + reshape (grouped-query attention), after rotary embeddings.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class HeadsAttention(nn.Module):
    def __init__(self, width, heads, manual):
        super().__init__()
        self.heads = heads
        self.manual = manual
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, c // self.heads).permute(0, 2, 1, 3) for z in (q, k, v))
        if self.manual:
            s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            y = torch.matmul(F.softmax(s.float(), dim=-1).to(q.dtype), v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.permute(0, 2, 1, 3).reshape(b, t, c))


class HeadsBlock(nn.Module):
    def __init__(self, width, heads, manual):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = HeadsAttention(width, heads, manual)
        self.norm2 = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class HeadsGPT(nn.Module):
    def __init__(self, tokens, width, heads, depth, positions, manual):
        super().__init__()
        self.tok = nn.Embedding(tokens, width)
        self.pos = nn.Parameter(torch.zeros(1, positions, width))
        self.stack = nn.ModuleList(HeadsBlock(width, heads, manual) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.unembed = nn.Linear(width, tokens, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos[:, : ids.shape[1]]
        for block in self.stack:
            x = block(x)
        return self.unembed(self.norm(x))


def build_heads_gpt(tokens=96, width=48, heads=6, depth=3, positions=24, manual=False):
    return HeadsGPT(tokens, width, heads, depth, positions, manual)


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rolled = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rolled * sin


class NhAttention(nn.Module):
    def __init__(self, dim, nh, nkv, hd, broadcast):
        super().__init__()
        self.nh, self.nkv, self.hd, self.broadcast = nh, nkv, hd, broadcast
        self.wq = nn.Linear(dim, nh * hd, bias=False)
        self.wk = nn.Linear(dim, nkv * hd, bias=False)
        self.wv = nn.Linear(dim, nkv * hd, bias=False)
        self.wo = nn.Linear(nh * hd, dim, bias=False)

    def _expand(self, z):
        rep = self.nh // self.nkv
        if self.broadcast == "repeat_interleave":
            return z.repeat_interleave(rep, dim=1)
        b, _, t, d = z.shape
        return z[:, :, None].expand(b, self.nkv, rep, t, d).reshape(b, self.nh, t, d)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, self._expand(k), self._expand(v), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class NhBlock(nn.Module):
    def __init__(self, dim, nh, nkv, hd, ffn, broadcast):
        super().__init__()
        self.n1 = RMSNorm(dim)
        self.attn = NhAttention(dim, nh, nkv, hd, broadcast)
        self.n2 = RMSNorm(dim)
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.n1(x), cos, sin)
        h = self.n2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class NhLlama(nn.Module):
    def __init__(self, vocab, dim, nh, nkv, hd, ffn, depth, broadcast):
        super().__init__()
        self.hd = hd
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(NhBlock(dim, nh, nkv, hd, ffn, broadcast) for _ in range(depth))
        self.norm = RMSNorm(dim)
        self.proj = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2, device=tokens.device).float() / self.hd))
        ang = torch.outer(torch.arange(t, device=tokens.device).float(), inv)
        ang = torch.cat((ang, ang), dim=-1)
        cos, sin = ang.cos().to(self.emb.weight.dtype), ang.sin().to(self.emb.weight.dtype)
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.proj(self.norm(x))


def build_nh_llama(vocab=80, dim=64, nh=8, nkv=2, hd=12, ffn=96, depth=2, broadcast="repeat_interleave"):
    """hd * nh (96) differs from dim (64) on purpose: head_dim is not hidden // heads."""
    return NhLlama(vocab, dim, nh, nkv, hd, ffn, depth, broadcast)
