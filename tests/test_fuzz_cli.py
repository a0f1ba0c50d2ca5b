"""Property-based bad input for every command (hypothesis): random flags, numbers and paths, and truncated or
mutated plan.json files. None may print a traceback or exit with anything but 0 or 2 (1 is an internal bug).

The commands run in-process through their main(argv). mlm-run stops short of training (the launch is replaced by
a stub, so a plan that passes validation is counted, not run); mlm-profile stops before measuring.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_runtime_harness import GPT_ARGS, make_plan

from mlm.planner.plan import save_plan

SETTINGS = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture], derandomize=True
)


def _call(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse: 2 on a usage error, 0 for --help
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return code, err.getvalue()


def _check(main: Callable[[list[str]], int], argv: list[str]) -> int:
    code, err = _call(main, argv)
    assert "Traceback" not in err, (argv, err[-2000:])
    assert code in (0, 2), (argv, code, err[-2000:])
    return code


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("fuzz")
    good = tmp / "plan.json"
    save_plan(make_plan("gpt", dp=2, micro_batch=2, num_microbatches=1, args=dict(GPT_ARGS, n_layer=2)), good)
    (tmp / "empty.json").write_text("")
    (tmp / "binary.json").write_bytes(bytes(range(256)) * 4)
    (tmp / "list.json").write_text("[1, 2, 3]")
    (tmp / "dir.json").mkdir()
    (tmp / "tokens.bin").write_bytes(bytes(7))
    (tmp / "model.py").write_text("import torch\nraise RuntimeError('boom at import')\n")
    return {
        "good": good,
        "empty": tmp / "empty.json",
        "binary": tmp / "binary.json",
        "list": tmp / "list.json",
        "dir": tmp / "dir.json",
        "tokens": tmp / "tokens.bin",
        "model": tmp / "model.py",
        "missing": tmp / "missing" / "x.json",
        "tmp": tmp,
    }


SMALL = st.sampled_from([1, 2, 4, 8, 16, 64])  # mostly plausible values, so the commands get past argparse
ODD = st.sampled_from(["0", "-1", "1e400", "nan", "inf", "-inf", "0x10", "1_000", "", " ", "3.5", "1e3", "ten"])
NUMBERS = st.one_of(SMALL, SMALL, SMALL, st.integers(-(10**12), 10**12), ODD)
NUMBER_TEXT = NUMBERS.map(str)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=6,
)


def _paths(files: dict[str, Path]) -> st.SearchStrategy[str]:
    return st.sampled_from(["good", "empty", "binary", "list", "dir", "tokens", "model", "missing"]).map(
        lambda k: str(files[k])
    ) | st.sampled_from(["", "-", "/", "/dev/null", "/proc/self/mem", "\x7f", "a" * 300, "~/nope", "../../etc/passwd"])


def _flags(spec: dict[str, st.SearchStrategy[str] | None]) -> st.SearchStrategy[list[str]]:
    """Random subsets of a command's flags (None: a switch), in random order, sometimes with junk appended."""

    def build(chosen: list[tuple[str, str | None]], junk: list[str]) -> list[str]:
        argv: list[str] = []
        for flag, value in chosen:
            argv += [flag] if value is None else [flag, value]
        return argv + junk

    pair = st.sampled_from(sorted(spec)).flatmap(
        lambda f: st.tuples(st.just(f), spec[f] if spec[f] is not None else st.none())
    )
    junk = st.lists(st.sampled_from(["--nope", "-x", "--", "--steps=", "=", "--json=1"]), max_size=1)
    return st.builds(build, st.lists(pair, max_size=4), junk)


# ---- plan.json mutations ----


def _mutate(doc: Any, rng: random.Random, value: Any) -> Any:
    """Replace, delete or add one entry somewhere inside doc (in place on a copy)."""
    doc = json.loads(json.dumps(doc))
    node, path = doc, []
    while isinstance(node, (dict, list)) and node and rng.random() < 0.7:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        if not isinstance(node[key], (dict, list)) or not node[key]:
            break
        path.append(key)
        node = node[key]
    if isinstance(node, dict) and node:
        key = rng.choice(list(node))
        action = rng.choice(["replace", "delete", "add"])
        if action == "replace":
            node[key] = value
        elif action == "delete":
            del node[key]
        else:
            node["extra_" + str(key)] = value
    elif isinstance(node, list) and node:
        i = rng.randrange(len(node))
        node[i] = value if rng.random() < 0.7 else node[i]
        if rng.random() < 0.3:
            node.pop(i)
    return doc


@given(
    seed=st.integers(0, 2**32 - 1),
    value=JSON_VALUES,
    cut=st.floats(0, 1),
    how=st.sampled_from(["mutate", "mutate", "mutate", "truncate", "bytes"]),
)
@settings(max_examples=120, **SETTINGS)
def test_mlm_run_rejects_mutated_plans_cleanly(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, seed: int, value: Any, cut: float, how: str
) -> None:
    import mlm.cli.run as run_cli
    import mlm.runtime.launch as launch

    launched: list[int] = []
    monkeypatch.setattr(run_cli, "_launch", lambda args, world, argv, console: launched.append(world) or 0)
    monkeypatch.setattr(launch, "init_single_process", lambda device: launched.append(1))
    monkeypatch.setattr(run_cli, "_run", lambda *a, **k: 0)
    text = files["good"].read_text()
    rng = random.Random(seed)
    if how == "mutate":
        text = json.dumps(_mutate(json.loads(text), rng, value))
    elif how == "truncate":
        text = text[: int(cut * len(text))]
    else:
        raw = bytearray(text.encode())
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        text = raw.decode("utf-8", "replace")
    path = files["tmp"] / "mutated.json"
    path.write_text(text)
    _check(run_cli.main, [str(path), "--device", "cpu"])


