"""The small per-layer ops around attention: RMSNorm (optionally fused with the residual add),
the gated activations (SiLU or tanh-GELU of the gate, times up), rotary embedding fused with the
per-head q/k norms and the KV-cache write, and the projections of a decode step's few rows (a
GEMV that can also apply the gated activation to its input, and add a bias).

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
    if weight.dtype == torch.float32:
        return (weight * h).to(x.dtype)             # Gemma's rounding: scaled in float32, rounded once
    return weight * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dim of ``x [rows, hidden]``. A float32 ``weight``
    scales in float32 and rounds once (Gemma's norms); one of ``x``'s dtype rounds the normalised
    row first (Llama's)."""
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


# The gated MLP activations, by transformers' names, and their codes in the CUDA ops.
GATED_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


def _act_code(act: str) -> int:
    if act not in GATED_ACTIVATIONS:
        raise ValueError(f"activation {act!r} is not one of {', '.join(GATED_ACTIVATIONS)}")
    return GATED_ACTIVATIONS[act]


def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    """``act(gate) * up`` for ``x = [gate | up]`` of shape ``[rows, 2 * inter]``."""
    code = _act_code(act)
    if x.is_cuda:
        _load(x.device)
        return torch.ops.flashdecode.silu_and_mul(x, code)
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate) if code == 0 else F.gelu(gate, approximate="tanh")) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return act_and_mul(x, "silu")


# Where a projection runs our GEMV instead of cuBLAS, by measurement (python -m
# kernels.bench_layer_ops): up to 4 rows, weights up to 4 M elements (larger ones, the LM head
# or a 4096-wide model's projections, stream as fast or faster through cuBLAS).
GEMV_MAX_ROWS = 4
GEMV_MAX_WEIGHT = 4 << 20
GEMV_MAX_INPUT_BYTES = 200 * 1024         # its input rows live in shared memory


def _gemv_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and x.shape[0] <= GEMV_MAX_ROWS and weight.numel() <= GEMV_MAX_WEIGHT
            and x.shape[0] * weight.shape[1] * x.element_size() <= GEMV_MAX_INPUT_BYTES)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``."""
    if _gemv_serves(x, weight):
        _load(x.device)
        return torch.ops.flashdecode.gemv(x, weight, False, bias)
    return F.linear(x, weight, bias)


def act_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, act: str) -> torch.Tensor:
    """``act_and_mul(gate_up, act) @ weight.T``: the MLP's down projection, fused for a few rows."""
    if _gemv_serves(gate_up, weight):
        _load(gate_up.device)
        return torch.ops.flashdecode.gemv(gate_up, weight, True, None, _act_code(act))
    return F.linear(act_and_mul(gate_up, act), weight)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return act_mul_linear(gate_up, weight, "silu")


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_q_heads: int, *,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """``qkv [T, (Hq + 2 Hkv) * D]``: RMS-normalises each query and key head in place when
    ``q_norm`` and ``k_norm`` (``[D]`` each) are given, rotates them in place (rotate-half
    convention, ``cos_sin [max_positions, D]`` holding the cosines then the sines of the D/2
    frequencies), then stores each token's key and value at ``slot_mapping`` (-1: nowhere); fp8
    caches store them quantised at ``k_scale``/``v_scale``, in the same launch on CUDA."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError(f"q_norm and k_norm come together; got q_norm {q_norm is not None}, "
                         f"k_norm {k_norm is not None}")
    check_kv_scales(k_cache, k_scale, v_scale)
    if qkv.is_cuda:
        _load(qkv.device)
        torch.ops.flashdecode.rope_write_kv(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, num_q_heads,
                                            q_norm, k_norm, eps, k_scale, v_scale)
        return
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    heads = qkv.unflatten(1, (-1, head_dim))
    if q_norm is not None:
        q, k = heads[:, :num_q_heads], heads[:, num_q_heads:num_q_heads + num_kv_heads]
        q.copy_(_rms_norm_torch(q, q_norm, eps))
        k.copy_(_rms_norm_torch(k, k_norm, eps))
    rotated = heads[:, :num_q_heads + num_kv_heads]
    table = cos_sin[positions.long()].unsqueeze(1)
    half = head_dim // 2
    cos, sin = table[..., :half], table[..., half:]
    x1, x2 = rotated[..., :half].float(), rotated[..., half:].float()
    rotated.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))
    reference_write_kv(k_cache, v_cache, heads[:, num_q_heads:num_q_heads + num_kv_heads],
                       heads[:, num_q_heads + num_kv_heads:], slot_mapping, k_scale, v_scale)
