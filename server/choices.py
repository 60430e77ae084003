"""Several generations answered as one OpenAI response: one per prompt of a completions request,
times ``n`` choices of each.

Each choice is its own engine request. The choices of one prompt after its first are added with
``follows`` set to the first's id, so the engine computes the prompt once and shares its cached
blocks with them; choice j > 0 gets its own seed stream, derived from the request's seed, so
that ``seed`` with ``n`` repeats and choice 0 equals the answer to ``n: 1``. Streamed, the
choices' events are merged as they come, each tagged with its index (prompt * n + choice).
"""

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from fastapi import Request

from .engine import queued_tokens
from .engine.params import FinishEvent, SamplingParams
from .generation import ClientGone, Generation, Prompt, drain_unless_gone, submit
from .http_errors import ApiError
from .services import Services

SEED_STRIDE = 0x9E3779B97F4A7C15          # odd: distinct choices never share a seed


def choice_seed(seed: int | None, choice: int) -> int | None:
    if seed is None or choice == 0:
        return seed
    return (seed + choice * SEED_STRIDE) % 2 ** 63


class ChoiceGroup:
    """The generations of one request, by index; ``close()`` aborts whichever are unfinished."""

    def __init__(self, generations: list[Generation], n: int):
        self.generations = generations
        self.n = n
        self._merged: asyncio.Queue | None = None

    def __len__(self) -> int:
        return len(self.generations)

    def first_of(self, index: int) -> Generation:
        """The first choice of the prompt of choice ``index`` (the one that reports its prompt)."""
        return self.generations[index - index % self.n]

    def has_ready_events(self) -> bool:
        if self._merged is not None:
            return not self._merged.empty()
        return self.generations[0].has_ready_events()

    async def events(self) -> AsyncIterator[tuple[int, object]]:
        """(index, event) until every choice has finished."""
        if len(self.generations) == 1:
            async for event in self.generations[0]:
                yield 0, event
            return
        merged = self._merged = asyncio.Queue()

        async def pump(index: int, generation: Generation):
            try:
                async for event in generation:
                    merged.put_nowait((index, event))
            except Exception as exc:                   # handed to the reader, which raises it
                merged.put_nowait((index, exc))

        tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(self.generations)]
        try:
            remaining = len(tasks)
            while remaining:
                index, event = await merged.get()
                if isinstance(event, Exception):
                    raise event
                if isinstance(event, FinishEvent):
                    remaining -= 1
                yield index, event
        finally:
            for task in tasks:
                task.cancel()

    async def collect(self, request: Request) -> list[FinishEvent]:
        """Runs every choice to its finish; aborts them all and raises ClientGone if the client
        disconnects first."""
        await drain_unless_gone(request, self.events(), self.close)
        if any(g.finish is None for g in self.generations):
            raise ClientGone()
        return [g.finish for g in self.generations]

    def close(self) -> None:
        for generation in self.generations:
            generation.close()


def check_fits_queue(config, prompts: list[tuple[Prompt, SamplingParams]], n: int) -> None:
    """400 for a request the engine's queue bounds could never admit whole (a 429 would ask for a retry)."""
    requests = len(prompts) * n
    if requests > config.max_waiting_requests:
        raise ApiError(400, f"{len(prompts)} prompts times n={n} are {requests} requests, over the "
                            f"{config.max_waiting_requests} the queue holds (--max-waiting-requests)", param="n")
    tokens = n * sum(queued_tokens(len(prompt.ids), params) for prompt, params in prompts)
    if tokens > config.max_waiting_tokens:
        raise ApiError(400, f"{len(prompts)} prompts times n={n} are {tokens} tokens of prompt and max_tokens, "
                            f"over the {config.max_waiting_tokens} the queue holds (--max-waiting-tokens)",
                       param="n")


def submit_choices(services: Services, engine, request: Request, prompts: list[tuple[Prompt, SamplingParams]],
                   n: int, *, endpoint: str, streaming: bool) -> ChoiceGroup:
    """Submits ``n`` choices of each prompt; if one cannot be admitted, those already are aborted."""
    check_fits_queue(engine.config, prompts, n)
    generations: list[Generation] = []
    try:
        for prompt, params in prompts:
            first = None
            for choice in range(n):
                choice_params = params
                if choice:
                    choice_params = dataclasses.replace(params, seed=choice_seed(params.seed, choice),
                                                        prompt_logprobs=None)
                gen = submit(services, engine, request, prompt, choice_params, endpoint=endpoint,
                             streaming=streaming, follows=first)
                first = first or gen.engine_request_id
                generations.append(gen)
    except BaseException:
        for gen in generations:
            gen.close()
        raise
    return ChoiceGroup(generations, n)
