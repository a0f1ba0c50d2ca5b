"""Measure this machine for mlm-profile: GEMM rate by size, memory bandwidth, attention, and collectives.

The result becomes a GPUProfile and a ClusterProfile (mlm.planner.cost.hardware) in exactly the presets' key set:
peak = the best measured rate, each curve = measured rate / peak. On CPU the "GPU" is one process of a gloo job:
rates are fp32, memory is this machine's RAM divided among `world_size` ranks, links are loopback gloo.
Collectives run in `world_size` local processes (fork + gloo on CPU, spawn + NCCL on CUDA) that are joined here.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from mlm.planner.cost.hardware import AttentionCurve, ClusterProfile, GemmCurve, GPUProfile, to_toml
from mlm.planner.errors import PlanError

Log = Callable[[str], None]
GIB = float(1 << 30)
_PG_TIMEOUT = datetime.timedelta(seconds=30)
_JOIN_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Settings:
    """Workload sizes for one run (benchmark choices, not hardware figures)."""

    matmul_sizes: tuple[int, ...]
    seq_lens: tuple[int, ...]
    attention_tokens: int  # batch * seq_len per attention call
    heads: int
    head_dim: int
    copy_bytes: int
    comm_bytes: int
    comm_iters: int
    min_time_s: float


def settings_for(device: str, quick: bool) -> Settings:
    """Sizes that finish in seconds (quick) or ~20 s on a 2-core CPU, and large enough to fill a big GPU."""
    if device == "cuda":
        if quick:
            return Settings(
                (256, 512, 1024, 2048, 4096, 8192), (512, 2048, 8192), 16384, 16, 128, 256 << 20, 64 << 20, 10, 0.1
            )
        return Settings(
            (128, 256, 512, 1024, 2048, 4096, 8192, 16384),
            (512, 1024, 2048, 4096, 8192, 16384),
            32768,
            16,
            128,
            1 << 30,
            256 << 20,
            20,
            0.3,
        )
    if quick:
        return Settings((64, 128, 256, 512, 1024), (128, 256, 512), 2048, 4, 64, 256 << 20, 8 << 20, 4, 0.1)
    return Settings(
        (64, 128, 256, 512, 1024, 2048), (128, 256, 512, 1024, 2048), 4096, 8, 64, 256 << 20, 64 << 20, 8, 0.4
    )


@dataclass(frozen=True)
class Collectives:
    """Collective rates among `world_size` local ranks. Bus bandwidths follow the nccl-tests convention."""

    backend: str
    world_size: int
    send_recv_gbps: float  # one direction, from a ping-pong between ranks 0 and 1
    all_reduce_gbps: float  # bus bandwidth: size/time * 2(p-1)/p
    all_gather_gbps: float  # bus bandwidth: output size/time * (p-1)/p
    latency_us: float  # time of a one-element all_reduce
    # of an async all_reduce, the fraction hidden under a GEMM loop of about its length run meanwhile (each rank)
    overlap: float = 1.0
    reduce_scatter_gbps: float = 0.0  # bus bandwidth: input size/time * (p-1)/p (0: not measured)


@dataclass(frozen=True)
class Measurement:
    """Everything one mlm-profile run measured."""

    device: str
    device_name: str
    dtype: str  # the dtype of the GEMM curve and attention
    matmul_tflops: tuple[tuple[int, float], ...]  # (size, TFLOP/s) for n x n x n GEMMs
    fp16_tflops: float
    fp32_tflops: float
    tf32_tflops: float
    copy_gbps: float  # bytes read + written per second by a large tensor copy
    elementwise_gbps: float  # the same for c = a + b
    attention_tflops: tuple[tuple[int, float], ...]  # (seq_len, TFLOP/s), causal fwd+bwd, 7*b*h*s^2*d FLOPs
    collectives: Collectives
    memory_gib: float  # per rank
    reserve_gib: float  # per rank, in use before our work (other processes, CUDA context, the Python runtime)


# ---- timing ------------------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn: Callable[[], Any], device: torch.device, min_time_s: float) -> float:
    """Best seconds per call of fn over at least 3 timed rounds and about min_time_s in all (after a warm-up)."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    one = max(time.perf_counter() - t0, 1e-7)
    reps = max(1, min(1000, int(min_time_s / 5 / one)))
    best, spent, rounds = math.inf, 0.0, 0
    while rounds < 3 or (spent < min_time_s and rounds < 100):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        dt = time.perf_counter() - t0
        best, spent, rounds = min(best, dt / reps), spent + dt, rounds + 1
    return best


