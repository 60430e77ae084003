"""Bodies of the OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models).

Requests accept vLLM's extension fields (min_tokens, ignore_eos, top_k, repetition_penalty,
skip_special_tokens, stop_token_ids, cache_salt, stream_options.continuous_usage_stats) and ignore fields
they do not know, as vLLM does (the route logs them): load generators and clients written for
vLLM send such fields. A known field with a value this server cannot honour is still refused.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from .schemas import (MAX_STOP_SEQUENCES, ChatMessage, FiniteFloat, Lenient, NonEmptyText, StopSequence, Text,
                      TextPart, integer, only)
from .schemas_structured import GuidedFields, ResponseFormat, ToolCall, ToolChoice, ToolDefinition

TokenId = integer(ge=0)
MAX_STOP_TOKEN_IDS = 64
MAX_N = 16                   # choices per prompt
MAX_LOGPROBS = 20            # top log-probabilities per position (vLLM's default --max-logprobs)
MAX_LOGIT_BIAS = 100.0
MAX_TOKEN_ID_DIGITS = 12     # past any vocabulary; int() refuses over 4300
MAX_PROMPTS = 256            # prompts in one /v1/completions request
LOGPROB_BOUNDS = {"minimum": 0, "maximum": MAX_LOGPROBS}


def within(name: str, value: int | None, low: int, high: int) -> int | None:
    """``value`` if None or in low..high; else a ValueError naming the field, the value and the range."""
    if value is not None and not low <= value <= high:
        raise ValueError(f"{name} {value} is outside {low}..{high}")
    return value


def logprob_count(name: str):
    def check(cls, v):
        return within(name, v, 0, MAX_LOGPROBS)
    return field_validator(name)(classmethod(check))

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# What CompletionRequest._prompts accepts, for the document: a non-empty prompt, or a batch of them.
PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_PROMPTS},
    _TOKEN_IDS,
    {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": MAX_PROMPTS}]}


class StreamOptions(Lenient):
    include_usage: bool = Field(False, description="Send a last chunk with token usage before [DONE].")
    continuous_usage_stats: bool = Field(
        False, description="With include_usage: every chunk carries the usage so far (vLLM's extension).")


class SamplingFields(Lenient):
    model: Text = Field(description="The id listed by GET /v1/models.")
    temperature: FiniteFloat | None = Field(None, ge=0.0, le=2.0, description="0 means greedy; default 1.")
    top_p: FiniteFloat | None = Field(None, gt=0.0, le=1.0)
    n: integer() | None = Field(None, description="Choices to generate (default 1); the prompt is "
                                                   "computed once and its cache shared by all of them.",
                                json_schema_extra={"minimum": 1, "maximum": MAX_N})
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopSequence | Annotated[list[StopSequence], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: integer(ge=0, lt=2**63) | None = Field(None)
    presence_penalty: FiniteFloat | None = Field(None, ge=-2.0, le=2.0, description=(
        "Subtracted from the logit of every token generated so far (OpenAI's definition)."))
    frequency_penalty: FiniteFloat | None = Field(None, ge=-2.0, le=2.0, description=(
        "Subtracted from a token's logit once per time it was generated so far."))
    logit_bias: dict[str, FiniteFloat] | None = Field(None, description=(
        "Token id (as a string) -> a bias from -100 to 100 added to its logit before sampling."),
        json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$", "maxLength": MAX_TOKEN_ID_DIGITS},
                           "additionalProperties": {"minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS}})
    user: Text | None = Field(None, description="Accepted and ignored.")
    # Extensions in vLLM's spelling.
    top_k: integer(ge=-1) | None = Field(None, description="0 or -1 turn the top-k cut off.")
    repetition_penalty: FiniteFloat | None = Field(None, ge=0.01, le=10.0)
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    min_tokens: integer(ge=0) = Field(0, description="Neither the end-of-sequence token, stop_token_ids nor stop "
                                                 "strings end the generation before this many tokens.")
    include_stop_str_in_output: bool = Field(False, description="true: the text ends after the stop string "
                                                                 "that ended it, not before.")
    stop_token_ids: list[TokenId] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS, description="Token ids that end the generation (finish_reason "
                                                         "'stop'); the token itself is not in the text.")
    skip_special_tokens: bool = Field(True, description="false: special tokens generated show in the text.")
    cache_salt: NonEmptyText | None = Field(
        None, max_length=1024, description="Prefix-cache blocks are shared only among requests with the same "
                                           "salt (and among those without one): a long random secret per "
                                           "tenant keeps others from timing its prompts.")
    @field_validator("n")
    @classmethod
    def _n(cls, v):
        return within("n", v, 1, MAX_N)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias key {key[:20]!r} is not a token id (a non-negative integer)")
            if len(key) > MAX_TOKEN_ID_DIGITS:
                raise ValueError(f"logit_bias key {key[:20]}... ({len(key)} digits) is not a token id: too large")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias of token {key} is {bias}, outside -{MAX_LOGIT_BIAS:g}.."
                                 f"{MAX_LOGIT_BIAS:g}")
        return v

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items() if b)

    def choices(self) -> int:
        return self.n or 1

    def stop_tuple(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Usage on every chunk: vLLM sends it only when include_usage is set too."""
        return self.include_usage() and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields, GuidedFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]] = Field(
        description=f"A string, a list of token ids, or a list of up to {MAX_PROMPTS} of either: one "
                    "choice per prompt (times n), indexed prompt by prompt.",
        json_schema_extra=lambda schema: schema.update(PROMPT_SCHEMA))
    max_tokens: integer(ge=0) | None = Field(None, description="Default 16, as OpenAI's; 0 generates nothing "
                                                           "(with echo: the prompt and its log-probabilities).")
    echo: bool = Field(False, description="Prepend the prompt to the returned text (and, with logprobs, its "
                                          "tokens' log-probabilities, the first null).")
    logprobs: integer() | None = Field(None, json_schema_extra=LOGPROB_BOUNDS, description=(
        "The log-probability of each token and of this many likeliest tokens at each position, from the "
        "model's distribution (before temperature, penalties and bias). Capped by the server's "
        "--max-logprobs."))
    prompt_logprobs: integer() | None = Field(None, json_schema_extra=LOGPROB_BOUNDS, description=(
        "vLLM's extension: the prompt tokens' log-probabilities, with this many likeliest at each position."))
    best_of: integer() | None = only(1, None, description="Only 1: vLLM V1 dropped best_of; ask for n choices and "
                                                  "pick by their logprobs instead.")
    suffix: None = Field(None, description="Not supported; null only.")

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, v):
        prompts = [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else v
        if not prompts:
            raise ValueError("the prompt is empty")
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"{len(prompts)} prompts in one request, over the limit of {MAX_PROMPTS}")
        if any(not p for p in prompts):
            raise ValueError("the prompt is empty")
        return v

    def _one_prompt(self) -> bool:
        return isinstance(self.prompt, str) or isinstance(self.prompt[0], int)

    def prompt_list(self) -> list[str | list[int]]:
        return [self.prompt] if self._one_prompt() else list(self.prompt)

    def prompt_field(self, index: int) -> str:
        """The name of prompt ``index`` in error messages: 'prompt', or 'prompt.1' in a list."""
        return "prompt" if self._one_prompt() else f"prompt.{index}"

    _logprobs = logprob_count("logprobs")
    _prompt_logprobs = logprob_count("prompt_logprobs")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v not in (None, 1):
            raise ValueError(f"best_of {v} is not supported: vLLM V1 dropped best_of too; ask for n={v} "
                             "choices with logprobs and pick among them")
        return v


