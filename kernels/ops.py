"""The CUDA ops ``torch.ops.flashdecode.flash_decode`` / ``flash_prefill`` / ``write_kv`` / ``read_kv`` and their
Python entry points.

The ops are defined in ``csrc/binding.cpp`` (TORCH_LIBRARY) and built on first use
(``build.py``); the fake kernels below let torch.compile trace them as single ops. The entry
points validate inputs with readable errors, pick the split count from the workspace's plan and
never read device data, so a call does not synchronise with the host and can be captured in a
CUDA graph. Nothing is allocated besides the output, except the first time a default workspace
is needed (or must grow), which is refused during graph capture.
"""

import torch

from . import build
from .constants import HEAD_DIMS
from .kv_quant import INT8, check_kv_scales, is_int8
from .paging import SUPPORTED_BLOCK_SIZE_RULE, supported_block_size
from .planner import prefill_row_tiles
from .prefill import check_prefill
from .window import check_window
from .workspace import PrefillWorkspace, Workspace

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
INT8_HEAD_DIMS = (32, 64, 128, 256)   # write_kv on int8 caches: a row's D / 8 threads share a warp

_ready_devices: set[int] = set()
_default_workspaces: dict[tuple, Workspace] = {}
_default_prefill_workspaces: dict[tuple, PrefillWorkspace] = {}
MAX_GRID_YZ = 65535   # CUDA's limit on a grid's y and z: the prefill's row tiles, and the merge's rows