@contextlib.contextmanager
def _matmul_precision(precision: str) -> Iterator[None]:
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


# ---- single-device benchmarks ------------------------------------------------------------------------------------


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, min_time_s: float) -> float:
    """TFLOP/s of an n x n x n GEMM (2 n^3 FLOPs)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    t = _best_time(lambda: torch.mm(a, b, out=out), device, min_time_s)
    return 2.0 * n**3 / t / 1e12


def memory_gbps(device: torch.device, nbytes: int, min_time_s: float) -> tuple[float, float]:
    """(copy, elementwise add) bandwidth in GB/s, counting every byte read and written."""
    n = nbytes // 4
    a = torch.ones(n, device=device)
    b = torch.ones(n, device=device)
    c = torch.empty(n, device=device)
    t_copy = _best_time(lambda: c.copy_(a), device, min_time_s)
    t_add = _best_time(lambda: torch.add(a, b, out=c), device, min_time_s)
    return 2 * 4 * n / t_copy / 1e9, 3 * 4 * n / t_add / 1e9


def attention_tflops(device: torch.device, dtype: torch.dtype, s: int, cfg: Settings) -> float:
    """TFLOP/s of causal scaled_dot_product_attention forward + backward, counted as 7*b*h*s^2*d FLOPs."""
    b = max(1, cfg.attention_tokens // s)
    shape = (b, cfg.heads, s, cfg.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=device, dtype=dtype)

    def step() -> None:
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    t = _best_time(step, device, cfg.min_time_s)
    return 7.0 * b * cfg.heads * s * s * cfg.head_dim / t / 1e12


# ---- collectives -------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timed(op: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Best seconds per op over 3 rounds of `iters` calls; every rank runs the same counts, so none waits forever."""
    op()
    _sync(device)
    best = math.inf
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            op()
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def _collective_worker(rank: int, world: int, port: int, backend: str, nbytes: int, iters: int, queue: Any) -> None:
    """One rank of the collective test; rank 0 puts the result dict on `queue`."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=_PG_TIMEOUT
    )
    try:
        n = nbytes // 4 // world * world
        x = torch.ones(n, device=device)
        shard, gathered = torch.ones(n // world, device=device), torch.empty(n, device=device)
        tiny = torch.ones(1, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def ping_pong() -> None:
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
                dist.send(x, 0)

        t_pp = _timed(ping_pong, device, iters)
        t_ar = _timed(lambda: dist.all_reduce(x), device, iters)
        t_ag = _timed(lambda: gather(gathered, shard), device, iters)
        t_rs = _timed(lambda: scatter(shard, x), device, iters)
        t_lat = _timed(lambda: dist.all_reduce(tiny), device, 4 * iters)
        overlap = _overlap(x, t_ar, device, iters)
        if rank == 0:
            size = 4.0 * n
            queue.put(
                {
                    "send_recv_gbps": 2 * size / t_pp / 1e9,
                    "all_reduce_gbps": size / t_ar * 2 * (world - 1) / world / 1e9,
                    "all_gather_gbps": size / t_ag * (world - 1) / world / 1e9,
                    "reduce_scatter_gbps": size / t_rs * (world - 1) / world / 1e9,
                    "latency_us": t_lat * 1e6,
                    "overlap": overlap,
                }
            )
    finally:
        dist.destroy_process_group()


def _overlap(x: torch.Tensor, t_all_reduce: float, device: torch.device, iters: int) -> float:
    """How much of an all_reduce of `x` (t_all_reduce seconds alone) hides under compute: the all_reduce launched
    async beside a loop of GEMMs about as long, (t_alone + t_gemms − t_both) / min(t_alone, t_gemms), in [0, 1].
    1: the collective runs on resources of its own (NCCL's stream); 0: it takes its time from the compute (gloo's
    threads on the cores the compute uses)."""
    a = torch.ones(256, 256, device=device)
    t_mm = _timed(lambda: a @ a, device, 4 * iters)
    k = max(1, round(t_all_reduce / max(t_mm, 1e-9)))

    def gemms() -> None:
        for _ in range(k):
            a @ a

    def both() -> None:
        work = dist.all_reduce(x, async_op=True)
        gemms()
        assert work is not None
        work.wait()

    shares = []
    for _ in range(5):  # the median of five: on a shared CPU one measurement varies by tens of percent
        t_c, t_both = _timed(gemms, device, iters), _timed(both, device, iters)
        shares.append(min(1.0, max(0.0, (t_all_reduce + t_c - t_both) / min(t_all_reduce, t_c))))
    return sorted(shares)[2]


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure_collectives(device: str, world: int, nbytes: int, iters: int) -> Collectives:
    """All-reduce, all-gather, send/recv bandwidth and latency among `world` local processes."""
    backend, method = ("nccl", "spawn") if device == "cuda" else ("gloo", "fork")
    ctx = mp.get_context(method)
    queue = ctx.SimpleQueue()
    port = _free_port()
    with _env(OMP_NUM_THREADS="1"):
        procs = [
            ctx.Process(target=_collective_worker, args=(r, world, port, backend, nbytes, iters, queue))
            for r in range(world)
        ]
        for p in procs:
            p.start()
    deadline = time.monotonic() + _JOIN_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stuck = [p for p in procs if p.is_alive()]
    for p in stuck:
        p.kill()
        p.join()
    failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if failed or queue.empty():
        raise PlanError(
            f"the {backend} collective test among {world} local processes failed "
            f"(rank, exit code: {failed}); see the workers' messages above, or try a smaller --world-size"
        )
    r = queue.get()
    return Collectives(
        backend,
        world,
        r["send_recv_gbps"],
        r["all_reduce_gbps"],
        r["all_gather_gbps"],
        r["latency_us"],
        r["overlap"],
        r["reduce_scatter_gbps"],
    )


def measure_host_link(nbytes: int, min_time_s: float) -> Collectives:
    """Stand-in for one CUDA GPU with no peer: pinned host-to-device copies (the only link it has)."""
    device = torch.device("cuda")
    host = torch.ones(nbytes // 4, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    gbps = 4.0 * host.numel() / _best_time(lambda: dev.copy_(host, non_blocking=True), device, min_time_s) / 1e9
    tiny_h, tiny_d = torch.ones(1, pin_memory=True), torch.empty(1, device=device)
    lat_us = _best_time(lambda: tiny_d.copy_(tiny_h, non_blocking=True), device, min_time_s) * 1e6
    return Collectives("host-copy", 1, gbps, gbps, gbps, lat_us)


# ---- the whole run -----------------------------------------------------------------------------------------------


def _cpu_memory_gib() -> tuple[float, float]:
    """(total, in use by others) RAM in GiB, from sysconf and /proc/meminfo."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = total
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/statm", encoding="ascii") as f:  # our own runtime counts as reserved too
            available -= int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total / GIB, max(0.0, total - available) / GIB


