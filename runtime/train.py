"""Build this rank's part of the plan and train: mesh -> stages -> TP -> recompute -> DP -> schedule -> loop.

Called on every rank with the default process group already initialized (launch.py). Composes PyTorch's own
pieces: DeviceMesh, parallelize_module + loss_parallel, torch.distributed.pipelining schedules, DDP / FSDP2,
torch.utils.checkpoint and torch.distributed.checkpoint. What is written here by hand is only what torch does not
provide: cutting an arbitrary eager model into stages (stages.py), the tied-weight all-reduce across stages and a
global gradient norm over mixed DTensor / plain gradients across stages (optim.py).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from mlm.planner.capture.loader import ModelSpec
from mlm.planner.errors import Infeasible, PlanFileError
from mlm.planner.plan import Plan
from mlm.runtime import checkpoint as ckpt
from mlm.runtime.context_parallel import ContextParallel
from mlm.runtime.data import DropoutSeeds, ExampleSource, TokenSource, data_source, split_rows
from mlm.runtime.data_parallel import apply_data_parallel, choose_data_parallel
from mlm.runtime.expert_parallel import (
    ExpertParallel,
    expert_params,
    find_banks,
    gather_over_ep,
    shard_experts,
    sizes_without_values,
)
from mlm.runtime.faults import Injection, NonFiniteError, StopRequest, injection_from_env
from mlm.runtime.mesh import MeshInfo, build_mesh, check_supported
from mlm.runtime.model_build import (
    LOSS_LAYER,
    LayerCall,
    TensorSpec,
    _fake_mode_active,
    build_meta_model,
    load_checked_spec,
    materialize,
    owner_layer,
    plan_layers,
    record_layer_calls,
    root_parameters,
    row_order,
    tied_groups,
    to_original_order,
)
from mlm.runtime.optim import (
    LossTokens,
    TiedCopy,
    build_optimizer,
    clip_and_scale_grads,
    grad_norm,
    lr_factor,
    set_lr,
    sync_tied_grads,
)
from mlm.runtime.recompute import apply_recompute
from mlm.runtime.stages import (
    Boundary,
    Placeholder,
    StageModule,
    build_stage,
    carry_plan,
    check_stage_boundaries,
    original_fqn,
    stage_ranks,
)
from mlm.runtime.tensor_parallel import apply_tensor_parallel, check_tp_map, gather_full, sequence_parallel_start


@dataclass(frozen=True)
class RunOptions:
    steps: int = 10
    data: Path | None = None
    data_dtype: str = "uint16"
    save: Path | None = None
    save_every: int = 0
    resume: Path | None = None
    device: str = "cpu"
    optimizer: str = "adamw"
    lr: float = 3e-4
    seed: int = 0
    max_grad_norm: float = 1.0
    warmup_steps: int | None = None  # default: 10% of the decay horizon, at most 2000
    lr_decay_steps: int | None = None  # default: steps (set it to the full run's length when stopping early)
    skip_nonfinite: bool = False  # drop the update of a step whose loss or gradient is not finite, and count it
    compute_dtype: str | None = None  # "bf16" / "fp32"; default bf16 on CUDA (unless the plan says fp32), fp32 on CPU
    # False: FSDP2's replicate() where torch DDP would run (fp32, tp 1): the dry run, because DDP's constructor and
    # C++ reducer read and allocate real tensors; replicate() keeps the same bytes (docs/semantics.md)
    allow_ddp: bool = True


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    lr: float
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float | None
    predicted_step_time_s: float | None
    skipped: bool = False  # the update was dropped (non-finite loss or gradient, --skip-nonfinite)


@dataclass
class Runtime:
    """Everything one rank built for the plan."""

    plan: Plan
    opts: RunOptions
    info: MeshInfo
    device: torch.device
    stages: list[StageModule]  # this rank's stages (unwrapped), in stage order
    runners: list[nn.Module]  # what executes each stage (DDP wrapper or the FSDP-sharded stage)
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    schedule: Any  # a torch.distributed.pipelining schedule, or None when pp == 1
    tied: list[TiedCopy]
    canonical: dict[str, str]
    source: TokenSource | ExampleSource
    tp_contexts: Callable[[], contextlib.AbstractContextManager]
    tokens: LossTokens = field(default_factory=LossTokens)  # loss tokens of this step's micro-batches (optim.py)
    dropout: DropoutSeeds | None = None  # per-layer, per-micro-batch RNG seeds (data.py)
    start_step: int = 0
    records: list[StepRecord] = field(default_factory=list)
    stop: StopRequest = field(default_factory=StopRequest)  # set by SIGTERM / SIGINT (faults.py)
    stopped_by: str | None = None  # the signal that ended the run early
    saved_step: int | None = None  # the step of the last checkpoint this run wrote
    skipped: list[int] = field(default_factory=list)  # steps whose update was dropped (--skip-nonfinite)
    experts: ExpertParallel | None = None  # ep > 1: this rank's expert banks and ep group (expert_parallel.py)
    expert_params: list[nn.Parameter] = field(default_factory=list)
    context: ContextParallel | None = None  # cp > 1: this rank's positions and cp group (context_parallel.py)


def check_plan_runnable(plan: Plan) -> None:
    """Everything about the plan itself that would fail after launch; raises a PlanError with one line."""
    lay = plan.layout
    check_supported(lay)
    if lay.pp > 1 and lay.vpp > 1 and lay.num_microbatches % lay.pp != 0:
        raise Infeasible(f"interleaved 1F1B needs num_microbatches ({lay.num_microbatches}) divisible by pp ({lay.pp})")
    if lay.tp > 1:
        if plan.model.num_heads % lay.tp:
            raise Infeasible(f"tp = {lay.tp} does not divide the {plan.model.num_heads} attention heads")
        if plan.model.vocab_size % lay.tp and "vocab" in plan.tensor_parallel.values():
            raise Infeasible(
                f"tp = {lay.tp} does not divide the vocabulary ({plan.model.vocab_size}) for the "
                f"vocabulary-parallel embedding / head"
            )
        if lay.sequence_parallel and plan.training.seq_len % (lay.tp * lay.cp):
            raise Infeasible(
                f"sequence parallelism needs seq_len ({plan.training.seq_len}) divisible by tp·cp = {lay.tp * lay.cp}"
            )
    if lay.cp > 1 and plan.training.seq_len % (2 * lay.cp):
        raise Infeasible(
            f"context parallelism needs seq_len ({plan.training.seq_len}) divisible by 2·cp = {2 * lay.cp} "
            f"(2·cp load-balanced causal chunks)"
        )
    if lay.micro_batch * lay.num_microbatches * lay.dp != plan.training.global_batch:
        raise PlanFileError("plan.json: training.global_batch != micro_batch * num_microbatches * dp")


def schedule_name(plan: Plan) -> str:
    lay = plan.layout
    if lay.pp == 1:
        return "none"
    if lay.vpp > 1:
        return "interleaved-1f1b"
    return "1f1b" if lay.num_microbatches >= lay.pp else "gpipe"  # 1F1B needs >= pp micro-batches


def setup(
    plan: Plan,
    opts: RunOptions,
    spec: ModelSpec | None = None,
    *,
    mesh: MeshInfo | None = None,
    tensor_mode: contextlib.AbstractContextManager | None = None,
) -> Runtime:
    """Build this rank's part of the plan. `mesh` and `tensor_mode` serve the dry run (dry_run.py): the mesh is
    built before entering a FakeTensorMode (DeviceMesh reads ranks from real tensors), and everything that
    allocates (model, stages, TP, FSDP, optimizer) is built inside `tensor_mode`."""
    check_plan_runnable(plan)
    lay = plan.layout
    device = _device(opts.device)
    info = mesh or build_mesh(lay, device.type)
    spec = spec or load_checked_spec(plan)
    calls = record_layer_calls(spec, plan, lay.micro_batch)
    check_stage_boundaries(plan, calls)
    with tensor_mode or contextlib.nullcontext():
        return _build_runtime(plan, opts, spec, info, device, calls)


def compute_dtype(plan: Plan, opts: RunOptions, device: torch.device) -> torch.dtype:
    """The forward/backward dtype: bf16 on CUDA (fp32 master weights and reductions, data_parallel.py), fp32 on
    CPU (exact parity with one process); RunOptions.compute_dtype overrides (the dry run emulates CUDA on CPU)."""
    name = opts.compute_dtype
    if name is None:
        name = "fp32" if device.type != "cuda" or plan.training.dtype == "fp32" else "bf16"
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if name not in dtypes:
        raise PlanFileError(f"compute dtype {name!r}: expected one of {', '.join(dtypes)}")
    return dtypes[name]


def _build_runtime(
    plan: Plan, opts: RunOptions, spec: ModelSpec, info: MeshInfo, device: torch.device, calls: dict[str, Any]
) -> Runtime:
    """Meta model -> stages -> TP -> recompute -> FSDP2 (all on meta) -> materialise this rank's shards -> DDP,
    optimizer, schedule (torchtitan's order; model_build.py says how the weights stay layout-independent)."""
    lay = plan.layout
    meta = build_meta_model(spec, opts.seed, cpu=device.type == "cpu")
    model = meta.model
    check_tp_map(plan.tensor_parallel, model)
    canonical = meta.canonical
    ties = tied_groups(model)  # before TP / FSDP replace the parameters of this rank's layers
    roots = root_parameters(model, plan_layers(plan))
    seq_start = sequence_parallel_start(model, plan.tensor_parallel) if lay.sequence_parallel else None
    dtype = compute_dtype(plan, opts, device)
    tokens = LossTokens()
    loss_fn = tokens.wrap_loss_fn(spec.loss_fn)
    mine = [i for i, r in enumerate(stage_ranks(plan)) if r == info.pp_rank]
    context = None
    if lay.cp > 1:
        context = ContextParallel(info.cp_rank, info.cp_size, info.cp_group, plan.training.seq_len)
        calls, first_cp_layer = _context_parallel_layers(model, plan, calls, context)
    stages: list[StageModule] = []
    vocab_head = False
    experts = None
    owned = [f for i in mine for f in plan.stages[i].layers if f != LOSS_LAYER]
    if lay.ep > 1:
        if opts.save is not None or opts.resume is not None:
            raise Infeasible("--save / --resume with ep > 1: checkpoints of expert-parallel banks are not written yet")
        experts = ExpertParallel(info.ep_rank, info.ep_size, info.ep_group)
        shard_experts(model, find_banks(model, owned), experts)
    elif _fake_mode_active():  # the dry run
        sizes_without_values(model, find_banks(model, owned))
    carry = carry_plan(plan, calls)  # activations that skip over stage boundaries (stages.py)
    for i in mine:
        stage = build_stage(model, loss_fn, plan, i, calls, device, carry=carry)
        if context is not None:
            context.shard_targets(stage.inner, first_cp_layer)
        if stage.is_last:
            tokens.attach(stage.inner, counts_inside_forward=spec.loss_fn is None)
        if lay.tp > 1:
            vocab_head |= apply_tensor_parallel(
                stage.inner.model,
                plan.tensor_parallel,
                info.tp_mesh,
                lay.sequence_parallel,
                seq_start,
                layers=plan_layers(plan),
                calls={k: v for c in calls.values() for k, v in c.inner.items()},
                modified_in_place={f for c in calls.values() for f in c.modified_in_place},
            )
        for fqn in plan.stages[i].recompute_layers:
            if fqn != LOSS_LAYER:
                apply_recompute(
                    stage.inner.model.get_submodule(fqn), "selective" if lay.recompute == "selective" else "full"
                )
        stages.append(stage)
    choice = choose_data_parallel(lay, schedule_name(plan), dtype, opts.allow_ddp)
    runners: list[nn.Module] = []
    row_shards = experts.shard_names() if experts is not None else None
    for st in stages:
        layers = [st.inner.model.get_submodule(f) for f in st.layers]
        banks = None
        if experts is not None:
            inside = [g for g in experts.groups if any(g.startswith(f + ".") for f in st.layers)]
            banks = ([st.inner.model.get_submodule(f) for f in inside], info.expert_dp_mesh)
        if choice.wrapper != "ddp":
            runners.append(apply_data_parallel(st, layers, choice, info.dp_mesh, dtype, banks))
        materialize(st, meta, device, original_fqn, row_shards)
        if choice.wrapper == "ddp":  # DDP broadcasts real parameters when built
            runners.append(apply_data_parallel(st, layers, choice, info.dp_mesh, dtype))
    tied = _tied_copies(ties, plan, info, stages) + _root_copies(roots, plan, info, stages)
    del model, meta  # other stages' layers are freed; this rank keeps only its own
    dropout = DropoutSeeds(opts.seed, info.data_rank, lay.num_microbatches, device)
    for st in stages:
        # its own layers and the parameter-free ones every stage runs (T5's encoder.dropout, on a carried input)
        runs = [(f, st.inner.model.get_submodule(f)) for f in plan_layers(plan)]
        dropout.attach(st, [(f, m) for f, m in runs if f in st.layers or not isinstance(m, (Placeholder, Boundary))])
    params = _unique_params(stages)
    optimizer = build_optimizer(params, opts.optimizer, opts.lr)
    paused = tuple(c for c in (tokens, dropout, experts, context) if c is not None)
    schedule = _build_schedule(plan, stages, runners, info, device, paused)
    source = data_source(plan, spec, opts.seed, opts.data, opts.data_dtype)
    source.check()
    rt = Runtime(
        plan,
        opts,
        info,
        device,
        stages,
        runners,
        params,
        optimizer,
        schedule,
        tied,
        canonical,
        source,
        partial_contexts(lay.tp > 1, vocab_head, device),
        tokens,
        dropout,
    )
    rt.experts = experts
    rt.expert_params = expert_params([st.inner.model for st in stages], experts)
    rt.context = context
    if opts.resume is not None:
        _resume(rt, opts.resume)
    return rt


def _context_parallel_layers(
    model: nn.Module, plan: Plan, calls: dict[str, LayerCall], context: ContextParallel
) -> tuple[dict[str, LayerCall], str]:
    """Make every plan layer from the first one that reads an activation run on this rank's positions
    (context_parallel.py). Returns the recorded calls with those layers' outputs as long as this rank's part of
    the sequence (what their placeholders on other stages stand for), and that first layer."""
    layers = plan_layers(plan)
    start = next((i for i, f in enumerate(layers) if calls[f].grad_leaves), 0)
    out = dict(calls)
    for fqn in layers[start:]:
        context.wrap_layer(fqn, model.get_submodule(fqn), calls[fqn].leaf_shapes)
        local = pytree.tree_map(
            lambda x: TensorSpec(context.local_shape(x.shape), x.dtype) if isinstance(x, TensorSpec) else x,
            calls[fqn].output,
        )
        out[fqn] = replace(calls[fqn], output=local)
    return out, layers[start]


def partial_contexts(tp: bool, vocab_head: bool, device: torch.device) -> Callable[[], contextlib.ExitStack]:
    """Contexts around forward + backward under tensor parallelism: loss_parallel must enclose the backward too
    (so it wraps the whole schedule step); implicit_replication lets user code mix plain tensors (rotary tables,
    masks) with DTensors. Attention kernels on CPU: an SDPA call on DTensors (attention outside a TP region) runs
    the math kernel, because DTensor has no sharding rule for the CPU flash kernel; attention of a region, on
    local per-head tensors, keeps SDPA's own choice, the flash kernel, as one process runs it and as the plan
    prices it (it saves only the logsumexp; the math kernel saves the s x s scores and took twice as long on a
    CPU: benchmarks/cpu_calibration_loop.py)."""

    def enter() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if tp:
            from torch.distributed.tensor.experimental import implicit_replication

            stack.enter_context(implicit_replication())
            if vocab_head:
                from torch.distributed.tensor.parallel import loss_parallel

                stack.enter_context(loss_parallel())
            if device.type == "cpu":
                from torch.distributed.tensor import DTensor
                from torch.nn.attention import SDPBackend, sdpa_kernel
                from torch.overrides import TorchFunctionMode

                class MathForDTensorAttention(TorchFunctionMode):
                    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
                        kwargs = kwargs or {}
                        if func is torch.nn.functional.scaled_dot_product_attention and any(
                            isinstance(x, DTensor) for x in (*args, *kwargs.values())
                        ):
                            with sdpa_kernel(SDPBackend.MATH):
                                return func(*args, **kwargs)
                        return func(*args, **kwargs)

                stack.enter_context(MathForDTensorAttention())
        return stack

    return enter


def _device(name: str) -> torch.device:
    if name == "cuda":
        if not torch.cuda.is_available():
            raise Infeasible("--device cuda but no CUDA GPU is visible")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _unique_params(stages: list[StageModule]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for st in stages:
        for p in st.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _tied_copies(ties: list[list[str]], plan: Plan, info: MeshInfo, stages: list[StageModule]) -> list[TiedCopy]:
    """Groups of ranks that each hold one copy of a weight tied across pipeline stages (created on every rank in
    the same order, as new_group requires)."""
    layers = plan_layers(plan)
    stage_of = {fqn: i for i, s in enumerate(plan.stages) for fqn in s.layers}
    ranks_of_stage = stage_ranks(plan)
    lay = plan.layout
    copies: list[TiedCopy] = []
    for group in ties:
        names = [n for n in group if any(n.startswith(f + ".") for f in layers)]  # not T5's uncalled `shared`
        owners: dict[int, list[str]] = {}
        for name in names:
            owners.setdefault(ranks_of_stage[stage_of[owner_layer(name, layers)]], []).append(name)
        if len(owners) < 2:
            continue
        stages_per_rank = {r: {stage_of[owner_layer(n, layers)] for n in ns} for r, ns in owners.items()}
        if any(len(s) > 1 for s in stages_per_rank.values()):
            raise PlanFileError(
                f"plan.json: tied parameters {', '.join(names)} lie on two stages of one pipeline "
                f"rank; place them on one stage or on different ranks"
            )
        pp_ranks = sorted(owners)
        for d in range(lay.dp * lay.cp):  # the mesh's dp axis (mesh.py)
            for t in range(lay.tp):
                group = dist.new_group([info.global_rank(p, d, t) for p in pp_ranks])
                if (d, t) == (info.dp_rank, info.tp_rank) and info.pp_rank in owners:
                    name = owners[info.pp_rank][0]
                    stage = next(st for st in stages if name.startswith(tuple(f + "." for f in st.layers)))
                    param = stage.inner.model.get_parameter(name)
                    copies.append(TiedCopy(param, group, primary=info.pp_rank == pp_ranks[0]))
    return copies


def _root_copies(names: list[str], plan: Plan, info: MeshInfo, stages: list[StageModule]) -> list[TiedCopy]:
    """Every pipeline rank holds the root parameters (model_build.root_parameters); like a tied weight's copies,
    their gradients are summed over the pipeline ranks (only the stage whose root code reads them with real
    values has any) so that every copy takes the same step."""
    lay = plan.layout
    if lay.pp == 1 or not names:
        return []
    copies: list[TiedCopy] = []
    for name in names:
        held = {id(st.inner.model.get_parameter(name)): st.inner.model.get_parameter(name) for st in stages}
        if len(held) > 1:
            raise Infeasible(
                f"root parameter {name} (outside every layer) with several stages on one pipeline rank under a "
                f"data-parallel wrapper: not supported; plan without interleaving (vpp 1)"
            )
        for d in range(lay.dp * lay.cp):
            for t in range(lay.tp):
                group = dist.new_group([info.global_rank(p, d, t) for p in range(lay.pp)])
                if (d, t) == (info.dp_rank, info.tp_rank):
                    copies.append(TiedCopy(next(iter(held.values())), group, primary=info.pp_rank == 0))
    return copies


def _identity_loss(output: torch.Tensor, _target: Any) -> torch.Tensor:
    return output.reshape(())  # the last stage already returns the training loss (TrainingModule)


def _build_schedule(
    plan: Plan,
    stages: list[StageModule],
    runners: list[nn.Module],
    info: MeshInfo,
    device: torch.device,
    counters: tuple[Any, ...] = (),
) -> Any:
    if plan.layout.pp == 1:
        return None
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    n = plan.layout.num_microbatches
    pstages = [
        PipelineStage(r, st.index, len(plan.stages), device, group=info.pp_group) for r, st in zip(runners, stages)
    ]
    for ps in pstages:
        _pause_during_shape_inference(ps, counters)
    name = schedule_name(plan)
    if name == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(pstages, n_microbatches=n, loss_fn=_identity_loss, scale_grads=False)
    cls = Schedule1F1B if name == "1f1b" else ScheduleGPipe
    return cls(pstages[0], n_microbatches=n, loss_fn=_identity_loss, scale_grads=False)  # loss sums (optim.py)


def _pause_during_shape_inference(stage: Any, counters: tuple[Any, ...]) -> None:
    """The first step's extra forward that infers a stage's input/output shapes (torch 2.13, on empty tensors)
    must not count loss tokens, advance the dropout micro-batch index, nor exchange tokens between expert-parallel
    ranks (whose routing of uninitialised values would be garbage, at other times on each rank). Under DDP it also
    runs in no_sync: torch calls the DDP module directly there (not via forward_maybe_with_nosync), so DDP's
    forward would arm its reducer for a backward that never comes; the next micro-batch's backward then reduced
    early and the last one again, recording every parameter twice (the step-2 assert "rebuilt parameter indices
    size is not same as original model parameters size (26 vs 52)")."""
    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:
        return
    no_sync = getattr(stage.submod, "no_sync", None)

    def paused(*args: Any, **kwargs: Any) -> Any:
        for c in counters:
            c.paused = True
        try:
            with no_sync() if no_sync is not None else contextlib.nullcontext():
                return infer(*args, **kwargs)
        finally:
            for c in counters:
                c.paused = False

    stage._forward_metadata_inference = paused


def _resume(rt: Runtime, directory: Path) -> None:
    meta = ckpt.read_meta(directory)
    if meta.get("model_sha256") != rt.plan.model.sha256:
        raise ckpt.CheckpointError(f"--resume {directory}: saved for another model file (sha256 differs)")
    if rt.opts.optimizer == "adamw":
        ckpt.init_optimizer_state(rt.optimizer)
    ckpt.load(directory, *ckpt.training_state(rt.stages, rt.optimizer, rt.canonical))
    rt.start_step = int(meta["step"])


def save_checkpoint(rt: Runtime, step: int) -> None:
    """Save this step's state (collective); refuses a state with non-finite parameters (never saved over a good
    checkpoint)."""
    assert rt.opts.save is not None
    bad = torch.zeros(1, device=rt.device)
    with torch.no_grad():
        for p in rt.params:
            local = p.to_local() if hasattr(p, "to_local") else p
            if not bool(torch.isfinite(local).all()):
                bad.fill_(1.0)
                break
    dist.all_reduce(bad)
    if float(bad) > 0:
        raise NonFiniteError(
            f"step {step}: the parameters hold NaN or infinite values; not saving them over the "
            f"checkpoint in {rt.opts.save}"
        )
    meta = {
        "model_sha256": rt.plan.model.sha256,
        "layout": rt.plan.layout.describe(),
        "seed": rt.opts.seed,
        "optimizer": rt.opts.optimizer,
    }
    state, orders = ckpt.training_state(rt.stages, rt.optimizer, rt.canonical)
    ckpt.save(rt.opts.save, step, state, meta, orders)
    rt.saved_step = step


# ---- the training loop ----


def train(
    plan: Plan, opts: RunOptions, spec: ModelSpec | None = None, on_step: Callable[[StepRecord], None] | None = None
) -> Runtime:
    rt = setup(plan, opts, spec)
    run_steps(rt, on_step)
    return rt


def run_steps(rt: Runtime, on_step: Callable[[StepRecord], None] | None = None) -> None:
    """Train from rt.start_step to opts.steps. Stops early, after finishing the step and saving (when --save),
    if any rank got SIGTERM / SIGINT (rt.stop); raises NonFiniteError on a non-finite step unless
    skip_nonfinite."""
    opts, lay = rt.opts, rt.plan.layout
    decay = opts.lr_decay_steps or opts.steps
    warmup = opts.warmup_steps if opts.warmup_steps is not None else max(1, min(2000, decay // 10))
    flops = step_flops(rt.plan)
    inject = injection_from_env()
    for step in range(rt.start_step, opts.steps):
        start = time.perf_counter()
        factor = lr_factor(step, warmup, decay)
        set_lr(rt.optimizer, opts.lr, factor)
        inputs, targets = rt.source.batch(step, rt.info.data_rank, lay.dp, rt.device)
        rt.optimizer.zero_grad(set_to_none=True)
        if rt.dropout is not None:
            rt.dropout.start_step(step)
        with rt.tp_contexts():
            loss_sum = _forward_backward(rt, inputs, targets)
        if inject is not None and inject.step == step + 1 and inject.rank == dist.get_rank():
            loss_sum = _inject(rt, inject, loss_sum)
        sync_tied_grads(rt.tied)
        for p in rt.expert_params:  # the dp wrapper averaged over the dp/ep holders only (expert_parallel.py)
            if p.grad is not None:
                p.grad.div_(lay.ep)
        exclude = {id(c.param) for c in rt.tied if not c.primary}
        distinct = {id(p): lay.ep for p in rt.expert_params}
        raw_norm = float(grad_norm(rt.params, rt.info.pp_group if lay.pp > 1 else None, exclude, distinct))
        loss, tokens, stop, nonfinite = _reduce_step(rt, loss_sum, rt.tokens.take(), raw_norm)
        scale = lay.dp * lay.cp / tokens  # loss sums -> global token mean; the dp wrappers average over dp·cp ranks
        norm = raw_norm * scale
        skipped = False
        if nonfinite:
            if not opts.skip_nonfinite:
                raise NonFiniteError(_nonfinite_message(rt, step + 1, loss, norm))
            rt.optimizer.zero_grad(set_to_none=True)  # drop this step's update; parameters stay finite
            rt.skipped.append(step + 1)
            skipped = True
        else:
            clip_and_scale_grads(rt.params, opts.max_grad_norm, raw_norm, scale)
            rt.optimizer.step()
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        record = _record(rt, step, loss, norm, opts.lr * factor, elapsed, flops, skipped)
        rt.records.append(record)
        if on_step is not None:
            on_step(record)
        done = step + 1
        due = (opts.save_every and done % opts.save_every == 0) or done == opts.steps
        if opts.save is not None and (due or stop):
            save_checkpoint(rt, done)
        if stop:
            rt.stopped_by = rt.stop.signal_name or "a signal on another rank"
            return


def _inject(rt: Runtime, inject: Injection, loss_sum: torch.Tensor) -> torch.Tensor:
    """The MLM_INJECT_NONFINITE test hook (faults.py)."""
    if inject.kind == "grad":
        for p in rt.params:
            if p.grad is not None:
                (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).fill_(float("nan"))
                break
        return loss_sum
    return loss_sum + float("nan")


def _nonfinite_message(rt: Runtime, step: int, loss: float, norm: float) -> str:
    what = "loss" if not math.isfinite(loss) else "gradient norm"
    kept = ""
    if rt.opts.save is not None:
        last = rt.saved_step if rt.saved_step is not None else ckpt.latest_step(rt.opts.save)
        kept = (
            f"; the checkpoint in {rt.opts.save} (step {last}) is untouched"
            if last is not None
            else "; nothing was saved"
        )
    return (
        f"step {step}: non-finite {what} (loss {loss}, gradient norm {norm}); stopped before the optimizer "
        f"step{kept}. Lower --lr or --max-grad-norm, check the data, or pass --skip-nonfinite to drop such "
        f"steps"
    )


def _forward_backward(rt: Runtime, inputs: Any, targets: Any) -> torch.Tensor:
    """One global step's forward and backward on this rank; returns the sum of its micro-batch losses (zero on
    ranks without the last stage)."""
    n = rt.plan.layout.num_microbatches
    if rt.schedule is not None:
        losses: list[torch.Tensor] = []
        rt.schedule.step(inputs=inputs, targets=targets, target=targets, losses=losses)
        return sum((_plain(x).detach() for x in losses), torch.zeros((), device=rt.device))
    runner = rt.runners[0]
    total = torch.zeros((), device=rt.device)
    each = rt.plan.layout.zero == 3  # ZeRO-3 keeps only gradient shards: reduce-scatter after every micro-batch
    for i, (inp, tgt) in enumerate(zip(split_rows(inputs, n), split_rows(targets, n))):
        with _grad_sync(runner, last=each or i == n - 1):
            loss = runner(inputs=inp, targets=tgt).reshape(())  # the micro-batch's loss sum (optim.py)
            loss.backward()
        total = total + _plain(loss).detach()
    return total


@contextlib.contextmanager
def _grad_sync(runner: nn.Module, last: bool) -> Iterator[None]:
    """Gradient accumulation: reduce over dp only after the last micro-batch."""
    if hasattr(runner, "no_sync") and not last:
        with runner.no_sync():
            yield
        return
    if hasattr(runner, "set_requires_gradient_sync"):
        runner.set_requires_gradient_sync(last)
    yield


def _plain(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def _reduce_step(
    rt: Runtime, loss_sum: torch.Tensor, tokens: torch.Tensor, norm: float
) -> tuple[float, float, bool, bool]:
    """One all-reduce per step gives every rank the step's loss sum and token count over the global batch (so the
    token-mean loss and the gradient scale), whether any rank was asked to stop (SIGTERM / SIGINT), and whether any
    rank saw a non-finite loss or gradient norm. Returns (mean loss, tokens, stop, non-finite)."""
    lay, info = rt.plan.layout, rt.info
    holder = info.pp_rank == lay.pp - 1 and info.tp_rank == 0
    zero = torch.zeros(1, device=rt.device)
    loss = _plain(loss_sum).float().reshape(1).to(rt.device) if holder else zero
    count = tokens.float().reshape(1).to(rt.device) if holder else zero
    loss_bad = not bool(torch.isfinite(loss).all())
    flags = [1.0 if rt.stop.requested else 0.0, 1.0 if loss_bad else 0.0, 0.0 if math.isfinite(norm) else 1.0]
    clean = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0)
    value = torch.cat([clean, count, torch.tensor(flags, device=rt.device)])
    dist.all_reduce(value)
    total = max(float(value[1]), 1.0)
    stop, any_loss_bad, any_norm_bad = (float(v) > 0 for v in value[2:])
    mean = float("nan") if any_loss_bad else float(value[0]) / total
    return mean, total, stop, any_loss_bad or any_norm_bad


def step_flops(plan: Plan) -> float:
    """Model FLOPs of one global step, fwd + bwd without recompute (Korthikanti et al. 2022, eq. 3 without the
    recompute term): 72 B s l h^2 (1 + s/(6h) + V/(12 l h))."""
    b, s = plan.training.global_batch, plan.training.seq_len
    l, h, v = plan.model.num_layers, plan.model.hidden_size, plan.model.vocab_size
    if not (l and h):
        return 6.0 * plan.model.num_params * b * s
    return 72.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def peak_tflops(plan: Plan) -> float | None:
    for key, value in plan.cluster.profile.items():
        if "bf16" in key and "tflops" in key and isinstance(value, (int, float)) and value > 0:
            return float(value)
    return None


def _record(
    rt: Runtime, step: int, loss: float, norm: float, lr: float, elapsed: float, flops: float, skipped: bool = False
) -> StepRecord:
    plan = rt.plan
    tokens = plan.training.global_batch * plan.training.seq_len
    tflops = flops / elapsed / plan.layout.world_size / 1e12
    peak = peak_tflops(plan) if rt.device.type == "cuda" else None
    predicted = plan.predicted.step_time_s if plan.predicted is not None else None
    return StepRecord(
        step=step + 1,
        loss=loss,
        grad_norm=norm,
        lr=lr,
        step_time_s=elapsed,
        tokens_per_s=tokens / elapsed,
        tflops_per_gpu=tflops,
        mfu=(tflops / peak) if peak else None,
        predicted_step_time_s=predicted,
        skipped=skipped,
    )


def full_parameters(rt: Runtime) -> dict[str, torch.Tensor]:
    """This rank's parameters gathered to full tensors on CPU, by original FQN (collective over dp and tp)."""
    out: dict[str, torch.Tensor] = {}
    experts = rt.experts
    rows = experts.shard_names() if experts is not None else {}
    for st in rt.stages:
        for name, p in st.named_parameters(remove_duplicate=False):
            value = gather_full(p)  # not p.full_tensor(): torch 2.13 gathers strided (per-head) shards wrongly
            value = to_original_order(value, row_order(st, name))
            if original_fqn(name) in rows:
                assert experts is not None
                value = gather_over_ep(value, experts)
            out[original_fqn(name)] = value.detach().cpu().clone()
    return out
