"""Pure-PyTorch flash decoding over the paged cache: the CPU path and the kernel's oracle.

The same algorithm as the CUDA kernel: the KV sequence is cut into ``num_splits`` chunks, each
chunk yields a partial output normalised by its own softmax sum plus its log-sum-exp, and the
chunks are merged exactly. Accumulation is in float32 (float64 stays float64). int8 caches are
dequantised with their row scales (``kv_quant``) as they are read.
"""

import torch

from .kv_quant import check_kv_scales, dequantize_rows, is_int8, quantize_rows
from .planner import max_splits_for
from .window import attended_span, check_window, window_starts


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def gather_dense(cache: torch.Tensor, block_table: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, Hkv, width, D]`` view-by-copy of each sequence's first ``width`` cached tokens."""
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    blocks_needed = -(-width // block_size)
    ids = block_table[:, :blocks_needed].long().clamp(0, num_blocks - 1)
    tiles = cache[ids]                                    # [B, nb, Hkv, bs, D]
    dense = tiles.transpose(1, 2).reshape(ids.shape[0], num_kv_heads, blocks_needed * block_size, head_dim)
    return dense[:, :, :width]


def gather_window(cache: torch.Tensor, block_table: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, Hkv, width, D]`` copy of each sequence's cached tokens from ``starts[b]`` on; rows past
    the block table's reach repeat its last row (the caller masks them)."""
    block_size = cache.shape[2]
    positions = starts.view(-1, 1) + torch.arange(width, device=starts.device)
    positions = positions.clamp_max(block_table.shape[1] * block_size - 1)
    ids = block_table.long().gather(1, positions // block_size).clamp(0, cache.shape[0] - 1)
    rows = cache[ids, :, positions % block_size]            # [B, width, Hkv, D]
    return rows.transpose(1, 2)


def split_attention(q, k, v, seq_lens, num_splits):
    """Per-split partial outputs and LSEs.

    q [B, Hq, D] (already scaled), k/v [B, Hkv, M, D] dense, seq_lens [B].
    Returns ``o [B, Hq, S, D]`` and ``lse [B, Hq, S]``; an empty split has lse = -inf, o = 0.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, width = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    chunk = -(-width // num_splits)
    pad = num_splits * chunk - width
    if pad:
        k = torch.nn.functional.pad(k, (0, 0, 0, pad))
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
    k = k.view(batch, num_kv_heads, num_splits, chunk, head_dim)
    v = v.view(batch, num_kv_heads, num_splits, chunk, head_dim)
    qg = q.view(batch, num_kv_heads, 1, group, head_dim)
    scores = qg @ k.transpose(-1, -2)                                     # [B, Hkv, S, G, chunk]
    ragged = pad > 0 or bool((seq_lens != width).any())
    if ragged:
        positions = torch.arange(num_splits * chunk, device=q.device).view(num_splits, chunk)
        valid = positions.view(1, 1, num_splits, 1, chunk) < seq_lens.view(batch, 1, 1, 1, 1)
        scores = scores.masked_fill(~valid, float("-inf"))
        v = v.masked_fill(~valid.transpose(-1, -2), 0.0)   # rows past the end may hold anything, NaN included
    m = scores.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m)) if ragged else m
    p = torch.exp(scores - m_safe)
    l = p.sum(dim=-1, keepdim=True)
    o = (p @ v) / l.clamp_min(torch.finfo(l.dtype).tiny)                  # [B, Hkv, S, G, D]
    lse = (m_safe + torch.log(l)).squeeze(-1)                             # log(0) = -inf when empty
    o = o.permute(0, 1, 3, 2, 4).reshape(batch, num_q_heads, num_splits, head_dim)
    lse = lse.permute(0, 1, 3, 2).reshape(batch, num_q_heads, num_splits)
    return o, lse


def merge_splits(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Exact merge of split partials: ``O = sum_c exp(lse_c - lse) O_c``."""
    if o.shape[2] == 1:
        return o[:, :, 0]                   # one split is already normalised: its weight is 1
    total = torch.logsumexp(lse, dim=-1, keepdim=True)
    weights = torch.exp(lse - total)
    weights = torch.where(torch.isfinite(total), weights, torch.zeros_like(weights))
    return (weights.unsqueeze(-1) * o).sum(dim=2)


def reference_decode(q, k_cache, v_cache, block_table, seq_lens, *, scale=None, workspace=None, read_ahead=True,
                     window=None, k_scale=None, v_scale=None):
    """One decode step of attention for each sequence. Same contract as ``flash_decode`` (on the
    CPU nothing runs ahead, so ``read_ahead`` changes nothing); the workspace's plan sets the split
    count, and a workspace that does not fit the call is refused as on CUDA."""
    window = check_window(window)
    if workspace is None:
        num_splits = max_splits_for(attended_span(int(seq_lens.max()), window))
    else:
        _, num_kv_heads, block_size, head_dim = k_cache.shape
        workspace.check_cache(is_int8(k_cache))
        num_splits = workspace.check_call(q.shape[0], q.shape[1], num_kv_heads, q.shape[2], block_table.shape[1],
                                          block_size, q.device, window=window).num_splits
    return split_decode(q, k_cache, v_cache, block_table, seq_lens, num_splits, scale=scale, window=window,
                        k_scale=k_scale, v_scale=v_scale)


def split_decode(q, k_cache, v_cache, block_table, seq_lens, num_splits, *, scale=None, window=None, k_scale=None,
                 v_scale=None):
    """``reference_decode`` with an explicit split count (any count gives the same result). With a
    window, as in the kernel, the splits divide each sequence's attended positions
    ``[max(0, seq_len - window), seq_len)``, and nothing before them is read."""
    window = check_window(window)
    int8 = check_kv_scales(k_cache, k_scale, v_scale)
    head_dim = q.shape[-1]
    scale = head_dim ** -0.5 if scale is None else scale
    acc = _accum_dtype(q.dtype)
    seq_lens = seq_lens.to(q.device)
    if window is None:
        width = int(seq_lens.max())
        lengths = seq_lens

        def gather(cache):
            return gather_dense(cache, block_table, width)
    else:
        starts = window_starts(seq_lens, window)
        lengths = seq_lens.long() - starts
        width = int(lengths.max())

        def gather(cache):
            return gather_window(cache, block_table, starts, width)
    if int8:   # the row scales gathered as caches of D = 1
        k = dequantize_rows(gather(k_cache), gather(k_scale.unsqueeze(-1)).squeeze(-1), acc)
        v = dequantize_rows(gather(v_cache), gather(v_scale.unsqueeze(-1)).squeeze(-1), acc)
    else:
        k, v = gather(k_cache).to(acc), gather(v_cache).to(acc)
    o, lse = split_attention(q.to(acc) * scale, k, v, lengths, num_splits)
    return merge_splits(o, lse).to(q.dtype)


def reference_read_kv(k_cache, v_cache, slot_mapping, dtype, k_scale=None, v_scale=None):
    """The rows stored at ``slot_mapping [K]`` as ``(key, value)`` ``[K, Hkv, D]`` of ``dtype``;
    slots < 0 (and past the pool, where ``write_kv`` writes nothing) read zeros. int8 caches read
    as ``kv_quant.dequantize_rows`` of the codes at their row scales, other caches into their own dtype."""
    int8 = check_kv_scales(k_cache, k_scale, v_scale)
    if not int8 and dtype != k_cache.dtype:
        raise ValueError(f"read_kv of a {k_cache.dtype} cache reads into {k_cache.dtype}, not {dtype}")
    block_size = k_cache.shape[2]
    slots = slot_mapping.long()
    stored = (slots >= 0) & (slots < k_cache.shape[0] * block_size)
    at = torch.where(stored, slots, 0)
    rows = []
    for cache, scale in ((k_cache, k_scale), (v_cache, v_scale)):
        r = cache[at // block_size, :, at % block_size]
        r = dequantize_rows(r, scale[at // block_size, :, at % block_size], dtype) if int8 else r.to(dtype)
        rows.append(torch.where(stored.view(-1, 1, 1), r, torch.zeros((), dtype=dtype, device=r.device)))
    return rows[0], rows[1]


def reference_write_kv(k_cache, v_cache, key, value, slot_mapping, k_scale=None, v_scale=None):
    """Store ``key/value [T, Hkv, D]`` at ``slot_mapping [T]``; slots < 0 (and past the pool)
    write nothing. int8 caches store ``kv_quant.quantize_rows`` of the rows, their scales in
    ``k_scale``/``v_scale``."""
    int8 = check_kv_scales(k_cache, k_scale, v_scale)
    block_size = k_cache.shape[2]
    keep = (slot_mapping >= 0) & (slot_mapping < k_cache.shape[0] * block_size)
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    slots = slot_mapping.long()
    blocks, rows = slots // block_size, slots % block_size
    if int8:
        (key, k_rows), (value, v_rows) = quantize_rows(key), quantize_rows(value)
        k_scale[blocks, :, rows] = k_rows
        v_scale[blocks, :, rows] = v_rows
    k_cache[blocks, :, rows] = key.to(k_cache.dtype)
    v_cache[blocks, :, rows] = value.to(v_cache.dtype)
