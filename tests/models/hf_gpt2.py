"""HF GPT-2 (transformers' GPT2LMHeadModel) built from a config: no download. Conv1D projections, tied head."""

from __future__ import annotations

from typing import Any


def build_model(**kwargs: Any):
    from transformers import GPT2Config, GPT2LMHeadModel

    defaults = dict(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=64,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    config = GPT2Config(**{**defaults, **kwargs})
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)
