"""The split workspace: every buffer one decode call needs, allocated once.

Partial outputs and LSEs are stored per (sequence, query head, split). The capacity is the
largest ``batch * num_splits`` any call up to ``max_batch`` is planned with, so no call
allocates. ``num_splits(batch)`` is the plan a call of that batch uses, fixed for the life of
the workspace, which is what lets a CUDA graph captured for one batch size replay it.
"""

import torch

from .planner import max_splits_for, plan_num_splits


def device_sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


class Workspace:
    def __init__(self, max_batch: int, num_q_heads: int, head_dim: int, max_seq_len: int, device,
                 num_kv_heads: int | None = None, max_splits: int | None = None):
        if max_batch < 1 or num_q_heads < 1 or max_seq_len < 1:
            raise ValueError("max_batch, num_q_heads and max_seq_len must be positive")
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads or num_q_heads
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.max_splits = max_splits or max_splits_for(max_seq_len)
        self.num_sms = device_sm_count(self.device)
        # The CUDA kernel runs one thread block per 16 query heads of a KV head's group.
        group = num_q_heads // self.num_kv_heads
        work_heads = self.num_kv_heads * -(-group // 16)
        three_per_sm = head_dim == 64 and group <= 8 and self.device.type == "cuda"
        # The launcher's plan (the kernel may run three blocks per SM), and the one for calls whose
        # launch arguments rule that out (an explicit merge mode, ring depth or warp layout).
        self._plan, self._plain_plan = ([0] + [
            plan_num_splits(b, work_heads, self.num_sms, max_seq_len, self.max_splits, wide)
            for b in range(1, max_batch + 1)] for wide in (three_per_sm, False))
        rows = max(b * max(self._plan[b], self._plain_plan[b]) for b in range(1, max_batch + 1))
        rows = max(rows, self.max_splits)           # any batch-1 call may ask for max_splits
        self.capacity_rows = rows
        self.partial_out = torch.empty(rows, num_q_heads, head_dim, dtype=torch.float32, device=self.device)
        self.partial_lse = torch.empty(rows, num_q_heads, dtype=torch.float32, device=self.device)
        # One counter per (sequence, thread-block head group); num_q_heads bounds the groups.
        self.merge_counters = torch.zeros(max_batch * num_q_heads, dtype=torch.int32, device=self.device)

    def num_splits(self, batch: int, three_per_sm: bool = True) -> int:
        """The split count of a call of ``batch`` sequences; ``three_per_sm=False`` for a call whose
        launch arguments keep the kernel from running three blocks per SM."""
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch {batch} outside this workspace's 1..{self.max_batch}")
        return (self._plan if three_per_sm else self._plain_plan)[batch]

    def fits(self, batch: int, num_splits: int) -> bool:
        return batch <= self.max_batch and batch * num_splits <= self.capacity_rows and num_splits <= self.max_splits