def load(device: torch.device | None = None) -> None:
    """Build/load the extension and check that ``device`` can run it."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    if device.index in _ready_devices:
        return
    build.load_extension()
    _register_fakes()
    build.check_device(device)
    _ready_devices.add(device.index)


_fakes_registered = False


def _register_fakes() -> None:
    global _fakes_registered
    if _fakes_registered:
        return

    @torch.library.register_fake("flashdecode::flash_decode")
    def _flash_decode_fake(q, k_cache, v_cache, block_table, seq_lens, scale, num_splits, three_per_sm,
                           partial_out, partial_lse, read_ahead=True, window=0, k_scale=None, v_scale=None):
        return q.new_empty(q.shape)

    @torch.library.register_fake("flashdecode::flash_prefill")
    def _flash_prefill_fake(q, k_cache, v_cache, block_table, cu_query_starts, seq_lens, scale, num_splits, row_tiles,
                            partial_out, partial_lse, window=0, k_scale=None, v_scale=None):
        return q.new_empty(q.shape)

    @torch.library.register_fake("flashdecode::write_kv")
    def _write_kv_fake(k_cache, v_cache, key, value, slot_mapping, k_scale=None, v_scale=None):
        return None

    @torch.library.register_fake("flashdecode::read_kv")
    def _read_kv_fake(k_cache, v_cache, slot_mapping, dtype, k_scale=None, v_scale=None):
        shape = (slot_mapping.shape[0], k_cache.shape[1], k_cache.shape[3])
        return k_cache.new_empty(shape, dtype=dtype), k_cache.new_empty(shape, dtype=dtype)

    @torch.library.register_fake("flashdecode::rms_norm")
    def _rms_norm_fake(x, weight, eps):
        return x.new_empty(x.shape)

    @torch.library.register_fake("flashdecode::add_rms_norm")
    def _add_rms_norm_fake(x, residual, weight, eps):
        return x.new_empty(x.shape), x.new_empty(x.shape)

    @torch.library.register_fake("flashdecode::silu_and_mul")
    def _silu_and_mul_fake(x, act=0):
        return x.new_empty(x.shape[0], x.shape[1] // 2)

    @torch.library.register_fake("flashdecode::gemv")
    def _gemv_fake(x, w, bias=None, act=-1):
        return x.new_empty(x.shape[0], w.shape[0] // 2 if act >= 0 else w.shape[0])

    @torch.library.register_fake("flashdecode::add_rms_norm_gemv")
    def _add_rms_norm_gemv_fake(x, residual, norm_weight, eps, w, bias=None, act=-1):
        return x.new_empty(x.shape[0], w.shape[0] // 2 if act >= 0 else w.shape[0]), x.new_empty(x.shape)

    @torch.library.register_fake("flashdecode::rope_write_kv")
    def _rope_write_kv_fake(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, num_q_heads, q_norm=None,
                            k_norm=None, eps=0.0, k_scale=None, v_scale=None):
        return None

    _fakes_registered = True


def _misaligned(t: torch.Tensor) -> bool:
    # While torch.compile traces there is no data pointer; the C++ op checks alignment at run time.
    return not torch.compiler.is_compiling() and t.data_ptr() % 16 != 0


def _check_cache(k_cache, v_cache, device, name="k_cache/v_cache"):
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"{name} must be [num_blocks, Hkv, block_size, D] of one shape, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if k_cache.device != device or v_cache.device != device:
        raise ValueError(f"the caches are on {k_cache.device}/{v_cache.device}, expected {device}")
    if _misaligned(k_cache) or _misaligned(v_cache):
        raise ValueError("the caches must be 16-byte aligned")


def _check_kernel_query(q):
    """q [rows, Hq, D] as the kernels read it: a head_dim they are built for, 16-byte aligned rows."""
    head_dim = q.shape[2]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported by the CUDA kernel (supported: "
                         f"{', '.join(map(str, HEAD_DIMS))})")
    if q.stride(2) != 1 or q.stride(0) % 8 or q.stride(1) % 8 or _misaligned(q):
        raise ValueError("q needs a contiguous last dim and 16-byte aligned rows (call q.contiguous())")


def _validate_decode(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale):
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q must be bfloat16 or float16 on CUDA, got {q.dtype}")
    batch, num_q_heads, head_dim = q.shape
    _check_kernel_query(q)
    _check_cache(k_cache, v_cache, q.device)
    if k_cache.dtype not in (q.dtype, INT8):
        raise ValueError(f"the caches are {k_cache.dtype} but q is {q.dtype} (caches hold q's dtype or {INT8})")
    check_kv_scales(k_cache, k_scale, v_scale)
    _, num_kv_heads, block_size, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"cache head_dim {cache_dim} != q head_dim {head_dim}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if not supported_block_size(block_size):
        raise ValueError(f"block_size {block_size} is not supported: {SUPPORTED_BLOCK_SIZE_RULE}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be int32 [B={batch}, max_blocks], "
                         f"got {block_table.dtype} {tuple(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table needs a contiguous last dim")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (batch,) or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be contiguous int32 [B={batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    for t, name in ((block_table, "block_table"), (seq_lens, "seq_lens")):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    return batch, num_q_heads, num_kv_heads, head_dim, block_size


def _kept_workspace(kept: dict, key, op: str, size_attr: str, size: int, max_seq_len: int, window, build):
    """The workspace ``kept[key]`` when it holds ``size`` (its ``size_attr``: sequences or rows),
    ``max_seq_len`` and ``window``; else (outside graph capture only) ``build(size, max_seq_len,
    windows)`` grown to cover the old one too, kept in its place."""
    ws = kept.get(key)
    if ws is not None and size <= getattr(ws, size_attr) and max_seq_len <= ws.max_seq_len and ws.serves_window(window):
        return ws
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{op} needs a larger default workspace while a CUDA graph is being captured; "
                           "pass workspace= or run one eager call of the largest shape first")
    windows = () if window is None else (window,)
    if ws is not None:
        size, max_seq_len = max(size, getattr(ws, size_attr)), max(max_seq_len, ws.max_seq_len)
        windows += ws.windows
    ws = build(size, max_seq_len, windows)
    kept[key] = ws
    return ws


def default_workspace(device, num_q_heads, num_kv_heads, head_dim, batch, max_seq_len, window=None,
                      kv_int8: bool = False) -> Workspace:
    """The workspace kept for calls without one; grows (outside graph capture only) when outgrown
    or given a window it has no plan for."""
    return _kept_workspace(
        _default_workspaces, (device, num_q_heads, num_kv_heads, head_dim, kv_int8), "flash_decode", "max_batch",
        batch, max_seq_len, window,
        lambda batch, max_seq_len, windows: Workspace(batch, num_q_heads, head_dim, max_seq_len, device,
                                                      num_kv_heads=num_kv_heads, windows=windows, kv_int8=kv_int8))


def flash_decode_cuda(q, k_cache, v_cache, block_table, seq_lens, *, scale=None, workspace=None, read_ahead=True,
                      window=None, k_scale=None, v_scale=None):
    """``kernels.flash_decode`` for CUDA tensors; see ``kernels/__init__.py`` for the contract."""
    window = check_window(window)
    batch, num_q_heads, num_kv_heads, head_dim, block_size = _validate_decode(q, k_cache, v_cache, block_table,
                                                                               seq_lens, k_scale, v_scale)
    load(q.device)
    kv_int8 = is_int8(k_cache)
    if workspace is None:
        workspace = default_workspace(q.device, num_q_heads, num_kv_heads, head_dim, batch,
                                      block_table.shape[1] * block_size, window, kv_int8)
    workspace.check_cache(kv_int8)
    plan = workspace.check_call(batch, num_q_heads, num_kv_heads, head_dim, block_table.shape[1], block_size,
                                q.device, window=window)
    scale = head_dim ** -0.5 if scale is None else float(scale)
    window = _kernel_window(window, block_table.shape[1] * block_size)
    return torch.ops.flashdecode.flash_decode(q, k_cache, v_cache, block_table, seq_lens, scale, plan.num_splits,
                                              plan.three_per_sm, workspace.partial_out, workspace.partial_lse,
                                              bool(read_ahead), window, k_scale, v_scale)


def default_prefill_workspace(device, num_q_heads, num_kv_heads, head_dim, num_rows, max_seq_len,
                              window=None) -> PrefillWorkspace:
    """The prefill workspace kept for calls without one; grows (outside graph capture only)."""
    return _kept_workspace(
        _default_prefill_workspaces, (device, num_q_heads, num_kv_heads, head_dim), "flash_prefill", "max_rows",
        num_rows, max_seq_len, window,
        lambda num_rows, max_seq_len, windows: PrefillWorkspace(num_rows, num_q_heads, head_dim, max_seq_len, device,
                                                                num_kv_heads=num_kv_heads, windows=windows))


def flash_prefill_cuda(q, k_cache, v_cache, block_table, cu_query_starts, seq_lens, *, scale=None, window=None,
                       k_scale=None, v_scale=None, workspace=None):
    """``kernels.flash_prefill`` for CUDA tensors; see ``kernels/__init__.py`` for the contract. Reads
    no device data: the split count is the workspace's plan for q's rows and the batch."""
    window = check_window(window)
    batch, num_q_heads, num_kv_heads, head_dim, block_size = check_prefill(
        q, k_cache, v_cache, block_table, cu_query_starts, seq_lens, k_scale, v_scale)
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q must be bfloat16 or float16 on CUDA, got {q.dtype}")
    _check_kernel_query(q)
    _check_cache(k_cache, v_cache, q.device)
    if not supported_block_size(block_size):
        raise ValueError(f"block_size {block_size} is not supported: {SUPPORTED_BLOCK_SIZE_RULE}")
    if block_table.stride(1) != 1:
        raise ValueError("block_table needs a contiguous last dim")
    if not (seq_lens.is_contiguous() and cu_query_starts.is_contiguous()):
        raise ValueError("seq_lens and cu_query_starts must be contiguous")
    num_rows = q.shape[0]
    if num_rows == 0 or batch == 0:
        return q.new_empty(q.shape)
    row_tiles = prefill_row_tiles(num_rows, batch, num_q_heads, num_kv_heads)
    if row_tiles > MAX_GRID_YZ:
        raise ValueError(f"{num_rows} new rows over {batch} sequences make {row_tiles} row tiles per KV head, "
                         f"more than the grid's {MAX_GRID_YZ}: split the call")
    reach = block_table.shape[1] * block_size
    load(q.device)
    if workspace is None:
        workspace = default_prefill_workspace(q.device, num_q_heads, num_kv_heads, head_dim, num_rows, reach, window)
    if not isinstance(workspace, PrefillWorkspace):
        raise ValueError(f"flash_prefill takes a PrefillWorkspace, got {type(workspace).__name__}")
    plan = workspace.check_call(num_rows, batch, num_q_heads, num_kv_heads, head_dim, block_table.shape[1],
                                block_size, q.device, window=window)
    if plan.num_splits > 1 and num_rows > MAX_GRID_YZ:
        raise ValueError(f"a call of {plan.num_splits} splits takes at most {MAX_GRID_YZ} rows, this one has {num_rows}")
    scale = head_dim ** -0.5 if scale is None else float(scale)
    return torch.ops.flashdecode.flash_prefill(q, k_cache, v_cache, block_table, cu_query_starts, seq_lens, scale,
                                               plan.num_splits, row_tiles, workspace.partial_out,
                                               workspace.partial_lse, _kernel_window(window, reach), k_scale, v_scale)


def _kernel_window(window: int | None, reach: int) -> int:
    """The op's window: 0 where every position the block table reaches is attended."""
    return 0 if window is None or window >= reach else window


