"""The HTTP server with a synthetic engine core: what the API processes cost, without a model.

The core process is replaced by one that answers every request with a token per step at a fixed
step period (``--step-ms``), its first token one step after arrival, the prompt ignored; the
rest is the real server (its API workers, the pipes, the detokenizer, SSE). Loaded by the load
generator, the times it measures are the HTTP layer's own: a host without a GPU can measure the
way in, the hand-over to the core and the delivery of tokens as a GPU host's engine would drive
them.

    python -m load_tests.synthetic_core --step-ms 1 [server flags: --port, --api-workers, ...]
    python -m load_tests.loadgen --base-url http://127.0.0.1:8000 --concurrency 16 ...
"""

import logging
import logging.config
import os
import random
import signal
import sys
import time

from server.engine import process
from server.engine.core import EngineStats, ModelInfo, drain_inbox
from server.engine.params import FinishEvent, TokenEvent

STEP_MS_ENV = "SYNTHETIC_STEP_MS"
FIRST_TOKEN_ID, LAST_TOKEN_ID = 1000, 20000     # ordinary text tokens of SmolLM2's vocabulary
CONTEXT = 1 << 20
VOCAB = 1 << 31                                  # the prompt is ignored: any id will do


class _Request:
    def __init__(self, prompt_tokens: int, max_new_tokens: int, now: float):
        self.prompt_tokens, self.max_new_tokens, self.arrival = prompt_tokens, max_new_tokens, now
        self.made = 0
        self.first_token: float | None = None


def synthetic_core_main(model, dtype, device, config, request_readers, outboxes, log_config, loaded_flag=None):
    """Stands in for ``server.engine.process.core_main``: same arguments, same messages."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log_config is not None:
        logging.config.dictConfig(log_config)
    step_s = float(os.environ.get(STEP_MS_ENV, "1")) / 1e3
    router = process._Router(outboxes)
    inbox = process.RequestInbox(request_readers)
    if loaded_flag is not None:
        loaded_flag.set()
    router.broadcast(("ready", ModelInfo(model, CONTEXT, CONTEXT, config.block_size, CONTEXT // config.block_size,
                                         VOCAB)))
    running: dict[str, _Request] = {}
    rng = random.Random(0)
    next_step = time.monotonic()
    while True:
        messages = drain_inbox(inbox, block=not running)
        now = time.monotonic()
        events = []
        for kind, payload in messages:
            if kind == "stop":
                router.broadcast(("stopped",))
                return
            if kind == "add":
                request_id, prompt_ids, params = payload[:3]
                running[request_id] = _Request(len(prompt_ids), params.max_new_tokens, now)
            elif kind == "abort" and payload in running:
                events.append((payload, _finish(running.pop(payload), "abort", now)))
        if not running:
            if events:
                router(events, _stats(running))
            next_step = time.monotonic()
            continue
        next_step = max(next_step + step_s, now)
        time.sleep(max(0.0, next_step - time.monotonic()))
        now = time.monotonic()
        for request_id, request in list(running.items()):
            first = request.first_token is None
            if first:
                request.first_token = now
            request.made += 1
            last = request.made == request.max_new_tokens
            events.append((request_id, TokenEvent(rng.randrange(FIRST_TOKEN_ID, LAST_TOKEN_ID), "", None, False, now,
                                                  last, 0 if first else None)))
            if last:
                events.append((request_id, _finish(running.pop(request_id), "length", now)))
        router(events, _stats(running))


def _finish(request: _Request, reason: str, now: float) -> FinishEvent:
    timings = {"queue": 0.0, "ttft": (request.first_token - request.arrival) if request.first_token else None,
               "total": now - request.arrival}
    return FinishEvent(reason, "", request.prompt_tokens, request.made, None, timings, 0)


def _stats(running) -> EngineStats:
    return EngineStats(len(running), 0, CONTEXT // 128, 0, 0)


def main(argv: list[str]) -> int:
    """``--step-ms MS`` (default 1), then the server's own flags."""
    if argv[:1] == ["--step-ms"]:
        os.environ[STEP_MS_ENV] = argv[1]
        argv = argv[2:]
    process.core_main = synthetic_core_main
    from server.cli import main as serve
    return serve(["--model", "random:smollm2-135m", "--device", "cpu", *argv])


if __name__ == "__main__":
    logging.basicConfig()
    sys.exit(main(sys.argv[1:]))
