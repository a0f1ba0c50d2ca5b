"""Numerics against one process (docs/semantics.md): the loss is the global token mean under a masked loss_fn,
dropout masks are one device's under dp and pp, AdamW and SGD on sharded parameters (FSDP2 zero 3, tp) match.

The model is the GPT preset with a model-file loss_fn that ignores (ignore_index = -100) the targets whose input
token is divisible by 3, so micro-batches and replicas hold different numbers of loss tokens. Independent check of
the loss: step 1's loss equals the loss_fn applied eagerly to the whole global batch at once (one mean over all
unmasked tokens, not a mean of micro-batch means). Parity: 5 steps, fp32, atol 1e-5, against one process running
the same global batch as micro-batches of the plan's size (the dropout reference, runtime/data.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_runtime_harness import GPT_ARGS, LLAMA_ARGS, make_plan, merged, run_workers, train_runs

from mlm.planner.capture.loader import load_model_spec
from mlm.runtime.data import TokenSource
from mlm.runtime.model_build import build_model
from mlm.runtime.train import RunOptions

ATOL = 1e-5
STEPS = 5
MODEL = """
import torch.nn.functional as F
from mlm.planner.capture.presets.PRESET import build_model


def loss_fn(output, batch):
    inputs, targets = batch
    masked = targets.masked_fill(inputs % 3 == 0, -100)
    return F.cross_entropy(output.reshape(-1, output.size(-1)).float(), masked.reshape(-1), ignore_index=-100)
"""
OPTS = {
    "sgd": RunOptions(steps=STEPS, optimizer="sgd", lr=0.5, seed=1, max_grad_norm=0.5),
    "adamw": RunOptions(steps=STEPS, optimizer="adamw", lr=1e-3, seed=1, max_grad_norm=0.5),
}


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("numerics") / "masked_gpt.py"
    path.write_text(MODEL.replace("PRESET", "gpt"))
    return path


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("numerics") / "masked_llama.py"
    path.write_text(MODEL.replace("PRESET", "llama"))
    return path


def _plan(model_file: Path, dropout: float, **cfg: Any) -> Any:
    args = {**GPT_ARGS, "dropout": dropout, "bias": False}  # no biases: no parameter with an exactly-zero gradient
    return make_plan("gpt", model_file=model_file, args=args, **cfg)


def _llama(model_file: Path, **cfg: Any) -> Any:
    return make_plan("llama", model_file=model_file, args=LLAMA_ARGS, **cfg)


def _compare(ref: Any, got: Any, what: str) -> None:
    ref_losses, ref_params = ref
    losses, params = got
    assert len(losses) == STEPS
    assert losses == pytest.approx(ref_losses, abs=ATOL), what
    assert set(params) == set(ref_params), what
    for name, value in ref_params.items():
        worst = (params[name] - value).abs().max().item()
        assert worst <= ATOL, f"{what}: {name} differs by {worst}"


def test_loss_is_the_global_token_mean(model_file: Path) -> None:
    """Step 1's loss under dp2 x 2 micro-batches equals one eager mean over the global batch's unmasked tokens,
    and differs from the mean of the micro-batch means (the masking is uneven)."""
    plan = _plan(model_file, 0.0, dp=2, micro_batch=1, num_microbatches=2)
    opts = RunOptions(steps=1, optimizer="sgd", lr=0.5, seed=1)
    (loss,), _ = merged(run_workers(2, train_runs, [(plan, opts)]), 0)
    spec = load_model_spec(str(model_file), "build_model", plan.model.args)
    model = build_model(spec, opts.seed)
    source = TokenSource(vocab=plan.model.vocab_size, seq_len=plan.training.seq_len, global_batch=4, seed=opts.seed)
    inputs, targets = source.batch(0, 0, 1, torch.device("cpu"))
    with torch.no_grad():
        whole = float(spec.loss_fn(model(inputs), (inputs, targets)))
        per_sample = [
            float(spec.loss_fn(model(inputs[i : i + 1]), (inputs[i : i + 1], targets[i : i + 1]))) for i in range(4)
        ]
    assert loss == pytest.approx(whole, abs=1e-6)
    assert abs(sum(per_sample) / 4 - whole) > 1e-4  # the test can tell the two apart


def test_dp_and_pp_match_one_process_with_dropout(model_file: Path) -> None:
    """Dropout 0.1 everywhere, SGD and AdamW: dp2 (DDP), dp2 zero 3 (FSDP2), pp2 (1F1B over 4 micro-batches) and
    pp2 x dp2 zero 0 (DDP inside the pipeline stages) draw one device's masks and train what it trains."""
    ref_plan = _plan(model_file, 0.1, micro_batch=1, num_microbatches=4)
    no_dropout = _plan(model_file, 0.0, micro_batch=1, num_microbatches=4)
    refs = run_workers(1, train_runs, [(ref_plan, OPTS["sgd"]), (ref_plan, OPTS["adamw"]), (no_dropout, OPTS["sgd"])])
    assert abs(merged(refs, 0)[0][0] - merged(refs, 2)[0][0]) > 1e-3  # dropout is on
    two = [
        _plan(model_file, 0.1, dp=2, micro_batch=1, num_microbatches=2),
        _plan(model_file, 0.1, dp=2, zero=3, micro_batch=1, num_microbatches=2),
        _plan(model_file, 0.1, pp=2, micro_batch=1, num_microbatches=4),
    ]
    four = _plan(model_file, 0.1, pp=2, dp=2, zero=0, micro_batch=1, num_microbatches=2)
    for world, plans in ((2, two), (4, [four])):
        runs = run_workers(world, train_runs, [(p, OPTS[o]) for p in plans for o in ("sgd", "adamw")])
        for i, (plan, o) in enumerate((p, o) for p in plans for o in ("sgd", "adamw")):
            ref = merged(refs, 0 if o == "sgd" else 1)
            _compare(ref, merged(runs, i), f"{o} {plan.layout.describe()}")


