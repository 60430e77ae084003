"""The small per-layer ops around attention: RMSNorm (optionally fused with the residual add),
the gated activations (SiLU or tanh-GELU of the gate, times up), rotary embedding fused with the
per-head q/k norms and the KV-cache write, and the projections of a decode step's few rows (a
GEMV that can also take the residual add and RMSNorm in front of it, add a bias, or end in the
gated activation).

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


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)``, the sum rounded once to x's dtype."""
    if x.is_cuda:
        _load(x.device)
        return torch.ops.flashdecode.add_rms_norm(x, residual, weight, eps)
    summed = residual + x
    return _rms_norm_torch(summed, weight, eps), summed


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
# benchmarks.layer_ops_bench, and the decode step of each preset at B=1): one row with up to
# GEMV_MAX_OUT output features and GEMV_MAX_WEIGHT weight elements (past those its warps' chains
# of loads are longer than cuBLAS's), two rows with up to GEMV_MAX_WEIGHT_TWO_ROWS elements;
# more rows always take cuBLAS.
GEMV_MAX_OUT = 16384
GEMV_MAX_WEIGHT = 40 << 20
GEMV_MAX_WEIGHT_TWO_ROWS = 2 << 20
GEMV_MAX_INPUT_BYTES = 200 * 1024         # its input rows live in shared memory, as float32


def gemv_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear(x, weight)`` and its fused forms run our GEMV (else cuBLAS)."""
    rows, (n, k) = x.shape[0], weight.shape
    if not x.is_cuda or rows * k * 4 > GEMV_MAX_INPUT_BYTES:
        return False
    if rows == 1:
        return n <= GEMV_MAX_OUT and n * k <= GEMV_MAX_WEIGHT
    return rows == 2 and n * k <= GEMV_MAX_WEIGHT_TWO_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``."""
    if gemv_serves(x, weight):
        _load(x.device)
        return torch.ops.flashdecode.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def gated_linear(x: torch.Tensor, gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """The gated MLP's input to its down projection: ``act(x @ gate.T) * (x @ up.T)`` for
    ``gate_up = [gate; up]`` (the two weights stacked, ``[2 * inter, hidden]``)."""
    code = _act_code(act)
    if gemv_serves(x, gate_up):
        _load(x.device)
        return torch.ops.flashdecode.gemv(x, gate_up, None, code)
    return act_and_mul(F.linear(x, gate_up), act)


def add_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None,
                        act: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection after the residual add and RMSNorm: ``(linear(h, weight, bias), residual + x)``
    with ``h = rms_norm(residual + x, norm_weight)``, or ``gated_linear(h, weight, act)`` when
    ``act`` is given. For a decode step's few rows one launch does all of it."""
    code = None if act is None else _act_code(act)
    if code is not None and bias is not None:
        raise ValueError(f"a gated projection ({act}) takes no bias")
    if gemv_serves(x, weight):
        _load(x.device)
        return torch.ops.flashdecode.add_rms_norm_gemv(x, residual, norm_weight, eps, weight, bias,
                                                       -1 if code is None else code)
    h, summed = add_rms_norm(x, residual, norm_weight, eps)
    return (linear(h, weight, bias) if act is None else gated_linear(h, weight, act)), summed


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_q_heads: int, *,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """``qkv [T, (Hq + 2 Hkv) * D]``: RMS-normalises each query and key head in place when
    ``q_norm`` and ``k_norm`` (``[D]`` each) are given, rotates them in place (rotate-half
    convention, ``cos_sin [max_positions, D]`` holding the cosines then the sines of the D/2
    frequencies), then stores each token's key and value at ``slot_mapping`` (-1: nowhere); int8
    caches store them quantised, their row scales in ``k_scale``/``v_scale``, in the same launch on CUDA."""
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
