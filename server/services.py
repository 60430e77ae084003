"""What the routes reach through ``request.app.state.services``: engine, settings, metrics."""

import asyncio
import time
from collections.abc import Callable
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


CATCH_UP_S = 60.0


@dataclass
class Services:
    settings: Settings
    slot: EngineSlot
    metrics: Metrics
    started: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False                   # shutting down: admit nothing new (server/shutdown.py)
    generations: set = field(default_factory=set)   # admitted and not yet closed (generation.py)
    # With several API workers: whether the shared core has loaded its model. A worker hears it
    # through its own pipe, up to seconds after another worker has (the worker may still be starting).
    core_loaded: Callable[[], bool] = lambda: False

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

    async def settled_health(self, catch_up_s: float = CATCH_UP_S) -> tuple[bool, str, str | None]:
        """``health()``, except that a worker whose shared core has loaded the model waits (up to
        ``catch_up_s``) to hear so rather than answer "loading": a client that got 200 from one
        worker must not get "still loading" from the next."""
        health = self.health()
        if health[1] != "loading":
            return health
        deadline = time.monotonic() + catch_up_s
        while health[1] == "loading" and self.core_loaded() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            health = self.health()
        return health


# The two dependencies are coroutines (ready_engine waits only while a worker catches up with its
# shared core): FastAPI runs a plain function dependency in its thread pool, a hop there and back
# on every request.

async def get_services(request: Request) -> Services:
    return request.app.state.services


async def ready_engine(request: Request):
    """The engine, or 503 with Retry-After while it is loading or shutting down, 503 after it failed."""
    services: Services = request.app.state.services
    healthy, status, _ = await services.settled_health()
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
