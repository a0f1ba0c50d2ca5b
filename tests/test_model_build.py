"""Building on meta (runtime/model_build.py): every layout materialises the same weights, only its own shard, with
the model's own initialisation.

Independent checks: (a) the shards every layout materialises, gathered, equal the single-process build exactly
(real gloo groups); (b) the process's peak RSS while one rank of a pp4·tp2 plan builds its stage stays far below
the whole model's fp32 size (the fake process-group backend, real tensors, a fresh interpreter); (c) each
parameter's statistics match what the model's own __init__ gives when run eagerly under torch.manual_seed (a
different method: plain torch), exactly for the deterministic parts (zeros, ones, padding rows).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from test_runtime_harness import REPO, make_plan, run_workers

from mlm.planner.capture.loader import load_model_spec
from mlm.runtime.model_build import build_model
from mlm.runtime.train import RunOptions, full_parameters, setup


def _built(rank: int, plans: list[Any]) -> list[dict[str, torch.Tensor]]:
    return [full_parameters(setup(plan, RunOptions(steps=1, optimizer="adamw", seed=3))) for plan in plans]


def _reference(plan: Any) -> dict[str, torch.Tensor]:
    spec = load_model_spec(plan.model.source, plan.model.entry, plan.model.args)
    return {n: p.detach() for n, p in build_model(spec, 3).named_parameters(remove_duplicate=False)}


def _check_same(plans: list[Any], world: int) -> None:
    per_rank = run_workers(world, _built, plans)
    for i, plan in enumerate(plans):
        merged: dict[str, torch.Tensor] = {}
        for rank_result in per_rank:
            merged.update(rank_result[i])
        ref = _reference(plan)
        assert set(merged) == set(ref), plan.layout.describe()
        for name, value in ref.items():
            assert torch.equal(merged[name], value), f"{plan.layout.describe()}: {name}"


def test_weights_identical_across_layouts() -> None:
    plans = [
        make_plan("gpt", tp=2, sp=True),
        make_plan("gpt", pp=2, vpp=2),
        make_plan("gpt", dp=2, zero=3),
        make_plan("llama", tp=2),
        make_plan("hf", tp=2),
    ]
    _check_same(plans, 2)
    _check_same([make_plan("llama", tp=2, dp=2, zero=3), make_plan("nanogpt", tp=2, pp=2)], 4)


def _fsdp_shards_match(rank: int) -> list[str]:
    """FSDP2 over TP shards of real tensors (the ground truth) against local_shard of the full tensor."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from mlm.runtime.model_build import local_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    bad = []
    for shape in [(96, 6), (90, 6), (7, 12)]:
        full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        tp_places = [Shard(0), Shard(1), Replicate(), _StridedShard(1, split_factor=3)]
        if shape[0] % 3 == 0:  # per-head sharding of a fused q|k|v (equal chunks only)
            tp_places.append(_StridedShard(0, split_factor=3))
        for place in tp_places:
            for fsdp in (False, True):
                module = nn.Module()
                module.w = nn.Parameter(distribute_tensor(full, mesh["tp"], [place], src_data_rank=None))
                if fsdp:
                    fully_shard(module, mesh=mesh["dp"])
                p = module.w
                if not torch.equal(p.to_local(), local_shard(full, p.device_mesh, p.placements)):
                    bad.append(f"{shape} {p.placements}")
    return bad


def test_local_shard_is_what_fsdp2_and_tp_hold() -> None:
    assert run_workers(4, _fsdp_shards_match) == [[], [], [], []]


_MEMORY_SCRIPT = """
import json, resource, sys
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
sys.path.insert(0, {tests!r})
from test_runtime_harness import GPT_FILE, make_plan
from mlm.runtime.mesh import build_mesh
from mlm.runtime.train import RunOptions, setup
args = dict(n_layer=16, n_head=16, n_embd=1024, vocab_size=32768, block_size=64, dropout=0.0)
plan = make_plan("gpt", tp=2, pp=4, micro_batch=1, num_microbatches=4, args=args)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
info = build_mesh(plan.layout, "cpu")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
rt = setup(plan, RunOptions(steps=1), mesh=info)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
local = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in rt.params)
print(json.dumps(dict(growth=after - before, local=local)))
"""


