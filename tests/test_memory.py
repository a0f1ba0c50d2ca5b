"""The memory model against Korthikanti et al. 2022 (Table 2) and the paper's GPT-3 175B layouts."""

from __future__ import annotations

import pytest

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.hardware import resolve
from mlm.planner.cost.memory import activation_bytes, bytes_per_param, state_bytes
from mlm.planner.cost.step_time import evaluate, summarize
from mlm.planner.layout import Layout

S, H, A, T = 2048, 12288, 96, 8  # GPT-3 175B: sequence, hidden, heads; tensor-parallel size


@pytest.fixture(scope="module")
def hw():
    return resolve("a100-80gb", "dgx-a100")


@pytest.fixture(scope="module")
def plain_gpt_block():
    """A plain GPT block as Korthikanti et al. count it: materialised attention, dropout 0.1."""
    return summarize(capture(load_model_spec("gpt3-175b", args=dict(attention="manual", dropout=0.1)))).block


@pytest.mark.parametrize(
    "recompute,tp,sp,formula",
    [
        ("none", 1, False, 34 + 5 * A * S / H),
        ("none", T, False, 10 + 24 / T + 5 * A * S / (H * T)),
        ("none", T, True, 34 / T + 5 * A * S / (H * T)),
        ("selective", T, False, 10 + 24 / T),
        ("selective", T, True, 34 / T),
        ("full", T, False, 2.0),
        ("full", T, True, 2.0 / T),
    ],
)
def test_activations_match_korthikanti(plain_gpt_block, recompute, tp, sp, formula):
    """Bytes per layer in units of s·b·h (b = 1), Korthikanti et al. 2022 Table 2, within 5%."""
    for mb in (1, 4):
        got = activation_bytes(plain_gpt_block, recompute, tp, sp, mb) / (S * mb * H)
        assert got == pytest.approx(formula, rel=0.05)


def test_default_sdpa_block_keeps_no_scores():
    block = summarize(capture(load_model_spec("gpt3-175b"))).block
    assert block.act_core == 0.0
    assert activation_bytes(block, "none", 1, False, 1) / (S * H) == pytest.approx(26.03 + 8.0, rel=0.01)


def test_state_bytes_mixed_precision_adam():
    assert bytes_per_param(0, 8) == 16.0
    assert bytes_per_param(1, 8) == pytest.approx(4 + 12 / 8)
    assert bytes_per_param(3, 8) == pytest.approx(16 / 8)
    s = state_bytes(1e9, 1, 4)
    assert (s.params, s.grads, s.optimizer) == (2e9, 2e9, 3e9)


@pytest.mark.parametrize("pp", [8, 12, 16])
def test_gpt3_175b_fits_80gb_as_in_the_paper(hw, pp):
    """Narayanan et al. 2021 ran GPT-3 175B at tp 8 with pp 8-16, full recompute, on 80 GB A100s."""
    gpu, cluster = hw
    inputs = summarize(capture(load_model_spec("gpt3-175b")))
    dp = 1536 // (8 * pp)
    for mb in (1, 2):
        layout = Layout(tp=8, pp=pp, dp=dp, micro_batch=mb, num_microbatches=1536 // (dp * mb), recompute="full")
        ev = evaluate(inputs, layout, gpu, cluster)
        assert ev.fits, ev.reason
        assert ev.peak_memory_bytes < 80 * 2**30
        first = ev.rank_memory[0]
        # weights + grads + Adam states: 16 bytes for each of the ~175e9/(8·pp) local parameters
        assert first.static == pytest.approx(16 * 174.6e9 / (8 * pp), rel=0.08)
    no_recompute = Layout(tp=8, pp=8, dp=24, micro_batch=4, num_microbatches=16, recompute="none")
    assert not evaluate(inputs, no_recompute, gpu, cluster).fits  # why the paper needed recompute
