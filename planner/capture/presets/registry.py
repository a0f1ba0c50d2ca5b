"""Built-in presets: a name maps to a model.py-style file in this folder plus its default arguments.

Sources: GPT-2 124M (Radford et al. 2019, nanoGPT's config); GPT-3 175B (Brown et al. 2020, Table 2.1, with
V=51200 and s=2048 as in Narayanan et al. 2021); Llama 3 8B/70B/405B (Llama Team 2024, "The Llama 3 Herd of
Models", Table 3); megatron-* are the rows of Narayanan et al. 2021 Table 1 (s=2048, V=51200); Mixtral 8x7B and
8x22B (Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088, Table 1, and the released configs: 8 SwiGLU
experts, top-2, rope theta 1e6); Qwen3-30B-A3B (Qwen Team 2025, "Qwen3 Technical Report", arXiv:2505.09388, Table 2,
and the released config: 48 layers, 32 query / 4 kv heads of 128, 128 experts of 768, top-8, q/k RMSNorm).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Preset:
    file: str  # file name inside mlm/planner/capture/presets
    args: dict[str, Any] = field(default_factory=dict)
    global_batch: int = 512  # the batch the source trained with, used when --global-batch is not given
    description: str = ""


def _megatron(heads: int, hidden: int, layers: int, batch: int, label: str) -> Preset:
    return Preset(
        "gpt.py",
        dict(n_layer=layers, n_head=heads, n_embd=hidden, vocab_size=51200, block_size=2048, bias=True),
        batch,
        f"Megatron-LM {label} GPT (Narayanan et al. 2021, Table 1)",
    )


def _llama(dim: int, layers: int, heads: int, ffn: int, batch: int, label: str) -> Preset:
    return Preset(
        "llama.py",
        dict(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=8, vocab_size=128256, ffn_dim=ffn, max_seq_len=8192),
        batch,
        f"Llama 3 {label} (Llama Team 2024)",
    )


PRESETS: dict[str, Preset] = {
    "gpt2": Preset(
        "gpt.py",
        dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024),
        512,
        "GPT-2 124M (nanoGPT configuration)",
    ),
    "gpt3-175b": Preset(
        "gpt.py",
        dict(n_layer=96, n_head=96, n_embd=12288, vocab_size=51200, block_size=2048),
        1536,
        "GPT-3 175B (Brown et al. 2020; V=51200, s=2048 as in Narayanan et al. 2021)",
    ),
    "llama3-8b": _llama(4096, 32, 32, 14336, 512, "8B"),
    "llama3-70b": _llama(8192, 80, 64, 28672, 1024, "70B"),
    "llama3-405b": _llama(16384, 126, 128, 53248, 2048, "405B"),
    "mixtral-8x7b": Preset(
        "llama.py",
        dict(
            dim=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            vocab_size=32000,
            ffn_dim=14336,
            rope_theta=1e6,
            max_seq_len=32768,
            n_experts=8,
            top_k=2,
        ),
        256,
        "Mixtral 8x7B (Jiang et al. 2024): 46.7B parameters, 12.9B active, 8 experts top-2",
    ),
    "mixtral-8x22b": Preset(
        "llama.py",
        dict(
            dim=6144,
            n_layers=56,
            n_heads=48,
            n_kv_heads=8,
            vocab_size=32768,
            ffn_dim=16384,
            rope_theta=1e6,
            max_seq_len=65536,
            n_experts=8,
            top_k=2,
        ),
        256,
        "Mixtral 8x22B (Mistral AI 2024): 141B parameters, 39B active, 8 experts top-2",
    ),
    "qwen3-30b-a3b": Preset(
        "llama.py",
        dict(
            dim=2048,
            n_layers=48,
            n_heads=32,
            n_kv_heads=4,
            head_dim=128,
            qk_norm=True,
            vocab_size=151936,
            ffn_dim=6144,
            norm_eps=1e-6,
            rope_theta=1e6,
            max_seq_len=40960,
            n_experts=128,
            top_k=8,
            moe_ffn_dim=768,
        ),
        512,
        "Qwen3-30B-A3B (Qwen Team 2025): 30.5B parameters, 3.3B active, 128 experts top-8",
    ),
    "megatron-1.7b": _megatron(24, 2304, 24, 512, "1.7B"),
    "megatron-3.6b": _megatron(32, 3072, 30, 512, "3.6B"),
    "megatron-7.5b": _megatron(32, 4096, 36, 512, "7.5B"),
    "megatron-18.4b": _megatron(48, 6144, 40, 1024, "18.4B"),
    "megatron-39.1b": _megatron(64, 8192, 48, 1536, "39.1B"),
    "megatron-76.1b": _megatron(80, 10240, 60, 1792, "76.1B"),
    "megatron-145.6b": _megatron(96, 12288, 80, 2304, "145.6B"),
    "megatron-310.1b": _megatron(128, 16384, 96, 2160, "310.1B"),
    "megatron-529.6b": _megatron(128, 20480, 105, 2520, "529.6B"),
    "megatron-1t": _megatron(160, 25600, 128, 3072, "1T"),
}
