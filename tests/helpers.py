"""Driving the engine synchronously from tests."""

import asyncio

from server.engine import Engine, FinishEvent, SamplingParams


def chat_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


async def collect(engine: Engine, prompt_ids, params: SamplingParams, abort_after: int | None = None):
    stream = engine.add_request(list(prompt_ids), params)
    tokens, texts = [], []
    async for event in stream:
        if isinstance(event, FinishEvent):
            return tokens, "".join(texts), event
        tokens.append(event.token_id)
        texts.append(event.text)
        if abort_after is not None and len(tokens) == abort_after:
            stream.abort()


def run_all(engine: Engine, requests):
    """requests: [(prompt_ids, params)] or [(prompt_ids, params, abort_after)], served together."""
    async def main():
        return await asyncio.gather(*(collect(engine, *r) for r in requests))
    return asyncio.run(main())
