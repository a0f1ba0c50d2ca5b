"""The tensor-parallel ILP rediscovers Megatron's pattern from the graph and solves unusual blocks optimally."""

from __future__ import annotations

import time

import pulp
import pytest
from conftest import MODELS

from mlm.planner.capture.loader import load_model_spec
from mlm.planner.capture.trace import capture
from mlm.planner.errors import Infeasible, PlanError
from mlm.planner.search.layouts import PlanRequest
from mlm.planner.search.make_plan import make_plan
from mlm.planner.search.tp_sharding import TPCost, _classify_nodes, plan_tensor_parallel

TP_MODELS = str(MODELS / "tp_models.py")
HF_MODELS = str(MODELS / "hf_models.py")


@pytest.fixture(scope="module")
def gpt2():
    return capture(load_model_spec("gpt2"))


@pytest.fixture(scope="module")
def llama8b():
    return capture(load_model_spec("llama3-8b"))


def _tp_models(entry: str, **args):
    return capture(load_model_spec(TP_MODELS, entry=entry, args=args))


def _block_styles(ir, result) -> dict[str, str]:
    """Styles of the first block, keyed by the path inside the block ('attn.c_attn')."""
    b = ir.blocks[0].name
    return {f[len(b) + 1 :]: s for f, s in result.styles.items() if f.startswith(b + ".")}


def _assert_every_block_agrees(ir, result) -> None:
    first = _block_styles(ir, result)
    for block in ir.blocks:
        got = {f[len(block.name) + 1 :]: s for f, s in result.styles.items() if f.startswith(block.name + ".")}
        assert got == first, block.name
        assert len(result.collectives[block.name]) == len(result.collectives[ir.blocks[0].name])


