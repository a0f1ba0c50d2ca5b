"""Calibration as code: re-run benchmarks/fit_profiles.py's fit on the committed measurements and check that each
GPU profile says what the fit gives (its factor, its curves, its held-out error per source). Fails when data,
cost model or profile change without a refit (python benchmarks/fit_profiles.py --write)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlm.planner.cost.calibration import FACTOR_STEP, fit_gpu, measurement_files, read_measurements, sources_sha256
from mlm.planner.cost.hardware import list_gpus, load_gpu
from mlm.planner.cost.kernels import forward_backward_fractions, read_kernel_table

FITTED = [g for g in list_gpus() if (c := load_gpu(g).calibration) is not None and c.status == "fitted"]


@pytest.fixture(scope="module")
def fits():
    return {g: fit_gpu(load_gpu(g)) for g in FITTED}


def test_every_row_is_cited_and_split_and_every_source_holds_rows_out():
    for path in measurement_files():
        rows = read_measurements(path)
        assert rows, path
        assert all(m.source.strip() and m.split in ("train", "test") for m in rows), path
        assert any(m.split == "test" for m in rows), f"{path.name}: no held-out rows"
        for m in rows:
            assert m.gpus % (m.tp * m.pp * m.cp) == 0 and m.global_batch % m.dp == 0, (path.name, m.name)
            assert (m.dp * m.cp) % m.ep == 0 and (m.ep == 1 or m.experts > 0), (path.name, m.name)
            assert m.published_step_s() > 0


def test_every_profile_states_its_calibration():
    for g in list_gpus():
        cal = load_gpu(g).calibration
        assert cal is not None, f"{g}: no [calibration] table"
        if cal.status == "transferred":
            origin = load_gpu(cal.transferred_from).calibration
            assert origin is not None and origin.status == "fitted"
            assert cal.compute_factor == origin.compute_factor and cal.test_sources == origin.test_sources
            assert cal.test_mean_error_pct == origin.test_mean_error_pct
        if cal.status == "prior":
            assert cal.compute_factor == 1.0 and not cal.test_sources


@pytest.mark.parametrize("name", list_gpus())
def test_curves_are_the_prior_times_the_factor(name):
    gpu = load_gpu(name)
    cal = gpu.calibration
    assert cal is not None
    fused = gpu.fused_attention_curve
    for got, prior in ((gpu.gemm_curve.fractions, cal.prior_gemm_fractions),
                       (gpu.attention_curve.fractions, cal.prior_attention_fractions),
                       (fused.fractions if fused else (), cal.prior_fused_attention_fractions)):  # fmt: skip
        assert got == pytest.approx([min(1.0, p * cal.compute_factor) for p in prior], rel=1e-3)


@pytest.mark.parametrize("name", [g for g in list_gpus() if load_gpu(g).calibration.prior_attention_source])
def test_prior_attention_curves_are_derived_from_the_published_kernel_benchmark(name):
    """A profile citing a kernel benchmark holds, as its prior attention curves, forward + backward of that file's
    FlashAttention-2 (SDPA) and cuDNN rows at the curve's sequence lengths (planner/cost/kernels.py)."""
    gpu = load_gpu(name)
    cal = gpu.calibration
    table = read_kernel_table(Path(cal.prior_attention_source).name)
    pairs = [("flash2", gpu.attention_curve, cal.prior_attention_fractions),
             ("cudnn", gpu.fused_attention_curve, cal.prior_fused_attention_fractions)]  # fmt: skip
    for kernel, curve, prior in pairs:
        assert curve is not None and tuple(s for s, _, _ in table[kernel]) == curve.seq_lens
        assert prior == pytest.approx(forward_backward_fractions(table[kernel], gpu.bf16_tflops), abs=6e-5)
    # the published fused kernel is faster at every length, so a stack running it is never priced slower
    assert all(f > a for f, a in zip(cal.prior_fused_attention_fractions, cal.prior_attention_fractions))


@pytest.mark.parametrize("name", FITTED)
def test_refit_reproduces_the_profile(fits, name):
    """The factor is the fit's (within one grid step) and the held-out errors are the ones the file claims."""
    res, cal = fits[name], load_gpu(name).calibration
    assert res is not None and cal is not None
    assert abs(res.factor - cal.compute_factor) <= FACTOR_STEP / 2, f"{name}: refit gives {res.factor}"
    assert cal.train_rows == sum(1 for p in res.predictions if p.measurement.split == "train")
    files = sorted(dict.fromkeys(p.measurement.file for p in res.predictions))
    assert cal.sources == tuple(f"profiles/calibration/{f}" for f in files)
    assert cal.data_sha256 == sources_sha256(files), f"{name}: data changed since the fit; run fit_profiles --write"
    held = res.held_out()
    assert tuple(held) == cal.test_sources
    for src, n, mean, worst in zip(cal.test_sources, cal.test_rows, cal.test_mean_error_pct, cal.test_worst_error_pct):
        got_n, got_mean, got_worst = held[src]
        # the file holds one decimal; 0.051 leaves room for float noise at a rounding boundary, not for a change
        assert got_n == n and abs(got_mean - mean) <= 0.051 and abs(got_worst - worst) <= 0.051, (src, held[src])


@pytest.mark.parametrize("name", FITTED)
def test_a_source_s_own_factor_is_fitted_on_its_own_train_rows_only(fits, name):
    """The per-source factor sees only that source's train rows: moving every other source's rows cannot change it,
    and a source without train rows has none (its rows are held out at the profile's factor only)."""
    res = fits[name]
    rows = [m for f in measurement_files() for m in read_measurements(f) if m.gpu == name]
    for src, (_, preds) in res.own.items():
        assert any(m.file == src and m.split == "train" for m in rows)
        assert {p.measurement.file for p in preds} == {src}
    smallest = min(res.own, key=lambda src: sum(m.file == src for m in rows))  # refit one source alone (captures)
    alone = fit_gpu(load_gpu(name), [f for f in measurement_files() if f.name == smallest])
    assert alone is not None and alone.own[smallest][0] == res.own[smallest][0]
    assert all(any(m.file == f and m.split == "train" for m in rows) == (f in res.own) for f in {m.file for m in rows})


@pytest.mark.parametrize("name", FITTED)
def test_train_and_test_rows_are_disjoint_and_all_predicted(fits, name):
    res = fits[name]
    rows = [m for f in measurement_files() for m in read_measurements(f) if m.gpu == name]
    assert len(res.predictions) == len(rows)
    keys = [(p.measurement.file, p.measurement.name) for p in res.predictions]
    assert len(set(keys)) == len(keys)
    for p in res.predictions:  # the row's pinned mesh is the one evaluated
        m, lo = p.measurement, p.layout
        pinned = (lo.tp, lo.pp, lo.cp, lo.ep, lo.world_size, lo.global_batch, lo.zero)
        assert pinned == (m.tp, m.pp, m.cp, m.ep, m.gpus, m.global_batch, m.zero)
        assert lo.recompute in m.recompute and lo.sequence_parallel == m.sp
