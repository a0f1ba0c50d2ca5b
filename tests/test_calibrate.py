"""mlm-calibrate: the refit recovers a known compute factor from logs the cost model writes, the profile it writes
loads and re-prices the runs at their measured times, bad logs fail with one line, and a real `mlm-run --log`
writes every field the refit reads."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlm.cli.calibrate import main as calibrate_main
from mlm.cli.plan import main as plan_main
from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.cost.fit import profile_fingerprint, read_runs
from mlm.planner.cost.hardware import GPUProfile, load_gpu, resolve, to_toml
from mlm.planner.cost.step_time import CostOptions, evaluate, summarize
from mlm.planner.layout import Layout

# The synthetic world has no dp overlap: the refit takes communication as priced, and an exposed dp term that
# hides under compute (mlm-run's DDP/FSDP overlap) shrinks when compute slows, which one compute factor cannot say.
NO_OVERLAP = CostOptions(dp_overlap=0.0)
TINY = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 1024}
LAYOUTS = [  # 8 GPUs, global batch 32: the families mlm-run runs
    Layout(dp=8, micro_batch=2, num_microbatches=2),
    Layout(tp=2, dp=4, micro_batch=2, num_microbatches=4),
    Layout(pp=2, dp=4, micro_batch=1, num_microbatches=8),
    Layout(pp=2, dp=4, vpp=2, micro_batch=1, num_microbatches=8),
    Layout(tp=2, dp=4, micro_batch=4, num_microbatches=2, recompute="full"),
    Layout(dp=8, micro_batch=4, num_microbatches=1, zero=1),
    Layout(dp=8, micro_batch=2, num_microbatches=2, zero=3),
]


@pytest.fixture(scope="module")
def inputs():
    return summarize(capture(load_model_spec("gpt2", args=TINY), seq_len=256))


@pytest.fixture(scope="module")
def hw():
    gpu, cluster = resolve("a100-80gb", None)
    assert gpu.calibration is not None  # the calibrated path: curves = prior x compute_factor
    return gpu, cluster


def slower(gpu: GPUProfile, factor: float) -> GPUProfile:
    """The 'true' machine: every efficiency of the profile as it stands times `factor` (< 1, so nothing clamps)."""
    return replace(
        gpu,
        gemm_curve=replace(gpu.gemm_curve, fractions=tuple(x * factor for x in gpu.gemm_curve.fractions)),
        attention_curve=replace(
            gpu.attention_curve, fractions=tuple(x * factor for x in gpu.attention_curve.fractions)
        ),
        memory_bound_efficiency=gpu.memory_bound_efficiency * factor,
    )


def write_log(path: Path, layout: Layout, gpu: GPUProfile, predicted, measured: list[float]) -> None:
    """A log as mlm-run --log writes it (the fields the refit reads, and a few it does not)."""
    with path.open("w") as f:
        for i, t in enumerate(measured, 1):
            rec = {
                "step": i,
                "loss": 5.0,
                "step_time_s": t,
                "predicted_step_time_s": predicted.step_time_s,
                "skipped": False,
                "layout": dataclasses.asdict(layout),
                "gpu_profile": gpu.name,
                "gpu_profile_sha256": profile_fingerprint(gpu.to_dict()),
                "predicted_breakdown": predicted.breakdown,
                "predicted_peak_memory_bytes": predicted.peak_memory_bytes,
                "peak_memory_bytes": None,
            }
            f.write(json.dumps(rec) + "\n")


def synth_logs(tmp: Path, inputs, gpu, cluster, factor: float, layouts=LAYOUTS) -> list[Path]:
    """One log per layout: predicted with `gpu`, 'measured' by the cost model on slower(gpu, factor), the first
    step a 10x slower warm-up (which the refit must skip)."""
    true = slower(gpu, factor)
    paths = []
    for i, lo in enumerate(layouts):
        pred = evaluate(inputs, lo, gpu, cluster, options=NO_OVERLAP)
        meas = evaluate(inputs, lo, true, cluster, options=NO_OVERLAP).step_time_s
        path = tmp / f"run{i}.jsonl"
        write_log(path, lo, gpu, pred, [10 * meas, meas, meas * 1.001, meas * 0.999])
        paths.append(path)
    return paths


@settings(max_examples=6, deadline=None)
@given(factor=st.floats(0.3, 0.95))
def test_refit_recovers_the_factor_and_reprices_at_measured(tmp_path_factory, inputs, hw, factor):
    """Property: whatever factor the 'machine' has, the refit finds it, and the profile it writes (loaded as
    mlm-plan loads a --gpu file) predicts each run's measured step time."""
    gpu, cluster = hw
    tmp = tmp_path_factory.mktemp("fit")
    logs = synth_logs(tmp, inputs, gpu, cluster, factor)
    out = tmp / "refit.toml"
    assert calibrate_main([*map(str, logs), "--gpu", gpu.name, "--out", str(out)]) == 0
    new, new_cluster = resolve(str(out), None)
    assert new_cluster == cluster  # its default cluster still resolves
    cal = new.calibration
    assert cal is not None and cal.status == "fitted" and cal.train_rows == 3 * len(LAYOUTS)
    assert cal.sources == tuple(map(str, logs))
    # the written factor is the old one times the machine's (the exposed dp and bubble terms make it approximate)
    assert cal.compute_factor == pytest.approx(gpu.calibration.compute_factor * factor, rel=0.02)
    for lo in LAYOUTS:
        measured = evaluate(inputs, lo, slower(gpu, factor), cluster, options=NO_OVERLAP).step_time_s
        assert evaluate(inputs, lo, new, cluster, options=NO_OVERLAP).step_time_s == pytest.approx(
            measured, rel=0.03
        ), lo.describe()


