"""What a router reads of a replica when it registers it: GET /server_info and GET /model_info.

The SGLang Model Gateway (``sglang-router``) asks each worker for these two SGLang routes and names
the worker's model after ``served_model_name``; without them every worker is filed under the model
``unknown``, which is what the gateway's own /v1/models then lists. Only the fields it reads, with
this server's meaning, are answered. ``model_path`` and ``tokenizer_path`` are left out on purpose:
given either, the gateway tries to load a tokenizer from that path (a Hugging Face hub name to it),
which an HTTP router never needs and which ``default`` or ``random:tiny`` cannot satisfy.
"""

from fastapi import APIRouter, Depends
from pydantic import BaseModel

from .routes_openai import ERRORS
from .routes_tgi import server_version
from .services import ready_engine

router = APIRouter(tags=["Routers"])


class ServerInfo(BaseModel):
    served_model_name: str
    max_total_tokens: int       # tokens the KV cache holds
    context_length: int         # longest sequence, prompt and generated tokens together
    page_size: int              # KV cache block size in tokens
    version: str


class ModelInfo(BaseModel):
    served_model_name: str
    is_generation: bool = True


@router.get("/server_info", response_model=ServerInfo, responses=ERRORS,
            summary="The served model's name and the KV cache's size, for a router registering this replica")
async def server_info(engine=Depends(ready_engine)):
    info = engine.info
    return ServerInfo(served_model_name=info.model_name, max_total_tokens=info.kv_tokens,
                      context_length=info.max_model_len, page_size=info.block_size, version=server_version())


@router.get("/model_info", response_model=ModelInfo, responses=ERRORS,
            summary="What the served model is, for a router registering this replica")
async def model_info(engine=Depends(ready_engine)):
    return ModelInfo(served_model_name=engine.model_name)
