"""Request and response bodies shared by both APIs, and those of the TGI-style API.

On the TGI routes unknown fields are refused (422 naming them) so that a misspelt option never
silently does nothing (the OpenAI routes ignore and log them instead, as vLLM does:
``schemas_openai.py``); fields TGI clients send with neutral values (``null``, ``false``) are accepted and
only refused when they ask for something this server does not do.
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator


def _encodable(value: str) -> str:
    """JSON may carry lone surrogates (\\ud800) that no tokenizer can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode (lone surrogate at position {exc.start})") from None
    return value


def _integral(value: Any) -> Any:
    """JSON Schema's integers include 10.0; strings and booleans stay refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Text = Annotated[str, AfterValidator(_encodable)]
def integer(**bounds) -> Any:
    """An integer field's type, its bounds (ge, lt, ...) in the document."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]
# JSON's NaN and Infinity (Python's parser takes them) are refused before any bound is checked, so
# that the message says what is wrong with them ("Input should be a finite number").
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
StopSequence = Annotated[Text, Field(min_length=1, max_length=256)]
NonEmptyText = Annotated[Text, Field(min_length=1)]
MAX_STOP_SEQUENCES = 16


# Types are strict, as OpenAI's and vLLM's are: "10" or true is no integer, "yes" no boolean (an
# integer is still a number).
class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Lenient(BaseModel):
    """Unknown fields are kept aside (``model_extra``), ignored and logged (``ignored_fields``):
    clients written for other servers send extensions of their own."""
    model_config = ConfigDict(extra="allow", strict=True)


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields a ``Lenient`` model (and those inside it) did not know."""
    names = [prefix + name for name in (model.model_extra or {})]
    for name in type(model).model_fields:
        for i, value in _items(getattr(model, name)):
            if isinstance(value, BaseModel):
                names += ignored_fields(value, f"{prefix}{name}{i}.")
    return names


def _items(value):
    if isinstance(value, list):
        return [(f".{i}", v) for i, v in enumerate(value)]
    return [("", value)]


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


def chat_template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the tokenizer's chat template wants them ('developer' is OpenAI's new 'system')."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in messages]


def require_neutral(value: Any, neutral: tuple, what: str) -> Any:
    if value not in neutral:
        raise ValueError(f"{what} is not supported by this server")
    return value


def only(*values, description: str, default=None):
    """A field accepted only with one of ``values`` (the neutral values other servers' clients
    send), so declared in the OpenAPI document; its validator names what is not supported."""
    return Field(default, description=description, json_schema_extra={"enum": list(values)})


class ErrorResponse(BaseModel):
    error: str
    error_type: str


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class OpenAIErrorResponse(BaseModel):
    error: OpenAIErrorDetail


# ---------------------------------------------------------------- TGI


class GenerateParameters(Strict):
    max_new_tokens: integer(ge=1) | None = Field(
        None, description="Tokens to generate at most; default: the server's default, "
                                "capped by what the context length leaves after the prompt.")
    do_sample: bool | None = Field(
        None, description="false: greedy decoding whatever the temperature. true: sample. "
                          "Omitted: sample only if temperature, top_k or top_p ask for it.")
    temperature: FiniteFloat | None = Field(None, ge=0.0, le=100.0,
                                      description="Sampling temperature; 0 means greedy.")
    top_p: FiniteFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: integer(ge=0) | None = Field(None, description="0 turns the top-k cut off.")
    repetition_penalty: FiniteFloat | None = Field(None, ge=0.01, le=10.0)
    seed: integer(ge=0, lt=2**63) | None = Field(None)
    stop: list[StopSequence] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES,
                                     description="Generation stops at any of these strings; the text ends "
                                                 "with it, as TGI's does.")
    details: bool = Field(False, description="Add finish reason, token count, seed and tokens.")
    return_full_text: bool | None = Field(False, description="Prepend the prompt to generated_text.")
    truncate: integer(ge=1) | None = Field(None, description="Keep only the last `truncate` prompt tokens.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    # Sent by TGI clients; only their neutral values are accepted.
    best_of: integer() | None = only(1, None, description="Only 1 (or null) is supported.")
    typical_p: FiniteFloat | None = only(None, description="Not supported; null only.")
    watermark: bool = only(False, default=False, description="Not supported; false only.")
    decoder_input_details: bool = Field(False, description="With details: the prompt's tokens with their "
                                                           "log-probabilities in details.prefill.")
    top_n_tokens: integer() | None = Field(None, description="With details (or streamed): this many likeliest "
                                                             "tokens at each position in top_tokens, 0..20 (--max-logprobs).")
    frequency_penalty: FiniteFloat | None = Field(None, ge=-2.0, le=2.0, description=(
        "Subtracted from a token's logit once per time it was generated so far (OpenAI's definition)."))
    grammar: None = Field(None, description="Not supported; null only.")
    adapter_id: None = Field(None, description="Not supported; null only.")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        return require_neutral(v, (None, 1), "best_of other than 1")

    @field_validator("typical_p")
    @classmethod
    def _typical_p(cls, v):
        return require_neutral(v, (None,), "typical_p")

    @field_validator("watermark")
    @classmethod
    def _watermark(cls, v):
        return require_neutral(v, (False,), "watermark")

    @field_validator("top_n_tokens")
    @classmethod
    def _top_n_tokens(cls, v):
        if v is not None and not 0 <= v <= 20:
            raise ValueError(f"top_n_tokens {v} is outside 0..20")
        return v

    def wants_sampling(self) -> bool:
        if self.do_sample is not None:
            return self.do_sample
        return ((self.temperature is not None and self.temperature not in (0.0, 1.0))
                or bool(self.top_k) or (self.top_p is not None and self.top_p < 1.0))


# `inputs` or `messages`, not both, as the document says it (the validator names the fields).
_ONE_PROMPT = {"oneOf": [
    {"required": ["inputs"], "properties": {"inputs": {"type": "string"}, "messages": {"type": "null"}}},
    {"required": ["messages"], "properties": {"messages": {"type": "array"}, "inputs": {"type": "null"}}}]}


class GenerateRequest(Strict):
    model_config = ConfigDict(json_schema_extra=_ONE_PROMPT)

    inputs: NonEmptyText | None = Field(None, description="The prompt. Give this or `messages`.")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="A chat, rendered with the model's chat template. "
                                        "Give this or `inputs`.")
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = Field(False, description="Answer text/event-stream, one event per token.")

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.inputs is None) == (self.messages is None):
            raise ValueError("give exactly one of `inputs` or `messages`")
        return self


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(BaseModel):
    id: int
    text: str
    logprob: float | None


class Details(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence", "abort", "error"]
    generated_tokens: int
    seed: int | None
    cached_tokens: int = Field(0, description="Prompt tokens whose KV came from the prefix cache.")
    prefill: list[PrefillToken] = Field([], description="With decoder_input_details: the prompt's tokens.")
    tokens: list[Token]
    top_tokens: list[list[Token]] | None = Field(None, description="With top_n_tokens: per generated token, "
                                                                   "the likeliest ones.")


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None


class StreamDetails(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence", "abort", "error"]
    generated_tokens: int
    seed: int | None
    input_length: int
    cached_tokens: int = Field(0, description="Prompt tokens whose KV came from the prefix cache.")


class StreamResponse(BaseModel):
    """One `data:` event of /generate_stream; the last carries generated_text and details."""
    index: int
    token: Token
    generated_text: str | None = None
    details: StreamDetails | None = None
    top_tokens: list[Token] | None = None


class Info(BaseModel):
    model_id: str
    max_input_tokens: int
    max_total_tokens: int
    max_stop_sequences: int
    version: str
