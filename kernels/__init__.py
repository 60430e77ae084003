"""Flash-decoding attention over a paged KV cache.

``flash_decode`` runs the CUDA kernel on CUDA tensors and the pure-PyTorch reference on CPU
tensors; both compute the same split-KV algorithm (see ``reference.py`` and ``csrc/``).
``flash_prefill`` does the same for blocks of new query rows after a cached prefix (``prefill.py``).
"""

from .paging import cache_shape, pack_paged
from .planner import Plan, prefill_plan, split_plan
from .prefill import reference_prefill
from .reference import reference_decode, reference_read_kv, reference_write_kv
from .window import check_window
from .workspace import PrefillWorkspace, Workspace

__all__ = ["flash_decode", "flash_prefill", "write_kv", "read_kv", "reference_decode", "reference_prefill",
           "reference_write_kv", "reference_read_kv", "pack_paged", "cache_shape", "Workspace", "PrefillWorkspace",
           "Plan", "split_plan", "prefill_plan", "check_window"]


def flash_decode(q, k_cache, v_cache, block_table, seq_lens, *, scale=None, workspace=None, read_ahead=True,
                 window=None, k_scale=None, v_scale=None):
    """Attention of one new query token per sequence over its paged KV cache.

    q [B, Hq, D]; k_cache/v_cache [num_blocks, Hkv, block_size, D] (``paging.py``);
    block_table [B, max_blocks] int32; seq_lens [B] int32, each >= 1. Returns [B, Hq, D].

    On CUDA the kernel starts reading ``seq_lens``, ``block_table`` and the cache rows before
    ``seq_len - 1`` while the kernels ahead of it in the stream may still run (programmatic
    dependent launch): none that may still run may write those. ``q`` and row ``seq_len - 1`` (a
    decode step's new token) they may write. ``read_ahead=False`` reads nothing before they
    have finished.

    ``workspace`` (``Workspace``) holds the split buffers and the plan; one planned for other head
    counts, another head_dim or shorter sequences than the block table reaches is refused with a
    ValueError. Without one a default workspace is kept per head layout.

    ``window`` (a positive int, or None for all positions) is a sliding window: the query at
    position ``seq_len - 1`` attends to positions ``p >= seq_len - window`` only, and cache blocks
    wholly before them are not read. The workspace must have been planned for that window
    (``Workspace(..., windows=...)``) unless it is at least the workspace's ``max_seq_len``.

    int8 caches (``kv_quant``) need ``k_scale`` and ``v_scale``, their row scales: float16
    ``[num_blocks, Hkv, block_size]`` on the caches' device (a row dequantises as
    ``code * scale``); other caches refuse them.
    """
    if q.is_cuda:
        from . import ops
        return ops.flash_decode_cuda(q, k_cache, v_cache, block_table, seq_lens, scale=scale,
                                     workspace=workspace, read_ahead=read_ahead, window=window, k_scale=k_scale,
                                     v_scale=v_scale)
    return reference_decode(q, k_cache, v_cache, block_table, seq_lens, scale=scale, workspace=workspace,
                            window=window, k_scale=k_scale, v_scale=v_scale)


def flash_prefill(q, k_cache, v_cache, block_table, cu_query_starts, seq_lens, *, scale=None, window=None,
                  k_scale=None, v_scale=None, workspace=None):
    """Attention of new query rows over their sequences' paged KV cache (a prefill after a cached
    prefix, or a later chunk of a long prompt), causal within the new rows.

    q [T, Hq, D]: the new rows of B sequences packed, sequence i's at rows
    ``cu_query_starts[i]:cu_query_starts[i + 1]`` (int32 [B + 1], from 0 to T; a sequence may
    have none), the last of its ``seq_lens[i]`` (int32 [B]) positions, their keys and values
    already written to the caches (``write_kv``). block_table [B, max_blocks] int32. A row at
    position p attends to positions ``<= p``; with ``window=W`` to ``p - W < pos <= p``. Returns
    [T, Hq, D] in q's dtype. Caches, int8 row scales and their checks as in ``flash_decode``.

    ``workspace`` (``PrefillWorkspace``) holds the split buffers; the split count is planned from
    T, B and the workspace (``planner.prefill_plan``), never from lengths on the device, so calls
    capture into CUDA graphs. Without one a default workspace is kept per head layout (CUDA).
    """
    if q.is_cuda:
        from . import ops
        return ops.flash_prefill_cuda(q, k_cache, v_cache, block_table, cu_query_starts, seq_lens, scale=scale,
                                      window=window, k_scale=k_scale, v_scale=v_scale, workspace=workspace)
    return reference_prefill(q, k_cache, v_cache, block_table, cu_query_starts, seq_lens, scale=scale, window=window,
                             k_scale=k_scale, v_scale=v_scale, workspace=workspace)


def write_kv(k_cache, v_cache, key, value, slot_mapping, k_scale=None, v_scale=None):
    """Store one layer's new ``key/value [T, Hkv, D]`` at ``slot_mapping [T]``; slot -1 writes nothing.
    int8 caches store the rows quantised (``kv_quant.quantize_rows``), their scales in ``k_scale``/``v_scale``."""
    if key.is_cuda:
        from . import ops
        return ops.write_kv_cuda(k_cache, v_cache, key, value, slot_mapping, k_scale, v_scale)
    return reference_write_kv(k_cache, v_cache, key, value, slot_mapping, k_scale, v_scale)


def read_kv(k_cache, v_cache, slot_mapping, dtype, k_scale=None, v_scale=None):
    """The rows ``(key, value)``, each ``[K, Hkv, D]`` of ``dtype``, stored at ``slot_mapping [K]``
    (int32); slot -1 (and a slot past the pool, where ``write_kv`` writes nothing) reads as a row of
    zeros. int8 caches are read as ``code * scale``
    (``kv_quant.dequantize_rows``), other caches into their own dtype."""
    if k_cache.is_cuda:
        from . import ops
        return ops.read_kv_cuda(k_cache, v_cache, slot_mapping, dtype, k_scale, v_scale)
    return reference_read_kv(k_cache, v_cache, slot_mapping, dtype, k_scale, v_scale)