MEGATRON_GPT2 = {"attn.c_attn": "colwise", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"}


def test_gpt2_rediscovers_megatron(gpt2) -> None:
    r = plan_tensor_parallel(gpt2, 4)
    assert _block_styles(gpt2, r) == MEGATRON_GPT2
    colls = r.block_collectives(gpt2)
    assert [(c.kind, c.module) for c in colls] == [
        ("all-reduce", "transformer.h.0.attn.c_proj"),
        ("all-reduce", "transformer.h.0.mlp.c_proj"),
    ]
    assert r.comm_bytes_per_block(gpt2) == 2 * 1024 * 768 * 2  # two (s, h) bf16 tensors per sample
    _assert_every_block_agrees(gpt2, r)
    assert r.styles["transformer.h.11.mlp.c_proj"] == "rowwise"
    assert r.patterns(gpt2)["transformer.h.*.attn.c_attn"] == "colwise"
    assert r.shard_splits["transformer.h.0.attn.c_attn"] == (768, 768, 768)  # fused q|k|v, split chunk-wise
    # the vocabulary 50257 does not divide by 4: embedding and tied head stay replicated
    assert r.styles["transformer.wte"] == "replicate" and r.styles["lm_head"] == "replicate"
    assert "2 all-reduces" in r.explanation


def test_llama3_8b_gqa_tp8(llama8b) -> None:
    r = plan_tensor_parallel(llama8b, 8)
    styles = _block_styles(llama8b, r)
    assert styles == {
        "attention.wq": "colwise",
        "attention.wk": "colwise",
        "attention.wv": "colwise",
        "attention.wo": "rowwise",
        "feed_forward.w1": "colwise",
        "feed_forward.w3": "colwise",
        "feed_forward.w2": "rowwise",
    }
    assert [c.kind for c in r.block_collectives(llama8b)] == ["all-reduce", "all-reduce"]
    assert r.styles["tok_embeddings"] == "vocab" and r.styles["output"] == "vocab"  # 128256 = 8 * 16032
    _assert_every_block_agrees(llama8b, r)


def test_llama3_8b_sequence_parallel(llama8b) -> None:
    r = plan_tensor_parallel(llama8b, 8, sequence_parallel=True)
    styles = _block_styles(llama8b, r)
    assert styles["attention_norm"] == styles["ffn_norm"] == "sequence"
    assert styles["attention.wo"] == styles["feed_forward.w2"] == "rowwise"
    assert r.styles["norm"] == "sequence"
    colls = r.block_collectives(llama8b)
    # one all-gather shared by wq/wk/wv (and one by w1/w3), one reduce-scatter after wo and w2
    assert [c.kind for c in colls] == ["all-gather", "reduce-scatter", "all-gather", "reduce-scatter"]
    assert r.layouts["layers.0.attention.wq"] == ("Q", "S") and r.layouts["layers.0.attention.wo"] == ("S", "Q")


@pytest.mark.parametrize("entry", ["build_gpt2", "build_llama"])
def test_hf_models_from_config(entry: str) -> None:
    """HF GPT-2 (Conv1D: addmm with a transposed weight) and HF Llama (external rotary tables, GQA 4/2)."""
    ir = capture(load_model_spec(HF_MODELS, entry=entry))
    r = plan_tensor_parallel(ir, 2)
    styles = _block_styles(ir, r)
    if entry == "build_gpt2":
        assert styles == MEGATRON_GPT2
    else:
        assert styles == {
            "self_attn.q_proj": "colwise",
            "self_attn.k_proj": "colwise",
            "self_attn.v_proj": "colwise",
            "self_attn.o_proj": "rowwise",
            "mlp.gate_proj": "colwise",
            "mlp.up_proj": "colwise",
            "mlp.down_proj": "rowwise",
        }
    assert r.collectives_per_block(ir) == 2
    assert "vocab" in r.styles.values()  # vocabulary 128 divides by 2


def test_unusual_mlp_shards_the_widest_pair() -> None:
    """dim -> 3 dim -> 5 dim -> dim: Megatron by position (fcs.0 colwise, fcs.1 rowwise) would all-reduce a
    5·dim-wide tensor and replicate fcs.2 (5 dim²); the optimum replicates the smallest linear and all-reduces a
    dim-wide one."""
    ir = _tp_models("build_chain", dim=1024, widths=(3, 5))
    r = plan_tensor_parallel(ir, 4)
    assert _block_styles(ir, r) == {"fcs.0": "replicate", "fcs.1": "colwise", "fcs.2": "rowwise"}
    assert [c.kind for c in r.block_collectives(ir)] == ["all-reduce"]
    assert r.comm_bytes_per_block(ir) == 512 * 1024 * 2


def test_unusual_mlp_with_gather_shards_everything() -> None:
    """With colwise-then-all-gather allowed, gathering the 3·dim tensor beats replicating fcs.0 at dim 4096."""
    ir = _tp_models("build_chain", dim=4096, widths=(3, 5))
    r = plan_tensor_parallel(ir, 4, allow_gather=True)
    assert _block_styles(ir, r) == {"fcs.0": "colwise", "fcs.1": "colwise", "fcs.2": "rowwise"}
    assert r.layouts["blocks.0.fcs.0"] == ("R", "R")  # its output is all-gathered
    assert [c.kind for c in r.block_collectives(ir)] == ["all-gather", "all-reduce"]


def test_tradeoff_flips_with_size() -> None:
    """dim -> 5 dim -> 3 dim -> dim: small models save communication (replicate fcs.0, all-reduce dim wide),
    large ones save compute and memory (replicate the smaller fcs.2, all-reduce 3·dim wide)."""
    cost = TPCost(bf16_tflops=312, hbm_gbps=2039, link_gbps=300, memory_weight_s_per_gib=1e-3)
    small = _tp_models("build_chain", dim=128, widths=(5, 3))
    large = _tp_models("build_chain", dim=8192, widths=(5, 3))
    assert _block_styles(small, plan_tensor_parallel(small, 4, cost=cost)) == {
        "fcs.0": "replicate",
        "fcs.1": "colwise",
        "fcs.2": "rowwise",
    }
    assert _block_styles(large, plan_tensor_parallel(large, 4, cost=cost)) == {
        "fcs.0": "colwise",
        "fcs.1": "rowwise",
        "fcs.2": "replicate",
    }


def test_memory_weight_prefers_replicating_fewer_parameters() -> None:
    """Same small chain, but unsharded parameter state priced high: replicate fcs.2 (3 dim²), not fcs.0 (5 dim²)."""
    ir = _tp_models("build_chain", dim=128, widths=(5, 3))
    r = plan_tensor_parallel(ir, 4, cost=TPCost(memory_weight_s_per_gib=1.0))
    assert _block_styles(ir, r) == {"fcs.0": "colwise", "fcs.1": "rowwise", "fcs.2": "replicate"}


def test_block_input_readers() -> None:
    """The block input is not a graph node: the norm and the residual add (x + attn) read it; HF Llama's
    rotary q * cos (one graph input, q as wide as the residual but head-shaped) does not."""
    gpt2 = capture(load_model_spec(HF_MODELS, entry="build_gpt2"))
    g = gpt2.blocks[0].ops
    _, readers, _ = _classify_nodes(g)
    residual_add = next(
        n
        for n in g
        if g.nodes[n]["op"] == "add"
        and list(g.predecessors(n))
        and g.nodes[next(iter(g.predecessors(n)))]["kind"] == "dropout"
        and len(list(g.predecessors(n))) == 1
    )
    assert {n for n in readers if g.nodes[n]["kind"] == "norm"} == {"layer_norm"}
    assert residual_add in readers
    llama = capture(load_model_spec(HF_MODELS, entry="build_llama"))
    g = llama.blocks[0].ops
    _, readers, _ = _classify_nodes(g)
    rotary = [n for n in g if len(g.nodes[n]["shape"]) == 4 and g.nodes[n]["kind"] == "elementwise"]
    assert rotary and not readers & set(rotary)


def test_parallel_branches() -> None:
    """x + fc2(gelu(fc1(n))) + proj(n): the lone linear can be neither colwise (its sharded output would meet a
    replicated one in the add) nor rowwise (its input is replicated), so it stays replicated."""
    ir = _tp_models("build_branch")
    r = plan_tensor_parallel(ir, 4)
    assert _block_styles(ir, r) == {"fc1": "colwise", "fc2": "rowwise", "proj": "replicate"}
    assert r.collectives_per_block(ir) == 1


def test_tp1_replicates_everything(gpt2) -> None:
    r = plan_tensor_parallel(gpt2, 1)
    assert set(r.styles.values()) == {"replicate"}
    assert r.collectives_per_block(gpt2) == 0


def test_heads_not_divisible_replicate_attention(gpt2) -> None:
    """12 heads at tp=8: attention runs replicated (chosen over an error), the MLP is still sharded."""
    r = plan_tensor_parallel(gpt2, 8)
    assert _block_styles(gpt2, r) == {
        "attn.c_attn": "replicate",
        "attn.c_proj": "replicate",
        "mlp.c_fc": "colwise",
        "mlp.c_proj": "rowwise",
    }
    assert r.collectives_per_block(gpt2) == 1
    assert "do not divide by tp=8" in r.explanation


def test_heads_not_divisible_under_sequence_parallelism_is_an_error(gpt2) -> None:
    """The runtime feeds colwise linears sequence shards and replicated ones nothing, so replicated attention
    cannot get its full-sequence input: a clear error, not a plan that would not run."""
    with pytest.raises(Infeasible, match="tp dividing the head counts"):
        plan_tensor_parallel(gpt2, 8, sequence_parallel=True)


@pytest.mark.parametrize("model", ["gpt2", "llama3-8b"])
def test_solver_is_fast(model: str, gpt2, llama8b) -> None:
    ir = gpt2 if model == "gpt2" else llama8b
    plan_tensor_parallel(ir, 4)  # warm the solver binary
    start = time.perf_counter()
    plan_tensor_parallel(ir, 4, sequence_parallel=True)
    assert time.perf_counter() - start < 0.2


def test_solver_choice(gpt2) -> None:
    with pytest.raises(PlanError, match="unknown ILP solver"):
        plan_tensor_parallel(gpt2, 4, solver="gurobi-ish")
    if pulp.HiGHS(msg=False).available() or pulp.HiGHS_CMD(msg=False).available():
        assert _block_styles(gpt2, plan_tensor_parallel(gpt2, 4, solver="highs")) == MEGATRON_GPT2
    else:
        with pytest.raises(PlanError, match="highs"):
            plan_tensor_parallel(gpt2, 4, solver="highs")


def test_a_position_table_as_long_as_the_vocabulary_is_not_vocabulary_parallel() -> None:
    """GPT with block_size == vocab_size: wpe has as many rows as wte, but reads an arange, not token ids; only
    wte (and the tied head) are split by vocabulary rows."""
    shape = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "block_size": 256}
    ir = capture(load_model_spec("gpt2", args=shape), seq_len=64)
    styles = plan_tensor_parallel(ir, tp=2).styles
    assert styles["transformer.wte"] == "vocab" and styles["transformer.wpe"] == "replicate"


