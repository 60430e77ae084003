"""The split workspace: every buffer one decode call needs, allocated once, and the call's plan.

Partial outputs and LSEs are stored per (sequence, query head, split). The capacity is the
largest ``batch * num_splits`` any call up to ``max_batch`` is planned with, so no call
allocates. ``plan(batch)`` is the plan a call of that batch uses (``planner.split_plan``), fixed
for the life of the workspace, which is what lets a CUDA graph captured for one batch size
replay it. The plan depends on both head counts, so a workspace serves only calls of its own
head layout, head_dim and longest sequence (``check_call``).

A sliding-window layer attends to at most ``window`` positions, so it is planned over that span,
not the longest sequence: the workspace holds one plan per batch for global attention and one per
batch for each window in ``windows`` (Gemma 3's local and global layers share one workspace, and
every plan is fixed at construction, as graph replay needs). A window at least ``max_seq_len``
long is global attention and uses the global plan.

An int8 cache at head_dim 256 (``kv_int8``) doubles a plan whose blocks fill at most one wave of
one block per SM: its consumers convert 256 codes a row, so a second block per SM pays (on an H100,
4/1/256: B = 8 with 32k cached 114 -> 80 us, B = 64 with 4k 114 -> 77 us and with 32k 857 -> 520
us; unchanged where the plan already fills the SMs or the splits are capped). A workspace serves
the caches it was planned for (``check_cache``).

``split_scale`` multiplies every planned split count (at most ``max_splits``; the three-per-SM
plan becomes a plain one): an A/B knob for measuring other plans (``benchmarks.kernel_bench``),
1 in the product.
"""

import torch

from .planner import Plan, max_splits_for, prefill_plan, split_plan, work_heads
from .window import check_window

INT8_WIDE_HEAD_DIM = 256    # int8 caches of this head_dim plan two blocks per SM where bf16 plans one


def device_sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


