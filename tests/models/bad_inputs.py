"""Model files that fail in the ways users' files fail; each factory is selected with --entry."""

from torch import nn


def raises():
    raise RuntimeError("config file missing")


def not_a_module():
    return 42


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: no tracer can follow this on meta tensors
            return self.emb(x)
        return self.emb(x) * 2


def data_dependent():
    return DataDependent()
