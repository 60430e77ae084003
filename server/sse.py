"""Server-sent events for generations, on FastAPI's built-in SSE support."""

import json
from collections.abc import AsyncIterator

from fastapi.sse import EventSourceResponse, format_sse_event
from starlette.types import Receive, Scope, Send

from .generation import Generation

DONE = b"data: [DONE]\n\n"


def sse_json(payload: dict) -> bytes:
    return format_sse_event(data_str=json.dumps(payload, ensure_ascii=False, allow_nan=False))


class GenerationEventStream(EventSourceResponse):
    """Streams ``content`` and, however the stream ends (finished, client gone, error), closes
    the generation, which aborts the engine request if it has not finished."""

    def __init__(self, content: AsyncIterator[bytes], generation: Generation):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
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


SSE_RESPONSE_DOC = {"text/event-stream": {"schema": {"type": "string"},
                                          "description": "Server-sent events, one `data:` line each."}}
