"""Classify captured fx nodes into the few kinds of op the cost model distinguishes.

Works on both graphs the capture produces: torch.export's aten ops (aten.linear.default) and symbolic_trace's
torch-level calls (F.linear, operator.add, Tensor.view): both are looked up by the op's base name. For each op we
derive forward FLOPs, the bytes a memory-bound kernel moves, and which inputs autograd saves for backward (the
activation-memory model). The saved-tensor rules follow the derivative formulas in PyTorch's derivatives.yaml:
a matmul saves both operands, a product the other factor, softmax and ReLU their output, GELU/SiLU their input,
layer_norm its input (plus per-row statistics), dropout its mask (1 byte per element), add and views nothing.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "transpose",
        "t",
        "permute",
        "expand",
        "split",
        "split_with_sizes",
        "chunk",
        "getitem",
        "unsqueeze",
        "squeeze",
        "flatten",
        "unflatten",
        "slice",
        "select",
        "narrow",
        "alias",
        "detach",
        "contiguous",
        "clone",
        "to",
        "_to_copy",
        "type_as",
        "float",
        "half",
        "bfloat16",
        "type",
        "size",
        "dim",
        "unbind",
        "view_as",
        "expand_as",
        "movedim",
        "numpy_T",  # x @ W.T (Falcon's FalconLinear, nn.Linear written as a matmul)
        "mT",
        "_assert_tensor_metadata",
        "lift_fresh_copy",
        "dropout_noop",
        "cat",
        "stack",
        "repeat_interleave",
        "repeat",
        "index_select",
        "zeros_like",
        "ones_like",
        "full_like",
    }
)
CREATION_OPS = frozenset(
    {
        "arange",
        "ones",
        "zeros",
        "full",
        "empty",
        "tril",
        "triu",
        "rand",
        "randn",
        "scalar_tensor",
        "bitwise_not",
        "logical_not",
        "eq",
        "ne",
        "lt",
        "gt",
        "le",
        "ge",
    }
)
NORM_OPS = frozenset({"layer_norm", "native_layer_norm", "rms_norm", "group_norm", "batch_norm"})
SOFTMAX_OPS = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"})
SAVES_INPUT = frozenset(
    {
        "gelu",
        "silu",
        "pow",
        "sin",
        "cos",
        "log",
        "abs",
        "square",
        "var",
        "std",
        "leaky_relu",
        "elu",
        "softplus",
        "erf",
    }
)
# relu's backward reads its result (torch's derivatives.yaml: threshold_backward(grad, result, 0)), so relu(x)**2
# saves one tensor, shared with the square
SAVES_OUTPUT = frozenset({"relu", "tanh", "sigmoid", "exp", "rsqrt", "sqrt", "reciprocal"})
SAVES_BOTH = frozenset({"mul", "div", "maximum", "minimum", "outer"})  # each operand's grad needs the other
SAVES_MASK = frozenset({"masked_fill", "where"})  # only the boolean condition is needed
LOSS_OPS = frozenset(
    {
        "cross_entropy_loss",
        "cross_entropy",
        "nll_loss",
        "nll_loss_forward",
        "mse_loss",
        "binary_cross_entropy_with_logits",
    }
)
ATTENTION_OPS = frozenset(
    {
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_cudnn_attention",
    }
)
MATMUL_OPS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum"})
CONV_OPS = frozenset(
    {
        "convolution",
        "_convolution",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_transpose1d",
        "conv_transpose2d",
        "conv_transpose3d",
        "cudnn_convolution",
        "mkldnn_convolution",
    }
)


def op_name(node: torch.fx.Node) -> str:
    """The base name of a call: 'linear' for aten.linear.default, F.linear and nn.Linear-less traces."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if target is operator.getitem:
        return "getitem"
    if node.op != "call_function":
        return node.op
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    name = getattr(target, "__name__", str(target))
    return {
        "add": "add",
        "iadd": "add",
        "sub": "sub",
        "mul": "mul",
        "truediv": "div",
        "floordiv": "div",
        "matmul": "matmul",
        "neg": "neg",
    }.get(name, name)


