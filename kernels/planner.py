"""How many KV splits one decode call uses.

A single query row per (sequence, head) leaves the GPU nearly idle when ``batch * kv_heads`` is
small next to the SM count, so the KV sequence is cut into splits that run as separate thread
blocks. The split count depends only on quantities known on the host without reading the
sequence lengths (batch, KV heads, SM count, the longest sequence the workspace serves), so the
same plan is valid for every step replayed from one CUDA graph. Each sequence then divides its
own length evenly among those splits on the device; splits that start past its end are empty.
"""

MIN_CHUNK = 64          # the kernel's tile: a split never gets fewer tokens than this
WAVES = 2               # thread blocks per SM the plan fills: the CUDA kernel keeps two resident


def max_splits_for(max_seq_len: int, cap: int = 128) -> int:
    return max(1, min(cap, -(-max_seq_len // MIN_CHUNK)))


def plan_num_splits(batch: int, num_kv_heads: int, num_sms: int, max_seq_len: int, cap: int = 128) -> int:
    if batch < 1 or num_kv_heads < 1:
        raise ValueError("batch and num_kv_heads must be positive")
    work_items = batch * num_kv_heads
    # Round down: one more block than the resident slots would start a second, nearly empty wave.
    wanted = WAVES * num_sms // work_items
    return max(1, min(wanted, max_splits_for(max_seq_len, cap)))
