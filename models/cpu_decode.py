"""One decoder layer of a one-sequence CPU decode step, compiled by ``torch.compile``.

Run eagerly, a B=1 decode step of the embedded model spends more time dispatching its fifty-odd
small ops per layer (norms, rotary embedding, the split softmax, casts and adds, a few
microseconds each) than in its int4 matmuls (docs/cpu.md, The one-sequence decode step).
Inductor compiles this layer into a few C++ loops around the int4 matmuls, the same arithmetic up
to the order of its sums.

Attention is the split-KV algorithm with one split per cached block and one more for the new
token: its key and value form a split of one row (partial output: its value; log-sum-exp: its
score), merged exactly with the others. So the layer reads the cache before the new row is
written, and the caller writes it: a cache row written inside the graph would make inductor copy
the whole cache tensor.
"""

import functools

import torch
import torch.nn.functional as F

from .quantized import int4_matmul


def rms_norm_row(x: torch.Tensor, weight_sqrt_h: torch.Tensor, h_eps: torch.Tensor) -> torch.Tensor:
    """``x [1, H]`` normalised, scaled by the norm weight, as bfloat16 (the int4 matmul's input):
    ``x / sqrt(x . x + H eps) * (w sqrt(H))``, as ``CpuLlama``'s eager norm computes it."""
    return (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + h_eps) * weight_sqrt_h).to(torch.bfloat16)


def decode_layer(residual, norm_in, h_eps_in, qkv, cos, sin, qk_scale, k_cache, v_cache, block_ids, cached,
                 o_proj, norm_post, h_eps_post, gate_up, down, num_q_heads: int):
    """One layer for one new token.

    residual ``[1, H]`` float32; norm weights pre-scaled by sqrt(H); ``qkv``, ``o_proj``,
    ``gate_up``, ``down``: int4 parts (``Int4Linear.parts``); ``cos``/``sin`` ``[D/2]`` the new
    position's rotation, ``qk_scale [Hq + Hkv, 1]`` the attention scale for the query heads (1 for
    the key heads); the layer's caches ``[num_blocks, Hkv, block_size, D]``, ``block_ids [n]``
    (int64) the blocks holding the sequence's ``cached`` tokens (a 0-d int64 tensor), each block
    at least one. Returns the new residual and the new token's key and value ``[Hkv, D]``.
    """
    keys, values = k_cache[block_ids], v_cache[block_ids]                    # [n, Hkv, bs, D]
    n, num_kv_heads, block_size, head_dim = keys.shape
    heads = num_q_heads + num_kv_heads
    group = num_q_heads // num_kv_heads
    proj = int4_matmul(rms_norm_row(residual, norm_in, h_eps_in), qkv)
    qk = proj[0, :heads * head_dim].float().view(heads, head_dim // 2, 2)    # interleaved rotary pairs
    re, im = qk[..., 0], qk[..., 1]
    c, s = cos * qk_scale, sin * qk_scale
    qk = torch.stack([re * c - im * s, re * s + im * c], dim=-1).view(heads, head_dim)
    q = qk[:num_q_heads].view(num_kv_heads, group, head_dim)
    key = qk[num_q_heads:]
    value = proj[0, heads * head_dim:].float().view(num_kv_heads, head_dim)

    past_end = torch.arange(n * block_size, device=keys.device).view(n, 1, 1, block_size) >= cached
    scores = (q.view(1, num_kv_heads, group, 1, head_dim) * keys.view(n, num_kv_heads, 1, block_size, head_dim)
              ).sum(-1).masked_fill(past_end, float("-inf"))                 # [n, Hkv, G, bs]
    m = scores.amax(-1, keepdim=True)
    p = (scores - m).exp()
    l = p.sum(-1, keepdim=True)
    o = (p.unsqueeze(-1) * values.view(n, num_kv_heads, 1, block_size, head_dim)).sum(-2)   # [n, Hkv, G, D]
    own = (q * key.view(num_kv_heads, 1, head_dim)).sum(-1, keepdim=True)     # the new token's split
    weights = torch.softmax(torch.cat([m + torch.log(l), own.unsqueeze(0)]), dim=0)
    o = (o / l * weights[:n]).sum(0) + weights[n] * value.view(num_kv_heads, 1, head_dim)

    residual = residual + int4_matmul(o.reshape(1, num_q_heads * head_dim).to(torch.bfloat16), o_proj)
    gu = int4_matmul(rms_norm_row(residual, norm_post, h_eps_post), gate_up)
    half = gu.shape[-1] // 2
    residual = residual + int4_matmul(F.silu(gu[:, :half]) * gu[:, half:], down)
    return residual, key, value


@functools.cache
def compiled_decode_layer():
    """``decode_layer`` under ``torch.compile``, made on first use: importing inductor takes over
    a second, which the processes that never decode (the HTTP workers) need not pay."""
    return torch.compile(decode_layer)


def mark_sizes(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Compile for any pool size: an engine of another size finds the compiled code in inductor's
    cache instead of compiling anew (the marks stay on the engine's cache tensors)."""
    for k_cache, v_cache in kv_caches:
        torch._dynamo.mark_dynamic(k_cache, 0)
        torch._dynamo.mark_dynamic(v_cache, 0)


def mark_block_count(block_ids: torch.Tensor) -> None:
    """Compile for any number of a sequence's blocks, one included (as data-dependent: no
    recompiling when a sequence reaches its second block)."""
    torch._dynamo.decorators.mark_unbacked(block_ids, 0)
