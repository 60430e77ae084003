"""API-independent glue between a route and the engine: tokenizing (long texts off the event
loop), length checks, admission, and one ``Generation`` per admitted request that records
metrics, writes the request's log line and aborts the engine request if it is left unfinished."""

import logging
import math
import time
import uuid
from dataclasses import dataclass, field

import anyio
from fastapi import Request
from starlette.concurrency import run_in_threadpool

from .encoding import prompt_encoder
from .engine.errors import QueueFullError
from .engine.params import FinishEvent, SamplingParams, TokenEvent
from .http_errors import ApiError
from .services import Services, shutting_down

log = logging.getLogger("server.generation")


class ClientGone(Exception):
    """The client disconnected before its non-streaming answer was ready."""


@dataclass
class Prompt:
    ids: list[int]
    text: str                      # what was tokenized (the rendered chat for chat requests)
    tokenize_s: float = 0.0
    tokenize_started: float = field(default_factory=time.time)   # epoch seconds
    reused_chars: int = 0          # characters whose ids a kept prompt served (server/encoding.py)


def _encoder(engine):
    return prompt_encoder(engine.tokenizer, engine.config.prefix_caching)


async def _encode(engine, text: str, add_special_tokens: bool, shared: bool) -> tuple[list[int], int]:
    """A short text (or what follows a kept start) on the event loop, a longer one off it."""
    encoder = _encoder(engine)
    work = encoder.prepare(text, add_special_tokens, shared)
    if work.small:
        return encoder.run(work)
    return await run_in_threadpool(encoder.run, work)


async def encode_ids(engine, text: str, add_special_tokens: bool) -> list[int]:
    """The ids of ``text`` (the tokenize route's), encoded as prompts are."""
    return (await _encode(engine, text, add_special_tokens, True))[0]


async def encode_text(engine, text: str, shared: bool = True) -> Prompt:
    """``shared``: see ``PromptEncoder.prepare`` (False for a request with a cache_salt)."""
    started, started_epoch = time.perf_counter(), time.time()
    ids, reused = await _encode(engine, text, True, shared)
    return Prompt(ids, text, time.perf_counter() - started, started_epoch, reused)


def _render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)


async def encode_chat(engine, messages: list[dict], shared: bool = True, tools: list[dict] | None = None) -> Prompt:
    """``tools``: for a chat template that renders them (server/tools.py)."""
    started, started_epoch = time.perf_counter(), time.time()
    try:
        text = await run_in_threadpool(_render_chat, engine.tokenizer, messages, tools)
    except Exception as exc:       # jinja raises on conversations its template refuses
        raise ApiError(400, f"messages do not fit the model's chat template: {exc}",
                       param="messages") from exc
    # The template already wrote any special tokens it wants.
    ids, reused = await _encode(engine, text, False, shared)
    return Prompt(ids, text, time.perf_counter() - started, started_epoch, reused)


async def decode_ids(tokenizer, ids: list[int]) -> str:
    return await run_in_threadpool(tokenizer.decode, ids)


def check_token_ids(ids, vocab_size: int, param: str = "prompt") -> None:
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
                       param=param)


def resolve_max_new_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                           default: int, param: str, max_prompt_tokens: int | None = None,
                           prompt_param: str = "inputs") -> int:
    """The number of tokens to generate, or 400 naming the numbers that do not fit."""
    if prompt_len < 1:
        raise ApiError(400, "the prompt is empty after tokenization", param=prompt_param)
    prompt_limit = min(max_prompt_tokens or max_model_len - 1, max_model_len - 1)
    if prompt_len > prompt_limit:
        raise ApiError(400, f"the prompt has {prompt_len} tokens, over the limit of {prompt_limit} "
                            f"(context length {max_model_len})", param=prompt_param, reason="too_long")
    room = max_model_len - prompt_len
    if requested is None:
        return min(default, room)
    if requested > room:
        raise ApiError(400, f"the prompt ({prompt_len} tokens) plus {param} ({requested}) is "
                            f"{prompt_len + requested} tokens, over the context length of "
                            f"{max_model_len} tokens", param=param, reason="too_long")
    return requested


SAMPLING_EPS = 1e-5     # temperatures below this sample as greedy (vLLM's rule): no overflow


