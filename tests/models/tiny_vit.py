"""A small ViT: float32 pixels in (example_inputs), class labels out; capture casts the model to bf16, so the
pixels must be cast too (the Conv2d patch embedding rejects float input against bf16 weights)."""

import torch
import torch.nn.functional as F
from torch import nn


class Encoder(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.out(y.transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(x)


class ViT(nn.Module):
    def __init__(self, image=32, patch=8, width=48, heads=4, depth=2, classes=10):
        super().__init__()
        self.patchify = nn.Conv2d(3, width, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, width))
        self.blocks = nn.ModuleList(Encoder(width, heads) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, pixels):
        x = self.patchify(pixels).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(x[:, 0])


def build_model(**kwargs):
    return ViT(**kwargs)


def example_inputs(batch_size, seq_len):
    return torch.randn(batch_size, 3, 32, 32), torch.zeros(batch_size, dtype=torch.long)


def loss_fn(output, batch):
    return F.cross_entropy(output.float(), batch[1])
