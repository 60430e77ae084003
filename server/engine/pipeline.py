"""The decode step's host/device protocol: metadata in, sampled ids out, one step in flight.

A decode step is launched before the previous step's sampled ids are read back, so the host's
bookkeeping overlaps the device's next step. That needs, all owned here:

- one device buffer holding the last decode's sampled ids and the metadata of the next step
  (host ids, where each row's input id comes from, positions, slots, lengths, block table); the
  positions, slots and lengths the graphs read are views of it, so one copy loads them;
- two pinned host buffers of that metadata taking turns (one is rewritten while the other's
  copy may still be pending), each with the event of its copy;
- each row's source: the row of the previous step whose sampled id is this row's input, or -1
  when the host knows the input (``select_inputs`` picks them on the device, inside the graph);
- three pinned read-back buffers (two for decode steps taking turns, one for prefills), each
  with the event that marks its copy done, and the step whose ids are on their way.

A sequence's ``pending`` counts its tokens sampled on the device and not yet read back.
"""

import itertools
import time
from typing import NamedTuple

import numpy as np
import torch


class Sampled(NamedTuple):
    """A step's sampled ids, read back: one per sequence, with log-probabilities where asked for."""
    seqs: list
    ids: list[int]
    logprobs: list[tuple[float, list[int], list[float]] | None] | None   # per sequence: (of the token drawn,
                                                                      # likeliest ids, their values)
    waited_s: float                               # host time spent waiting for the copy


MAX_TOP_LOGPROBS = 20                             # top log-probabilities per row a step reads back at most


