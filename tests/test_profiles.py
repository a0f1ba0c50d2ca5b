"""GPU/cluster profiles: presets, strict keys, interpolation, resolve(), and an end-to-end mlm-profile --quick run."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib

from mlm.planner.cost import hardware as P
from mlm.planner.errors import PlanError

GPUS = {"a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200"}
CLUSTERS = {"dgx-a100", "dgx-h100", "dgx-h200", "dgx-b200"}


def _preset_text(folder: str, name: str) -> str:
    import importlib.resources

    return (importlib.resources.files("mlm.profiles") / folder / f"{name}.toml").read_text(encoding="utf-8")


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---- presets -----------------------------------------------------------------------------------------------------


def test_presets_are_listed_and_load() -> None:
    assert set(P.list_gpus()) == GPUS
    assert set(P.list_clusters()) == CLUSTERS
    for name in GPUS:
        g = P.load_gpu(name)
        assert g.name == name
        assert g.default_cluster in CLUSTERS
        assert g.bf16_tflops == g.fp16_tflops > g.tf32_tflops > g.fp32_tflops > 0
        assert 0 < g.memory_bound_efficiency <= 1 and g.hbm_gib > 0 and g.hbm_gbps > 0
        assert max(g.gemm_curve.fractions) < 0.9  # a prior of achievable efficiency, not 100%
    for name in CLUSTERS:
        c = P.load_cluster(name)
        assert c.name == name and c.gpu in GPUS and c.gpus_per_node == 8
        assert c.intra_node_gbps > c.inter_node_gbps > 0
        assert c.intra_node_gbps == P.load_gpu(c.gpu).nvlink_gbps


def test_datasheet_figures() -> None:
    a100 = P.load_gpu("a100-80gb")
    assert (a100.bf16_tflops, a100.fp32_tflops, a100.hbm_gbps, a100.nvlink_gbps) == (312.0, 19.5, 2039.0, 300.0)
    assert P.load_gpu("a100-40gb").hbm_gbps == 1555.0
    h100 = P.load_gpu("h100-sxm")
    assert math.isclose(h100.bf16_tflops, 989.4) and h100.hbm_gbps == 3350.0 and h100.nvlink_gbps == 450.0
    assert P.load_gpu("h200").hbm_gbps == 4800.0 and P.load_gpu("h200").hbm_gib > 130
    b200 = P.load_gpu("b200")
    assert (b200.bf16_tflops, b200.hbm_gbps, b200.nvlink_gbps) == (2250.0, 8000.0, 900.0)
    assert P.load_cluster("dgx-a100").inter_node_gbps == 25.0
    assert {P.load_cluster(c).inter_node_gbps for c in ("dgx-h100", "dgx-h200", "dgx-b200")} == {50.0}


def test_profiles_module_is_pure_and_holds_no_hardware_numbers() -> None:
    code = "import sys, mlm.planner.cost.hardware; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    source = Path(P.__file__).read_text(encoding="utf-8")
    for figure in ("312", "989", "2039", "1555", "3350", "4800", "2250"):
        assert figure not in source


def test_to_dict_and_to_toml_round_trip() -> None:
    for name in GPUS:
        g = P.load_gpu(name)
        d = json.loads(json.dumps(g.to_dict()))
        assert d["gemm_curve"]["sizes"] == list(g.gemm_curve.sizes)
        assert P.GPUProfile.from_dict(d) == g
        assert P.GPUProfile.from_dict(tomllib.loads(P.to_toml(g, {"hbm_gbps": "note"}, "a\nb"))) == g
    for name in CLUSTERS:
        c = P.load_cluster(name)
        assert P.ClusterProfile.from_dict(tomllib.loads(P.to_toml(c))) == c == P.ClusterProfile.from_dict(c.to_dict())


# ---- strict keys -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace('name = "h100-sxm"', 'name = "h100-sxm"\nbf16_tflop = 1.0'), "unknown key 'bf16_tflop'"),
        (lambda t: "\n".join(l for l in t.splitlines() if not l.startswith("hbm_gbps")), "missing key 'hbm_gbps'"),
        (lambda t: t.replace("sizes = [", "sizez = ["), "unknown key 'gemm_curve.sizez'"),
        (lambda t: t.replace("[attention_curve]\nseq_lens", "[attention_curve]\nx"), "unknown key 'attention_curve.x'"),
        (lambda t: t.replace("hbm_gib = 79.6", 'hbm_gib = "80"'), "key 'hbm_gib' must be a number"),
        (lambda t: t.replace("hbm_gib = 79.6", "hbm_gib = -1"), "key 'hbm_gib' must be > 0"),
        (lambda t: t.replace("memory_bound_efficiency = 0.80", "memory_bound_efficiency = 1.5"), "in (0, 1]"),
        (lambda t: re.sub(r"^fractions = \[", "fractions = [1.5, ", t, count=1, flags=re.M), "must be in (0, 1]"),
        (lambda t: t.replace("[128, 256, 512", "[128, 256, 128"), "must be strictly increasing"),
        (lambda t: re.sub(r"^fractions = \[[0-9.]+, ", "fractions = [", t, count=1, flags=re.M), "differ in length"),
        (lambda t: t.replace("[gemm_curve]", "gemm_curve = 3\n[gemm_curve_old]"), "unknown key 'gemm_curve_old'"),
        (lambda t: "name = 'twice'\n" + t, "invalid TOML"),
    ],
)
def test_strict_gpu_keys(tmp_path: Path, edit, message: str) -> None:
    text = edit(_preset_text("gpus", "h100-sxm"))
    path = _write(tmp_path, "bad.toml", text)
    with pytest.raises(PlanError) as err:
        P.load_gpu(str(path))
    line = str(err.value)
    assert message in line and str(path) in line and "\n" not in line


def test_strict_cluster_keys(tmp_path: Path) -> None:
    text = _preset_text("clusters", "dgx-a100")
    bad = _write(tmp_path, "extra.toml", text + "\nnic_count = 8\n")
    with pytest.raises(PlanError, match=r"extra\.toml: unknown key 'nic_count'"):
        P.load_cluster(str(bad))
    missing = _write(tmp_path, "missing.toml", text.replace("gpus_per_node = 8\n", ""))
    with pytest.raises(PlanError, match="missing key 'gpus_per_node'"):
        P.load_cluster(str(missing))
    floaty = _write(tmp_path, "floaty.toml", text.replace("gpus_per_node = 8", "gpus_per_node = 8.0"))
    with pytest.raises(PlanError, match="'gpus_per_node' must be a positive integer"):
        P.load_cluster(str(floaty))
    renamed = _write(tmp_path, "renamed.toml", text.replace('name = "dgx-a100"', 'name = "my-cluster"'))
    assert P.load_cluster(str(renamed)).name == "my-cluster"  # files may carry any name; presets may not


def test_unknown_names_and_files() -> None:
    with pytest.raises(PlanError, match="unknown GPU profile 'h300'; available: a100-40gb, a100-80gb, b200"):
        P.load_gpu("h300")
    with pytest.raises(PlanError, match="unknown cluster profile 'dgx-z'; available: dgx-a100"):
        P.load_cluster("dgx-z")
    with pytest.raises(PlanError, match="not found"):
        P.load_gpu("/nonexistent/gpu.toml")


# ---- interpolation -----------------------------------------------------------------------------------------------


def _gpu_with_curves(gemm: tuple[list[float], list[float]], attn: tuple[list[float], list[float]]) -> P.GPUProfile:
    d = P.load_gpu("a100-80gb").to_dict()
    del d["calibration"]  # curves of other lengths than the priors it holds
    d["gemm_curve"] = {"sizes": gemm[0], "fractions": gemm[1]}
    d["attention_curve"] = {"seq_lens": attn[0], "fractions": attn[1]}
    return P.GPUProfile.from_dict(d, "test")


def test_interpolation_clamps_and_is_linear_in_log_size() -> None:
    g = _gpu_with_curves(([100, 1000, 10000], [0.2, 0.6, 0.8]), ([512, 2048], [0.3, 0.5]))
    assert g.gemm_efficiency(1) == 0.2 and g.gemm_efficiency(100) == 0.2
    assert g.gemm_efficiency(1e9) == 0.8 and g.gemm_efficiency(10000) == 0.8
    assert g.gemm_efficiency(1000) == pytest.approx(0.6)
    assert g.gemm_efficiency(math.sqrt(100 * 1000)) == pytest.approx(0.4)  # log-midpoint
    assert g.gemm_efficiency(math.sqrt(1000 * 10000)) == pytest.approx(0.7)
    assert g.gemm_efficiency(200) == pytest.approx(0.2 + 0.4 * math.log(2) / math.log(10))
    assert g.attention_efficiency(16) == 0.3 and g.attention_efficiency(1 << 20) == 0.5
    assert g.attention_efficiency(1024) == pytest.approx(0.4)
    one = _gpu_with_curves(([512], [0.7]), ([1024], [0.4]))
    assert one.gemm_efficiency(1) == one.gemm_efficiency(1e6) == 0.7
    assert P.gemm_size(2, 4, 8) == pytest.approx(4.0)


def test_preset_curves_are_monotone() -> None:
    for name in GPUS:
        g = P.load_gpu(name)
        values = [g.gemm_efficiency(2.0**e) for e in range(5, 16)]
        assert values == sorted(values) and values[-1] == pytest.approx(g.gemm_curve.fractions[-1])
        assert g.gemm_efficiency(8192) > g.gemm_efficiency(512) > 0
        assert g.attention_efficiency(4096) >= g.attention_efficiency(1024) > 0


# ---- resolve -----------------------------------------------------------------------------------------------------


def test_resolve_defaults_and_overrides(tmp_path: Path) -> None:
    g, c = P.resolve(None, None)
    assert (g.name, c.name) == ("a100-80gb", "dgx-a100")
    assert [x.name for x in P.resolve("h100-sxm", None)] == ["h100-sxm", "dgx-h100"]
    assert [x.name for x in P.resolve(None, "dgx-h200")] == ["h200", "dgx-h200"]
    assert [x.name for x in P.resolve("b200", "dgx-a100")] == ["b200", "dgx-a100"]
    cluster_file = _write(tmp_path, "lab.toml", _preset_text("clusters", "dgx-h100").replace('"dgx-h100"', '"lab"'))
    assert [x.name for x in P.resolve("a100-40gb", str(cluster_file))] == ["a100-40gb", "lab"]
    # a GPU file whose default_cluster is a file next to it, and a cluster file whose gpu is a file next to it
    sub = tmp_path / "sub"
    sub.mkdir()
    gpu_text = _preset_text("gpus", "h200").replace('name = "h200"', 'name = "mine"')
    _write(sub, "mine.toml", gpu_text.replace('default_cluster = "dgx-h200"', 'default_cluster = "mine.cluster.toml"'))
    _write(sub, "mine.cluster.toml", _preset_text("clusters", "dgx-h200").replace('gpu = "h200"', 'gpu = "mine.toml"'))
    assert [x.name for x in P.resolve(str(sub / "mine.toml"), None)] == ["mine", "dgx-h200"]
    assert [x.name for x in P.resolve(None, str(sub / "mine.cluster.toml"))] == ["mine", "dgx-h200"]
    dangling = _write(tmp_path, "dangling.toml", gpu_text.replace('"dgx-h200"', '"nowhere.cluster.toml"'))
    with pytest.raises(PlanError, match="default_cluster: .*not found; pass --cluster"):
        P.resolve(str(dangling), None)


# ---- mlm-profile -------------------------------------------------------------------------------------------------


def test_mlm_profile_quick_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mlm.cli.profile import main

    out = tmp_path / "prof" / "me.toml"
    start = time.perf_counter()
    assert main(["--quick", "--device", "cpu", "--out", str(out), "--name", "cpu-test"]) == 0
    elapsed = time.perf_counter() - start
    assert elapsed < 90, f"--quick took {elapsed:.0f} s"
    assert (tmp_path / "prof" / "me.cluster.toml").is_file()
    g = P.load_gpu(str(out))
    assert g.name == "cpu-test" and g.default_cluster == "me.cluster.toml" and g.usd_per_gpu_hour == 0.0
    assert g.bf16_tflops > 1e-4 and g.hbm_gbps > 0.1 and g.nvlink_gbps > 0 and g.hbm_gib > 0
    assert max(g.gemm_curve.fractions) == 1.0 and len(g.gemm_curve.sizes) >= 4
    assert len(g.attention_curve.seq_lens) >= 3 and 0 < g.attention_efficiency(256) <= 1
    # the preset key set, less the optional tables: [calibration] (a measured profile was fitted to nothing) and
    # [fused_attention_curve] (mlm-profile times SDPA only)
    assert set(tomllib.loads(out.read_text())) == set(P.load_gpu("h100-sxm").to_dict()) - {
        "calibration",
        "fused_attention_curve",
    }
    g2, c = P.resolve(str(out), None)
    assert g2 == g and c.gpus_per_node == 2 and c.intra_node_gbps == g.nvlink_gbps
    assert 0 < c.intra_node_collective_efficiency <= 1 and c.intra_node_latency_us > 0
    assert P.resolve(None, str(tmp_path / "prof" / "me.cluster.toml"))[0] == g
    err = capsys.readouterr().err
    assert "all-reduce" in err and "GFLOP/s" in err


def test_mlm_profile_bad_input_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from mlm.cli.profile import main

    assert main(["--device", "cpu", "--world-size", "1", "--quick", "--out", str(tmp_path / "x.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --world-size 1: the collective test needs at least 2")
    assert main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a directory; give a file name such as" in err[0]
    if not torch.cuda.is_available():
        assert main(["--device", "cuda", "--quick"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("error: --device cuda: no CUDA device")
    with pytest.raises(SystemExit) as ex:
        main(["--device", "tpu"])
    assert ex.value.code == 2


def _fake_measurement(world: int):
    from mlm.runtime.profiling.machine import Collectives, Measurement

    coll = Collectives("gloo", world, 2.0, 1.5, 1.0, 120.0, 0.0, 0.6)
    return Measurement(
        "cpu",
        "fake CPU",
        "float32",
        ((64, 0.01), (256, 0.05), (1024, 0.08)),
        0.08,
        0.08,
        0.08,
        40.0,
        44.0,
        ((128, 0.02), (512, 0.1)),
        coll,
        8.0,
        0.5,
    )


def test_build_profiles_from_a_measurement() -> None:
    from mlm.runtime.profiling.machine import build_profiles, render

    m = _fake_measurement(world=2)
    gpu, cluster = build_profiles(m, "fake", "fake.cluster.toml", "fake.toml")
    assert gpu.bf16_tflops == 0.08 and gpu.gemm_curve.fractions == (0.125, 0.625, 1.0)
    assert gpu.attention_curve.fractions == (0.25, 1.0)  # clamped: never above the GEMM peak
    assert gpu.memory_bound_efficiency == 1.0 and gpu.hbm_gbps == 40.0 and gpu.nvlink_gbps == 2.0
    assert cluster.intra_node_collective_efficiency == 0.5 and cluster.gpu == "fake.toml"
    assert cluster.collective_overlap_efficiency == 0.0  # measured: nothing hidden (allowed, unlike a bandwidth)
    assert cluster.reduce_scatter_efficiency == 0.6  # 0.6 GB/s reduce-scatter over min(all-reduce, all-gather) 1.0
    assert gpu.compute_dtype == "fp32" and gpu.compute_bytes == 4  # mlm-run computes in fp32 on CPU
    gpu_text, cluster_text = render(m, gpu, cluster)
    assert P.GPUProfile.from_dict(tomllib.loads(gpu_text)) == gpu
    assert P.ClusterProfile.from_dict(tomllib.loads(cluster_text)) == cluster


def test_compute_dtype_is_checked() -> None:
    """A preset computes in bf16; a profile may say fp32 (mlm-profile on CPU); anything else is refused by name."""
    gpu = P.load_gpu("h100-sxm")
    assert gpu.compute_dtype == "bf16" and gpu.compute_bytes == 2
    data = {**gpu.to_dict(), "compute_dtype": "fp32"}
    assert P.GPUProfile.from_dict(data).compute_bytes == 4
    with pytest.raises(PlanError, match="compute_dtype"):
        P.GPUProfile.from_dict({**data, "compute_dtype": "fp8"})


def test_mlm_profile_stdout(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from mlm.cli.profile import main
    from mlm.runtime.profiling import machine as machine_profile

    monkeypatch.setattr(machine_profile, "measure", lambda device, quick, world, log: _fake_measurement(world))
    assert main(["--device", "cpu", "--name", "fake"]) == 0
    captured = capsys.readouterr()
    gpu = P.GPUProfile.from_dict(tomllib.loads(captured.out))
    assert gpu.name == "fake" and gpu.default_cluster == "fake.cluster.toml"
    assert "--out" in captured.err


def test_internal_error_is_exit_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from mlm.cli.profile import main
    from mlm.runtime.profiling import machine as machine_profile

    def boom(*args: object) -> None:
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(machine_profile, "measure", boom)
    assert main(["--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "internal error" in err and "ZeroDivisionError" in err and "Traceback" not in err