def default_world_size(device: str) -> int:
    """2 processes on CPU; every visible GPU (up to 8) on CUDA."""
    return min(8, torch.cuda.device_count()) if device == "cuda" else 2


def _rate(tflops: float) -> str:
    return f"{tflops:.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.1f} GFLOP/s"


def check_request(device: str, world_size: int) -> None:
    """Raise PlanError for a device or world size this machine cannot measure."""
    if device == "cuda" and not torch.cuda.is_available():
        raise PlanError("--device cuda: no CUDA device is available here; use --device cpu")
    if world_size < 1 or (device == "cpu" and world_size < 2):
        raise PlanError(f"--world-size {world_size}: the collective test needs at least 2 processes on CPU")
    if device == "cuda" and world_size > torch.cuda.device_count():
        raise PlanError(f"--world-size {world_size}: only {torch.cuda.device_count()} CUDA devices are visible")


def measure(device: str, quick: bool, world_size: int, log: Log) -> Measurement:
    """Run every benchmark (collectives first, before this process's thread pools are warm) and return the figures."""
    check_request(device, world_size)
    cfg = settings_for(device, quick)
    dev = torch.device(device)
    if device == "cpu":
        total_gib, used_gib = _cpu_memory_gib()
        memory_gib, reserve_gib = total_gib / world_size, used_gib / world_size
        name = f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    else:
        free, total = torch.cuda.mem_get_info(dev)
        memory_gib, reserve_gib, name = total / GIB, (total - free) / GIB, torch.cuda.get_device_name(dev)

    if world_size >= 2:
        log(f"collectives: {world_size} processes, {cfg.comm_bytes >> 20} MiB messages")
        coll = measure_collectives(device, world_size, cfg.comm_bytes, cfg.comm_iters)
    else:
        log("collectives: one GPU, no peer; timing host-to-device copies as its link")
        coll = measure_host_link(cfg.comm_bytes, cfg.min_time_s)
    log(
        f"  all-reduce {coll.all_reduce_gbps:.2f} GB/s bus, all-gather {coll.all_gather_gbps:.2f} GB/s bus, "
        f"reduce-scatter {coll.reduce_scatter_gbps:.2f} GB/s bus"
    )
    log(f"  send/recv {coll.send_recv_gbps:.2f} GB/s, latency {coll.latency_us:.0f} us")

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    curve = []
    for n in cfg.matmul_sizes:
        curve.append((n, matmul_tflops(dev, dtype, n, cfg.min_time_s)))
        log(f"matmul {n}^3 {str(dtype).removeprefix('torch.')}: {_rate(curve[-1][1])}")
    peak_n = max(curve, key=lambda p: p[1])[0]
    if device == "cuda":
        fp16 = matmul_tflops(dev, torch.float16, peak_n, cfg.min_time_s)
        with _matmul_precision("highest"):
            fp32 = matmul_tflops(dev, torch.float32, peak_n, cfg.min_time_s)
        with _matmul_precision("high"):
            tf32 = matmul_tflops(dev, torch.float32, peak_n, cfg.min_time_s)
        log(f"matmul {peak_n}^3: fp16 {fp16:.1f}, fp32 {fp32:.1f}, tf32 {tf32:.1f} TFLOP/s")
    else:
        fp16 = fp32 = tf32 = max(r for _, r in curve)

    copy, add = memory_gbps(dev, cfg.copy_bytes, cfg.min_time_s)
    log(f"memory: copy {copy:.1f} GB/s, add {add:.1f} GB/s ({cfg.copy_bytes >> 20} MiB tensors)")
    attn = []
    for s in cfg.seq_lens:
        attn.append((s, attention_tflops(dev, dtype, s, cfg)))
        log(f"attention s={s}: {_rate(attn[-1][1])} (causal, fwd+bwd)")
    if device == "cuda":
        outside_torch = total - torch.cuda.mem_get_info(dev)[0] - torch.cuda.memory_reserved(dev)
        reserve_gib = max(reserve_gib, outside_torch / GIB)
    return Measurement(
        device,
        name,
        str(dtype).removeprefix("torch."),
        tuple(curve),
        fp16,
        fp32,
        tf32,
        copy,
        add,
        tuple(attn),
        coll,
        memory_gib,
        reserve_gib,
    )


