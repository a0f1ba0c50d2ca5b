"""Tiny T5 (encoder-decoder) with the inputs its forward needs: encoder token ids and decoder token ids."""

import torch


def build_model(num_layers=2, d_model=32, d_kv=8, num_heads=4, vocab_size=96):
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=d_kv,
        d_ff=64,
        num_layers=num_layers,
        num_heads=num_heads,
        use_cache=False,
    )
    return T5ForConditionalGeneration(cfg)


def example_inputs(batch_size, seq_len):
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    return {"input_ids": ids, "decoder_input_ids": ids}, ids
