"""Server-sent events for generations, on FastAPI's built-in SSE support."""

from collections.abc import AsyncIterator

import pydantic_core
from fastapi.sse import EventSourceResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from .generation import Generation

DONE = b"data: [DONE]\n\n"


def sse_json(payload: dict) -> bytes:
    """One ``data:`` line of ``payload``'s JSON (which holds no line break: JSON escapes them in
    strings), a non-finite number written as null. pydantic-core's serializer: about 0.7 us for a
    token's event against 4.6 us through ``json.dumps`` and ``format_sse_event``, every token."""
    return b"data: " + pydantic_core.to_json(payload, inf_nan_mode="null") + b"\n\n"


async def coalesced(chunks: AsyncIterator[bytes], generation: Generation) -> AsyncIterator[bytes]:
    """Joins the events rendered from tokens that were already waiting into one write: a stream
    that fell behind the engine (many streams, one event loop) then costs one send per burst
    instead of one per token, and a stream that keeps up still sends each token at once."""
    buffer: list[bytes] = []
    try:
        async for chunk in chunks:
            buffer.append(chunk)
            if not generation.has_ready_events():
                joined = b"".join(buffer)
                buffer.clear()
                if joined:
                    yield joined
        joined = b"".join(buffer)
        if joined:
            yield joined
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()


class GenerationEventStream(EventSourceResponse):
    """Streams ``content`` and, however the stream ends (finished, client gone, error), closes
    the generation, which aborts the engine request if it has not finished."""

    def __init__(self, content: AsyncIterator[bytes], generation: Generation):
        super().__init__(coalesced(content, generation),
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()
            # Starlette leaves an unfinished body generator to the garbage collector.
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


EVENT_MODELS: list[type[BaseModel]] = []     # the app adds their schemas to the OpenAPI components


def event_stream_doc(*event_models: type[BaseModel], done: bool = False) -> dict:
    """The OpenAPI content of a text/event-stream response, as FastAPI documents its own event
    streams: ``itemSchema`` describes one event, whose ``data`` is the JSON of one of
    ``event_models`` (or, with ``done``, the literal ``[DONE]``)."""
    EVENT_MODELS.extend(m for m in event_models if m not in EVENT_MODELS)
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{m.__name__}"}
                                             for m in event_models]}}
    data = {"anyOf": [{"type": "string", "const": "[DONE]"}, json_data]} if done else json_data
    return {"text/event-stream": {"itemSchema": {
        "type": "object", "required": ["data"],
        "properties": {"data": data, "event": {"type": "string"}, "id": {"type": "string"},
                       "retry": {"type": "integer", "minimum": 0}}}}}
