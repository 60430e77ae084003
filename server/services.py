"""What the routes reach through ``request.app.state.services``: engine, settings, metrics."""

import time
from dataclasses import dataclass, field

from fastapi import Request

from .http_errors import ApiError
from .metrics import Metrics
from .settings import Settings


@dataclass
class EngineSlot:
    """Holds the engine once it is loaded; ``load_error`` is set if loading failed."""
    engine: object | None = None
    load_error: str | None = None

    def get(self):
        return self.engine


@dataclass
class Services:
    settings: Settings
    slot: EngineSlot
    metrics: Metrics
    started: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False                   # shutting down: admit nothing new (server/shutdown.py)
    generations: set = field(default_factory=set)   # admitted and not yet closed (generation.py)

    def health(self) -> tuple[bool, str, str | None]:
        """(healthy, status, error message)."""
        if self.draining:
            return False, "draining", None
        if self.slot.load_error is not None:
            return False, "error", self.slot.load_error
        engine = self.slot.engine
        if engine is None:
            return False, "loading", None
        if engine.error is not None:
            return False, "error", engine.error
        if not engine.ready:
            return False, "loading", None
        return True, "ok", None


# The two dependencies are coroutines although nothing in them waits: FastAPI runs a plain function
# dependency in its thread pool, a hop there and back on every request.

async def get_services(request: Request) -> Services:
    return request.app.state.services


async def ready_engine(request: Request):
    """The engine, or 503 with Retry-After while it is loading or shutting down, 503 after it failed."""
    services: Services = request.app.state.services
    healthy, status, _ = services.health()
    if not healthy:
        if status == "draining":
            raise shutting_down()
        if status == "loading":
            raise ApiError(503, "the model is still loading", headers={"Retry-After": "5"})
        raise ApiError(503, "the engine has failed; see /health")
    return services.slot.engine


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on another replica",
                    headers={"Retry-After": "5"})
