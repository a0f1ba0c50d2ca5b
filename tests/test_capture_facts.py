"""Architecture facts come from the captured graph: each expected value is the model's own construction argument
(what its author passed), never read back from capture's code."""

from __future__ import annotations

import json

import pytest
from conftest import MODELS

from mlm.cli.plan import main as plan_main
from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture

ODD = str(MODELS / "odd_attention.py")
ZOO = str(MODELS / "hf_zoo.py")
HF = str(MODELS / "hf_models.py")


def facts(model: str, entry: str, seq_len: int | None = 16, **args):
    ir = capture(load_model_spec(model, entry, args), seq_len=seq_len)
    return ir, (ir.hidden_size, ir.num_heads, ir.num_kv_heads, ir.head_dim, ir.vocab_size)


@pytest.mark.parametrize("manual", [False, True], ids=["sdpa", "matmul-softmax-matmul"])
def test_heads_stored_as_self_heads(manual: bool) -> None:
    args = {"tokens": 96, "width": 48, "heads": 6, "depth": 3, "positions": 24, "manual": manual}
    _, got = facts(ODD, "build_heads_gpt", **args)
    assert got == (48, 6, 6, 48 // 6, 96)


@pytest.mark.parametrize("broadcast", ["repeat_interleave", "expand"])
def test_gqa_with_nh_nkv_names_and_head_dim_not_hidden_over_heads(broadcast: str) -> None:
    args = {"vocab": 80, "dim": 64, "nh": 8, "nkv": 2, "hd": 12, "ffn": 96, "depth": 2, "broadcast": broadcast}
    ir, got = facts(ODD, "build_nh_llama", **args)
    assert got == (64, 8, 2, 12, 80)
    assert not [w for w in ir.warnings if "heads" in w and "graph gives" in w]  # no attribute to disagree with


def test_hf_llama_gqa() -> None:
    _, got = facts(HF, "build_llama", num_attention_heads=8, num_key_value_heads=2, hidden_size=64, vocab_size=128)
    assert got == (64, 8, 2, 64 // 8, 128)


def test_hf_gpt2() -> None:
    _, got = facts(HF, "build_gpt2", n_embd=64, n_head=4, vocab_size=128)
    assert got == (64, 4, 4, 16, 128)


def test_hf_falcon_multi_query_reads_one_kv_head_and_shows_the_config_disagreeing() -> None:
    # Falcon-7B style: one shared key/value head; FalconConfig.num_kv_heads still says num_attention_heads
    ir, got = facts(ZOO, "build_falcon", multi_query=True, num_attention_heads=4)
    assert got == (64, 4, 1, 16, 112)
    assert any("kv heads" in w and "config.num_kv_heads" in w for w in ir.warnings)


def test_hf_falcon_new_architecture_grouped_kv() -> None:
    # Falcon-40B style: the key is broadcast to all query heads (torch.broadcast_to) before attention
    _, got = facts(ZOO, "build_falcon", new_decoder_architecture=True, num_kv_heads=2, num_attention_heads=8)
    assert got == (64, 8, 2, 8, 112)


def test_model_without_attention_says_so_and_tp_cannot_split_it() -> None:
    ir = capture(load_model_spec(str(MODELS / "mlp_sequential.py")), seq_len=8)
    assert ir.num_heads == 1 and ir.head_dim == 0
    assert any("no attention op" in w for w in ir.warnings)


def test_inspect_json_lists_the_facts_and_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [ZOO, "--entry", "build_falcon", "--inspect", "--json", "--seq-len", "16"]
    assert plan_main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["num_heads"], summary["num_kv_heads"], summary["head_dim"]) == (4, 1, 16)
    assert any(w.startswith("kv heads: the graph gives 1") for w in summary["warnings"])


@pytest.mark.parametrize("name", ["gpt3-175b", "llama3-405b", "megatron-1t"])
def test_full_size_presets_match_their_published_shapes(name: str) -> None:
    spec = load_model_spec(name)
    a = spec.args
    want = (
        a.get("n_embd", a.get("dim")),
        a.get("n_head", a.get("n_heads")),
        a.get("n_kv_heads", a.get("n_head")),
        a.get("n_embd", a.get("dim")) // a.get("n_head", a.get("n_heads")),
        a["vocab_size"],
    )
    ir = capture(spec, seq_len=128)
    assert (ir.hidden_size, ir.num_heads, ir.num_kv_heads, ir.head_dim, ir.vocab_size) == want
    assert not any("graph gives" in w for w in ir.warnings)


@pytest.mark.parametrize(
    ("model", "entry", "args", "seq", "kind"),
    [
        (HF, "build_gpt2", {}, 16, "causal"),
        (ODD, "build_heads_gpt", {"manual": True}, 16, "causal"),  # masked_fill with triu(1): hidden = future
        (ZOO, "build_bert", {}, 16, "full"),
        (ZOO, "build_mistral", {"sliding_window": 16}, 64, "sliding window 16"),
        (ZOO, "build_mistral", {"sliding_window": 16}, 16, "causal"),  # the window covers the whole sequence
    ],
)
def test_attention_kind_is_read_from_the_mask(model: str, entry: str, args: dict, seq: int, kind: str) -> None:
    ir = capture(load_model_spec(model, entry, args), seq_len=seq)
    assert ir.attention_kinds == (kind,)
    assert ir.blocks and all(block.attention == (kind,) for block in ir.blocks)


def test_encoder_decoder_cross_attention_is_found_and_the_facts_come_from_self_attention() -> None:
    ir = capture(load_model_spec(str(MODELS / "hf_t5.py"), args={"d_model": 32, "d_kv": 8, "num_heads": 4}), seq_len=8)
    assert "cross" in ir.attention_kinds
    assert (ir.num_heads, ir.num_kv_heads, ir.head_dim, ir.hidden_size, ir.vocab_size) == (4, 4, 8, 32, 96)