# ---- profiles from a measurement ---------------------------------------------------------------------------------


def default_name(device: str) -> str:
    """cpu-<hostname> on CPU, the CUDA device name (slugged) on GPUs."""
    raw = f"cpu-{socket.gethostname()}" if device == "cpu" else torch.cuda.get_device_name()
    return re.sub(r"[^a-z0-9]+", "-", raw.lower()).strip("-") or device


def _sig(x: float, digits: int = 4) -> float:
    """x rounded to `digits` significant digits (for readable TOML); never rounds a positive x to 0."""
    return float(f"{x:.{digits}g}")


def build_profiles(m: Measurement, name: str, cluster_ref: str, gpu_ref: str) -> tuple[GPUProfile, ClusterProfile]:
    """Measured figures in the presets' key set: peak = best rate, curves = rate / peak (clamped to 1)."""
    raw_peak = max(r for _, r in m.matmul_tflops)
    peak = _sig(raw_peak)
    c = m.collectives
    link_eff = _sig(min(1.0, min(c.all_reduce_gbps, c.all_gather_gbps) / c.send_recv_gbps))
    bus = min(1.0, min(c.all_reduce_gbps, c.all_gather_gbps) / c.send_recv_gbps) * c.send_recv_gbps
    rs_eff = _sig(min(1.0, c.reduce_scatter_gbps / bus)) if c.reduce_scatter_gbps > 0 else 1.0
    link, latency = _sig(c.send_recv_gbps), _sig(c.latency_us)
    gpu = GPUProfile(
        name=name,
        bf16_tflops=peak,
        fp16_tflops=_sig(m.fp16_tflops),
        fp32_tflops=_sig(m.fp32_tflops),
        tf32_tflops=_sig(m.tf32_tflops),
        hbm_gib=_sig(m.memory_gib),
        hbm_gbps=_sig(m.copy_gbps),
        nvlink_gbps=link,
        usd_per_gpu_hour=0.0,
        default_cluster=cluster_ref,
        memory_bound_efficiency=_sig(min(1.0, m.elementwise_gbps / m.copy_gbps)),
        gemm_curve=GemmCurve(
            tuple(float(n) for n, _ in m.matmul_tflops), tuple(_sig(min(1.0, r / raw_peak)) for _, r in m.matmul_tflops)
        ),
        attention_curve=AttentionCurve(
            tuple(float(s) for s, _ in m.attention_tflops),
            tuple(_sig(min(1.0, r / raw_peak)) for _, r in m.attention_tflops),
        ),
        compute_dtype="fp32" if m.device == "cpu" else "bf16",  # what mlm-run computes in on this device
    )
    cluster = ClusterProfile(
        name=f"{name}-local",
        gpu=gpu_ref,
        gpus_per_node=max(1, c.world_size),
        intra_node_gbps=link,
        intra_node_latency_us=latency,
        intra_node_collective_efficiency=link_eff,
        inter_node_gbps=link,
        inter_node_latency_us=latency,
        inter_node_collective_efficiency=link_eff,
        memory_reserve_gib=max(_sig(m.reserve_gib), 1e-3),
        collective_overlap_efficiency=_sig(c.overlap),
        reduce_scatter_efficiency=rs_eff,
    )
    source = f"measured profile '{name}'"  # the loader's strict checks, so a bad figure fails here, not in mlm-plan
    return GPUProfile.from_dict(gpu.to_dict(), source), ClusterProfile.from_dict(cluster.to_dict(), source)


