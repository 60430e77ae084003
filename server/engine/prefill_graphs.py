"""Prefill of packed prompt chunks, padded to a bucket of token counts, replayed from CUDA graphs:
gathering arrivals costs one graph launch instead of an eager pass through every layer (~300
launches of host-bound dispatch, ~8 ms) while the running streams wait.

Up to ``max_seqs`` chunks share one replay. The padding rows form one more sequence after the
real ones (so attention stays finite there) and carry slot -1 (so they write nothing into the
cache); unused sequence slots are empty. The logits are taken at each chunk's last row.

Whole prompts (nothing cached before them) attend over their own keys. Chunks that follow a
cached prefix (prefix caching, or a long prompt's later chunks) attend over key rows read from
the cache at their slots (``key_rows``, ``kernels.read_kv``): their graphs are captured per pair
of token bucket and key-row bucket; the padding sequence's key rows, as many as its query rows,
and the bucket's spare rows read zeros (slot -1). Captured graphs always run that FlashAttention
path, never the split-KV kernel the measured table may choose for an eager step
(``ModelRunner.takes_split_kv``): one graph serves every shape of its buckets, which the table may
answer differently, and the table measured unpadded calls, not a bucket's padded one.
"""

import logging
import time

import numpy as np
import torch

from models import AttentionBatch

from .graphs import capture_graphs

log = logging.getLogger(__name__)

