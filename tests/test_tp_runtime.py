"""Tensor parallelism as Megatron runs it, measured on 2 gloo processes (tp = 2) for the GPT preset, the Llama preset
(grouped-query attention: 4 heads, 2 kv heads) and HF GPT-2 (Conv1D, fused c_attn):

- per block, CommDebugMode's collective counts in forward and in backward equal planner/cost/tp_collectives.py
  (2 all-reduces each way; with sequence parallelism 2 all-gathers + 2 reduce-scatters each way; GPT also under
  full and selective recompute), and the bytes of the forward collectives equal its bytes;
- every SDPA call gets a local query with num_heads / tp heads and local keys with num_kv_heads / tp heads;
- tp2 and tp2 + SP train what one process trains under AdamW (3 steps; SGD: test_runtime_parity).
The region check's errors (tp not dividing the kv heads, head counts no integer attribute holds) are pure tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_runtime_harness import (
    GPT_ARGS,
    GPT_SP,
    GPT_TP,
    LLAMA_ARGS,
    LLAMA_TP,
    SEQ,
    VOCAB,
    make_plan,
    merged,
    run_workers,
    train_runs,
)

from mlm.planner.cost.tp_collectives import tp_block_collectives
from mlm.planner.errors import PlanError
from mlm.runtime.train import RunOptions, setup

KINDS = ("gpt", "llama", "hf")
HEADS = {"gpt": (4, 4), "llama": (4, 2), "hf": (4, 4)}  # (num_heads, num_kv_heads) of the test configs
BLOCK = {"gpt": "transformer.h.1", "llama": "layers.1", "hf": "transformer.h.1"}
HIDDEN = 32
MICRO = 2
GPT_NOBIAS = dict(GPT_ARGS, bias=False)  # see test_runtime_parity: AdamW amplifies the key bias's zero gradient
COLLECTIVE_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def _plan(kind: str, sp: bool, micro_batch: int = MICRO, num_microbatches: int = 1, **kw: Any) -> Any:
    args = GPT_NOBIAS if kind == "gpt" else None
    return make_plan(kind, micro_batch=micro_batch, num_microbatches=num_microbatches, sp=sp, args=args, **kw)


class _Attention(torch.overrides.TorchFunctionMode):
    """Records (is DTensor, shape) of the query and key of every SDPA call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, tuple[int, ...], tuple[int, ...]]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.nn.functional.scaled_dot_product_attention:
            from torch.distributed.tensor import DTensor

            q, k = args[0], args[1]
            self.calls.append((isinstance(q, DTensor) or isinstance(k, DTensor), tuple(q.shape), tuple(k.shape)))
        return func(*args, **(kwargs or {}))


class _ForwardBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of each functional collective while `active` (set by hooks around one block's forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.ops: dict[str, list[float]] = {}

    def start(self, *_: Any) -> None:
        self.active = True

    def stop(self, *_: Any) -> None:
        self.active = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if self.active and name in COLLECTIVE_OPS:
            full = out if name == "all_gather_into_tensor" else args[0]  # the dry run's convention
            self.ops.setdefault(name, []).append(float(full.numel() * full.element_size()))
        return out


def _measure(rank: int, configs: list[tuple[str, bool, str]]) -> list[dict[str, Any]]:
    from torch.distributed.tensor.debug import CommDebugMode

    out = []
    for kind, sp, recompute in configs:
        plan = _plan(kind, sp, tp=2, recompute=recompute)
        rt = setup(plan, RunOptions(steps=1, optimizer="sgd", lr=0.1, seed=0))
        model = rt.stages[0].inner.model
        block = model.get_submodule(BLOCK[kind])
        nbytes = _ForwardBytes()
        block.register_forward_pre_hook(nbytes.start)
        block.register_forward_hook(nbytes.stop)
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ), generator=torch.Generator().manual_seed(0))
        attention = _Attention()
        with rt.tp_contexts(), CommDebugMode() as comm, nbytes, attention:
            logits = model(tokens)
            logits = getattr(logits, "logits", logits)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
            loss.backward()
        key = next(k for k in comm.comm_module_counts if k.endswith("." + BLOCK[kind]) or k == BLOCK[kind])
        counts = {
            phase: {str(op).rsplit(".", 1)[-1]: n for op, n in comm.comm_module_counts[key][phase].items()}
            for phase in ("forward", "backward")
        }
        out.append(dict(counts=counts, bytes=nbytes.ops, attention=attention.calls, strided=_strided_round_trip(model)))
    return out