def test_attention_with_a_constant_that_spans_every_head_stays_replicated() -> None:
    """T5 adds a relative-position bias with one row per head (a constant of the batch-independent positions) to
    its scores: a rank holding half the heads could not add it, and mlm-run refused such a plan ("no per-rank
    setting ... runs it on 2 heads per rank"). The ILP keeps that attention replicated and splits the MLP; a
    rotary table or a causal mask (size 1 on the head dimension) does not stop Llama's attention from splitting.
    Swin's learned bias (2 heads in its first stage, 4 in the second) is read against each block's own heads."""
    ir = capture(load_model_spec(HF_MODELS.replace("hf_models.py", "hf_t5.py")), seq_len=16)
    styles = plan_tensor_parallel(ir, tp=2).styles
    block = {k.split("block.0.", 1)[1]: v for k, v in styles.items() if k.startswith("encoder.block.0.")}
    assert block == {
        "layer.0.SelfAttention.q": "replicate",
        "layer.0.SelfAttention.k": "replicate",
        "layer.0.SelfAttention.v": "replicate",
        "layer.0.SelfAttention.o": "replicate",
        "layer.1.DenseReluDense.wi": "colwise",
        "layer.1.DenseReluDense.wo": "rowwise",
    }
    assert any(
        "layer.0.SelfAttention reads a tensor of shape (1, 4, 16, 16)" in n for n in plan_tensor_parallel(ir, 2).notes
    )

    swin = capture(load_model_spec(HF_MODELS.replace("hf_models.py", "hf_swin.py")), seq_len=16)
    styles = plan_tensor_parallel(swin, tp=2).styles
    attention = [v for k, v in styles.items() if ".attention." in k]
    assert len(attention) == 16 and set(attention) == {"replicate"}  # q, k, v, o of 4 blocks
    assert {v for k, v in styles.items() if k.endswith("mlp.fc1")} == {"colwise"}


