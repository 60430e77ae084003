"""One forward pass of a decoder-only model (Llama, Qwen2/3, Gemma 3) over the paged cache.

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
    core, cfg = model.model, model.config
    hidden = core.embed_tokens(input_ids)
    layer_types = getattr(core.rotary_emb, "layer_types", None)     # Gemma 3: a rotary table per layer type
    if layer_types:
        tables = {t: core.rotary_emb(hidden, positions, t) for t in layer_types}
        position_embeddings = [tables[t] for t in cfg.layer_types]
    else:
        position_embeddings = [core.rotary_emb(hidden, position_ids=positions)] * cfg.num_hidden_layers
    for layer, rotary in zip(core.layers[: cfg.num_hidden_layers], position_embeddings):
        hidden = layer(hidden, attention_mask=None, position_ids=positions,
                       position_embeddings=rotary, attn_batch=batch)
        if isinstance(hidden, tuple):
            hidden = hidden[0]
    hidden = core.norm(hidden).flatten(0, 1)
    if logits_rows is not None:
        hidden = hidden[logits_rows]
    logits = model.lm_head(hidden)
    softcap = getattr(cfg, "final_logit_softcapping", None)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits
