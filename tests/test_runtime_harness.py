"""Helpers for the runtime tests (no tests here): hand-built plans and forked gloo worker groups.

Workers are forked from the pytest process (torch is already imported, ~5x faster than spawn), run with
OMP_NUM_THREADS=1 and a 30 s process-group timeout so a hang becomes an error.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mlm.planner.capture.loader import file_sha256
from mlm.planner.layout import Layout
from mlm.planner.plan import ClusterRef, ModelRef, Plan, Stage, Training

REPO = Path(__file__).resolve().parent.parent
GPT_FILE = REPO / "planner" / "capture" / "presets" / "gpt.py"
LLAMA_FILE = REPO / "planner" / "capture" / "presets" / "llama.py"
HF_GPT2_FILE = Path(__file__).resolve().parent / "models" / "hf_gpt2.py"
NANOGPT_FILE = Path(__file__).resolve().parent / "models" / "nanogpt_style.py"  # forward(idx, targets) -> loss

SEQ = 16
VOCAB = 64
GPT_ARGS = dict(n_layer=4, n_head=4, n_embd=32, vocab_size=VOCAB, block_size=SEQ, dropout=0.0)
LLAMA_ARGS = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, ffn_dim=64, max_seq_len=SEQ)
HF_ARGS = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ)
NANOGPT_ARGS = dict(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32)

GPT_TP = {
    "transformer.wte": "vocab",
    "transformer.h.*.attn.c_attn": "colwise",
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
    "lm_head": "vocab",
}
GPT_SP = {"transformer.h.*.ln_1": "sequence", "transformer.h.*.ln_2": "sequence", "transformer.ln_f": "sequence"}
LLAMA_TP = {
    "tok_embeddings": "vocab",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w3": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "output": "vocab",
}
LLAMA_SP = {"layers.*.attention_norm": "sequence", "layers.*.ffn_norm": "sequence", "norm": "sequence"}
NANOGPT_TP = {
    "wte": "vocab",
    "h.*.c_attn": "colwise",
    "h.*.c_proj": "rowwise",
    "h.*.c_fc": "colwise",
    "h.*.mlp_proj": "rowwise",
    "lm_head": "vocab",
}
HF_TP = {
    "transformer.wte": "vocab",
    "transformer.h.*.attn.c_attn": "colwise",
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
    "lm_head": "vocab",
}


def layer_names(kind: str, n: int) -> tuple[list[str], list[str], list[str]]:
    """(head layers, blocks, tail layers) in the planner's layer-FQN convention."""
    if kind == "llama":
        return ["tok_embeddings"], [f"layers.{i}" for i in range(n)], ["norm", "output"]
    if kind == "nanogpt":
        return ["wte", "wpe"], [f"h.{i}" for i in range(n)], ["ln_f", "lm_head"]
    return (
        ["transformer.wte", "transformer.wpe", "transformer.drop"],
        [f"transformer.h.{i}" for i in range(n)],
        ["transformer.ln_f", "lm_head"],
    )


