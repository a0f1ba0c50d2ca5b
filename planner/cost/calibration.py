"""Calibration: the cost model against published training runs, and the fit of each GPU profile's compute factor.

Two parts. First (calibrate, calibrate_row), Narayanan et al. 2021 (Megatron-LM) Table 1: predicted vs published
TFLOP/s per GPU, as benchmarks/calibrate_megatron.py prints it. Second (read_measurements ... fit_gpu), every
measurement CSV in profiles/calibration/ in one schema, each row with its source and train/test split: the
compute factor on a profile's prior curves that minimises the train rows' error, and the error of every row at it
(benchmarks/fit_profiles.py; tests/test_cost_fit.py re-runs it against the profiles).

Table 1:

For each row: the megatron-* preset, tp and pp pinned, dp = gpus/(tp·pp), a100-80gb on dgx-a100, full recompute,
no sequence parallelism and zero 0 (both postdate the paper), and the fastest fitting micro-batch in {1, 2, 4, 8}
and schedule (1F1B, or interleaved with vpp dividing the blocks per stage). The predicted step time is turned into
the paper's metric with its Eq. 3, F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per iteration, which counts the
recomputed forward.

The model captured for a row is the megatron-* preset's GPT with the paper's attention kernels
(`build_megatron_2021`): hidden and attention dropout 0.1, scores materialised by batched GEMMs with the 1/sqrt(d)
scale folded in, and one softmax pass standing for Megatron-LM's fused scale-mask-softmax kernel (the causal mask
is applied inside that kernel, so it moves no extra bytes). Flash attention did not exist in 2021; costing the
preset's SDPA block instead would credit the paper with kernels it did not have.
"""

from __future__ import annotations

import csv
import importlib.resources
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from mlm.planner.capture.presets.gpt import GPT, CausalSelfAttention, GPTConfig
from mlm.planner.capture.presets.registry import PRESETS
from mlm.planner.cost.hardware import ClusterProfile, GPUProfile
from mlm.planner.cost.inputs import ModelCostInputs
from mlm.planner.cost.step_time import (
    MEGATRON_2021,
    CostOptions,
    Evaluation,
    StageAssignment,
    balanced_blocks,
    evaluate,
    summarize,
)
from mlm.planner.layout import Layout

MICRO_BATCHES = (1, 2, 4, 8)
SEQ_LEN = 2048
VOCAB = 51200


@dataclass(frozen=True)
class CalibrationRow:
    params_b: float
    published_tflops: float
    predicted_tflops: float
    layout: Layout
    evaluation: Evaluation

    @property
    def error(self) -> float:
        """Signed relative error of the prediction."""
        return self.predicted_tflops / self.published_tflops - 1.0


def table_path(name: str) -> Path:
    """A measurement table shipped in mlm.profiles (profiles/calibration/NAME), each file citing its source."""
    return Path(str(importlib.resources.files("mlm.profiles").joinpath("calibration", name)))


def read_table(path: Path) -> list[dict[str, str]]:
    """The CSV rows (comment lines starting with # skipped)."""
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return list(csv.DictReader(lines))


