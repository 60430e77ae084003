"""How many KV splits one decode call uses.

A single query row per (sequence, head) leaves the GPU nearly idle when ``batch * kv_heads`` is
small next to the SM count, so the KV sequence is cut into splits that run as separate thread
blocks. The split count depends only on quantities known on the host without reading the
sequence lengths (batch, KV heads, SM count, the longest sequence the workspace serves), so the
same plan is valid for every step replayed from one CUDA graph. Each sequence then divides its
own length evenly among those splits on the device; splits that start past its end are empty.
"""

from dataclasses import dataclass

from .constants import (BLOCKS_PER_SM, HEADS_PER_BLOCK, MIN_CHUNK, PREFILL_ROWS, WIDE_BLOCKS_PER_SM,
                        WIDE_WARP_HEAD_DIM, WIDE_WARP_MAX_GROUP)

MAX_SPLITS = 128        # a workspace plans at most this many splits (the kernel takes up to constants.MAX_SPLITS)
FILL = 0.95             # a plan must keep at least this share of the block slots busy
ONE_WAVE_FILL = 0.9     # ... or of the SMs, for one block per SM (spread: no SM doubles up)
TAIL_MIN_CHUNK = 8192   # splitting only to even out the last wave pays where splits keep this many tokens
THREE_PER_SM_MIN_LEN = 4096  # the three-per-SM plan pays for sequences this long (measured at 4096; at 512 it lost)
PREFILL_MAX_SPLITS = 64      # a prefill plan's cap (not yet measured: docs/prefill-kernel.md)


@dataclass(frozen=True)
class Plan:
    """How the CUDA kernel runs a call: its split count, and whether its blocks run three per SM
    (four-warp head_dim-64 blocks with rings of two stages, the two splits merging in a cluster)."""
    num_splits: int
    three_per_sm: bool = False


def max_splits_for(max_seq_len: int, cap: int = MAX_SPLITS) -> int:
    return max(1, min(cap, -(-max_seq_len // MIN_CHUNK)))


def wave_fill(blocks: int, slots: int) -> float:
    """Busy share of the block slots, averaged over the waves, when ``blocks`` equal blocks run."""
    return blocks / (slots * -(-blocks // slots))


def wide_warps(num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel runs four consumer warps of 32 tokens (else eight, or four at head_dim 128, of 16)."""
    return head_dim == WIDE_WARP_HEAD_DIM and num_q_heads // num_kv_heads <= WIDE_WARP_MAX_GROUP


def plan_num_splits(batch: int, num_kv_heads: int, num_sms: int, max_seq_len: int, cap: int = MAX_SPLITS,
                    three_per_sm: bool = False) -> int:
    """Splits per (sequence, KV head), as measured best on the H200 (docs/log.md); see ``split_plan``."""
    return _plan(batch, num_kv_heads, num_sms, max_seq_len, cap, three_per_sm).num_splits


def split_plan(batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, num_sms: int,
               max_seq_len: int) -> Plan:
    """The plan of a call of ``batch`` sequences of at most ``max_seq_len`` tokens on ``num_sms`` SMs.
    A block serves up to HEADS_PER_BLOCK query heads of one KV head, so the work items are
    ``batch * num_kv_heads * ceil(group / HEADS_PER_BLOCK)``."""
    return _plan(batch, work_heads(num_q_heads, num_kv_heads), num_sms, max_seq_len, MAX_SPLITS,
                 wide_warps(num_q_heads, num_kv_heads, head_dim))


def work_heads(num_q_heads: int, num_kv_heads: int) -> int:
    """Thread blocks per sequence and split: one per KV head and HEADS_PER_BLOCK of its query heads."""
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    return num_kv_heads * -(-(num_q_heads // num_kv_heads) // HEADS_PER_BLOCK)


def _plan(batch, num_kv_heads, num_sms, max_seq_len, cap, three_per_sm) -> Plan:
    """One wave of one block per SM filling 90 % of the SMs, else an even wave of two per SM; else,
    for long sequences, the fewest splits whose blocks fill whole waves; else, where the kernel can
    run three blocks per SM (``three_per_sm``: four-warp blocks), two splits that fill one such
    wave; else one."""
    if batch < 1 or num_kv_heads < 1:
        raise ValueError("batch and num_kv_heads must be positive")
    work_items = batch * num_kv_heads
    limit = max_splits_for(max_seq_len, cap)
    for per_sm in range(1, BLOCKS_PER_SM + 1):
        splits = per_sm * num_sms // work_items
        fill = ONE_WAVE_FILL if per_sm == 1 else FILL
        if splits >= 1 and work_items * splits >= fill * per_sm * num_sms:
            return Plan(min(splits, limit))
    slots = BLOCKS_PER_SM * num_sms
    tail_limit = max(1, min(limit, max_seq_len // TAIL_MIN_CHUNK))
    for splits in range(1, tail_limit + 1):
        if wave_fill(work_items * splits, slots) >= FILL:
            return Plan(splits)
    wide_slots = WIDE_BLOCKS_PER_SM * num_sms
    if (three_per_sm and limit >= 2 and max_seq_len >= THREE_PER_SM_MIN_LEN
            and 2 * work_items <= wide_slots and wave_fill(2 * work_items, wide_slots) >= FILL):
        return Plan(2, three_per_sm=True)
    return Plan(1)


def prefill_row_tiles(num_rows: int, batch: int, num_q_heads: int, num_kv_heads: int) -> int:
    """Upper bound of the prefill kernel's row tiles per KV head (its grid's z): a sequence of n new
    tokens has ``n * group`` query rows in ``ceil(n * group / PREFILL_ROWS)`` tiles, so ``num_rows``
    tokens over ``batch`` sequences take at most ``ceil(num_rows * group / PREFILL_ROWS) + batch``."""
    group = num_q_heads // num_kv_heads
    return -(-num_rows * group // PREFILL_ROWS) + batch


def prefill_plan(num_rows: int, batch: int, num_q_heads: int, num_kv_heads: int, num_sms: int,
                 max_seq_len: int, window: int | None = None) -> Plan:
    """Splits of a prefill call of ``num_rows`` new tokens over ``batch`` sequences of at most
    ``max_seq_len`` tokens (cached + new), from host-known numbers only (a captured graph replays
    it). Work items are ``num_kv_heads`` times the fewest row tiles the call can have,
    ``max(min(batch, num_rows), ceil(num_rows * group / PREFILL_ROWS))`` (sequences may be empty); the splits are as many as fill one wave
    of BLOCKS_PER_SM blocks per SM, at most PREFILL_MAX_SPLITS and never below MIN_CHUNK tokens
    of the span a row tile attends to (a window's ``window + PREFILL_ROWS``, else the sequence)."""
    if num_rows < 1 or batch < 1 or num_sms < 1 or max_seq_len < 1:
        raise ValueError(f"prefill_plan needs positive sizes, got num_rows {num_rows}, batch {batch}, "
                         f"num_sms {num_sms}, max_seq_len {max_seq_len}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    group = num_q_heads // num_kv_heads
    work_items = num_kv_heads * max(min(batch, num_rows), -(-num_rows * group // PREFILL_ROWS))
    span = max_seq_len if window is None else min(max_seq_len, window + PREFILL_ROWS)
    splits = BLOCKS_PER_SM * num_sms // work_items
    return Plan(max(1, min(splits, PREFILL_MAX_SPLITS, max_splits_for(span))))
