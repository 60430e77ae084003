"""Iteration-level scheduling: which sequences run in the next model step.

A step is either a prefill (prompt chunks of waiting sequences, under a token budget) or a
decode (one token for every running sequence). By default an arrival is prefilled at the next
step and decodes from the one after. With ``prefill_delay_steps`` > 0, arrivals while streams
decode are gathered for up to that many decode steps (or until they fill the token budget or
the free batch rows) and prefilled together: a prefill's cost is mostly per step, not per
prompt, so under many concurrent streams one prefill of eight prompts stalls them about as long
as one of one prompt (TGI's waiting_served_ratio / max_waiting_tokens). While streams decode, a
prefill step follows another at once only when what waits is short (``chained_prefill_tokens``
tokens to compute at most, after cached prefixes; without a gathering delay) and never three in
a row: the prompts that arrived during a short prefill after a cached prefix skip a decode step.
A long prompt's chunks alternate with decode steps, but for a short last chunk, which may follow
the chunk before it at once (the streams then wait for two prefill steps, never more). When
the pool cannot hold the next decode token, the newest running sequence is preempted: its
blocks are freed and it goes back to the front of the queue (behind a prompt being prefilled in
chunks, which holds its blocks meanwhile) to be recomputed later (with prefix caching, from the
blocks of it still cached). A sequence's first prefill chunk starts after the longest chain of
cached blocks matching its tokens (``BlockManager.match``).
"""

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence, Status

# A prompt whose log-probabilities are asked for is prefilled in chunks of at most this many
# tokens, each chunk's logits over the whole vocabulary held at once.
PROMPT_LOGPROBS_CHUNK = 512


@dataclass
class PrefillStep:
    chunks: list[tuple[Sequence, int]]          # (sequence, tokens of it to run now)


@dataclass
class DecodeStep:
    seqs: list[Sequence]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch: int, max_prefill_tokens: int, max_model_len: int,
                 prefill_delay_steps: int = 0, chained_prefill_tokens: int = 0):
        self.blocks = blocks
        self.prefill_delay_steps = prefill_delay_steps
        self.chained_prefill_tokens = chained_prefill_tokens
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._prefills_in_a_row = 0
        self._decodes_since_prefill = 0
        self.preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def prefill_turn(self) -> bool:
        """Whether the next step tries a prefill (so everything in flight must be known)."""
        if not self.waiting or len(self.running) >= self.max_batch:
            return False
        if not self.running:
            return True
        if self._prefills_in_a_row:
            return (self._prefills_in_a_row == 1 and self.prefill_delay_steps == 0
                    and self._tokens_to_compute(self.chained_prefill_tokens) <= self.chained_prefill_tokens)
        return (self._decodes_since_prefill >= self.prefill_delay_steps
                or len(self.waiting) >= self.max_batch - len(self.running)
                or sum(s.prefill_remaining for s in self.waiting) >= self.max_prefill_tokens)

    def _tokens_to_compute(self, limit: int) -> int:
        """The waiting sequences' tokens still to run through the model, after what the cache
        holds of their starts; counting stops past ``limit``."""
        total = 0
        for seq in self.waiting:
            total += seq.prefill_remaining if seq.block_table else seq.length - self.blocks.cached_prefix(seq)
            if total > limit:
                break
        return total

    def schedule(self) -> PrefillStep | DecodeStep | None:
        if self.prefill_turn():
            step = self._schedule_prefill()
            if step is not None:
                self._prefills_in_a_row += 1
                self._decodes_since_prefill = 0
                return step
        self._prefills_in_a_row = 0
        if not self.running:
            return None
        self._decodes_since_prefill += 1
        return self._schedule_decode()

    def needs_sync(self) -> bool:
        """Whether the next decode needs every earlier token on the host (repetition penalty)."""
        return any(s.params.repetition_penalty != 1.0 for s in self.running)

    def _schedule_prefill(self) -> PrefillStep | None:
        budget = self.max_prefill_tokens
        chunks: list[tuple[Sequence, int]] = []
        for seq in self.waiting:
            if budget == 0 or len(self.running) + len(chunks) >= self.max_batch:
                break
            fresh = not seq.block_table            # nothing computed yet, or preempted since
            scoring = seq.prompt_logprobs is not None   # every prompt position must run through the model
            if fresh and not scoring:
                seq.num_cached = self.blocks.match(seq)
            take = min(seq.prefill_remaining, budget, PROMPT_LOGPROBS_CHUNK if scoring else budget)
            if not self.blocks.can_grow(seq.block_table, seq.num_cached + take):
                if fresh and not scoring:
                    self.blocks.unmatch(seq)
                break
            if seq.cached_tokens is None:
                seq.cached_tokens = seq.num_cached
            self.blocks.grow(seq.block_table, seq.num_cached + take)
            chunks.append((seq, take))
            budget -= take
            if take < seq.prefill_remaining:
                break                            # the rest of this prompt goes in a later step
        return PrefillStep(chunks) if chunks else None

    def _schedule_decode(self) -> DecodeStep:
        scheduled: list[Sequence] = []
        block_size = self.blocks.block_size
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.runs_out(self.max_model_len):
                continue
            if seq.total_len <= len(seq.block_table) * block_size:
                scheduled.append(seq)              # its blocks hold the next token already
                continue
            while not self.blocks.can_grow(seq.block_table, seq.total_len):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq.block_table, seq.total_len)
                scheduled.append(seq)
        return DecodeStep(scheduled) if scheduled else None

    def add_next(self, seqs: list[Sequence]) -> None:
        """``seqs`` first in line, but behind a prompt whose prefill is under way (see ``preempt``)."""
        ahead = next((i for i, s in enumerate(self.waiting) if not s.block_table), len(self.waiting))
        for seq in reversed(seqs):
            self.waiting.insert(ahead, seq)

    def prefill_done(self, seq: Sequence) -> None:
        """``seq``'s whole prompt is in the cache: it decodes from the next step on."""
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        self.running.append(seq)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)                    # what it computed stays cached, found again on resume
        seq.num_cached = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        # First in line, but behind a prompt whose prefill is under way: that one holds blocks,
        # and with nothing left running, a sequence ahead of it that needs them could wait forever.
        ahead = next((i for i, s in enumerate(self.waiting) if not s.block_table), len(self.waiting))
        self.waiting.insert(ahead, seq)

    def remove(self, seq: Sequence, keep_cache: bool = True) -> None:
        """Drop a finished or aborted sequence and return its blocks to the pool (what it
        computed stays cached unless ``keep_cache`` is False: after a failed step)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq, keep_cache)
