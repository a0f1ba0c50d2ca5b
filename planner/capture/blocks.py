"""Find the model's stacks of blocks and group each stack's blocks by kind, so each kind is captured once.

A stack is an nn.ModuleList, nn.Sequential or nn.ModuleDict of >= 2 children that all hold parameters and are of
one module type (or, in a ModuleList / ModuleDict, are all composite modules, e.g. a dense and an MoE block
class); stacks inside another stack's children (experts inside a block) are not stacks, and stacks much smaller
than the largest are ignored. Encoder-decoders have two stacks.

Blocks of one stack are of one kind when they agree on module type, parameter names and shapes (dense vs MoE,
T5's relative-position bias in block 0) and on behavioural attributes: plain int/str/bool/None attributes
of every submodule (sliding_window, attention_type, is_sliding; floats such as per-layer drop-path rates do
not change costs), except ones that number the layer (layer_idx, or an attribute equal to the block's position
in the stack). The cut model keeps the first two blocks of each
kind, so capture also checks that two instances of a kind behave alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

_INDEX_NAME = re.compile(r"idx|index|layer_id|layer_num|layer_number|^id$|^layer$", re.IGNORECASE)
_STACK_SHARE = 0.25  # a stack with fewer parameters than this share of the largest is not a block stack
PER_KIND = 2  # instances of each kind kept in the cut model (the second checks the first)


@dataclass(frozen=True)
class BlockGroup:
    """One stack: its FQN, the names of its children in order, and each child's kind index."""

    fqn: str
    children: tuple[str, ...]
    kinds: tuple[int, ...] = ()

    def kind_of(self, child: str) -> int:
        return self.kinds[self.children.index(child)] if self.kinds else 0

    def members(self, kind: int) -> tuple[str, ...]:
        return tuple(c for c, k in zip(self.children, self.kinds or (0,) * len(self.children)) if k == kind)

    def representatives(self, per_kind: int = 1) -> tuple[str, ...]:
        keep = []
        for kind in dict.fromkeys(self.kinds or (0,)):
            keep.extend(self.members(kind)[:per_kind])
        return tuple(c for c in self.children if c in keep)


def find_block_groups(model: nn.Module, exclude: tuple[str, ...] = ()) -> list[BlockGroup]:
    """Every block stack of `model` in module order (`exclude`: containers that are not stacks, e.g. experts)."""
    candidates: list[tuple[str, nn.Module, int]] = []
    for fqn, module in model.named_modules():
        if fqn in exclude or not _is_stack(module):
            continue
        candidates.append((fqn, module, sum(p.numel() for p in module.parameters())))
    roots = [
        (fqn, module, size)
        for fqn, module, size in candidates
        if not any(fqn.startswith(other + ".") for other, _, _ in candidates)
    ]
    if not roots:
        return []
    largest = max(size for _, _, size in roots)
    return [_group(fqn, module) for fqn, module, size in roots if size >= _STACK_SHARE * largest]


def _is_stack(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) or len(module) < 2:
        return False
    children = list(module.children())
    if not all(any(True for _ in c.parameters()) for c in children):
        return False
    if len({type(c) for c in children}) == 1:
        return True
    composite = all(sum(1 for _ in c.children()) >= 2 for c in children)
    return composite and not isinstance(module, nn.Sequential)


def _group(fqn: str, module: nn.Module) -> BlockGroup:
    children = list(module.named_children())
    ignore = _index_attributes([c for _, c in children])
    signatures: dict[tuple, int] = {}
    kinds = []
    for _, child in children:
        sig = signature(child, ignore)
        kinds.append(signatures.setdefault(sig, len(signatures)))
    return BlockGroup(fqn, tuple(name for name, _ in children), tuple(kinds))


def signature(module: nn.Module, ignore: frozenset[str] = frozenset()) -> tuple:
    """Module type, parameter names and shapes, and behavioural attributes of every submodule."""
    params = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    behaviour = tuple((name, type(sub).__name__, _attributes(sub, ignore)) for name, sub in module.named_modules())
    return type(module), params, behaviour


def _attributes(module: nn.Module, ignore: frozenset[str]) -> tuple:
    return tuple(
        sorted(
            (k, repr(v))
            for k, v in vars(module).items()
            if not k.startswith("_")
            and k != "training"
            and k not in ignore
            and not _INDEX_NAME.search(k)
            and (v is None or isinstance(v, (int, str, bool)))
        )
    )


def _index_attributes(children: list[nn.Module]) -> frozenset[str]:
    """Attributes that number the layer: equal to the child's position (or position + 1) in every child."""
    if len(children) < 2:
        return frozenset()
    names: set[str] | None = None
    for i, child in enumerate(children):
        here = {
            f"{k}"
            for sub in child.modules()
            for k, v in vars(sub).items()
            if isinstance(v, int) and not isinstance(v, bool) and v in (i, i + 1)
        }
        names = here if names is None else names & here
    return frozenset(names or ())


def cut_to_representatives(model: nn.Module, groups: list[BlockGroup], per_kind: int = PER_KIND) -> nn.Module:
    """The same model object with each stack holding only the first `per_kind` blocks of each kind (meta: free)."""
    for group in groups:
        container = model.get_submodule(group.fqn)
        keep = set(group.representatives(per_kind))
        for name in group.children:
            if name not in keep:
                delattr(container, name)
    return model
