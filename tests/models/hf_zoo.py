"""Tiny Hugging Face decoders with unusual head layouts, built from config objects (no download)."""


def build_falcon(multi_query=True, new_decoder_architecture=False, num_kv_heads=None, num_attention_heads=4):
    """Falcon-7B is multi-query (one kv head); Falcon-40B/180B use the new architecture with grouped kv heads."""
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(
        vocab_size=112,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_kv_heads=num_kv_heads,
        multi_query=multi_query,
        new_decoder_architecture=new_decoder_architecture,
        max_position_embeddings=48,
        use_cache=False,
    )
    return FalconForCausalLM(cfg)


def build_t5():
    """An encoder-decoder whose forward needs decoder inputs mlm cannot guess from token ids alone."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, use_cache=False)
    return T5ForConditionalGeneration(cfg)


def build_mistral(sliding_window=16, max_position_embeddings=64):
    """Mistral attends to a sliding window of the last `sliding_window` positions in every layer."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=4,
        sliding_window=sliding_window,
        max_position_embeddings=max_position_embeddings,
        use_cache=False,
    )
    return MistralForCausalLM(cfg)


def build_bert():
    """A bidirectional encoder (masked language model): every position attends to every other."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    return BertForMaskedLM(cfg)


def build_opt():
    """OPT's decoder layer flattens batch and sequence into one dimension before its MLP."""
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=128,
        max_position_embeddings=64,
        word_embed_proj_dim=64,
        use_cache=False,
    )
    return OPTForCausalLM(cfg)


def build_xglm():
    """XGLM computes attention scores with the heads folded into the batch dimension (3-D bmm)."""
    from transformers import XGLMConfig, XGLMForCausalLM

    cfg = XGLMConfig(
        vocab_size=128, d_model=64, num_layers=2, attention_heads=4, ffn_dim=128, max_position_embeddings=64
    )
    cfg.use_cache = False
    return XGLMForCausalLM(cfg)
