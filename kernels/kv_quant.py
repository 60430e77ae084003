"""The float8_e4m3fn KV cache: codes that dequantise as ``code * scale``, one float32 scale per
KV head for K and one for V (``[num_kv_heads]`` tensors on the caches' device).

Quantising is ``x / scale`` in float32, saturated to +-448 and rounded to nearest even: the CUDA
writes (``write_kv``, ``rope_write_kv``) compute exactly this, so tests compare them bit for bit.
"""

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0             # the largest e4m3 magnitude; quantising saturates to it


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def check_kv_scales(k_cache: torch.Tensor, k_scale, v_scale) -> bool:
    """Whether the caches are fp8; raises ValueError unless ``k_scale`` and ``v_scale`` are both
    given (float32 ``[num_kv_heads]`` on the caches' device) for fp8 caches and neither for others."""
    fp8 = is_fp8(k_cache)
    given = (k_scale is not None, v_scale is not None)
    if fp8 and given != (True, True):
        raise ValueError(f"float8_e4m3fn caches need k_scale and v_scale, got k_scale={_describe(k_scale)}, "
                         f"v_scale={_describe(v_scale)}")
    if not fp8:
        if any(given):
            raise ValueError(f"k_scale and v_scale are for float8_e4m3fn caches only; the caches are {k_cache.dtype} "
                             f"(k_scale={_describe(k_scale)}, v_scale={_describe(v_scale)})")
        return False
    num_kv_heads = k_cache.shape[1]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s.dtype != torch.float32 or s.shape != (num_kv_heads,) or not s.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 [num_kv_heads={num_kv_heads}], "
                             f"got {s.dtype} {tuple(s.shape)}")
        if s.device != k_cache.device:
            raise ValueError(f"{name} is on {s.device} but the caches are on {k_cache.device}")
    return True


def _describe(scale) -> str:
    return "None" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 codes of ``x`` at ``scale [Hkv]``, the KV heads being dim 1 of ``x`` (``[T, Hkv, D]``,
    ``[B, Hkv, M, D]``): ``x / scale`` in float32, saturated to +-448, rounded to nearest even."""
    scaled = x.float() / scale.float().view(-1, *[1] * (x.dim() - 2))
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scale`` in ``dtype``, the KV heads being dim 1 of ``codes`` (``[T, Hkv, D]``,
    ``[B, Hkv, M, D]`` or a cache ``[num_blocks, Hkv, block_size, D]``)."""
    return codes.to(dtype) * scale.to(dtype).view(-1, *[1] * (codes.dim() - 2))


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Per-head scales that map each head's largest magnitude to 448 (a head of zeros gets the
    scale of amax 1, so that nothing divides by zero)."""
    amax = amax.float()
    return torch.where(amax > 0, amax, torch.ones_like(amax)) / FP8_MAX
