"""The small per-layer ops around attention: RMSNorm (optionally fused with the residual add),
SiLU-and-multiply, rotary embedding fused with the KV-cache write, and the projections of a
decode step's few rows (a GEMV that can also apply SiLU-and-multiply to its input).

CUDA tensors run the kernels in ``csrc/layer_ops.cu`` (ops ``torch.ops.flashdecode.*``); CPU
tensors run the same arithmetic in PyTorch. Rounding follows transformers' Llama modules.
"""

import torch
import torch.nn.functional as F

from .kv_quant import check_kv_scales
from .reference import reference_write_kv


def _load(device: torch.device) -> None:
    from . import ops
    ops.load(device)


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dim of ``x [rows, hidden]``."""
    if x.is_cuda:
        _load(x.device)
        return torch.ops.flashdecode.rms_norm(x, weight, eps)
    return _rms_norm_torch(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual += x``, then ``x = rms_norm(residual)``."""
    if x.is_cuda:
        _load(x.device)
        torch.ops.flashdecode.add_rms_norm(x, residual, weight, eps)
        return
    residual.add_(x)
    x.copy_(_rms_norm_torch(residual, weight, eps))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` of shape ``[rows, 2 * inter]``."""
    if x.is_cuda:
        _load(x.device)
        return torch.ops.flashdecode.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# Where a projection runs our GEMV instead of cuBLAS, by measurement (python -m
# kernels.bench_layer_ops): up to 4 rows, weights up to 4 M elements (larger ones, the LM head
# or a 4096-wide model's projections, stream as fast or faster through cuBLAS).
GEMV_MAX_ROWS = 4
GEMV_MAX_WEIGHT = 4 << 20
GEMV_MAX_INPUT_BYTES = 200 * 1024         # its input rows live in shared memory


def _gemv_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and x.shape[0] <= GEMV_MAX_ROWS and weight.numel() <= GEMV_MAX_WEIGHT
            and x.shape[0] * weight.shape[1] * x.element_size() <= GEMV_MAX_INPUT_BYTES)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (no bias)."""
    if _gemv_serves(x, weight):
        _load(x.device)
        return torch.ops.flashdecode.gemv(x, weight, False)
    return F.linear(x, weight)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul(gate_up) @ weight.T``: the MLP's down projection, fused for a few rows."""
    if _gemv_serves(gate_up, weight):
        _load(gate_up.device)
        return torch.ops.flashdecode.gemv(gate_up, weight, True)
    return F.linear(silu_and_mul(gate_up), weight)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_q_heads: int,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """``qkv [T, (Hq + 2 Hkv) * D]``: rotates the query and key heads in place (rotate-half
    convention, ``cos_sin [max_positions, D]`` holding the cosines then the sines of the D/2
    frequencies), then stores each token's key and value at ``slot_mapping`` (-1: nowhere); fp8
    caches store them quantised at ``k_scale``/``v_scale``, in the same launch on CUDA."""
    check_kv_scales(k_cache, k_scale, v_scale)
    if qkv.is_cuda:
        _load(qkv.device)
        torch.ops.flashdecode.rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, num_q_heads,
                                            k_scale, v_scale)
        return
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    heads = qkv.unflatten(1, (-1, head_dim))
    rotated = heads[:, :num_q_heads + num_kv_heads]
    table = cos_sin[positions.long()].unsqueeze(1)
    half = head_dim // 2
    cos, sin = table[..., :half], table[..., half:]
    x1, x2 = rotated[..., :half].float(), rotated[..., half:].float()
    rotated.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))
    reference_write_kv(k_cache, v_cache, heads[:, num_q_heads:num_q_heads + num_kv_heads],
                       heads[:, num_q_heads + num_kv_heads:], slot_mapping, k_scale, v_scale)
