"""Context parallelism on gloo against one process: plans written by mlm-plan with --cp pinned, trained 5 steps.

Models: the GPT preset (SDPA, dropout 0.1 on the embeddings, the attention probabilities and the residuals), the
Llama preset (its rotary angles computed inside the attention from the input's length: the positions must be
the rank's real ones), tiny Hugging Face Llama and Qwen3 (rotary cos/sin and position ids computed in the root and
passed to every layer; Qwen3's per-head q/k norms) and Qwen3-MoE with ep2 carved out of the cp ranks (attention
dropout 0.1). Layouts: cp2 (zero 0 / 1 / 3, selective recompute), cp4, cp2·dp2, cp2·pp2 (the phantom shapes of
the other stage's layers are the local ones) and cp2·tp2 with sequence parallelism (the GPT preset, and HF Llama,
whose attention takes its input, position embeddings and mask by keyword). The reference is one process
on the same global batch of 4 sequences in micro-batches of 1, so dropout masks (runtime/data.py) and token means
are defined the same way; the context-parallel ranks draw one device's masks of the whole sequence and keep their
positions (runtime/context_parallel.py). Losses and SGD parameters within 1e-5, AdamW parameters within 2% of each
tensor's movement in norm (test_runtime_parity.py explains both)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import MODELS
from test_runtime_harness import (
    GPT_FILE,
    LLAMA_FILE,
    PARITY_ATOL,
    assert_params_match,
    merged,
    run_workers,
    train_runs,
    write_plan,
)

from mlm.planner.errors import Infeasible
from mlm.planner.plan import load_plan
from mlm.runtime.context_parallel import ContextParallel, local_positions, seq_dim
from mlm.runtime.train import RunOptions, train

STEPS = 5
SEQ = 32
SGD = RunOptions(steps=STEPS, optimizer="sgd", lr=0.5, seed=0, max_grad_norm=0.5, device="cpu")
ADAMW = RunOptions(steps=STEPS, optimizer="adamw", lr=0.01, seed=0, max_grad_norm=0.5, device="cpu")
GPT_ARGS = ["n_layer=2", "n_head=4", "n_embd=32", "vocab_size=64", f"block_size={SEQ}"]
MODELS_FILE = {
    "gpt": (GPT_FILE, "build_model", [*GPT_ARGS, "dropout=0.1"]),
    "gpt-nodrop": (GPT_FILE, "build_model", GPT_ARGS),
    "llama": (
        LLAMA_FILE,
        "build_model",
        ["dim=32", "n_layers=2", "n_heads=4", "n_kv_heads=2", "vocab_size=64", "ffn_dim=64", f"max_seq_len={SEQ}"],
    ),
    "hf-llama": (MODELS / "zoo_families.py", "build", ["family=llama"]),
    "hf-qwen3": (MODELS / "zoo_families.py", "build", ["family=qwen3"]),
    "qwen3-moe": (MODELS / "moe_configs.py", "build_qwen3_moe", ["dropout=0.1"]),
}
# (model, optimizer, pins beyond --gpus): world 2, then world 4
TWO = [
    ("gpt", "sgd", ["--gpus", "2", "--cp", "2", "--zero", "0"]),
    ("gpt", "adamw", ["--gpus", "2", "--cp", "2", "--zero", "3", "--recompute", "selective"]),
    ("llama", "adamw", ["--gpus", "2", "--cp", "2", "--zero", "1"]),
    ("hf-llama", "sgd", ["--gpus", "2", "--cp", "2", "--zero", "0"]),
    ("hf-qwen3", "adamw", ["--gpus", "2", "--cp", "2", "--zero", "0"]),
    ("qwen3-moe", "sgd", ["--gpus", "2", "--cp", "2", "--ep", "2", "--zero", "0"]),
]
FOUR = [
    ("gpt", "adamw", ["--gpus", "4", "--cp", "2", "--dp", "2", "--zero", "1"]),
    ("gpt", "sgd", ["--gpus", "4", "--cp", "2", "--pp", "2", "--zero", "0"]),
    ("gpt", "sgd", ["--gpus", "4", "--cp", "4", "--zero", "0"]),
    ("gpt-nodrop", "sgd", ["--gpus", "4", "--cp", "2", "--tp", "2", "--sequence-parallel", "--zero", "0"]),
    ("hf-llama", "adamw", ["--gpus", "4", "--cp", "2", "--tp", "2", "--sequence-parallel", "--zero", "0"]),
]


def _mlm_plan(tmp: Path, name: str, model: str, pins: list[str]) -> Path:
    path, entry, args = MODELS_FILE[model]
    cmd = [str(path), "--entry", entry]
    for a in args:
        cmd += ["--model-arg", a]
    cmd += ["--seq-len", str(SEQ), "--global-batch", "4", "--micro-batch", "1"]
    for flag, default in (("--tp", "1"), ("--pp", "1"), ("--recompute", "none")):
        if flag not in pins:
            cmd += [flag, default]
    if "--dp" not in pins and "--gpus" in pins:
        model_parallel = _pin(pins, "--cp") * _pin(pins, "--tp") * _pin(pins, "--pp")
        cmd += ["--dp", str(_pin(pins, "--gpus") // model_parallel)]
    return write_plan(tmp, name, [*cmd, *pins])


def _pin(pins: list[str], flag: str) -> int:
    return int(pins[pins.index(flag) + 1]) if flag in pins else 1


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("cp")
    models = sorted({m for m, _, _ in TWO + FOUR})
    out = {f"one-{m}": _mlm_plan(tmp, f"one-{m}", m, ["--gpus", "1", "--cp", "1"]) for m in models}
    for i, (model, _opt, pins) in enumerate(TWO + FOUR):
        out[f"case{i}"] = _mlm_plan(tmp, f"case{i}", model, pins)
    return out


def test_context_parallel_matches_one_process(plans: dict[str, Path]) -> None:
    cases = TWO + FOUR
    opts = {"sgd": SGD, "adamw": ADAMW}
    keys = sorted({(m, o) for m, o, _ in cases})
    models = sorted({m for m, _ in keys})
    still = RunOptions(steps=1, optimizer="sgd", lr=0.0, seed=0, device="cpu")
    ref_runs = [(str(plans[f"one-{m}"]), opts[o]) for m, o in keys] + [(str(plans[f"one-{m}"]), still) for m in models]
    ref = run_workers(1, train_runs, ref_runs)
    refs = {key: merged(ref, i) for i, key in enumerate(keys)}
    initial = {m: merged(ref, len(keys) + j)[1] for j, m in enumerate(models)}
    for world, group, offset in ((2, TWO, 0), (4, FOUR, len(TWO))):
        runs = [(str(plans[f"case{offset + i}"]), opts[o]) for i, (_m, o, _p) in enumerate(group)]
        result = run_workers(world, train_runs, runs, timeout=400)
        for i, (model, opt, pins) in enumerate(group):
            plan = load_plan(plans[f"case{offset + i}"])
            assert plan.layout.cp == _pin(pins, "--cp") and "cp" in plan.pinned, plan.layout
            losses, params = merged(result, i)
            what = f"{model} {plan.layout.describe()} {opt}"
            assert len(losses) == STEPS, what
            assert losses == pytest.approx(refs[model, opt][0], abs=PARITY_ATOL), what
            assert_params_match(params, refs[model, opt][1], initial[model], opt, what)


def test_mlm_run_runs_a_cp_and_ep_plan_from_the_command_line(plans: dict[str, Path], tmp_path: Path) -> None:
    """Qwen3-MoE at cp2 with ep2 (the experts split over the two cp ranks) through torchrun."""
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    assert TWO[5][0] == "qwen3-moe"
    cmd = [sys.executable, "-m", "mlm.cli.run", str(plans["case5"]), "--steps", "2", "--simulate-locally"]
    proc = subprocess.run(
        [*cmd, "--device", "cpu", "--log", str(log)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cp2" in proc.stdout + proc.stderr and "ep2" in proc.stdout + proc.stderr
    assert len(log.read_text().splitlines()) == 2


@pytest.mark.parametrize("seq,cp", [(16, 2), (32, 4), (48, 3), (64, 8)])
def test_load_balanced_chunks_cover_the_sequence_with_equal_causal_work(seq: int, cp: int) -> None:
    """Every position on exactly one rank, T/cp on each, and the same causal attention work (keys at or before
    each query) on every rank: the point of the 2·cp chunks."""
    parts = [local_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    assert {len(p) for p in parts} == {seq // cp}
    assert len({int((p + 1).sum()) for p in parts}) == 1
    with pytest.raises(Infeasible, match="divisible by 2·cp"):
        local_positions(seq + 1, cp, 0)


def test_arguments_are_cut_once_along_their_sequence_dimension() -> None:
    """The sequence dimension is the first of length T after the batch, else dimension 0; a tensor already this
    rank's part (hidden size = T) is not cut again when the whole-sequence shape says so."""
    seq = 8
    cp = ContextParallel(rank=1, size=2, group=None, seq_len=seq)
    assert seq_dim((2, seq, 4), seq) == 1 and seq_dim((seq, 4), seq) == 0 and seq_dim((2, 1, seq, seq), seq) == 2
    hidden = torch.arange(2 * seq * seq, dtype=torch.float32).reshape(2, seq, seq)  # hidden size = T
    rope = torch.arange(seq * 3).reshape(seq, 3)
    local, table = cp.shard((hidden, rope), ((2, seq, seq), (seq, 3)))
    assert local.shape == (2, seq // 2, seq) and table.shape == (seq // 2, 3)
    positions = local_positions(seq, 2, 1)
    assert torch.equal(local, hidden[:, positions]) and torch.equal(table, rope[positions])
    again = cp.shard((local,), ((2, seq, seq),))[0]
    assert again.shape == local.shape


def test_hand_written_attention_is_refused_by_the_planner_and_the_runtime(tmp_path: Path) -> None:
    """The GPT preset with attention="manual" (matmul-softmax-matmul): mlm-plan names why no cp layout runs, and
    mlm-run stops on a plan edited to cp 2 instead of attending to half the context."""
    import dataclasses

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLM_CACHE_DIR": str(tmp_path / "cache")}
    base = [sys.executable, "-m", "mlm.cli.plan", str(GPT_FILE), "--entry", "build_model"]
    for a in [*GPT_ARGS, "attention=manual"]:
        base += ["--model-arg", a]
    base += ["--seq-len", str(SEQ), "--global-batch", "4", "--micro-batch", "1", "--tp", "1", "--pp", "1"]
    proc = subprocess.run([*base, "--gpus", "2", "--cp", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode != 0 and "by hand" in proc.stderr, proc.stderr[-2000:]
    out = tmp_path / "one.json"
    proc = subprocess.run([*base, "--gpus", "1", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = load_plan(out)
    edited = dataclasses.replace(
        plan, layout=dataclasses.replace(plan.layout, cp=2), cluster=dataclasses.replace(plan.cluster, num_gpus=2)
    )

    def run(_rank: int) -> str:
        try:
            train(edited, RunOptions(steps=1, optimizer="sgd", device="cpu"))
        except Infeasible as e:
            return str(e)
        return "ran"

    messages = run_workers(2, run)
    assert all("attention computed by hand" in m for m in messages), messages
