"""Scaling a model family the way the presets do, for "the largest model that fits" (pure).

One integer knob k per question:
  layers: k blocks; width unchanged.
  hidden: k·step heads of the base head dimension (hidden = heads · head_dim); depth unchanged.
  both:   k·step heads and depth scaled in proportion (layers/heads of the base kept), the way the GPT-3 and
          Megatron rows grow depth and width together.
step = lcm(8, kv heads): every tensor-parallel size up to a node (1, 2, 4, 8) divides the heads, as in every
preset. Llama's FFN keeps the base ffn_dim/dim ratio, rounded to a multiple of 256; kv heads stay fixed (Llama 3
keeps 8 at every size). The family is recognised by the factory's keyword arguments (a preset supplies them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mlm.planner.errors import PlanError

SCALE_CHOICES = ("both", "layers", "hidden")
HEAD_STEP = 8
FFN_MULTIPLE = 256
MAX_LAYERS = 1 << 14
MAX_HEADS = 4096


@dataclass(frozen=True)
class Family:
    """Names of a family's size arguments (None: the family has no such argument)."""

    name: str
    layers: str
    heads: str
    hidden: str
    ffn: str | None = None
    kv_heads: str | None = None


FAMILIES = (
    Family("gpt", layers="n_layer", heads="n_head", hidden="n_embd"),
    Family("llama", layers="n_layers", heads="n_heads", hidden="dim", ffn="ffn_dim", kv_heads="n_kv_heads"),
)


@dataclass(frozen=True)
class Base:
    """The model being scaled, as captured (layers, heads, hidden) plus the arguments it was built with."""

    family: Family
    layers: int
    heads: int
    hidden: int
    args: dict[str, Any]

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def step(self) -> int:
        kv = int(self.args.get(self.family.kv_heads, 1)) if self.family.kv_heads else 1
        return math.lcm(HEAD_STEP, kv)


def find_family(args: dict[str, Any]) -> Family:
    """The family whose size arguments all appear in `args`, or PlanError saying what to pass."""
    for fam in FAMILIES:
        if all(k in args for k in (fam.layers, fam.heads, fam.hidden)):
            return fam
    wanted = " or ".join(f"{f.layers}/{f.heads}/{f.hidden}" for f in FAMILIES)
    raise PlanError(
        f"--max-params needs to know how to grow the model: use a gpt or llama preset, or pass its "
        f"size arguments ({wanted}) with --model-arg"
    )


def knob_range(base: Base, scale: str) -> tuple[int, int, int]:
    """(k_start, k_min, k_max) for `scale`: the base model's knob and the bounds the search may try."""
    if scale == "layers":
        return min(base.layers, MAX_LAYERS), 1, MAX_LAYERS
    if scale not in SCALE_CHOICES:
        raise PlanError(f"--scale must be one of {', '.join(SCALE_CHOICES)}")
    k_max = MAX_HEADS // base.step
    return min(max(1, base.heads // base.step), k_max), 1, k_max


def scaled_args(base: Base, scale: str, k: int) -> dict[str, Any]:
    """The factory arguments of size k (see the module docstring)."""
    fam, args = base.family, dict(base.args)
    if scale == "layers":
        args[fam.layers] = k
        return args
    heads = k * base.step
    hidden = heads * base.head_dim
    args[fam.heads], args[fam.hidden] = heads, hidden
    if scale == "both":
        args[fam.layers] = max(1, round(base.layers * heads / base.heads))
    if fam.ffn and fam.ffn in args:
        ratio = int(args.get(fam.ffn, 4 * base.hidden)) / base.hidden
        args[fam.ffn] = max(FFN_MULTIPLE, FFN_MULTIPLE * round(ratio * hidden / FFN_MULTIPLE))
    return args


def describe(base: Base, args: dict[str, Any]) -> str:
    fam = base.family
    names = [fam.layers, fam.heads, fam.hidden] + [n for n in (fam.ffn, fam.kv_heads) if n and n in args]
    return ", ".join(f"{n}={args[n]}" for n in names)