def val(node: Any) -> torch.Tensor | None:
    """The meta tensor a node produces (export: meta['val']; our symbolic-trace interpreter sets the same key)."""
    if not isinstance(node, torch.fx.Node):
        return None
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def nbytes(t: torch.Tensor | None) -> float:
    return 0.0 if t is None else float(t.numel() * t.element_size())


@dataclass(frozen=True)
class OpCost:
    """What one op costs in the forward pass, for one captured sample."""

    kind: str  # "linear", "conv", "embedding", "attention", "matmul", "norm", "softmax", "dropout", "loss", "view",
    #            "creation", "elementwise"
    flops: float
    bytes_moved: float
    saved: tuple[torch.fx.Node, ...]  # activation nodes autograd keeps for backward
    extra_saved_bytes: float  # saved tensors that are not graph nodes (dropout masks, norm statistics, lse)


def tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensor-valued node arguments of a call, in order."""
    return [a for a in _flat(node) if val(a) is not None]


def _flat(node: torch.fx.Node) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


def param_view(a: torch.fx.Node, is_param: Collection[torch.fx.Node]) -> torch.fx.Node | None:
    """The parameter `a` is, or is a view of (W.T: a matmul that reads a weight through a transpose is a linear)."""
    while a not in is_param and a.op in ("call_function", "call_method") and op_name(a) in VIEW_OPS:
        inputs = tensor_args(a)
        if len(inputs) != 1:
            return None
        a = inputs[0]
    return a if a in is_param else None


def classify(node: torch.fx.Node, is_param: set[torch.fx.Node]) -> OpCost:
    """Cost of one call node; `is_param` holds the nodes that are parameters or buffers (never 'activations')."""
    name = op_name(node)
    out = val(node)
    args = tensor_args(node)
    acts = [a for a in args if a not in is_param]
    out_bytes = nbytes(out)
    in_bytes = sum(nbytes(val(a)) for a in args)
    if name in VIEW_OPS or out is None and name not in LOSS_OPS:
        return OpCost("view", 0.0, 0.0, (), 0.0)
    if name in CREATION_OPS and not acts:
        return OpCost("creation", 0.0, 0.0, (), 0.0)
    if name == "embedding":
        return OpCost("embedding", 0.0, 2 * out_bytes, tuple(a for a in acts), 0.0)
    if name in ATTENTION_OPS:
        q, k, v = (val(a) for a in args[:3])
        assert q is not None and k is not None and v is not None
        lq, s = q.shape[-2], k.shape[-2]
        batch_heads = math.prod(q.shape[:-2])
        flops = 2.0 * batch_heads * lq * s * (q.shape[-1] + v.shape[-1])
        lse = batch_heads * lq * 4.0  # float32 log-sum-exp per query row, kept by flash/efficient kernels
        # a mask or bias (the 4th tensor) is kept too: the memory-efficient kernel's backward reads it (T5's
        # learned position bias, s x s per head): trace._layer_ir counts it in the layer that makes it
        return OpCost("attention", flops, in_bytes + out_bytes, tuple(acts[:3]) + (node,) + tuple(acts[3:4]), lse)
    if name in MATMUL_OPS:
        params = [a for a in args if param_view(a, is_param) is not None]
        k = _contracted_dim(name, node, args)
        flops = 2.0 * (out.numel() if out is not None else 0) * k
        if params and name != "baddbmm":
            return OpCost("linear", flops, 0.0, tuple(acts), 0.0)
        return OpCost("matmul", flops, 0.0, tuple(acts), 0.0)
    if name in CONV_OPS:
        return OpCost("conv", _conv_flops(name, node, args), 0.0, tuple(acts), 0.0)
    if name in NORM_OPS:
        rows = out.numel() / out.shape[-1] if out is not None and out.dim() else 0
        return OpCost("norm", 5.0 * out.numel(), in_bytes + out_bytes, tuple(acts[:1]), 8.0 * rows)
    if name in SOFTMAX_OPS:
        return OpCost("softmax", 5.0 * out.numel(), in_bytes + out_bytes, (node,), 0.0)
    if name in ("dropout", "native_dropout", "feature_dropout"):
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        if not p or not train:
            return OpCost("view", 0.0, 0.0, (), 0.0)
        return OpCost("dropout", float(out.numel()), in_bytes + out_bytes + out.numel(), (), float(out.numel()))
    if name in LOSS_OPS:
        logits = val(args[0]) if args else None
        n = logits.numel() if logits is not None else 0
        # cross-entropy keeps the log-softmax of the logits (float32 when the logits were upcast)
        saved_bytes = float(n * (logits.element_size() if logits is not None else 4))
        return OpCost("loss", 5.0 * n, 2 * in_bytes, (), saved_bytes)
    saved: tuple[torch.fx.Node, ...]
    if name in SAVES_OUTPUT:
        saved = (node,)
    elif name in SAVES_INPUT:
        saved = tuple(acts[:1])
    elif name in SAVES_BOTH:
        saved = tuple(args) if len(args) >= 2 else ()  # times a Python scalar: the grad needs no tensor
        saved = tuple(a for a in saved if a not in is_param)
    elif name in SAVES_MASK:
        saved = tuple(a for a in args if (t := val(a)) is not None and t.dtype == torch.bool)
    else:  # add, sub, neg, scalar ops: the derivative needs no tensor
        saved = ()
    return OpCost("elementwise", float(out.numel()), in_bytes + out_bytes, saved, 0.0)


def _contracted_dim(name: str, node: torch.fx.Node, args: list[torch.fx.Node]) -> int:
    """The reduction length K of a matmul-like op (FLOPs = 2 * numel(out) * K)."""
    if name == "linear":
        w = val(args[1])
        return int(w.shape[-1]) if w is not None else 0
    if name in ("addmm", "baddbmm"):
        a = val(args[1])
        return int(a.shape[-1]) if a is not None else 0
    if name == "einsum":
        return _einsum_contracted(node, args)
    a = val(args[0])
    return int(a.shape[-1]) if a is not None else 0


def _conv_flops(name: str, node: torch.fx.Node, args: list[torch.fx.Node]) -> float:
    """2 multiply-adds per output element and per weight tap it reads: out · (C_in/groups) · prod(kernel) for a
    convolution, in · (C_out/groups) · prod(kernel) for a transposed one (each input element is scattered over
    the kernel), the counts torch.utils.flop_counter also uses."""
    x, w, out = (val(args[0]) if args else None), (val(args[1]) if len(args) > 1 else None), val(node)
    if x is None or w is None or out is None:
        return 0.0
    transposed = "transpose" in name or bool(
        node.args[6] if name in ("convolution", "_convolution") and len(node.args) > 6 else False
    )
    taps = math.prod(int(d) for d in w.shape[1:])  # (C_in/groups or C_out/groups) · kernel
    return 2.0 * float(x.numel() if transposed else out.numel()) * taps


def _einsum_contracted(node: torch.fx.Node, args: list[torch.fx.Node]) -> int:
    """K of an einsum: the product of the sizes of the indices that appear in the operands but not the output."""
    equation = node.args[0] if node.args and isinstance(node.args[0], str) else None
    if equation is None or "->" not in equation or "..." in equation:
        return 1
    inputs, output = equation.replace(" ", "").split("->")
    sizes: dict[str, int] = {}
    for letters, a in zip(inputs.split(","), args, strict=False):
        t = val(a)
        if t is None or len(letters) != t.dim():
            return 1
        sizes.update({c: int(d) for c, d in zip(letters, t.shape, strict=True)})
    return math.prod(sizes[c] for c in set(sizes) - set(output))
