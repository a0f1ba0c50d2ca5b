"""Tiny Hugging Face models, one per family, built from config objects (no download), for the zoo suite.

Every family shares the same small shape (hidden 64, 4 query heads, 2 kv heads where the family has grouped-query
attention, 4 layers, vocabulary 128) so that tensor parallelism 2 and pipeline parallelism 2 divide it. `build`
takes the family name; `config_facts` states the facts the family's own config gives, for the test to compare
with what capture reads from the graph.
"""

from __future__ import annotations

HIDDEN, HEADS, KV_HEADS, LAYERS, VOCAB, FFN, CONTEXT = 64, 4, 2, 4, 128, 128, 64

DECODERS = (
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "gpt_neox",
    "falcon",
    "olmo2",
    "phi",
)
ENCODERS = ("bert",)  # ViT and T5 need their own example_inputs: hf_vit.py, hf_t5.py


def _decoder_config(family: str):
    import transformers as hf

    common = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "use_cache": False}
    gqa = {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "intermediate_size": FFN}
    ctx = {"max_position_embeddings": CONTEXT}
    if family == "gpt2":
        return hf.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=CONTEXT)
    if family == "llama":
        return hf.LlamaConfig(**common, **gqa, **ctx)
    if family == "mistral":
        return hf.MistralConfig(**common, **gqa, **ctx, sliding_window=16)
    if family == "qwen2":
        return hf.Qwen2Config(**common, **gqa, **ctx)
    if family == "qwen3":
        return hf.Qwen3Config(**common, **gqa, **ctx, head_dim=HIDDEN // HEADS)
    if family == "gemma2":
        return hf.Gemma2Config(**common, **gqa, **ctx, head_dim=HIDDEN // HEADS, sliding_window=8)
    if family == "gemma3":
        return hf.Gemma3TextConfig(**common, **gqa, **ctx, head_dim=HIDDEN // HEADS, sliding_window=8)
    if family == "phi3":
        return hf.Phi3Config(**common, **gqa, **ctx, original_max_position_embeddings=CONTEXT, pad_token_id=0)
    if family == "gpt_neox":
        return hf.GPTNeoXConfig(**common, **ctx, num_attention_heads=HEADS, intermediate_size=FFN)
    if family == "falcon":
        return hf.FalconConfig(
            **common,
            **ctx,
            num_attention_heads=HEADS,
            num_kv_heads=KV_HEADS,
            new_decoder_architecture=True,
        )
    if family == "olmo2":
        return hf.Olmo2Config(**common, **gqa, **ctx)
    if family == "phi":  # Phi-2: attention and MLP in parallel off one LayerNorm, partial rotary
        return hf.PhiConfig(**common, **ctx, num_attention_heads=HEADS, intermediate_size=FFN, pad_token_id=0)
    raise ValueError(f"unknown decoder family {family!r}")


def config_facts(family: str) -> dict[str, int]:
    """hidden, heads, kv heads, head dim and vocabulary as the family's config states them."""
    kv = KV_HEADS if family not in ("gpt2", "gpt_neox", "bert", "phi") else HEADS
    return {"hidden": HIDDEN, "heads": HEADS, "kv_heads": kv, "head_dim": HIDDEN // HEADS, "vocab": VOCAB}


def build(family: str = "llama", default_cache: bool = False):
    """A freshly initialised tiny model of `family` (a causal LM head for decoders); `default_cache` leaves the
    config's use_cache at transformers' default (True), as a user's model file would."""
    import transformers as hf

    if family in DECODERS:
        cfg = _decoder_config(family)
        if default_cache:
            cfg.use_cache = True
        return hf.AutoModelForCausalLM.from_config(cfg)
    if family == "bert":
        cfg = hf.BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            intermediate_size=FFN,
            max_position_embeddings=CONTEXT,
        )
        return hf.BertForMaskedLM(cfg)
    raise ValueError(f"unknown family {family!r}")
