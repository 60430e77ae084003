"""Prefill attention after a cached prefix, as split-KV flash attention: the contract's checks and the
pure-PyTorch algorithm (the CPU path and the CUDA kernel's oracle).

A call carries the new tokens of B sequences packed as ``q [T, Hq, D]``: sequence i's are rows
``cu_query_starts[i]:cu_query_starts[i + 1]``, the last ``n_i`` of its ``seq_lens[i]`` positions
(cached + new; their keys and values already in the paged cache). A new row at position p attends
causally to positions ``<= p`` and, with ``window=W``, ``> p - W`` (``kernels.window``). The keys
each sequence attends to, from its first row's window start to its end, are cut into
``num_splits`` chunks; each chunk yields per-row partial outputs normalised by their own softmax
sums and their log-sum-exps, merged exactly (``reference.merge_splits``). Accumulation is in
float32 (float64 stays float64); int8 caches are dequantised with their row scales as they are read.
"""

import torch

from .kv_quant import INT8, check_kv_scales, dequantize_rows, is_int8
from .planner import max_splits_for
from .reference import _accum_dtype, gather_window, merge_splits
from .window import check_window


def check_prefill(q, k_cache, v_cache, block_table, cu_query_starts, seq_lens, k_scale=None, v_scale=None):
    """The checks that read no tensor's data (CPU and CUDA alike); returns
    ``(batch, num_q_heads, num_kv_heads, head_dim, block_size)``. Mismatches raise ValueError naming both."""
    if q.dim() != 3:
        raise ValueError(f"q must be [total_new_rows, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must be [num_blocks, Hkv, block_size, D] of one shape, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    if k_cache.dtype not in (q.dtype, INT8):
        raise ValueError(f"the caches are {k_cache.dtype} but q is {q.dtype} (caches hold q's dtype or {INT8})")
    check_kv_scales(k_cache, k_scale, v_scale)
    _, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"cache head_dim {cache_dim} != q head_dim {head_dim}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"block_table must be int32 [B, max_blocks], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    batch = block_table.shape[0]
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (batch,):
        raise ValueError(f"seq_lens must be int32 [B={batch}] (block_table's rows), got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    if cu_query_starts.dtype != torch.int32 or tuple(cu_query_starts.shape) != (batch + 1,):
        raise ValueError(f"cu_query_starts must be int32 [B + 1 = {batch + 1}], got {cu_query_starts.dtype} "
                         f"{tuple(cu_query_starts.shape)}")
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache"), (block_table, "block_table"),
                    (cu_query_starts, "cu_query_starts"), (seq_lens, "seq_lens")):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    return batch, num_q_heads, num_kv_heads, head_dim, block_size


def check_lengths(q, block_table, cu_query_starts, seq_lens, block_size):
    """The checks that read the lengths (the CPU path only: on CUDA they would sync with the host).
    Returns the host lists ``(starts, seq_lens)``."""
    starts = [int(x) for x in cu_query_starts.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    if starts[0] != 0 or starts[-1] != q.shape[0]:
        raise ValueError(f"cu_query_starts must run from 0 to q's {q.shape[0]} rows, got {starts[0]}..{starts[-1]}")
    reach = block_table.shape[1] * block_size
    for i, (n, total) in enumerate(zip((b - a for a, b in zip(starts, starts[1:])), lens)):
        if n < 0:
            raise ValueError(f"cu_query_starts must not decrease, got {starts[i]} then {starts[i + 1]}")
        if n > total:
            raise ValueError(f"sequence {i} has {n} new rows but seq_len {total}")
        if total > reach:
            raise ValueError(f"sequence {i} has seq_len {total} but the block table reaches {reach}")
    return starts, lens


def reference_prefill(q, k_cache, v_cache, block_table, cu_query_starts, seq_lens, *, scale=None, window=None,
                      k_scale=None, v_scale=None, workspace=None):
    """``flash_prefill``'s contract in PyTorch; the workspace's plan (``PrefillWorkspace``) sets the
    split count, else as many splits as the longest sequence has minimal chunks."""
    window = check_window(window)
    batch, num_q_heads, num_kv_heads, head_dim, block_size = check_prefill(
        q, k_cache, v_cache, block_table, cu_query_starts, seq_lens, k_scale, v_scale)
    if workspace is None:
        num_splits = max_splits_for(int(seq_lens.max()) if batch else 1)
    else:
        num_splits = workspace.check_call(max(q.shape[0], 1), max(batch, 1), num_q_heads, num_kv_heads, head_dim,
                                          block_table.shape[1], block_size, q.device, window=window).num_splits
    return split_prefill(q, k_cache, v_cache, block_table, cu_query_starts, seq_lens, num_splits, scale=scale,
                         window=window, k_scale=k_scale, v_scale=v_scale)


def split_prefill(q, k_cache, v_cache, block_table, cu_query_starts, seq_lens, num_splits, *, scale=None,
                  window=None, k_scale=None, v_scale=None):
    """``reference_prefill`` with an explicit split count (any count gives the same result): per
    sequence, the keys from its first new row's window start (0 without one) to its end are cut
    into ``num_splits`` chunks, attended by every new row with its causal and window mask, and the
    chunks' partials merged."""
    window = check_window(window)
    _, num_q_heads, num_kv_heads, head_dim, block_size = check_prefill(
        q, k_cache, v_cache, block_table, cu_query_starts, seq_lens, k_scale, v_scale)
    if num_splits < 1:
        raise ValueError(f"num_splits must be positive, got {num_splits}")
    starts, lens = check_lengths(q, block_table, cu_query_starts, seq_lens, block_size)
    int8 = is_int8(k_cache)
    scale = head_dim ** -0.5 if scale is None else scale
    acc = _accum_dtype(q.dtype)
    group = num_q_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for i, total in enumerate(lens):
        n = starts[i + 1] - starts[i]
        if n == 0:
            continue
        first = 0 if window is None else max(0, total - n - window + 1)
        width = total - first
        table = block_table[i:i + 1]
        origin = torch.tensor([first], device=q.device)

        def gather(cache):
            return gather_window(cache, table, origin, width)[0]             # [Hkv, width, D]
        if int8:
            k = dequantize_rows(gather(k_cache), gather(k_scale.unsqueeze(-1)).squeeze(-1), acc)
            v = dequantize_rows(gather(v_cache), gather(v_scale.unsqueeze(-1)).squeeze(-1), acc)
        else:
            k, v = gather(k_cache).to(acc), gather(v_cache).to(acc)
        rows = q[starts[i]:starts[i + 1]].to(acc) * scale                      # [n, Hq, D]
        rows = rows.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
        positions = torch.arange(total - n, total, device=q.device)
        out[starts[i]:starts[i + 1]] = _attend_splits(rows, k, v, first, positions, num_splits, window).to(q.dtype)
    return out


SPLIT_BATCH_ELEMENTS = 1 << 24   # partial outputs (or scores) held at once: 64 MB of float32


def _attend_splits(q, k, v, first, positions, num_splits, window):
    """Rows ``q [Hkv, G, n, D]`` (scaled) at ``positions [n]`` over keys ``k/v [Hkv, width, D]`` at
    positions ``first..first + width - 1``, cut into ``num_splits`` chunks: ``[n, Hq, D]``, the chunks'
    partials merged exactly, a batch of chunks at a time (memory stays bounded at any split count;
    the merge is associative)."""
    num_kv_heads, group, n, head_dim = q.shape
    width = k.shape[1]
    splits = min(num_splits, width)
    chunk = -(-width // splits)
    per_batch = max(1, SPLIT_BATCH_ELEMENTS // (num_kv_heads * group * n * max(head_dim, chunk)))
    out = total = None
    for s0 in range(0, splits, per_batch):
        s1 = min(splits, s0 + per_batch)
        lo, hi = s0 * chunk, min(width, s1 * chunk)
        o, lse = _split_rows(q, k[:, lo:hi], v[:, lo:hi], first + lo, first + width, positions, s1 - s0, chunk,
                             window)
        part, part_lse = merge_splits(o, lse), torch.logsumexp(lse, dim=-1)
        if out is None:
            out, total = part, part_lse
        else:
            pair_lse = torch.stack([total, part_lse], dim=2)
            out = merge_splits(torch.stack([out, part], dim=2), pair_lse)
            total = torch.logsumexp(pair_lse, dim=-1)
    return out


def _split_rows(q, k, v, key0, key_end, positions, splits, chunk, window):
    """Per-split partials of rows ``q [Hkv, G, n, D]`` over keys ``k/v [Hkv, w, D]`` at positions
    ``key0..`` (those from ``key_end`` on are padding), in ``splits`` chunks of ``chunk``:
    ``o [n, Hq, S, D]`` and ``lse [n, Hq, S]``; a row that sees none of a chunk's keys has lse =
    -inf and o = 0."""
    num_kv_heads, group, n, head_dim = q.shape
    pad = splits * chunk - k.shape[1]
    if pad:
        k = torch.nn.functional.pad(k, (0, 0, 0, pad))
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
    k = k.view(num_kv_heads, splits, chunk, head_dim)
    v = v.view(num_kv_heads, splits, chunk, head_dim)
    scores = torch.einsum("hgnd,hscd->hgnsc", q, k)                          # [Hkv, G, n, S, chunk]
    key_pos = key0 + torch.arange(splits * chunk, device=q.device).view(1, splits, chunk)
    row_pos = positions.view(n, 1, 1)
    seen = (key_pos <= row_pos) & (key_pos < key_end)
    if window is not None:
        seen &= key_pos > row_pos - window
    scores = scores.masked_fill(~seen.view(1, 1, n, splits, chunk), float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m_safe)
    l = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("hgnsc,hscd->hgnsd", p, v) / l.clamp_min(torch.finfo(l.dtype).tiny)
    lse = (m_safe + torch.log(l)).squeeze(-1)                                # log(0) = -inf
    o = o.permute(2, 0, 1, 3, 4).reshape(n, num_kv_heads * group, splits, head_dim)
    lse = lse.permute(2, 0, 1, 3).reshape(n, num_kv_heads * group, splits)
    return o, lse
