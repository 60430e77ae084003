"""Text Generation Inference-shaped routes: POST /generate, POST /generate_stream, GET /info."""

import importlib.metadata
import logging
import secrets
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from .engine.params import FinishEvent, SamplingParams, TokenEvent
from .generation import (SAMPLING_EPS, ClientGone, Generation, Prompt, encode_chat, encode_text,
                         finite_or_none, plan_max_new_tokens, sampling_params, submit)
from .http_errors import ApiError, ended_by_shutdown, require_json_body
from .schemas import (MAX_STOP_SEQUENCES, ErrorResponse, GenerateParameters, GenerateRequest,
                      GenerateResponse, Info, StreamResponse, chat_template_messages)
from .services import Services, get_services, ready_engine
from .sse import GenerationEventStream, event_stream_doc, sse_json
from .structured import constrain, tgi_grammar
from .token_text import token_strings

log = logging.getLogger("server.tgi")
router = APIRouter(tags=["TGI"], dependencies=[Depends(require_json_body)])

FINISH_REASONS = {"length": "length", "eos": "eos_token", "stop": "stop_sequence",
                  "abort": "abort", "error": "error"}
ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 413, 415, 422, 429, 500, 503)}
# The token events, the last with generated_text and details, or an error event instead of it.
STREAM_DOC = event_stream_doc(StreamResponse, ErrorResponse)


def server_version() -> str:
    try:
        return importlib.metadata.version("flashdecode-server")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def tgi_sampling(engine, p: GenerateParameters, max_new_tokens: int, services: Services) -> SamplingParams:
    sample = p.wants_sampling()
    temperature = (1.0 if p.temperature is None else p.temperature) if sample else 0.0
    seed = p.seed
    if seed is None and temperature >= SAMPLING_EPS:
        seed = secrets.randbits(63)     # reported in details, so a sample can be replayed
    return sampling_params(engine, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_p=p.top_p, top_k=p.top_k, repetition_penalty=p.repetition_penalty,
                           seed=seed, stop=tuple(p.stop), logprobs=True, ignore_eos=p.ignore_eos,
                           include_stop_str_in_output=True,    # TGI's generated_text ends with the stop sequence
                           top_logprobs=p.top_n_tokens or 0, frequency_penalty=p.frequency_penalty,
                           prompt_logprobs=0 if p.decoder_input_details and p.details else None)


def check_top_n_tokens(p: GenerateParameters, services: Services) -> None:
    limit = services.settings.max_logprobs
    if p.top_n_tokens is not None and p.top_n_tokens > limit:
        raise ApiError(422, f"top_n_tokens {p.top_n_tokens} is over this server's limit of {limit} "
                            "(--max-logprobs)", param="parameters.top_n_tokens")


def top_tokens_json(event: TokenEvent, strings) -> list[dict] | None:
    if event.top_logprobs is None:
        return None
    return [{"id": i, "text": strings.text(i), "logprob": finite_or_none(v), "special": i in strings.special}
            for i, v in event.top_logprobs]


def prefill_json(prompt_ids: list[int], report, strings) -> list[dict]:
    values = [None] + [finite_or_none(v) for v, _, _ in report or ()]
    return [{"id": i, "text": strings.text(i), "logprob": v} for i, v in zip(prompt_ids, values)]


def token_json(event: TokenEvent) -> dict:
    return {"id": event.token_id, "text": event.text, "logprob": finite_or_none(event.logprob),
            "special": event.special}


async def build_prompt(body: GenerateRequest, engine) -> Prompt:
    if body.messages is not None:
        prompt = await encode_chat(engine, chat_template_messages(body.messages))
    else:
        prompt = await encode_text(engine, body.inputs)
    truncate = body.parameters.truncate
    if truncate is not None and len(prompt.ids) > truncate:
        prompt.ids = prompt.ids[-truncate:]
    return prompt


def stream_error(gen: Generation, finish: FinishEvent) -> dict:
    """The error event that ends a stream the engine could not finish, as TGI sends one."""
    if finish.reason == "error":
        return {"error": f"generation failed: {finish.error}", "error_type": "generation"}
    return {"error": f"the server is shutting down and ended the request after "
                     f"{finish.completion_tokens} tokens", "error_type": "incomplete_generation"}