def write_kv_cuda(k_cache, v_cache, key, value, slot_mapping, k_scale=None, v_scale=None):
    """``kernels.write_kv`` for CUDA tensors: slot -1 (any negative slot) writes nothing; int8
    caches store ``kv_quant.quantize_rows`` of the rows (bf16 or fp16) and their scales."""
    _check_cache(k_cache, v_cache, key.device)
    int8 = check_kv_scales(k_cache, k_scale, v_scale)
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    if key.dim() != 3 or key.shape != value.shape or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"key and value must be [T, {num_kv_heads}, {head_dim}], "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"slot_mapping must be int32/int64 [T={key.shape[0]}], "
                         f"got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if slot_mapping.device != key.device or value.device != key.device:
        raise ValueError("key, value and slot_mapping must be on the caches' device")
    row_dtype = k_cache.dtype
    if int8:
        if key.dtype not in SUPPORTED_DTYPES or value.dtype != key.dtype:
            raise ValueError(f"key and value written to an {INT8} cache must be one of bfloat16/float16, "
                             f"got {key.dtype} and {value.dtype}")
        if head_dim not in INT8_HEAD_DIMS:
            raise ValueError(f"an {INT8} cache's write takes head_dim {', '.join(map(str, INT8_HEAD_DIMS))}, "
                             f"not {head_dim}")
        row_dtype = key.dtype
    row_bytes = head_dim * torch.empty((), dtype=row_dtype).element_size()
    if row_bytes % 16:
        raise ValueError(f"head_dim {head_dim} x {row_bytes // head_dim} bytes is not a multiple of 16 bytes")
    key = _rows_aligned(key.to(row_dtype))
    value = _rows_aligned(value.to(row_dtype))
    load(key.device)
    torch.ops.flashdecode.write_kv(k_cache, v_cache, key, value, slot_mapping.contiguous(), k_scale, v_scale)