def test_building_one_stage_allocates_about_its_shard() -> None:
    """pp4 x tp2 of a 235M-parameter GPT (0.94 GB fp32): rank 0 holds about 1/8 of it. Building the whole model
    first (the old way) would raise the peak RSS by at least 0.94 GB; here it grows by the shard (168 MB) plus one
    full-size parameter at a time (at most the 134 MB embedding) plus 64 MB of slack for the allocator."""
    n_layer, d, vocab = 16, 1024, 32768
    full_bytes = 4 * (n_layer * (12 * d * d + 13 * d) + vocab * d + 64 * d)
    script = _MEMORY_SCRIPT.format(tests=str(REPO / "tests"))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=_env(), check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["local"] < full_bytes / 4  # a shard: 4 of 16 blocks / tp, half the embedding
    largest = 4 * vocab * d  # the embedding, alive in full while its shard is taken
    assert figures["growth"] < figures["local"] + largest + 64 * 2**20, figures


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}


_INIT_MODEL = """
import math
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, n=256, n_layer=2, vocab=512):
        super().__init__()
        self.emb = nn.Embedding(vocab, n, padding_idx=0)
        self.blocks = nn.ModuleList(nn.Linear(n, n) for _ in range(n_layer))
        self.c_proj = nn.Linear(n, n)
        self.norm = nn.Parameter(torch.ones(n))
        self.scale = nn.Parameter(torch.randn(n, 8) * 0.5)  # computed in __init__
        self.tn = nn.Parameter(torch.empty(n, n))
        nn.init.trunc_normal_(self.tn, std=0.05, a=-0.04, b=0.04)
        self.apply(self._init_weights)  # HF's style
        for name, p in self.named_parameters():  # nanoGPT's scaled residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        {extra}

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(mean=0.0, std=0.02)
            module.bias.data.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=0.02)
            module.weight.data[module.padding_idx].zero_()

    def forward(self, x):
        return self.emb(x)


def build_model():
    return Model()
"""


def _spec(tmp_path: Path, extra: str = "") -> Any:
    path = tmp_path / "init_model.py"
    path.write_text(textwrap.dedent(_INIT_MODEL).replace("{extra}", extra))
    return load_model_spec(str(path), "build_model", {})


def test_user_initialisation_is_honoured(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    built = {n: p.detach() for n, p in build_model(spec, 0).named_parameters()}
    torch.manual_seed(0)
    eager = dict(spec.factory().named_parameters())
    assert set(built) == set(eager)
    for name, ref in eager.items():
        value, ref = built[name].detach(), ref.detach()
        if ref.std() == 0:  # constants: exact
            assert torch.equal(value, ref.detach()), name
        else:
            assert float(value.std()) == pytest.approx(float(ref.std()), rel=0.08), name
            assert abs(float(value.mean()) - float(ref.mean())) < 0.1 * float(ref.std()) + 1e-3, name
    assert float(built["c_proj.weight"].std()) == pytest.approx(0.02 / math.sqrt(4), rel=0.05)
    assert float(built["blocks.0.weight"].std()) == pytest.approx(0.02, rel=0.05)
    assert torch.count_nonzero(built["emb.weight"][0]) == 0  # the padding row
    assert float(built["tn"].abs().max()) <= 0.04  # truncated
    other = dict(build_model(spec, 1).named_parameters())
    assert not torch.equal(other["blocks.0.weight"], built["blocks.0.weight"])  # the seed matters


def test_unreplayable_initialisation_falls_back_with_a_warning(tmp_path: Path) -> None:
    """A parameter set from another parameter (copy_ of a computed meta tensor) cannot be replayed alone: its value
    comes from a full CPU build, equal to the eager model's; orthogonal_ (a QR) is replayed whole."""
    extra = (
        "nn.init.orthogonal_(self.blocks[0].weight)\n"
        "        with torch.no_grad():\n"
        "            self.blocks[1].weight.copy_(self.blocks[0].weight * 2)"
    )
    spec = _spec(tmp_path, extra)
    with pytest.warns(UserWarning, match=r"blocks\.1\.weight") as caught:
        built = dict(build_model(spec, 0).named_parameters())
    assert "blocks.0.weight" not in str(caught[0].message)
    torch.manual_seed(0)
    eager = dict(spec.factory().named_parameters())
    assert torch.equal(built["blocks.1.weight"], eager["blocks.1.weight"])
    w = built["blocks.0.weight"].detach()
    torch.testing.assert_close(w @ w.T, torch.eye(w.shape[0]), atol=1e-4, rtol=0)
