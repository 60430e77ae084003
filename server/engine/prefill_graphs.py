"""Prefill of one sequence's whole prompt, padded to a bucket of lengths and replayed from a CUDA
graph: an arriving request then costs one graph launch instead of an eager pass through every
layer while the running streams wait.

Padding rows follow the prompt, so causal attention keeps them out of every real row; their
slot -1 keeps them out of the cache; the logits are taken at the prompt's last row.
"""

import logging
import time

import torch

from models import AttentionBatch

from .graphs import capture_graphs

log = logging.getLogger(__name__)


class PrefillGraphs:
    def __init__(self, forward, kv_caches, buckets, device: torch.device):
        self.forward = forward                    # forward_logits' contract, the model bound
        self.kv_caches = kv_caches
        self.buckets = tuple(sorted(buckets))
        self.device = device
        n = self.buckets[-1]
        self.ids = torch.zeros(1, n, dtype=torch.int32, device=device)
        self.positions = torch.zeros(1, n, dtype=torch.int32, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int32, device=device)
        self.last = torch.zeros(1, dtype=torch.int64, device=device)
        self._unused_table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        self._unused_lens = torch.ones(1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def bucket_for(self, seq, take: int) -> int | None:
        """The bucket that serves this chunk: a whole prompt (nothing cached before it) that fits."""
        if seq.num_cached != 0:
            return None
        return next((b for b in self.buckets if b >= take), None)

    def _forward(self, length: int) -> torch.Tensor:
        batch = AttentionBatch(self.kv_caches, self.slots[:length], self._unused_table, self._unused_lens,
                               is_decode=False, query_starts=[0, length], context_lens=[0])
        return self.forward(self.ids[:, :length], self.positions[:, :length], batch,
                              logits_rows=self.last)

    def capture(self) -> None:
        started = time.monotonic()
        self.slots.fill_(-1)                               # capture writes nothing into the cache
        self.graphs = capture_graphs(self._forward, self.buckets, self.device)
        self.capture_seconds = time.monotonic() - started
        log.info("captured prefill graphs for prompt lengths up to %s in %.1f s", self.buckets, self.capture_seconds)

    @torch.inference_mode()
    def run(self, seq, take: int, slots: list[int], length: int) -> torch.Tensor:
        """Logits [1, vocab] at the prompt's last token; ``length`` from ``bucket_for``."""
        pad = length - take
        host = torch.tensor([seq.token_ids[:take] + [0] * pad, list(range(length)), slots + [-1] * pad],
                            dtype=torch.int32)
        if self.device.type == "cuda":
            host = host.pin_memory()
        values = host.to(self.device, non_blocking=True)
        self.ids[0, :length].copy_(values[0])
        self.positions[0, :length].copy_(values[1])
        self.slots[:length].copy_(values[2])
        self.last.fill_(take - 1)
        if length in self.graphs:
            graph, logits = self.graphs[length]
            graph.replay()
            return logits.clone()             # the next replay reuses that buffer
        return self._forward(length)