def eq3_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021, Eq. 3: FLOPs per iteration with activation recomputation."""
    return 96.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def candidate_layouts(layers: int, tp: int, pp: int, gpus: int, batch: int) -> list[Layout]:
    """The micro-batch / schedule grid searched for one row."""
    dp = gpus // (tp * pp)
    out = []
    for mb in MICRO_BATCHES:
        if (batch // dp) % mb:
            continue
        m = batch // (dp * mb)
        if pp > 1 and m < pp:
            continue
        vpps = [1] + (
            [v for v in range(2, layers // pp + 1) if (layers // pp) % v == 0 and m % pp == 0] if pp > 1 else []
        )
        for vpp in vpps:
            out.append(
                Layout(
                    tp=tp,
                    pp=pp,
                    dp=dp,
                    micro_batch=mb,
                    num_microbatches=m,
                    vpp=vpp,
                    sequence_parallel=False,
                    recompute="full",
                    zero=0,
                )
            )
    return out


def calibrate_row(
    inputs: ModelCostInputs,
    row: dict[str, str],
    gpu: GPUProfile,
    cluster: ClusterProfile,
    options: CostOptions = MEGATRON_2021,
) -> CalibrationRow:
    """Best fitting layout for one row and its Eq. 3 TFLOP/s per GPU."""
    layers, hidden = int(row["layers"]), int(row["hidden"])
    tp, pp, gpus, batch = int(row["tp"]), int(row["pp"]), int(row["gpus"]), int(row["global_batch"])
    best: tuple[float, Layout, Evaluation] | None = None
    for layout in candidate_layouts(layers, tp, pp, gpus, batch):
        ev = evaluate(inputs, layout, gpu, cluster, options=options)
        if ev.fits and (best is None or ev.step_time_s < best[0]):
            best = (ev.step_time_s, layout, ev)
    assert best is not None, f"no fitting layout for row {row}"
    step, layout, ev = best
    tflops = eq3_flops(batch, SEQ_LEN, layers, hidden, VOCAB) / step / gpus / 1e12
    return CalibrationRow(float(row["params_b"]), float(row["tflops_per_gpu"]), tflops, layout, ev)


class Megatron2021Attention(CausalSelfAttention):
    """Attention as Megatron-LM ran it in 2021 (see the module docstring): the cost structure, not the math of
    causal masking."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        d = C // self.n_head
        q, k, v = (t.view(B, T, self.n_head, d).transpose(1, 2) for t in self.c_attn(x).split(self.n_embd, dim=2))
        att = torch.matmul(q * (1.0 / d**0.5), k.transpose(-2, -1))  # baddbmm(alpha=1/sqrt(d)) in Megatron-LM
        att = self.attn_dropout(F.softmax(att, dim=-1))  # FusedScaleMaskSoftmax: one pass over the scores
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


def build_megatron_2021(**kwargs: object) -> GPT:
    """The GPT preset with Megatron-LM 2021's attention kernels and dropout 0.1 (a model.py-style factory)."""
    model = GPT(GPTConfig(**{"dropout": 0.1, **kwargs}))  # type: ignore[arg-type]
    for block in model.transformer.h:
        block.attn.__class__ = Megatron2021Attention
    return model


def capture_row(row: dict[str, str]) -> ModelCostInputs:
    """Summarised IR of a row's model, as Megatron-LM 2021 ran it."""
    from mlm.planner.capture.loader import load_model_spec
    from mlm.planner.capture.trace import capture

    spec = load_model_spec(__file__, entry="build_megatron_2021", args=PRESETS[preset_name(row)].args)
    return summarize(capture(spec))


def preset_name(row: dict[str, str]) -> str:
    """The megatron-* preset of a Table 1 row ("1008.0" is the 1T model)."""
    b = float(row["params_b"])
    return "megatron-1t" if b >= 1000 else f"megatron-{b:g}b"


def calibrate(
    path: Path, gpu: GPUProfile, cluster: ClusterProfile, options: CostOptions = MEGATRON_2021
) -> list[CalibrationRow]:
    """All rows of the table (captures each model once: about a second per row)."""
    return [calibrate_row(capture_row(row), row, gpu, cluster, options) for row in read_table(path)]


# ---- published measurements with full layouts, and the fit of a GPU profile's compute factor ---------------------

