"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

import logging
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from .engine.params import FinishEvent, SamplingParams, TokenEvent
from .generation import (ClientGone, Generation, Prompt, check_token_ids, decode_ids, encode_chat,
                         encode_text, finite_or_none, plan_max_new_tokens, sampling_params, submit)
from .http_errors import ApiError, ended_by_shutdown, error_body
from .schemas import OpenAIErrorResponse, ignored_fields
from .schemas_openai import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                             CompletionChunk, CompletionRequest, CompletionResponse, ModelCard, ModelList,
                             SamplingFields)
from .services import Services, get_services, ready_engine
from .sse import DONE, GenerationEventStream, event_stream_doc, sse_json
from .structured import constrain, openai_grammar
from .tools import ToolCallStream, parse_tool_calls, plan_tools, template_messages

log = logging.getLogger("server.openai")
router = APIRouter(prefix="/v1", tags=["OpenAI"])

FINISH_REASONS = {"length": "length", "eos": "stop", "stop": "stop", "abort": "abort", "error": "error"}
CALLS_FINISH = ("eos", "stop")          # reasons that become "tool_calls" when the output made calls
ERRORS = {status: {"model": OpenAIErrorResponse} for status in (400, 401, 404, 413, 422, 429, 500, 503)}


def streaming(chunk_model) -> dict:
    """JSON, or with stream=true the chunks, [DONE] at the end (an error event instead, if the
    engine fails)."""
    return {200: {"content": event_stream_doc(chunk_model, OpenAIErrorResponse, done=True),
                  "description": "JSON, or with stream=true server-sent events"}, **ERRORS}


def served_names(engine, services: Services) -> set[str]:
    return {engine.model_name, services.settings.model}


def check_model(name: str, engine, services: Services) -> None:
    if name not in served_names(engine, services):
        raise ApiError(404, f"the model `{name}` does not exist; this server serves "
                            f"`{engine.model_name}`", param="model")


def openai_sampling(engine, body: SamplingFields, max_new_tokens: int, logprobs: bool) -> SamplingParams:
    return sampling_params(engine, max_new_tokens=max_new_tokens,
                           temperature=1.0 if body.temperature is None else body.temperature,
                           top_p=body.top_p, top_k=body.top_k,
                           repetition_penalty=body.repetition_penalty, seed=body.seed,
                           stop=body.stop_tuple(), logprobs=logprobs, ignore_eos=body.ignore_eos,
                           min_tokens=body.min_tokens, stop_token_ids=tuple(body.stop_token_ids or ()),
                           cache_salt=body.cache_salt, include_stop_str_in_output=body.include_stop_str_in_output)


def warn_ignored(body: SamplingFields, request: Request) -> None:
    """One log line per request naming the fields it sent that this server does not know."""
    names = ignored_fields(body)
    if names:
        log.warning("ignoring request fields this server does not know",
                    extra={"fields": {"request_id": request.state.request_id, "ignored_fields": names}})


def text_of(token: TokenEvent, tokenizer, skip_special_tokens: bool) -> str:
    """A token's text; with skip_special_tokens false, a special token shows as itself, except
    one that ended the request (EOS, a stop token id), which vLLM leaves out too."""
    if skip_special_tokens or not token.special or token.last:
        return token.text
    return tokenizer.convert_ids_to_tokens(token.token_id)


def stream_usage(gen: Generation) -> dict:
    """Usage so far, for stream_options.continuous_usage_stats."""
    completion = len(gen.tokens)
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": completion,
            "total_tokens": gen.prompt_tokens + completion}


def usage(finish: FinishEvent) -> dict:
    return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
            "total_tokens": finish.prompt_tokens + finish.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finish.cached_tokens}}


def visible(tokens: list[TokenEvent]) -> list[TokenEvent]:
    """Tokens OpenAI would list in logprobs (not the end-of-sequence token)."""
    return [t for t in tokens if not (t.special and not t.text)]


def completion_logprobs(tokens: list[TokenEvent], offset: int) -> dict:
    tokens = visible(tokens)
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    lps = [finite_or_none(t.logprob) for t in tokens]
    return {"tokens": [t.text for t in tokens], "token_logprobs": lps,
            "top_logprobs": [{t.text: lp} for t, lp in zip(tokens, lps)], "text_offset": offsets}


def chat_logprobs(tokens: list[TokenEvent]) -> dict:
    return {"content": [{"token": t.text, "logprob": finite_or_none(t.logprob),
                         "bytes": list(t.text.encode("utf-8")), "top_logprobs": []}
                        for t in visible(tokens)]}