class _SplitBuffers:
    """What both workspaces hold and check alike: the head layout, head_dim, longest sequence and
    windows planned for, and the float32 split buffers (partial outputs and LSEs)."""

    def _set_layout(self, what: str, count: int, num_q_heads: int, head_dim: int, max_seq_len: int, device,
                    num_kv_heads: int, windows) -> None:
        if count < 1 or num_q_heads < 1 or num_kv_heads < 1 or head_dim < 1 or max_seq_len < 1:
            raise ValueError(f"{what}, num_q_heads, num_kv_heads, head_dim and max_seq_len must be positive")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.device = torch.device(device)
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.num_sms = device_sm_count(self.device)
        self.windows = tuple(sorted({w for w in map(check_window, windows) if w is not None and w < max_seq_len}))

    def _allocate(self, capacity_rows: int) -> None:
        self.capacity_rows = capacity_rows
        self.partial_out = torch.empty(capacity_rows, self.num_q_heads, self.head_dim, dtype=torch.float32,
                                       device=self.device)
        self.partial_lse = torch.empty(capacity_rows, self.num_q_heads, dtype=torch.float32, device=self.device)
        self.device = self.partial_out.device   # with its index: cuda means cuda:<current>

    def serves_window(self, window: int | None) -> bool:
        window = check_window(window)
        return window is None or window >= self.max_seq_len or window in self.windows

    def _check_layout(self, num_q_heads: int, num_kv_heads: int, head_dim: int, max_blocks: int, block_size: int,
                      device) -> None:
        """Refuses, naming both values, a call of another head layout, head_dim or device, or whose
        block table (``max_blocks * block_size``) reaches past the longest sequence planned for."""
        for what, ours, call in (("num_kv_heads", self.num_kv_heads, num_kv_heads),
                                 ("num_q_heads", self.num_q_heads, num_q_heads),
                                 ("head_dim", self.head_dim, head_dim)):
            if ours != call:
                raise ValueError(f"the workspace was planned for {what} {ours}, this call has {what} {call}")
        if max_blocks > -(-self.max_seq_len // block_size):
            raise ValueError(f"the workspace was planned for sequences of up to {self.max_seq_len} tokens, this "
                             f"call's block table reaches {max_blocks * block_size} ({max_blocks} blocks of "
                             f"{block_size})")
        if torch.device(device) != self.device:
            raise ValueError(f"the workspace is on {self.device}, this call on {device}")


class Workspace(_SplitBuffers):
    def __init__(self, max_batch: int, num_q_heads: int, head_dim: int, max_seq_len: int, device,
                 num_kv_heads: int, windows=(), split_scale: int = 1, kv_int8: bool = False):
        self._set_layout("max_batch", max_batch, num_q_heads, head_dim, max_seq_len, device, num_kv_heads, windows)
        self.max_batch = max_batch
        self.max_splits = max_splits_for(max_seq_len)
        if split_scale < 1:
            raise ValueError(f"split_scale must be positive, got {split_scale}")

        self.kv_int8 = bool(kv_int8)

        def planned(batch, span):
            plan = split_plan(batch, num_q_heads, num_kv_heads, head_dim, self.num_sms, span)
            if self.kv_int8 and head_dim == INT8_WIDE_HEAD_DIM and not plan.three_per_sm:
                blocks = batch * work_heads(num_q_heads, num_kv_heads) * plan.num_splits
                if blocks <= self.num_sms:
                    plan = Plan(min(plan.num_splits * 2, max_splits_for(span)))
            return plan if split_scale == 1 else Plan(min(plan.num_splits * split_scale, self.max_splits))
        self._plans = {span: [Plan(1)] + [planned(b, span) for b in range(1, max_batch + 1)]
                       for span in (max_seq_len, *self.windows)}
        self._allocate(max(b * plans[b].num_splits for plans in self._plans.values()
                           for b in range(1, max_batch + 1)))

    def plan(self, batch: int, window: int | None = None) -> Plan:
        """The plan of a call of ``batch`` sequences, attending to the last ``window`` positions of each."""
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch {batch} outside this workspace's 1..{self.max_batch}")
        if not self.serves_window(window):
            raise ValueError(f"the workspace was planned for windows {list(self.windows) or 'none'} (and global "
                             f"attention), this call has window {window}")
        span = self.max_seq_len if window is None or window >= self.max_seq_len else window
        return self._plans[span][batch]

    def num_splits(self, batch: int, window: int | None = None) -> int:
        return self.plan(batch, window).num_splits

    def check_cache(self, kv_int8: bool) -> None:
        """Refuses, naming both, caches of another kind than the workspace was planned for."""
        if bool(kv_int8) != self.kv_int8:
            ours, call = ("int8" if x else "bf16/fp16" for x in (self.kv_int8, kv_int8))
            raise ValueError(f"the workspace was planned for {ours} caches, this call has {call} caches")

    def check_call(self, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_blocks: int,
                   block_size: int, device, window: int | None = None) -> Plan:
        """The plan of a call of ``batch`` sequences; refuses, naming both values, a call this
        workspace was not planned for. ``max_blocks * block_size`` (the block table's reach)
        bounds the call's longest sequence."""
        self._check_layout(num_q_heads, num_kv_heads, head_dim, max_blocks, block_size, device)
        return self.plan(batch, window)


class PrefillWorkspace(_SplitBuffers):
    """The split buffers of ``flash_prefill`` calls of up to ``max_rows`` new tokens (all
    sequences together), allocated once: partial outputs and LSEs per (new token, split, query
    head), as many rows as the largest ``num_rows * num_splits`` any planned call needs
    (``planner.prefill_plan``; a call of one split writes its output directly). The plan of a call
    is a pure function of its token count, batch and window, so a graph captured for one shape
    replays it; a workspace serves its own head layout, head_dim, longest sequence and windows
    (``check_call``), refusing others naming both values."""

    def __init__(self, max_rows: int, num_q_heads: int, head_dim: int, max_seq_len: int, device,
                 num_kv_heads: int, windows=()):
        self._set_layout("max_rows", max_rows, num_q_heads, head_dim, max_seq_len, device, num_kv_heads, windows)
        self.max_rows = max_rows
        capacity = 0
        for window in (None, *self.windows):
            for rows in range(1, max_rows + 1):   # splits only fall as rows grow; one split needs no buffer
                splits = self.plan(rows, 1, window).num_splits
                if splits == 1:
                    break
                capacity = max(capacity, rows * splits)
        self._allocate(max(capacity, 1))

    def plan(self, num_rows: int, batch: int, window: int | None = None) -> Plan:
        """The plan of a call of ``num_rows`` new tokens over ``batch`` sequences."""
        if not 1 <= num_rows <= self.max_rows:
            raise ValueError(f"the workspace was planned for up to {self.max_rows} new tokens, this call has "
                             f"{num_rows}")
        if not self.serves_window(window):
            raise ValueError(f"the workspace was planned for windows {list(self.windows) or 'none'} (and global "
                             f"attention), this call has window {window}")
        window = None if window is None or window >= self.max_seq_len else window
        return prefill_plan(num_rows, batch, self.num_q_heads, self.num_kv_heads, self.num_sms, self.max_seq_len,
                            window)

    def check_call(self, num_rows: int, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                   max_blocks: int, block_size: int, device, window: int | None = None) -> Plan:
        """The plan of the call; refuses, naming both values, a call this workspace was not planned
        for (``max_blocks * block_size``, the block table's reach, bounds its longest sequence)."""
        self._check_layout(num_q_heads, num_kv_heads, head_dim, max_blocks, block_size, device)
        return self.plan(num_rows, batch, window)
