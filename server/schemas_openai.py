"""Bodies of the OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models).

Requests accept vLLM's extension fields (min_tokens, ignore_eos, top_k, repetition_penalty,
skip_special_tokens, stop_token_ids, cache_salt, stream_options.continuous_usage_stats) and ignore fields
they do not know, as vLLM does (the route logs them): load generators and clients written for
vLLM send such fields. A known field with a value this server cannot honour is still refused.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from .schemas import (MAX_STOP_SEQUENCES, ChatMessage, FiniteFloat, Lenient, NonEmptyText, StopSequence, Strict,
                      Text, integer, only, require_neutral)

TokenId = integer(ge=0)
MAX_STOP_TOKEN_IDS = 64
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# What CompletionRequest._one_prompt accepts, for the document: one non-empty prompt, not a batch.
ONE_PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
    _TOKEN_IDS,
    {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": 1}]}


class StreamOptions(Lenient):
    include_usage: bool = Field(False, description="Send a last chunk with token usage before [DONE].")
    continuous_usage_stats: bool = Field(
        False, description="With include_usage: every chunk carries the usage so far (vLLM's extension).")


class SamplingFields(Lenient):
    model: Text = Field(description="The id listed by GET /v1/models.")
    temperature: FiniteFloat | None = Field(None, ge=0.0, le=2.0, description="0 means greedy; default 1.")
    top_p: FiniteFloat | None = Field(None, gt=0.0, le=1.0)
    n: integer() | None = only(1, None, description="Only 1 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopSequence | Annotated[list[StopSequence], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: integer(ge=0, lt=2**63) | None = Field(None)
    presence_penalty: FiniteFloat | None = only(0, None, description="Only 0 is supported.")
    frequency_penalty: FiniteFloat | None = only(0, None, description="Only 0 is supported; see repetition_penalty.")
    logit_bias: dict[str, float] | None = Field(None, description="Only an empty map is supported.",
                                                json_schema_extra={"maxProperties": 0})
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
        return require_neutral(v, (None, 1), "n other than 1")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalties(cls, v):
        return require_neutral(v, (None, 0, 0.0), "a non-zero presence/frequency penalty")

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by this server")
        return v

    def stop_tuple(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Usage on every chunk: vLLM sends it only when include_usage is set too."""
        return self.include_usage() and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]] = Field(
        description="One prompt: a string or a list of token ids (a one-element list of either "
                    "is accepted too).", json_schema_extra=lambda schema: schema.update(ONE_PROMPT_SCHEMA))
    max_tokens: integer(ge=1) | None = Field(None, description="Default 16, as OpenAI's.")
    echo: bool = Field(False, description="Prepend the prompt to the returned text.")
    logprobs: integer(ge=0, le=5) | None = Field(None, description=(
        "Return the log probability of each generated token. Only the sampled token is "
        "reported in top_logprobs, whatever the number asked for."))
    best_of: integer() | None = only(1, None, description="Only 1 is supported.")
    suffix: None = Field(None, description="Not supported; null only.")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, str):
            if not v:
                raise ValueError("the prompt is empty")
            return v
        if not v:
            raise ValueError("the prompt is empty")
        if isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            if not v[0]:
                raise ValueError("the prompt is empty")
            return v[0]
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        return require_neutral(v, (None, 1), "best_of other than 1")


class ResponseFormat(Strict):
    type: Literal["text"] = Field(description="Only plain text is supported.")


class OpenAIChatMessage(ChatMessage, Lenient):
    """A chat message; fields the template does not use (tool_calls: [], say) are ignored."""


class ChatCompletionRequest(SamplingFields):
    messages: list[OpenAIChatMessage] = Field(min_length=1)
    max_tokens: integer(ge=1) | None = Field(None, description="Deprecated OpenAI name of "
                                                           "max_completion_tokens.")
    max_completion_tokens: integer(ge=1) | None = Field(None)
    logprobs: bool = False
    top_logprobs: integer() | None = only(0, None, description="Only 0 is supported.")
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = Field(None, description="Not supported; null or [] only.",
                                    json_schema_extra={"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]})
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = Field(None, description="Accepted and ignored.")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v):
        return require_neutral(v, (None, 0), "top_logprobs above 0")

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        if v:
            raise ValueError("tools are not supported by this server")
        return v

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
    top_logprobs: list[dict[str, float | None]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[Any] = []


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = Field(
        description="Set on the last chunk; 'abort': the server ended the request while shutting down.")


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed /v1/chat/completions; a final `data: [DONE]` follows."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="As in CompletionChunk.")
