"""Attention priced by the work its kernel executes when the model runs: a causal call (is_causal, no mask) lets the
flash and memory-efficient kernels skip the blocks above the diagonal, half the counted FLOPs; a sliding-window
mask, a mask tensor with the causal pattern (a model that builds its own mask) or a bidirectional call computes
every (query, key) block, priced so, with a warning for the masks. (Hugging Face decoders build such a mask only
while traced; capture traces them on the path they run, hf_positions.py, where they pass is_causal.) The model
FLOPs (what MFU counts) are the same every way."""

from __future__ import annotations

import pytest
from conftest import MODELS

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.hardware import load_cluster, load_gpu
from mlm.planner.cost.inputs import summarize
from mlm.planner.cost.step_time import evaluate
from mlm.planner.layout import Layout

SEQ = 256


def _ir(call: str):
    return capture(load_model_spec(str(MODELS / "attention_calls.py"), args={"call": call}), seq_len=SEQ)


@pytest.fixture(scope="module")
def irs():
    return {call: _ir(call) for call in ("causal", "mask", "window", "full")}


def test_every_call_counts_the_same_model_flops_and_flags_full_work(irs) -> None:
    blocks = {call: [layer for layer in ir.layers if layer.flops_attention] for call, ir in irs.items()}
    counted = {call: [layer.flops_attention for layer in b] for call, b in blocks.items()}
    assert counted["causal"] == counted["mask"] == counted["window"] == counted["full"] and len(counted["causal"]) == 2
    assert [layer.flops_attention_full for layer in blocks["causal"]] == [0.0, 0.0]
    for call in ("mask", "window", "full"):
        assert [layer.flops_attention_full for layer in blocks[call]] == counted[call]


def test_a_kernel_that_computes_every_block_is_priced_above_the_causal_one(irs) -> None:
    gpu, cluster = load_gpu("h100-sxm"), load_cluster("dgx-h100")
    layout = Layout(micro_batch=4, num_microbatches=2)
    step = {call: evaluate(summarize(ir), layout, gpu, cluster) for call, ir in irs.items()}
    assert step["full"].breakdown["compute_s"] > step["causal"].breakdown["compute_s"]
    assert step["window"].breakdown["compute_s"] > step["causal"].breakdown["compute_s"]
    assert step["mask"].breakdown["compute_s"] >= step["full"].breakdown["compute_s"]  # and it builds the mask
    # the model FLOPs per GPU, what MFU counts, do not depend on the kernel: throughput in them falls as time grows
    for call in ("full", "mask", "window"):
        achieved = step[call].model_tflops_per_gpu * step[call].step_time_s
        assert achieved == pytest.approx(step["causal"].model_tflops_per_gpu * step["causal"].step_time_s)


def test_masks_are_named_in_warnings(irs) -> None:
    """The causal-pattern mask and the sliding window are said to be priced as full work, the first with the way to
    halve it; the causal call and the bidirectional one (nothing to say) get neither warning."""
    said = {call: [w for w in ir.warnings if "mask" in w] for call, ir in irs.items()}
    assert said["causal"] == [] and said["full"] == []
    assert len(said["mask"]) == 1 and "blocks.0" in said["mask"][0] and "causal pattern" in said["mask"][0]
    assert "every (query, key) block" in said["mask"][0] and "is_causal=True" in said["mask"][0]
    assert len(said["window"]) == 1 and "sliding-window" in said["window"][0]
