"""Numbers the Python side and the CUDA sources share, defined here and nowhere else.

``build.py`` hands each to nvcc and the host compiler as ``-DFLASHDECODE_<NAME>=<value>``
(``nvcc_defines()``); ``csrc/flash_decode.h`` turns them into constants and refuses to compile
without them. Python reads them from here.
"""

HEAD_DIMS = (64, 128, 256)  # the head_dims the kernel is built for
HEADS_PER_BLOCK = 16        # query heads one thread block serves (the MMA's M); larger groups take several
MAX_SPLITS = 256            # largest split count a launch accepts (bounds the merge's shared memory)
MIN_CHUNK = 256             # fewest tokens a non-empty split gets (on the device, before rounding to a tile)
TILE_ELEMENTS = 8192        # a K/V tile holds this many elements per tensor: 128 tokens at head_dim 64, 64 at 128, 32 at 256
WIDE_WARP_HEAD_DIM = 64     # at this head_dim, groups of at most WIDE_WARP_MAX_GROUP query heads per KV
WIDE_WARP_MAX_GROUP = 8     # head run four consumer warps of 32 tokens instead of eight of 16
BLOCKS_PER_SM = 2           # split blocks resident per SM (rings of three 32 KB stages)
WIDE_BLOCKS_PER_SM = 3      # ... in the three-per-SM plan (four-warp blocks, rings of two stages)
BLOCK_SIZE_GRANULE = 16     # a cache block holds a multiple of this many tokens ...
BLOCK_SIZE_PERIOD = 128     # ... and divides, or is a multiple of, this many (the largest tile)
PREFILL_ROWS = 64           # query rows (new token, query head of the group) one prefill block serves
PREFILL_TILE = 64           # KV tokens per prefill pipeline stage

SHARED = ("HEAD_DIMS", "WIDE_WARP_HEAD_DIM", "HEADS_PER_BLOCK", "MAX_SPLITS", "MIN_CHUNK", "TILE_ELEMENTS", "WIDE_WARP_MAX_GROUP", "BLOCKS_PER_SM",
          "WIDE_BLOCKS_PER_SM", "BLOCK_SIZE_GRANULE", "BLOCK_SIZE_PERIOD", "PREFILL_ROWS", "PREFILL_TILE")


def tile_tokens(head_dim: int) -> int:
    """Tokens of one K/V tile, a 32 KB pipeline stage of K and V (bf16/fp16)."""
    return TILE_ELEMENTS // head_dim


def nvcc_defines() -> list[str]:
    """A tuple becomes one define per item, NAME_0, NAME_1, ... (nvcc splits a -D value at commas)."""
    defines = []
    for name in SHARED:
        value = globals()[name]
        items = enumerate(value) if isinstance(value, tuple) else [(None, value)]
        defines += [f"-DFLASHDECODE_{name}{'' if i is None else f'_{i}'}={v}" for i, v in items]
    return defines
