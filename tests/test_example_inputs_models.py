"""Models fed by their file's example_inputs (images, latents, encoder-decoder ids): costed per sample when their
inputs are not token sequences, and trained by mlm-run on batches from example_inputs, equal to one process under
data, tensor and pipeline parallelism."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from conftest import MODELS
from torch.utils.flop_counter import FlopCounterMode

from mlm.cli.plan import main as plan_main
from mlm.planner.capture.loader import instantiate, load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.search.layouts import PlanRequest
from mlm.planner.search.make_plan import make_plan

pytest.importorskip("transformers")


def _spec(name: str):
    return load_model_spec(str(MODELS / name))


def test_image_models_are_costed_per_sample_of_the_tokens_their_attention_sees() -> None:
    """A ViT's example_inputs ignore seq_len: its unit is the sample of 17 tokens (16 patches and the class token,
    from the attention op), whatever --seq-len says; a conv U-Net without attention is costed per sample; a T5
    fed ids of seq_len stays a token model."""
    vit = capture(_spec("hf_vit.py"), seq_len=512)
    assert (vit.seq_len, vit.token_inputs) == ((32 // 8) ** 2 + 1, False)
    assert any("do not change with seq_len (--seq-len 512 does not apply)" in w for w in vit.warnings)
    unet = capture(_spec("unet_segmentation.py"))
    assert (unet.seq_len, unet.token_inputs) == (1, False)
    assert not any("vocabulary unknown" in w for w in unet.warnings)  # an image model has no vocabulary
    t5 = capture(_spec("hf_t5.py"), seq_len=16)
    assert (t5.seq_len, t5.token_inputs) == (16, True)


def test_plan_of_an_image_model_reports_samples(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    out = tmp_path / "vit.json"
    assert plan_main([str(MODELS / "hf_vit.py"), "--gpus", "2", "--global-batch", "8", "--out", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())  # rich wraps lines
    assert "global batch 8 samples of 17 tokens" in text and "samples/s" in text
    from mlm.planner.plan import load_plan

    training = load_plan(out).training
    assert (training.seq_len, training.token_inputs) == (17, False)


@pytest.mark.parametrize(("name", "tokens"), [("hf_diffusers_unet.py", 1), ("hf_diffusers_dit.py", 64)])
def test_diffusers_models_params_and_flops(name: str, tokens: int) -> None:
    """Exact parameters and forward FLOPs against torch's FLOP counter on a real forward, with diffusers' classic
    attention processor (baddbmm-softmax-bmm: the counter does not count the CPU SDPA kernel)."""
    pytest.importorskip("diffusers")
    from diffusers.models.attention_processor import AttnProcessor

    spec = _spec(name)
    ir = capture(spec)
    assert ir.num_params == sum(p.numel() for p in instantiate(spec, "meta").parameters())
    assert (ir.seq_len, ir.token_inputs) == (tokens, False)
    model = spec.factory().eval()
    for module in model.modules():
        if hasattr(module, "set_processor"):
            module.set_processor(AttnProcessor())
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*spec.module.example_inputs(1, 0)[0])
    captured = sum(layer.flops_matmul + layer.flops_attention for layer in ir.layers)
    assert captured == pytest.approx(counter.get_total_flops(), rel=0.01)


@functools.cache
def _captured(name: str):
    spec = _spec(name)
    return spec, capture(spec, seq_len=16)


def _fp32_plan(name: str, dp: int, tp: int, pp: int, zero: int = 0):
    spec, ir = _captured(name)
    pins = dict(tp=tp, pp=pp, dp=dp, micro_batch=1, vpp=1, recompute="none", sequence_parallel=False, zero=zero)
    plan = make_plan(spec, ir, PlanRequest(num_gpus=dp * tp * pp, global_batch=4, **pins)).plan
    return dataclasses.replace(plan, training=dataclasses.replace(plan.training, dtype="fp32"))


def _losses(_rank: int, runs: list) -> list[list[float]]:
    from mlm.runtime.train import train

    return [[r.loss for r in train(plan, opts).records] for plan, opts in runs]


def test_models_fed_by_example_inputs_train_what_one_process_trains() -> None:
    """mlm-run on mlm-plan's plans, 3 AdamW steps, against one process: a ViT whose class token and position
    table are root parameters (held by both pipeline stages, their gradients summed) at tp2 and pp2; HF ViT
    at pp2 (its root reads the patch projection's dtype on the stage that does not hold it); a U-Net for
    segmentation at dp2; T5 (its `shared` embedding is called as encoder.embed_tokens, and ties to the
    vocabulary-parallel copies under tp) at tp2, and at pp2·dp2 below; Whisper at tp2; ConvNeXt at pp2 (its
    permuted activation and its gradient are sent with row-major strides, as gloo needs); Swin at tp2 (per-stage
    heads; its position bias spans them); the U-Net and Whisper at pp2, their skip connections and encoder output
    carried across the stage boundary; diffusers' conditional U-Net at tp2 and a DiT at dp2."""
    from test_runtime_harness import run_workers

    from mlm.runtime.train import RunOptions

    adamw = RunOptions(steps=3, optimizer="adamw", lr=0.01, seed=0, max_grad_norm=0.5)
    cases = [
        ("tiny_vit.py", 1, 2, 1),
        ("tiny_vit.py", 1, 1, 2),
        ("hf_vit.py", 1, 1, 2),
        ("unet_segmentation.py", 2, 1, 1),
        ("hf_t5.py", 1, 2, 1),  # attention replicated (its position bias spans every head), the MLP split
        ("hf_whisper.py", 1, 2, 1),  # speech encoder-decoder: fixed-length features, decoder ids of seq_len
        ("hf_convnext.py", 1, 1, 2),  # a channels-last activation crosses the stage boundary
        ("hf_swin.py", 1, 2, 1),  # window attention with a per-head position bias stays replicated
        ("unet_segmentation.py", 1, 1, 2),  # skip connections carried across the stage boundary
        ("hf_whisper.py", 1, 1, 2),  # a decoder stage that starts at its embedding: it receives only carried ones
    ]
    try:
        import diffusers  # noqa: F401

        cases += [("hf_diffusers_unet.py", 1, 2, 1), ("hf_diffusers_dit.py", 2, 1, 1)]
    except ImportError:
        pass
    reference = run_workers(1, _losses, [(_fp32_plan(name, 1, 1, 1), adamw) for name, *_ in cases])[0]
    split = run_workers(2, _losses, [(_fp32_plan(name, *layout), adamw) for name, *layout in cases])[0]
    for case, want, got in zip(cases, reference, split, strict=True):
        assert len(got) == 3 and got == pytest.approx(want, abs=2e-5), case


def test_t5_pipeline_by_data_parallel_under_zero_keeps_its_tied_embedding_in_one_group() -> None:
    """T5's embedding is one tensor under four names (shared, encoder / decoder embed_tokens, lm_head): on the
    decoder's stage FSDP2 refused lm_head as its own group while the root group held `shared` ("shared with a
    parameter already managed by another FSDP group"). pp2·dp2 ZeRO-1 and pp4, 4 processes, against one process
    (T5's dropout 0.1 on)."""
    from test_runtime_harness import run_workers

    from mlm.runtime.train import RunOptions

    adamw = RunOptions(steps=3, optimizer="adamw", lr=0.01, seed=0, max_grad_norm=0.5)
    want = run_workers(1, _losses, [(_fp32_plan("hf_t5.py", 1, 1, 1), adamw)])[0][0]
    got = run_workers(4, _losses, [(_fp32_plan("hf_t5.py", 2, 1, 2, zero=1), adamw)])[0][0]
    assert got == pytest.approx(want, abs=2e-5)
    # pp4, one block per stage: decoder block 1 reads the cross-attention bias decoder block 0 returns (its mask,
    # no grad), which the boundary now sends (mlm-run refused the plan before: "skips over a stage boundary")
    got = run_workers(4, _losses, [(_fp32_plan("hf_t5.py", 1, 1, 4), adamw)])[0][0]
    assert got == pytest.approx(want, abs=2e-5)


def test_a_boundary_value_without_grad_needs_torch_2_13(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sending T5's cross-attention bias (no grad) across a boundary relies on PipelineStage sending no gradient back
    for it, which torch 2.13 does (the pp4 parity above); on an older torch mlm-run refuses such a plan in one line
    naming the stage, and accepts the plans whose boundaries carry only tensors with grad."""
    from mlm.planner.errors import PlanFileError
    from mlm.runtime import stages
    from mlm.runtime.model_build import load_checked_spec, record_layer_calls

    monkeypatch.setattr(stages, "_torch_version", lambda: (2, 11))
    pp4, pp2 = _fp32_plan("hf_t5.py", 1, 1, 4), _fp32_plan("hf_t5.py", 1, 1, 2)
    with pytest.raises(PlanFileError, match=r"stages\[3\] receives a value without grad .* torch >= 2.13"):
        stages.check_stage_boundaries(pp4, record_layer_calls(load_checked_spec(pp4), pp4, 1))
    stages.check_stage_boundaries(pp2, record_layer_calls(load_checked_spec(pp2), pp2, 1))


def test_example_batches_are_one_device_rows_split_over_data_parallel_ranks() -> None:
    from mlm.runtime.data import ExampleSource

    source = ExampleSource(_spec("tiny_vit.py").example_inputs, seq_len=8, global_batch=4, seed=3)
    source.check()
    whole = source.batch(5, 0, 1, torch.device("cpu"))
    halves = [source.batch(5, r, 2, torch.device("cpu")) for r in range(2)]
    for i in range(2):  # inputs, targets
        assert torch.equal(torch.cat([h[i] for h in halves]), whole[i])
    assert torch.equal(source.batch(5, 0, 1, torch.device("cpu"))[0], whole[0])  # same (seed, step): same rows
    assert not torch.equal(source.batch(6, 0, 1, torch.device("cpu"))[0], whole[0])


def test_example_inputs_without_the_batch_first_and_data_files_are_refused_in_one_line(tmp_path) -> None:
    from mlm.runtime.data import DataError, ExampleSource, data_source

    def shared_mask(batch_size: int, seq_len: int):
        return (torch.zeros(batch_size, seq_len), torch.ones(seq_len, seq_len)), torch.zeros(batch_size)

    with pytest.raises(DataError, match=r"shape \(8, 8\).*first dimension"):
        ExampleSource(shared_mask, seq_len=8, global_batch=4, seed=0).check()
    plan = _fp32_plan("tiny_vit.py", 1, 1, 1)
    data = tmp_path / "tokens.bin"
    data.write_bytes(bytes(64))
    with pytest.raises(DataError, match="defines example_inputs"):
        data_source(plan, _spec("tiny_vit.py"), 0, data, "uint16")


@pytest.mark.parametrize(
    ("name", "reader", "source"),
    [
        ("skip_over_stages.py", "blocks.", "emb"),  # root-level residual from the embedding to the head
        ("unet_segmentation.py", "up.", "down."),  # the U-Net's skip connections
        ("hf_t5.py", "decoder.block.", "encoder."),  # cross-attention reads the encoder's output
    ],
)
def test_connections_that_skip_over_blocks_are_found_and_priced(name: str, reader: str, source: str) -> None:
    """Capture finds the connection in the graph and the bytes it carries across a block boundary; a pipeline plan
    prices them beside the boundary's activation (mlm-run carries them: the pp 2 runs above and
    tests/test_runtime_stages.py)."""
    from mlm.planner.cost.collective_counts import pipeline_boundary_bytes
    from mlm.planner.cost.inputs import summarize

    spec = _spec(name)
    ir = capture(spec, seq_len=16)
    assert any(s.startswith(reader) and f"the output of {source}" in s for s in ir.pipeline_skips), ir.pipeline_skips
    assert ir.carried_bytes > 0 and any("pipeline stages carry them" in w for w in ir.warnings)
    plan = make_plan(spec, ir, PlanRequest(num_gpus=4, global_batch=8, pp=2, vpp=1, micro_batch=1)).plan
    inputs = summarize(ir)
    # per sample the block's output and what is carried beside it; once per micro-batch what no sample sizes (T5's
    # position bias, LayerIR.output_fixed_bytes)
    per_sample = inputs.block.output_bytes + ir.carried_bytes
    want = plan.layout.micro_batch * per_sample + inputs.block.output_fixed_bytes
    assert pipeline_boundary_bytes(inputs, plan.layout) == want


def test_models_without_such_connections_keep_pipeline_stages() -> None:
    for name in ("hf_vit.py", "tiny_vit.py", "hf_gpt2.py"):
        ir = capture(_spec(name), seq_len=16)
        assert (ir.pipeline_skips, ir.reused_modules) == ((), ()), name


def test_a_block_module_called_outside_its_block_rules_out_zero3_and_pipeline_stages() -> None:
    """The DiT's head calls transformer_blocks[0].norm1.emb after the blocks: under ZeRO-3 that call would meet
    the block's sharded weights (FSDP gathers them around the block's own forward; the dry run failed on it)."""
    pytest.importorskip("diffusers")
    from mlm.planner.errors import Infeasible

    spec = _spec("hf_diffusers_dit.py")
    ir = capture(spec)
    assert ir.reused_modules == ("transformer_blocks.0.norm1.emb of transformer_blocks.0",)
    assert any("called outside that block" in w for w in ir.warnings)
    with pytest.raises(Infeasible, match="outside that block"):
        make_plan(spec, ir, PlanRequest(num_gpus=4, global_batch=8, dp=4, zero=3))
    with pytest.raises(Infeasible, match="a pipeline stage holds only its own blocks' modules"):
        make_plan(spec, ir, PlanRequest(num_gpus=4, global_batch=8, pp=2))


def test_root_parameters_are_found_and_interleaving_them_under_data_parallelism_is_not_planned() -> None:
    """A ViT's class token and position table live on the root module: every stage holds them (pp 2 ran above);
    two stages of one rank under a data-parallel wrapper would hold two wrapped copies, which mlm-run does not
    keep equal (it failed there), so such a layout is not planned."""
    from mlm.planner.errors import Infeasible

    spec = load_model_spec(str(MODELS / "tiny_vit.py"), None, {"depth": 4})
    ir = capture(spec, seq_len=16)
    assert ir.root_params == ("cls", "pos")
    assert sum(layer.params for layer in ir.layers) == ir.num_params  # they are priced, with the layer reading them
    pins = dict(tp=1, pp=2, vpp=2, micro_batch=1)
    with pytest.raises(Infeasible, match="cls lies outside every layer"):
        make_plan(spec, ir, PlanRequest(num_gpus=4, global_batch=8, dp=2, **pins))
    assert make_plan(spec, ir, PlanRequest(num_gpus=2, global_batch=8, dp=1, **pins)).plan.layout.vpp == 2


def test_context_parallelism_is_not_planned_for_cross_or_unrecognised_masked_attention() -> None:
    """T5 (a relative-position bias built for the whole sequence, cross-attention) failed under mlm-run at cp 2
    ("The size of tensor a (16) must match the size of tensor b (8)"); such attention is named and cp refused."""
    from mlm.planner.errors import Infeasible

    spec = _spec("hf_t5.py")
    ir = capture(spec, seq_len=16)
    with pytest.raises(Infeasible, match="attention, which mlm-run's context parallelism cannot split"):
        make_plan(spec, ir, PlanRequest(num_gpus=2, global_batch=4, cp=2))


@pytest.mark.parametrize("name", ["hf_whisper.py", "hf_t5.py"])
def test_every_layer_of_an_encoder_decoder_is_on_one_stage(name: str) -> None:
    """plan.json's stages hold every layer once, in order, whatever the stage MILP assigns: the layers between
    the encoder and decoder stacks (a final norm, the decoder's embeddings) run with the block before them, as the
    cost model prices them. Whisper at pp2 lost its decoder layers before (the MILP's block counts were applied to
    a list that also held those layers) and mlm-run refused the plan."""
    spec, ir = _captured(name)
    for pp in (2, 4):
        request = PlanRequest(num_gpus=pp, global_batch=8, pp=pp, tp=1, dp=1, vpp=1)
        plan = make_plan(spec, ir, request).plan
        placed = [layer for stage in plan.stages for layer in stage.layers]
        assert placed == [layer.name for layer in ir.layers], (name, pp)
