"""Expert parallelism in mlm-run: each MoE layer's routed experts split over the ep ranks, tokens exchanged by
all-to-all (dispatch before the experts, combine after), as torchtitan and Megatron-Core's alltoall dispatcher do.

Which experts: those capture recognises (planner/capture/moe.py). What runs is the model's own code: the router,
the top-k and the weighting stay the model's; only the call of the fused expert bank is replaced. A bank is a
module holding 3-D weights whose leading extent is the number of experts, called as
`experts(tokens, top_k_index, top_k_weights)` and returning sum_k weight_k · expert_{index_k}(token) per token
(transformers >= 5 builds every MoE this way: Mixtral, Qwen2/3-MoE, DeepSeek-V3, ...). Expert e lives on ep rank
e // (num_experts / ep); its weights are rows [r·L, (r + 1)·L) of each bank, materialised on that rank only.

One call, per micro-batch and MoE layer, on the rank's own tokens:
1. each (token, k) pair is sorted by expert; an all-to-all of the per-expert counts tells every rank how many rows
   it receives from each peer for each of its L experts;
2. dispatch: one all_to_all_single (autograd) of the rows, `hidden` bytes each, tokens · top_k rows in all;
3. the bank's own forward runs on the received rows with each row's local expert index and weight 1, so its
   weights index [0, L) (the bank's `num_experts` attribute, where it has one, reads L during that call);
4. combine: the reverse all_to_all_single, then each row times its routing weight, summed per token (index_add).
The backward of 2 and 4 is the reverse exchange, so the rows' gradients go back to where the tokens came from.

Gradients: the owner's expert gradient sums over the tokens of its whole ep group, and the data-parallel wrapper
averages it over the dp/ep ranks that hold the same experts (data_parallel.py wraps each bank over that group),
so train.py divides it by ep: every parameter then carries the gradient of the global token mean. The router and
everything else is data-parallel as in a dense model (each rank routes its own tokens).

Experts in an nn.ModuleList (a hand-written MoE whose own loop calls each expert module: Mixtral's first code,
torch.where + index_add, or dense one-hot dispatch) keep the model's dispatch by running the MoE module's forward
twice per call. Pass 1 swaps every expert for a slot that records the tokens the model hands it and returns zeros;
one exchange, as above, sends each expert's recorded rows to its owner, which runs the real expert once on all
rows it received; pass 2 runs the model's forward again with the slots returning those outputs, so routing,
weighting and combining are the model's own. The gradient reaches the tokens through pass 1's dispatch (the
recorded rows) and the routing weights through pass 2. Cost: the MoE module's non-expert part (router, shared
experts) runs twice forward; only pass 2's output is used. Only this rank's experts exist here (the others are
parameter-free until the call), each its own data-parallel group over the ranks holding the same experts.

The dry run (fake tensors: the routing has no values) executes fused banks with every expert receiving its
balanced share of the (token, k) pairs (`balanced_counts`, the cost model's capacity factor 1): the same calls and
bytes as a perfectly balanced step.

With tp > 1 the ep groups are the ranks of one tp coordinate (mesh.py's expert mesh): every tp rank holds its ep
rank's experts whole (no expert-tensor parallelism) and exchanges the tokens it holds (all of the micro-batch's
without sequence parallelism, its token shard with it) with the ranks of its tp coordinate. Not run here: the dry
run of experts in an nn.ModuleList (the model's own dispatch sizes its tensors from the routing), refused.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from mlm.planner.capture.moe import find_moe
from mlm.planner.errors import Infeasible
from mlm.runtime.tensor_parallel import is_fake


@dataclass(frozen=True)
class ExpertBank:
    """The experts of one MoE layer: a fused bank (3-D weights) or an nn.ModuleList of expert modules."""

    fqn: str  # the bank module, or the expert list
    num_experts: int
    params: tuple[str, ...]  # fused: names inside the bank whose leading extent is num_experts
    kind: str = "fused"  # or "list"
    moe: str = ""  # the MoE module whose forward runs twice ("list")


@dataclass
class ExpertParallel:
    """This rank's expert-parallel state: its ep coordinate and group and the banks it sharded."""

    rank: int
    size: int
    group: dist.ProcessGroup
    banks: list[ExpertBank] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)  # modules holding only this rank's experts: own dp groups
    paused: bool = False  # True during torch's pipeline shape inference (train.py): shapes only, no exchange

    def shard_names(self) -> dict[str, tuple[int, int]]:
        """Model FQN -> (ep rank, ep size) of every fused-bank parameter, of which this rank holds its rows
        (model_build.materialize slices it; full_parameters gathers it back)."""
        return {f"{b.fqn}.{p}": (self.rank, self.size) for b in self.banks if b.kind == "fused" for p in b.params}


