"""Expert parallelism on gloo against one process: plans written by mlm-plan with --ep pinned, trained 5 steps.

Models: tiny Hugging Face Qwen3-MoE (a dense first block, then 8 experts top-2; attention dropout 0.1), Mixtral
(4 experts top-2, every block MoE), DeepSeek-V3 (group-limited sigmoid routing, a shared expert, MLA) and GPT-OSS
(attention sinks, expert biases, sliding-window layers), all with
transformers 5's fused expert banks; the built-in Llama preset's MoE (the mixtral / qwen3 presets' code) at tiny
size; and two hand-written MoEs whose experts are an nn.ModuleList called by the
model's own loop (hand_moe.py: torch.where + index_add_, a shared expert; block_kinds.py: dense one-hot gating).
Layouts: ep2 (dp2, zero 0 / 1 / 3), dp4 with ep2 (two groups of experts, each
averaged over its own 2 holders), pp2·dp2·ep2 (experts on both pipeline stages) and tp2·dp2·ep2 (without SP, and
with SP on a per-token MoE, moe_per_token.py). The reference is one process on
the same global batch of 4 sequences in micro-batches of 1, so routing, dropout masks (per layer and global
micro-batch, runtime/data.py) and token means are defined the same way. Losses and SGD parameters within 1e-5,
AdamW parameters within 2% of each tensor's movement in norm (test_runtime_parity.py explains both), every expert
compared after gathering the banks over ep. The sparse hand-written MoE also captures: its per-expert token counts
are data-dependent (torch.where), priced as balanced routing with a warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import MODELS
from test_runtime_harness import PARITY_ATOL, assert_params_match, merged, run_workers, train_runs, write_plan
from torch import nn

from mlm.planner.capture.presets import llama as llama_preset
from mlm.planner.plan import load_plan
from mlm.runtime.train import RunOptions

STEPS = 5
SGD = RunOptions(steps=STEPS, optimizer="sgd", lr=0.5, seed=0, max_grad_norm=0.5, device="cpu")
ADAMW = RunOptions(steps=STEPS, optimizer="adamw", lr=0.01, seed=0, max_grad_norm=0.5, device="cpu")
ATOL = PARITY_ATOL
MODELS_FILE = {
    "qwen3": (MODELS / "moe_configs.py", "build_qwen3_moe", ["dropout=0.1"]),
    "deepseek": (MODELS / "moe_configs.py", "build_deepseek_v3", []),
    "mixtral": (MODELS / "block_kinds.py", "build_hf_moe", ["kind=mixtral"]),
    "hand": (MODELS / "hand_moe.py", "build_model", []),
    "pertoken": (MODELS / "moe_per_token.py", "build_model", []),  # keeps batch and sequence apart: SP shardable
    "gptoss": (MODELS / "moe_configs.py", "build_gpt_oss", ["dropout=0.1"]),  # attention sinks, expert biases
    "onehot": (MODELS / "block_kinds.py", "build_dense_then_moe", ["dense=1", "moe=2", "shared=True"]),
    # the built-in Llama preset's MoE (mixtral-8x7b, qwen3-30b-a3b) at tiny size: fused bank, softmax top-2 routing
    "preset": (
        Path(llama_preset.__file__),
        "build_model",
        ["dim=64", "n_layers=2", "n_heads=4", "n_kv_heads=2", "vocab_size=128", "ffn_dim=96", "n_experts=4"],
    ),
}
# (model, optimizer, pins beyond --gpus): world 2, then world 4
TWO = [
    ("qwen3", "sgd", ["--gpus", "2", "--ep", "2", "--zero", "0"]),
    ("qwen3", "adamw", ["--gpus", "2", "--ep", "2", "--zero", "3"]),
    ("deepseek", "sgd", ["--gpus", "2", "--ep", "2", "--zero", "1"]),
    ("mixtral", "adamw", ["--gpus", "2", "--ep", "2", "--zero", "0"]),
    ("hand", "sgd", ["--gpus", "2", "--ep", "2", "--zero", "3"]),
    ("onehot", "adamw", ["--gpus", "2", "--ep", "2", "--zero", "0"]),
    ("preset", "adamw", ["--gpus", "2", "--ep", "2", "--zero", "1"]),
    ("gptoss", "adamw", ["--gpus", "2", "--ep", "2", "--zero", "1"]),
]
FOUR = [
    ("qwen3", "sgd", ["--gpus", "4", "--dp", "4", "--ep", "2", "--zero", "0"]),
    ("qwen3", "adamw", ["--gpus", "4", "--pp", "2", "--dp", "2", "--ep", "2", "--zero", "1"]),
    ("hand", "adamw", ["--gpus", "4", "--pp", "2", "--dp", "2", "--ep", "2", "--zero", "0"]),
    # ep with tp: each tp rank holds its ep rank's experts whole and exchanges its tokens within its tp coordinate
    ("qwen3", "adamw", ["--gpus", "4", "--tp", "2", "--dp", "2", "--ep", "2", "--zero", "0", "--no-sequence-parallel"]),
    ("pertoken", "adamw", ["--gpus", "4", "--tp", "2", "--dp", "2", "--ep", "2", "--zero", "1", "--sequence-parallel"]),
    # Hugging Face's MoE flattens batch and sequence into rows for its router and experts: under SP each tp rank
    # routes its own rows (style "rows": replicated router and expert weights, gradients summed over tp)
    ("qwen3", "adamw", ["--gpus", "4", "--tp", "2", "--dp", "2", "--ep", "2", "--zero", "1", "--sequence-parallel"]),
    # GPT-OSS's attention sinks (one per head) split with the heads over tp
    ("gptoss", "sgd", ["--gpus", "4", "--tp", "2", "--dp", "2", "--ep", "2", "--zero", "0", "--no-sequence-parallel"]),
]


def _mlm_plan(tmp: Path, name: str, model: str, pins: list[str]) -> Path:
    path, entry, args = MODELS_FILE[model]
    cmd = [str(path), "--entry", entry]
    for a in args:
        cmd += ["--model-arg", a]
    cmd += ["--seq-len", "32", "--global-batch", "4", "--micro-batch", "1", "--recompute", "none"]
    if "--tp" not in pins:
        cmd += ["--tp", "1"]
    if "--pp" not in pins:
        cmd += ["--pp", "1"]
    return write_plan(tmp, name, [*cmd, *pins])


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("ep")
    out = {f"one-{m}": _mlm_plan(tmp, f"one-{m}", m, ["--gpus", "1"]) for m in MODELS_FILE}
    for i, (model, _opt, pins) in enumerate(TWO + FOUR):
        out[f"case{i}"] = _mlm_plan(tmp, f"case{i}", model, pins)
    return out


def _compare(got: tuple[list[float], dict], ref: tuple[list[float], dict], initial: dict, opt: str, what: str) -> None:
    losses, params = got
    ref_losses, ref_params = ref
    assert len(losses) == STEPS, what
    assert losses == pytest.approx(ref_losses, abs=ATOL), what
    assert set(params) == set(ref_params), what
    for name, want in ref_params.items():
        assert params[name].shape == want.shape, f"{what}: {name}"
    assert_params_match(params, ref_params, initial, opt, what)


def test_expert_parallel_matches_one_process(plans: dict[str, Path]) -> None:
    cases = TWO + FOUR
    opts = {"sgd": SGD, "adamw": ADAMW}
    keys = sorted({(m, o) for m, o, _ in cases})
    still = RunOptions(steps=1, optimizer="sgd", lr=0.0, seed=0, device="cpu")
    ref_runs = [(str(plans[f"one-{m}"]), opts[o]) for m, o in keys] + [
        (str(plans[f"one-{m}"]), still) for m in MODELS_FILE
    ]
    ref = run_workers(1, train_runs, ref_runs)
    refs = {key: merged(ref, i) for i, key in enumerate(keys)}
    initial = {m: merged(ref, len(keys) + j)[1] for j, m in enumerate(MODELS_FILE)}
    for world, group, offset in ((2, TWO, 0), (4, FOUR, len(TWO))):
        runs = [(str(plans[f"case{offset + i}"]), opts[o]) for i, (_m, o, _p) in enumerate(group)]
        result = run_workers(world, train_runs, runs, timeout=400)
        for i, (model, opt, _pins) in enumerate(group):
            plan = load_plan(plans[f"case{offset + i}"])
            assert plan.layout.ep == 2 and "ep" in plan.pinned, plan.layout
            _compare(merged(result, i), refs[model, opt], initial[model], opt, f"{model} {plan.layout} {opt}")


def test_a_sparse_hand_written_moe_captures_with_its_data_dependent_sizes_named() -> None:
    """hand_moe.py against hand counts: 4 experts of SwiGLU 64, top-2, a shared expert; FLOPs per block within 5% of
    attention + router + 2 routed + 1 shared expert per token (balanced routing), and the assumption is a warning."""
    from mlm.planner.capture.loader import load_model_spec
    from mlm.planner.capture.trace import capture

    seq, d, f, e, k = 32, 64, 64, 4, 2
    ir = capture(load_model_spec(str(MODELS / "hand_moe.py"), "build_model", {}), seq_len=seq)
    assert (ir.num_experts, ir.experts_top_k) == (e, k)
    expert = 3 * d * f
    block_params = 4 * d * d + 4 * d + 4 * d + d * e + e * expert + expert  # qkv+proj (+biases), 2 LNs, router
    assert [b.params for b in ir.blocks] == [block_params] * 2
    per_token = 2 * (4 * d * d + d * e + k * expert + expert) + 4 * seq * d / 2  # causal attention: half the scores
    for b in ir.blocks:
        assert (b.flops_matmul + b.flops_attention) / seq == pytest.approx(per_token, rel=0.05), b.name
    assert any("data-dependent sizes" in w and "blocks.0.moe" in w for w in ir.warnings), ir.warnings


def test_mlm_run_runs_an_ep_plan_from_the_command_line(plans: dict[str, Path], tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mlm.cli.run", str(plans["case0"]), "--steps", "2", "--simulate-locally"]
    proc = subprocess.run(
        [*cmd, "--device", "cpu", "--log", str(log)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ep2" in proc.stdout + proc.stderr
    assert len(log.read_text().splitlines()) == 2


def test_routed_experts_under_tensor_parallelism_train_what_one_process_trains(tmp_path: Path) -> None:
    """Tensor parallelism keeps the routed experts whole on every tp rank. Under SP they run on the rank's token
    shard, so each expert weight's gradient is a partial sum over tp: mlm-plan gives the experts style 'heads'
    (replicated weights on a rank-local input, gradients summed over tp), which mlm-run applies to each expert's
    linears. A per-token MoE (experts in an nn.ModuleList) at tp2 with and without SP against one process, 5
    steps, SGD and AdamW. Before, mlm-run failed on this plan (a style on the MoE module, which DTensor cannot
    replicate with its submodules); without the experts' style the second AdamW loss differs (5.0500 / 5.0478)."""
    model = str(MODELS / "moe_per_token.py")
    shape = ["--seq-len", "32", "--global-batch", "4", "--micro-batch", "1", "--pp", "1", "--ep", "1"]
    shape += ["--recompute", "none", "--zero", "0"]
    one = write_plan(tmp_path, "one", [model, *shape, "--gpus", "1"])
    sp = write_plan(tmp_path, "sp", [model, *shape, "--gpus", "2", "--tp", "2", "--sequence-parallel"])
    nosp = write_plan(tmp_path, "nosp", [model, *shape, "--gpus", "2", "--tp", "2", "--no-sequence-parallel"])
    styles = load_plan(sp).tensor_parallel
    assert styles["blocks.0.moe.experts"] == "rows" and "blocks.0.moe.experts" not in load_plan(nosp).tensor_parallel
    still = RunOptions(steps=1, optimizer="sgd", lr=0.0, seed=0, device="cpu")
    ref = run_workers(1, train_runs, [(str(one), SGD), (str(one), ADAMW), (str(one), still)])
    initial = merged(ref, 2)[1]
    got = run_workers(2, train_runs, [(str(p), o) for p in (sp, nosp) for o in (SGD, ADAMW)], timeout=400)
    for i, (p, opt) in enumerate((p, o) for p in ("sp", "nosp") for o in ("sgd", "adamw")):
        _compare(merged(got, i), merged(ref, i % 2), initial, opt, f"tp2 {p} {opt}")


