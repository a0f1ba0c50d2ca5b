"""What capture feeds the model and what it does when its guesses do not fit: the default sequence length, the
retry at a shorter position table, inputs at the model's dtype, sibling imports, inputs mlm cannot guess, and the
whole-model fallback on a fresh instance. Expected values are the models' construction arguments."""

from __future__ import annotations

import sys

import pytest
from conftest import MODELS

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import DEFAULT_SEQ_CAP, capture
from mlm.planner.errors import PlanError

EDGE = str(MODELS / "capture_edge_cases.py")
HF = str(MODELS / "hf_models.py")


def test_long_context_model_defaults_to_the_cap_and_says_how_to_change_it() -> None:
    ir = capture(load_model_spec(HF, "build_llama", {"max_position_embeddings": 131072}))
    assert ir.seq_len == DEFAULT_SEQ_CAP == 4096
    note = next(w for w in ir.warnings if w.startswith("seq_len"))
    assert "131072" in note and "--seq-len" in note


def test_short_context_model_defaults_to_its_context() -> None:
    ir = capture(load_model_spec(HF, "build_gpt2", {"n_positions": 40}))
    assert ir.seq_len == 40
    assert any(w.startswith("seq_len 40") for w in ir.warnings)


def test_given_seq_len_is_used_and_not_explained() -> None:
    ir = capture(load_model_spec(HF, "build_gpt2", {"n_positions": 40}), seq_len=12)
    assert ir.seq_len == 12
    assert not any(w.startswith("seq_len") for w in ir.warnings)


def test_position_table_shorter_than_the_guess_is_retried_at_its_length() -> None:
    # no context attribute; the learned (1, 24, width) table broadcasts only against 24 tokens
    ir = capture(load_model_spec(str(MODELS / "odd_attention.py"), "build_heads_gpt", {"positions": 24}))
    assert ir.seq_len == 24
    assert any(w.startswith("seq_len 24") and "--seq-len" in w for w in ir.warnings)


def test_guess_that_does_not_run_fails_in_one_line_naming_seq_len() -> None:
    with pytest.raises(PlanError) as caught:
        capture(load_model_spec(EDGE, "build_capped", {"limit": 100}))
    message = str(caught.value)
    assert "pass --seq-len N" in message and "\n" not in message
    assert capture(load_model_spec(EDGE, "build_capped", {"limit": 100}), seq_len=100).seq_len == 100


