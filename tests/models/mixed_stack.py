"""A GPT-style stack whose blocks differ in cost at a size where pipeline stages matter: narrow-FFN blocks, then
wide-FFN blocks, then blocks with local (windowed) attention, so a count of blocks per stage says little about
what a stage costs."""

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, d, heads, window=None):
        super().__init__()
        self.heads, self.window = heads, window
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        if self.window is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            i = torch.arange(s, device=x.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, d, heads, ffn, window=None):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, window)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, ffn, bias=False)
        self.out = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class MixedLM(nn.Module):
    def __init__(self, blocks, vocab, d, seq):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(narrow=6, wide=6, local=4, d=2048, heads=16, vocab=32000, seq=2048, window=256, pattern=0):
    """`narrow` blocks with a 2·d FFN, `wide` with 8·d, `local` with 4·d and windowed attention; then `pattern`
    Gemma-3-like blocks (4·d FFN, five windowed to one global attention)."""
    blocks = [Block(d, heads, 2 * d) for _ in range(narrow)]
    blocks += [Block(d, heads, 8 * d) for _ in range(wide)]
    blocks += [Block(d, heads, 4 * d, window) for _ in range(local)]
    blocks += [Block(d, heads, 4 * d, None if i % 6 == 5 else window) for i in range(pattern)]
    return MixedLM(blocks, vocab, d, seq)
