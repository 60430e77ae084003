"""The engine: a background thread that steps the model and streams events to requests.

The HTTP layer reaches it only through ``add_request`` / ``abort`` and the per-request
``RequestStream``; model work never runs on the event loop.
"""

import asyncio
import itertools
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass

import torch

from models import LoadedModel

from .block_manager import BlockManager
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, step_all
from .errors import EngineDeadError, QueueFullError
from .model_runner import ModelRunner
from .params import FinishEvent, SamplingParams, TokenEvent
from .sampler import SamplingRows, sample
from .scheduler import DecodeStep, PrefillStep, Scheduler
from .sequence import Sequence, Status

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    preemptions: int


class RequestStream:
    """Async iterator over one request's events; the last event is a ``FinishEvent``."""

    def __init__(self, engine: "Engine", request_id: str, prompt_tokens: int):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def _put(self, event) -> None:            # event-loop thread
        self._queue.put_nowait(event)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        event = await self._queue.get()
        if isinstance(event, FinishEvent):
            self.finished = True
        return event

    def abort(self) -> None:
        if not self.finished:
            self._engine.abort(self.request_id)


class Inflight:
    """A step's sampled tokens on their way to the host (one copy per step, into pinned memory)."""

    def __init__(self, seqs, host: torch.Tensor, count: int, with_logprobs: bool, done):
        self.seqs, self._host, self._count, self._with_logprobs, self._done = seqs, host, count, with_logprobs, done

    @classmethod
    def launch(cls, seqs, ids: torch.Tensor, logprobs: torch.Tensor | None, host: torch.Tensor) -> "Inflight":
        packed = ids.double() if logprobs is None else torch.cat([ids.double(), logprobs.double()])
        host[:packed.shape[0]].copy_(packed, non_blocking=True)
        done = None
        if ids.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return cls(seqs, host, ids.shape[0], logprobs is not None, done)

    def read(self) -> tuple[list[int], list[float] | None]:
        if self._done is not None:
            self._done.synchronize()
        n = self._count
        values = self._host[:2 * n if self._with_logprobs else n].tolist()
        return [int(v) for v in values[:n]], (values[n:] if self._with_logprobs else None)


