"""mlm-plan --inspect and the bad-input contract: one clear line, exit code 2, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import MODELS

from mlm.cli.plan import main


def test_inspect_json_has_layers_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpt2", "--inspect", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["num_params"] == 124439808
    assert doc["layers"][0]["name"] == "transformer.wte"
    assert doc["totals"]["params"] == doc["num_params"]
    assert "torch.export" in doc["capture_method"]


def test_inspect_table_names_capture_method(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpt2", "--inspect"]) == 0
    out = capsys.readouterr().out
    assert "transformer.h.0" in out and "124.4M" in out and "captured with" in out


def test_inspect_shows_experts_top_k_active_parameters_and_the_assumptions(capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3-MoE tiny (moe_configs.py: 3 blocks, the first dense, then 8 SwiGLU experts of 32 per block, top-2):
    the active parameters are all parameters (counted on the module) less 6 idle experts in each of 2 MoE
    blocks, by hand; the MoE recognition's assumption is printed as a warning."""
    from mlm.planner.capture.loader import instantiate, load_model_spec

    path = str(MODELS / "moe_configs.py")
    model = instantiate(load_model_spec(path, "build_qwen3_moe", {}), "meta")
    total = sum(p.numel() for p in model.parameters())
    active = total - 2 * (8 - 2) * 3 * 64 * 32
    assert main([path, "--entry", "build_qwen3_moe", "--seq-len", "32", "--inspect"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"MoE: 2 layers of 8 routed experts, top-2; active parameters per token {active:,}" in out
    assert "warning MoE recognised" in out


BAD_INPUTS = [
    (["does/not/exist.py"], "does not exist"),
    (["no-such-preset"], "presets: gpt2"),
    ([str(MODELS / "syntax_error.py")], "syntax error"),
    ([str(MODELS / "no_factory.py")], "no model factory"),
    ([str(MODELS / "bad_inputs.py"), "--entry", "raises"], "config file missing"),
    ([str(MODELS / "bad_inputs.py"), "--entry", "not_a_module"], "not a torch.nn.Module"),
    ([str(MODELS / "bad_inputs.py"), "--entry", "data_dependent"], "bad_inputs.py:"),
    ([str(MODELS / "bad_inputs.py"), "--entry", "missing_entry"], "has no 'missing_entry'"),
    (["gpt2", "--model-arg", "n_layer"], "key=value"),
    (["gpt2", "--model-arg", "no_such_arg=3"], "rejected the model arguments"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--inspect"]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) <= 3  # one logical line, possibly wrapped by the terminal width


def test_console_script_exit_code() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mlm.cli.plan", "no-such-preset", "--inspect"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "unknown model" in proc.stderr
