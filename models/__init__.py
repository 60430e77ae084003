from .attention import AttentionBatch
from .forward import forward_logits
from .fused_llama import FusedLlama, unsupported_reason as fused_unsupported_reason
from .loader import LoadedModel, load_model, load_tokenizer

__all__ = ["AttentionBatch", "FusedLlama", "LoadedModel", "forward_logits", "fused_unsupported_reason", "load_model", "load_tokenizer"]
