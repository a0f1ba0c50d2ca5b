"""The capture cache: a hit equals a fresh capture, any change to what the IR depends on misses, a bad entry is
rebuilt, and a repeat mlm-plan reads the cache without importing torch and writes the same plan."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
from conftest import MODELS

from mlm.cli.plan import build_parser, load_or_capture
from mlm.planner.capture import cache
from mlm.planner.capture.graph import ModelIR
from mlm.planner.capture.loader import load_model_spec, parse_model_args
from mlm.planner.capture.trace import capture

TINY = ["n_layer=2", "n_head=4", "n_embd=64", "vocab_size=256", "block_size=64"]


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "cache"
    monkeypatch.setenv("MLM_CACHE_DIR", str(where))
    return where


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    """A private copy of a test model, so the test may edit it."""
    path = tmp_path / "model" / "nanogpt_style.py"
    path.parent.mkdir()
    shutil.copy(MODELS / "nanogpt_style.py", path)
    return path


def _args(model: Path | str, *extra: str, model_args: list[str] = TINY) -> argparse.Namespace:
    argv = [str(model), *extra]
    for item in model_args:
        argv += ["--model-arg", item]
    return build_parser().parse_args(argv)


def _without_timing(ir: ModelIR) -> ModelIR:
    return dataclasses.replace(ir, capture_seconds=0.0)


def _entries(where: Path) -> list[Path]:
    return sorted((where / "capture").glob("*.pkl"))


def test_hit_equals_a_fresh_capture(cache_dir: Path, model_file: Path) -> None:
    spec0, first, cached0 = load_or_capture(_args(model_file, "--seq-len", "32"))
    spec1, hit, cached1 = load_or_capture(_args(model_file, "--seq-len", "32"))
    assert (cached0, cached1) == (False, True)
    fresh_spec = load_model_spec(str(model_file), None, parse_model_args(TINY))
    fresh = capture(fresh_spec, seq_len=32)
    assert _without_timing(hit) == _without_timing(fresh)
    for a, b in zip(hit.layers, fresh.layers):  # LayerIR.ops is excluded from ==; the TP ILP reads it
        assert (a.ops is None) == (b.ops is None)
        if a.ops is not None:
            assert nx.utils.graphs_equal(a.ops, b.ops)
    for attr in ("source", "sha256", "entry", "args", "display_name", "preset"):
        assert getattr(spec1, attr) == getattr(fresh_spec, attr), attr
    assert Path(spec1.path) == fresh_spec.path


def test_changing_file_args_or_seq_len_misses(cache_dir: Path, model_file: Path) -> None:
    assert load_or_capture(_args(model_file, "--seq-len", "32"))[2] is False
    assert load_or_capture(_args(model_file, "--seq-len", "32"))[2] is True
    _, ir, cached = load_or_capture(_args(model_file, "--seq-len", "16"))
    assert cached is False and ir.seq_len == 16
    _, ir, cached = load_or_capture(_args(model_file, "--seq-len", "32", model_args=[*TINY, "n_layer=3"]))
    assert cached is False and ir.num_layers == 3
    model_file.write_text(model_file.read_text() + "\n# edited\n")
    assert load_or_capture(_args(model_file, "--seq-len", "32"))[2] is False
    sibling = model_file.parent / "helpers.py"  # a module the model could import
    sibling.write_text("X = 1\n")
    assert load_or_capture(_args(model_file, "--seq-len", "32"))[2] is False
    assert load_or_capture(_args(model_file, "--seq-len", "32"))[2] is True
    assert load_or_capture(_args(model_file, "--seq-len", "32", "--no-cache"))[2] is False
    assert len(_entries(cache_dir)) == 5  # --no-cache wrote nothing


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(b"not a pickle"),
        lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
        lambda p: p.write_bytes(pickle.dumps({"format": cache.FORMAT_VERSION, "key": p.stem, "ir": 1, "spec": 2})),
        lambda p: p.write_bytes(pickle.dumps({"format": -1})),
    ],
    ids=["garbage", "truncated", "wrong-types", "old-format"],
)
def test_bad_entry_is_rebuilt(cache_dir: Path, model_file: Path, damage) -> None:
    _, ir, _ = load_or_capture(_args(model_file, "--seq-len", "32"))
    (entry,) = _entries(cache_dir)
    damage(entry)
    assert cache.load(entry.stem) is None
    _, again, cached = load_or_capture(_args(model_file, "--seq-len", "32"))
    assert cached is False and _without_timing(again) == _without_timing(ir)
    assert cache.load(entry.stem) is not None  # rewritten


def test_entry_referring_to_torch_is_refused(cache_dir: Path, model_file: Path) -> None:
    """Unpickling a torch object would import torch on a hit: such an entry is a miss."""
    import torch

    load_or_capture(_args(model_file, "--seq-len", "32"))
    (entry,) = _entries(cache_dir)
    spec, ir = cache.load(entry.stem)
    entry.write_bytes(pickle.dumps({"format": cache.FORMAT_VERSION, "key": entry.stem, "spec": spec, "ir": ir,
                                    "extra": torch.float32}))  # fmt: skip
    assert cache.load(entry.stem) is None


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "mlm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "mlm"
    monkeypatch.setenv("MLM_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache.cache_dir() == tmp_path / "explicit"


RUN_PLAN = """
import json, sys
from mlm.cli.plan import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules}))
"""


def _plan_in_subprocess(model: Path, out: Path, cache_dir: Path) -> dict:
    argv = [str(model), "--gpus", "4", "--seq-len", "32", "--global-batch", "8", "--out", str(out), "--json"]
    for item in TINY:
        argv += ["--model-arg", item]
    env = {**__import__("os").environ, "MLM_CACHE_DIR": str(cache_dir)}
    proc = subprocess.run([sys.executable, "-c", RUN_PLAN, *argv], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold_and_warm(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, Path, Path]:
    where = tmp_path_factory.mktemp("plan")
    cold, warm = where / "cold.json", where / "warm.json"
    first = _plan_in_subprocess(MODELS / "nanogpt_style.py", cold, where / "cache")
    second = _plan_in_subprocess(MODELS / "nanogpt_style.py", warm, where / "cache")
    return first, second, cold, warm


def test_repeat_plan_writes_the_same_plan(cold_and_warm: tuple[dict, dict, Path, Path]) -> None:
    first, second, cold, warm = cold_and_warm
    assert first == {"rc": 0, "torch": True}  # the cold run captured
    assert second["rc"] == 0
    assert json.loads(cold.read_text()) == json.loads(warm.read_text())


def test_repeat_plan_does_not_import_torch(cold_and_warm: tuple[dict, dict, Path, Path]) -> None:
    assert cold_and_warm[1]["torch"] is False
