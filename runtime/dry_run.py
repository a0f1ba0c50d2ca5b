"""`mlm-run --dry-run`: one training step of every distinct rank role at the plan's real sizes, allocating nothing.

Each role is built by the same `setup()` that `mlm-run` uses, on fake tensors (FakeTensorMode) over torch's "fake"
process-group backend (collectives return at once; Megatron's --fake-process-group and torchtitan's memory
estimation do the same), and driven through one step: forward and backward of every micro-batch in the pipeline
schedule's own action order, the gradient reductions, tied-weight sync, gradient norm and the optimizer step, with
the optimizer state created first so the step is the steady state. Measured on the way:

- memory: runtime/memory_tracker.py (live storages by category: parameters, buffers, gradients, activations,
  temporaries, optimizer state; its docstring says why not torch's MemTracker) at the step's peak, plus the
  pipeline receive buffers;
- collectives: every c10d / functional collective the step issues, counted with its payload bytes (CommDebugMode
  counts calls but not bytes, so `CollectiveCounter` is a small dispatch mode over the same op sets).

Attention kernels: fake tensors live on the CPU, where SDPA with a mask or with dropout can only run its math kernel,
which saves the s x s probabilities (and the dropout mask) for backward; a CUDA device runs those calls with the
memory-efficient kernel, which saves the output and the log-sum-exp. The dry run stands for the CUDA run, so it runs
such calls through aten's memory-efficient op (`GpuAttentionKernels`), as the cost model prices them.

Roles: one rank per pipeline rank (dp_rank 0, tp_rank 0). Data- and tensor-parallel ranks of one pipeline rank run
the same program on equal shards (the dp shards of FSDP2 differ by at most one padding row, tp shards are equal when
tp divides the dimensions, which check_plan_runnable requires), so one of them stands for all.

Pipeline schedules are not run through `schedule.step()`: torch's schedules exchange tensor metadata and vote over
real point-to-point messages on their first step, which a fake process group cannot answer. The dry run executes the
schedule's `pipeline_order` for this rank instead (the same F / B / REDUCE_GRAD actions), with the received
activations and gradients as fake tensors of the shapes recorded on the meta device, and adds the receive buffers
that torch's PipelineStage allocates per micro-batch (activations forward, gradients backward; kept for the step).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from mlm.planner.capture.hf_positions import unpacked_positions
from mlm.planner.capture.loader import ModelSpec
from mlm.planner.errors import PlanError
from mlm.planner.plan import Plan
from mlm.runtime.data import split_rows
from mlm.runtime.memory_tracker import StorageTracker
from mlm.runtime.mesh import MeshInfo, build_mesh
from mlm.runtime.model_build import TensorSpec, load_checked_spec
from mlm.runtime.optim import grad_norm, sync_tied_grads


@dataclass
class CollectiveTotals:
    count: int = 0
    bytes: float = 0.0


@dataclass
class RoleReport:
    """What one rank role measured in its dry-run step."""

    rank: int
    pp_rank: int
    stages: list[int]
    peak_memory_bytes: float
    memory_by_category: dict[str, float]
    collectives: dict[str, CollectiveTotals]
    seconds: float
    notes: list[str] = field(default_factory=list)


class CollectiveCounter(TorchDispatchMode):
    """Counts each collective op by name with its payload: the full (unsharded) tensor an all-gather produces or a
    reduce-scatter consumes, the tensor an all-reduce / broadcast / all-to-all / p2p carries."""

    def __init__(self) -> None:
        super().__init__()
        from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops, funcol_native, funcol_py

        self._ops = set(c10d_collective_ops) | {getattr(funcol_native, n) for n in _FUNCOL_NAMES}
        self._ops |= {getattr(funcol_py, n) for n in _FUNCOL_NAMES if hasattr(funcol_py, n)}
        self.totals: dict[str, CollectiveTotals] = {}
        self.micro_batch: int | None = None  # set while a pipeline action of this micro-batch runs
        self.by_micro_batch: dict[int, dict[str, CollectiveTotals]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(issubclass(t, DTensor) for t in types) and not isinstance(func, torch._ops.HigherOrderOperator):
            # as CommDebugMode does: let DTensor desugar the op first, so that the collectives its op handlers
            # issue (loss_parallel's reductions, a norm's partial reduction) reach this mode on local tensors;
            # running func here would run them with this mode popped, unseen
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "overloadpacket", func)
        if packet in self._ops or func in self._ops:
            name = canonical_collective(str(getattr(packet, "__name__", packet)))
            nbytes = _payload_bytes(name, args, out)
            tables = [self.totals]
            if self.micro_batch is not None:
                tables.append(self.by_micro_batch.setdefault(self.micro_batch, {}))
            for table in tables:
                entry = table.setdefault(name, CollectiveTotals())
                entry.count += 1
                entry.bytes += nbytes
        return out

    def extrapolate(self, executed: int, planned: int) -> None:
        """Add the collectives of micro-batches planned but not executed, each like micro-batch 1 (neither the
        first, which may gather parameters, nor the last, which reduces gradients)."""
        if planned <= executed:
            return
        typical = self.by_micro_batch.get(1 if executed >= 3 else 0, {})
        for name, entry in typical.items():
            total = self.totals.setdefault(name, CollectiveTotals())
            total.count += (planned - executed) * entry.count
            total.bytes += (planned - executed) * entry.bytes


def executed_microbatches(layout: Any) -> int:
    """How many of the plan's micro-batches the dry run executes: enough for the schedule to reach its steady
    state, so the memory peak (the most micro-batches in flight) is the full schedule's, and at least three, so
    one typical micro-batch (neither first nor last) is measured for the rest.

    1F1B: rank r has at most pp − r in flight, reached with pp micro-batches. Interleaved 1F1B (torch's
    ScheduleInterleaved1F1B): rank 0 runs (vpp − 1)·pp + 2·(pp − 1) warm-up forwards of its m·vpp before the first
    backward; one round past that, rounded up to a multiple of pp as the schedule requires. Without pipelining
    every micro-batch runs (they are few, and the step code is train.py's own)."""
    m, pp, vpp = layout.num_microbatches, layout.pp, layout.vpp
    if pp == 1:
        return m
    if vpp == 1:
        return min(m, max(pp, 3))
    warmup = (vpp - 1) * pp + 2 * (pp - 1)
    need = max(3, -(-(warmup + 2) // vpp))
    return min(m, -(-need // pp) * pp)


_FUNCOL_NAMES = (
    "all_gather_into_tensor",
    "all_gather_into_tensor_coalesced",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all_single",
    "broadcast",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced",
)


def canonical_collective(name: str) -> str:
    """One name per collective kind, whichever API issued it (c10d op, functional collective, coalesced form)."""
    n = name.split(".")[-1].strip("_").replace("_coalesced", "").replace("_into_tensor", "")
    if n in ("allgather", "all_gather", "allgather_base"):
        return "all_gather"
    if n in ("allreduce", "all_reduce"):
        return "all_reduce"
    if n in ("reduce_scatter", "reduce_scatter_base", "reduce_scatter_tensor"):
        return "reduce_scatter"
    if n in ("alltoall", "alltoall_base", "all_to_all_single", "all_to_all"):
        return "all_to_all"
    return n


def _tensor_bytes(x: Any) -> float:
    return float(sum(t.numel() * t.element_size() for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)))


def _payload_bytes(name: str, args: tuple, out: Any) -> float:
    if name == "all_gather":
        # c10d allgather_ and _allgather_base_ write into their first argument; functional ones return it
        target = args[0] if args and not _is_functional(out) else out
        return _tensor_bytes(target)
    if name == "reduce_scatter":
        source = args[1] if len(args) > 1 and not _is_functional(out) else args[0]
        return _tensor_bytes(source)
    return _tensor_bytes(args[0]) if args else 0.0


def _is_functional(out: Any) -> bool:
    return isinstance(out, torch.Tensor) or (isinstance(out, list) and all(isinstance(t, torch.Tensor) for t in out))


def dry_run(
    plan: Plan,
    opts: Any = None,
    pp_ranks: list[int] | None = None,
    progress: Callable[[str], None] | None = None,
    workers: int | None = None,
) -> list[RoleReport]:
    """Dry-run one step of each pipeline rank's role (all of them unless `pp_ranks`); see the module doc.

    Each role runs in a fresh process (a process group and the meshes and DTensor caches built on it cannot be
    torn down and rebuilt for another rank in one process), `workers` at a time (default: the CPU count, at most
    4: each role holds its model's fake tensors and the Python objects of its stages)."""
    import concurrent.futures
    import multiprocessing
    import os

    from mlm.runtime.train import check_plan_runnable

    check_plan_runnable(plan)
    opts = opts or dry_run_options(plan)
    ranks = list(pp_ranks if pp_ranks is not None else range(plan.layout.pp))
    workers = workers or max(1, min(4, os.cpu_count() or 1, len(ranks)))
    context = _fresh_process_context(multiprocessing)
    env = dict(os.environ)  # a forkserver's children inherit the environment of its start, not today's
    reports: dict[int, RoleReport] = {}
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context, max_tasks_per_child=1) as pool:
        futures = {pool.submit(_role_in_worker, plan, opts, r, env): r for r in ranks}
        for future in concurrent.futures.as_completed(futures):
            report = future.result()
            reports[report.pp_rank] = report
            if progress is not None:
                progress(f"pipeline rank {report.pp_rank} done in {report.seconds:.1f} s ({len(reports)}/{len(ranks)})")
    return [reports[r] for r in ranks]


def _fresh_process_context(multiprocessing: Any) -> Any:
    """Where the platform has it, a forkserver that imported torch and the runtime once: each role still starts in
    a process of its own with no process group, without paying torch's import again (about 2.5 s of each role's
    start on a 2-core CPU). Elsewhere, spawn."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "mlm.runtime.train", "mlm.runtime.dry_run"])
    return context


def _role_in_worker(plan: Plan, opts: Any, pp_rank: int, env: dict[str, str] | None = None) -> RoleReport:
    """dry_run_role in a pool worker, whose exception must cross back pickled: one that cannot (torch's carry
    C++ function records) or that comes from a shape computed from tensor values, which fake tensors do not have
    (a model's own MoE dispatch: nonzero / where over the routing), is raised as a one-line PlanError instead.
    `env`: the caller's environment, which this worker takes (its forkserver may have started under another)."""
    import os
    import pickle

    if env is not None:
        os.environ.clear()
        os.environ.update(env)

    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    try:
        return dry_run_role(plan, opts, pp_rank)
    except DynamicOutputShapeException as e:
        raise PlanError(
            f"the dry run cannot run pipeline rank {pp_rank}: the model computes a tensor's shape from tensor "
            f"values ({e.func}; a mixture-of-experts' own dispatch over its routing, as at ep 1), which the fake "
            f"tensors of a dry run do not have"
        ) from None
    except Exception as e:
        try:
            pickle.dumps(e)
        except Exception:
            raise PlanError(f"the dry run of pipeline rank {pp_rank} failed: {type(e).__name__}: {e}") from None
        raise


def dry_run_options(plan: Plan) -> Any:
    """The run options of a dry run: one step on CPU, computing in the dtype the plan priced (bf16 emulates the
    CUDA program), FSDP2's replicate() where mlm-run would use DDP (whose constructor and reducer need real
    tensors; same bytes, one all-reduce per layer group instead of per 25 MB bucket)."""
    from mlm.runtime.train import RunOptions

    dtype = "fp32" if plan.training.dtype == "fp32" else "bf16"
    return RunOptions(steps=1, device="cpu", compute_dtype=dtype, allow_ddp=False)


def dry_run_role(
    plan: Plan,
    opts: Any,
    pp_rank: int,
    spec: ModelSpec | None = None,
    fake: bool = True,
    every_microbatch: bool = False,
) -> RoleReport:
    """One role's dry run in this process (which must have no default process group); fake=False runs the same
    step on real tensors; every_microbatch runs the whole schedule instead of its steady-state prefix."""
    spec = spec or load_checked_spec(plan)
    bounds = boundary_specs(spec, plan, _compute_dtype(plan, opts))
    return _dry_run_role(plan, opts, spec, bounds, pp_rank, fake, every_microbatch)


@contextlib.contextmanager
def _metadata_on_real_tensors() -> Iterator[None]:
    """Run torch's mesh and shard-layout bookkeeping outside the FakeTensorMode.

    DeviceMesh (also the meshes FSDP2 builds for TP x DP parameters) computes rank coordinates, and _StridedShard
    (a fused-QKV split of a tensor-parallel tensor) its local offsets, with small tensor ops that read values back;
    under fake tensors those values do not exist. They are metadata, not model tensors, so they are computed on
    real tensors. No torch API exposes this, hence the wrapping of the two functions for the dry run's duration."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import _StridedShard

    targets = [(DeviceMesh, "__init__"), (_StridedShard, "local_shard_size_and_offset")]
    saved = [(owner, name, owner.__dict__[name]) for owner, name in targets if name in owner.__dict__]
    chunker = _lazy_fsdp_chunks()
    for owner, name, original in saved:
        fn = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original

        def real(*args: Any, __fn: Any = fn, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return __fn(*args, **kwargs)

        wrapped: Any = real
        if isinstance(original, staticmethod):
            wrapped = staticmethod(real)
        elif isinstance(original, classmethod):
            wrapped = classmethod(real)
        setattr(owner, name, wrapped)
    try:
        with chunker:
            yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


class _LazyChunks(Sequence):
    """torch.chunk(tensor, n, dim) padded with empty tensors to n, as FSDP2's _chunk_with_empty returns, but each
    chunk made (as the same view, by narrow) only when read. FSDP2 reads one chunk of each parameter, its rank's;
    materialising all dp-degree chunks as fake tensors costs ~0.15 s per parameter at dp = 512."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        size = tensor.size(dim)
        self.step = -(-size // num_chunks) if size else 0
        self.nonempty = -(-size // self.step) if self.step else 0

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.num_chunks))]
        i = i + self.num_chunks if i < 0 else i
        if not 0 <= i < self.num_chunks:
            raise IndexError(i)
        if i >= self.nonempty:
            return self.tensor.new_empty(0)
        start = i * self.step
        return self.tensor.narrow(self.dim, start, min(self.step, self.tensor.size(self.dim) - start))


@contextlib.contextmanager
def _lazy_fsdp_chunks() -> Iterator[None]:
    """FSDP2's parameter chunking made lazy for the dry run (see _LazyChunks); torch has no option for it."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:  # another torch layout: run as is, only slower
        yield
        return
    original = getattr(_fsdp_param, "_chunk_with_empty", None)
    if original is None:
        yield
        return
    _fsdp_param._chunk_with_empty = _LazyChunks  # type: ignore[assignment]
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original


class GpuAttentionKernels(TorchFunctionMode):
    """F.scaled_dot_product_attention with a mask or dropout through aten's memory-efficient kernel (module doc):
    what CUDA selects for such a call, where the CPU can only run the math kernel. Calls that CUDA would not run
    so stay as they are: no mask and no dropout (the CPU's flash kernel already saves what a GPU's does), DTensor
    arguments (attention outside a tensor-parallel region), grouped-query heads with enable_gqa, which CUDA's
    memory-efficient kernel does not take."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            out = _memory_efficient_attention(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _memory_efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    """The memory-efficient kernel's output for one SDPA call, or None where the call is left as it is."""
    if attn_mask is None and not dropout_p:
        return None
    if any(isinstance(t, DTensor) for t in (query, key, value, attn_mask)) or query.dim() != 4:
        return None
    if key.shape[-3] != query.shape[-3] or value.shape[-3] != query.shape[-3]:
        return None  # grouped-query heads (enable_gqa): not this kernel's
    bias = None
    try:
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=attn_mask.device)
                bias = bias.masked_fill(~attn_mask, float("-inf"))
            else:
                bias = attn_mask.to(query.dtype)
            bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, True, float(dropout_p), bool(is_causal), scale=scale
        )
    except (RuntimeError, ValueError, NotImplementedError):  # the kernel's checks refuse it: SDPA's own choice
        return None
    return out[0]


@contextlib.contextmanager
def _fake_world(rank: int, world: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the dry run needs a process without a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _dry_run_role(
    plan: Plan,
    opts: Any,
    spec: ModelSpec,
    bounds: dict[int, list[TensorSpec]],
    pp_rank: int,
    fake: bool = True,
    every_microbatch: bool = False,
) -> RoleReport:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mlm.runtime.train import setup

    lay = plan.layout
    rank = (pp_rank * lay.dp * lay.cp) * lay.tp  # dp_rank 0, cp_rank 0, tp_rank 0 of this pipeline rank
    start = time.perf_counter()
    executed = lay.num_microbatches if every_microbatch else executed_microbatches(lay)
    planned_plan = plan
    if executed < lay.num_microbatches:
        import dataclasses

        plan = dataclasses.replace(
            plan,
            layout=dataclasses.replace(lay, num_microbatches=executed),
            training=dataclasses.replace(plan.training, global_batch=lay.micro_batch * executed * lay.dp),
        )
    with _fake_world(rank, lay.world_size), _metadata_on_real_tensors(), unpacked_positions():
        info = build_mesh(lay, "cpu")
        # fake=False: the same step on real tensors (collectives still return at once): how the tests check that the
        # fake execution allocates what a real one does
        mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
        rt = setup(plan, opts, spec, mesh=info, tensor_mode=mode)
        notes: list[str] = []
        with mode:
            _steady_optimizer_state(rt.optimizer)
            tracker = StorageTracker()
            _track_state(tracker, rt)
            counter = CollectiveCounter()
            kernels = GpuAttentionKernels() if fake else contextlib.nullcontext()
            with tracker, counter, _fsdp_gathers_are_parameters(tracker), _sharding_metadata_untracked(tracker):
                with kernels:
                    _one_step(rt, info, bounds, counter, tracker)
    counter.extrapolate(executed, lay.num_microbatches)
    if executed < lay.num_microbatches:
        notes.append(
            f"executed {executed} of {lay.num_microbatches} micro-batches (the schedule's steady state: same peak); "
            f"collectives of the others counted as one typical micro-batch's"
        )
    plan = planned_plan
    by_category = dict(tracker.peak_by)
    peak = tracker.peak
    buffers = pipeline_buffer_bytes(plan, bounds, pp_rank)
    if buffers:
        # the step allocated receive buffers for the micro-batches in flight; torch's PipelineStage keeps one per
        # micro-batch for the whole step: those replace them
        peak += buffers - by_category.get("pipeline_buffers", 0.0)
        by_category["pipeline_buffers"] = buffers
        notes.append("pipeline receive buffers: one per micro-batch and stage, as torch's PipelineStage allocates")
    collectives = dict(counter.totals)
    for name, totals in pipeline_p2p(plan, bounds, pp_rank).items():
        collectives[name] = totals
    return RoleReport(
        rank=rank,
        pp_rank=pp_rank,
        stages=[s.index for s in rt.stages],
        peak_memory_bytes=peak,
        memory_by_category=by_category,
        collectives=collectives,
        seconds=time.perf_counter() - start,
        notes=notes,
    )


def _track_state(tracker: StorageTracker, rt: Any) -> None:
    """Count what exists before the step: this rank's parameters, buffers and optimizer state; gradients are
    reclassified as they accumulate (a hook per parameter; FSDP2's in its post-backward)."""
    for stage in rt.stages:
        for p in stage.parameters():
            tracker.track(p, "parameters")
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda q: tracker.reclassify(q.grad, "gradients"))
        for b in stage.buffers():
            tracker.track(b, "buffers")
    for state in rt.optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                tracker.track(value, "optimizer")


def _reclassify_gradients(tracker: StorageTracker, rt: Any) -> None:
    """After a backward: parameters' gradients (and FSDP2's unsharded accumulated ones) count as gradients."""
    for stage in rt.stages:
        for module in stage.modules():
            for p in module.parameters(recurse=False):
                tracker.reclassify(p.grad, "gradients")
            state_of = getattr(module, "_get_fsdp_state", None)
            state = state_of() if callable(state_of) else None
            for group in getattr(state, "_fsdp_param_groups", None) or ():
                for fp in group.fsdp_params:
                    for name in ("unsharded_accumulated_grad", "_unsharded_param"):
                        value = getattr(fp, name, None)
                        tracker.reclassify(
                            getattr(value, "grad", None) if name == "_unsharded_param" else value, "gradients"
                        )
                    tracker.reclassify(getattr(fp.sharded_param, "grad", None), "gradients")


@contextlib.contextmanager
def _sharding_metadata_untracked(tracker: StorageTracker) -> Iterator[None]:
    """DTensor's sharding propagation runs each op once more on global-shape tensors of a fake mode to learn the
    output's shape: its own FakeTensorMode in a real run (no memory), but the dry run's when one is active, where
    the tracker would count them (the whole fc1 weight of a 1T model, 10 GB, at the peak). Not counted; no torch
    API turns this off, hence the wrapping of the one method for the dry run's duration."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    name = "_propagate_tensor_meta_non_cached"
    original = ShardingPropagator.__dict__.get(name)
    if original is None:  # another torch: nothing to wrap
        yield
        return

    def untracked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with tracker.paused():
            return original(self, *args, **kwargs)

    setattr(ShardingPropagator, name, untracked)
    try:
        yield
    finally:
        setattr(ShardingPropagator, name, original)


@contextlib.contextmanager
def _fsdp_gathers_are_parameters(tracker: StorageTracker) -> Iterator[None]:
    """Storages FSDP2 allocates to gather parameters (unshard) count as parameters, as they would on a GPU."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        yield
        return
    originals = {name: FSDPParamGroup.__dict__[name] for name in ("unshard", "wait_for_unshard", "post_backward")}

    def gather(fn: Any) -> Any:
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            with tracker.category("parameters"):
                return fn(self, *args, **kwargs)

        return inner

    def reduce(fn: Any) -> Any:
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = fn(self, *args, **kwargs)
            for fp in self.fsdp_params:  # the gradients this group now holds (accumulated or reduced)
                tracker.reclassify(getattr(fp, "unsharded_accumulated_grad", None), "gradients")
                tracker.reclassify(getattr(fp.sharded_param, "grad", None), "gradients")
            return out

        return inner

    for name, fn in originals.items():
        setattr(FSDPParamGroup, name, reduce(fn) if name == "post_backward" else gather(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(FSDPParamGroup, name, fn)


def _steady_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The state tensors the optimizer holds from its second step on (Adam/AdamW: step, exp_avg, exp_avg_sq), so
    the measured step is a steady-state one; created directly (a zero-lr step on fake tensors costs seconds)."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }


def _one_step(
    rt: Any, info: MeshInfo, bounds: dict[int, list[TensorSpec]], counter: CollectiveCounter, tracker: StorageTracker
) -> None:
    """The training step as run_steps (train.py) runs it, without reading any value back."""
    lay = rt.plan.layout
    inputs, targets = rt.source.batch(0, info.data_rank, lay.dp, rt.device)
    rt.optimizer.zero_grad(set_to_none=True)
    with rt.tp_contexts():
        if rt.schedule is None:
            from mlm.runtime.train import _forward_backward

            _forward_backward(rt, inputs, targets)
        else:
            _pipeline_step(rt, info, bounds, inputs, targets, counter, tracker)
    _reclassify_gradients(tracker, rt)
    sync_tied_grads(rt.tied)
    exclude = {id(c.param) for c in rt.tied if not c.primary}
    grad_norm(rt.params, info.pp_group if lay.pp > 1 else None, exclude)
    with tracker.category("temporaries"):  # the states exist already: what the step allocates is transient
        rt.optimizer.step()


def _first_layer(plan: Plan, stage: int) -> str:
    return next(x for x in plan.stages[stage].layers if x != "loss")


def _compute_dtype(plan: Plan, opts: Any) -> torch.dtype:
    from mlm.runtime.train import compute_dtype

    return compute_dtype(plan, opts, torch.device("cpu"))


def boundary_specs(spec: ModelSpec, plan: Plan, dtype: torch.dtype) -> dict[int, list[TensorSpec]]:
    """Stage index -> the activations it receives for one micro-batch, in `dtype` (the compute dtype: the meta model
    runs in fp32, a bf16 stage sends bf16): the floating tensors with gradients among its first layer's call
    arguments, then the activations carried past the boundary (stages.carry_plan), as model_build.record_layer_calls
    records them in one training step on fake tensors."""
    from mlm.runtime.model_build import record_layer_calls
    from mlm.runtime.stages import carry_plan

    found: dict[int, list[TensorSpec]] = {}
    if len(plan.stages) == 1:
        return found
    calls = record_layer_calls(spec, plan, plan.layout.micro_batch)
    for s, carried in enumerate(carry_plan(plan, calls)):
        if s == 0:
            continue
        first = calls[_first_layer(plan, s)]
        found[s] = [TensorSpec(first.leaf_shapes[i], dtype) for i in first.grad_leaves]  # type: ignore[arg-type]
        for layer, i in carried:
            leaf = pytree.tree_leaves(calls[layer].output, is_leaf=lambda x: isinstance(x, TensorSpec))[i]
            found[s].append(TensorSpec(tuple(leaf.shape), dtype))
    lay = plan.layout
    seq = plan.training.seq_len
    if lay.cp > 1:  # a cp rank sends (and receives) its part of the sequence (runtime/context_parallel.py)
        from mlm.runtime.context_parallel import ContextParallel

        cp = ContextParallel(rank=0, size=lay.cp, group=None, seq_len=seq)
        found = {s: [TensorSpec(cp.local_shape(t.shape), t.dtype) for t in specs] for s, specs in found.items()}
        seq //= lay.cp
    if lay.sequence_parallel and lay.tp > 1:  # a tp rank sends (and receives) its sequence shard
        found = {s: [_sequence_shard(t, seq, lay.tp) for t in specs] for s, specs in found.items()}
    return found


def _sequence_shard(spec: TensorSpec, seq_len: int, tp: int) -> TensorSpec:
    """`spec` as one tp rank holds it under sequence parallelism: SEQ_DIM split (activations are batch, seq, …)."""
    from mlm.runtime.tensor_parallel import SEQ_DIM

    shape = list(spec.shape)
    if len(shape) > SEQ_DIM and shape[SEQ_DIM] == seq_len:
        shape[SEQ_DIM] //= tp
    return TensorSpec(tuple(shape), spec.dtype)


def pipeline_buffer_bytes(plan: Plan, bounds: dict[int, list[TensorSpec]], pp_rank: int) -> float:
    """Bytes of the receive buffers torch's PipelineStage keeps for this rank: for each of its stages and each
    micro-batch, one buffer per received activation (stages > 0) and one per gradient of its output (all but the
    last stage)."""
    lay = plan.layout
    total = 0.0
    for s in range(len(plan.stages)):
        if s % lay.pp != pp_rank:
            continue
        if s > 0:
            total += _boundary_bytes(bounds, s) * lay.num_microbatches
        if s < len(plan.stages) - 1:
            total += _boundary_bytes(bounds, s + 1) * lay.num_microbatches
    return total


def _boundary_bytes(bounds: dict[int, list[TensorSpec]], stage: int) -> float:
    """Bytes of the activations sent into stage `stage` for one micro-batch."""
    return float(sum(math.prod(s.shape) * s.dtype.itemsize for s in bounds.get(stage, [])))


def pipeline_p2p(plan: Plan, bounds: dict[int, list[TensorSpec]], pp_rank: int) -> dict[str, CollectiveTotals]:
    """Point-to-point messages this rank sends in one step (activations forward, gradients backward)."""
    lay = plan.layout
    send = CollectiveTotals()
    for s in range(len(plan.stages)):
        if s % lay.pp != pp_rank:
            continue
        if s < len(plan.stages) - 1:  # activations to the next stage
            send.count += lay.num_microbatches
            send.bytes += _boundary_bytes(bounds, s + 1) * lay.num_microbatches
        if s > 0:  # gradients to the previous stage
            send.count += lay.num_microbatches
            send.bytes += _boundary_bytes(bounds, s) * lay.num_microbatches
    return {"send": send} if send.count else {}


def _pipeline_step(
    rt: Any,
    info: MeshInfo,
    bounds: dict[int, list[TensorSpec]],
    inputs: Any,
    targets: Any,
    counter: CollectiveCounter,
    tracker: StorageTracker,
) -> None:
    """This rank's actions of the schedule's pipeline_order (see module doc)."""
    from torch.distributed.pipelining._backward import stage_backward

    plan, lay = rt.plan, rt.plan.layout
    n = lay.num_microbatches
    actions = rank_actions(rt.schedule, info.pp_rank, n)
    pstages = {st.stage_index: st for st in _schedule_stages(rt.schedule)}
    runners = {st.index: runner for st, runner in zip(rt.stages, rt.runners)}
    in_chunks = split_rows(inputs, n)  # a tensor, or a model's example_inputs (a dict / tuple of tensors)
    tgt_chunks = split_rows(targets, n)
    saved: dict[tuple[int, int], tuple[Any, tuple[torch.Tensor, ...]]] = {}
    done_backward: dict[int, int] = {}
    for kind, s, mb in actions:
        if kind == "F":
            with tracker.category("pipeline_buffers"):  # PipelineStage's receive buffer for this micro-batch
                received = (
                    tuple(
                        torch.zeros(spec.shape, dtype=spec.dtype, device=rt.device, requires_grad=True)
                        for spec in bounds.get(s, [])
                    )
                    if s > 0
                    else ()
                )
            counter.micro_batch = mb
            out = runners[s](*received, inputs=in_chunks[mb], targets=tgt_chunks[mb])
            counter.micro_batch = None
            saved[(s, mb)] = (out, received)
        elif kind == "B":
            out, received = saved.pop((s, mb))
            runner = runners[s]
            last = done_backward.get(s, 0) == n - 1
            done_backward[s] = done_backward.get(s, 0) + 1
            if s == len(plan.stages) - 1:
                outputs, grads = out.reshape(()), None
            else:
                outputs = out
                with tracker.category("pipeline_buffers"):  # the received gradient of this output
                    grads = tuple(torch.zeros_like(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            counter.micro_batch = mb
            with _backward_sync(runner, last):
                stage_backward(outputs, grads, list(received))
            counter.micro_batch = None
            _reclassify_gradients(tracker, rt)
        elif kind == "REDUCE_GRAD":
            pstages[s].perform_reduce_grad(n if rt.schedule.scale_grads else 1)
        else:
            raise RuntimeError(f"the dry run does not execute pipeline action {kind} (stage {s}, micro-batch {mb})")


def rank_actions(schedule: Any, pp_rank: int, n: int) -> list[tuple[str, int, int | None]]:
    """(kind, stage, micro-batch) in the order torch runs them on this rank: F forward, B full backward,
    REDUCE_GRAD. Multi-stage schedules run their pipeline_order; the single-stage ones do not (their
    _step_microbatches has its own loop, and Schedule1F1B's pipeline_order omits the last rank's first forward), so
    their loops are followed here: GPipe all forwards then all backwards; 1F1B min(n, stages − stage) warm-up
    forwards, then backward / forward pairs, then the remaining backwards; then one REDUCE_GRAD."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    stage = getattr(schedule, "_stage", None)
    if isinstance(schedule, (Schedule1F1B, ScheduleGPipe)) and stage is not None:
        s, stages = stage.stage_index, schedule._num_stages
        if isinstance(schedule, ScheduleGPipe):
            order = [("F", s, i) for i in range(n)] + [("B", s, i) for i in range(n)]
        else:
            warmup = min(n, stages - s)
            order = [("F", s, i) for i in range(warmup)]
            fwd, bwd = warmup, 0
            while True:
                order.append(("B", s, bwd))
                bwd += 1
                if fwd == n:
                    break
                order.append(("F", s, fwd))
                fwd += 1
            order += [("B", s, i) for i in range(bwd, n)]
        return [*order, ("REDUCE_GRAD", s, None)]
    table = getattr(schedule, "pipeline_order", None)
    if table is None:
        raise RuntimeError(f"the {type(schedule).__name__} schedule has no pipeline_order to dry-run")
    out = [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in table[pp_rank] if a is not None]
    if not any(kind == "REDUCE_GRAD" for kind, _, _ in out):  # older torch: reduce after the last backward
        out += [("REDUCE_GRAD", st.stage_index, None) for st in _schedule_stages(schedule)]
    return out


@contextlib.contextmanager
def _backward_sync(runner: Any, last: bool) -> Iterator[None]:
    """What PipelineStage.backward_maybe_with_nosync does around one micro-batch's backward."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(runner, DistributedDataParallel) and not last:
        with runner.no_sync():
            yield
        return
    if isinstance(runner, FSDPModule):
        runner.set_is_last_backward(False)
        runner.set_reshard_after_backward(False)
        runner.set_requires_gradient_sync(False)
    yield


def _schedule_stages(schedule: Any) -> list[Any]:
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]