def _strided_round_trip(model: torch.nn.Module) -> list[tuple[str, bool, bool]]:
    """Per-head (strided) parameters: (name, the plain-shard copy holds the same full value, copying it back
    restores this rank's shard)."""
    from mlm.runtime.tensor_parallel import copy_from_plain_shards, gather_full, is_strided, to_plain_shards

    out = []
    for name, p in model.named_parameters():
        if is_strided(p):
            plain = to_plain_shards(p)
            before = p.to_local().clone()
            with torch.no_grad():
                p.to_local().zero_()
            copy_from_plain_shards(p, plain)
            out.append((name, torch.equal(plain.full_tensor(), gather_full(p)), torch.equal(p.to_local(), before)))
    return out


CONFIGS = [(k, sp, "none") for k in KINDS for sp in (False, True)]
CONFIGS += [("gpt", sp, rc) for sp in (False, True) for rc in ("full", "selective")]


@pytest.fixture(scope="module")
def measured() -> dict[tuple[str, bool], dict[str, Any]]:
    result = run_workers(2, _measure, CONFIGS)
    return {(k, sp) if rc == "none" else (k, sp, rc): m for (k, sp, rc), m in zip(CONFIGS, result[0])}


@pytest.mark.parametrize("kind,sp,recompute", CONFIGS)
def test_block_collectives_match_the_cost_model(measured: dict, kind: str, sp: bool, recompute: str) -> None:
    m = measured[(kind, sp) if recompute == "none" else (kind, sp, recompute)]
    for phase in ("forward", "backward"):
        want = tp_block_collectives(2, sp, MICRO, SEQ, HIDDEN, dtype_bytes=4, phase=phase, recompute=recompute)
        assert m["counts"][phase] == {op: n for op, (n, _) in want.items()}, phase
    want = tp_block_collectives(2, sp, MICRO, SEQ, HIDDEN, dtype_bytes=4, phase="forward")
    assert {op: (len(b), sum(b)) for op, b in m["bytes"].items()} == want


