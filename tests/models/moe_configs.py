"""Tiny Hugging Face mixtures built from config objects (no download), with the knobs the MoE tests vary."""


def build_qwen3_moe(layers=3, mlp_only_layers=(0,), experts=8, top_k=2, dropout=0.0):
    """Qwen3-MoE: blocks listed in mlp_only_layers keep a dense SwiGLU, the others route to experts (attention
    dropout `dropout`)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        mlp_only_layers=list(mlp_only_layers),
        num_experts=experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=64,
        attention_dropout=dropout,
        use_cache=False,
    )
    return Qwen3MoeForCausalLM(cfg)


def build_deepseek_v3(layers=3, v_head_dim=8, qk_nope_head_dim=8, qk_rope_head_dim=8):
    """DeepSeek-V3: one dense block, then MoE blocks with a shared expert; multi-head latent attention."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=128,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=qk_rope_head_dim,
        qk_nope_head_dim=qk_nope_head_dim,
        v_head_dim=v_head_dim,
        max_position_embeddings=64,
        use_cache=False,
    )
    return DeepseekV3ForCausalLM(cfg)


def build_gpt_oss(layers=2, dropout=0.0):
    """GPT-OSS: per-head attention sinks (a parameter of the attention module itself), experts with biases, and
    sliding-window layers alternating with full attention (attention dropout `dropout`)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
        attention_dropout=dropout,
    )
    return GptOssForCausalLM(cfg)