async def openai_stream(gen: Generation, *, head: list[dict], chunk: Callable[[dict], dict],
                        token_choice: Callable[[TokenEvent], dict | None],
                        final_choice: Callable[[FinishEvent], dict],
                        include_usage: bool, continuous_usage: bool) -> AsyncIterator[bytes]:
    """``data:`` chunks: ``head`` choices, one per token with text, the finish reason (also
    "abort" when the server ended the request on shutdown), optional usage, then [DONE]. An
    engine error ends the stream with an error event instead."""
    def extra() -> dict:
        if continuous_usage:
            return {"usage": stream_usage(gen)}
        return {"usage": None} if include_usage else {}

    try:
        for choice in head:
            yield sse_json({**chunk(choice), **extra()})
        async for event in gen:
            if isinstance(event, TokenEvent):
                choice = token_choice(event)
                # b"" when nothing shows yet: lets the coalescer send what it holds
                yield sse_json({**chunk(choice), **extra()}) if choice is not None else b""
                continue
            if event.reason == "error":
                yield sse_json(error_body("/v1/", 500, f"generation failed: {event.error}"))
                return
            yield sse_json({**chunk(final_choice(event)), **({"usage": usage(event)} if continuous_usage
                                                              else extra())})
            if include_usage:
                yield sse_json({**chunk(None), "choices": [], "usage": usage(event)})
            yield DONE
    except Exception:
        log.exception("stream failed", extra={"fields": {"request_id": gen.request_id}})
        yield sse_json(error_body("/v1/", 500, "internal server error"))


async def finish_or_raise(gen: Generation, request: Request) -> FinishEvent | None:
    """The finish event of a non-streaming request; None if the client went away."""
    try:
        finish = await gen.collect(request)
    except ClientGone:
        return None
    if finish.reason == "error":
        raise ApiError(500, f"generation failed: {finish.error}")
    if finish.reason == "abort":
        raise ended_by_shutdown(finish)
    return finish


def final_text(gen: Generation, finish: FinishEvent, engine, body: SamplingFields) -> str:
    if body.skip_special_tokens:
        return finish.text
    for t in gen.tokens:
        t.text = text_of(t, engine.tokenizer, False)
    return "".join(t.text for t in gen.tokens)


def envelope(gen: Generation, object_name: str, id_prefix: str, model: str) -> Callable[[dict], dict]:
    base = {"id": f"{id_prefix}-{gen.engine_request_id}", "object": object_name,
            "created": gen.created, "model": model}
    return lambda choice: {**base, "choices": [choice] if choice is not None else []}


@router.post("/completions", response_model=CompletionResponse, responses=streaming(CompletionChunk),
             summary="Text completion (OpenAI)")
async def completions(body: CompletionRequest, request: Request, engine=Depends(ready_engine),
                      services: Services = Depends(get_services)) -> Response:
    check_model(body.model, engine, services)
    warn_ignored(body, request)
    if isinstance(body.prompt, str):
        prompt = await encode_text(engine, body.prompt, shared=body.cache_salt is None)
    else:
        check_token_ids(body.prompt, len(engine.tokenizer))
        prompt = Prompt(list(body.prompt), await decode_ids(engine.tokenizer, body.prompt))
    default = min(services.settings.default_completion_tokens, services.settings.default_max_new_tokens)
    max_new = plan_max_new_tokens(services, engine, prompt, body.max_tokens, default, "max_tokens")
    want_logprobs = body.logprobs is not None
    params = await constrain(openai_sampling(engine, body, max_new, want_logprobs), openai_grammar(body))
    gen = submit(services, engine, request, prompt, params, endpoint="completions", streaming=body.stream)
    echo = prompt.text if body.echo else ""
    chunk = envelope(gen, "text_completion", "cmpl", body.model)

    if body.stream:
        offset = [len(echo)]

        def token_choice(t: TokenEvent) -> dict | None:
            t.text = text_of(t, engine.tokenizer, body.skip_special_tokens)
            if not t.text and not want_logprobs:
                return None
            lp = completion_logprobs([t], offset[0]) if want_logprobs else None
            offset[0] += len(t.text)
            return {"index": 0, "text": t.text, "logprobs": lp, "finish_reason": None}

        head = [{"index": 0, "text": echo, "logprobs": None, "finish_reason": None}] if echo else []
        return GenerationEventStream(openai_stream(
            gen, head=head, chunk=chunk, token_choice=token_choice,
            final_choice=lambda f: {"index": 0, "text": "", "logprobs": None,
                                    "finish_reason": FINISH_REASONS[f.reason]},
            include_usage=body.include_usage(), continuous_usage=body.continuous_usage()), gen)

    finish = await finish_or_raise(gen, request)
    if finish is None:
        return Response(status_code=499)
    choice = {"index": 0, "text": echo + final_text(gen, finish, engine, body),
              "logprobs": completion_logprobs(gen.tokens, len(echo)) if want_logprobs else None,
              "finish_reason": FINISH_REASONS[finish.reason]}
    return JSONResponse({**chunk(choice), "usage": usage(finish)})


