"""The FastAPI application factory."""

import logging
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema
from starlette.concurrency import run_in_threadpool

from . import routes_gateway, routes_openai, routes_ops, routes_playground, routes_tgi, routes_tokenize
from .http_errors import install_error_handlers
from .metrics import Metrics
from .middleware import ApiKeyMiddleware, BodyLimitMiddleware, RequestContextMiddleware
from .services import EngineSlot, Services
from .settings import Settings
from .sse import EVENT_MODELS

log = logging.getLogger("server.app")

OPEN_PATHS = frozenset({"/health"}) | routes_playground.PATHS
DOCS_STATIC_URL = "/docs/static"


def create_app(engine=None, settings: Settings | None = None, *,
               loader: Callable[[], object] | None = None,
               on_load_error: Callable[[str], None] | None = None,
               core_loaded: Callable[[], bool] | None = None) -> FastAPI:
    """The app serving ``engine`` (not yet started: the app starts it on startup and shuts it
    down on shutdown). Give ``loader`` instead to build the engine in a background thread
    after startup, so that /health can answer 503 while the model loads; if loading fails,
    /health answers 503 with the error and ``on_load_error(message)`` is called. ``core_loaded``
    says whether a core shared with other workers has loaded its model (``Services.core_loaded``)."""
    if (engine is None) == (loader is None):
        raise ValueError("give exactly one of engine or loader")
    settings = settings or Settings()
    slot = EngineSlot()
    services = Services(settings=settings, slot=slot, metrics=Metrics(slot.get),
                        core_loaded=core_loaded or (lambda: False))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stopping = _Stopping()
        if engine is not None:
            await run_in_threadpool(engine.start)
            slot.engine = engine
        else:
            threading.Thread(target=_load, args=(loader, slot, stopping, on_load_error),
                             name="model-loader", daemon=True).start()
        try:
            yield
        finally:
            with stopping.lock:
                stopping.requested = True
                running = slot.engine
            if running is not None:
                await run_in_threadpool(running.shutdown)

    # /docs and /redoc from the package's own copies of Swagger UI and ReDoc: no CDN, so they work offline
    app = FastAPIOffline(title="flashdecode server", version="0.1.0", lifespan=lifespan,
                         description="LLM text generation with TGI-style and OpenAI-compatible APIs.",
                         static_url=DOCS_STATIC_URL)
    app.state.services = services
    install_error_handlers(app)
    app.include_router(routes_tgi.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_tokenize.router)
    app.include_router(routes_ops.router)
    app.include_router(routes_gateway.router)
    app.include_router(routes_playground.router)

    # Added innermost first: request context, then API key, then the body limit.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.openapi = _openapi(app, bearer=bool(settings.api_key))
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, open_paths=OPEN_PATHS)
    app.add_middleware(RequestContextMiddleware, metrics=services.metrics)
    return app


class _Stopping:
    """Whether the app is shutting down, decided under a lock shared with the loader thread, so
    that a model loaded during shutdown is shut down exactly once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requested = False


def _load(loader: Callable[[], object], slot: EngineSlot, stopping: _Stopping,
          on_load_error: Callable[[str], None] | None) -> None:
    try:
        engine = loader()
        engine.start()
    except Exception as exc:
        log.exception("loading the model failed")
        slot.load_error = f"{type(exc).__name__}: {exc}"
        if on_load_error is not None:
            on_load_error(slot.load_error)
        return
    with stopping.lock:
        if not stopping.requested:
            slot.engine = engine
    if slot.engine is not engine:   # the server shut down while the model was loading
        engine.shutdown()
        return
    log.info("engine ready", extra={"fields": {"model": engine.model_name,
                                               "max_model_len": engine.max_model_len}})


def _openapi(app: FastAPI, bearer: bool) -> Callable[[], dict]:
    """FastAPI's document, with the schemas of the stream events (``sse.event_stream_doc``)
    and, with an API key, the bearer scheme on every path but the open ones."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            _, defs = models_json_schema([(m, "serialization") for m in EVENT_MODELS],
                                         ref_template="#/components/schemas/{model}")
            for name, definition in defs.get("$defs", {}).items():
                components.setdefault(name, definition)
            if bearer:
                schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                for path, operations in schema["paths"].items():
                    if path not in OPEN_PATHS:
                        for operation in operations.values():
                            operation["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema
    return openapi
