"""Paged KV-cache layout shared by the reference and the CUDA kernel.

One layer's cache is a pair of tensors ``[num_blocks, num_kv_heads, block_size, head_dim]``:
each block holds ``block_size`` consecutive tokens of one sequence, and within a block each KV
head's tile is contiguous, so a thread block streams one head's tokens with unit stride.
Token ``t`` of a sequence lives in block ``block_table[seq, t // block_size]`` at row
``t % block_size``. A slot is ``block * block_size + row``; slot -1 marks a padded row that
must write nothing. Entries of ``block_table`` past a sequence's last block are never read.
"""

import torch

from .constants import BLOCK_SIZE_GRANULE, BLOCK_SIZE_PERIOD

# Tokens per cache block unless the engine says otherwise (chosen by measurement: docs/log.md).
DEFAULT_BLOCK_SIZE = 128
SUPPORTED_BLOCK_SIZE_RULE = (f"the CUDA kernel needs a multiple of {BLOCK_SIZE_GRANULE} that divides "
                             f"{BLOCK_SIZE_PERIOD} or is a multiple of it")


def supported_block_size(block_size: int) -> bool:
    return (block_size > 0 and block_size % BLOCK_SIZE_GRANULE == 0
            and (BLOCK_SIZE_PERIOD % block_size == 0 or block_size % BLOCK_SIZE_PERIOD == 0))


def cache_shape(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int) -> tuple[int, ...]:
    return (num_blocks, num_kv_heads, block_size, head_dim)


def pack_paged(k: torch.Tensor, v: torch.Tensor, block_size: int, *, shuffle: bool = True, generator=None):
    """Copy dense ``k, v [B, Hkv, M, D]`` into a paged cache.

    Blocks are handed out in a random order when ``shuffle`` so that tests exercise real
    indirection. Returns ``(k_cache, v_cache, block_table)``.
    """
    if k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"k and v must both be [B, Hkv, M, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, num_kv_heads, max_len, head_dim = k.shape
    blocks_per_seq = -(-max_len // block_size)
    num_blocks = batch * blocks_per_seq
    order = (torch.randperm(num_blocks, generator=generator) if shuffle else torch.arange(num_blocks))
    block_table = order.view(batch, blocks_per_seq).to(torch.int32)
    padded = blocks_per_seq * block_size
    k_cache = k.new_zeros(cache_shape(num_blocks, num_kv_heads, block_size, head_dim))
    v_cache = torch.zeros_like(k_cache)
    for cache, dense in ((k_cache, k), (v_cache, v)):
        if padded != max_len:
            dense = torch.nn.functional.pad(dense, (0, 0, 0, padded - max_len))
        tiles = dense.view(batch, num_kv_heads, blocks_per_seq, block_size, head_dim).transpose(1, 2)
        cache[block_table.flatten().long().to(cache.device)] = tiles.reshape(num_blocks, num_kv_heads, block_size, head_dim)
    return k_cache, v_cache, block_table.to(k.device)
