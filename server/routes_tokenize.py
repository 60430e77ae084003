"""POST /tokenize (vLLM's body and answer, or TGI's when the body has ``inputs``) and POST /detokenize
(vLLM's)."""

from typing import Annotated

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field, model_validator
from starlette.concurrency import run_in_threadpool

from .generation import check_token_ids, encode_chat, encode_ids
from .http_errors import ApiError
from .schemas import ErrorResponse, NonEmptyText, Strict, Text, chat_template_messages
from .schemas_openai import OpenAIChatMessage
from .services import Services, get_services, ready_engine

router = APIRouter(tags=["Tokenizer"])
ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 422, 503)}
TokenId = Annotated[int, Field(ge=0)]


class TokenizeRequest(Strict):
    model: Text | None = Field(None, description="Optional; the served model's id if given.")
    prompt: Text | None = Field(None, description="Text to tokenize (vLLM). Give this, `messages` or `inputs`.")
    messages: list[OpenAIChatMessage] | None = Field(None, min_length=1, description=(
        "A chat, rendered with the model's chat template and tokenized (vLLM)."))
    add_generation_prompt: bool = Field(True, description="With messages: end with the assistant's turn opening.")
    add_special_tokens: bool | None = Field(None, description=(
        "Add the tokenizer's special tokens (BOS): default true for a prompt, false for messages, whose "
        "template writes its own."))
    return_token_strs: bool = Field(False, description="Also return each token's vocabulary entry (vLLM).")
    inputs: NonEmptyText | None = Field(None, description="TGI's form: text to tokenize; the answer is TGI's "
                                                          "list of tokens with character offsets.")

    @model_validator(mode="after")
    def _one_input(self):
        given = [name for name in ("prompt", "messages", "inputs") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of `prompt`, `messages` or `inputs`, not {given or 'none'}")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class TgiToken(BaseModel):
    id: int
    text: str
    start: int
    stop: int


class DetokenizeRequest(Strict):
    model: Text | None = None
    tokens: list[TokenId] = Field(description="Token ids to turn back into text.")


class DetokenizeResponse(BaseModel):
    prompt: str


def check_model_name(name: str | None, engine, services: Services) -> None:
    if name is not None and name not in {engine.model_name, services.settings.model}:
        raise ApiError(404, f"the model `{name}` does not exist; this server serves `{engine.model_name}`",
                       param="model")


def _tgi_tokens(tokenizer, text: str) -> list[dict]:
    encoded = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    return [{"id": i, "text": text[a:b], "start": a, "stop": b}
            for i, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"])]


@router.post("/tokenize", response_model=TokenizeResponse | list[TgiToken], responses=ERRORS,
             summary="Tokenize a prompt or a chat (vLLM), or `inputs` (TGI)")
async def tokenize(body: TokenizeRequest, engine=Depends(ready_engine), services: Services = Depends(get_services)):
    check_model_name(body.model, engine, services)
    tokenizer = engine.tokenizer
    if body.inputs is not None:
        return await run_in_threadpool(_tgi_tokens, tokenizer, body.inputs)
    if body.messages is not None:
        messages = chat_template_messages(body.messages)
        if not body.add_generation_prompt or body.add_special_tokens:
            text = await run_in_threadpool(tokenizer.apply_chat_template, messages, tokenize=False,
                                           add_generation_prompt=body.add_generation_prompt)
            ids = await encode_ids(engine, text, bool(body.add_special_tokens))
        else:
            ids = (await encode_chat(engine, messages)).ids
    else:
        ids = await encode_ids(engine, body.prompt, True if body.add_special_tokens is None else body.add_special_tokens)
    answer = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": list(ids), "token_strs": None}
    if body.return_token_strs:
        answer["token_strs"] = tokenizer.convert_ids_to_tokens(list(ids))
    return answer


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS,
             summary="Token ids back to text (vLLM)")
async def detokenize(body: DetokenizeRequest, engine=Depends(ready_engine),
                     services: Services = Depends(get_services)):
    check_model_name(body.model, engine, services)
    check_token_ids(body.tokens, len(engine.tokenizer), param="tokens")
    return {"prompt": await run_in_threadpool(engine.tokenizer.decode, body.tokens)}

