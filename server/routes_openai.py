"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""

import logging
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from .engine.params import FinishEvent, SamplingParams, TokenEvent
from .choices import ChoiceGroup, submit_choices
from .generation import (ClientGone, Generation, Prompt, check_token_ids, decode_ids, encode_chat,
                         encode_text, plan_max_new_tokens, sampling_params)
from .openai_logprobs import (chat_logprobs, completion_logprobs, echo_logprobs, joined,
                              vllm_prompt_logprobs)
from .http_errors import ApiError, ended_by_shutdown, error_body, require_json_body
from .schemas import OpenAIErrorResponse, ignored_fields
from .schemas_openai import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                             CompletionChunk, CompletionRequest, CompletionResponse, ModelCard, ModelList,
                             SamplingFields)
from .services import Services, get_services, ready_engine
from .sse import DONE, GenerationEventStream, event_stream_doc, sse_json
from .structured import constrain, openai_grammar
from .token_text import token_strings
from .tools import ToolCallStream, parse_tool_calls, plan_tools, template_messages

log = logging.getLogger("server.openai")
router = APIRouter(prefix="/v1", tags=["OpenAI"], dependencies=[Depends(require_json_body)])

FINISH_REASONS = {"length": "length", "eos": "stop", "stop": "stop", "abort": "abort", "error": "error"}
CALLS_FINISH = ("eos", "stop")          # reasons that become "tool_calls" when the output made calls
ERRORS = {status: {"model": OpenAIErrorResponse} for status in (400, 401, 404, 413, 415, 422, 429, 500, 503)}


def streaming(chunk_model) -> dict:
    """JSON, or with stream=true the chunks, [DONE] at the end (an error event instead, if the
    engine fails)."""
    return {200: {"content": event_stream_doc(chunk_model, OpenAIErrorResponse, done=True),
                  "description": "JSON, or with stream=true server-sent events"}, **ERRORS}


def served_names(engine, services: Services) -> set[str]:
    return {engine.model_name, services.settings.model}


MODEL_NAME_SHOWN = 100     # characters of an unknown model name quoted back in the 404


def check_model(name: str, engine, services: Services) -> None:
    if name not in served_names(engine, services):
        shown = name if len(name) <= MODEL_NAME_SHOWN else \
            f"{name[:MODEL_NAME_SHOWN]}... ({len(name)} characters)"
        raise ApiError(404, f"the model `{shown}` does not exist; this server serves "
                            f"`{engine.model_name}`", param="model")