async def tgi_stream(gen: Generation, prefix: str, strings) -> AsyncIterator[bytes]:
    """One event per token; the last token's event also carries generated_text and details, as
    TGI's does (the engine marks that token, its finish event queued right behind it)."""
    index = 0
    try:
        async for event in gen:
            finish = event if isinstance(event, FinishEvent) else None
            token = None if finish else event
            if token is not None and token.last:
                finish = await gen.__anext__()
            if finish is not None and finish.reason in ("error", "abort"):
                if token is not None:
                    index += 1
                    yield sse_json({"index": index, "token": token_json(token), "generated_text": None,
                                    "details": None, "top_tokens": top_tokens_json(token, strings)})
                yield sse_json(stream_error(gen, finish))
                return
            index += 1
            if finish is None:
                yield sse_json({"index": index, "token": token_json(token), "generated_text": None,
                                "details": None, "top_tokens": top_tokens_json(token, strings)})
                continue
            token = token or TokenEvent(0, "", None, True)    # finished with no token of its own
            yield sse_json({
                "index": index, "token": token_json(token),
                "generated_text": prefix + finish.text,
                "details": {"finish_reason": FINISH_REASONS[finish.reason],
                            "generated_tokens": finish.completion_tokens,
                            "seed": gen.params.seed, "input_length": finish.prompt_tokens,
                            "cached_tokens": finish.cached_tokens},
                "top_tokens": top_tokens_json(token, strings)})
            return
    except Exception:
        log.exception("stream failed", extra={"fields": {"request_id": gen.request_id}})
        yield sse_json({"error": "internal server error", "error_type": "internal"})


async def run_generate(body: GenerateRequest, request: Request, engine, services: Services,
                       *, stream: bool, endpoint: str) -> Response:
    prompt = await build_prompt(body, engine)
    params = body.parameters
    max_new = plan_max_new_tokens(services, engine, prompt, params.max_new_tokens,
                                  services.settings.default_max_new_tokens,
                                  "parameters.max_new_tokens",
                                  "messages" if body.messages is not None else "inputs")
    check_top_n_tokens(params, services)
    sampling = await constrain(tgi_sampling(engine, params, max_new, services), tgi_grammar(params.grammar))
    strings = token_strings(engine.tokenizer)
    prefix = prompt.text if params.return_full_text else ""
    gen = submit(services, engine, request, prompt, sampling, endpoint=endpoint, streaming=stream)
    if stream:
        return GenerationEventStream(
            tgi_stream(gen, prefix, strings), gen)
    try:
        finish = await gen.collect(request)
    except ClientGone:
        return Response(status_code=499)
    if finish.reason == "error":
        raise ApiError(500, f"generation failed: {finish.error}")
    if finish.reason == "abort":
        raise ended_by_shutdown(finish)
    answer = {"generated_text": prefix + finish.text}
    if params.details:
        answer["details"] = {"finish_reason": FINISH_REASONS[finish.reason],
                             "generated_tokens": finish.completion_tokens, "seed": sampling.seed,
                             "cached_tokens": finish.cached_tokens,
                             "prefill": [], "tokens": [token_json(t) for t in gen.tokens]}
        if params.decoder_input_details and gen.tokens:
            answer["details"]["prefill"] = prefill_json(prompt.ids, gen.tokens[0].prompt_logprobs, strings)
        if params.top_n_tokens:
            answer["details"]["top_tokens"] = [top_tokens_json(t, strings) or [] for t in gen.tokens]
    return JSONResponse(answer)


@router.post("/generate", response_model=GenerateResponse,
             responses={200: {"content": STREAM_DOC, "description": "JSON, or with stream=true "
                                                                   "server-sent events"}, **ERRORS},
             summary="Generate text (JSON, or server-sent events with stream=true)")
async def generate(body: GenerateRequest, request: Request, engine=Depends(ready_engine),
                   services: Services = Depends(get_services)) -> Response:
    return await run_generate(body, request, engine, services, stream=body.stream,
                              endpoint="generate")


@router.post("/generate_stream", response_class=Response,
             responses={200: {"content": STREAM_DOC, "description": "Server-sent events"}, **ERRORS},
             summary="Generate text as server-sent events (the body's `stream` is ignored)")
async def generate_stream(body: GenerateRequest, request: Request, engine=Depends(ready_engine),
                          services: Services = Depends(get_services)) -> Response:
    return await run_generate(body, request, engine, services, stream=True,
                              endpoint="generate_stream")


@router.get("/info", response_model=Info, summary="Model and limits")
async def info(engine=Depends(ready_engine), services: Services = Depends(get_services)) -> Info:
    limit = services.settings.max_prompt_tokens or engine.max_model_len - 1
    return Info(model_id=engine.model_name, max_input_tokens=min(limit, engine.max_model_len - 1),
                max_total_tokens=engine.max_model_len, max_stop_sequences=MAX_STOP_SEQUENCES,
                version=server_version())