def read_kv_cuda(k_cache, v_cache, slot_mapping, dtype, k_scale=None, v_scale=None):
    """``kernels.read_kv`` for CUDA tensors."""
    _check_cache(k_cache, v_cache, k_cache.device)
    int8 = check_kv_scales(k_cache, k_scale, v_scale)
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"read_kv reads into one of bfloat16/float16, not {dtype}")
    if not int8 and dtype != k_cache.dtype:
        raise ValueError(f"read_kv of a {k_cache.dtype} cache reads into {k_cache.dtype}, not {dtype}")
    if slot_mapping.dtype != torch.int32 or slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be int32 [K], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if slot_mapping.device != k_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, the caches on {k_cache.device}")
    if k_cache.shape[3] % 8:
        raise ValueError(f"read_kv needs head_dim a multiple of 8, not {k_cache.shape[3]}")
    load(k_cache.device)
    return torch.ops.flashdecode.read_kv(k_cache, v_cache, slot_mapping.contiguous(), dtype, k_scale, v_scale)


def _rows_aligned(t: torch.Tensor) -> torch.Tensor:
    size = t.element_size()
    ok = t.stride(2) == 1 and (t.stride(0) * size) % 16 == 0 and (t.stride(1) * size) % 16 == 0 and not _misaligned(t)
    return t if ok else t.contiguous()