# The share of tp collectives TransformerEngine's comm-GEMM overlap (--tp-comm-overlap) hides, fitted on the train
# rows of the Megatron-Core sources at their own compute factors: `python benchmarks/fit_profiles.py --fit-tp-overlap`
# (fit_tp_overlap; grid 0 / 0.25 / 0.5 / 0.75 / 1: train error 4.6 / 4.2 / 3.9 / 3.7 / 4.2%, mean of the sources).
MEGATRON_CORE_TP_OVERLAP = 0.75
MEGATRON_CORE = CostOptions(  # --overlap-grad-reduce / --overlap-param-gather, --tp-comm-overlap, ring CP
    dp_overlap=1.0,
    tp_overlap=MEGATRON_CORE_TP_OVERLAP,
    sp_saves_gathered_inputs=False,
    pipeline_buffers_every_microbatch=False,
    cp_overlap=1.0,
    fused_loss_backward=True,
    zero1_gathers_every_microbatch=False,  # the distributed optimizer all-gathers the parameters once per step
    recompute_repeats_every_reduction=True,  # tensor_parallel.checkpoint re-runs the layer's whole forward
    expert_tensor_parallel=True,  # --expert-tensor-parallel-size defaults to the tp size
    pp_overlap=1.0,  # overlap_p2p_comm: on by default (--no-overlap-p2p-communication), interleaved schedule only
)
RUNTIMES = {
    "megatron-2021": MEGATRON_2021,  # Megatron-LM 2021/2022: DP and TP collectives on the compute stream
    "megatron-core": MEGATRON_CORE,
    # NeMo 2.x performance recipes on Megatron-Core: grad_reduce_in_fp32 off (bf16 gradient buffer and reduction;
    # the recipes' performance_optimizations set it)
    "nemo": replace(MEGATRON_CORE, grad_reduce_bytes=2.0, grad_buffer_bytes=2.0),
    "torch": CostOptions(),  # mlm-run: torch DDP buckets / FSDP2 prefetch
    "torch-te": CostOptions(cp_overlap=1.0),  # FSDP2 with TransformerEngine's ring attention for CP
    # the same with the loss on the bf16 logits (NeMo AutoModel's MaskedCrossEntropy, fp32_upcast: false)
    "torch-te-bf16-loss": CostOptions(cp_overlap=1.0, loss_bytes=2.0),
    # MosaicML Composer FSDP (FULL_SHARD, prefetch), gradients reduce-scattered on every micro-batch;
    # mixed precision PURE reduces bf16 gradients, DEFAULT fp32
    "composer-fsdp-pure": CostOptions(zero3_reduce_every_microbatch=True),
    "composer-fsdp-default": CostOptions(zero3_reduce_every_microbatch=True, grad_reduce_bytes=4.0),
}
RECOMPUTE_SEARCH = ("none", "selective", "full")
# manual: scores materialised by batched GEMMs (before flash attention); sdpa: F.scaled_dot_product_attention's
# FlashAttention-2, or a run's flash-attn; te: TransformerEngine's DotProductAttention (CostOptions.fused_attention)
ATTENTION_KINDS = ("manual", "sdpa", "te")


@dataclass(frozen=True)
class Measurement:
    """One published run: hardware, model shape, layout (blank micro_batch / vpp / recompute "any": searched), and
    the published figure in its own metric (step_s, eq3_tflops, model_tflops per GPU, tokens_per_gpu_s)."""

    file: str
    source: str
    split: str
    name: str
    gpu: str
    cluster: str
    gpus: int
    arch: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    attention: str
    tp: int
    pp: int
    cp: int
    ep: int
    head_dim: int  # attention head width (hidden // heads unless the model sets it)
    experts: int  # routed experts per MoE block (0: dense)
    top_k: int
    moe_ffn: int  # each expert's hidden size
    micro_batch: int | None
    vpp: int | None
    global_batch: int
    recompute: tuple[str, ...]
    sp: bool
    zero: int
    runtime: str
    metric: str
    value: float

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def options(self) -> CostOptions:
        """The runtime's cost options; attention "te" (TransformerEngine's DotProductAttention) runs the GPU
        profile's fused attention kernel where it has one (captured as SDPA: the same FLOPs and saved tensors)."""
        return self.options_under(RUNTIMES)

    def options_under(self, runtimes: dict[str, CostOptions]) -> CostOptions:
        """`options` with the runtimes' options taken from `runtimes` (fit_tp_overlap tries other values)."""
        return replace(runtimes[self.runtime], fused_attention=self.attention == "te")

    def shape_key(self) -> tuple:
        return (self.arch, self.layers, self.hidden, self.heads, self.kv_heads, self.ffn, self.vocab, self.seq,
                self.attention, self.head_dim, self.experts, self.top_k, self.moe_ffn)  # fmt: skip

    def published_step_s(self) -> float:
        """The published figure as seconds per step."""
        b, s, l, h, v = self.global_batch, self.seq, self.layers, self.hidden, self.vocab
        if self.metric == "step_s":
            return self.value
        if self.metric == "tokens_per_gpu_s":
            return b * s / (self.value * self.gpus)
        if self.metric == "eq3_tflops":
            return eq3_flops(b, s, l, h, v) / (self.value * 1e12 * self.gpus)
        if self.metric == "model_tflops":
            return megatron_model_flops(self) / (self.value * 1e12 * self.gpus)
        raise ValueError(f"{self.file}: unknown metric {self.metric!r}")