def find_banks(model: nn.Module, layers: list[str] | None = None) -> list[ExpertBank]:
    """The fused expert banks of `model` (inside `layers` when given); refuses MoE layers ep cannot run."""
    banks = []
    for fqn, site in find_moe(model).items():
        if layers is not None and not any(fqn == f or fqn.startswith(f + ".") for f in layers):
            continue
        if site.expert_modules and "fused" not in site.ir.how:
            banks.append(ExpertBank(site.expert_modules[0], site.ir.num_experts, (), "list", fqn))
            continue
        if not site.expert_modules:
            raise Infeasible(f"{fqn}: its expert weights lie on the MoE module itself; ep > 1 cannot split them")
        bank_fqn = site.expert_modules[0]
        bank = model.get_submodule(bank_fqn)
        params = tuple(
            n for n, p in bank.named_parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == site.ir.num_experts
        )
        if len(inspect.signature(bank.forward).parameters) != 3:
            raise Infeasible(
                f"{bank_fqn}: ep > 1 needs the expert bank called as experts(tokens, top_k_index, top_k_weights); "
                f"its forward takes {list(inspect.signature(bank.forward).parameters)}: plan it with --ep 1"
            )
        others = [n for n, _ in bank.named_parameters() if n not in params]
        if others:
            raise Infeasible(f"{bank_fqn}: holds {others[0]}, which is not one row per expert; ep > 1 cannot split it")
        banks.append(ExpertBank(bank_fqn, site.ir.num_experts, params))
    return banks


def shard_experts(model: nn.Module, banks: list[ExpertBank], ep: ExpertParallel) -> None:
    """On the meta model: keep this rank's L = E / ep experts of each bank (meta parameters of the local shape)
    and route the bank's calls through the all-to-all exchange (module doc)."""
    for bank in banks:
        if bank.num_experts % ep.size:
            raise Infeasible(f"{bank.fqn}: ep {ep.size} does not divide its {bank.num_experts} experts")
        if bank.kind == "list":
            ep.groups.extend(shard_expert_list(model, bank.moe, bank.fqn, ep))
            ep.banks.append(bank)
            continue
        module = model.get_submodule(bank.fqn)
        local = bank.num_experts // ep.size
        for name in bank.params:
            old = module._parameters[name]
            assert old is not None and old.is_meta, f"{bank.fqn}.{name} must be on meta when sharded"
            shape = (local, *old.shape[1:])
            module._parameters[name] = nn.Parameter(
                torch.empty(shape, dtype=old.dtype, device="meta"), requires_grad=old.requires_grad
            )
        original = module.forward  # the bound forward of the model's own class

        def forward(
            hidden: torch.Tensor,
            top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor,
            _module: nn.Module = module,
            _original: Any = original,
            _num: int = bank.num_experts,
        ) -> torch.Tensor:
            return exchange(_module, _original, _num, ep, hidden, top_k_index, top_k_weights)

        module.forward = forward  # an instance attribute: nn.Module.__call__ (and FSDP2's hooks around it) stay
        ep.banks.append(bank)
        ep.groups.append(bank.fqn)


