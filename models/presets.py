"""Random-weight models of real architectures, for benchmarks on hosts without weights."""

from transformers import LlamaConfig

PRESETS = {
    # SmolLM2-135M-Instruct's architecture, with a long context for long-prompt benchmarks.
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=65536, tie_word_embeddings=True),
    # Llama-3-style attention (32 query heads, 8 KV heads, head_dim 128), few layers.
    "llama-gqa128": dict(hidden_size=4096, intermediate_size=8192, num_hidden_layers=4,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=65536, tie_word_embeddings=False),
    # A two-layer toy with the SmolLM2 head layout, for fast tests.
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 max_position_embeddings=4096, tie_word_embeddings=True),
}

COMMON = dict(vocab_size=49152, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
              rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, hidden_act="silu",
              attention_bias=False, mlp_bias=False)


def preset_config(name: str) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown random preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return LlamaConfig(**COMMON, **PRESETS[name])