def _into(host: torch.Tensor, tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``tensor`` copied into the front of the flat pinned buffer ``host`` (without waiting for it
    on CUDA), viewed in ``tensor``'s shape."""
    if tensor is None:
        return None
    view = host[:tensor.numel()].view(tensor.shape)
    view.copy_(tensor, non_blocking=True)
    return view


class _Readback:
    """One step's sampled ids (and log-probabilities) on their way to pinned host buffers."""

    def __init__(self, seqs, ids_host: torch.Tensor, logprobs, count: int, done):
        self.seqs, self._ids, self._logprobs, self._count, self._done = seqs, ids_host, logprobs, count, done

    @classmethod
    def launch(cls, seqs, ids: torch.Tensor, logprobs, ids_host: torch.Tensor, logprobs_host: tuple,
               done: torch.cuda.Event | None) -> "_Readback":
        """``ids``: int32 on the device; ``logprobs``: a ``sampler.StepLogprobs`` or None, read
        into ``logprobs_host`` (three flat pinned buffers)."""
        count = ids.shape[0]
        ids_host[:count].copy_(ids, non_blocking=True)
        host_logprobs = None
        if logprobs is not None:
            sampled, top_ids, top_values = logprobs_host
            host_logprobs = (logprobs.rows, _into(sampled, logprobs.sampled), _into(top_ids, logprobs.top_ids),
                             _into(top_values, logprobs.top_logprobs))
        if done is not None:
            done.record()
        return cls(seqs, ids_host, host_logprobs, count, done)

    def read(self) -> Sampled:
        waited = 0.0
        if self._done is not None:
            started = time.monotonic()
            self._done.synchronize()
            waited = time.monotonic() - started
        n = self._count
        ids = self._ids[:n].tolist()
        logprobs = None
        if self._logprobs is not None:
            rows, sampled, top_ids, top_values = self._logprobs
            logprobs = [None] * n
            sampled = sampled.tolist()
            top_ids = top_ids.tolist() if top_ids is not None else [[]] * len(rows)
            top_values = top_values.tolist() if top_values is not None else [[]] * len(rows)
            for row, value, best, best_values in zip(rows, sampled, top_ids, top_values):
                logprobs[row] = (value, best, best_values)
        for seq in self.seqs:
            seq.pending -= 1
        return Sampled(self.seqs, ids, logprobs, waited)


class StepPipeline:
    def __init__(self, max_batch: int, max_blocks_per_seq: int, block_size: int, device: torch.device):
        n, widest = max_batch, max_blocks_per_seq
        self.max_batch = n
        self.block_size = block_size
        pin = device.type == "cuda"
        # device: sampled ids | host ids | input rows | positions | slots | lengths | block table (rows x width);
        # the host buffers hold everything after the sampled ids, in the same layout
        self._packed = torch.zeros(6 * n + n * widest, dtype=torch.int32, device=device)
        self._hosts = [torch.zeros(5 * n + n * widest, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._copied = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._turn = 0
        self.sampled = self._packed[0:n]                               # the last decode's ids
        self._input_rows = self._packed[2 * n:3 * n]                   # of _packed: sampled ids, then host ids
        self._host_id_rows = np.arange(n, 2 * n, dtype=np.int32)       # where row i's host id lies in _packed
        # the static inputs a decode graph reads
        self.input_ids = torch.zeros(n, 1, dtype=torch.int32, device=device)
        self.positions = self._packed[3 * n:4 * n].view(n, 1)
        self.slots = self._packed[4 * n:5 * n]
        self.seq_lens = self._packed[5 * n:6 * n]
        self.block_tables = torch.zeros(n, widest, dtype=torch.int32, device=device)
        self.slots.fill_(-1)
        self.seq_lens.fill_(1)
        self._readback = [(torch.zeros(n, dtype=torch.int32, pin_memory=pin),
                           (torch.zeros(n, dtype=torch.float32, pin_memory=pin),
                            torch.zeros(n * MAX_TOP_LOGPROBS, dtype=torch.int32, pin_memory=pin),
                            torch.zeros(n * MAX_TOP_LOGPROBS, dtype=torch.float32, pin_memory=pin)),
                           torch.cuda.Event() if pin else None) for _ in range(3)]
        self._steps = 0
        self._inflight: _Readback | None = None

    @property
    def busy(self) -> bool:
        return self._inflight is not None

    def sources(self, seqs) -> list[int]:
        """Each sequence's row in the step in flight if its input token is still on the device, else -1."""
        inflight = self._inflight
        rows = {id(seq): row for row, seq in enumerate(inflight.seqs)} if inflight else {}
        return [rows[id(seq)] if seq.pending else -1 for seq in seqs]

    def load(self, seqs, sources, rows: int) -> None:
        """Fill the static inputs' first ``rows`` rows for ``seqs`` (the rest are padding: slot -1,
        length 1) but the input ids, which ``select_inputs`` takes: row i's is ``sampled[sources[i]]``
        where ``sources[i] >= 0``, else the id the host knows."""
        n, bs = self.max_batch, self.block_size
        width = max(len(s.block_table) for s in seqs)
        self._turn ^= 1
        host = self._hosts[self._turn]
        if self._copied is not None:
            self._copied[self._turn].synchronize()          # returns at once if never recorded
        h = host.numpy()
        ids, pick, pos = h[0:rows], h[n:n + rows], h[2 * n:2 * n + rows]
        slots, lens = h[3 * n:3 * n + rows], h[4 * n:4 * n + rows]
        table = h[5 * n:5 * n + rows * width].reshape(rows, width)
        b = len(seqs)
        ids[b:], pos[b:], slots[b:], lens[b:], table[b:] = 0, 0, -1, 1, 0          # padding rows
        # whole columns from Python lists, the ragged block tables as one flat padded sequence
        pos[:b] = [s.total_len - 1 for s in seqs]
        lens[:b] = pos[:b] + 1
        pick[:] = self._host_id_rows[:rows]
        src = np.asarray(sources, dtype=np.int32)
        pick[:b] = np.where(src >= 0, src, pick[:b])
        ids[:b] = [(s.output_ids[-1] if s.output_ids else s.prompt_ids[-1]) if k < 0 else 0
                   for s, k in zip(seqs, sources)]
        pad = [0] * width
        padded = itertools.chain.from_iterable(s.block_table + pad[len(s.block_table):] for s in seqs)
        table[:b] = np.fromiter(padded, dtype=np.int32, count=b * width).reshape(b, width)
        slots[:b] = table[np.arange(b), pos[:b] // bs] * bs + pos[:b] % bs
        count = 5 * n + rows * width
        self._packed[n:n + count].copy_(host[:count], non_blocking=True)
        if self._copied is not None:
            self._copied[self._turn].record()
        at = 6 * n
        self.block_tables[:rows, :width].copy_(self._packed[at:at + rows * width].view(rows, width))

    def select_inputs(self, rows: int) -> None:
        """The input ids of the first ``rows`` rows, from the sampled ids or the host's (one
        gather on the device, so a graph replays it)."""
        torch.index_select(self._packed, 0, self._input_rows[:rows], out=self.input_ids[:rows, 0])

    def launch(self, seqs, ids: torch.Tensor | None, logprobs) -> Sampled | None:
        """A decode step's sampled ids (None: the step already wrote them into ``sampled``): kept
        on the device for the next step's inputs and sent to the host; returns the previous
        step's, read back (None if there was none)."""
        if ids is not None:
            self.sampled[:ids.shape[0]].copy_(ids)
        for seq in seqs:
            seq.pending += 1
        self._steps += 1
        previous = self._inflight
        self._inflight = _Readback.launch(seqs, self.sampled[:len(seqs)], logprobs, *self._readback[self._steps % 2])
        return previous.read() if previous is not None else None

    def read_now(self, seqs, ids: torch.Tensor, logprobs) -> Sampled:
        """A prefill's sampled ids, read back at once (the decode step in flight is left alone)."""
        for seq in seqs:
            seq.pending += 1
        return _Readback.launch(seqs, ids.to(torch.int32), logprobs, *self._readback[2]).read()

    def drain(self) -> Sampled | None:
        """The step in flight, read back; None when there is none."""
        inflight, self._inflight = self._inflight, None
        return inflight.read() if inflight is not None else None

    def drop(self) -> None:
        """Forget the step in flight (after a failed step, whose requests are failed anyway)."""
        if self._inflight is not None:
            for seq in self._inflight.seqs:
                seq.pending -= 1
        self._inflight = None
