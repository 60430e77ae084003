"""What a request asks of the engine, and what the engine streams back."""

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["length", "stop", "eos", "abort", "error"]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0            # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                      # 0 means no top-k cut
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False   # the text ends after the stop string instead of before it
    logprobs: bool = False              # the sampled token's log-probability (raw: before penalties and temperature)
    top_logprobs: int = 0               # with logprobs: also the this many likeliest tokens and theirs
    prompt_logprobs: int | None = None  # the prompt tokens' log-probabilities, with this many likeliest at each
    presence_penalty: float = 0.0       # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0      # subtracted once per time a token was generated so far
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit)
    ignore_eos: bool = False
    min_tokens: int = 0                 # EOS, stop_token_ids and stop strings do not end the request before this many
    stop_token_ids: frozenset[int] = frozenset()   # these end the request ("stop"), as EOS does
    # prefix-cache blocks are shared only among requests with the same salt; a secret, kept out of reprs
    cache_salt: str | None = field(default=None, repr=False)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def penalised(self) -> bool:
        """Whether a presence or frequency penalty or a logit bias changes the logits (each such
        request holds a row of ``penalties.PenaltyState``)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def logprobs_asked(self) -> int:
        """-1: none; else how many likeliest tokens to report beside the sampled one."""
        return self.top_logprobs if self.logprobs else -1


@dataclass(slots=True)
class TokenEvent:
    """One generated token. ``text`` is the newly printable text (may be empty while a
    multi-byte character is incomplete, or while a stop sequence might still match); the core
    leaves it empty and the front end fills it in (``output.py``). Not frozen: one is made per
    token, and a frozen dataclass costs five times as much to build."""
    token_id: int
    text: str
    logprob: float | None = None
    special: bool = False
    time: float = 0.0                   # time.monotonic() when the engine produced it
    last: bool = False                  # the request's FinishEvent is queued right behind it
    cached_tokens: int | None = None    # on a request's first token: its prompt tokens found in the prefix cache
    top_logprobs: list[tuple[int, float]] | None = None    # the likeliest tokens (id, log-probability), best first
    # on a request's first token, if asked: per prompt position after the first, (log-probability of the
    # prompt's token there, its rank, [(id, log-probability) of the likeliest tokens])
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None


@dataclass(frozen=True)
class FinishEvent:
    reason: FinishReason
    text: str                           # the whole generated text, stop sequence excluded
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    timings: dict = field(default_factory=dict)   # seconds: queued, first_token, total
    cached_tokens: int = 0              # prompt tokens whose KV came from the prefix cache
