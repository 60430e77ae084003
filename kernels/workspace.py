"""The split workspace: every buffer one decode call needs, allocated once, and the call's plan.

Partial outputs and LSEs are stored per (sequence, query head, split). The capacity is the
largest ``batch * num_splits`` any call up to ``max_batch`` is planned with, so no call
allocates. ``plan(batch)`` is the plan a call of that batch uses (``planner.split_plan``), fixed
for the life of the workspace, which is what lets a CUDA graph captured for one batch size
replay it. The plan depends on both head counts, so a workspace serves only calls of its own
head layout, head_dim and longest sequence (``check_call``).
"""

import torch

from .planner import Plan, max_splits_for, split_plan


def device_sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


class Workspace:
    def __init__(self, max_batch: int, num_q_heads: int, head_dim: int, max_seq_len: int, device,
                 num_kv_heads: int):
        if max_batch < 1 or num_q_heads < 1 or num_kv_heads < 1 or head_dim < 1 or max_seq_len < 1:
            raise ValueError("max_batch, num_q_heads, num_kv_heads, head_dim and max_seq_len must be positive")
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.max_splits = max_splits_for(max_seq_len)
        self.num_sms = device_sm_count(self.device)
        self._plans = [Plan(1)] + [split_plan(b, num_q_heads, num_kv_heads, head_dim, self.num_sms, max_seq_len)
                                   for b in range(1, max_batch + 1)]
        self.capacity_rows = max(b * self._plans[b].num_splits for b in range(1, max_batch + 1))
        self.partial_out = torch.empty(self.capacity_rows, num_q_heads, head_dim, dtype=torch.float32,
                                       device=self.device)
        self.partial_lse = torch.empty(self.capacity_rows, num_q_heads, dtype=torch.float32, device=self.device)
        self.device = self.partial_out.device   # with its index: cuda means cuda:<current>

    def plan(self, batch: int) -> Plan:
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch {batch} outside this workspace's 1..{self.max_batch}")
        return self._plans[batch]

    def num_splits(self, batch: int) -> int:
        return self.plan(batch).num_splits

    def check_call(self, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_blocks: int,
                   block_size: int, device) -> Plan:
        """The plan of a call of ``batch`` sequences; refuses, naming both values, a call this
        workspace was not planned for. ``max_blocks * block_size`` (the block table's reach)
        bounds the call's longest sequence."""
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
        return self.plan(batch)