def test_uncalibrated_profile_gets_a_calibration_table(tmp_path, inputs, hw):
    """A measured profile (mlm-profile's, no [calibration]) is refitted on its own curves; a relative
    default_cluster is rewritten to resolve from the new file's folder."""
    a100, cluster = hw
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "c.toml").write_text(to_toml(cluster))
    gpu = replace(a100, name="measured", calibration=None, default_cluster="c.toml")
    (tmp_path / "m" / "g.toml").write_text(to_toml(gpu))
    logs = synth_logs(tmp_path, inputs, gpu, cluster, 0.5, LAYOUTS[:3])
    out = tmp_path / "elsewhere" / "g2.toml"
    out.parent.mkdir()
    assert calibrate_main([*map(str, logs), "--gpu", str(tmp_path / "m" / "g.toml"), "--out", str(out)]) == 0
    new, new_cluster = resolve(str(out), None)
    assert new_cluster == cluster
    assert new.calibration.prior_gemm_fractions == gpu.gemm_curve.fractions
    assert new.calibration.compute_factor == pytest.approx(0.5, rel=0.02)
    assert new.memory_bound_efficiency == pytest.approx(0.5 * gpu.memory_bound_efficiency, rel=0.02)


def test_warmup_is_skipped_and_appended_runs_are_split(tmp_path, inputs, hw):
    gpu, cluster = hw
    (log,) = synth_logs(tmp_path, inputs, gpu, cluster, 0.7, LAYOUTS[:1])
    text = log.read_text()
    log.write_text(text + text)  # a second run appended to the same file
    runs = read_runs(log, warmup=1)
    assert [r.source for r in runs] == ["run0.jsonl#1", "run0.jsonl#2"]
    assert all(len(r.measured_s) == 3 and max(r.measured_s) < 2 * min(r.measured_s) for r in runs)


def _error(capsys, argv: list[str], needle: str) -> None:
    assert calibrate_main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err


def test_bad_logs_fail_with_one_clear_line(tmp_path, capsys, inputs, hw):
    gpu, cluster = hw
    (log,) = synth_logs(tmp_path, inputs, gpu, cluster, 0.7, LAYOUTS[:1])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _error(capsys, [str(empty), "--gpu", gpu.name], "empty log")
    _error(capsys, [str(tmp_path / "none.jsonl"), "--gpu", gpu.name], "cannot read")
    _error(capsys, [str(log), "--gpu", "h100-sxm"], "planned for GPU profile 'a100-80gb', not 'h100-sxm'")
    other = tmp_path / "a100-80gb-edited.toml"
    other.write_text(to_toml(replace(gpu, hbm_gbps=gpu.hbm_gbps * 1.1, default_cluster="dgx-a100")))
    _error(capsys, [str(log), "--gpu", str(other)], "another 'a100-80gb' profile")
    _error(capsys, [str(log), "--gpu", gpu.name, "--warmup", "4"], "all warm-up")
    old = tmp_path / "old.jsonl"  # a log from before --log carried the plan's fields
    old.write_text(json.dumps({"step": 1, "step_time_s": 0.1, "predicted_step_time_s": None}) + "\n")
    _error(capsys, [str(old), "--gpu", gpu.name], "no predicted_step_time_s, gpu_profile, layout")
    junk = tmp_path / "junk.jsonl"
    junk.write_text("{not json\n")
    _error(capsys, [str(junk), "--gpu", gpu.name], "not a JSON line")


def test_real_mlm_run_log_has_every_field_the_refit_reads(tmp_path, monkeypatch):
    """A 1-process CPU mlm-run of a tiny gpt2 plan: every line holds numbers where the refit needs them, and
    mlm-calibrate accepts the log for the profile the plan was priced with."""
    monkeypatch.setenv("MLM_CACHE_DIR", str(tmp_path / "cache"))
    plan, log = tmp_path / "plan.json", tmp_path / "run.jsonl"
    margs = [a for k, v in {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512}.items()
             for a in ("--model-arg", f"{k}={v}")]  # fmt: skip
    pins = ["--tp", "1", "--pp", "1", "--dp", "1", "--vpp", "1", "--recompute", "none", "--zero", "0"]
    argv = ["gpt2", *margs, "--seq-len", "64", "--gpus", "1", "--global-batch", "4", "--micro-batch", "2", *pins]
    assert plan_main([*argv, "--no-sequence-parallel", "--out", str(plan)]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "mlm.cli.run", str(plan), "--steps", "3", "--device", "cpu", "--log", str(log)]
    proc = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    layout_keys = {f.name for f in dataclasses.fields(Layout)}
    for r in recs:
        for key in ("step_time_s", "predicted_step_time_s", "predicted_peak_memory_bytes", "loss", "tokens_per_s"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, key
        assert set(r["layout"]) == layout_keys and r["world_size"] == 1
        assert r["gpu_profile"] == "a100-80gb"
        assert r["gpu_profile_sha256"] == profile_fingerprint(load_gpu("a100-80gb").to_dict())
        bd = r["predicted_breakdown"]
        assert {"compute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "bubble_s", "optimizer_s"} <= set(bd)
        assert sum(bd.values()) == pytest.approx(r["predicted_step_time_s"], rel=1e-6)
        assert r["peak_memory_bytes"] is None  # CPU: no allocator statistics
    out = tmp_path / "cpu-refit.toml"
    assert calibrate_main([str(log), "--gpu", "a100-80gb", "--out", str(out)]) == 0
    assert load_gpu(str(out)).calibration.train_rows == 2


def test_fit_does_not_import_torch():
    code = "import sys, mlm.planner.cost.fit; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
