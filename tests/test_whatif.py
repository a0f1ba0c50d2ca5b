"""Pure parts of mlm-whatif: time/cost arithmetic, Eq. 4, sweep parsing, the integer searches, model scaling."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlm.planner.errors import PlanError
from mlm.planner.whatif.arithmetic import (
    eq4_seconds,
    parse_count,
    parse_sweep,
    required_tokens_per_s,
    resolve_price,
    training_time,
)
from mlm.planner.whatif.integer_search import largest_fitting, smallest_count_for_rate
from mlm.planner.whatif.scale import FAMILIES, Base, find_family, knob_range, scaled_args

DAY = 86400.0


def test_training_time_counts_whole_steps_and_costs() -> None:
    t = training_time(tokens=10_000, global_batch=4, seq_len=1000, step_time_s=2.0, num_gpus=16, usd_per_gpu_hour=3.0)
    assert (t.tokens_per_step, t.steps, t.seconds) == (4000, 3, 6.0)
    assert t.gpu_hours == pytest.approx(16 * 6.0 / 3600)
    assert t.cost_usd == pytest.approx(t.gpu_hours * 3.0)
    assert training_time(8000, 4, 1000, 2.0, 16).cost_usd is None


def test_eq4_reproduces_the_papers_two_estimates() -> None:
    """Narayanan et al. 2021 Sec. 5.1: GPT-3 ≈ 34 days, 1T ≈ 84 days (X = 140 and 163 TFLOP/s)."""
    assert eq4_seconds(300e9, 175e9, 1024, 140) / DAY == pytest.approx(34, abs=0.5)
    assert eq4_seconds(450e9, 1e12, 3072, 163) / DAY == pytest.approx(84, abs=1.0)
    # mlm's model-FLOP accounting (6 per parameter and token) at the same hardware rate: 3/4 of the time
    assert eq4_seconds(300e9, 175e9, 1024, 140, 6.0) == pytest.approx(0.75 * eq4_seconds(300e9, 175e9, 1024, 140))


def test_required_rate_and_bad_inputs() -> None:
    assert required_tokens_per_s(86400e3, 1.0) == pytest.approx(1e3)
    for tokens, days in ((0, 1), (1e9, 0), (1e9, -2), (float("nan"), 1)):
        with pytest.raises(PlanError):
            required_tokens_per_s(tokens, days)


def test_price_sources() -> None:
    assert resolve_price("h100-sxm", 2.99, None).usd_per_gpu_hour == 2.99
    user = resolve_price("h100-sxm", 2.99, 1.5)
    assert (user.usd_per_gpu_hour, user.source) == (1.5, "--usd-per-gpu-hour")
    assert resolve_price("mine", 0.0, None).usd_per_gpu_hour is None
    with pytest.raises(PlanError):
        resolve_price("x", 1.0, -1.0)


def test_parse_sweep_and_counts() -> None:
    assert parse_sweep("gpus=64,128,128,256").values == (64, 128, 256)
    assert parse_sweep("global-batch=512, 1024").key == "global_batch"
    assert parse_sweep("gpu=a100-80gb,h100-sxm").values == ("a100-80gb", "h100-sxm")
    for bad in ("tp=1,2", "gpus=", "gpus=8,x", "gpus=0", "gpus"):
        with pytest.raises(PlanError):
            parse_sweep(bad)
    assert parse_count("300e9") == 300e9 and parse_count("450B") == 450e9 and parse_count("15T") == 15e12
    with pytest.raises(PlanError):
        parse_count("lots")


# ---- deadline search -------------------------------------------------------------------------------------------


def _brute(rate, required: float, node: int, max_gpus: int) -> int | None:
    for n in [node] + list(range(2 * node, max_gpus + 1, node)):
        r = rate(n)
        if r is not None and r >= required:
            return n
    return None


def test_deadline_finds_a_count_that_bisection_alone_misses() -> None:
    """Throughput dips at counts whose data-parallel size does not divide the batch (here: odd node counts)."""

    def rate(n: int) -> float | None:
        nodes = n // 8
        return None if n < 16 else n * (100.0 if nodes % 2 == 0 else 60.0)

    calls: list[int] = []
    found = smallest_count_for_rate(
        lambda n: (calls.append(n), rate(n))[1], required=100.0 * 8 * 37, node=8, max_gpus=4096, global_batch=512
    )
    assert found.num_gpus == _brute(rate, 100.0 * 8 * 37, 8, 4096) == 8 * 38
    assert len(calls) == len(set(calls)), "each count is evaluated once"
    assert len(calls) < 30


def test_deadline_reports_none_within_the_bound() -> None:
    found = smallest_count_for_rate(lambda n: n * 1.0, required=1e9, node=8, max_gpus=1024, global_batch=64)
    assert found.num_gpus is None and max(found.evaluated) <= 1024
    assert found.best_seen == (1024, 1024.0)


@settings(max_examples=60, deadline=None)
@given(
    per_gpu=st.lists(st.floats(50, 100), min_size=64, max_size=64),
    target_nodes=st.integers(1, 60),
    first_fit=st.integers(1, 4),
)
def test_deadline_matches_brute_force_when_per_gpu_rate_only_falls(
    per_gpu: list[float], target_nodes: int, first_fit: int
) -> None:
    """With per-GPU throughput non-increasing in N (the usual case), the answer is the exact minimum."""
    per = sorted(per_gpu, reverse=True)

    def rate(n: int) -> float | None:
        k = n // 8
        return None if k < first_fit or k > 64 else n * per[k - 1]

    required = 8 * target_nodes * per[target_nodes - 1] * 0.999
    found = smallest_count_for_rate(rate, required, 8, 512, global_batch=1024, scan_limit=64)
    assert found.num_gpus == _brute(rate, required, 8, 512)


# ---- largest model -------------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(threshold=st.integers(0, 3000), start=st.integers(1, 200))
def test_largest_fitting_matches_brute_force(threshold: int, start: int) -> None:
    k_max = 2048
    result = largest_fitting(lambda k: k <= threshold, start, 1, k_max)
    expected = min(threshold, k_max) if threshold >= 1 else None
    assert result.largest == expected
    assert len(result.tried) <= 2 * math.ceil(math.log2(k_max)) + 2
    if expected is not None and expected < k_max:
        assert result.first_failure == expected + 1


# ---- model scaling ---------------------------------------------------------------------------------------------


def _gpt_base() -> Base:
    args = dict(n_layer=96, n_head=96, n_embd=12288, vocab_size=51200, block_size=2048)
    return Base(find_family(args), 96, 96, 12288, args)


def test_gpt_scaling_keeps_head_dim_and_tp_friendly_heads() -> None:
    base = _gpt_base()
    k0, _, _ = knob_range(base, "both")
    assert scaled_args(base, "both", k0) == base.args  # the base model is a point of its own family
    grown = scaled_args(base, "both", 20)
    assert grown["n_head"] == 160 and grown["n_embd"] == 160 * 128 and grown["n_layer"] == 160
    assert scaled_args(base, "hidden", 20)["n_layer"] == 96
    assert scaled_args(base, "layers", 128) == {**base.args, "n_layer": 128}
    for k in range(1, 40):
        assert scaled_args(base, "hidden", k)["n_head"] % 8 == 0


def test_llama_scaling_keeps_ffn_ratio_and_kv_heads() -> None:
    args = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336)
    base = Base(find_family(args), 32, 32, 4096, args)
    assert base.family is FAMILIES[1]
    big = scaled_args(base, "both", 8)  # 64 heads
    assert big["dim"] == 8192 and big["n_layers"] == 64 and big["n_kv_heads"] == 8
    assert big["ffn_dim"] == 28672  # 3.5 x dim, as Llama 3 70B
    assert big["ffn_dim"] % 256 == 0


def test_unknown_family_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match="--model-arg"):
        find_family({"width": 3})
