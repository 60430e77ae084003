"""The streaming APIs the load generator speaks: what to send, and how to read what comes back.

Each backend turns a prompt into (path, JSON body) and turns the list of ``data:`` payloads of the
server-sent-event stream, each stamped with the time it arrived, into a ``Parsed`` record. Parsing
happens after the stream ends, so the timed loop only splits lines and stamps them.

Timing follows vLLM's serving benchmark: TTFT is the arrival of the first chunk that carries generated
text, ITL the gaps between such chunks. Counting: a TGI stream has one event per token (its text may be
empty while a multi-byte character is incomplete), so the count is exact. An OpenAI stream may leave
out tokens whose text is empty and send their text with a later chunk; with ``logprobs`` requested,
each chunk lists its tokens and the count is exact again, otherwise the number of chunks is a lower
bound. The server's own count (``usage.completion_tokens``, ``details.generated_tokens``) is kept
beside it, so a run can check the two and uses the server's count for throughput, as vLLM does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class Parsed:
    token_times: list[float] = field(default_factory=list)   # arrival time of each chunk with tokens
    tokens: int = 0                                           # tokens those chunks carried
    text: str = ""
    completion_tokens: int | None = None                      # the server's count, where it gave one
    prompt_tokens: int | None = None
    cached_tokens: int | None = None                          # prompt tokens served from the prefix cache
    finish_reason: str | None = None
    error: str | None = None


class Backend:
    name = ""
    path = ""
    needs_model = False

    def __init__(self, *, model: str | None = None, ignore_eos: bool = True, temperature: float = 0.0,
                 path: str | None = None, logprobs: bool = False):
        self.model = model
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        self.logprobs = logprobs
        if path:
            self.path = path

    @property
    def exact_count(self) -> bool:
        """Whether the streamed token count must equal the server's count."""
        return True

    def body(self, prompt: str, max_tokens: int) -> dict:
        raise NotImplementedError

    def parse(self, events: list[tuple[float, bytes]]) -> Parsed:
        out = Parsed()
        for t, data in events:
            try:
                obj = json.loads(data)
            except ValueError:
                out.error = f"undecodable event: {data[:200]!r}"
                break
            if not isinstance(obj, dict):
                continue
            if obj.get("error") is not None:
                err = obj["error"]
                out.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                break
            self._event(obj, t, out)
        return out

    def _event(self, obj: dict, t: float, out: Parsed) -> None:
        raise NotImplementedError


class TGIBackend(Backend):
    """Text Generation Inference's ``POST /generate_stream``: one event per token, the last one with
    ``generated_text`` and ``details``."""
    name = "tgi"
    path = "/generate_stream"

    def body(self, prompt: str, max_tokens: int) -> dict:
        params = {"max_new_tokens": max_tokens, "details": True}
        if self.temperature > 0:
            params.update(do_sample=True, temperature=self.temperature)
        else:
            params["do_sample"] = False
        if self.ignore_eos:
            params["ignore_eos"] = True
        return {"inputs": prompt, "parameters": params, "stream": True}

    def _event(self, obj: dict, t: float, out: Parsed) -> None:
        token = obj.get("token")
        details = obj.get("details")
        if token is not None:
            out.token_times.append(t)
            out.tokens += 1
            if not token.get("special"):
                out.text += token.get("text") or ""
        if details:
            out.finish_reason = details.get("finish_reason")
            if details.get("generated_tokens") is not None:
                out.completion_tokens = int(details["generated_tokens"])
                # A server that already sent its last token may close with an empty special
                # placeholder that it does not count: that event ends the stream, it is no token.
                if (token is not None and token.get("special") and not token.get("text")
                        and out.tokens == out.completion_tokens + 1):
                    out.token_times.pop()
                    out.tokens -= 1
            for key in ("input_length", "prompt_tokens"):
                if details.get(key) is not None:
                    out.prompt_tokens = int(details[key])
            if details.get("cached_tokens") is not None:
                out.cached_tokens = int(details["cached_tokens"])
            if out.prompt_tokens is None and details.get("prefill"):
                out.prompt_tokens = len(details["prefill"])


class OpenAICompletionsBackend(Backend):
    """OpenAI ``POST /v1/completions`` with ``stream`` and a final usage chunk."""
    name = "openai"
    path = "/v1/completions"
    needs_model = True

    @property
    def exact_count(self) -> bool:
        return self.logprobs

    def body(self, prompt: str, max_tokens: int) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": self.temperature, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True          # vLLM's extra field; this project's server takes it too
        if self.logprobs:
            body["logprobs"] = 1
        return body

    @staticmethod
    def _piece(choice: dict) -> str | None:
        return choice.get("text")

    @staticmethod
    def _logprob_tokens(choice: dict) -> int:
        return len((choice.get("logprobs") or {}).get("tokens") or [])

    def _event(self, obj: dict, t: float, out: Parsed) -> None:
        choices = obj.get("choices") or []
        if choices:
            choice = choices[0]
            piece = self._piece(choice)
            finish = choice.get("finish_reason")
            if self.logprobs:
                n = self._logprob_tokens(choice)
            else:
                # A chunk with text carries a token; so does an empty one while its text is held
                # back, unless it only closes the stream (finish_reason) or announces the role (chat).
                n = 1 if piece or (piece == "" and finish is None) else 0
            if n:
                out.token_times.append(t)
                out.tokens += n
                out.text += piece or ""
            if finish is not None:
                out.finish_reason = finish
        usage = obj.get("usage")
        if usage:
            if usage.get("completion_tokens") is not None:
                out.completion_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                out.prompt_tokens = int(usage["prompt_tokens"])
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is not None:
                out.cached_tokens = int(cached)


class OpenAIChatBackend(OpenAICompletionsBackend):
    """OpenAI ``POST /v1/chat/completions``: the prompt is one user message (the server's chat
    template adds tokens, so the reported prompt length exceeds the target)."""
    name = "openai-chat"
    path = "/v1/chat/completions"

    def body(self, prompt: str, max_tokens: int) -> dict:
        body = super().body(prompt, max_tokens)
        del body["prompt"]
        body["messages"] = [{"role": "user", "content": prompt}]
        if self.logprobs:
            body["logprobs"] = True
        return body

    @staticmethod
    def _logprob_tokens(choice: dict) -> int:
        return len((choice.get("logprobs") or {}).get("content") or [])

    @staticmethod
    def _piece(choice: dict) -> str | None:
        delta = choice.get("delta") or {}
        content = delta.get("content")
        if content == "" and "role" in delta:
            return None
        return content


BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (TGIBackend, OpenAICompletionsBackend, OpenAIChatBackend)}
