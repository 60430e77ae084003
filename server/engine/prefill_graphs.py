"""Prefill of whole prompts, packed and padded to a bucket of token counts, replayed from CUDA
graphs: gathering arrivals costs one graph launch instead of an eager pass through every layer
(~300 launches of host-bound dispatch, ~8 ms) while the running streams wait.

Up to ``max_seqs`` prompts share one replay. The padding rows form one more sequence after the
real ones (so attention stays finite there) and carry slot -1 (so they write nothing into the
cache); unused sequence slots are empty. The logits are taken at each prompt's last row.
"""

import logging
import time

import torch

from models import AttentionBatch

from .graphs import capture_graphs

log = logging.getLogger(__name__)


class PrefillGraphs:
    def __init__(self, forward, kv_caches, buckets, max_seqs: int, device: torch.device):
        self.forward = forward                    # forward_logits' contract, the model bound
        self.kv_caches = kv_caches
        self.buckets = tuple(sorted(buckets))
        self.max_seqs = max_seqs
        self.device = device
        n = self.buckets[-1]
        self.ids = torch.zeros(1, n, dtype=torch.int32, device=device)
        self.positions = torch.zeros(1, n, dtype=torch.int32, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int32, device=device)
        # one more sequence than prompts: the padding rows
        self.starts = torch.zeros(max_seqs + 2, dtype=torch.int32, device=device)
        self.last_rows = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self._unused_table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        self._unused_lens = torch.ones(1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def bucket_for(self, chunks) -> int | None:
        """The bucket that serves these chunks: whole prompts (nothing cached before them), few
        enough and short enough together."""
        if len(chunks) > self.max_seqs or any(seq.num_cached for seq, _ in chunks):
            return None
        total = sum(take for _, take in chunks)
        return next((b for b in self.buckets if b >= total), None)

    def _forward(self, length: int, query_starts=None) -> torch.Tensor:
        # On a GPU the attention reads the device copy of the starts (varlen); on a CPU the host list.
        batch = AttentionBatch(self.kv_caches, self.slots[:length], self._unused_table, self._unused_lens,
                               is_decode=False, query_starts=query_starts,
                               context_lens=None if query_starts is None else [0] * (len(query_starts) - 1),
                               cu_query_starts=self.starts if self.device.type == "cuda" else None,
                               max_query_len=length)
        return self.forward(self.ids[:, :length], self.positions[:, :length], batch, logits_rows=self.last_rows)

    def capture(self) -> None:
        started = time.monotonic()
        self.slots.fill_(-1)                               # capture writes nothing into the cache
        self.graphs = capture_graphs(self._forward, self.buckets, self.device,
                                     prepare=lambda length: self._load_starts([0, length]))
        self.capture_seconds = time.monotonic() - started
        log.info("captured prefill graphs for up to %d prompts of %s tokens in all in %.1f s",
                 self.max_seqs, self.buckets, self.capture_seconds)

    def _padded_starts(self, starts: list[int]) -> list[int]:
        return starts + [starts[-1]] * (self.max_seqs + 2 - len(starts))

    def _load_starts(self, starts: list[int]) -> None:
        self.starts.copy_(torch.tensor(self._padded_starts(starts), dtype=torch.int32))

    @torch.inference_mode()
    def run(self, chunks, slots: list[int], length: int) -> torch.Tensor:
        """Logits [len(chunks), vocab] at each prompt's last token; ``length`` from ``bucket_for``."""
        ids, positions, starts = [], [], [0]
        for seq, take in chunks:
            ids.extend(seq.token_ids[:take])
            positions.extend(range(take))
            starts.append(starts[-1] + take)
        pad = length - starts[-1]
        if pad:
            starts.append(length)                          # the padding rows: a sequence of their own
        last = [s - 1 for s in starts[1:len(chunks) + 1]]
        # ids | positions | slots | starts: one copy
        host = torch.tensor(ids + [0] * pad + positions + [0] * pad + slots + [-1] * pad + self._padded_starts(starts),
                            dtype=torch.int32)
        rows = torch.tensor(last + [0] * (self.max_seqs - len(last)), dtype=torch.int64)
        if self.device.type == "cuda":
            host, rows = host.pin_memory(), rows.pin_memory()
        values = host.to(self.device, non_blocking=True)
        self.ids[0, :length].copy_(values[:length])
        self.positions[0, :length].copy_(values[length:2 * length])
        self.slots[:length].copy_(values[2 * length:3 * length])
        self.starts.copy_(values[3 * length:])
        self.last_rows.copy_(rows, non_blocking=True)
        if length in self.graphs:
            graph, logits = self.graphs[length]
            graph.replay()
            return logits[:len(chunks)].clone()            # the next replay reuses that buffer
        return self._forward(length, starts)[:len(chunks)]
