"""The decode step's host/device protocol: metadata in, sampled ids out, one step in flight.

A decode step is launched before the previous step's sampled ids are read back, so the host's
bookkeeping overlaps the device's next step. That needs, all owned here:

- two pinned host buffers of decode metadata taking turns (one is rewritten while the other's
  copy may still be pending), each with the event of its copy;
- the sampled ids of the step in flight, kept on the device, and each row's source: the row of
  the previous step whose sampled id is this row's input, or -1 when the host knows the input;
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
    """A step's sampled ids, read back: one per sequence, with log-probabilities if asked for."""
    seqs: list
    ids: list[int]
    logprobs: list[float] | None
    waited_s: float                               # host time spent waiting for the copy


class DecodeInputs(NamedTuple):
    """The static device tensors a decode graph reads (rows x ...)."""
    input_ids: torch.Tensor                       # [n, 1]
    positions: torch.Tensor                       # [n, 1]
    slots: torch.Tensor                           # [n]
    seq_lens: torch.Tensor                        # [n]
    block_tables: torch.Tensor                    # [n, max_blocks_per_seq]


class _Readback:
    """One step's sampled ids on their way to a pinned host buffer (one copy per step)."""

    def __init__(self, seqs, host: torch.Tensor, count: int, with_logprobs: bool, done):
        self.seqs, self._host, self._count, self._with_logprobs, self._done = seqs, host, count, with_logprobs, done

    @classmethod
    def launch(cls, seqs, ids: torch.Tensor, logprobs: torch.Tensor | None, host: torch.Tensor,
               done: torch.cuda.Event | None) -> "_Readback":
        packed = ids.double() if logprobs is None else torch.cat([ids.double(), logprobs.double()])
        host[:packed.shape[0]].copy_(packed, non_blocking=True)
        if done is not None:
            done.record()
        return cls(seqs, host, ids.shape[0], logprobs is not None, done)

    def read(self) -> Sampled:
        waited = 0.0
        if self._done is not None:
            started = time.monotonic()
            self._done.synchronize()
            waited = time.monotonic() - started
        n = self._count
        values = self._host[:2 * n if self._with_logprobs else n].tolist()
        for seq in self.seqs:
            seq.pending -= 1
        return Sampled(self.seqs, [int(v) for v in values[:n]], values[n:] if self._with_logprobs else None, waited)


class StepPipeline:
    def __init__(self, inputs: DecodeInputs, block_size: int, device: torch.device):
        self.inputs = inputs
        self.block_size = block_size
        n, widest = inputs.block_tables.shape
        self.max_batch = n
        pin = device.type == "cuda"
        # ids | source rows | positions | slots | lengths | block table (rows x widest table)
        self._hosts = [torch.zeros(5 * n + n * widest, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._copied = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._turn = 0
        self._packed = torch.zeros_like(self._hosts[0], device=device)
        self.sampled = torch.zeros(n, dtype=torch.int32, device=device)     # the last decode's ids
        self._readback = [(torch.zeros(2 * n, dtype=torch.float64, pin_memory=pin),
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
        """Fill the static inputs' first ``rows`` rows for ``seqs``; the rest are padding (slot -1,
        length 1). Row i's input id is ``sampled[sources[i]]`` where ``sources[i] >= 0``."""
        n, bs = self.max_batch, self.block_size
        width = max(len(s.block_table) for s in seqs)
        self._turn ^= 1
        host = self._hosts[self._turn]
        if self._copied is not None:
            self._copied[self._turn].synchronize()          # returns at once if never recorded
        h = host.numpy()
        ids, src, pos = h[0:rows], h[n:n + rows], h[2 * n:2 * n + rows]
        slots, lens = h[3 * n:3 * n + rows], h[4 * n:4 * n + rows]
        table = h[5 * n:5 * n + rows * width].reshape(rows, width)
        b = len(seqs)
        ids[b:], src[b:], pos[b:], slots[b:], lens[b:], table[b:] = 0, -1, 0, -1, 1, 0   # padding rows
        # whole columns from Python lists, the ragged block tables as one flat padded sequence
        pos[:b] = [s.total_len - 1 for s in seqs]
        lens[:b] = pos[:b] + 1
        src[:b] = sources
        ids[:b] = [(s.output_ids[-1] if s.output_ids else s.prompt_ids[-1]) if k < 0 else 0
                   for s, k in zip(seqs, sources)]
        pad = [0] * width
        padded = itertools.chain.from_iterable(s.block_table + pad[len(s.block_table):] for s in seqs)
        table[:b] = np.fromiter(padded, dtype=np.int32, count=b * width).reshape(b, width)
        slots[:b] = table[np.arange(b), pos[:b] // bs] * bs + pos[:b] % bs
        count = 5 * n + rows * width
        self._packed[:count].copy_(host[:count], non_blocking=True)
        if self._copied is not None:
            self._copied[self._turn].record()
        d, x = self._packed, self.inputs
        from_device = d[n:n + rows]
        x.input_ids[:rows, 0] = torch.where(from_device >= 0, self.sampled[from_device.clamp(min=0)], d[0:rows])
        x.positions[:rows, 0].copy_(d[2 * n:2 * n + rows])
        x.slots[:rows].copy_(d[3 * n:3 * n + rows])
        x.seq_lens[:rows].copy_(d[4 * n:4 * n + rows])
        x.block_tables[:rows, :width].copy_(d[5 * n:5 * n + rows * width].view(rows, width))

    def launch(self, seqs, ids: torch.Tensor, logprobs: torch.Tensor | None) -> Sampled | None:
        """A decode step's sampled ids: kept on the device for the next step's inputs and sent to
        the host; returns the previous step's, read back (None if there was none)."""
        self.sampled[:ids.shape[0]].copy_(ids)
        for seq in seqs:
            seq.pending += 1
        self._steps += 1
        previous = self._inflight
        self._inflight = _Readback.launch(seqs, ids, logprobs, *self._readback[self._steps % 2])
        return previous.read() if previous is not None else None

    def read_now(self, seqs, ids: torch.Tensor, logprobs: torch.Tensor | None) -> Sampled:
        """A prefill's sampled ids, read back at once (the decode step in flight is left alone)."""
        for seq in seqs:
            seq.pending += 1
        return _Readback.launch(seqs, ids, logprobs, *self._readback[2]).read()

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