def test_tensor_parallel_dropout_draws_one_devices_masks(model_file: Path) -> None:
    """Dropout 0.1 on head-sharded attention (SDPA's dropout_p, and a manual softmax dropout) and on
    sequence-parallel residuals: tp2 and tp2 + SP draw one device's masks (runtime/tensor_parallel.py
    _RegionDropout) and train what one process trains, under SGD and AdamW."""
    ref_plan = _plan(model_file, 0.1, micro_batch=2, num_microbatches=2)
    manual_ref = make_plan(
        "gpt",
        model_file=model_file,
        args={**GPT_ARGS, "dropout": 0.1, "bias": False, "attention": "manual"},
        micro_batch=2,
        num_microbatches=2,
    )
    refs = run_workers(1, train_runs, [(ref_plan, OPTS["sgd"]), (ref_plan, OPTS["adamw"]), (manual_ref, OPTS["sgd"])])
    tp = _plan(model_file, 0.1, tp=2, micro_batch=2, num_microbatches=2)
    sp = _plan(model_file, 0.1, tp=2, sp=True, micro_batch=2, num_microbatches=2)
    manual = make_plan(
        "gpt",
        model_file=model_file,
        args={**GPT_ARGS, "dropout": 0.1, "bias": False, "attention": "manual"},
        tp=2,
        micro_batch=2,
        num_microbatches=2,
    )
    runs = [(tp, OPTS["sgd"]), (tp, OPTS["adamw"]), (sp, OPTS["adamw"]), (manual, OPTS["sgd"])]
    got = run_workers(2, train_runs, runs)
    for i, ref_index in enumerate((0, 1, 1, 2)):
        _compare(
            merged(refs, ref_index), merged(got, i), f"dropout {runs[i][1].optimizer} {runs[i][0].layout.describe()}"
        )


def test_tensor_parallel_adamw_matches_one_process(model_file: Path, llama_file: Path) -> None:
    """AdamW on tp-sharded (GPT: fused q|k|v sharded per head) and tp x FSDP2-sharded (Llama, GQA)
    parameters, masked loss, dropout off (dropout under tp: the test above)."""
    gpt_ref = _plan(model_file, 0.0, micro_batch=4, num_microbatches=1)
    llama_ref = _llama(llama_file, micro_batch=4, num_microbatches=1)
    refs = run_workers(1, train_runs, [(gpt_ref, OPTS["adamw"]), (llama_ref, OPTS["adamw"])])
    gpt_tp = _plan(model_file, 0.0, tp=2, micro_batch=2, num_microbatches=2)
    _compare(merged(refs, 0), merged(run_workers(2, train_runs, [(gpt_tp, OPTS["adamw"])]), 0), "gpt tp2 adamw")
    llama = _llama(llama_file, tp=2, dp=2, zero=3, micro_batch=1, num_microbatches=2)
    runs = run_workers(4, train_runs, [(llama, OPTS["adamw"])])
    _compare(merged(refs, 1), merged(runs, 0), "adamw " + llama.layout.describe())