PER_HEAD_WEIGHTS = """
import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim, heads, per_head_rows):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        # a q scale over the head width, one shared row (Qwen3-like) or one row per head (Cohere-like)
        self.q_scale = nn.Parameter(torch.ones(heads if per_head_rows else 1, self.head_dim))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, self.head_dim) for t in self.qkv(x).chunk(3, dim=-1))
        q = q * self.q_scale
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, per_head_rows):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(dim), Attention(dim, heads, per_head_rows)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class Model(nn.Module):
    def __init__(self, per_head_rows=False, dim=64, heads=4, layers=2, vocab=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, per_head_rows) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model(per_head_rows=False):
    return Model(per_head_rows)
"""


@pytest.mark.parametrize("per_head_rows", [False, True])
def test_a_weight_read_on_the_heads_is_split_only_when_it_broadcasts_over_them(per_head_rows, tmp_path) -> None:
    """A weight over the head width shared by every head runs on the rank's heads (style "heads": replicated, its
    gradient summed over tp); one with a row per head cannot (a rank would need its own rows, and mlm-run does
    not slice a module's parameters), so that attention stays replicated, as a constant spanning the heads does."""
    path = tmp_path / "per_head.py"
    path.write_text(PER_HEAD_WEIGHTS)
    ir = capture(load_model_spec(str(path), args={"per_head_rows": per_head_rows}), seq_len=32)
    styles = plan_tensor_parallel(ir, 2).styles
    attn = "blocks.0.attn"
    if per_head_rows:
        assert styles[f"{attn}.qkv"] == "replicate" and f"{attn}" not in styles
        # and the plan says so, once for both blocks, naming what holds it (a plan warning)
        request = PlanRequest(num_gpus=2, tp=2, pp=1, global_batch=4)
        warnings = make_plan(load_model_spec(str(path), args={"per_head_rows": True}), ir, request).plan.warnings
        said = [w for w in warnings if "attention runs on all heads" in w]
        assert len(said) == 1 and said[0].startswith("blocks.0 and 1 more layer like it") and "(4, 16)" in said[0]
    else:
        assert styles[f"{attn}.qkv"] == "colwise" and styles[attn] == "heads"
        assert not plan_tensor_parallel(ir, 2).notes


