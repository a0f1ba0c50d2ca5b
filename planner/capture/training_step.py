"""What one training sample is and how its loss is computed, shared by capture and the runtime.

A batch is (inputs, targets): by default token ids of shape (batch, seq) and the next tokens as targets. The
loss is the model file's `loss_fn(output, batch)` when it defines one; otherwise, when the forward takes
`targets` (nanoGPT's convention, whose forward without targets computes logits of the last position only) and
returns a loss, that loss; otherwise next-token cross-entropy on the logits, found in a tensor output, the first
element of a tuple, or a dict / HF-style output object's `logits` (HF's `labels` are not passed: HF shifts them
itself, and our targets are already shifted).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[Any, torch.Tensor]


def first_embedding_vocab(model: nn.Module) -> int:
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return module.num_embeddings
    raise ValueError("model has no nn.Embedding to take the vocabulary from; define example_inputs()")


def default_batch(
    model: nn.Module,
    batch_size: int,
    seq_len: int,
    device: str | torch.device,
    generator: torch.Generator | None = None,
) -> Batch:
    """Random token ids (inputs) and their targets, shape (batch, seq), from the first embedding's vocabulary."""
    vocab = first_embedding_vocab(model)
    if str(device) == "meta":
        tokens = torch.zeros(batch_size, seq_len + 1, dtype=torch.long, device=device)
    else:
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=generator).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def example_batch(example_inputs: Callable[[int, int], Any], batch_size: int, seq_len: int) -> Batch:
    """The model file's example_inputs(batch_size, seq_len) as (inputs, targets): a 2-tuple is that pair; anything
    else is the inputs alone, with zero targets of its first tensor's (batch, seq) shape (a loss_fn that reads
    no targets). Create it under torch.device("meta") for a batch without data."""
    example = example_inputs(batch_size, seq_len)
    if isinstance(example, tuple) and len(example) == 2:
        return example
    ref = example if isinstance(example, torch.Tensor) else next(iter(example.values()))
    return example, torch.zeros(ref.shape[:2], dtype=torch.long, device=ref.device)


def takes_targets(model: nn.Module) -> bool:
    """Whether the forward has a `targets` parameter (nanoGPT style)."""
    try:
        return "targets" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def extract_loss(output: Any) -> torch.Tensor | None:
    """A scalar loss returned by the model: (logits, loss), {"loss": ...} or an object with .loss."""
    if isinstance(output, (tuple, list)) and len(output) >= 2:
        candidate = output[1]
    elif isinstance(output, dict):
        candidate = output.get("loss")
    else:
        candidate = getattr(output, "loss", None)
    return candidate if isinstance(candidate, torch.Tensor) and candidate.dim() == 0 else None


def extract_logits(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and "logits" in output:
        return output["logits"]
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find logits in the model output of type {type(output).__name__}; define loss_fn()")


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def run_forward(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


class TrainingModule(nn.Module):
    """Wraps a model so forward(inputs, targets) returns the scalar training loss (the unit capture traces)."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(run_forward(self.model, inputs), (inputs, targets))
        if takes_targets(self.model) and isinstance(inputs, torch.Tensor):
            output = self.model(inputs, targets=targets)
            loss = extract_loss(output)
            if loss is not None:
                return loss
        else:
            output = run_forward(self.model, inputs)
        return next_token_loss(extract_logits(output), targets)
