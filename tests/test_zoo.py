"""The zoo: transformers' decoder families, an encoder, a vision transformer, an encoder-decoder and a U-Net
written as vision code, each at tiny size. For each: exact parameters, the facts the model's own config states
(hidden, heads, kv heads, head dim, vocabulary), forward FLOPs against torch.utils.flop_counter on a real forward
(a different method: it counts the dispatched kernels), and a plan at tp2·pp2 where the shape allows it."""

from __future__ import annotations

import pytest
import torch
from conftest import MODELS
from torch.utils.flop_counter import FlopCounterMode

from mlm.planner.capture.loader import instantiate, load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.inputs import summarize
from mlm.planner.search.layouts import PlanRequest
from mlm.planner.search.make_plan import make_plan

pytest.importorskip("transformers")

zoo = load_model_spec(str(MODELS / "zoo_families.py"), "build").module  # the families and their config facts

SEQ = 8  # shorter than every sliding window in the zoo, so the kernel FLOP count (full scores) applies


def _spec(family: str):
    return load_model_spec(str(MODELS / "zoo_families.py"), "build", {"family": family})


def _kernel_flops(model: torch.nn.Module, inputs: dict[str, torch.Tensor] | torch.Tensor) -> float:
    """Forward FLOPs of one sample as torch's FLOP counter sees the executed kernels. Attention runs in the
    model's eager (matmul-softmax-matmul) form: the counter's SDPA formula counts causal/GQA calls short of what
    the kernel's matmuls compute (checked: eager and sdpa differ for every causal family, agree for BERT)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    model.eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(**inputs) if isinstance(inputs, dict) else model(inputs)
    return float(counter.get_total_flops())


def _captured_flops(ir) -> float:
    return sum(layer.flops_matmul + layer.flops_attention for layer in ir.layers)


@pytest.fixture(scope="module")
def captured() -> dict[str, object]:
    return {}


def _capture(family: str, cache: dict[str, object]):
    if family not in cache:
        cache[family] = capture(_spec(family), seq_len=SEQ)
    return cache[family]


@pytest.mark.parametrize("family", [*zoo.DECODERS, *zoo.ENCODERS])
def test_family_facts_params_and_flops(family: str, captured: dict[str, object]) -> None:
    spec = _spec(family)
    ir = _capture(family, captured)
    assert ir.num_params == sum(p.numel() for p in instantiate(spec, "meta").parameters())
    facts = zoo.config_facts(family)
    got = {"hidden": ir.hidden_size, "heads": ir.num_heads, "kv_heads": ir.num_kv_heads}
    got |= {"head_dim": ir.head_dim, "vocab": ir.vocab_size}
    assert got == facts
    assert ir.num_layers == zoo.LAYERS
    torch.manual_seed(0)
    model = zoo.build(family)
    ids = torch.randint(0, zoo.VOCAB, (1, SEQ))
    assert _captured_flops(ir) == pytest.approx(_kernel_flops(model, {"input_ids": ids}), rel=0.02)


@pytest.mark.parametrize("family", ["llama", "gemma2", "falcon", "gpt_neox"])
def test_family_plans_at_tp2_pp2(family: str, captured: dict[str, object]) -> None:
    ir = _capture(family, captured)
    assert ir.pipeline_skips == ()  # a decoder's blocks pass one activation on (rotary tables recompute per stage)
    outcome = make_plan(_spec(family), ir, PlanRequest(num_gpus=4, global_batch=8, tp=2, pp=2))
    lay = outcome.plan.layout
    assert (lay.tp, lay.pp, lay.dp) == (2, 2, 1)
    assert [name for st in outcome.plan.stages for name in st.layers] == [layer.name for layer in ir.layers]


def test_gemma2_alternates_sliding_and_full_attention_as_its_config_says() -> None:
    ir = capture(_spec("gemma2"), seq_len=16)  # longer than its window of 8: the mask is banded
    layer_types = zoo.build("gemma2").config.layer_types
    want = [("sliding window 8",) if t == "sliding_attention" else ("causal",) for t in layer_types]
    assert [b.attention for b in ir.blocks] == want
    assert len(ir.block_kinds) == len(set(layer_types))


def test_vit_facts_and_flops() -> None:
    spec = load_model_spec(str(MODELS / "hf_vit.py"))
    ir = capture(spec, seq_len=SEQ)
    assert ir.num_params == sum(p.numel() for p in instantiate(spec, "meta").parameters())
    assert (ir.hidden_size, ir.num_heads, ir.head_dim, ir.num_layers) == (64, 4, 16, 4)
    model = spec.module.build_model()
    pixels = spec.module.example_inputs(1, SEQ)[0]
    assert _captured_flops(ir) == pytest.approx(_kernel_flops(model, pixels), rel=0.02)


def test_t5_encoder_decoder_facts_and_flops() -> None:
    spec = load_model_spec(str(MODELS / "hf_t5.py"))
    ir = capture(spec, seq_len=SEQ)
    assert ir.num_params == sum(p.numel() for p in instantiate(spec, "meta").parameters())
    assert (ir.hidden_size, ir.num_heads, ir.head_dim, ir.vocab_size) == (32, 4, 8, 96)
    # the shared embedding under three layers' names (root `shared` belongs to none); the decoder's copy runs with
    # the encoder's last block, so that block's stage holds one too
    assert ir.tied_layers == ("encoder.embed_tokens", "decoder.embed_tokens", "lm_head")
    assert summarize(ir).tied_blocks == (1,)
    model = spec.module.build_model()
    inputs = spec.module.example_inputs(1, SEQ)[0]
    assert _captured_flops(ir) == pytest.approx(_kernel_flops(model, inputs), rel=0.02)


def test_unet_convolutions_are_priced_and_it_plans_data_parallel() -> None:
    spec = load_model_spec(str(MODELS / "unet_segmentation.py"))
    ir = capture(spec, seq_len=SEQ)
    assert ir.num_params == sum(p.numel() for p in instantiate(spec, "meta").parameters())
    model = spec.module.build_model()
    image = spec.module.example_inputs(1, SEQ)[0]
    assert _captured_flops(ir) == pytest.approx(_kernel_flops(model, image), rel=0.02)
    outcome = make_plan(spec, ir, PlanRequest(num_gpus=2, global_batch=8, pp=1))
    assert outcome.plan.layout.dp == 2
    assert outcome.plan.predicted.step_time_s > 0


def _fp32_plan(family: str, tp: int, pp: int):
    """The planner's own plan for `family` (pinned to tp x pp, one row per micro-batch), run in fp32. A family
    named "<family>+cache" keeps transformers' default use_cache=True; "<family>+sp" has sequence parallelism."""
    import dataclasses

    name, _, option = family.partition("+")
    args = {"family": name, **({"default_cache": True} if option == "cache" else {})}
    spec = load_model_spec(str(MODELS / "zoo_families.py"), "build", args)
    ir = capture(spec, seq_len=16)
    sp = option == "sp" and tp > 1
    pins = dict(tp=tp, pp=pp, dp=1, micro_batch=1, vpp=1, recompute="none", sequence_parallel=sp, zero=0)
    plan = make_plan(spec, ir, PlanRequest(num_gpus=tp * pp, global_batch=4, **pins)).plan
    return dataclasses.replace(plan, training=dataclasses.replace(plan.training, dtype="fp32"))