@router.post("/chat/completions", response_model=ChatCompletionResponse,
             responses=streaming(ChatCompletionChunk),
             summary="Chat completion (OpenAI)")
async def chat_completions(body: ChatCompletionRequest, request: Request, engine=Depends(ready_engine),
                           services: Services = Depends(get_services)) -> Response:
    check_model(body.model, engine, services)
    warn_ignored(body, request)
    try:
        tools = plan_tools(body, engine.tokenizer)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="tool_choice") from None
    grammar = openai_grammar(body)
    if tools.grammar is not None:
        if grammar is not None:
            raise ApiError(400, f"{grammar[1]} and tools (tool_choice not 'none') together", param=grammar[1])
        grammar = (tools.grammar, "tools")
    prompt = await encode_chat(engine, template_messages(body.messages, tools.tools, tools.fmt),
                               shared=body.cache_salt is None, tools=tools.tools if tools.fmt.template_renders_tools else None)
    max_new = plan_max_new_tokens(services, engine, prompt, body.token_limit(),
                                  services.settings.default_max_new_tokens, "max_completion_tokens")
    params = await constrain(openai_sampling(engine, body, max_new, body.logprobs), grammar)
    gen = submit(services, engine, request, prompt, params, endpoint="chat.completions", streaming=body.stream)
    chunk = envelope(gen, "chat.completion.chunk" if body.stream else "chat.completion",
                     "chatcmpl", body.model)

    if body.stream:
        calls = ToolCallStream(tools.fmt) if tools.active else None

        def delta(text: str, made: list[dict]) -> dict:
            out = {"content": text} if text else {}
            if made:
                first = len(calls.calls) - len(made)
                out["tool_calls"] = [{"index": first + i, **call} for i, call in enumerate(made)]
            return out

        def token_choice(t: TokenEvent) -> dict | None:
            t.text = text_of(t, engine.tokenizer, body.skip_special_tokens)
            if not t.text:
                return None
            d = delta(*calls.feed(t.text)) if calls is not None else {"content": t.text}
            if not d:
                return None
            return {"index": 0, "delta": d, "logprobs": chat_logprobs([t]) if body.logprobs else None,
                    "finish_reason": None}

        def final_choice(f: FinishEvent) -> dict:
            d = delta(*calls.finish()) if calls is not None else {}
            reason = FINISH_REASONS[f.reason]
            if calls is not None and calls.calls and f.reason in CALLS_FINISH:
                reason = "tool_calls"
            return {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}

        head = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]
        return GenerationEventStream(openai_stream(
            gen, head=head, chunk=chunk, token_choice=token_choice, final_choice=final_choice,
            include_usage=body.include_usage(), continuous_usage=body.continuous_usage()), gen)

    finish = await finish_or_raise(gen, request)
    if finish is None:
        return Response(status_code=499)
    message = {"role": "assistant", "content": final_text(gen, finish, engine, body)}
    reason = FINISH_REASONS[finish.reason]
    if tools.active:
        message["content"], made = parse_tool_calls(message["content"], tools.fmt)
        if made:
            message["tool_calls"] = made
            reason = "tool_calls" if finish.reason in CALLS_FINISH else reason
    choice = {"index": 0, "message": message, "logprobs": chat_logprobs(gen.tokens) if body.logprobs else None,
              "finish_reason": reason}
    return JSONResponse({**chunk(choice), "usage": usage(finish)})


def model_card(engine, services: Services) -> dict:
    return ModelCard(id=engine.model_name, created=services.started,
                     max_model_len=engine.max_model_len).model_dump()


@router.get("/models", response_model=ModelList, responses=ERRORS, summary="The served model")
async def list_models(engine=Depends(ready_engine), services: Services = Depends(get_services)):
    return {"object": "list", "data": [model_card(engine, services)]}


@router.get("/models/{model_id:path}", response_model=ModelCard, responses=ERRORS,
            summary="One model")
async def get_model(model_id: str, engine=Depends(ready_engine),
                    services: Services = Depends(get_services)):
    check_model(model_id, engine, services)
    return model_card(engine, services)
