"""A Llama-family decoder step with fused weights and kernels: ten launches per layer.

transformers' layers launch about forty kernels per layer for one decode token (separate q, k, v
and gate, up projections; RMSNorm and rotary embedding as chains of elementwise ops); inside a
CUDA graph each launch still costs ~2 us, which at batch 1 is most of a step. This runs the same
weights as: norm fused with the residual add, one QKV matmul, rotary embedding fused with the
KV-cache write, attention over the paged cache, the output projection, norm, one gate/up matmul,
SiLU-and-multiply, the down projection (for a decode step's few rows the projections are our GEMV,
the last one applying SiLU-and-multiply to its input: eight launches). The q/k/v and gate/up weights are concatenated once and
the model's own modules are pointed at views of them, so the model keeps working and holds one copy.
"""

import torch
import torch.nn.functional as F

import kernels
from kernels import layer_ops

from .attention import AttentionBatch, head_dim_of, prefill_attention


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot run fused, or None when it can."""
    cfg = model.config
    if cfg.model_type != "llama":
        return f"model_type {cfg.model_type!r} is not llama"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "projections with bias"
    if cfg.hidden_act != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if cfg.hidden_size % 8 or cfg.intermediate_size % 8:
        return "hidden or intermediate size not a multiple of 8"
    return None


def _rotary_table(model, max_positions: int, head_dim: int, device) -> torch.Tensor | None:
    """``[max_positions, D]`` float32: the cosines then the sines of the D/2 rotary frequencies,
    from the model's own rotary module (so rope scaling is whatever the model says)."""
    positions = torch.arange(max_positions, device=device).unsqueeze(0)
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32, device=device), positions)
    cos, sin = cos[0].float(), sin[0].float()
    half = head_dim // 2
    if cos.shape[-1] != head_dim or not (torch.equal(cos[:, :half], cos[:, half:]) and
                                         torch.equal(sin[:, :half], sin[:, half:])):
        return None                                  # not the rotate-half layout over the whole head
    return torch.cat([cos[:, :half], sin[:, :half]], dim=-1).contiguous()


def _fuse(linears) -> torch.Tensor:
    fused = torch.cat([lin.weight.detach() for lin in linears]).contiguous()
    row = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[row:row + rows]
        row += rows
    return fused


class FusedLlama:
    def __init__(self, model, max_positions: int):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"cannot fuse this model: {reason}")
        cfg = model.config
        core = model.model
        self.num_q_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        self.scale = core.layers[0].self_attn.scaling
        self.eps = cfg.rms_norm_eps
        device = core.embed_tokens.weight.device
        self.cos_sin = _rotary_table(model, max_positions, self.head_dim, device)
        if self.cos_sin is None:
            raise ValueError("cannot fuse this model: its rotary embedding is not rotate-half over the whole head")
        self.embed = core.embed_tokens.weight
        self.final_norm = core.norm.weight
        self.lm_head = model.lm_head.weight
        self.layers = []
        with torch.no_grad():
            for layer in core.layers[:cfg.num_hidden_layers]:
                attn, mlp = layer.self_attn, layer.mlp
                self.layers.append((
                    layer.input_layernorm.weight,
                    _fuse([attn.q_proj, attn.k_proj, attn.v_proj]),
                    attn.o_proj.weight,
                    layer.post_attention_layernorm.weight,
                    _fuse([mlp.gate_proj, mlp.up_proj]),
                    mlp.down_proj.weight,
                ))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                 logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Same contract as ``forward_logits``: ids/positions ``[B, T]`` (int32), logits of the
        flattened rows ``logits_rows`` (all rows when None)."""
        ids, positions = input_ids.reshape(-1), positions.reshape(-1)
        tokens = ids.shape[0]
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        hidden = F.embedding(ids, self.embed)
        residual = None
        for i, (norm_in, qkv_w, o_w, norm_post, gate_up_w, down_w) in enumerate(self.layers):
            k_cache, v_cache = batch.kv_caches[i]
            k_scale, v_scale = batch.layer_scales(i)
            if residual is None:
                residual, hidden = hidden, layer_ops.rms_norm(hidden, norm_in, self.eps)
            else:
                layer_ops.add_rms_norm(hidden, residual, norm_in, self.eps)
            qkv = layer_ops.linear(hidden, qkv_w)
            layer_ops.rope_write_kv(qkv, positions, self.cos_sin, k_cache, v_cache, batch.slot_mapping, hq,
                                    k_scale, v_scale)
            q = qkv[:, :hq * d].unflatten(1, (hq, d))
            if batch.is_decode:
                attn = kernels.flash_decode(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                            scale=self.scale, workspace=batch.workspace, k_scale=k_scale,
                                            v_scale=v_scale)
            else:
                k = qkv[:, hq * d:(hq + hkv) * d].unflatten(1, (hkv, d))
                v = qkv[:, (hq + hkv) * d:].unflatten(1, (hkv, d))
                attn = prefill_attention(q, k, v, self.scale, batch, k_cache, v_cache, k_scale, v_scale)
            hidden = layer_ops.linear(attn.reshape(tokens, hq * d), o_w)
            layer_ops.add_rms_norm(hidden, residual, norm_post, self.eps)
            hidden = layer_ops.silu_mul_linear(layer_ops.linear(hidden, gate_up_w), down_w)
        layer_ops.add_rms_norm(hidden, residual, self.final_norm, self.eps)
        if logits_rows is not None:
            hidden = hidden[logits_rows]
        return layer_ops.linear(hidden, self.lm_head)
