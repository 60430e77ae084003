"""From the core's token ids to text, per request: detokenizing and stop strings.

The core streams token ids and knows nothing of text. This runs on the front end's side of
the core (in each HTTP worker process, or in the thread that hands events to the server), so
with several API workers the per-token text work is spread over their processes and kept off
the core's step loop, as vLLM's output processor is. When a stop string shows up in the text,
the request's last token event and its finish event go out at once and the core is asked to
abort it; what the core sends for it afterwards is dropped, up to the core's own finish event,
which ends the request here too (until then its id counts as in flight).
"""

import dataclasses
import time

from .detokenizer import IncrementalDetokenizer, StopMatcher
from .params import FinishEvent, SamplingParams, TokenEvent


class RequestText:
    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.prompt_tokens = len(prompt_ids)
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stops = StopMatcher(params.stop, params.include_stop_str_in_output)
        self.min_tokens = params.min_tokens    # a stop string ends the text from the token after these on
        self.text = ""                   # decoded output so far (cut at a stop string)
        self.emitted = 0                 # characters of text already streamed
        self.tokens = 0                  # tokens streamed (through the one completing a stop string)
        self.cached_tokens = 0           # prompt tokens the core found in its prefix cache
        self.stopped = False


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._requests: dict[str, RequestText] = {}

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self._requests[request_id] = RequestText(self.tokenizer, prompt_ids, params)

    def discard(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def process(self, pairs) -> tuple[list[tuple[str, object]], list[str]]:
        """Takes one step's ``(request_id, event)`` pairs from the core; returns the pairs with
        their text filled in (events of requests unknown or already finished dropped) and the
        ids of requests a stop string ended, which the core should abort."""
        states = [self._requests.get(request_id) for request_id, _ in pairs]
        deltas = self._detokenize(pairs, states)
        out, stopped = [], []
        for (request_id, event), state, delta in zip(pairs, states, deltas):
            if state is None or request_id not in self._requests:
                continue
            if type(event) is TokenEvent:
                if not state.stopped:
                    self._token(state, event, delta)
                    out.append((request_id, event))
                    if state.stopped:
                        out.append((request_id, self._stop_finish(state)))
                        stopped.append(request_id)
            else:
                del self._requests[request_id]
                if not state.stopped:
                    out.append((request_id, dataclasses.replace(event, text=state.text)))
        return out, stopped

    @staticmethod
    def _detokenize(pairs, states) -> list[str]:
        """The text delta of each token event in ``pairs``, in order (a request may have several
        tokens in one step); special tokens print nothing."""
        return [state.detokenizer.step(event.token_id)
                if state is not None and type(event) is TokenEvent and not state.stopped and not event.special
                else "" for (_, event), state in zip(pairs, states)]

    @staticmethod
    def _token(state: RequestText, event: TokenEvent, delta: str) -> None:
        state.tokens += 1
        if state.first_token is None:
            state.first_token = event.time
        if event.cached_tokens is not None:
            state.cached_tokens = event.cached_tokens
        state.text += delta
        release, state.stopped = state.stops.scan(state.text, state.emitted, len(delta),
                                                  may_stop=state.tokens > state.min_tokens)
        if state.stopped:
            state.text = state.text[:release]
        event.last = event.last or state.stopped
        if event.last:
            release = len(state.text)             # nothing is held back once the text is final
        event.text = state.text[state.emitted:release]
        state.emitted = release

    @staticmethod
    def _stop_finish(state: RequestText) -> FinishEvent:
        """The queueing time is the core's to know; this finish leaves it out."""
        now = time.monotonic()
        timings = {"queue": None, "ttft": max(0.0, state.first_token - state.arrival), "total": now - state.arrival}
        return FinishEvent("stop", state.text, state.prompt_tokens, state.tokens, None, timings, state.cached_tokens)
