"""Tiny Hugging Face Whisper (speech encoder-decoder): log-mel features of a fixed length, decoder token ids of
seq_len, next-token targets."""

import torch
import torch.nn.functional as F

MELS, FRAMES, VOCAB = 16, 64, 128


def build_model():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=MELS,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=FRAMES // 2,
        max_target_positions=64,
        use_cache=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    return WhisperForConditionalGeneration(cfg)


def example_inputs(batch_size, seq_len):
    ids = torch.randint(3, VOCAB, (batch_size, seq_len + 1))
    features = torch.randn(batch_size, MELS, FRAMES)
    return {"input_features": features, "decoder_input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, batch):
    return F.cross_entropy(output.logits.float().flatten(0, 1), batch[1].flatten())
