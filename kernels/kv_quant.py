"""The int8 KV cache: each row of D elements (one token, one KV head) stored as D int8 codes and
one float16 scale, for K and for V alike. The codes sit in caches ``[num_blocks, Hkv, block_size,
D]`` of int8, the scales in tensors ``[num_blocks, Hkv, block_size]`` of float16 beside them.

Symmetric, computed when the row is written (no calibration): ``scale = amax / 127`` in float32,
capped at ``SCALE_MAX`` and rounded up to float16 (so that no element maps past 127), and
``code = round(x / scale)`` in float32, ties to even, clamped to +-127; a row of zeros has scale
0 and codes 0. A row reads back as ``code * scale``. The CUDA writes (``write_kv``,
``rope_write_kv``) compute exactly this, so tests compare them bit for bit.

The cap keeps ``code * scale`` (the kernel's V operand, csrc/int8.cuh) inside float16: rows
with an element above 127 * 512 = 65024 in magnitude saturate there.
"""

import torch

INT8 = torch.int8
INT8_MAX = 127.0
SCALE_DTYPE = torch.float16
SCALE_MAX = 512.0


def is_int8(cache: torch.Tensor) -> bool:
    return cache.dtype == INT8


def scale_shape(cache_shape) -> tuple[int, int, int]:
    """The row scales' shape for a cache of ``cache_shape`` ``[num_blocks, Hkv, block_size, D]``."""
    return tuple(cache_shape[:3])


def check_kv_scales(k_cache: torch.Tensor, k_scale, v_scale) -> bool:
    """Whether the caches are int8; raises ValueError unless ``k_scale`` and ``v_scale`` are both
    given (contiguous float16 ``[num_blocks, Hkv, block_size]`` on the caches' device) for int8
    caches and neither for others."""
    int8 = is_int8(k_cache)
    given = (k_scale is not None, v_scale is not None)
    if int8 and given != (True, True):
        raise ValueError(f"int8 caches need k_scale and v_scale, got k_scale={_describe(k_scale)}, "
                         f"v_scale={_describe(v_scale)}")
    if not int8:
        if any(given):
            raise ValueError(f"k_scale and v_scale are for int8 caches only; the caches are {k_cache.dtype} "
                             f"(k_scale={_describe(k_scale)}, v_scale={_describe(v_scale)})")
        return False
    want = scale_shape(k_cache.shape)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s.dtype != SCALE_DTYPE or tuple(s.shape) != want or not s.is_contiguous():
            raise ValueError(f"{name} must be contiguous float16 [num_blocks, Hkv, block_size] = {list(want)}, "
                             f"got {s.dtype} {list(s.shape)}")
        if s.device != k_cache.device:
            raise ValueError(f"{name} is on {s.device} but the caches are on {k_cache.device}")
        if s.is_cuda and not torch.compiler.is_compiling() and s.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned (the kernel copies the scales in 16-byte pieces)")
    return True


def _describe(scale) -> str:
    return "None" if scale is None else f"{scale.dtype} {list(scale.shape)}"


def _round_up_to_half(x: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 ``x`` rounded up to float16 (the CUDA side's ``__float2half_ru``)."""
    h = x.to(SCALE_DTYPE)
    below = h.float() < x
    return torch.where(below, (h.view(torch.int16) + 1).view(SCALE_DTYPE), h)


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """float16 scales of the rows of ``x`` (its last dim): ``amax / 127``, capped and rounded up."""
    amax = x.float().abs().amax(dim=-1)
    # a tensor divisor: torch divides a CUDA tensor by a Python number as a product with its
    # reciprocal, which can differ from the division in the last bit
    return _round_up_to_half(torch.clamp(amax / torch.full_like(amax, INT8_MAX), max=SCALE_MAX))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``x [..., D]``: int8 codes of x's shape and float16 scales ``[...]``."""
    scales = row_scales(x)
    s = scales.float().unsqueeze(-1)
    codes = torch.where(s > 0, torch.round(x.float() / s), torch.zeros((), device=x.device))
    return codes.clamp(-INT8_MAX, INT8_MAX).to(INT8), scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scales`` in ``dtype`` (computed in float32, exact there, or float64): codes
    ``[..., D]``, scales ``[...]``."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return (codes.to(work) * scales.to(work).unsqueeze(-1)).to(dtype)


def new_scales(cache: torch.Tensor) -> torch.Tensor:
    """Zeroed row scales for ``cache`` (an int8 cache ``[num_blocks, Hkv, block_size, D]``)."""
    return torch.zeros(scale_shape(cache.shape), dtype=SCALE_DTYPE, device=cache.device)


def quantize_rows_asymmetric(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` through an asymmetric int8 row format (a float16 scale and a float16 zero
    point per row, codes 0..255), read back in float32: measured against the symmetric format by
    ``load_tests.kv_accuracy``, not served."""
    xf = x.float()
    lo, hi = xf.amin(dim=-1, keepdim=True), xf.amax(dim=-1, keepdim=True)
    scale = _round_up_to_half((hi - lo) / 255.0).float()
    zero = lo.to(SCALE_DTYPE).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((xf - zero) / safe).clamp(0, 255)
    return codes * scale + zero
