"""A decoder step with fused weights and kernels, for the Llama family and its relatives
(Qwen2, Qwen3, Gemma 3): five launches per layer for Llama's decode step, besides attention's.

transformers' layers launch about forty kernels per layer for one decode token (separate q, k, v
and gate, up projections; RMSNorm and rotary embedding as chains of elementwise ops); inside a
CUDA graph each launch still costs ~2 us, which at batch 1 is most of a step. This runs the same
weights as: the residual add and norm fused into one QKV matmul (its bias in the same call),
rotary embedding fused with the per-head q/k norms and the KV-cache write, attention over the
paged cache (over the layer's sliding window where it has one), the output projection, the
residual add and norm fused into one gate/up matmul that ends in the gated activation, and the
down projection. For a decode step's few rows the projections are our GEMV, which does the fusing;
for more rows they are cuBLAS's, with the norm and activation kernels around them. Gemma's extra
norms on the attention and MLP outputs add one launch each; its ``(1 + w)`` norm weights are
folded once into float32 weights.

The q/k/v and gate/up weights are concatenated once and the model's own modules are pointed at
views of them, so the model keeps working and holds one copy.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from kernels import layer_ops

from .attention import AttentionBatch, head_dim_of, prefill_attention


@dataclass(frozen=True)
class Family:
    norm_offset: float          # Gemma's RMSNorm scales by (1 + weight)
    sandwich_norms: bool        # Gemma: norms on the attention and MLP outputs before the residual add
    act_field: str              # the config field naming the MLP's activation


FAMILIES = {
    "llama": Family(0.0, False, "hidden_act"),
    "qwen2": Family(0.0, False, "hidden_act"),
    "qwen3": Family(0.0, False, "hidden_act"),
    "gemma3_text": Family(1.0, True, "hidden_activation"),
}


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot run fused, or None when it can."""
    cfg = model.config
    family = FAMILIES.get(cfg.model_type)
    if family is None:
        return f"model_type {cfg.model_type!r} is not one of {', '.join(FAMILIES)}"
    act = getattr(cfg, family.act_field)
    if act not in layer_ops.GATED_ACTIVATIONS:
        return f"{family.act_field} {act!r} is not one of {', '.join(layer_ops.GATED_ACTIVATIONS)}"
    if getattr(cfg, "mlp_bias", False):
        return "MLP projections with bias"
    layer = model.model.layers[0]
    if layer.self_attn.o_proj.bias is not None:
        return "output projection with bias"
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        return f"attention logit softcapping {cfg.attn_logit_softcapping}"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if cfg.hidden_size % 8 or cfg.intermediate_size % 8 or head_dim_of(cfg) % 8:
        return "hidden, intermediate or head size not a multiple of 8"
    return None


def _window(attn) -> int | None:
    return getattr(attn, "sliding_window", None) or None


def _rotary_tables(model, max_positions: int, head_dim: int, device) -> dict[str | None, torch.Tensor]:
    """Per layer type (None: one for all layers), ``[max_positions, D]`` float32: the cosines then
    the sines of the D/2 rotary frequencies, from the model's own rotary module (so rope scaling
    is whatever the model says)."""
    rotary = model.model.rotary_emb
    layer_types = getattr(rotary, "layer_types", None)
    positions = torch.arange(max_positions, device=device).unsqueeze(0)
    x = torch.zeros(1, dtype=torch.float32, device=device)
    pairs = {t: rotary(x, positions, t) for t in layer_types} if layer_types else {None: rotary(x, positions)}
    tables = {}
    half = head_dim // 2
    for layer_type, (cos, sin) in pairs.items():
        cos, sin = cos[0].float(), sin[0].float()
        if cos.shape[-1] != head_dim or not (torch.equal(cos[:, :half], cos[:, half:]) and
                                             torch.equal(sin[:, :half], sin[:, half:])):
            raise ValueError("cannot fuse this model: its rotary embedding is not rotate-half over the whole head")
        tables[layer_type] = torch.cat([cos[:, :half], sin[:, :half]], dim=-1).contiguous()
    return tables


def fuse_rows(tensors_of, linears, orders=None) -> torch.Tensor:
    """One tensor of the modules' ``tensors_of(lin)`` stacked, each one's rows in its order of
    ``orders`` (None: as they are); a module whose rows keep their order is pointed at its view,
    so the model holds those weights once and computes as before."""
    orders = orders or [None] * len(linears)
    parts = [tensors_of(lin) for lin in linears]
    fused = torch.cat([p.detach() if order is None else p.detach()[order] for p, order in zip(parts, orders)])
    row = 0
    for part, order in zip(parts, orders):
        rows = part.shape[0]
        if order is None:
            part.data = fused[row:row + rows]
        row += rows
    return fused


def _norm_weight(norm, family: Family) -> torch.Tensor:
    """The weight the norm kernels take: Gemma's ``1 + w`` in float32, as its norm computes it
    (the kernels then round once, as it does)."""
    if not family.norm_offset:
        return norm.weight
    return norm.weight.float() + family.norm_offset


@dataclass
class FusedLayer:
    norm_in: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: torch.Tensor
    attn_out_norm: torch.Tensor | None       # Gemma's post-attention norm (on the branch output)
    norm_mlp: torch.Tensor                  # the norm in front of the MLP
    gate_up: torch.Tensor
    down: torch.Tensor
    mlp_out_norm: torch.Tensor | None
    cos_sin: torch.Tensor
    window: int | None


