"""Writing a model's float32 weights as a GGUF file laid out as llama.cpp's converter lays them out
(so transformers' GGUF loader reads it back as it reads published files), for loading tests."""

import functools
from pathlib import Path

import gguf
import numpy as np

from models.attention import head_dim_of
from models.gguf_rope import ROPE_FREQS, llama3_divisors
from models.sources import embedded_gguf_path

GGUF_ARCH = {"llama": ("llama", gguf.MODEL_ARCH.LLAMA), "qwen2": ("qwen2", gguf.MODEL_ARCH.QWEN2),
             "qwen3": ("qwen3", gguf.MODEL_ARCH.QWEN3), "gemma3_text": ("gemma3", gguf.MODEL_ARCH.GEMMA3)}


def _interleave_heads(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores Llama's q and k rows per head as interleaved rotary pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@functools.cache
def _embedded_tokenizer_fields() -> list[tuple[str, object, gguf.GGUFValueType]]:
    """The SmolLM2 tokenizer (the random presets' tokenizer) and its chat template, from the
    embedded GGUF (parsed once per session: seconds)."""
    reader = gguf.GGUFReader(embedded_gguf_path())
    return [(key, field.contents(), field.types[0]) for key, field in reader.fields.items()
            if key.startswith("tokenizer.")]


def _copy_tokenizer(writer: gguf.GGUFWriter) -> None:
    for key, value, kind in _embedded_tokenizer_fields():
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)


def write_gguf(model, path: Path) -> Path:
    cfg = model.config
    name, arch = GGUF_ARCH[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), name)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_key_length(head_dim_of(cfg))
    writer.add_value_length(head_dim_of(cfg))
    if name == "llama":
        writer.add_rope_dimension_count(head_dim_of(cfg))
    if name == "gemma3":
        writer.add_sliding_window(cfg.sliding_window)
    _copy_tokenizer(writer)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        data = tensor.float().numpy().copy()
        if name == "llama" and gguf_name.endswith("attn_q.weight"):
            data = _interleave_heads(data, cfg.num_attention_heads)
        elif name == "llama" and gguf_name.endswith("attn_k.weight"):
            data = _interleave_heads(data, cfg.num_key_value_heads)
        elif name == "gemma3" and gguf_name.endswith("norm.weight"):
            data = data + 1.0                           # llama.cpp stores Gemma's (1 + w)
        writer.add_tensor(gguf_name, data)
    if rope.get("rope_type") == "llama3":      # llama.cpp's form: the divisors as a tensor, no parameters
        divisors = llama3_divisors(rope["rope_theta"], head_dim_of(cfg), rope["factor"], rope["low_freq_factor"],
                                   rope["high_freq_factor"], rope["original_max_position_embeddings"])
        writer.add_tensor(ROPE_FREQS, divisors.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