def sampling_params(engine, *, max_new_tokens: int, temperature: float, top_p: float | None,
                    top_k: int | None, repetition_penalty: float | None, seed: int | None,
                    stop: tuple[str, ...], logprobs: bool, ignore_eos: bool, min_tokens: int = 0,
                    stop_token_ids: tuple[int, ...] = (), cache_salt: str | None = None,
                    include_stop_str_in_output: bool = False, top_logprobs: int = 0,
                    prompt_logprobs: int | None = None, presence_penalty: float = 0.0,
                    frequency_penalty: float = 0.0,
                    logit_bias: tuple[tuple[int, float], ...] = ()) -> SamplingParams:
    """SamplingParams with degenerate values made plain: a top_k at or past the vocabulary
    (or vLLM's -1) is no cut, a vanishing temperature is greedy."""
    top_k = top_k or 0
    if top_k >= len(engine.tokenizer) or top_k < 0:
        top_k = 0
    if min_tokens > max_new_tokens:
        raise ApiError(400, f"min_tokens ({min_tokens}) is more than the tokens to generate "
                            f"({max_new_tokens})", param="min_tokens")
    check_token_ids(stop_token_ids, len(engine.tokenizer), param="stop_token_ids")
    vocab = len(engine.tokenizer)
    bad = next((i for i, _ in logit_bias if i >= vocab), None)
    if bad is not None:
        raise ApiError(422, f"logit_bias names token id {bad}, outside the vocabulary (0..{vocab - 1})",
                       param="logit_bias")
    return SamplingParams(max_new_tokens=max_new_tokens,
                          temperature=0.0 if temperature < SAMPLING_EPS else temperature,
                          top_p=1.0 if top_p is None else top_p, top_k=top_k,
                          repetition_penalty=repetition_penalty or 1.0, seed=seed, stop=stop,
                          logprobs=logprobs, ignore_eos=ignore_eos, min_tokens=min_tokens,
                          stop_token_ids=frozenset(stop_token_ids), cache_salt=cache_salt,
                          include_stop_str_in_output=include_stop_str_in_output, top_logprobs=top_logprobs,
                          prompt_logprobs=prompt_logprobs, presence_penalty=presence_penalty or 0.0,
                          frequency_penalty=frequency_penalty or 0.0, logit_bias=logit_bias)


def finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class Generation:
    """One admitted request's events. Iterate it; call ``close()`` when done (idempotent)."""

    def __init__(self, services: Services, engine, stream, *, request_id: str, endpoint: str,
                 prompt: Prompt, params: SamplingParams, streaming: bool, request_start: float | None = None):
        self.services = services
        self.engine = engine
        self.stream = stream
        self.engine_request_id = stream.request_id
        self.request_id = request_id
        self.request_start = request_start           # the client's X-Request-Start, epoch seconds
        self.endpoint = endpoint
        self.prompt = prompt
        self.params = params
        self.streaming = streaming
        self.created = int(time.time())
        self.admitted = time.monotonic()
        self.first_token_s: float | None = None       # admission to the first token here
        self.first_token_delivery_s: float | None = None   # the engine's first token to its arrival here
        self.tokens: list[TokenEvent] = []
        self.finish: FinishEvent | None = None
        self.ended_by_server = False       # the server shut down before the request finished
        self._closed = False
        services.generations.add(self)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.ids)

    def __aiter__(self):
        return self

    def has_ready_events(self) -> bool:
        """Whether the next event is already here (iterating will not wait)."""
        return self.finish is None and self.stream.has_ready_events()

    async def __anext__(self) -> TokenEvent | FinishEvent:
        if self.finish is not None:
            raise StopAsyncIteration
        event = await self.stream.__anext__()
        metrics = self.services.metrics
        if isinstance(event, TokenEvent):
            if not self.tokens:
                now = time.monotonic()
                self.first_token_s = now - self.admitted
                self.first_token_delivery_s = now - event.time if event.time else None
            if self.tokens and event.time and self.tokens[-1].time:
                metrics.inter_token.observe(max(0.0, event.time - self.tokens[-1].time))
            self.tokens.append(event)
        else:
            self.finish = event
            self._record(event.reason, event.prompt_tokens, event.completion_tokens, event.timings,
                         event.error)
        return event

    async def collect(self, request: Request) -> FinishEvent:
        """Runs to the finish event; aborts and raises ClientGone if the client disconnects."""
        await drain_unless_gone(request, self, self.close)
        if self.finish is None:
            raise ClientGone()
        return self.finish

    def end_by_server(self) -> None:
        """Ends the request for a shutdown: the engine aborts it and its stream receives a finish
        event with reason "abort", which the routes turn into a proper last event."""
        if self.finish is None and not self._closed:
            self.ended_by_server = True
            self.engine.abort(self.engine_request_id)

    def close(self) -> None:
        """Aborts the engine request unless it finished (client gone, or an error of ours)."""
        if self._closed:
            return
        self._closed = True
        self.services.generations.discard(self)
        if self.finish is None:
            self.engine.abort(self.engine_request_id)
            self._record("abort", self.prompt_tokens, len(self.tokens), {}, "client disconnected",
                         client_gone=True)

    def _record(self, reason: str, prompt_tokens: int, completion_tokens: int, timings: dict,
                error: str | None, client_gone: bool = False) -> None:
        metrics = self.services.metrics
        metrics.finished.labels(reason=reason).inc()
        metrics.prompt_tokens.inc(prompt_tokens)
        metrics.prompt_chars.inc(len(self.prompt.text))
        metrics.prompt_chars_reused.inc(self.prompt.reused_chars)
        metrics.generation_tokens.inc(completion_tokens)
        if timings.get("queue") is not None:
            metrics.queue.observe(timings["queue"])
        if timings.get("ttft") is not None:
            metrics.ttft.observe(timings["ttft"])
        if timings.get("total") is not None and reason not in ("abort", "error"):
            metrics.e2e.observe(timings["total"])
        fields = {
            "request_id": self.request_id, "engine_request_id": self.engine_request_id,
            "endpoint": self.endpoint, "stream": self.streaming, "finish_reason": reason,
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "max_new_tokens": self.params.max_new_tokens, "greedy": self.params.greedy,
            "tokenize_s": round(self.prompt.tokenize_s, 6), "tokenize_reused_chars": self.prompt.reused_chars,
            # the client's send to the start of tokenizing: the HTTP path in (and the clocks' skew)
            **({"request_start": self.request_start,
                "request_to_tokenize_s": round(self.prompt.tokenize_started - self.request_start, 6)}
               if self.request_start is not None else {}),
            **{k: round(v, 6) for k, v in (("first_token_s", self.first_token_s),
                                           ("first_token_delivery_s", self.first_token_delivery_s)) if v is not None},
            **{f"{k}_s": round(v, 6) for k, v in timings.items() if v is not None},
        }
        if error:
            fields["error"] = error
        if self.services.settings.log_prompts:
            fields["prompt"] = self.prompt.text
            fields["generated_text"] = (self.finish.text if self.finish is not None
                                        else "".join(t.text for t in self.tokens))
        level = logging.ERROR if reason == "error" else logging.INFO
        if client_gone:
            message = "client disconnected; request aborted"
        elif self.ended_by_server:
            message = "the server ended the request (shutting down)"
        else:
            message = "request finished"
        log.log(level, message, extra={"fields": fields})


async def drain_unless_gone(request: Request, events, close) -> None:
    """Reads ``events`` to their end, unless the client disconnects first; ``close()`` after
    either (it aborts what has not finished)."""
    async def consume(scope: anyio.CancelScope):
        async for _ in events:
            pass
        scope.cancel()

    async def watch(scope: anyio.CancelScope):
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, tg.cancel_scope)
            tg.start_soon(watch, tg.cancel_scope)
    finally:
        close()


def submit(services: Services, engine, request: Request, prompt: Prompt, params: SamplingParams,
           *, endpoint: str, streaming: bool, follows: str | None = None) -> Generation:
    """Hands the request to the engine (on the event-loop thread, as the engine requires);
    ``follows``: see ``EngineFrontend.add_request``."""
    metrics = services.metrics
    if services.draining:
        raise shutting_down()
    try:
        extra = {"follows": follows} if follows is not None else {}
        stream = engine.add_request(prompt.ids, params, request_id=uuid.uuid4().hex, **extra)
    except QueueFullError:
        metrics.rejected.labels(reason="queue_full").inc()
        raise
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    return Generation(services, engine, stream, request_id=request.state.request_id,
                      endpoint=endpoint, prompt=prompt, params=params, streaming=streaming,
                      request_start=getattr(request.state, "request_start", None))


def plan_max_new_tokens(services: Services, engine, prompt: Prompt, requested: int | None,
                        default: int, param: str, prompt_param: str) -> int:
    """``param``, ``prompt_param``: the request's fields of the token limit and of the prompt."""
    return resolve_max_new_tokens(requested, len(prompt.ids), engine.max_model_len, default,
                                  param, services.settings.max_prompt_tokens, prompt_param)