class _LoopBank(nn.Module):
    """A fused expert bank written as transformers 5 writes one: 3-D weights, and a loop over only the experts that
    were given rows, so a call with no rows returns zeros that depend on neither its input nor its weights."""

    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.up = nn.Parameter(torch.randn(experts, ffn, hidden) * 0.3)
        self.down = nn.Parameter(torch.randn(experts, hidden, ffn) * 0.3)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        mask = F.one_hot(index, self.num_experts).permute(2, 1, 0)  # expert, k, token
        for e in (mask.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist():
            k, tok = torch.where(mask[e])
            y = F.linear(F.gelu(F.linear(x[tok], self.up[e])), self.down[e])
            out = out.index_add(0, tok, y * weights[tok, k, None])
        return out


def _routed_to_rank_one_only(rank: int) -> dict[str, torch.Tensor]:
    """Every token of both ranks routed to experts 2 and 3 (ep rank 1's): ep rank 0's experts receive no row."""
    from mlm.runtime.expert_parallel import ExpertParallel, exchange

    torch.manual_seed(0)
    full = _LoopBank(4, 8, 16)
    x = torch.randn(2, 6, 8)[rank].requires_grad_()
    local = _LoopBank(2, 8, 16)
    with torch.no_grad():
        local.up.copy_(full.up[2 * rank : 2 * rank + 2])
        local.down.copy_(full.down[2 * rank : 2 * rank + 2])
    index = torch.tensor([[2, 3]] * 6)
    weights = torch.tensor([[0.7, 0.3]] * 6)
    ep = ExpertParallel(rank, 2, dist.group.WORLD)
    out = exchange(local, local.forward, 4, ep, x, index, weights)
    out.square().sum().backward()
    assert local.up.grad is not None and local.down.grad is not None
    return {"out": out.detach(), "x": x.grad, "up": local.up.grad, "down": local.down.grad}


def test_an_ep_rank_whose_experts_receive_no_token_runs_the_same_backward() -> None:
    """A rank whose experts get no row (routing that collapsed onto other ranks' experts; at tp2·dp2·ep2 AdamW
    reached it at step 5) still runs the dispatch's reverse exchange that its peers wait in: before, it skipped it
    (the bank's zeros hang from nothing) and both ranks blocked until gloo's timeout. Outputs and every gradient
    against the whole bank in one process."""
    got = run_workers(2, _routed_to_rank_one_only, timeout=60)
    torch.manual_seed(0)
    full = _LoopBank(4, 8, 16)
    x = torch.randn(2, 6, 8).requires_grad_()
    index, weights = torch.tensor([[2, 3]] * 6), torch.tensor([[0.7, 0.3]] * 6)
    out = torch.stack([full(x[r], index, weights) for r in range(2)])
    out.square().sum().backward()
    assert full.up.grad is not None and full.down.grad is not None and x.grad is not None
    for r in range(2):
        torch.testing.assert_close(got[r]["out"], out[r].detach())
        torch.testing.assert_close(got[r]["x"], x.grad[r])
        torch.testing.assert_close(got[r]["up"], full.up.grad[2 * r : 2 * r + 2])
        torch.testing.assert_close(got[r]["down"], full.down.grad[2 * r : 2 * r + 2])
    assert got[0]["up"].abs().sum() == 0  # no token reached ep rank 0's experts
