"""One request's state inside the engine."""

import enum
import time

from .params import FinishReason, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.seed = seed
        self.output_ids: list[int] = []
        self.length = len(self.prompt_ids)        # prompt and output tokens, kept by append(): read
                                                 # several times per token, a property cost 4x as much
        self.block_table: list[int] = []
        self.num_cached = 0                      # tokens whose K/V are in the cache
        self.block_keys: list[bytes] = []        # prefix-cache keys of its first full blocks
        self.cached_tokens: int | None = None    # prompt tokens found in the prefix cache when first scheduled
        self.pending = 0                         # tokens sampled on the device, not yet read back
        self.status = Status.WAITING
        self.finish_reason: FinishReason | None = None
        self.arrival = time.monotonic()
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.preemptions = 0
        self.penalty_row = -1                    # its row of the runner's PenaltyState, if it has one
        # while its prompt is first prefilled, if asked: the prompt tokens' log-probabilities so far
        self.prompt_logprobs: list | None = [] if params.prompt_logprobs is not None else None
        self.followers: list["Sequence"] = []   # choices of the same prompt waiting for its prefill

    def append(self, token: int) -> None:
        self.output_ids.append(token)
        self.length += 1

    @property
    def total_len(self) -> int:
        """Tokens including the one still in flight: the next decode step's length."""
        return self.length + self.pending

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.length - self.num_cached

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def runs_out(self, max_model_len: int) -> bool:
        """Whether the token in flight is its last one (by max_new_tokens or the context)."""
        generated = len(self.output_ids) + self.pending
        return generated >= self.params.max_new_tokens or self.total_len >= max_model_len
