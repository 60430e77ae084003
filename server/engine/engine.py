"""What the HTTP layer talks to: ``add_request`` / ``abort`` and a per-request event stream.

``Engine`` runs the core in a thread of this process; ``ProcessEngine`` (process.py) runs it in
a process of its own, so the core's per-token Python never competes with the HTTP layer for the
interpreter lock. Both share this front end: request ids, queue bounds, length checks, the text
of each step's tokens (``output.py``), and the fan-out of its events to the asyncio streams
waiting for them.
"""

import asyncio
import itertools
import logging
import queue
import random
import threading

from models import LoadedModel

from .config import EngineConfig
from .core import EngineCore, EngineStats, ModelInfo
from .errors import EngineDeadError, QueueFullError
from .output import OutputProcessor
from .params import FinishEvent, SamplingParams
from .pipeline import MAX_TOP_LOGPROBS

log = logging.getLogger(__name__)


def queued_tokens(prompt_len: int, params: SamplingParams) -> int:
    """What a request counts against ``max_waiting_tokens`` while it waits: prompt and max new tokens."""
    return prompt_len + params.max_new_tokens


class RequestStream:
    """Async iterator over one request's events; the last event is a ``FinishEvent``."""

    def __init__(self, frontend: "EngineFrontend", request_id: str, prompt_tokens: int, reserved_tokens: int):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.reserved_tokens = reserved_tokens
        self.started = False                      # an event has arrived: no longer queued
        self.finished = False
        self._frontend = frontend
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        event = await self._queue.get()
        if isinstance(event, FinishEvent):
            self.finished = True
        return event

    def has_ready_events(self) -> bool:
        return not self._queue.empty()

    def error_finish(self, message: str) -> FinishEvent:
        return FinishEvent("error", "", self.prompt_tokens, 0, message)

    def abort(self) -> None:
        if not self.finished:
            self._frontend.abort(self.request_id)


