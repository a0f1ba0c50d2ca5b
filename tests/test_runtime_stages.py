"""Pipeline stages (runtime/stages.py) run only their own layers: one process, no process group.

Each stage of a split plan is built from one model and run by hand, chaining the activations stage to stage; the
chain must give the single-model loss exactly, and a later stage's forward must allocate nothing of the size of
another stage's layer outputs (every new storage is recorded by a TorchDispatchMode, with its bytes and whether
one of the stage's own layers was running).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from test_runtime_harness import make_plan
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mlm.planner.capture.loader import instantiate
from mlm.planner.capture.training_step import TrainingModule
from mlm.runtime.model_build import TensorSpec, load_checked_spec, record_layer_calls
from mlm.runtime.stages import Boundary, Placeholder, StageModule, build_stage

SKIP_FILE = Path(__file__).resolve().parent / "models" / "skip_over_stages.py"
CPU = torch.device("cpu")


class Allocations(TorchDispatchMode):
    """Bytes of every new (non-meta) storage, split by whether the stage's first own layer had started (before
    it, the forward stands in for the earlier stages; after it, the stage's layers and the loss run)."""

    def __init__(self) -> None:
        super().__init__()
        self.started = False
        self.before: list[tuple[str, int]] = []
        self.after_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            if t.untyped_storage()._cdata in inputs:
                continue  # a view: no new memory
            n = t.untyped_storage().nbytes()
            if self.started:
                self.after_bytes += n
            else:
                self.before.append((str(func), n))
        return out

    def watch(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(lambda *_: setattr(self, "started", True))


def _stages(plan: Any, mb: int) -> tuple[nn.Module, Any, list[StageModule]]:
    spec = load_checked_spec(plan)
    calls = record_layer_calls(spec, plan, mb)
    torch.manual_seed(0)
    model = instantiate(spec, "cpu")
    stages = [build_stage(model, spec.loss_fn, plan, i, calls, CPU) for i in range(len(plan.stages))]
    return model, calls, stages


def _batch(mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (mb, 17), generator=torch.Generator().manual_seed(5))
    return tokens[:, :-1], tokens[:, 1:]


def _chain(stages: list[StageModule], inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    sent: tuple = ()
    for st in stages:
        out = st(*sent, inputs=inputs, targets=targets)
        sent = out if not st.is_last else ()
    return out.reshape(())


@pytest.mark.parametrize("kind,cfg", [("gpt", dict(pp=2)), ("llama", dict(pp=2, vpp=2)), ("hf", dict(pp=2))])
def test_stages_chain_to_the_single_model_loss(kind: str, cfg: dict) -> None:
    plan = make_plan(kind, micro_batch=2, num_microbatches=2, **cfg)
    model, _calls, stages = _stages(plan, 2)
    inputs, targets = _batch(2)
    want = TrainingModule(model, None)(inputs, targets)
    got = _chain(stages, inputs, targets)
    assert torch.equal(got, want.reshape(()))
    own_params = {id(p) for st in stages for p in st.parameters()}
    assert own_params == {id(p) for p in model.parameters()}  # every parameter on some stage (tied ones too)
    for st in stages:
        mine = {id(p) for fqn in st.layers for p in st.inner.model.get_submodule(fqn).parameters()}
        assert {id(p) for p in st.parameters()} == mine  # a stage holds only its own layers' parameters
        for stage in plan.stages:
            for fqn in stage.layers:
                if fqn != "loss" and fqn not in st.layers:
                    other = st.inner.model.get_submodule(fqn)
                    if next(model.get_submodule(fqn).parameters(), None) is not None:
                        assert isinstance(other, (Placeholder, Boundary)) and not list(other.children())
                    else:  # parameter-free layers (dropout, rotary tables) run on every stage, as themselves
                        assert other is model.get_submodule(fqn) or isinstance(other, Boundary)


@pytest.mark.parametrize("kind", ["gpt", "hf"])
def test_later_stage_allocates_nothing_of_other_stages_layer_size(kind: str) -> None:
    plan = make_plan(kind, pp=2, micro_batch=2, num_microbatches=2)
    _model, calls, stages = _stages(plan, 2)
    inputs, targets = _batch(2)
    sent = stages[0](inputs=inputs, targets=targets)
    last = stages[1]
    record = Allocations()
    record.watch(last.inner.model.get_submodule(last.layers[0]))
    with record:
        loss = last(*sent, inputs=inputs, targets=targets)
    assert loss.shape == (1,)
    other = [fqn for stage in plan.stages[:1] for fqn in stage.layers if fqn not in last.layers and fqn != "loss"]
    smallest = min(
        s.dtype.itemsize * int(torch.tensor(s.shape).prod())
        for fqn in other
        for s in pytree.tree_leaves(calls[fqn].output)
        if isinstance(s, TensorSpec) and len(s.shape) > 1
    )
    assert max((n for _f, n in record.before), default=0) < smallest, record.before
    assert sum(n for _f, n in record.before) < smallest, record.before
    assert record.after_bytes > smallest  # the stage's own layers did run


def test_a_connection_that_skips_over_a_stage_boundary_is_carried() -> None:
    """A root-level residual from the embedding to the head: the first stage sends the embedding's output beside the
    last block's input (stages.carry_plan, from the origins record_layer_calls tracks), the second stage's
    placeholder for `emb` returns it, and the chained stages compute the single model's loss."""
    args = dict(vocab_size=64, dim=32, n_layer=4)
    plan = make_plan("gpt", pp=2, micro_batch=2, num_microbatches=2, model_file=SKIP_FILE, args=args)
    plan.stages[0].layers[:] = ["emb", "blocks.0", "blocks.1"]
    plan.stages[1].layers[:] = ["blocks.2", "blocks.3", "head", "loss"]
    for st in plan.stages:
        st.recompute_layers[:] = []
    model, calls, stages = _stages(plan, 2)
    assert calls["head"].reads == frozenset({("emb", 0), ("blocks.3", 0)})
    assert (stages[1].carry_in, stages[0].carry_out) == ((("emb", 0),), (("emb", 0),))
    inputs, targets = _batch(2)
    assert len(stages[0](inputs=inputs, targets=targets)) == 2  # blocks.2's input, then emb's output
    want = TrainingModule(model, None)(inputs, targets)
    assert torch.equal(_chain(stages, inputs, targets), want.reshape(()))
