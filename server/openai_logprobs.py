"""Log-probabilities in the OpenAI response shapes (and vLLM's ``prompt_logprobs``).

The engine reports, per token, the raw log-probability of the token and the likeliest tokens as
(id, log-probability) pairs; these name each token by its text (``token_text``). Values that are
not finite (a token the model gives no probability) are written as null.
"""

import math

from .engine.params import TokenEvent
from .token_text import TokenStrings


def finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def visible(tokens: list[TokenEvent]) -> list[TokenEvent]:
    """Tokens OpenAI would list in logprobs (not the end-of-sequence token)."""
    return [t for t in tokens if not (t.special and not t.text)]


def _top_map(own: str, own_value: float | None, top, strings: TokenStrings) -> dict[str, float | None]:
    """The likeliest tokens by text, and the token itself (as vLLM's completions list it)."""
    mapping = {strings.text(i): finite_or_none(v) for i, v in (top or ())}
    mapping.setdefault(own, finite_or_none(own_value))
    return mapping


def completion_logprobs(tokens: list[TokenEvent], offset: int, strings: TokenStrings) -> dict:
    """The generated tokens' ``logprobs`` of a /v1/completions choice, text offsets from ``offset``."""
    tokens = visible(tokens)
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    return {"tokens": [t.text for t in tokens], "token_logprobs": [finite_or_none(t.logprob) for t in tokens],
            "top_logprobs": [_top_map(t.text, t.logprob, t.top_logprobs, strings) for t in tokens],
            "text_offset": offsets}


def echo_logprobs(prompt_ids: list[int], prompt_logprobs, strings: TokenStrings) -> dict:
    """The echoed prompt's part of a /v1/completions choice's ``logprobs``: its first token has none."""
    texts = [strings.text(i) for i in prompt_ids]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    values = [None] + [finite_or_none(v) for v, _, _ in prompt_logprobs]
    tops = [None] + [_top_map(text, v, top, strings)
                     for text, (v, _, top) in zip(texts[1:], prompt_logprobs)]
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def joined(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def _entry(token_id: int, value: float | None, strings: TokenStrings) -> dict:
    return {"token": strings.text(token_id), "logprob": finite_or_none(value), "bytes": strings.bytes(token_id)}


def chat_logprobs(tokens: list[TokenEvent], strings: TokenStrings) -> dict:
    """A chat choice's ``logprobs``: each token with its bytes and its ``top_logprobs`` list."""
    return {"content": [{**_entry(t.token_id, t.logprob, strings),
                         "top_logprobs": [_entry(i, v, strings) for i, v in (t.top_logprobs or ())]}
                        for t in visible(tokens)]}


def vllm_prompt_logprobs(prompt_ids: list[int], prompt_logprobs, strings: TokenStrings) -> list:
    """vLLM's ``prompt_logprobs``: None for the first token, then per position a map from token id
    (as a string) to logprob, rank and decoded_token, of the prompt's token and the likeliest ones."""
    out: list = [None]
    for token_id, (value, rank, top) in zip(prompt_ids[1:], prompt_logprobs):
        position = {str(i): {"logprob": finite_or_none(v), "rank": r + 1, "decoded_token": strings.text(i)}
                    for r, (i, v) in enumerate(top)}
        position.setdefault(str(token_id), {"logprob": finite_or_none(value), "rank": rank,
                                            "decoded_token": strings.text(token_id)})
        out.append(position)
    return out