# Key rows (cached tokens and chunks together) a prefill after a cached prefix may gather.
KEY_ROW_BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def token_slots(seq, first: int, count: int, block_size: int) -> np.ndarray:
    """The cache slots (int64) of ``seq``'s tokens ``first`` .. ``first + count - 1``."""
    positions = np.arange(first, first + count)
    return np.asarray(seq.block_table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


def key_rows(chunks, block_size: int) -> tuple[np.ndarray, list[int]]:
    """For chunks [(seq, take)] whose first ``seq.num_cached`` tokens are cached: the cache slot
    (int32) of every key row, each sequence's rows from its first token through its chunk, and
    the starts of each sequence's rows."""
    slots, starts = [], [0]
    for seq, take in chunks:
        slots.append(token_slots(seq, 0, seq.num_cached + take, block_size))
        starts.append(starts[-1] + len(slots[-1]))
    return np.concatenate(slots).astype(np.int32), starts


class PrefillGraphs:
    def __init__(self, forward, kv_caches, buckets, max_seqs: int, block_size: int, device: torch.device,
                 pool_tokens: int, kv_scales=None):
        self.forward = forward                    # forward_logits' contract, the model bound
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales                # int8 caches: each layer's (k_scale, v_scale)
        self.buckets = tuple(sorted(buckets))
        # key rows are at most the pool's tokens and the padding rows
        most = pool_tokens + self.buckets[-1]
        self.key_row_buckets = tuple(b for i, b in enumerate(KEY_ROW_BUCKETS) if i == 0 or KEY_ROW_BUCKETS[i - 1] < most)
        self.max_seqs = max_seqs
        self.block_size = block_size
        self.device = device
        n, keys = self.buckets[-1], self.key_row_buckets[-1]
        self.ids = torch.zeros(1, n, dtype=torch.int32, device=device)
        self.positions = torch.zeros(1, n, dtype=torch.int32, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int32, device=device)
        # one more sequence than chunks: the padding rows
        self.starts = torch.zeros(max_seqs + 2, dtype=torch.int32, device=device)
        self.key_starts = torch.zeros(max_seqs + 2, dtype=torch.int32, device=device)
        self.key_slots = torch.full((keys,), -1, dtype=torch.int32, device=device)
        self.last_rows = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self._unused_table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        self._unused_lens = torch.ones(1, dtype=torch.int32, device=device)
        # {(token rows, key rows): (graph, logits)}; key rows 0: whole prompts
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def bucket_for(self, chunks) -> tuple[int, int] | None:
        """The (token bucket, key-row bucket, 0 for whole prompts) that serves these chunks, or
        None when they are too many or too long."""
        if len(chunks) > self.max_seqs:
            return None
        total = sum(take for _, take in chunks)
        length = next((b for b in self.buckets if b >= total), None)
        if length is None or not any(seq.num_cached for seq, _ in chunks):
            return None if length is None else (length, 0)
        keys = sum(seq.num_cached + take for seq, take in chunks) + length - total
        bucket = next((b for b in self.key_row_buckets if b >= keys), None)
        return None if bucket is None else (length, bucket)

    def _forward(self, shape, query_starts=None, key_starts=None) -> torch.Tensor:
        # On a GPU attention reads the device copies of the starts (varlen); on a CPU the host lists.
        length, keys = shape
        on_gpu = self.device.type == "cuda"
        context = dict(key_slots=self.key_slots[:keys],
                       cu_kv_starts=self.key_starts if on_gpu else None, kv_starts=key_starts,
                       max_kv_len=keys) if keys else {}
        batch = AttentionBatch(self.kv_caches, self.slots[:length], self._unused_table, self._unused_lens,
                               is_decode=False, query_starts=query_starts,
                               context_lens=None if query_starts is None else [0] * (len(query_starts) - 1),
                               cu_query_starts=self.starts if on_gpu else None,
                               max_query_len=length, kv_scales=self.kv_scales, **context)
        return self.forward(self.ids[:, :length], self.positions[:, :length], batch, logits_rows=self.last_rows)

    def shapes(self) -> list[tuple[int, int]]:
        return ([(length, 0) for length in self.buckets]
                + [(length, keys) for length in self.buckets for keys in self.key_row_buckets if keys >= length])

    def capture(self) -> None:
        started = time.monotonic()
        self.slots.fill_(-1)                               # capture writes nothing into the cache

        def prepare(shape):
            length, keys = shape
            self._load_starts(self.starts, [0, length])
            self._load_starts(self.key_starts, [0, keys or length])

        self.graphs = capture_graphs(self._forward, self.shapes(), self.device, prepare=prepare)
        self.capture_seconds = time.monotonic() - started
        log.info("captured prefill graphs for up to %d chunks of %s tokens in all (after a cached prefix: "
                 "with up to %s key rows) in %.1f s", self.max_seqs, self.buckets, self.key_row_buckets,
                 self.capture_seconds)

    def _padded(self, starts: list[int]) -> list[int]:
        return starts + [starts[-1]] * (self.max_seqs + 2 - len(starts))

    def _load_starts(self, target: torch.Tensor, starts: list[int]) -> None:
        target.copy_(torch.tensor(self._padded(starts), dtype=torch.int32))

    @torch.inference_mode()
    def run(self, chunks, slots: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
        """Logits [len(chunks), vocab] at each chunk's last token; ``shape`` from ``bucket_for``."""
        length, keys = shape
        ids, positions, starts = [], [], [0]
        for seq, take in chunks:
            first = seq.num_cached
            ids.extend(seq.token_ids[first:first + take])
            positions.extend(range(first, first + take))
            starts.append(starts[-1] + take)
        pad = length - starts[-1]
        if pad:
            starts.append(length)                          # the padding rows: a sequence of their own
        last = [s - 1 for s in starts[1:len(chunks) + 1]]
        # ids | positions | slots | starts (| key starts | key slots): one copy
        parts = [ids, [0] * pad, positions, [0] * pad, slots, [-1] * pad, self._padded(starts)]
        key_starts = None
        if keys:
            key_slots, key_starts = key_rows(chunks, self.block_size)
            if pad:
                key_starts.append(key_starts[-1] + pad)    # its keys: rows of zeros, as many as its queries
            parts += [self._padded(key_starts), key_slots, np.full(keys - len(key_slots), -1, np.int32)]
        host = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int32) for p in parts]))
        rows = torch.tensor(last + [0] * (self.max_seqs - len(last)), dtype=torch.int64)
        if self.device.type == "cuda":
            host, rows = host.pin_memory(), rows.pin_memory()
        values = host.to(self.device, non_blocking=True)
        s = self.max_seqs + 2
        self.ids[0, :length].copy_(values[:length])
        self.positions[0, :length].copy_(values[length:2 * length])
        self.slots[:length].copy_(values[2 * length:3 * length])
        self.starts.copy_(values[3 * length:3 * length + s])
        if keys:
            at = 3 * length + s
            self.key_starts.copy_(values[at:at + s])
            self.key_slots[:keys].copy_(values[at + s:at + s + keys])
        self.last_rows.copy_(rows, non_blocking=True)
        if shape in self.graphs:
            graph, logits = self.graphs[shape]
            graph.replay()
            return logits[:len(chunks)].clone()            # the next replay reuses that buffer
        return self._forward(shape, starts, key_starts)[:len(chunks)]