def megatron_model_flops(m: Measurement) -> float:
    """Megatron-LM's num_floating_point_operations per step (no recompute): 12·B·s·l·h²·((1 + g/n + s/h)·q/h
    + ffn/h·gated + V/(2·l·h)), gated = 1.5 for SwiGLU (llama, qwen3), g/n the kv-head ratio, q/h the query width
    (heads·head_dim) over hidden; in an MoE block the MLP term is top_k experts of moe_ffn (the router is not
    counted)."""
    gated = 1.5 if m.arch in GATED_ARCHS else 1.0
    attn = (1 + m.kv_heads / m.heads + m.seq / m.hidden) * m.heads * m.head_dim / m.hidden
    mlp = m.top_k * m.moe_ffn if m.experts else m.ffn
    return (
        12.0 * m.global_batch * m.seq * m.layers * m.hidden**2
        * (attn + mlp / m.hidden * gated + m.vocab / (2 * m.layers * m.hidden))
    )  # fmt: skip


GATED_ARCHS = ("llama", "qwen3")  # SwiGLU MLPs; "nemotron": squared ReLU; "gpt", "mpt": GELU


def _opt_int(x: str) -> int | None:
    return int(x) if x.strip() else None


def _int_or(r: dict[str, str], key: str, default: int) -> int:
    """An optional column (cp, ep and the MoE shape were added later; older files leave them out)."""
    value = (r.get(key) or "").strip()
    return int(value) if value else default


