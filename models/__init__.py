from .attention import AttentionBatch
from .forward import forward_logits
from .loader import LoadedModel, load_model, load_tokenizer

__all__ = ["AttentionBatch", "LoadedModel", "forward_logits", "load_model", "load_tokenizer"]