class OpenAIChatMessage(ChatMessage, Lenient):
    """A chat message; fields the template does not use are ignored. An assistant message may
    carry tool_calls (its content null), a tool message the result of one."""
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None

    def text(self) -> str:
        return "" if self.content is None else super().text()

    def lacks_content(self) -> bool:
        """No content, and not an assistant message with tool_calls (a rule the document cannot
        state: the route answers 400)."""
        return self.content is None and not (self.role == "assistant" and self.tool_calls)


class ChatCompletionRequest(SamplingFields, GuidedFields):
    messages: list[OpenAIChatMessage] = Field(min_length=1)
    max_tokens: integer(ge=1) | None = Field(None, description="Deprecated OpenAI name of "
                                                           "max_completion_tokens.")
    max_completion_tokens: integer(ge=1) | None = Field(None)
    logprobs: bool = False
    top_logprobs: integer() | None = Field(None, json_schema_extra=LOGPROB_BOUNDS, description=(
        "With logprobs: also the this many likeliest tokens at each position, from the model's distribution "
        "(before temperature, penalties and bias). Capped by the server's --max-logprobs."))
    prompt_logprobs: integer() | None = Field(None, json_schema_extra=LOGPROB_BOUNDS, description=(
        "vLLM's extension: the prompt tokens' log-probabilities, with this many likeliest at each position."))
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = Field(None, description="Functions the model may call.")
    tool_choice: ToolChoice | None = Field(None, description="Default 'auto' with tools, 'none' without.")
    parallel_tool_calls: bool | None = Field(None, description="Default true: several calls in one answer.")

    _top_logprobs = logprob_count("top_logprobs")
    _prompt_logprobs = logprob_count("prompt_logprobs")

    def token_limits_differ(self) -> bool:
        """Both limits given, different (a rule the document cannot state: the route answers 400)."""
        return (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens whose KV came from the prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None] | None]
    text_offset: list[int]


PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = Field(None, description=(
        "With prompt_logprobs (vLLM): None, then per prompt position token id -> logprob, rank, decoded_token."))


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int] | None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int] | None
    top_logprobs: list[TopLogprob] = []


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(None, description="With prompt_logprobs, as in completions.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flashdecode"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------- stream events (documentation)


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = Field(
        description="Set on the last chunk; 'abort': the server ended the request while shutting down.")


class CompletionChunk(BaseModel):
    """One `data:` event of a streamed /v1/completions; a final `data: [DONE]` follows."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = Field(None, description="With stream_options.include_usage: null on every chunk "
                                                  "but a last one (empty choices) that counts the tokens; "
                                                  "with continuous_usage_stats too, on every chunk.")


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = Field(None, description="name and arguments (JSON text)")


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Field(None, description="Each call whole, in one delta.")


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "abort"] | None = Field(
        description="Set on the last chunk; 'abort': the server ended the request while shutting down.")


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed /v1/chat/completions; a final `data: [DONE]` follows."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="As in CompletionChunk.")