def openai_sampling(engine, body: SamplingFields, max_new_tokens: int, logprobs: bool, top_logprobs: int = 0,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    return sampling_params(engine, max_new_tokens=max_new_tokens,
                           temperature=1.0 if body.temperature is None else body.temperature,
                           top_p=body.top_p, top_k=body.top_k,
                           repetition_penalty=body.repetition_penalty, seed=body.seed,
                           stop=body.stop_tuple(), logprobs=logprobs, ignore_eos=body.ignore_eos,
                           min_tokens=body.min_tokens, stop_token_ids=tuple(body.stop_token_ids or ()),
                           cache_salt=body.cache_salt, include_stop_str_in_output=body.include_stop_str_in_output,
                           top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
                           presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                           logit_bias=body.bias_pairs())


def check_server_limits(services: Services, **asked: int | None) -> None:
    """422 for a count within the API's range but over this server's --max-logprobs / --max-n."""
    settings = services.settings
    for name, value in asked.items():
        limit = settings.max_n if name == "n" else settings.max_logprobs
        if value is not None and value > limit:
            flag = "--max-n" if name == "n" else "--max-logprobs"
            raise ApiError(422, f"{name} {value} is over this server's limit of {limit} ({flag})", param=name)


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


def group_usage(group: ChoiceGroup, completion_tokens: int | None = None, details: bool = True) -> dict:
    """Usage of every choice: each prompt counted once, the tokens of every choice; while
    streaming (``completion_tokens`` None), the tokens received so far."""
    firsts = group.generations[::group.n]
    prompt = sum(g.prompt_tokens for g in firsts)
    if completion_tokens is None:
        completion_tokens = sum(len(g.tokens) for g in group.generations)
    out = {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}
    if details:
        cached = sum(g.finish.cached_tokens for g in firsts if g.finish is not None)
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


async def openai_stream(group: ChoiceGroup, *, head: list[dict], chunk: Callable[[dict], dict],
                        token_choices: Callable[[int, TokenEvent], list[dict]],
                        final_choice: Callable[[int, FinishEvent], dict], final_usage: Callable[[], dict],
                        include_usage: bool, continuous_usage: bool) -> AsyncIterator[bytes]:
    """``data:`` chunks: ``head`` choices, those of each token (by choice index), each choice's
    finish reason (also "abort" when the server ended the request on shutdown), optional usage,
    then [DONE]. An engine error ends the stream with an error event instead."""
    def extra() -> dict:
        if continuous_usage:
            return {"usage": group_usage(group, details=False)}
        return {"usage": None} if include_usage else {}

    try:
        for choice in head:
            yield sse_json({**chunk(choice), **extra()})
        remaining = len(group)
        async for index, event in group.events():
            if isinstance(event, TokenEvent):
                choices = token_choices(index, event)
                # b"" when nothing shows yet: lets the coalescer send what it holds
                yield b"".join(sse_json({**chunk(c), **extra()}) for c in choices)
                continue
            if event.reason == "error":
                yield sse_json(error_body("/v1/", 500, f"generation failed: {event.error}"))
                return
            remaining -= 1
            last_usage = {"usage": final_usage()} if continuous_usage and not remaining else extra()
            yield sse_json({**chunk(final_choice(index, event)), **last_usage})
        if include_usage:
            yield sse_json({**chunk(None), "choices": [], "usage": final_usage()})
        yield DONE
    except Exception:
        log.exception("stream failed", extra={"fields": {"request_id": group.generations[0].request_id}})
        yield sse_json(error_body("/v1/", 500, "internal server error"))


async def finish_or_raise(group: ChoiceGroup, request: Request) -> list[FinishEvent] | None:
    """The finish events of a non-streaming request; None if the client went away."""
    try:
        finishes = await group.collect(request)
    except ClientGone:
        return None
    for finish in finishes:
        if finish.reason == "error":
            raise ApiError(500, f"generation failed: {finish.error}")
    for finish in finishes:
        if finish.reason == "abort":
            raise ended_by_shutdown(finish)
    return finishes


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


async def completion_prompt(engine, body: CompletionRequest, prompt) -> Prompt:
    if isinstance(prompt, str):
        return await encode_text(engine, prompt, shared=body.cache_salt is None)
    check_token_ids(prompt, len(engine.tokenizer))
    return Prompt(list(prompt), await decode_ids(engine.tokenizer, prompt))


def prompt_report(group: ChoiceGroup, index: int):
    """The prompt log-probabilities that the first choice of ``index``'s prompt brought, if any."""
    first = group.first_of(index)
    return first.tokens[0].prompt_logprobs if first.tokens else None


@router.post("/completions", response_model=CompletionResponse, responses=streaming(CompletionChunk),
             summary="Text completion (OpenAI)")
async def completions(body: CompletionRequest, request: Request, engine=Depends(ready_engine),
                      services: Services = Depends(get_services)) -> Response:
    check_model(body.model, engine, services)
    warn_ignored(body, request)
    check_server_limits(services, n=body.n, logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs)
    prompts = [await completion_prompt(engine, body, p) for p in body.prompt_list()]
    default = min(services.settings.default_completion_tokens, services.settings.default_max_new_tokens)
    nothing = body.max_tokens == 0                # the prompt alone: one token is computed and dropped
    want_logprobs = body.logprobs is not None
    echo_scores = body.echo and want_logprobs
    asked_prompt = body.prompt_logprobs
    if echo_scores:
        asked_prompt = max(body.logprobs, asked_prompt or 0)
    grammar = openai_grammar(body)
    planned = []
    for i, prompt in enumerate(prompts):
        max_new = plan_max_new_tokens(services, engine, prompt, 1 if nothing else body.max_tokens, default,
                                      "max_tokens", body.prompt_field(i))
        planned.append((prompt, await constrain(openai_sampling(engine, body, max_new, want_logprobs,
                                                                body.logprobs or 0, asked_prompt), grammar)))
    n = body.choices()
    group = submit_choices(services, engine, request, planned, n, endpoint="completions", streaming=body.stream)
    strings = token_strings(engine.tokenizer)
    chunk = envelope(group.generations[0], "text_completion", "cmpl", body.model)

    def prompt_of(index: int) -> Prompt:
        return prompts[index // n]

    def echo_part(index: int) -> tuple[str, dict | None, list | None]:
        """The echoed text, its logprobs part and vLLM's prompt_logprobs of choice ``index``."""
        report = prompt_report(group, index)
        prompt = prompt_of(index)
        text = prompt.text if body.echo else ""
        part = echo_logprobs(prompt.ids, report, strings) if echo_scores and report is not None else None
        vllm = (vllm_prompt_logprobs(prompt.ids, report, strings)
                if body.prompt_logprobs is not None and report is not None else None)
        return text, part, vllm

    def completed(gen: Generation) -> int:
        return 0 if nothing else len(gen.tokens)

    def final_usage() -> dict:
        return group_usage(group, sum(completed(g) for g in group.generations))

    if body.stream:
        offsets = [0] * len(group)
        started = [False] * len(group)

        def token_choices(index: int, t: TokenEvent) -> list[dict]:
            out = []
            if not started[index]:
                started[index] = True
                text, part, vllm = echo_part(index)
                if text or part is not None or vllm is not None:
                    choice = {"index": index, "text": text, "logprobs": part, "finish_reason": None}
                    if vllm is not None:
                        choice["prompt_logprobs"] = vllm
                    out.append(choice)
                    offsets[index] = len(text)
            if nothing:
                return out
            t.text = text_of(t, engine.tokenizer, body.skip_special_tokens)
            if not t.text and not want_logprobs:
                return out
            lp = completion_logprobs([t], offsets[index], strings) if want_logprobs else None
            offsets[index] += len(t.text)
            out.append({"index": index, "text": t.text, "logprobs": lp, "finish_reason": None})
            return out

        return GenerationEventStream(openai_stream(
            group, head=[], chunk=chunk, token_choices=token_choices,
            final_choice=lambda i, f: {"index": i, "text": "", "logprobs": None,
                                       "finish_reason": "length" if nothing else FINISH_REASONS[f.reason]},
            final_usage=final_usage, include_usage=body.include_usage(),
            continuous_usage=body.continuous_usage()), group)

    finishes = await finish_or_raise(group, request)
    if finishes is None:
        return Response(status_code=499)
    choices = []
    for index, (gen, finish) in enumerate(zip(group.generations, finishes)):
        echo, part, vllm = echo_part(index)
        text = "" if nothing else final_text(gen, finish, engine, body)
        logprobs = None
        if want_logprobs:
            generated = completion_logprobs([] if nothing else gen.tokens, len(echo), strings)
            logprobs = joined(part, generated) if part is not None else generated
        choice = {"index": index, "text": echo + text, "logprobs": logprobs,
                  "finish_reason": "length" if nothing else FINISH_REASONS[finish.reason]}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm
        choices.append(choice)
    return JSONResponse({**chunk(None), "choices": choices, "usage": final_usage()})


@router.post("/chat/completions", response_model=ChatCompletionResponse,
             responses=streaming(ChatCompletionChunk),
             summary="Chat completion (OpenAI)")
async def chat_completions(body: ChatCompletionRequest, request: Request, engine=Depends(ready_engine),
                           services: Services = Depends(get_services)) -> Response:
    check_model(body.model, engine, services)
    warn_ignored(body, request)
    check_server_limits(services, n=body.n, top_logprobs=body.top_logprobs, prompt_logprobs=body.prompt_logprobs)
    if body.token_limits_differ():
        raise ApiError(400, f"give max_completion_tokens or max_tokens, not two different values "
                            f"({body.max_completion_tokens} and {body.max_tokens})", param="max_completion_tokens")
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, f"top_logprobs {body.top_logprobs} asks for log-probabilities: set logprobs "
                            "to true as well", param="top_logprobs")
    empty = next((i for i, m in enumerate(body.messages) if m.lacks_content()), None)
    if empty is not None:
        raise ApiError(400, f"messages[{empty}] has no content (null only for an assistant message with "
                            "tool_calls)", param=f"messages.{empty}.content")
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
                               shared=body.cache_salt is None,
                               tools=tools.tools if tools.fmt.template_renders_tools else None)
    max_new = plan_max_new_tokens(services, engine, prompt, body.token_limit(),
                                  services.settings.default_max_new_tokens, "max_completion_tokens", "messages")
    params = openai_sampling(engine, body, max_new, body.logprobs, body.top_logprobs or 0 if body.logprobs else 0,
                             body.prompt_logprobs)
    params = await constrain(params, grammar)
    group = submit_choices(services, engine, request, [(prompt, params)], body.choices(),
                           endpoint="chat.completions", streaming=body.stream)
    strings = token_strings(engine.tokenizer)
    chunk = envelope(group.generations[0], "chat.completion.chunk" if body.stream else "chat.completion",
                     "chatcmpl", body.model)

    if body.stream:
        calls = [ToolCallStream(tools.fmt) for _ in range(len(group))] if tools.active else None

        def delta(index: int, text: str, made: list[dict]) -> dict:
            out = {"content": text} if text else {}
            if made:
                first = len(calls[index].calls) - len(made)
                out["tool_calls"] = [{"index": first + i, **call} for i, call in enumerate(made)]
            return out

        def token_choices(index: int, t: TokenEvent) -> list[dict]:
            t.text = text_of(t, engine.tokenizer, body.skip_special_tokens)
            if not t.text:
                return []
            d = delta(index, *calls[index].feed(t.text)) if calls is not None else {"content": t.text}
            if not d:
                return []
            return [{"index": index, "delta": d,
                     "logprobs": chat_logprobs([t], strings) if body.logprobs else None, "finish_reason": None}]

        def final_choice(index: int, f: FinishEvent) -> dict:
            d = delta(index, *calls[index].finish()) if calls is not None else {}
            reason = FINISH_REASONS[f.reason]
            if calls is not None and calls[index].calls and f.reason in CALLS_FINISH:
                reason = "tool_calls"
            return {"index": index, "delta": d, "logprobs": None, "finish_reason": reason}

        head = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(len(group))]
        return GenerationEventStream(openai_stream(
            group, head=head, chunk=chunk, token_choices=token_choices, final_choice=final_choice,
            final_usage=lambda: group_usage(group, sum(f.completion_tokens for f in
                                                       (g.finish for g in group.generations) if f)),
            include_usage=body.include_usage(), continuous_usage=body.continuous_usage()), group)

    finishes = await finish_or_raise(group, request)
    if finishes is None:
        return Response(status_code=499)
    choices = []
    for i, (gen, finish) in enumerate(zip(group.generations, finishes)):
        message = {"role": "assistant", "content": final_text(gen, finish, engine, body)}
        reason = FINISH_REASONS[finish.reason]
        if tools.active:
            message["content"], made = parse_tool_calls(message["content"], tools.fmt)
            if made:
                message["tool_calls"] = made
                reason = "tool_calls" if finish.reason in CALLS_FINISH else reason
        choices.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(gen.tokens, strings) if body.logprobs else None,
                        "finish_reason": reason})
    answer = {**chunk(None), "choices": choices,
              "usage": group_usage(group, sum(f.completion_tokens for f in finishes))}
    if body.prompt_logprobs is not None:
        report = prompt_report(group, 0)
        answer["prompt_logprobs"] = vllm_prompt_logprobs(prompt.ids, report, strings) if report is not None else None
    return JSONResponse(answer)


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
