"""Llama 3's rope scaling in GGUF files: llama.cpp's converter stores it as a tensor of
per-frequency divisors (``rope_freqs.weight``) and no parameters, and transformers' GGUF loader
ignores that tensor, so a Llama 3.x file would load with unscaled rotary frequencies. The
parameters are recovered here by finding the llama3 scaling that gives exactly those divisors."""

import itertools

import numpy as np
import torch
from gguf import GGUFReader
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

ROPE_FREQS = "rope_freqs.weight"
# The published Llama 3.x models use low 1, high 4, original context 8192 (factor 8 or 32).
LOW_FREQ_FACTORS = (1.0, 2.0, 4.0)
HIGH_FREQ_FACTORS = (1.0, 2.0, 4.0, 8.0)
ORIGINAL_CONTEXTS = (8192, 2048, 4096, 16384, 32768)


def llama3_divisors(theta: float, head_dim: int, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """The divisors of the default rotary frequencies that transformers' llama3 scaling applies."""
    config = LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
                         rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": factor,
                                          "low_freq_factor": low, "high_freq_factor": high,
                                          "original_max_position_embeddings": original})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    default = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return (default / scaled).numpy()


def llama3_rope_parameters(reader: GGUFReader, name: str, config) -> dict | None:
    """The llama3 ``rope_parameters`` that the ``rope_freqs`` tensor of the file ``name`` (read by
    ``reader``) encodes; None when it has none. A tensor no llama3 scaling explains is refused."""
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    divisors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if divisors.shape[0] != head_dim // 2:
        raise ValueError(f"{name}: {ROPE_FREQS} has {divisors.shape[0]} entries, head_dim {head_dim} needs "
                         f"{head_dim // 2}")
    theta = config.rope_parameters["rope_theta"]
    factor = float(divisors.max())
    for low, high, original in itertools.product(LOW_FREQ_FACTORS, HIGH_FREQ_FACTORS, ORIGINAL_CONTEXTS):
        if high <= low:
            continue
        if np.allclose(llama3_divisors(theta, head_dim, factor, low, high, original), divisors, rtol=1e-4):
            return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": original}
    raise ValueError(f"{name}: its {ROPE_FREQS} matches no llama3 rope scaling (factor {factor})")