def test_float_example_inputs_are_cast_to_the_model_dtype() -> None:
    spec = load_model_spec(str(MODELS / "tiny_vit.py"))
    ir = capture(spec)
    model = spec.factory()
    assert ir.num_params == sum(p.numel() for p in model.parameters())
    patches = (32 // 8) ** 2 + 1  # 16 patches and the class token
    assert ir.num_heads == 4 and ir.head_dim == 48 // 4 and ir.hidden_size == 48
    block = ir.blocks[0]
    qkv = next(op for op in block.linears if op.fqn.endswith("qkv"))
    assert qkv.rows == patches


def test_sibling_import_loads_and_leaves_sys_path_as_it_was() -> None:
    path_before = list(sys.path)
    spec = load_model_spec(str(MODELS / "nanogpt_repo" / "train.py"), args={"n_layer": 3, "n_embd": 32})
    assert sys.path == path_before and "model" not in sys.modules
    ir = capture(spec, seq_len=16)
    assert (ir.num_layers, ir.hidden_size, ir.num_heads) == (3, 32, 2)
    assert sys.path == path_before


def test_forward_with_two_required_inputs_names_them() -> None:
    with pytest.raises(PlanError) as caught:
        capture(load_model_spec(EDGE, "build_two_inputs"), seq_len=8)
    message = str(caught.value)
    assert "source_ids" in message and "target_ids" in message and "example_inputs" in message


def test_encoder_decoder_without_example_inputs_gets_the_forward_and_the_hook_named() -> None:
    with pytest.raises(PlanError) as caught:
        capture(load_model_spec(str(MODELS / "hf_zoo.py"), "build_t5"), seq_len=8)
    message = str(caught.value)
    assert "decoder_input_ids" in message and "example_inputs" in message and "\n" not in message


def test_whole_model_fallback_runs_on_a_fresh_instance_and_says_so() -> None:
    # the forward indexes blocks by a stored count, so the one-block cut fails; the cut model would fail again
    ir = capture(load_model_spec(EDGE, "build_counted", {"count": 3, "width": 16, "vocab": 40}), seq_len=8)
    assert ir.num_layers == 3
    assert ir.num_params == 40 * 16 + 3 * (2 * 16 + 16 * 16 + 16) + 16 * 40 + 40
    assert any(w.startswith("whole-model fallback") for w in ir.warnings)
    assert not any(w.startswith("blocks of one kind") for w in ir.warnings)


def test_replicated_blocks_are_a_warning() -> None:
    ir = capture(load_model_spec(EDGE, "build_capped"), seq_len=8)
    assert not any(w.startswith("blocks of one kind") for w in ir.warnings)  # no repeated container
    ir = capture(load_model_spec(HF, "build_gpt2", {"n_layer": 3}), seq_len=8)
    assert any(w.startswith("blocks of one kind costed from one instance") and "3 blocks" in w for w in ir.warnings)


def test_parameters_no_captured_op_reads_are_a_warning() -> None:
    ir = capture(load_model_spec(EDGE, "build_aux_head", {"vocab": 40, "width": 16}), seq_len=8)
    note = next(w for w in ir.warnings if "take part in no captured op" in w)
    assert "value_head.weight" in note and f"{16 + 1:,} elements" in note
    assert ir.num_params == 40 * 16 + 16 * 40 + 40 + 16 + 1  # still counted in the model's size
    assert not any("no captured op" in w for w in capture(load_model_spec(EDGE, "build_capped"), seq_len=8).warnings)


def test_position_lookup_past_the_table_is_caught_although_meta_runs_it() -> None:
    spec = load_model_spec(EDGE, "build_table_positions", {"positions": 20, "vocab": 40})
    ir = capture(spec)
    assert ir.seq_len == 20
    assert any(w.startswith("seq_len 20") and "where" in w for w in ir.warnings)
    ir = capture(spec, seq_len=30)  # a length the user chose is kept, and the problem said
    assert ir.seq_len == 30
    assert any("cannot run at this length" in w and "--seq-len 20" in w for w in ir.warnings)
    assert not any("cannot run" in w for w in capture(spec, seq_len=20).warnings)


@pytest.mark.parametrize(("path", "entry", "seq"), [(str(MODELS / "hf_vit.py"), None, None), (HF, "build_gpt2", 32)])
def test_batch_bytes_are_what_the_runtime_puts_on_a_rank(path: str, entry: str | None, seq: int | None) -> None:
    """ModelIR.batch_bytes, per sample, equals the bytes of the batch mlm-run's data source gives a rank (its
    tensors as they reach the device: a ViT's fp32 images and int64 labels, GPT-2's int64 ids and targets)."""
    import torch
    from torch.utils._pytree import tree_leaves

    from mlm.runtime.data import ExampleSource, TokenSource

    spec = load_model_spec(path, entry, {})
    ir = capture(spec, seq_len=seq)
    rows = 4
    if spec.example_inputs is not None:
        source = ExampleSource(spec.example_inputs, ir.seq_len, rows, seed=0)
    else:
        source = TokenSource(ir.vocab_size, ir.seq_len, rows, seed=0)
    batch = source.batch(0, dp_rank=0, dp=1, device=torch.device("cpu"))
    held = sum(t.untyped_storage().nbytes() for t in tree_leaves(batch) if isinstance(t, torch.Tensor))
    assert ir.batch_bytes * rows == held > 0