def test_flattened_tokens_and_folded_heads_are_refused_or_explained() -> None:
    """OPT flattens (batch, seq) into one dimension before its MLP: sequence parallelism's token shard (a slice of
    each sequence) cannot follow it, so with SP there is no sharding, and the error says why (the runtime failed in
    DTensor's layer norm before); without SP its heads split. XGLM computes its scores on (batch x heads, s, s):
    its attention stays replicated, and the plan's note says why."""
    opt = capture(load_model_spec(str(MODELS / "hf_zoo.py"), "build_opt"), seq_len=16)
    with pytest.raises(Infeasible, match="flattens batch and sequence"):
        plan_tensor_parallel(opt, 2, sequence_parallel=True)
    styles = plan_tensor_parallel(opt, 2).styles
    assert styles["model.decoder.layers.0.self_attn.q_proj"] == "colwise"

    xglm = capture(load_model_spec(str(MODELS / "hf_zoo.py"), "build_xglm"), seq_len=16)
    r = plan_tensor_parallel(xglm, 2)
    assert r.styles["model.layers.0.self_attn.q_proj"] == "replicate"
    assert r.styles["model.layers.0.fc1"] == "colwise"
    assert len(r.notes) == 1 and "folded into the batch dimension" in r.notes[0], r.notes


def test_per_sample_conditioning_is_refused_under_sequence_parallelism() -> None:
    """A diffusers DiT's blocks read the timestep and class label per sample (no sequence dimension) beside the
    token stream and compute adaLN's shifts and scales from them: under SP their gradient from the sequence shards
    is a partial sum that mlm-run's styles do not reduce (mlm-run failed in DTensor's addmm on the plan mlm-plan
    wrote). The sharding refuses SP and says why; without SP the attention splits, and a free search at tp 2 plans
    without SP. A plain decoder (the gpt2 preset, no per-sample input) still shards with SP."""
    pytest.importorskip("diffusers")
    dit = capture(load_model_spec(str(MODELS / "hf_diffusers_dit.py")), seq_len=64)
    with pytest.raises(Infeasible, match="per-sample tensors"):
        plan_tensor_parallel(dit, 2, sequence_parallel=True)
    assert plan_tensor_parallel(dit, 2).styles["transformer_blocks.0.attn1.to_q"] == "colwise"
    request = PlanRequest(num_gpus=2, tp=2, pp=1, global_batch=4)
    layout = make_plan(load_model_spec(str(MODELS / "hf_diffusers_dit.py")), dit, request).plan.layout
    assert layout.tp == 2 and not layout.sequence_parallel
    gpt = capture(load_model_spec("gpt2", args={"n_layer": 2, "n_embd": 64, "n_head": 4}), seq_len=32)
    assert plan_tensor_parallel(gpt, 2, sequence_parallel=True).styles
