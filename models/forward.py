"""One forward pass of a Llama-family model over the paged cache.

The model's own layers run (their attention calls ``models.attention``); this driver skips
what a serving step does not need: transformers' cache objects, mask construction, and the
LM head on every position instead of only the ones sampled from.
"""

import torch

from .attention import AttentionBatch


def forward_logits(model, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                   logits_rows: torch.Tensor | None = None) -> torch.Tensor:
    """input_ids/positions ``[B, T]``; returns logits for the flattened rows ``logits_rows``
    (all rows when None)."""
    core = model.model
    hidden = core.embed_tokens(input_ids)
    position_embeddings = core.rotary_emb(hidden, position_ids=positions)
    for layer in core.layers[: model.config.num_hidden_layers]:
        hidden = layer(hidden, attention_mask=None, position_ids=positions,
                       position_embeddings=position_embeddings, attn_batch=batch)
        if isinstance(hidden, tuple):
            hidden = hidden[0]
    hidden = core.norm(hidden).flatten(0, 1)
    if logits_rows is not None:
        hidden = hidden[logits_rows]
    return model.lm_head(hidden)
