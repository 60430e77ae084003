"""Random-weight models of real architectures, for benchmarks and tests on hosts without weights.

``random:<preset>`` builds the published configuration of each model (head layout, norms, rope
settings, activation, biases, tied head, sliding windows) with random weights; ``<preset>@<n>``
keeps its first ``n`` layers (with their layer types), for tests that need speed.
"""

from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

_SMOLLM2_TOKENS = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
_LLAMA_COMMON = dict(**_SMOLLM2_TOKENS, rms_norm_eps=1e-5, hidden_act="silu", attention_bias=False, mlp_bias=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
_QWEN_TOKENS = dict(vocab_size=151936, bos_token_id=151643, eos_token_id=151645, rms_norm_eps=1e-6,
                    hidden_act="silu", use_sliding_window=False)

# Gemma 3's pattern: five sliding-window layers, then one global layer.
def _gemma3_layer_types(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]


PRESETS = {
    # SmolLM2-135M-Instruct's architecture, with a long context for long-prompt benchmarks.
    "smollm2-135m": (LlamaConfig, dict(
        _LLAMA_COMMON, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=65536, tie_word_embeddings=True)),
    # Llama-3-style attention (32 query heads, 8 KV heads, head_dim 128), few layers.
    "llama-gqa128": (LlamaConfig, dict(
        _LLAMA_COMMON, hidden_size=4096, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=65536, tie_word_embeddings=False)),
    # A two-layer toy with the SmolLM2 head layout, for fast tests.
    "tiny": (LlamaConfig, dict(
        _LLAMA_COMMON, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=True)),
    # SmolLM2-360M-Instruct: 15 query heads on 5 KV heads.
    "smollm2-360m": (LlamaConfig, dict(
        _LLAMA_COMMON, hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
        num_key_value_heads=5, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)),
    # SmolLM2-1.7B-Instruct: 32 heads, no grouping.
    "smollm2-1.7b": (LlamaConfig, dict(
        _LLAMA_COMMON | {"rope_parameters": {"rope_type": "default", "rope_theta": 130000.0}},
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=32, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True)),
    # Llama-3.2-1B-Instruct: llama3 rope scaling, tied head.
    "llama3.2-1b": (LlamaConfig, dict(
        vocab_size=128256, bos_token_id=128000, eos_token_id=[128001, 128008, 128009], rms_norm_eps=1e-5,
        hidden_act="silu", attention_bias=False, mlp_bias=False, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    # Qwen2.5-0.5B-Instruct: q/k/v biases, 14 query heads on 2 KV heads.
    "qwen2.5-0.5b": (Qwen2Config, dict(
        _QWEN_TOKENS, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, sliding_window=32768, max_window_layers=21,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Qwen3-0.6B: per-head q/k RMSNorm, head_dim 128 on a 1024-wide model.
    "qwen3-0.6b": (Qwen3Config, dict(
        _QWEN_TOKENS, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, sliding_window=None,
        max_window_layers=28, attention_bias=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Gemma-3-270M-IT: GeGLU, (1 + w) sandwich norms, q/k norms, scaled embeddings, head_dim 256,
    # one KV head, window-512 local layers (rope base 10k) and global ones (1M).
    "gemma3-270m": (Gemma3TextConfig, dict(
        vocab_size=262144, bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0, hidden_size=640,
        intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=32768, rms_norm_eps=1e-6,
        query_pre_attn_scalar=256, sliding_window=512, attention_bias=False, final_logit_softcapping=None,
        attn_logit_softcapping=None, use_bidirectional_attention=False, tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}

# The presets of the popular small architectures (the benchmark's and the equivalence tests' list).
ARCHITECTURES = ("qwen2.5-0.5b", "qwen3-0.6b", "llama3.2-1b", "gemma3-270m", "smollm2-360m", "smollm2-1.7b")


def parse_preset(spec: str) -> tuple[str, int | None]:
    """``name`` or ``name@layers``."""
    name, sep, layers = spec.partition("@")
    if name not in PRESETS:
        raise ValueError(f"unknown random preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    if not sep:
        return name, None
    if not layers.isdigit() or int(layers) < 1:
        raise ValueError(f"layer count {layers!r} in random preset {spec!r} is not a positive integer")
    full = PRESETS[name][1]["num_hidden_layers"]
    if int(layers) > full:
        raise ValueError(f"random preset {spec!r} asks for {layers} layers; {name} has {full}")
    return name, int(layers)


def preset_config(spec: str):
    name, layers = parse_preset(spec)
    config_class, fields = PRESETS[name]
    fields = dict(fields)
    if layers is not None:
        fields["num_hidden_layers"] = layers
    if config_class is Gemma3TextConfig:
        fields["layer_types"] = _gemma3_layer_types(fields["num_hidden_layers"])
    return config_class(**fields)