@pytest.mark.parametrize("kind", KINDS)
def test_attention_runs_on_local_heads(measured: dict, kind: str) -> None:
    heads, kv_heads = HEADS[kind]
    for sp in (False, True):
        calls = measured[kind, sp]["attention"]
        n_blocks = 4 if kind != "hf" else 2
        assert len(calls) == n_blocks
        for is_dtensor, q, k in calls:
            assert not is_dtensor
            assert q == (MICRO, heads // 2, SEQ, HIDDEN // heads)
            assert k == (MICRO, kv_heads // 2, SEQ, HIDDEN // heads)


# ----------------------------------------------------------------------------------------------------- parity

ADAMW = RunOptions(steps=3, optimizer="adamw", lr=0.01, seed=0, max_grad_norm=0.5)
GRAD = RunOptions(steps=1, optimizer="sgd", lr=1.0, seed=0, max_grad_norm=1e9)  # p0 - p1 = the first gradient
ATOL = 1e-5
NOISE_GRAD = 1e-6  # |gradient| at fp32 cancellation noise (2^-23 relative on sums of ~1e-3..1 terms)


def _max(t: torch.Tensor) -> float:
    return t.max().item() if t.numel() else 0.0


def test_tp_matches_one_process_under_adamw() -> None:
    """tp2 and tp2 + SP (2 micro-batches) against one process on the same 2 micro-batches (only tp's reduction
    order differs), 3 AdamW steps (SGD parity of these layouts: test_runtime_parity). 1e-5 plus what fp32 noise
    in the gradient can move AdamW: it divides the noise by the gradient's own magnitude, so an element whose first
    gradient g is small may move by up to steps·lr·min(1, NOISE_GRAD/|g|) more (as for one process with another
    accumulation order).
    HF GPT-2's c_attn key bias (test_runtime_parity's pp2 x dp2 note: zero true gradient, so AdamW moves it by
    noise of up to lr per step in any layout) perturbs every later step at rounding level, so there the losses
    are checked to 1e-5 and the parameters to the step bound only."""
    start = RunOptions(steps=0, optimizer="sgd", lr=1.0, seed=0)
    refs = run_workers(
        1,
        train_runs,
        [
            (_plan(k, False, micro_batch=mb, num_microbatches=4 // mb), o)
            for k in KINDS
            for mb, o in ((2, ADAMW), (4, GRAD), (4, start))
        ],
    )
    cfgs = [(k, sp, ADAMW) for k in KINDS for sp in (False, True)]
    runs = run_workers(2, train_runs, [(_plan(k, sp, micro_batch=2, num_microbatches=2, tp=2), o) for k, sp, o in cfgs])
    for i, (kind, sp, opts) in enumerate(cfgs):
        r = 3 * KINDS.index(kind)
        ref_losses, ref_params = merged(refs, r)
        grads = {n: merged(refs, r + 2)[1][n] - p for n, p in merged(refs, r + 1)[1].items()}
        losses, params = merged(runs, i)
        assert losses == pytest.approx(ref_losses, abs=ATOL), (kind, sp, opts.optimizer)
        assert set(params) == set(ref_params)
        for name, ref in ref_params.items():
            diff = (params[name] - ref).abs()
            if opts is ADAMW and kind == "hf":  # see the docstring: losses and the AdamW step bound only
                assert _max(diff) <= opts.steps * opts.lr, name
                continue
            if opts is ADAMW:
                # AdamW's step moves by lr·m̂/√v̂, which a gradient error δ changes by about lr·δ/|g| per step: the
                # reduction-order noise NOISE_GRAD allows steps·lr·min(1, NOISE_GRAD/|g|) beyond ATOL per element
                share = (NOISE_GRAD / grads[name].abs().clamp_min(1e-30)).clamp(max=1.0)
                excess = diff - ATOL - opts.steps * opts.lr * share
                worst = _max(excess)
                assert worst <= 0, f"{kind} sp={sp} adamw: {name} exceeds its noise bound by {worst}"
                continue
            worst = _max(diff)
            assert worst <= ATOL, f"{kind} sp={sp} {opts.optimizer}: {name} differs by {worst}"


def test_sp_with_a_vocabulary_tp_does_not_divide_matches_one_process() -> None:
    """GPT-2's 50257 tokens at tp 2: the embedding and the head stay replicated; under SP the head's input is
    gathered, so every rank computes the whole logits and the complete head (tied embedding) gradient. tp2 + SP,
    2 micro-batches, 3 SGD steps, against one process (this crashed in FSDP2's reduction before: the head's
    gradient was a partial-sum DTensor of a plain parameter)."""
    args = {**GPT_ARGS, "vocab_size": VOCAB + 1}
    _tp2_sp_matches_one_process({**GPT_TP, "transformer.wte": "replicate", "lm_head": "replicate", **GPT_SP}, args)


def _tp2_sp_matches_one_process(tp_map: dict[str, str], args: dict[str, Any] | None = None) -> None:
    """The GPT preset at tp2 + SP with `tp_map`, 2 micro-batches, 3 SGD steps: losses and every parameter within
    ATOL of one process."""
    opts = RunOptions(steps=3, optimizer="sgd", lr=0.5, seed=0)
    one = make_plan("gpt", micro_batch=2, num_microbatches=2, args=args)
    two = make_plan("gpt", tp=2, sp=True, micro_batch=2, num_microbatches=2, args=args, tp_map=tp_map)
    ref_losses, ref_params = merged(run_workers(1, train_runs, [(one, opts)]), 0)
    losses, params = merged(run_workers(2, train_runs, [(two, opts)]), 0)
    assert losses == pytest.approx(ref_losses, abs=ATOL)
    assert set(params) == set(ref_params)
    for name, ref in ref_params.items():
        assert _max((params[name] - ref).abs()) <= ATOL, name


def test_sp_with_a_replicated_mlp_matches_one_process() -> None:
    """The sharding ILP may leave a block's MLP replicated (mlm-plan does so for small widths): under SP its two
    linears compute the rank's sequence shard with the replicated weights and the weight gradients are all-reduced
    over tp (before, the second linear gathered its already whole input again and the block failed on shapes).
    tp2 + SP, 2 micro-batches, 3 SGD steps, against one process."""
    _tp2_sp_matches_one_process(
        {**GPT_TP, **GPT_SP, "transformer.h.*.mlp.c_fc": "replicate", "transformer.h.*.mlp.c_proj": "replicate"}
    )


# ------------------------------------------------------------------------------------------ the region check


def _regions(file: Path, args: dict[str, Any], tp_map: dict[str, str], tp: int) -> list[Any]:
    from mlm.planner.capture.loader import load_model_spec
    from mlm.runtime.tensor_parallel import expand_tp_map, find_regions

    model = load_model_spec(str(file), "build_model", args).factory(**args)
    names = [n for n, _ in model.named_modules() if n]
    return find_regions(model, expand_tp_map(tp_map, names), tp, None)


def test_tp_must_divide_the_key_value_heads() -> None:
    from test_runtime_harness import LLAMA_FILE

    with pytest.raises(PlanError, match=r"tp=4 does not divide the 2 key/value heads .*layers.0.attention"):
        _regions(LLAMA_FILE, LLAMA_ARGS, LLAMA_TP, 4)
    assert len(_regions(LLAMA_FILE, LLAMA_ARGS, LLAMA_TP, 2)) == 8  # attention and MLP of 4 blocks


EDGE = Path(__file__).parent / "models" / "tp_attention_edge.py"


def _planned(file: Path, tp: int) -> Any:
    """mlm-plan's plan for `file` pinned to tp (one process per tp rank), run in fp32."""
    import dataclasses

    from mlm.planner.capture.loader import load_model_spec
    from mlm.planner.capture.trace import capture
    from mlm.planner.search.layouts import PlanRequest
    from mlm.planner.search.make_plan import make_plan as plan_for

    spec = load_model_spec(str(file), "build_model", {})
    pins = dict(tp=tp, pp=1, dp=1, micro_batch=2, vpp=1, recompute="none", sequence_parallel=False, zero=0)
    plan = plan_for(spec, capture(spec, seq_len=SEQ), PlanRequest(num_gpus=tp, global_batch=4, **pins)).plan
    return dataclasses.replace(plan, training=dataclasses.replace(plan.training, dtype="fp32"))


EDGE_TP = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise"}


def test_head_count_held_outside_the_module_is_a_clear_error() -> None:
    with pytest.raises(PlanError, match=r"no per-rank setting .*blocks.0.attn.* 2 heads per rank") as err:
        _regions(EDGE, {"heads_from": "module_constant"}, EDGE_TP, 2)
    assert "\n" not in str(err.value)


def test_unequal_fused_chunks_and_config_held_heads_run_on_local_heads() -> None:
    """A fused q | k | v cut into unequal chunks (4 query, 2 key/value heads of 8) by `split` with sizes computed
    from a shared config object: each rank gets its rows of every chunk and its attention a config of its own with
    2 query and 1 key/value heads; the model's config is left as it was. At tp2 (a plan mlm-plan wrote), 3 SGD
    steps with every parameter, biases of the reordered rows included, against one process (AdamW: Phi-3 in
    test_zoo; AdamW would amplify float noise in the key bias, whose gradient is zero)."""
    from mlm.planner.capture.loader import load_model_spec
    from mlm.runtime.tensor_parallel import expand_tp_map, find_regions

    model = load_model_spec(str(EDGE), "build_model", {}).factory()
    regions = find_regions(model, expand_tp_map(EDGE_TP, [n for n, _ in model.named_modules() if n]), 2, None)
    assert [(r.attrs, r.splits) for r in regions] == [
        ({"cfg.n_head": 2, "cfg.n_kv": 1}, {f"blocks.{i}.attn.qkv": (32, 16, 16)}) for i in range(2)
    ]
    assert (model.blocks[0].attn.cfg.n_head, model.blocks[0].attn.cfg.n_kv) == (4, 2)  # the check restores them

    opts = RunOptions(steps=3, optimizer="sgd", lr=0.5, seed=0)
    one, two = (_planned(EDGE, tp) for tp in (1, 2))
    assert two.tensor_parallel["blocks.0.attn.qkv"] == "colwise"
    ref_losses, ref_params = merged(run_workers(1, train_runs, [(one, opts)]), 0)
    losses, params = merged(run_workers(2, train_runs, [(two, opts)]), 0)
    assert losses == pytest.approx(ref_losses, abs=ATOL)
    for name, ref in ref_params.items():
        assert _max((params[name] - ref).abs()) <= ATOL, name


def test_manual_attention_gets_per_rank_attributes() -> None:
    """The GPT preset's materialised-softmax path (4-D matmuls instead of SDPA): nanoGPT's n_head and n_embd take
    per-rank values, and the module sees an input of per-rank width (its C = x.size(-1) drives the reshapes)."""
    from test_runtime_harness import GPT_FILE, GPT_TP

    regions = _regions(GPT_FILE, dict(GPT_ARGS, attention="manual"), GPT_TP, 2)
    attn = [r for r in regions if r.fqn.endswith("attn")]
    assert len(attn) == 4
    for r in attn:
        assert r.attrs == {"n_head": 2, "n_embd": HIDDEN // 2}
        assert r.proxy_width == HIDDEN // 2
        assert r.splits == {f"{r.fqn}.c_attn": (HIDDEN, HIDDEN, HIDDEN)}


def test_strided_parameters_convert_for_checkpoints(measured: dict) -> None:
    """Strided: the fused c_attn weights of GPT (4 blocks, no biases) and weight + bias of HF GPT-2 (2 blocks)."""
    for kind, n_fused in (("gpt", 4), ("hf", 2 * 2), ("llama", 0)):
        strided = measured[kind, False]["strided"]
        assert len(strided) == n_fused, kind
        assert all(same and restored for _, same, restored in strided), strided


if __name__ == "__main__":  # python tests/test_tp_runtime.py: the per-block counts, for reports
    for (kind, sp, rc), m in zip(CONFIGS, run_workers(2, _measure, CONFIGS)[0]):
        print(f"{kind:6} sp={sp!s:5} recompute={rc:9} {m['counts']}")