class Engine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.max_model_len = min(loaded.max_model_len, self.config.max_model_len or loaded.max_model_len)
        self.eos_ids = loaded.eos_token_ids
        self.special_ids = set(getattr(self.tokenizer, "all_special_ids", []))
        started = time.monotonic()
        self.runner = ModelRunner(loaded, self.config, self.max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, self.config.block_size)
        self.scheduler = Scheduler(self.blocks, self.config.max_batch, self.config.max_prefill_tokens,
                                   self.max_model_len)
        pinned = loaded.device.type == "cuda"
        self._readback = [torch.zeros(2 * self.config.max_batch, dtype=torch.float64, pin_memory=pinned)
                          for _ in range(3)]
        self._inflight: Inflight | None = None
        log.info("KV pool: %d blocks of %d tokens (%d tokens); graph buckets %s, captured in %.1f s; "
                 "engine ready in %.1f s", self.blocks.num_blocks, self.config.block_size, self.runner.kv_tokens,
                 sorted(self.runner.graphs) or "none", self.runner.capture_seconds, time.monotonic() - started)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._queued_lock = threading.Lock()
        self._queued_requests = 0
        self._queued_tokens = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: str | None = None
        self.ready = False
        self.steps = 0

    # ---- public API (event-loop thread) ------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        self.ready = True

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.ready = False

    def validate(self, prompt_tokens: int, params: SamplingParams) -> None:
        if prompt_tokens < 1:
            raise ValueError("the prompt is empty")
        if params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        total = prompt_tokens + params.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({prompt_tokens} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                             f"is {total}, over the context length of {self.max_model_len}")
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            raise ValueError(f"{total} tokens do not fit in the KV pool ({self.runner.kv_tokens} tokens)")

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> RequestStream:
        if self.error is not None:
            raise EngineDeadError(self.error)
        self.validate(len(prompt_ids), params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        tokens = len(prompt_ids) + params.max_new_tokens
        with self._queued_lock:
            if self._queued_requests >= self.config.max_waiting_requests:
                raise QueueFullError(f"{self._queued_requests} requests are waiting (limit "
                                     f"{self.config.max_waiting_requests})", retry_after=1.0)
            if self._queued_tokens + tokens > self.config.max_waiting_tokens:
                raise QueueFullError(f"{self._queued_tokens} tokens are waiting (limit "
                                     f"{self.config.max_waiting_tokens})", retry_after=1.0)
            self._queued_requests += 1
            self._queued_tokens += tokens
        stream = RequestStream(self, request_id, len(prompt_ids))
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        seq = Sequence(request_id, prompt_ids, params, seed, detok, stream)
        self._streams[request_id] = stream
        self._inbox.put(("add", seq))
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    def stats(self) -> EngineStats:
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting),
                           self.blocks.num_blocks, self.blocks.num_used, self.scheduler.preemptions)

    # ---- engine thread ---------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.scheduler.has_work():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                self._deliver(self.step())
        except Exception as exc:                  # the loop cannot go on: fail every request
            log.exception("engine step failed")
            self.error = f"{type(exc).__name__}: {exc}"
            self._fail_all(self.error)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.scheduler.add(item)
            else:
                self._abort_now(item)

    def _abort_now(self, request_id: str) -> None:
        for seq in itertools.chain(self.scheduler.running, self.scheduler.waiting):
            if seq.request_id == request_id:
                self._deliver([(seq, self._finish(seq, "abort"))])
                return

    def _unqueue(self, seq: Sequence) -> None:
        if seq.first_scheduled is None:
            seq.first_scheduled = time.monotonic()
            with self._queued_lock:
                self._queued_requests -= 1
                self._queued_tokens -= seq.reserved_tokens()

    def step(self) -> list[tuple[Sequence, object]]:
        """One model step; returns the (sequence, event) pairs that became known.

        A decode step is launched before the previous decode's tokens are read back, so the
        host's bookkeeping (detokenizing, stop strings, events) overlaps the GPU's next step;
        the next step reads its input tokens from the device. Prefills, and batches that need
        every earlier token on the host, first wait for the step in flight."""
        events = []
        if self.scheduler.needs_sync() or self.scheduler.prefill_turn():
            events += self._complete_inflight()
        work = self.scheduler.schedule()
        if work is None:
            return events + self._complete_inflight()
        self.steps += 1
        if isinstance(work, PrefillStep):
            return events + self._prefill(work)
        inflight = self._inflight
        rows_before = {id(seq): row for row, seq in enumerate(inflight.seqs)} if inflight else {}
        sources = [rows_before[id(seq)] if seq.pending else -1 for seq in work.seqs]
        logits = self.runner.decode(work.seqs, sources)
        ids, logprobs = sample(logits, self._sampling_rows(work.seqs))
        self.runner.keep_sampled(ids)
        for seq in work.seqs:
            seq.num_cached = seq.total_len
            seq.pending += 1
        self._inflight = Inflight.launch(work.seqs, ids, logprobs, self._readback[self.steps % 2])
        if inflight is not None:
            events += self._emit(inflight.seqs, *inflight.read())
        return events

    def _complete_inflight(self) -> list:
        inflight, self._inflight = self._inflight, None
        return self._emit(inflight.seqs, *inflight.read()) if inflight else []

    def _prefill(self, work: PrefillStep) -> list:
        for seq, _ in work.chunks:
            self._unqueue(seq)
        logits = self.runner.prefill(work.chunks)
        ready = []
        for row, (seq, take) in enumerate(work.chunks):
            seq.num_cached += take
            if seq.prefill_remaining == 0:
                self.scheduler.prefill_done(seq)
                ready.append((row, seq))
        if not ready:
            return []
        seqs = [s for _, s in ready]
        if len(ready) < len(work.chunks):
            logits = logits[torch.tensor([r for r, _ in ready], device=logits.device)]
        ids, logprobs = sample(logits, self._sampling_rows(seqs))
        for seq in seqs:
            seq.pending += 1
        return self._emit(seqs, *Inflight.launch(seqs, ids, logprobs, self._readback[2]).read())

    def _sampling_rows(self, seqs) -> SamplingRows:
        return SamplingRows(
            temperature=[s.params.temperature for s in seqs],
            top_k=[s.params.top_k for s in seqs],
            top_p=[s.params.top_p for s in seqs],
            repetition_penalty=[s.params.repetition_penalty for s in seqs],
            seeds=[s.seed for s in seqs],
            positions=[len(s.output_ids) + s.pending for s in seqs],
            history=[s.token_ids if s.params.repetition_penalty != 1.0 else [] for s in seqs],
            want_logprobs=any(s.params.logprobs for s in seqs),
        )

    def _emit(self, seqs, token_ids, token_logprobs) -> list[tuple[Sequence, object]]:
        """Apply read-back tokens; sequences that ended meanwhile (an abort, or a stop found in
        the step before) drop theirs."""
        for seq in seqs:
            seq.pending -= 1
        live = [i for i, seq in enumerate(seqs) if not seq.is_finished]
        now = time.monotonic()
        deltas = self._detokenize([seqs[i] for i in live], [token_ids[i] for i in live])
        events = []
        for i, delta in zip(live, deltas):
            seq = seqs[i]
            logprob = token_logprobs[i] if token_logprobs is not None and seq.params.logprobs else None
            events.extend(self._append_token(seq, token_ids[i], logprob, delta, now))
        return events

    def _detokenize(self, seqs, token_ids) -> list[str]:
        live = [i for i, (s, t) in enumerate(zip(seqs, token_ids)) if not self._is_eos(s, t)]
        texts = step_all([seqs[i].detokenizer for i in live], [token_ids[i] for i in live], self.tokenizer)
        deltas = [""] * len(seqs)
        for i, text in zip(live, texts):
            deltas[i] = text
        return deltas

    def _is_eos(self, seq: Sequence, token: int) -> bool:
        return token in self.eos_ids and not seq.params.ignore_eos

    def _append_token(self, seq: Sequence, token: int, logprob, delta: str, now: float):
        seq.output_ids.append(token)
        if seq.first_token is None:
            seq.first_token = now
        is_eos = self._is_eos(seq, token)
        special = token in self.special_ids
        seq.text += delta
        release, stopped = seq.stop_matcher.scan(seq.text, seq.emitted, len(delta))
        reason = None
        if is_eos:
            reason = "eos"
        elif stopped:
            reason = "stop"
            seq.text = seq.text[:release]
        elif len(seq.output_ids) >= seq.params.max_new_tokens or seq.length >= self.max_model_len:
            reason = "length"
        if reason is not None:
            release = len(seq.text)                # nothing is held back once the text is final
        out = seq.text[seq.emitted:release]
        seq.emitted = release
        events = [(seq, TokenEvent(token, out, logprob, special, now))]
        if reason is not None:
            events.append((seq, self._finish(seq, reason)))
        return events

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> FinishEvent:
        self._unqueue(seq)
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        now = time.monotonic()
        timings = {"queue": (seq.first_scheduled or now) - seq.arrival,
                   "ttft": (seq.first_token - seq.arrival) if seq.first_token else None,
                   "total": now - seq.arrival}
        return FinishEvent(reason, seq.text, len(seq.prompt_ids), len(seq.output_ids), error, timings)

    def _deliver(self, events) -> None:
        if not events:
            return
        pairs = [(seq.sink, ev) for seq, ev in events]
        for seq, ev in events:
            if isinstance(ev, FinishEvent):
                self._streams.pop(seq.request_id, None)
        loop = pairs[0][0]._loop
        try:
            loop.call_soon_threadsafe(_fan_out, pairs)
        except RuntimeError:                      # the event loop is closed: nobody listens
            pass

    def _fail_all(self, message: str) -> None:
        seqs = list(itertools.chain(self.scheduler.running, self.scheduler.waiting))
        events = []
        for seq in seqs:
            try:
                events.append((seq, self._finish(seq, "error", message)))
            except Exception:
                log.exception("could not release %s", seq.request_id)
        self._deliver(events)


def _fan_out(pairs) -> None:
    for stream, event in pairs:
        stream._put(event)