def _losses(_rank: int, runs: list) -> list[list[float]]:
    from mlm.runtime.train import train

    return [[r.loss for r in train(plan, opts).records] for plan, opts in runs]


def test_zoo_subset_trains_what_one_process_trains() -> None:
    """mlm-run on plans mlm-plan wrote: Qwen3 (per-head q/k norms, GQA) and Falcon (grouped kv) at tp2, GPT-NeoX
    (fused QKV, partial rotary) at pp2 — the rotary table each HF decoder computes once in its root runs on both
    stages — Phi-3 at tp2 (its fused qkv_proj is cut into unequal q | k | v chunks by slicing at offsets it reads
    from the shared config: each rank holds its rows of each chunk, and its attention its own copy of the config
    with per-rank head counts; mlm-run refused it before), and Qwen2 with transformers' default use_cache=True at
    tp2 (its KV-cache update crashed on tensor-parallel tensors before the runtime turned the cache off for
    training), and Gemma 2 at tp2, whose embedding subclass scales the lookup by sqrt(hidden) (the vocabulary-parallel
    lookup replaced that forward and dropped the scale: first loss 4.8498 against 4.8505), and BERT at tp2 with
    sequence parallelism and its dropouts on (its attention module adds its own input to the reduce-scattered
    output: that add reads the rank's chunk of the input; the dropout after its MLP's rowwise linear, outside any
    region, draws one device's mask; its head's LayerNorm on the token shard has its gradient summed over tp; each
    of the three failed or differed before), and Phi-2 at tp2 with SP (attention and MLP read one norm's output:
    one all-gather feeds both, one reduce-scatter returns their summed gradient) against one process, 3 steps, SGD
    and AdamW. Falcon's linears compute
    x @ W.T, which capture now reads as linears, so its heads are split (they were priced and run replicated)."""
    from test_runtime_harness import run_workers

    from mlm.runtime.train import RunOptions

    sgd = RunOptions(steps=3, optimizer="sgd", lr=0.5, seed=0, max_grad_norm=0.5)
    adamw = RunOptions(steps=3, optimizer="adamw", lr=0.01, seed=0, max_grad_norm=0.5)
    cases = [("qwen3", 2, 1, sgd), ("falcon", 2, 1, adamw), ("gpt_neox", 1, 2, sgd), ("phi3", 2, 1, adamw)]
    cases += [("qwen2+cache", 2, 1, sgd), ("gemma2", 2, 1, adamw), ("bert+sp", 2, 1, adamw), ("phi+sp", 2, 1, sgd)]
    reference = run_workers(1, _losses, [(_fp32_plan(f, 1, 1), o) for f, _, _, o in cases])[0]
    split = run_workers(2, _losses, [(_fp32_plan(f, tp, pp), o) for f, tp, pp, o in cases])[0]
    for (family, *_), want, got in zip(cases, reference, split, strict=True):
        assert len(got) == 3 and got == pytest.approx(want, abs=1e-5), family


def test_a_linear_written_as_a_matmul_with_the_transposed_weight_is_a_linear() -> None:
    """Falcon's FalconLinear (an nn.Linear) computes input @ self.weight.T: capture reads each as a linear of the
    weight's shape (priced at the GEMM rate, split by the tp ILP) instead of a matmul priced with attention."""
    spec = _spec("falcon")
    ir = capture(spec, seq_len=SEQ)
    block = ir.blocks[0]
    qkv = next(op for op in block.linears if op.fqn.endswith("query_key_value"))
    assert (qkv.in_features, qkv.out_features) == (zoo.HIDDEN, (zoo.HEADS + 2 * zoo.KV_HEADS) * zoo.HIDDEN // zoo.HEADS)
    assert len([op for op in block.linears if op.kind == "linear"]) == 4
    from mlm.planner.search.tp_sharding import plan_tensor_parallel

    styles = plan_tensor_parallel(ir, 2).styles
    assert styles[qkv.fqn] == "colwise" and styles[qkv.fqn.replace("query_key_value", "dense")] == "rowwise"
