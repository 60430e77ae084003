"""Split-KV decode attention over the paged cache on the CPU, one split per cache block.

The same algorithm and result as ``kernels.reference_decode`` (each split's softmax-normalised
partial output and log-sum-exp, merged exactly), with the split boundaries at the cache's own
blocks: each sequence's blocks are read in place of a dense copy of its keys padded to the
split grid, and everything that depends only on the batch (block ids, the mask of positions
past each sequence's end) is computed once per step, not once per layer.
"""

from dataclasses import dataclass

import torch

from kernels.kv_quant import dequantize_rows, quantize_rows
from kernels.window import check_window, window_starts


@dataclass
class DecodePlan:
    """What a decode step's attention needs in every layer, derived once from the batch."""
    block_ids: torch.Tensor      # [B * n] int64: the n blocks holding each sequence's (attended) tokens
    bias: torch.Tensor | None    # [B, n, 1, 1, block_size]: 0 where a token is attended, -inf elsewhere
    has_empty: bool              # some sequence has fewer than n blocks (an empty split)
    slot_blocks: torch.Tensor    # [B] the new token's block
    slot_rows: torch.Tensor      # [B] and its row in it
    first_block: int | None = None   # one sequence whose blocks are consecutive from this one: read in place
    slot: tuple[int, int] | None = None  # one sequence: its new token's (block, row) as host ints

    @classmethod
    def make(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor,
             block_size: int, window: int | None = None) -> "DecodePlan":
        """With a sliding ``window`` (``kernels.window``) each sequence's blocks are those holding its
        last ``window`` positions; the blocks before them are not read."""
        if check_window(window) is not None:
            return cls._windowed(block_tables, seq_lens, slots, block_size, window)
        longest = int(seq_lens.max())
        n = -(-longest // block_size)
        block_ids = block_tables[:, :n].reshape(-1).long().clamp_(0, None)
        bias, has_empty = None, False
        if bool((seq_lens != n * block_size).any()):
            positions = torch.arange(n * block_size).view(1, n, 1, 1, block_size)
            past_end = positions >= seq_lens.view(-1, 1, 1, 1, 1)
            bias = torch.zeros(past_end.shape).masked_fill_(past_end, float("-inf"))
            has_empty = bool((seq_lens <= (n - 1) * block_size).any())
        slots = slots.long()
        first_block = None
        if block_tables.shape[0] == 1:
            first = int(block_ids[0])
            if n == 1 or bool((block_ids == torch.arange(first, first + n)).all()):
                first_block = first
        slot = None
        if slots.shape[0] == 1:
            slot = divmod(int(slots[0]), block_size)
        return cls(block_ids, bias, has_empty, slots // block_size, slots % block_size, first_block, slot)

    @classmethod
    def _windowed(cls, block_tables, seq_lens, slots, block_size, window) -> "DecodePlan":
        lens = seq_lens.long()
        first = window_starts(lens, window)                              # first attended position
        first_col = first // block_size
        n = int((-(-lens // block_size) - first_col).max())
        cols = first_col.view(-1, 1) + torch.arange(n)                   # [B, n] block-table columns
        ids = block_tables.long().gather(1, cols.clamp_max(block_tables.shape[1] - 1))
        positions = (cols * block_size).view(-1, n, 1, 1, 1) + torch.arange(block_size).view(1, 1, 1, 1, -1)
        outside = (positions >= lens.view(-1, 1, 1, 1, 1)) | (positions < first.view(-1, 1, 1, 1, 1))
        bias = torch.zeros(outside.shape).masked_fill_(outside, float("-inf"))
        slots = slots.long()
        return cls(ids.reshape(-1).clamp_(0, None), bias, bool(outside.all(dim=-1).any()), slots // block_size,
                   slots % block_size)


def write_new_kv(k_cache, v_cache, key, value, plan: DecodePlan, k_scale=None, v_scale=None) -> None:
    """Store a decode step's ``key/value [B, Hkv, D]`` (every row a real token); int8 caches
    store them quantised, their row scales in ``k_scale``/``v_scale``."""
    pairs = [(k_cache, key), (v_cache, value)]
    if k_scale is not None:
        (key, k_rows), (value, v_rows) = quantize_rows(key), quantize_rows(value)
        pairs = [(k_cache, key), (v_cache, value), (k_scale, k_rows), (v_scale, v_rows)]
    for dst, src in pairs:
        if plan.slot is not None:
            block, row = plan.slot           # one row: a copy into a view, not an index_put
            dst[block, :, row].copy_(src[0])
        else:
            dst[plan.slot_blocks, :, plan.slot_rows] = src.to(dst.dtype)


def split_kv_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan,
                    scale: float, k_scale=None, v_scale=None) -> torch.Tensor:
    """``q [B, Hq, D]`` -> ``[B, Hq, D]``; caches ``[num_blocks, Hkv, block_size, D]``.
    Computes in the cache's dtype (float32 or float64), in float32 for int8 caches (dequantised
    at their row scales ``k_scale``/``v_scale``)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    split = (batch, -1, *k_cache.shape[1:])
    def blocks(t):
        if plan.first_block is not None:
            return t[plan.first_block:plan.first_block + plan.block_ids.shape[0]]
        return t.index_select(0, plan.block_ids)                          # [B * n, Hkv, bs, D]
    k, v = blocks(k_cache), blocks(v_cache)
    if k_scale is not None:
        k, v = dequantize_rows(k, blocks(k_scale)), dequantize_rows(v, blocks(v_scale))
    k, v = k.view(split), v.view(split)                                  # [B, n, Hkv, bs, D]
    if scale != 1.0:
        q = q * scale
    # batched over (sequence, split, KV head) with torch.bmm: matmul's broadcasting costs more
    # than these small products (docs/log.md, CPU op trimming)
    n, block_size = k.shape[1], k.shape[3]
    qg = q.to(k.dtype).view(batch, 1, num_kv_heads, -1, head_dim)
    group = qg.shape[3]
    qb = qg.expand(batch, n, num_kv_heads, group, head_dim).reshape(-1, group, head_dim)
    scores = torch.bmm(qb, k.reshape(-1, block_size, head_dim).transpose(1, 2))
    scores = scores.view(batch, n, num_kv_heads, group, block_size)      # [B, n, Hkv, G, bs]
    if plan.bias is not None:
        scores += plan.bias
    m = scores.amax(dim=-1, keepdim=True)
    if plan.has_empty:
        m = torch.nan_to_num(m, neginf=0.0)                               # an empty split's m is -inf
    p = scores.sub_(m).exp_()                                             # in place: scores are not read again
    l = p.sum(dim=-1, keepdim=True)
    if plan.has_empty:
        l = l.clamp_min(torch.finfo(l.dtype).tiny)                        # and its l is 0
    o = torch.bmm(p.view(-1, group, block_size), v.reshape(-1, block_size, head_dim))
    o = o.view(batch, n, num_kv_heads, group, head_dim)                  # [B, n, Hkv, G, D], unnormalised
    if o.shape[1] > 1:
        # each split's partial o / l, weighted by softmax over the splits' log-sum-exps; the
        # division by l is folded into the weights ([B, n, Hkv, G, 1]: D times fewer divisions)
        lse = m + torch.log(l)                                            # -inf for an empty split
        o = (o * torch.softmax(lse, dim=1).div_(l)).sum(dim=1)
    else:
        o = o[:, 0].div_(l[:, 0])
    return o.reshape(batch, num_q_heads, head_dim)
