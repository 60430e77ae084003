"""How many KV splits one decode call uses.

A single query row per (sequence, head) leaves the GPU nearly idle when ``batch * kv_heads`` is
small next to the SM count, so the KV sequence is cut into splits that run as separate thread
blocks. The split count depends only on quantities known on the host without reading the
sequence lengths (batch, KV heads, SM count, the longest sequence the workspace serves), so the
same plan is valid for every step replayed from one CUDA graph. Each sequence then divides its
own length evenly among those splits on the device; splits that start past its end are empty.
"""

MIN_CHUNK = 256         # a split never gets fewer tokens (on the device too): fewer cost more to merge
RESIDENT_PER_SM = 2     # the CUDA kernel keeps two blocks per SM (three in the THREE_PER_SM plan)
FILL = 0.95             # a plan must keep at least this share of the block slots busy
ONE_WAVE_FILL = 0.9     # ... or of the SMs, for one block per SM (spread: no SM doubles up)
TAIL_MIN_CHUNK = 8192   # splitting only to even out the last wave pays where splits keep this many tokens
THREE_PER_SM = 3        # four-warp head_dim-64 blocks with rings of two stages: three fit on an SM
THREE_PER_SM_MIN_LEN = 4096  # ... and pay for sequences this long (measured at 4096; at 512 they lost)


def max_splits_for(max_seq_len: int, cap: int = 128) -> int:
    return max(1, min(cap, -(-max_seq_len // MIN_CHUNK)))


def wave_fill(blocks: int, slots: int) -> float:
    """Busy share of the block slots, averaged over the waves, when ``blocks`` equal blocks run."""
    return blocks / (slots * -(-blocks // slots))


def plan_num_splits(batch: int, num_kv_heads: int, num_sms: int, max_seq_len: int, cap: int = 128,
                    three_per_sm: bool = False) -> int:
    """Splits per (sequence, KV head), as measured best on the H200 (kernels/NOTES.md): one wave
    of one block per SM filling 90 % of the SMs, else an even wave of two per SM; else, for long
    sequences, the fewest splits whose blocks fill whole waves; else, where the kernel can run
    three blocks per SM (``three_per_sm``: head_dim 64, at most eight query heads per KV head),
    two splits that fill one such wave; else one."""
    if batch < 1 or num_kv_heads < 1:
        raise ValueError("batch and num_kv_heads must be positive")
    work_items = batch * num_kv_heads
    limit = max_splits_for(max_seq_len, cap)
    for per_sm in range(1, RESIDENT_PER_SM + 1):
        splits = per_sm * num_sms // work_items
        fill = ONE_WAVE_FILL if per_sm == 1 else FILL
        if splits >= 1 and work_items * splits >= fill * per_sm * num_sms:
            return min(splits, limit)
    slots = RESIDENT_PER_SM * num_sms
    tail_limit = max(1, min(limit, max_seq_len // TAIL_MIN_CHUNK))
    for splits in range(1, tail_limit + 1):
        if wave_fill(work_items * splits, slots) >= FILL:
            return splits
    wide_slots = THREE_PER_SM * num_sms
    if (three_per_sm and limit >= 2 and max_seq_len >= THREE_PER_SM_MIN_LEN
            and 2 * work_items <= wide_slots and wave_fill(2 * work_items, wide_slots) >= FILL):
        return 2  # the launcher runs this grid as four-warp blocks, three per SM (flash_decode.cu)
    return 1
