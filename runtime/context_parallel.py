"""Context parallelism in mlm-run: every sequence split over the cp ranks in 2·cp load-balanced causal chunks.

With cp ranks and a sequence of T tokens cut into 2·cp chunks of T/(2·cp), cp rank r keeps chunks r and
2·cp−1−r, so every rank holds as much of the causal triangle as every other (Megatron-Core's and torch's load
balancing). What runs on a rank, from the first plan layer that reads an activation (the first block, or the
embedding dropout before it) to the loss, is the model's own code on its T/cp tokens:

- every tensor argument of such a layer with a dimension of length T (the hidden states, HF's rotary cos/sin,
  position ids, a 4-D mask's query rows) is cut to this rank's positions as the layer is called (`seq_dim` says
  which dimension: the first one of length T after the batch dimension, else dimension 0). Everything before
  that layer (embeddings, position ids, masks, rotary tables) runs on the whole sequence, so the positions the
  model computes are the real ones. The targets are cut the same way, so the loss is this rank's tokens' sum;
- F.scaled_dot_product_attention over the local sequence all-gathers K and V over the cp group (autograd:
  its backward reduce-scatters dK, dV). Causal attention without a mask runs each of the rank's two chunks
  against the keys up to the chunk's end, lower-right aligned (torch's CausalBias: the flash / efficient kernels
  skip the masked blocks, so each rank does its share of the causal work); with the model's own mask (reordered
  to the gathered keys) or attention dropout the rank's queries attend to all T keys under the written-out mask.
  This is the all-gather form of context parallelism that Llama 3 was trained with; per layer and micro-batch
  it receives (cp−1)/cp of the layer's K/V forward (the bytes ring attention passes) and sends the same back as
  gradients;
- positions a layer computes from its input's length (`torch.arange(t)`, as a rotary embedding inside the
  attention does) are this rank's real positions;
- dropout on a local activation draws one device's mask of the whole sequence and keeps this rank's positions,
  so masks are one device's on every layout (as for tensor parallelism on CPU, tensor_parallel.py); attention
  dropout is computed as the math kernel computes it, on CPU only;
- attention written by hand (a softmax over the local keys) cannot be split this way and stops the run with an
  error naming it, instead of attending to a fraction of the context.

Gradients of everything (the model is replicated over cp) reduce over the dp·cp ranks: mesh.py makes the
data-parallel axis dp·cp long, and train.py scales the loss sums by dp·cp over the global token count.

Why by hand: torch's context_parallel (torch.distributed.tensor.experimental) rewrites only the flash, efficient
and cuDNN SDPA kernels of CUDA on DTensor inputs and shards buffers the caller names; CPU/gloo has none of those
kernels, and a user's model computes its positions from the input length, which sharding the inputs would break.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from mlm.planner.errors import Infeasible
from mlm.runtime.tensor_parallel import is_fake

SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def local_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The sequence positions cp rank `rank` holds: chunks rank and 2·cp−1−rank of 2·cp equal chunks."""
    if seq_len % (2 * cp):
        raise Infeasible(f"context parallelism needs seq_len ({seq_len}) divisible by 2·cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([first, second])


def _counts_to(args: tuple, kwargs: dict) -> int | None:
    """n for a call torch.arange(n) / arange(0, n) / arange(0, n, 1) with integer bounds, else None."""
    bounds = [*args, *(kwargs[k] for k in ("start", "end", "step") if k in kwargs)]
    if any(isinstance(b, bool) or not isinstance(b, int) for b in bounds):
        return None
    if len(bounds) == 1:
        return bounds[0]
    if len(bounds) in (2, 3) and bounds[0] == 0 and (len(bounds) == 2 or bounds[2] == 1):
        return bounds[1]
    return None


def seq_dim(shape: tuple[int, ...] | torch.Size, length: int) -> int | None:
    """Which dimension of a tensor of this shape is the sequence of `length` tokens: the first one of that length
    after dimension 0 (batch), else dimension 0 (a [T, d] rotary table), else None."""
    for d in range(1, len(shape)):
        if shape[d] == length:
            return d
    return 0 if len(shape) >= 1 and shape[0] == length else None


@dataclass
class ContextParallel:
    """This rank's part of the sequence and the exchange over its cp group (see module doc)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None
    seq_len: int
    paused: bool = False  # set while the pipeline infers shapes with an extra forward (train.py): no exchange
    _index: dict[tuple[str, torch.device], torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def local_len(self) -> int:
        return self.seq_len // self.size

    def positions(self, device: torch.device) -> torch.Tensor:
        return self._cached("local", device, lambda: local_positions(self.seq_len, self.size, self.rank))

    def key_positions(self, device: torch.device) -> torch.Tensor:
        """The real positions of the all-gathered keys: every rank's local positions, in rank order."""
        return self._cached(
            "keys", device, lambda: torch.cat([local_positions(self.seq_len, self.size, r) for r in range(self.size)])
        )

    def _cached(self, name: str, device: torch.device, make: Any) -> torch.Tensor:
        key = (name, device)
        if key not in self._index:
            self._index[key] = make().to(device)
        return self._index[key]

    def shard(self, tree: Any, whole: tuple[tuple[int, ...] | None, ...] | None = None) -> Any:
        """Every tensor of the pytree with a whole-sequence dimension, cut to this rank's positions. `whole`: the
        leaves' shapes in a whole-sequence run of the same call (model_build.LayerCall.leaf_shapes); a leaf is
        cut only where its shape is still that one, so a tensor already this rank's part is never cut again (its
        hidden size may equal T)."""
        leaves, spec = pytree.tree_flatten(tree)
        if whole is not None and len(whole) != len(leaves):
            whole = None  # another call structure than the recorded one: go by the shapes alone
        out = []
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor) and (whole is None or whole[i] == tuple(x.shape)):
                d = seq_dim(x.shape, self.seq_len)
                if d is not None:
                    x = x.index_select(d, self.positions(x.device))
            out.append(x)
        return pytree.tree_unflatten(out, spec)

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        d = seq_dim(shape, self.seq_len)
        return shape if d is None else shape[:d] + (self.local_len,) + shape[d + 1 :]

    def wrap_layer(self, fqn: str, module: nn.Module, whole: tuple[tuple[int, ...] | None, ...] = ()) -> None:
        """The layer's forward on this rank's positions, with attention and dropout as the module doc says. The
        arguments are cut by a pre-hook that runs before every other (sequence parallelism's scatter of the first
        block's input then splits this rank's part, not the whole sequence); the forward is replaced on the instance
        (FQNs unchanged) before recompute wraps it, so a recomputed forward exchanges K/V again."""
        inner = module.forward

        def cut(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return self.shard((args, kwargs), whole or None)

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with _ContextMode(self, fqn):
                return inner(*args, **kwargs)

        module.register_forward_pre_hook(cut, with_kwargs=True, prepend=True)
        module.forward = forward  # type: ignore[method-assign]

    def shard_targets(self, training_module: nn.Module, first_layer: str) -> None:
        """The loss reads this rank's targets (a pre-hook on the TrainingModule, forward(inputs, targets)); a shape
        error in the forward says that the model's code may assume the whole sequence."""
        inner = training_module.forward

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            try:
                return inner(*args, **kwargs)
            except RuntimeError as e:
                if "shape" not in str(e) and "size" not in str(e):
                    raise
                raise Infeasible(
                    f"under context parallelism (cp {self.size}: from {first_layer} on, each rank runs "
                    f"{self.local_len} of the {self.seq_len} tokens) the model's forward failed: "
                    f"{str(e).splitlines()[0]}. Its code between layers may assume the whole sequence (a view "
                    f"to the input's length, as Hugging Face GPT-2 does after ln_f); plan with --cp 1"
                ) from e

        training_module.forward = forward  # type: ignore[method-assign]

        def pre(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if len(args) > 1:
                args = (args[0], self.shard(args[1]), *args[2:])
            elif "targets" in kwargs:
                kwargs = {**kwargs, "targets": self.shard(kwargs["targets"])}
            return args, kwargs

        training_module.register_forward_pre_hook(pre, with_kwargs=True)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """All ranks' local sequences concatenated along `dim` (autograd: the backward reduce-scatters)."""
        if self.paused:  # shape inference: the right shape, no exchange
            return torch.cat([x] * self.size, dim=dim)
        import torch.distributed._functional_collectives as funcol

        # all_gather_single_autograd is the newer name (torch >= 2.13) of all_gather_tensor_autograd
        gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
        return funcol.wait_tensor(gather(x.contiguous(), dim, self.group))


class _ContextMode(TorchFunctionMode):
    """SDPA over the whole sequence, one device's dropout masks, and a refusal of hand-written attention, inside a
    context-parallel layer (module doc)."""

    def __init__(self, cp: ContextParallel, fqn: str) -> None:
        super().__init__()
        self.cp, self.fqn = cp, fqn

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(func, args, kwargs)
        if func is F.dropout:
            return self._dropout(func, args, kwargs)
        if func in (F.softmax, torch.softmax, torch.Tensor.softmax):
            self._refuse_manual_attention(args, kwargs)
        if func is torch.arange and _counts_to(args, kwargs) == self.cp.local_len:
            return self._positions(kwargs)
        return func(*args, **kwargs)

    def _positions(self, kwargs: dict) -> torch.Tensor:
        """`torch.arange(t)` inside the layer, t its input's length: the positions of its tokens, which on a cp
        rank are this rank's (module doc), not 0..t−1."""
        device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else torch.device("cpu")
        pos = self.cp.positions(device)
        return pos.to(kwargs["dtype"]) if kwargs.get("dtype") is not None else pos

    def _attention(self, func: Any, args: tuple, kwargs: dict) -> Any:
        cp = self.cp
        bound = {**dict(zip(SDPA_ARGS, args)), **kwargs}
        q, k, v = bound["query"], bound["key"], bound["value"]
        n = cp.local_len
        if q.shape[-2] != n or k.shape[-2] != n:  # not self-attention over this rank's tokens (cross-attention)
            return func(*args, **kwargs)
        if isinstance(q, DTensor):
            raise Infeasible(
                f"{self.fqn}: attention on DTensors under context parallelism (tensor parallelism sharded the "
                f"projections one by one, not as one attention region); plan with --cp 1 or --tp 1"
            )
        device = q.device
        k_all, v_all = cp.gather(k, k.dim() - 2), cp.gather(v, v.dim() - 2)
        p = float(bound.get("dropout_p") or 0.0)
        rest = {"scale": bound.get("scale")}
        if bound.get("enable_gqa"):
            rest["enable_gqa"] = True
        if bound.get("is_causal") and bound.get("attn_mask") is None and p == 0:
            return self._causal_chunks(func, q, k_all, v_all, rest)
        keys = cp.key_positions(device)
        allowed = None
        if bound.get("is_causal"):
            allowed = cp.positions(device)[:, None] >= keys[None, :]
        mask = bound.get("attn_mask")
        if mask is not None:
            if mask.shape[-1] == cp.seq_len:  # the model's mask over the keys in their real order
                mask = mask.index_select(-1, keys)
            if mask.dim() >= 2 and mask.shape[-2] == cp.seq_len:  # rows not cut at the layer's input
                mask = mask.index_select(-2, cp.positions(device))
            if allowed is not None:
                mask = mask & allowed if mask.dtype == torch.bool else mask.masked_fill(~allowed, float("-inf"))
        else:
            mask = allowed
        if p > 0:
            return self._attention_with_dropout(q, k_all, v_all, mask, p, rest["scale"])
        return func(q, k_all, v_all, attn_mask=mask, dropout_p=0.0, is_causal=False, **rest)

    def _causal_chunks(
        self, func: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rest: dict[str, Any]
    ) -> torch.Tensor:
        """Causal attention of this rank's two chunks: each chunk's queries attend to the keys up to its end in
        their real order, with the causal diagonal aligned to the lower right (torch's CausalBias, which the
        flash and efficient kernels run without a mask tensor): the work of the causal triangle's share."""
        from torch.nn.attention.bias import causal_lower_right

        cp = self.cp
        order = torch.argsort(cp.key_positions(q.device))  # gathered keys -> positions 0..T−1
        k, v = k.index_select(-2, order), v.index_select(-2, order)
        size = cp.seq_len // (2 * cp.size)
        out = []
        for i, chunk in enumerate((cp.rank, 2 * cp.size - 1 - cp.rank)):
            end = (chunk + 1) * size
            q_i = q.narrow(-2, i * size, size)
            if is_fake(q):  # fake tensors (the dry run) cannot wrap a CausalBias: the same mask, written out
                mask = torch.ones(size, end, dtype=torch.bool, device=q.device).tril(end - size)
            else:
                mask = causal_lower_right(size, end)
            out.append(func(q_i, k.narrow(-2, 0, end), v.narrow(-2, 0, end), attn_mask=mask, **rest))
        return torch.cat(out, dim=-2)

    def _attention_with_dropout(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: float, scale: Any
    ) -> torch.Tensor:
        """The math kernel's attention with one device's dropout mask over the whole sequence, cut to this rank's
        query rows and the gathered keys' order (CPU: the masks are exact there; see module doc)."""
        if q.device.type != "cpu":
            raise Infeasible(
                f"{self.fqn}: attention dropout under context parallelism runs on CPU only (its mask is the whole "
                f"T x T one); train with attention dropout 0 (the practice at long context) or --cp 1"
            )
        if k.shape[-3] != q.shape[-3]:  # grouped-query attention, as enable_gqa repeats the key/value heads
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        scores = (q @ k.transpose(-2, -1)) * (scale or q.shape[-1] ** -0.5)
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1)
        whole = list(probs.shape)
        whole[-2] = whole[-1] = self.cp.seq_len
        keep = F.dropout(torch.ones(whole, dtype=probs.dtype, device=probs.device), p, True)
        keep = keep.index_select(-2, self.cp.positions(q.device)).index_select(-1, self.cp.key_positions(q.device))
        return (probs * keep) @ v

    def _dropout(self, func: Any, args: tuple, kwargs: dict) -> Any:
        bound = {**dict(zip(("input", "p", "training", "inplace"), args)), **kwargs}
        x, p, training = bound["input"], bound.get("p", 0.5), bound.get("training", True)
        d = seq_dim(x.shape, self.cp.local_len) if isinstance(x, torch.Tensor) else None
        if not training or p == 0 or self.cp.paused or d is None:
            return func(*args, **kwargs)
        whole = list(x.shape)
        whole[d] = self.cp.seq_len
        mask = func(torch.ones(whole, dtype=x.dtype, device=x.device), p, True)
        return x * mask.index_select(d, self.cp.positions(x.device))

    def _refuse_manual_attention(self, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("input")
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or not isinstance(dim, int):
            return
        n = self.cp.local_len
        if x.shape[dim] == n and x.shape[-2] == n:
            raise Infeasible(
                f"{self.fqn}: attention computed by hand (a softmax over the sequence) cannot be split by context "
                f"parallelism, which replaces F.scaled_dot_product_attention; write attention with SDPA "
                f"(Hugging Face: attn_implementation='sdpa') or plan with --cp 1"
            )
