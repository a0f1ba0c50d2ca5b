"""Parity: every layout family trains what one process trains (fp32, 5 steps, SGD and AdamW, dropout on).

The reference is one process running the same global batch (4 sequences) in the same micro-batches (1 row each,
in order), so dropout masks are defined the same way (runtime/data.py, DropoutSeeds: seeded per layer and global
micro-batch). Clipping is active (max norm 0.5 < the gradient norm), so the global-norm reduction over mixed
DTensor / plain gradients and over the pp group is exercised.

Families (GPT preset unless named): tp, pp, dp (DDP), interleaved pp (vpp 2), sequence parallelism, ZeRO-1/3,
full and selective recompute, and the compositions pp x dp with zero 0 (Megatron's commonest layout) and
zero 3, tp x pp (with vpp and SP), tp x dp, tp x pp x dp with SP; the Llama preset (RMSNorm, SwiGLU, RoPE, GQA),
HF GPT-2 (Conv1D) and nanoGPT as users write it get a representative subset. Several plans share one group of
forked processes to keep the suite fast on two cores.

Dropout: p = 0.1 on every family whose dropout acts on tensors that are not split over tp. Under tp on the CPU
a dropout on a head- or sequence-sharded tensor draws each shard's mask from the same seed (data.py says so),
which is not one device's mask, so tp families run HF GPT-2 with residual and embedding dropout on (replicated
tensors without sequence parallelism) and attention dropout off, and the GPT/Llama tp families without dropout.

Tolerances: losses and SGD parameters within 1e-5 (fp32 sums in another order). AdamW divides each update by the
root of its own running squared gradient, so an element whose true gradient is ~0 (the key part of a fused QKV
bias: adding a constant to every key shifts all of a query's scores equally, which softmax ignores; a hidden unit
GELU keeps near zero for every token) turns its rounding noise into updates of up to ~lr, while SGD on the same
layout agrees to 1e-7. So under AdamW each parameter tensor is compared in norm: the distance to one process's
tensor must stay within 2% of how far one process moved that tensor in the run (observed: at most 0.82%, the
fused QKV bias under tp 2 x pp 2; 0.25-0.29% under dp and pp; below 0.02% on Llama and HF GPT-2; a wrong
reduction or optimizer state is off in every element, O(100%)). Scale errors that AdamW cannot see (it is
invariant to the gradient's scale) are what the SGD cases catch.

Each family runs under SGD in one case and AdamW in another (compositions cover several families at once), to
keep the file's run time near what 3 SGD steps per family cost before."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_runtime_harness import (
    GPT_ARGS,
    GPT_FILE,
    HF_ARGS,
    PARITY_ATOL,
    assert_params_match,
    make_plan,
    merged,
    run_workers,
    train_runs,
)

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.training_step import TrainingModule
from mlm.runtime.model_build import build_model
from mlm.runtime.train import RunOptions

STEPS = 5
SGD = RunOptions(steps=STEPS, optimizer="sgd", lr=0.5, seed=0, max_grad_norm=0.5)
ADAMW = RunOptions(steps=STEPS, optimizer="adamw", lr=0.01, seed=0, max_grad_norm=0.5)
OPTS = (SGD, ADAMW)
GLOBAL_BATCH = 4
ATOL = PARITY_ATOL
DROPOUT = {
    "gpt": dict(GPT_ARGS, dropout=0.1),
    "hf": dict(HF_ARGS, resid_pdrop=0.1, embd_pdrop=0.1),
}
Result = tuple[list[float], dict[str, torch.Tensor]]


def _args(kind: str, dropout: bool) -> dict[str, Any] | None:
    return DROPOUT[kind] if dropout and kind in DROPOUT else None


def _plan(kind: str, dropout: bool = True, micro_batch: int = 1, **cfg: Any) -> Any:
    dp = cfg.get("dp", 1)
    n = GLOBAL_BATCH // dp // micro_batch
    return make_plan(kind, micro_batch=micro_batch, num_microbatches=n, args=_args(kind, dropout), **cfg)


KINDS = ("gpt", "llama", "hf", "nanogpt")


def _reference_key(kind: str, opt: str, cfg: dict[str, Any]) -> tuple[str, bool, str]:
    return kind, bool(cfg.get("dropout", True)) and kind in DROPOUT, opt


@pytest.fixture(scope="module")
def references() -> dict[Any, Any]:
    """One process for every (model, dropout, optimizer) the cases use, and each model's initial parameters
    (one SGD step at lr 0)."""
    keys = sorted({_reference_key(*case) for case in TWO + FOUR + TP_TIMES_DP} | {("gpt", False, "sgd")})
    opts = {o.optimizer: o for o in OPTS}
    still = RunOptions(steps=1, optimizer="sgd", lr=0.0, seed=0)
    runs = [(_plan(k, d), opts[o]) for k, d, o in keys] + [(_plan(k, False), still) for k in KINDS]
    result = run_workers(1, train_runs, runs)
    refs: dict[Any, Any] = {key: merged(result, i) for i, key in enumerate(keys)}
    for i, k in enumerate(KINDS):
        refs["initial", k] = merged(result, len(keys) + i)[1]
    return refs


def _check(cases: list[tuple[str, str, dict[str, Any]]], world: int, references: dict) -> None:
    """Run (model kind, optimizer, layout) cases in one group of `world` processes; compare with one process."""
    opts = {o.optimizer: o for o in OPTS}
    runs = [(_plan(kind, **cfg), opts[opt]) for kind, opt, cfg in cases]
    result = run_workers(world, train_runs, runs)
    for i, (kind, opt, cfg) in enumerate(cases):
        losses, params = merged(result, i)
        ref_losses, ref_params = references[_reference_key(kind, opt, cfg)]
        what = f"{kind} {cfg} {opt}"
        assert len(losses) == STEPS, what
        assert losses == pytest.approx(ref_losses, abs=ATOL), what
        assert_params_match(params, ref_params, references["initial", kind], opt, what)


def test_single_process_reference_is_plain_torch(references: dict) -> None:
    """The (1,1,1) runtime without dropout equals a hand-written loop: TrainingModule, clip_grad_norm_, SGD,
    the same lr schedule, 4 micro-batches of 1 accumulated (initial weights: model_build.build_model, the
    layout-independent initialisation every layout gets)."""
    spec = load_model_spec(str(GPT_FILE), "build_model", dict(GPT_ARGS))
    model = build_model(spec, SGD.seed)
    step_fn = TrainingModule(model)
    opt = torch.optim.SGD(model.parameters(), lr=SGD.lr)
    from mlm.runtime.data import TokenSource
    from mlm.runtime.optim import lr_factor

    source = TokenSource(vocab=64, seq_len=16, global_batch=GLOBAL_BATCH, seed=SGD.seed)
    losses = []
    for step in range(SGD.steps):
        for g in opt.param_groups:
            g["lr"] = SGD.lr * lr_factor(step, 1, SGD.steps)
        inputs, targets = source.batch(step, 0, 1, torch.device("cpu"))
        opt.zero_grad()
        total = 0.0
        for inp, tgt in zip(inputs.chunk(GLOBAL_BATCH), targets.chunk(GLOBAL_BATCH)):
            loss = step_fn(inp, tgt) / GLOBAL_BATCH
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), SGD.max_grad_norm)
        opt.step()
        losses.append(total)
    ref_losses, ref_params = references["gpt", False, "sgd"]
    assert losses == pytest.approx(ref_losses, abs=ATOL)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[name], atol=ATOL, rtol=0)


# Each family runs under SGD in one case and AdamW in another (pp x dp with zero 0 under both); "dropout": False
# marks the tp cases whose dropout would act on tp-split tensors (module doc).
TWO = [
    ("gpt", "sgd", dict(pp=2, vpp=2, recompute="selective")),
    ("gpt", "adamw", dict(pp=2, recompute="full")),
    ("gpt", "sgd", dict(dp=2)),
    ("gpt", "adamw", dict(dp=2, zero=1)),
    ("gpt", "adamw", dict(dp=2, zero=3)),
    ("gpt", "adamw", dict(tp=2, sp=True, recompute="selective", dropout=False)),
    ("gpt", "sgd", dict(tp=2, recompute="full", dropout=False)),
    ("llama", "adamw", dict(tp=2, sp=True)),
    ("llama", "sgd", dict(pp=2, vpp=2, recompute="selective")),
    ("llama", "adamw", dict(dp=2)),
    ("hf", "sgd", dict(tp=2)),
    ("hf", "adamw", dict(pp=2)),
    ("hf", "sgd", dict(dp=2, zero=3)),
]
FOUR = [
    ("gpt", "sgd", dict(pp=2, dp=2, zero=0)),
    ("gpt", "adamw", dict(pp=2, dp=2, zero=0, vpp=2, recompute="selective")),
    ("gpt", "sgd", dict(pp=2, dp=2, zero=3)),
    ("gpt", "sgd", dict(tp=2, pp=2, vpp=2, sp=True, dropout=False)),
    ("gpt", "adamw", dict(tp=2, pp=2, dropout=False)),
    ("llama", "sgd", dict(tp=2, pp=2, recompute="full")),
    ("hf", "adamw", dict(tp=2, pp=2, sp=True, dropout=False)),
    ("nanogpt", "adamw", dict(tp=2, pp=2)),
]
TP_TIMES_DP = [
    ("gpt", "sgd", dict(tp=2, dp=2, zero=1, recompute="full", dropout=False)),
    ("gpt", "adamw", dict(tp=2, pp=2, dp=2, sp=True, dropout=False)),
]


def test_two_processes(references: dict) -> None:
    _check(TWO, 2, references)


def test_four_processes(references: dict) -> None:
    """pp2 x dp2 with zero 0 (it crashed at step 2 under plain DDP) under SGD and AdamW, also interleaved with
    selective recompute; nanoGPT as users write it (forward(idx, targets) -> (logits, loss), tied)."""
    _check(FOUR, 4, references)


def test_tp_times_dp(references: dict) -> None:
    _check(TP_TIMES_DP[:1], 4, references)
    _check(TP_TIMES_DP[1:], 8, references)