class EngineFrontend:
    def __init__(self, config: EngineConfig, tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.output = OutputProcessor(tokenizer)
        self.info: ModelInfo | None = None
        self.error: str | None = None
        self.ready = False
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self.id_prefix = ""                       # routes events back to this front end when it shares a core
        self._queued_requests = 0                 # admitted, no event yet (event-loop thread only)
        self._queued_tokens = 0
        self._stats = EngineStats(0, 0, 0, 0, 0)

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def stats(self) -> EngineStats:
        return self._stats

    def _send(self, message) -> None:
        raise NotImplementedError

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        prompt_tokens = len(prompt_ids)
        if prompt_tokens < 1:
            raise ValueError("the prompt is empty")
        if params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        total = prompt_tokens + params.max_new_tokens
        if total > self.info.max_model_len:
            raise ValueError(f"prompt ({prompt_tokens} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                             f"is {total}, over the context length of {self.info.max_model_len}")
        if total > self.info.kv_tokens:
            raise ValueError(f"{total} tokens do not fit in the KV pool ({self.info.kv_tokens} tokens)")
        for name in ("top_logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} {value} is outside 0..{MAX_TOP_LOGPROBS}")
        bad = next((i for i, _ in params.logit_bias if not 0 <= i < self.info.vocab_size), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary (0..{self.info.vocab_size - 1})")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.info.vocab_size:
            bad = next(i for i in prompt_ids if not 0 <= i < self.info.vocab_size)
            raise ValueError(f"token id {bad} is outside the model's vocabulary of {self.info.vocab_size} "
                             f"(0..{self.info.vocab_size - 1})")

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, follows: str | None = None) -> RequestStream:
        """Call from the event loop. Raises ValueError, QueueFullError or EngineDeadError.
        ``follows``: the engine id (``RequestStream.request_id``) of another choice of the same
        prompt added just before: the core computes the prompt once for both (``EngineCore.add``)."""
        if self.error is not None:
            raise EngineDeadError(self.error)
        if not self.ready:
            raise EngineDeadError("the engine is not ready")
        self.validate(prompt_ids, params)
        request_id = self.id_prefix + (request_id or f"req-{next(self._ids)}")
        if request_id in self._streams or request_id in self.output:
            raise ValueError(f"request id {request_id!r} is already in flight")
        tokens = queued_tokens(len(prompt_ids), params)
        if self._queued_requests >= self.config.max_waiting_requests:
            raise QueueFullError(f"{self._queued_requests} requests are waiting (limit "
                                 f"{self.config.max_waiting_requests})", retry_after=1.0)
        if self._queued_tokens + tokens > self.config.max_waiting_tokens:
            raise QueueFullError(f"{self._queued_tokens} tokens are waiting (limit "
                                 f"{self.config.max_waiting_tokens})", retry_after=1.0)
        self._queued_requests += 1
        self._queued_tokens += tokens
        stream = RequestStream(self, request_id, len(prompt_ids), tokens)
        self._streams[request_id] = stream
        self.output.add(request_id, prompt_ids, params)
        if self.error is not None:                # the core died meanwhile; its open streams may have been failed before this one
            self._streams.pop(request_id, None)
            self.output.discard(request_id)
            self._started(stream)                  # a failure fanned out to it later leaves the counts alone
            raise EngineDeadError(self.error)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self._send(("add", (request_id, list(prompt_ids), params, seed, follows)))
        return stream

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def _publish(self, pairs, stats: EngineStats) -> None:
        """From the core's thread (or the reader of its process): text for the events, then hand
        them to the loops."""
        try:
            pairs, stopped = self.output.process(pairs)
        except Exception as exc:                  # a bug or a tokenizer error: fail those requests, keep serving
            log.exception("making the text of a step's tokens failed")
            pairs, stopped = self._fail_text(pairs, f"{type(exc).__name__}: {exc}")
        for request_id in stopped:
            self.abort(request_id)
        by_loop: dict = {}
        for request_id, event in pairs:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream._loop, []).append((stream, event))
        self._stats = stats
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._fan_out, batch)
            except RuntimeError:                  # that event loop is closed: nobody listens
                pass

    def _fail_text(self, pairs, message: str) -> tuple[list, list[str]]:
        """Error finishes for the requests of ``pairs`` and their ids, for the core to abort."""
        ids = list(dict.fromkeys(request_id for request_id, _ in pairs))
        failed = []
        for request_id in ids:
            self.output.discard(request_id)
            stream = self._streams.get(request_id)
            if stream is not None:
                failed.append((request_id, stream.error_finish(message)))
        return failed, ids

    def _started(self, stream: RequestStream) -> None:
        """The stream's first event: it no longer counts against the queue bounds."""
        if not stream.started:
            stream.started = True
            self._queued_requests -= 1
            self._queued_tokens -= stream.reserved_tokens

    def _fan_out(self, batch) -> None:
        for stream, event in batch:
            self._started(stream)
            if isinstance(event, FinishEvent):
                self._streams.pop(stream.request_id, None)
            stream._queue.put_nowait(event)

    def _fail_streams(self, message: str) -> None:
        """The core is gone: end every open stream with an error."""
        pairs = [(rid, s.error_finish(message)) for rid, s in list(self._streams.items())]
        self._publish(pairs, self._stats)


class Engine(EngineFrontend):
    """The core in a background thread of this process."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None):
        super().__init__(config or EngineConfig(), loaded.tokenizer)
        self.core = EngineCore(loaded, self.config, self._publish)
        self.info = self.core.info
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        self.ready = True

    def _run(self) -> None:
        try:
            self.core.run(self._inbox)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            self.ready = False
            self._fail_streams(self.error)

    def shutdown(self) -> None:
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.ready = False

    def stats(self) -> EngineStats:
        return self.core.stats()

    def _send(self, message) -> None:
        self._inbox.put(message)