class FusedDecoder:
    def __init__(self, model, max_positions: int):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"cannot fuse this model: {reason}")
        cfg = model.config
        family = FAMILIES[cfg.model_type]
        core = model.model
        self.num_q_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        self.eps = cfg.rms_norm_eps
        self.act = getattr(cfg, family.act_field)
        self.model_type = cfg.model_type
        self.scale = core.layers[0].self_attn.scaling
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        device = core.embed_tokens.weight.device
        tables = _rotary_tables(model, max_positions, self.head_dim, device)
        self.embed = core.embed_tokens.weight
        scale = getattr(core.embed_tokens, "embed_scale", None)    # Gemma: sqrt(hidden), in the weights' dtype
        self.embed_scale = None if scale is None else scale.to(device=device, dtype=self.embed.dtype)
        self.final_norm = _norm_weight(core.norm, family)
        self.lm_head = model.lm_head.weight
        layer_types = getattr(cfg, "layer_types", None)
        self.layers = []
        with torch.no_grad():
            for i, layer in enumerate(core.layers[:cfg.num_hidden_layers]):
                attn, mlp = layer.self_attn, layer.mlp
                if attn.scaling != self.scale:
                    raise ValueError(f"cannot fuse this model: layer {i} scales attention by {attn.scaling}, "
                                     f"layer 0 by {self.scale}")
                qkv_linears = [attn.q_proj, attn.k_proj, attn.v_proj]
                has_bias = attn.q_proj.bias is not None
                q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
                sandwich = family.sandwich_norms
                self.layers.append(FusedLayer(
                    norm_in=_norm_weight(layer.input_layernorm, family),
                    qkv=fuse_rows(lambda lin: lin.weight, qkv_linears),
                    qkv_bias=fuse_rows(lambda lin: lin.bias, qkv_linears) if has_bias else None,
                    q_norm=None if q_norm is None else _norm_weight(q_norm, family),
                    k_norm=None if k_norm is None else _norm_weight(k_norm, family),
                    o_proj=attn.o_proj.weight,
                    attn_out_norm=_norm_weight(layer.post_attention_layernorm, family) if sandwich else None,
                    norm_mlp=_norm_weight(layer.pre_feedforward_layernorm if sandwich
                                          else layer.post_attention_layernorm, family),
                    gate_up=fuse_rows(lambda lin: lin.weight, [mlp.gate_proj, mlp.up_proj]),
                    down=mlp.down_proj.weight,
                    mlp_out_norm=_norm_weight(layer.post_feedforward_layernorm, family) if sandwich else None,
                    cos_sin=tables[layer_types[i] if None not in tables else None],
                    window=_window(attn),
                ))

    @property
    def describe(self) -> str:
        windows = sorted({layer.window for layer in self.layers if layer.window})
        extras = [name for name, present in (
            ("q/k/v bias", self.layers[0].qkv_bias is not None), ("q/k norms", self.layers[0].q_norm is not None),
            ("sandwich norms", self.layers[0].attn_out_norm is not None),
            (f"sliding windows {windows}", bool(windows)), (self.act, True)) if present]
        return f"{self.model_type}: " + ", ".join(extras)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                 logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Same contract as ``forward_logits``: ids/positions ``[B, T]`` (int32), logits of the
        flattened rows ``logits_rows`` (all rows when None)."""
        ids, positions = input_ids.reshape(-1), positions.reshape(-1)
        tokens = ids.shape[0]
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        hidden = F.embedding(ids, self.embed)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        residual = None
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = batch.kv_caches[i]
            k_scale, v_scale = batch.layer_scales(i)
            if residual is None:
                residual = hidden
                qkv = layer_ops.linear(layer_ops.rms_norm(hidden, layer.norm_in, self.eps), layer.qkv, layer.qkv_bias)
            else:
                qkv, residual = layer_ops.add_rms_norm_linear(hidden, residual, layer.norm_in, self.eps, layer.qkv,
                                                              layer.qkv_bias)
            layer_ops.rope_write_kv(qkv, positions, layer.cos_sin, k_cache, v_cache, batch.slot_mapping, hq,
                                    q_norm=layer.q_norm, k_norm=layer.k_norm, eps=self.eps, k_scale=k_scale,
                                    v_scale=v_scale)
            q = qkv[:, :hq * d].unflatten(1, (hq, d))
            if batch.is_decode:
                attn = kernels.flash_decode(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                            scale=self.scale, workspace=batch.workspace, window=layer.window,
                                            k_scale=k_scale, v_scale=v_scale)
            else:
                k = qkv[:, hq * d:(hq + hkv) * d].unflatten(1, (hkv, d))
                v = qkv[:, (hq + hkv) * d:].unflatten(1, (hkv, d))
                attn = prefill_attention(q, k, v, self.scale, batch, k_cache, v_cache, k_scale, v_scale,
                                         window=layer.window)
            hidden = layer_ops.linear(attn.reshape(tokens, hq * d), layer.o_proj)
            if layer.attn_out_norm is not None:
                hidden = layer_ops.rms_norm(hidden, layer.attn_out_norm, self.eps)
            gated, residual = layer_ops.add_rms_norm_linear(hidden, residual, layer.norm_mlp, self.eps,
                                                            layer.gate_up, act=self.act)
            hidden = layer_ops.linear(gated, layer.down)
            if layer.mlp_out_norm is not None:
                hidden = layer_ops.rms_norm(hidden, layer.mlp_out_norm, self.eps)
        hidden, _ = layer_ops.add_rms_norm(hidden, residual, self.final_norm, self.eps)
        if logits_rows is not None:
            hidden = hidden[logits_rows]
        logits = layer_ops.linear(hidden, self.lm_head)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
