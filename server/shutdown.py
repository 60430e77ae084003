"""Graceful drain on SIGTERM / SIGINT.

The first signal starts a drain while the server keeps listening: new requests answer 503 with
Retry-After and /health answers 503, so a load balancer stops routing here; running requests
may finish for up to ``shutdown_timeout`` seconds; the server then ends those still running
(their streams get a proper last event) and uvicorn shuts down with nothing left to cut off.
The process exits 0. A second SIGINT (Ctrl-C twice) cuts the wait short: the requests still
running are ended at once, with their last events, and the server exits as after a timeout.

A signal may reach the server's parent process alone (``kill PID``) or every process of it
(``kill -- -PGID``, a terminal's Ctrl-C, systemd's control-group stop, a container runtime): the
engine process ignores SIGINT and SIGTERM (``server.engine.process``), so either way the drain
above is what happens. With several API workers the parent passes the first signal on as SIGTERM
and a second SIGINT as ``HURRY_SIGNAL``, which drains and hurries in one: a worker handed both at
once runs the lower-numbered signal's handler first, so a forwarded SIGINT could pass for the first.
"""

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from types import FrameType

import uvicorn

from .services import Services

log = logging.getLogger("server.shutdown")

HURRY_SIGNAL = signal.SIGUSR1
FINAL_EVENTS_S = 5.0      # after ending the requests: time for their last events to be written
IDLE_ENGINE_S = 2.0       # time for the engine to report its KV blocks free
DRAIN_REPORT_S = 5.0      # while draining, how often the log says what is left


def _count(requests: int) -> str:
    return f"{requests} request{'' if requests == 1 else 's'}"


async def drain(services: Services, timeout: float, hurry: Callable[[], bool] = lambda: False,
                report_every: float = DRAIN_REPORT_S) -> None:
    """Stops admitting, waits up to ``timeout`` s for the running requests (saying every
    ``report_every`` s how many and for how long still; less once ``hurry()`` is true), then ends
    the rest."""
    services.draining = True
    running = services.generations
    if running:
        log.info(f"draining: new requests get 503; {_count(len(running))} running may finish for up to "
                 f"{timeout:g} s (--shutdown-timeout), then the server ends "
                 f"{'it' if len(running) == 1 else 'them'}",
                 extra={"fields": {"running_requests": len(running), "shutdown_timeout_s": timeout}})
    else:
        log.info("draining: no request running; new requests get 503",
                 extra={"fields": {"running_requests": 0, "shutdown_timeout_s": timeout}})
    deadline = time.monotonic() + timeout
    while running and not hurry() and time.monotonic() < deadline:
        await _until(lambda: not running or hurry(), min(report_every, deadline - time.monotonic()))
        left = deadline - time.monotonic()
        if running and left > 0 and not hurry():
            log.info(f"draining: {_count(len(running))} still running, ended in {left:.0f} s",
                     extra={"fields": {"running_requests": len(running), "seconds_left": round(left, 1)}})
    if running:
        ended = list(running)
        log.warning("shutdown timeout reached: the server ends the requests still running" if not hurry() else
                    "second interrupt: the server ends the requests still running",
                    extra={"fields": {"ended_requests": len(ended),
                                      "request_ids": [g.request_id for g in ended]}})
        for generation in ended:
            generation.end_by_server()
        await _until(lambda: not running, FINAL_EVENTS_S)
    engine = services.slot.engine
    if engine is not None and engine.error is None:
        await _until(lambda: engine.stats().kv_blocks_used == 0 and engine.stats().running == 0,
                     IDLE_ENGINE_S)
    stats = engine.stats() if engine is not None else None
    log.info("drained", extra={"fields": {
        "unfinished_streams": len(running),
        "kv_blocks_used": stats.kv_blocks_used if stats is not None else None}})


async def _until(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


class DrainingServer(uvicorn.Server):
    """uvicorn, with its signal handling replaced: a signal starts ``drain(hurry)`` and uvicorn's
    own shutdown follows it; a SIGINT after the first signal makes ``hurry()`` true. Unlike
    uvicorn's, the process does not re-raise the signal on its way out, so it exits with status 0."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[Callable[[], bool]], Awaitable[None]]):
        super().__init__(config)
        self._drain = drain
        self._drain_signal: int | None = None
        self._drain_task: asyncio.Task | None = None
        self._hurry = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_signal is None:
            self._drain_signal = sig
        elif sig == signal.SIGINT:
            self._hurry = True

    def handle_hurry(self, sig: int, frame: FrameType | None) -> None:
        """``HURRY_SIGNAL`` from the parent of several workers: drain, ending the running requests now."""
        if self._drain_signal is None:
            self._drain_signal = signal.SIGTERM
        self._hurry = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_signal is not None and self._drain_task is None and not self.should_exit:
            name = signal.Signals(self._drain_signal).name
            log.info("received %s%s", name, ": Ctrl-C again stops at once" if self._drain_signal == signal.SIGINT else "")
            self._drain_task = asyncio.create_task(self._drain_then_exit())
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain(lambda: self._hurry)
        except Exception:
            log.exception("draining failed")
        self.should_exit = True
