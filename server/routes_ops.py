"""Operations: GET /health and GET /metrics."""

from typing import Literal

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from .services import Services, get_services

router = APIRouter(tags=["Operations"])


class Health(BaseModel):
    status: Literal["ok", "loading", "draining", "error"]
    model: str | None = None
    error: str | None = None


@router.get("/health", response_model=Health,
            responses={503: {"model": Health, "description": "Loading, draining on shutdown, or the engine failed"}},
            summary="200 when ready to serve; 503 while loading, while draining on shutdown, or after a "
                    "fatal engine error")
async def health(services: Services = Depends(get_services)):
    return await _health(services)


@router.head("/health", include_in_schema=False)
async def health_head(services: Services = Depends(get_services)):
    """The same status for probes that send HEAD (the server sends no body)."""
    return await _health(services)


async def _health(services: Services) -> JSONResponse:
    healthy, status, error = await services.settled_health()
    engine = services.slot.engine
    body = Health(status=status, model=engine.model_name if engine is not None else None,
                  error=error.splitlines()[0][:300] if error else None)
    return JSONResponse(body.model_dump(exclude_none=True), status_code=200 if healthy else 503)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
            summary="Prometheus metrics")
async def metrics(services: Services = Depends(get_services)) -> Response:
    return Response(services.metrics.render(), media_type=CONTENT_TYPE_LATEST)
