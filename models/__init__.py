from .attention import AttentionBatch, head_dim_of, layer_windows
from .cpu_llama import CPU_WEIGHTS, CpuLlama, cpu_forward, unsupported_reason as cpu_unsupported_reason
from .forward import forward_logits
from .fused_decoder import FusedDecoder, unsupported_reason as fused_unsupported_reason
from .loader import LoadedModel, load_model, load_tokenizer

__all__ = ["AttentionBatch", "CPU_WEIGHTS", "CpuLlama", "cpu_forward", "cpu_unsupported_reason", "FusedDecoder", "LoadedModel", "forward_logits", "fused_unsupported_reason", "head_dim_of", "layer_windows",
           "load_model", "load_tokenizer"]
