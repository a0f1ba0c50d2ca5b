"""A plain MLP that torch.fx.symbolic_trace captures (the fast path), with a custom example_inputs and loss_fn."""

import torch
from torch import nn


def build_model(width=16, depth=3):
    return nn.Sequential(
        nn.Linear(8, width),
        *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)],
        nn.Linear(width, 4),
    )


def example_inputs(batch_size, seq_len):
    return torch.zeros(batch_size, seq_len, 8), torch.zeros(batch_size, seq_len, 4)


def loss_fn(output, batch):
    return torch.nn.functional.mse_loss(output, batch[1])