RUN_FLAGS = {
    "--steps": NUMBER_TEXT,
    "--data": None,
    "--data-dtype": st.sampled_from(["uint16", "uint32", "int8"]),
    "--save": None,
    "--save-every": NUMBER_TEXT,
    "--resume": None,
    "--device": st.sampled_from(["cpu", "tpu"]),
    "--optimizer": st.sampled_from(["adamw", "sgd", "lion"]),
    "--lr": NUMBER_TEXT,
    "--warmup-steps": NUMBER_TEXT,
    "--lr-decay-steps": NUMBER_TEXT,
    "--max-grad-norm": NUMBER_TEXT,
    "--seed": NUMBER_TEXT,
    "--log": None,
    "--skip-nonfinite": None,
    "--max-restarts": NUMBER_TEXT,
}


@given(data=st.data())
@settings(max_examples=60, **SETTINGS)
def test_mlm_run_random_flags_and_paths(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, data: st.DataObject
) -> None:
    import mlm.cli.run as run_cli

    monkeypatch.setattr(run_cli, "_launch", lambda args, world, argv, console: 0)
    paths = _paths(files)
    spec = {
        k: (paths if v is None and k in ("--data", "--save", "--resume", "--log") else v) for k, v in RUN_FLAGS.items()
    }
    argv = [data.draw(paths, "plan")] + data.draw(_flags(spec), "flags")
    _check(run_cli.main, argv)


PLAN_FLAGS = {
    "--gpus": NUMBER_TEXT,
    "--gpu": st.sampled_from(["a100-80gb", "h100-sxm", "nope", "/dev/null", ""]),
    "--cluster": st.sampled_from(["nope", "/", ""]),
    "--seq-len": NUMBER_TEXT,
    "--global-batch": NUMBER_TEXT,
    "--tp": NUMBER_TEXT,
    "--pp": NUMBER_TEXT,
    "--dp": NUMBER_TEXT,
    "--micro-batch": NUMBER_TEXT,
    "--vpp": NUMBER_TEXT,
    "--recompute": st.sampled_from(["none", "full", "half"]),
    "--sequence-parallel": None,
    "--no-sequence-parallel": None,
    "--zero": st.sampled_from(["0", "1", "2", "3"]),
    "--top": NUMBER_TEXT,
    "--json": None,
    "--explain": None,
    "--inspect": None,
    "--model-arg": st.sampled_from(
        ["n_layer=2", "n_layer=x", "=", "n_layer", "__import__('os')=1", "n_embd=-1", "n_layer=10**100"]
    ),
    "--entry": st.sampled_from(["build_model", "nope", "__class__"]),
    "--time-limit": st.just("2"),
}


@given(data=st.data())
@settings(max_examples=40, **SETTINGS)
def test_mlm_plan_random_flags(files: dict[str, Path], data: st.DataObject) -> None:
    from mlm.cli.plan import main

    model = data.draw(
        st.sampled_from(
            ["gpt2", "no-such-preset", str(files["model"]), str(files["missing"]), str(files["dir"]), "", "/dev/null"]
        ),
        "model",
    )
    base = ["--time-limit", "2"] + (["--gpus", "8"] if data.draw(st.booleans(), "gpus") else [])
    _check(main, [model, *base, *data.draw(_flags(PLAN_FLAGS), "flags")])


WHATIF_FLAGS = {
    "--gpus": NUMBER_TEXT,
    "--tokens": st.sampled_from(["300e9", "15T", "1e400", "-5", "x", "0", "1P"]),
    "--days": NUMBER_TEXT,
    "--max-gpus": NUMBER_TEXT,
    "--max-params": None,
    "--memory": None,
    "--sweep": st.sampled_from(["gpus=8,16", "gpus=", "gpu=nope", "x=1", "=", "global_batch=0,-1"]),
    "--usd-per-gpu-hour": NUMBER_TEXT,
    "--json": None,
    "--scale": st.sampled_from(["both", "nope"]),
}


@given(data=st.data())
@settings(max_examples=25, **SETTINGS)
def test_mlm_whatif_random_flags(files: dict[str, Path], data: st.DataObject) -> None:
    from mlm.cli.whatif import main

    model = data.draw(st.sampled_from(["gpt2", "no-such-preset", str(files["model"]), str(files["missing"]), ""]))
    base = ["--max-gpus", "64"]  # bounded searches keep the fuzz loop quick
    base += ["--gpus", "8"] if data.draw(st.booleans(), "gpus") else []
    base += ["--tokens", "1e9"] if data.draw(st.booleans(), "tokens") else []
    _check(main, [model, *base, *data.draw(_flags(WHATIF_FLAGS), "flags")])


class _Measured(BaseException):
    """mlm-profile got as far as measuring: every check of its arguments passed."""


PROFILE_FLAGS = {
    "--out": None,
    "--device": st.sampled_from(["cpu", "cuda", "npu"]),
    "--quick": None,
    "--name": st.sampled_from(["x", "", "a/b", "../x", "\x00"]),
    "--world-size": NUMBER_TEXT,
}


@given(data=st.data())
@settings(max_examples=40, **SETTINGS)
def test_mlm_profile_random_flags(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch, data: st.DataObject) -> None:
    from mlm.cli.profile import main
    from mlm.runtime.profiling import machine as machine_profile

    def measured(*args: Any, **kwargs: Any) -> None:
        raise _Measured

    monkeypatch.setattr(machine_profile, "measure", measured)
    spec = {k: (_paths(files) if v is None and k == "--out" else v) for k, v in PROFILE_FLAGS.items()}
    argv = data.draw(_flags(spec))
    try:
        _check(main, argv)
    except _Measured:
        pass