def make_plan(
    kind: str = "gpt",
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    cp: int = 1,
    vpp: int = 1,
    micro_batch: int = 2,
    num_microbatches: int = 2,
    sp: bool = False,
    recompute: str = "none",
    zero: int = 0,
    tp_map: dict[str, str] | None = None,
    model_file: Path | None = None,
    args: dict[str, Any] | None = None,
) -> Plan:
    """A plan as the planner would write it: blocks split evenly over pp*vpp stages."""
    file = model_file or {"gpt": GPT_FILE, "llama": LLAMA_FILE, "hf": HF_GPT2_FILE, "nanogpt": NANOGPT_FILE}[kind]
    margs = dict(
        args
        if args is not None
        else {"gpt": GPT_ARGS, "llama": LLAMA_ARGS, "hf": HF_ARGS, "nanogpt": NANOGPT_ARGS}[kind]
    )
    n_layers = margs.get("n_layer", margs.get("n_layers", 2))
    head, blocks, tail = layer_names(kind, n_layers)
    n_stages = pp * vpp
    per = [len(blocks) // n_stages + (1 if i < len(blocks) % n_stages else 0) for i in range(n_stages)]
    stages, pos = [], 0
    for i in range(n_stages):
        layers = (head if i == 0 else []) + blocks[pos : pos + per[i]] + (tail + ["loss"] if i == n_stages - 1 else [])
        pos += per[i]
        rec = [x for x in layers if x in blocks] if recompute != "none" else []
        stages.append(Stage(index=i, layers=layers, recompute_layers=rec))
    if tp_map is None:
        tp_map = {}
        if tp > 1:
            base = {"gpt": GPT_TP, "llama": LLAMA_TP, "hf": HF_TP, "nanogpt": NANOGPT_TP}[kind]
            tp_map = {**base, **({"gpt": GPT_SP, "llama": LLAMA_SP, "hf": GPT_SP}[kind] if sp else {})}
    layout = Layout(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        micro_batch=micro_batch,
        num_microbatches=num_microbatches,
        vpp=vpp,
        sequence_parallel=sp,
        recompute=recompute,
        zero=zero,
    )  # type: ignore[arg-type]
    model = ModelRef(
        source=str(file),
        sha256=file_sha256(file),
        entry="build_model",
        args=margs,
        num_params=0,
        num_layers=n_layers,
        hidden_size=32,
        num_heads=4,
        vocab_size=VOCAB,
    )
    return Plan(
        model=model,
        cluster=ClusterRef(gpu="cpu", num_gpus=layout.world_size, gpus_per_node=8, profile={}),
        training=Training(global_batch=layout.global_batch, seq_len=SEQ, dtype="fp32"),
        layout=layout,
        stages=stages,
        tensor_parallel=tp_map,
    )


TrainResult = tuple[list[float], dict[str, torch.Tensor]]  # one run's losses and full parameters


def train_runs(_rank: int, runs: list[tuple[Plan | str | Path, Any]]) -> list[TrainResult]:
    """run_workers' fn: train each (plan, or a plan.json path; RunOptions) in turn on this rank and return its
    losses and the full parameters this rank holds."""
    from mlm.planner.plan import load_plan
    from mlm.runtime.train import full_parameters, train

    out = []
    for plan, opts in runs:
        rt = train(plan if isinstance(plan, Plan) else load_plan(plan), opts)
        out.append(([r.loss for r in rt.records], full_parameters(rt)))
    return out


def merged(per_rank: list[list[TrainResult]], i: int) -> TrainResult:
    """Run i of train_runs over all ranks: rank 0's losses, every rank's parameters."""
    params: dict[str, torch.Tensor] = {}
    for result in per_rank:
        params.update(result[i][1])
    return per_rank[0][i][0], params


def write_plan(tmp: Path, name: str, argv: list[str]) -> Path:
    """tmp/name.json written by mlm-plan's command line with `argv`, run in this process (a subprocess per plan
    costs ~1.5 s of imports), capture cache under tmp."""
    import pytest

    from mlm.cli.plan import main

    out = tmp / f"{name}.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLM_CACHE_DIR", str(tmp / "cache"))
        assert main([*argv, "--out", str(out)]) == 0, argv
    return out


PARITY_ATOL = 1e-5  # losses and SGD parameters (fp32 sums in another order)
ADAMW_RTOL = 0.02  # AdamW: of each tensor's movement in the one-process run, in norm (test_runtime_parity.py)


def assert_params_match(
    params: dict[str, torch.Tensor],
    ref_params: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor],
    optimizer: str,
    what: str,
) -> None:
    """Trained parameters against one process's: every element within PARITY_ATOL under SGD; under AdamW each
    tensor's distance within ADAMW_RTOL of how far one process moved it (test_runtime_parity.py says why)."""
    assert set(params) == set(ref_params), what
    for name, want in ref_params.items():
        if optimizer == "sgd":
            diff = (params[name] - want).abs().max().item()
            assert diff <= PARITY_ATOL, f"{what}: {name} differs by {diff:.3g}"
        else:
            moved = (want - initial[name]).norm().item()
            rel = (params[name] - want).norm().item() / max(moved, PARITY_ATOL)
            assert rel <= ADAMW_RTOL, f"{what}: {name} differs by {rel:.2%} of its movement {moved:.3g}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 240.0) -> list[Any]:
    """Fork `world` processes with a gloo group, call fn(rank, *args) in each, return the results by rank."""
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(rank, world, port, fn, args, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world and time.monotonic() < deadline:
        if queue.empty():
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.02)
            continue
        rank, ok, payload = queue.get()
        if ok:
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append(f"rank {rank}: {payload}")
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
    if errors:  # the root cause, not a peer's 'connection reset' that follows it
        primary = [e for e in errors if "Connection reset" not in e and "Connection closed" not in e]
        raise AssertionError("worker failed:\n" + (primary or errors)[0])
    if len(results) != world:
        raise AssertionError(f"workers did not finish in {timeout} s (exit codes {[p.exitcode for p in procs]})")
    return [results[r] for r in range(world)]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    code = 0
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
        result = fn(rank, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(code)