def sizes_without_values(model: nn.Module, banks: list[ExpertBank]) -> None:
    """ep 1: each fused bank's forward runs through _call_bank, so that under the dry run's fake tensors (routing
    without values) a transformers bank uses its grouped_mm implementation, whose shapes need no values, instead
    of a loop that sizes each expert's rows with nonzero; on real tensors the bank's own forward runs unchanged."""
    for bank in banks:
        if bank.kind == "list":
            continue
        module = model.get_submodule(bank.fqn)
        original = module.forward

        def forward(*args: torch.Tensor, _module: nn.Module = module, _original: Any = original) -> torch.Tensor:
            return _call_bank(_module, _original, *args)

        module.forward = forward


def exchange(
    module: nn.Module,
    original: Any,
    num_experts: int,
    ep: ExpertParallel,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Dispatch, local experts, combine (module doc, steps 1-4). hidden: (tokens, h); index, weights: (tokens, k)."""
    if ep.paused:  # the pipeline's shape inference: the output's shape, differentiably
        return hidden * top_k_weights.sum(-1, keepdim=True).to(hidden.dtype)
    size, local = ep.size, num_experts // ep.size
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, k) pairs by expert, hence by owner rank
    token = order // k
    # the dry run: routing has no values; each expert gets its balanced share (balanced_counts)
    balanced = balanced_counts(flat.numel(), num_experts) if is_fake(flat) else None
    if balanced is not None:
        counts = torch.tensor(balanced, device=flat.device).view(size, local)
    else:
        counts = torch.bincount(flat, minlength=num_experts).view(size, local)

    def run_bank(rows: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] == 0:
            # no row reached this rank's experts: a bank that loops over the experts it was given rows for returns
            # zeros unconnected to its input, so this rank's backward would skip the dispatch's reverse exchange
            # that its peers wait in (a deadlock) and call FSDP's reduction of the bank out of order. One zero row
            # through local expert 0, dropped from the output, keeps the graph the same on every rank; its
            # gradient is exactly zero.
            padded = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
            first = torch.zeros(1, 1, dtype=torch.long, device=rows.device)
            return _local_call(padded, first)[:0]
        expert_of_row = torch.repeat_interleave(
            torch.arange(local, device=rows.device).repeat(size), received.reshape(-1), output_size=rows.shape[0]
        ).unsqueeze(1)
        return _local_call(rows, expert_of_row)

    def _local_call(rows: torch.Tensor, expert_of_row: torch.Tensor) -> torch.Tensor:
        ones = torch.ones(expert_of_row.shape, dtype=top_k_weights.dtype, device=rows.device)
        had = getattr(module, "num_experts", None)
        if isinstance(had, int):
            module.num_experts = local
        try:
            return _call_bank(module, original, rows, expert_of_row, ones)
        finally:
            if isinstance(had, int):
                module.num_experts = had

    back = _rows_to_owners_and_back(hidden[token], counts, ep, run_bank, balanced)
    weights = top_k_weights.reshape(-1)[order].unsqueeze(1).to(back.dtype)
    return torch.zeros_like(hidden, dtype=back.dtype).index_add(0, token, back * weights).to(hidden.dtype)


def _call_bank(module: nn.Module, original: Any, *args: torch.Tensor) -> torch.Tensor:
    """The bank's own forward on the received rows. Under the dry run's fake tensors a loop over experts that finds
    each one's rows with nonzero / where has no size to give; a transformers bank is then run with its grouped_mm
    implementation (transformers' `experts_implementation`: one grouped GEMM over rows sorted by expert, shapes
    known without values), and any other bank is refused with the reason."""
    if not is_fake(args[0]):
        return original(*args)
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    config = getattr(module, "config", None)
    kept = getattr(config, "_experts_implementation", None)
    if kept is None:
        try:
            return original(*args)
        except DynamicOutputShapeException:
            raise Infeasible(
                f"the dry run of ep > 1: the expert bank {type(module).__name__} finds its rows with data-dependent "
                f"ops (nonzero / where), which fake tensors cannot size"
            ) from None
    config._experts_implementation = "grouped_mm"
    try:
        return original(*args)
    finally:
        config._experts_implementation = kept


def _rows_to_owners_and_back(
    send: torch.Tensor,
    counts: torch.Tensor,
    ep: ExpertParallel,
    compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    balanced: list[int] | None = None,
) -> torch.Tensor:
    """The exchange both kinds of experts use. `send`: rows ordered by owner rank, then by the owner's local expert;
    `counts` (ep, L): how many rows go to each. One all-to-all of the counts, the dispatch all_to_all_single
    (autograd), `compute(rows, received)` on the rows received (ordered by source rank, then local expert;
    `received` (ep, L) their numbers) returning one output row per row, and the reverse all_to_all_single: the
    output rows in `send`'s order."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=ep.group)
    if balanced is not None:
        # the dry run: every rank routes its tokens alike (`balanced`, the per-expert counts as a list, since fake
        # tensors hold no values), so it receives from each peer what it sends that peer for its own experts; the
        # all-to-all of the counts above still runs (it is counted)
        local = counts.shape[1]
        mine = balanced[ep.rank * local : (ep.rank + 1) * local]
        received = torch.tensor([mine] * ep.size, device=counts.device)
        send_splits = [sum(balanced[r * local : (r + 1) * local]) for r in range(ep.size)]
        recv_splits = [sum(mine)] * ep.size
    else:
        send_splits, recv_splits = counts.sum(1).tolist(), received.sum(1).tolist()
    rows = wait_tensor(all_to_all_single_autograd(send, recv_splits, send_splits, ep.group))
    out = compute(rows, received)
    return wait_tensor(all_to_all_single_autograd(out, send_splits, recv_splits, ep.group))


def balanced_counts(rows: int, num_experts: int) -> list[int]:
    """`rows` (token, k) pairs spread over `num_experts` as evenly as they go: the routing the cost model prices
    (capacity factor 1), which the dry run executes because fake tensors have no routing values."""
    base, extra = divmod(rows, num_experts)
    return [base + (1 if e < extra else 0) for e in range(num_experts)]


def expert_params(stage_modules: list[nn.Module], ep: ExpertParallel | None) -> list[nn.Parameter]:
    """This rank's expert parameters among the stages' (after the data-parallel wrappers replaced them)."""
    if ep is None:
        return []
    out: list[nn.Parameter] = []
    for fqn in ep.groups:
        for stage in stage_modules:
            try:
                module = stage.get_submodule(fqn)
            except AttributeError:
                continue
            out.extend(module.parameters())
    return out


def gather_over_ep(value: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """The whole bank (all experts, in order) from each ep rank's rows (collective over the ep group)."""
    parts = [torch.empty_like(value) for _ in range(ep.size)]
    dist.all_gather(parts, value.contiguous(), group=ep.group)
    return torch.cat(parts, dim=0)


class _Slot(nn.Module):
    """Stands in an expert list for one expert during a MoE layer's two passes (module doc): records the tokens the
    model's dispatch hands to the expert (pass 1, returning zeros) or returns the exchanged outputs (pass 2)."""

    def __init__(self, calls: _ListCalls, expert: int) -> None:
        super().__init__()
        self.calls, self.expert = calls, expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.calls.call(self.expert, x)


@dataclass
class _ListCalls:
    """The calls of one MoE layer's experts in one forward: inputs recorded in pass 1, outputs replayed in pass 2."""

    recording: bool = True
    inputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def call(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        if self.recording:
            self.inputs.setdefault(expert, []).append(x)
            return torch.zeros_like(x)
        pending = self.outputs.get(expert)
        if not pending:
            raise Infeasible(f"expert {expert} was called more often in the second pass than in the first")
        out = pending.pop(0)
        if out.shape[:-1] != x.shape[:-1]:
            raise Infeasible(f"expert {expert}: its dispatch differs between the two passes (data-dependent shapes)")
        return out


def shard_expert_list(model: nn.Module, site_fqn: str, list_fqn: str, ep: ExpertParallel) -> list[str]:
    """ModuleList experts: keep this rank's L experts (the others become parameter-free slots) and run the MoE
    module's forward twice per call (module doc). Returns the FQNs of the local expert modules."""
    moe = model.get_submodule(site_fqn)
    experts = model.get_submodule(list_fqn)
    local = len(experts) // ep.size  # shard_experts checked that ep divides it
    mine = range(ep.rank * local, (ep.rank + 1) * local)
    keys = list(experts._modules)
    for i, key in enumerate(keys):
        if i not in mine:
            experts._modules[key] = nn.Identity()  # no parameters: never materialised here; replaced in forward
    original = moe.forward

    def forward(*args: Any, _original: Any = original, _experts: nn.Module = experts, **kwargs: Any) -> Any:
        return two_passes(_original, _experts, keys, mine, ep, args, kwargs)

    moe.forward = forward
    return [f"{list_fqn}.{keys[i]}" for i in mine]


def two_passes(
    original: Any, experts: nn.Module, keys: list[str], mine: range, ep: ExpertParallel, args: tuple, kwargs: dict
) -> Any:
    """Pass 1 records what the dispatch gives each expert; one exchange computes every expert on its owner; pass 2
    runs the model's forward again with the experts' outputs (module doc)."""
    calls = _ListCalls()
    if ep.paused:  # the pipeline's shape inference: zeros from every expert, no exchange
        return _with_slots(original, experts, keys, calls, args, kwargs)
    if any(isinstance(a, torch.Tensor) and is_fake(a) for a in pytree.tree_leaves((args, kwargs))):
        raise Infeasible(
            "the dry run of ep > 1 runs fused expert banks only: experts in an nn.ModuleList keep the model's own "
            "dispatch, whose token counts per expert are data-dependent, which fake tensors cannot size"
        )
    real = [experts._modules[keys[i]] for i in mine]
    _with_slots(original, experts, keys, calls, args, kwargs)
    size, local = ep.size, len(mine)
    shapes = [[x.shape for x in calls.inputs.get(e, [])] for e in range(len(keys))]
    counts = [sum(math.prod(s[:-1]) for s in per) for per in shapes]
    flat = [x.reshape(-1, x.shape[-1]) for e in range(len(keys)) for x in calls.inputs.get(e, [])]
    if flat:
        send = torch.cat(flat)
    else:  # no expert was called on this rank: it still takes part in the exchange
        like = next(
            a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.is_floating_point()
        )
        send = like.new_zeros(0, like.shape[-1])

    def run_experts(rows: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        by_source = rows.split(received.reshape(-1).tolist())  # source rank-major, then local expert
        per_expert = []
        for j in range(local):  # each local expert once, on all its rows (every rank calls each: FSDP's hooks agree)
            mine_rows = [by_source[q * local + j] for q in range(size)]
            per_expert.append(real[j](torch.cat(mine_rows)).split([r.shape[0] for r in mine_rows]))
        return torch.cat([per_expert[j][q] for q in range(size) for j in range(local)])

    count_t = torch.tensor(counts, dtype=torch.long, device=send.device).view(size, local)
    back = _rows_to_owners_and_back(send, count_t, ep, run_experts)
    for e, chunk in enumerate(back.split(counts)):
        pieces = chunk.split([math.prod(s[:-1]) for s in shapes[e]]) if shapes[e] else []
        calls.outputs[e] = [c.reshape(*s[:-1], c.shape[-1]) for c, s in zip(pieces, shapes[e])]
    calls.recording = False
    return _with_slots(original, experts, keys, calls, args, kwargs)


def _with_slots(
    original: Any, experts: nn.Module, keys: list[str], calls: _ListCalls, args: tuple, kwargs: dict
) -> Any:
    """The MoE module's own forward with a slot in place of every expert; the experts are put back after."""
    saved = dict(experts._modules)
    for i, key in enumerate(keys):
        experts._modules[key] = _Slot(calls, i)
    try:
        return original(*args, **kwargs)
    finally:
        experts._modules.clear()
        experts._modules.update(saved)