def read_measurements(path: Path) -> list[Measurement]:
    """Rows of a measurement CSV: the generic schema, or Narayanan et al. 2021 Table 1's own columns."""
    out = []
    for r in read_table(path):
        if "params_b" in r:  # Table 1: GPT, s=2048, V=51200, full recompute, no SP, no DP overlap
            h = int(r["hidden"])
            r = {
                **r, "name": f"{float(r['params_b']):g}B", "gpu": "a100-80gb", "cluster": "dgx-a100",
                "arch": "gpt", "kv_heads": r["heads"], "ffn": str(4 * h), "vocab": str(VOCAB), "seq": str(SEQ_LEN),
                "attention": "manual", "micro_batch": "", "vpp": "", "recompute": "full", "sp": "0", "zero": "0",
                "runtime": "megatron-2021", "metric": "eq3_tflops", "value": r["tflops_per_gpu"],
            }  # fmt: skip
        if r["attention"] not in ATTENTION_KINDS:
            raise ValueError(f"{path.name}: row {r['name']}: attention must be one of {', '.join(ATTENTION_KINDS)}")
        out.append(
            Measurement(
                file=path.name,
                source=r["source"],
                split=r["split"],
                name=r["name"],
                gpu=r["gpu"],
                cluster=r["cluster"],
                gpus=int(r["gpus"]),
                arch=r["arch"],
                layers=int(r["layers"]),
                hidden=int(r["hidden"]),
                heads=int(r["heads"]),
                kv_heads=int(r["kv_heads"]),
                ffn=int(r["ffn"]),
                vocab=int(r["vocab"]),
                seq=int(r["seq"]),
                attention=r["attention"],
                tp=int(r["tp"]),
                pp=int(r["pp"]),
                cp=_int_or(r, "cp", 1),
                head_dim=_int_or(r, "head_dim", int(r["hidden"]) // int(r["heads"])),
                ep=_int_or(r, "ep", 1),
                experts=_int_or(r, "experts", 0),
                top_k=_int_or(r, "top_k", 0),
                moe_ffn=_int_or(r, "moe_ffn", int(r["ffn"])),
                micro_batch=_opt_int(r["micro_batch"]),
                vpp=_opt_int(r["vpp"]),
                global_batch=int(r["global_batch"]),
                recompute=RECOMPUTE_SEARCH if r["recompute"] == "any" else (r["recompute"],),
                sp=r["sp"].strip() in ("1", "true", "True"),
                zero=int(r["zero"]),
                runtime=r["runtime"],
                metric=r["metric"],
                value=float(r["value"]),
            )
        )
    return out


def capture_measurement(m: Measurement) -> ModelCostInputs:
    """Summarised IR of a row's model: the GPT preset (Megatron-LM 2021 kernels when attention is manual; no
    biases for arch "mpt") or the Llama preset (arch "llama"; "qwen3" adds q/k norms, "nemotron" a squared-ReLU
    MLP; routed experts where the row has them), with the row's shape."""
    from mlm.planner.capture.loader import load_model_spec
    from mlm.planner.capture.trace import capture

    if m.arch in ("llama", "qwen3", "nemotron"):
        args = dict(dim=m.hidden, n_layers=m.layers, n_heads=m.heads, n_kv_heads=m.kv_heads, vocab_size=m.vocab,
                    ffn_dim=m.ffn, max_seq_len=m.seq, head_dim=m.head_dim, qk_norm=m.arch == "qwen3",
                    mlp="relu2" if m.arch == "nemotron" else "swiglu")  # fmt: skip
        if m.experts:
            args.update(n_experts=m.experts, top_k=m.top_k, moe_ffn_dim=m.moe_ffn)
        spec = load_model_spec("llama3-8b", args=args)
    else:
        assert m.ffn == 4 * m.hidden and not m.experts, f"{m.name}: the GPT preset has a dense 4h MLP"
        args = dict(n_layer=m.layers, n_head=m.heads, n_embd=m.hidden, vocab_size=m.vocab, block_size=m.seq,
                    bias=m.arch != "mpt")  # fmt: skip
        if m.attention == "manual":
            spec = load_model_spec(__file__, entry="build_megatron_2021", args=args)
        else:
            spec = load_model_spec("gpt2", args=args)
    return summarize(capture(spec, seq_len=m.seq))


def measurement_layouts(m: Measurement, num_blocks: int) -> list[Layout]:
    """The layouts a row allows: its tp/pp/cp/ep/dp/zero/SP pinned, micro-batch, schedule and recompute as given
    or searched (micro-batch in MICRO_BATCHES, vpp dividing the blocks per stage)."""
    dp = m.dp
    per_dp = m.global_batch // dp
    out = []
    for mb in (m.micro_batch,) if m.micro_batch else MICRO_BATCHES:
        if per_dp % mb:
            continue
        n = per_dp // mb
        if m.pp > 1 and n < m.pp:
            continue
        if m.vpp:
            vpps = [m.vpp]
        elif m.pp > 1 and n % m.pp == 0:
            vpps = [v for v in range(1, num_blocks // m.pp + 1) if (num_blocks // m.pp) % v == 0]
        else:
            vpps = [1]
        for vpp in vpps:
            for rc in m.recompute:
                out.append(
                    Layout(
                        tp=m.tp,
                        pp=m.pp,
                        dp=dp,
                        cp=m.cp,
                        ep=m.ep,
                        micro_batch=mb,
                        num_microbatches=n,
                        vpp=vpp,
                        sequence_parallel=m.sp,
                        recompute=rc,
                        zero=m.zero,
                    )  # type: ignore[arg-type]  # fmt: skip
                )
    return out


@dataclass(frozen=True)
class RowPrediction:
    measurement: Measurement
    layout: Layout
    predicted_step_s: float
    fits: bool  # False: no allowed layout fits the memory model; the fastest one is reported anyway
    recomputed: int | None = None  # recompute "full": blocks recomputed per virtual stage (None: all of them)

    @property
    def error(self) -> float:
        """Signed relative error of the predicted throughput (published step / predicted step − 1)."""
        return self.measurement.published_step_s() / self.predicted_step_s - 1.0


Candidate = tuple[Layout, int | None]  # a layout and, under recompute "full", the blocks recomputed per stage


def _assignment(inputs: ModelCostInputs, layout: Layout, recomputed: int | None) -> StageAssignment | None:
    """Balanced blocks with at most `recomputed` of each stage's recomputed (None: evaluate's default, all)."""
    if recomputed is None:
        return None
    counts = balanced_blocks(inputs.num_blocks, layout.pp * layout.vpp)
    return StageAssignment(counts, tuple(min(recomputed, c) for c in counts))


def fewest_recomputed(
    inputs: ModelCostInputs,
    layout: Layout,
    gpu: GPUProfile,
    cluster: ClusterProfile,
    options: CostOptions,
    partial: bool = True,
) -> Candidate | None:
    """Under recompute "full", the fewest blocks per virtual stage that must be recomputed for `layout` to fit
    (Megatron-LM's --recompute-num-layers with the block method, as mlm-plan's stage MILP also chooses per stage;
    recompute time only grows with the count, so the fewest that fit is the fastest); None when even all do not
    fit. Other layouts, and every layout when not `partial` (a source that says it recomputed every block): the
    layout itself when it fits."""
    if layout.recompute != "full" or not partial:
        return (layout, None) if evaluate(inputs, layout, gpu, cluster, options=options).fits else None
    most = max(balanced_blocks(inputs.num_blocks, layout.pp * layout.vpp))
    for k in range(1, most + 1):
        if evaluate(inputs, layout, gpu, cluster, _assignment(inputs, layout, k), options).fits:
            return layout, (None if k >= most else k)
    return None


class RowEvaluator:
    """Predicts rows under a changing GPU profile; captures each model shape and checks memory only once."""

    def __init__(
        self, rows: list[Measurement], gpu: GPUProfile, runtimes: dict[str, CostOptions] | None = None
    ) -> None:
        from mlm.planner.cost.hardware import load_cluster

        self.rows = rows
        self.runtimes = RUNTIMES if runtimes is None else runtimes
        shapes: dict[tuple, ModelCostInputs] = {}
        self._cands: list[tuple[ModelCostInputs, ClusterProfile, list[Candidate], bool]] = []
        for m in rows:
            if m.shape_key() not in shapes:
                shapes[m.shape_key()] = capture_measurement(m)
            inputs, cluster = shapes[m.shape_key()], load_cluster(m.cluster)
            layouts = measurement_layouts(m, inputs.num_blocks)
            assert layouts, f"{m.file}: no layout for row {m.name}"
            options = m.options_under(self.runtimes)
            searched = m.recompute == RECOMPUTE_SEARCH  # "any": not published, so partial recompute is allowed
            fitting = [c for lo in layouts if (c := fewest_recomputed(inputs, lo, gpu, cluster, options, searched))]
            self._cands.append((inputs, cluster, fitting or [(lo, None) for lo in layouts], bool(fitting)))

    def subset(self, indices: list[int]) -> RowEvaluator:
        """The same evaluator restricted to some rows (no recapture)."""
        sub = RowEvaluator.__new__(RowEvaluator)
        sub.rows, sub._cands = [self.rows[i] for i in indices], [self._cands[i] for i in indices]
        sub.runtimes = self.runtimes
        return sub

    def predict(self, gpu: GPUProfile) -> list[RowPrediction]:
        out = []
        for m, (inputs, cluster, cands, fits) in zip(self.rows, self._cands):
            opts = m.options_under(self.runtimes)
            best = min(
                ((evaluate(inputs, lo, gpu, cluster, _assignment(inputs, lo, k), opts).step_time_s, lo, k)
                 for lo, k in cands),
                key=lambda t: t[0],
            )  # fmt: skip
            out.append(RowPrediction(m, best[1], best[0], fits, best[2]))
        return out


def objective(preds: list[RowPrediction]) -> float:
    """Mean over sources of the mean |error| of their rows (a source with many rows does not dominate)."""
    by: dict[str, list[float]] = {}
    for p in preds:
        by.setdefault(p.measurement.file, []).append(abs(p.error))
    return sum(sum(v) / len(v) for v in by.values()) / len(by)


FACTOR_STEP = 0.005


def fit_factor(train: RowEvaluator, gpu: GPUProfile) -> float:
    """The compute factor on the prior curves that minimises `objective` on the train rows: a 0.02 grid over
    [0.30, 1.30], refined on a FACTOR_STEP grid around the best point."""
    grid = [round(0.30 + 0.02 * i, 3) for i in range(51)]
    best = min(grid, key=lambda f: (objective(train.predict(gpu.with_compute_factor(f))), f))
    fine = [round(best + FACTOR_STEP * i, 3) for i in range(-4, 5) if best + FACTOR_STEP * i > 0]
    return min(fine, key=lambda f: (objective(train.predict(gpu.with_compute_factor(f))), f))


@dataclass(frozen=True)
class FitResult:
    """The profile's factor and every row at it; and, for each source with train rows of its own, the factor fitted
    on those rows alone and that source's rows at it (`own`): the software stack a source ran (its kernels, fusion,
    framework overheads) moves achieved efficiency by tens of percent between sources on the same chip, so the
    per-source fit asks whether the model's structure carries one calibration over a source's other models,
    scales and layouts, as `mlm-calibrate` on a user's own runs does."""

    gpu: str
    factor: float
    predictions: list[RowPrediction]  # every row of every source, train and test
    own: dict[str, tuple[float, list[RowPrediction]]] = field(default_factory=dict)

    def held_out(self, own: bool = False) -> dict[str, tuple[int, float, float]]:
        """Per source file: test rows, mean and worst |error| in percent (own: at the source's own factor, only
        sources that have one)."""
        preds = [p for _, ps in self.own.values() for p in ps] if own else self.predictions
        out: dict[str, tuple[int, float, float]] = {}
        for f in dict.fromkeys(p.measurement.file for p in preds):
            errs = [abs(p.error) for p in preds if p.measurement.file == f and p.measurement.split == "test"]
            if errs:
                out[f] = (len(errs), 100 * sum(errs) / len(errs), 100 * max(errs))
        return out


def sources_sha256(names: list[str]) -> str:
    """SHA-256 over the named measurement files in profiles/calibration/ (sorted by name), to tell a profile fitted
    on other data from one fitted on these."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(names):
        h.update(name.encode() + b"\0" + table_path(name).read_bytes())
    return h.hexdigest()


def measurement_files() -> list[Path]:
    """Every measurement CSV shipped in profiles/calibration/."""
    root = table_path("")
    return sorted(p for p in root.iterdir() if p.suffix == ".csv")


def fit_gpu(gpu: GPUProfile, files: list[Path] | None = None) -> FitResult | None:
    """Fit `gpu`'s compute factor on the train rows naming it, and predict every row (None: no rows)."""
    rows = [m for f in files or measurement_files() for m in read_measurements(f) if m.gpu == gpu.name]
    if not rows:
        return None
    everything = RowEvaluator(rows, gpu)
    train = [i for i, m in enumerate(rows) if m.split == "train"]
    if train:
        factor = fit_factor(everything.subset(train), gpu)
    else:
        factor = gpu.calibration.compute_factor if gpu.calibration else 1.0
    own: dict[str, tuple[float, list[RowPrediction]]] = {}
    for src in dict.fromkeys(m.file for m in rows):
        mine = [i for i, m in enumerate(rows) if m.file == src]
        fit_rows = [i for i in mine if rows[i].split == "train"]
        if fit_rows:
            f = fit_factor(everything.subset(fit_rows), gpu)
            own[src] = (f, everything.subset(mine).predict(gpu.with_compute_factor(f)))
    return FitResult(gpu.name, factor, everything.predict(gpu.with_compute_factor(factor)), own)


def leave_source_out(gpu: GPUProfile, files: list[Path] | None = None) -> dict[str, tuple[float, float, float]]:
    """For each source with train rows: the factor fitted on the other sources' train rows alone, and the mean and
    worst |error| (percent) over all of the left-out source's rows at that factor (a cross-source check)."""
    rows = [m for f in files or measurement_files() for m in read_measurements(f) if m.gpu == gpu.name]
    everything = RowEvaluator(rows, gpu)
    out: dict[str, tuple[float, float, float]] = {}
    for src in dict.fromkeys(m.file for m in rows):
        train = [i for i, m in enumerate(rows) if m.split == "train" and m.file != src]
        if not train or not any(m.file == src and m.split == "train" for m in rows):
            continue
        factor = fit_factor(everything.subset(train), gpu)
        held = everything.subset([i for i, m in enumerate(rows) if m.file == src])
        errs = [100 * abs(p.error) for p in held.predict(gpu.with_compute_factor(factor))]
        out[src] = (factor, sum(errs) / len(errs), max(errs))
    return out


MEGATRON_CORE_FAMILY = ("megatron-core", "nemo")  # runtimes whose tp_overlap fit_tp_overlap chooses
TP_OVERLAP_GRID = (0.0, 0.25, 0.5, 0.75, 1.0)


def fit_tp_overlap(
    gpu: GPUProfile, files: list[Path] | None = None, grid: tuple[float, ...] = TP_OVERLAP_GRID
) -> dict[float, dict[str, tuple[float, float]]]:
    """The share of tensor-parallel collectives that TransformerEngine's comm-GEMM overlap hides in Megatron-Core
    runs (CostOptions.tp_overlap of MEGATRON_CORE_FAMILY), as the data say: for each value on `grid`, each source of
    those runtimes with train rows gets its own compute factor on them (a stack's GEMM efficiency is its own:
    FitResult), and the value scores by those sources' train rows at their own factors. The pooled factor cannot
    decide it: stacks two years apart pull it further than the overlap moves it. Returns value -> source file ->
    (own factor, mean |error| of its train rows)."""
    rows = [
        m
        for f in files or measurement_files()
        for m in read_measurements(f)
        if m.gpu == gpu.name and m.runtime in MEGATRON_CORE_FAMILY
    ]
    sources = [s for s in dict.fromkeys(m.file for m in rows) if any(m.file == s and m.split == "train" for m in rows)]
    out: dict[float, dict[str, tuple[float, float]]] = {}
    for value in grid:
        runtimes = {k: (replace(o, tp_overlap=value) if k in MEGATRON_CORE_FAMILY else o) for k, o in RUNTIMES.items()}
        evaluator = RowEvaluator(rows, gpu, runtimes)
        out[value] = {}
        for src in sources:
            train = evaluator.subset([i for i, m in enumerate(rows) if m.file == src and m.split == "train"])
            factor = fit_factor(train, gpu)
            out[value][src] = (factor, objective(train.predict(gpu.with_compute_factor(factor))))
    return out
