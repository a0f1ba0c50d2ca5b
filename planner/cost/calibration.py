"""Calibration against Narayanan et al. 2021 (Megatron-LM), Table 1: predicted vs published TFLOP/s per GPU.

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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mlm.planner.capture.presets.gpt import GPT, CausalSelfAttention, GPTConfig
from mlm.planner.capture.presets.registry import PRESETS
from mlm.planner.cost.hardware import ClusterProfile, GPUProfile
from mlm.planner.cost.inputs import ModelCostInputs
from mlm.planner.cost.step_time import MEGATRON_2021, CostOptions, Evaluation, evaluate, summarize
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