def render(m: Measurement, gpu: GPUProfile, cluster: ClusterProfile) -> tuple[str, str]:
    """The two profiles as TOML text, with comments saying what each number is."""
    when = time.strftime("%Y-%m-%d %H:%M")
    c = m.collectives
    cpu_note = (
        "\nOn CPU every *_tflops key holds the measured fp32 rate (the runtime computes in fp32 on CPU),"
        f"\nand hbm_gib is this machine's RAM / {c.world_size} ranks."
        if m.device == "cpu"
        else ""
    )
    gpu_header = (
        f"Measured by mlm-profile on {when}: {m.device_name} ({m.device}, GEMM curve in {m.dtype}).\n"
        "Strict key set of mlm/planner/cost/hardware.py; peak = best measured rate, curves = rate / peak." + cpu_note
    )
    gpu_comments = {
        "bf16_tflops": f"best {m.dtype} GEMM rate measured (n = {max(m.matmul_tflops, key=lambda p: p[1])[0]})",
        "hbm_gib": "total device memory" + (" per rank" if m.device == "cpu" else ""),
        "hbm_gbps": "large tensor copy, bytes read + written per second",
        "nvlink_gbps": (
            "pinned host-to-device copy (one GPU, no peer)"
            if c.world_size < 2
            else f"send/recv between 2 local ranks ({c.backend}), one direction"
        ),
        "usd_per_gpu_hour": "unknown: set your price",
        "default_cluster": "written next to this file by mlm-profile --out",
        "memory_bound_efficiency": f"c = a + b bandwidth / copy bandwidth ({m.elementwise_gbps:.1f} GB/s)",
        "gemm_curve": "n x n x n GEMMs; size = geometric mean of (m, n, k)",
        "attention_curve": "causal SDPA fwd+bwd, FLOPs 7*b*h*s^2*d, over bf16_tflops",
        "compute_dtype": "what mlm-run computes in on this device; plans for this profile are priced in it",
    }
    cluster_header = (
        f"Measured by mlm-profile on {when}: {c.world_size} local ranks, {c.backend}.\n"
        "One machine only: the inter_node_* keys copy the intra-node figures; edit them for a "
        "multi-node cluster."
    )
    cluster_comments = {
        "intra_node_gbps": "send/recv ping-pong, one direction",
        "intra_node_latency_us": "one-element all_reduce",
        "intra_node_collective_efficiency": (
            f"min(all_reduce {c.all_reduce_gbps:.2f}, all_gather "
            f"{c.all_gather_gbps:.2f} GB/s bus bandwidth) / intra_node_gbps"
        ),
        "memory_reserve_gib": "memory in use before mlm's work (other processes, runtime/CUDA context) per rank",
        "collective_overlap_efficiency": "share of an async all_reduce hidden under a GEMM loop as long, run meanwhile",
        "reduce_scatter_efficiency": f"reduce_scatter {c.reduce_scatter_gbps:.2f} GB/s bus bandwidth / the above's",
    }
    return (to_toml(gpu, gpu_comments, gpu_header), to_toml(cluster, cluster_comments, cluster_header))
