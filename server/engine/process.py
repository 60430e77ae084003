"""The engine core in a process of its own.

The server process keeps only the tokenizer and the asyncio streams; the core process owns the
model and the GPU. Requests and aborts go down one queue; each step's events and a state
snapshot come back up another, as one message per step.
"""

import logging
import logging.config
import multiprocessing as mp
import queue
import threading

import transformers

from models import load_model, load_tokenizer

from .config import EngineConfig
from .core import EngineCore
from .engine import EngineFrontend

log = logging.getLogger(__name__)


def _core_main(model: str, dtype: str | None, device: str, config: EngineConfig, inbox, outbox,
               log_config: dict | None):
    if log_config is not None:
        logging.config.dictConfig(log_config)
    transformers.utils.logging.disable_progress_bar()
    try:
        loaded = load_model(model, dtype=dtype, device=device)
        core = EngineCore(loaded, config, lambda pairs, stats: outbox.put(("events", pairs, stats)))
        outbox.put(("ready", core.info))
        core.run(inbox)
        outbox.put(("stopped",))
    except BaseException as exc:                 # tell the server before the process ends
        log.exception("engine core failed")
        outbox.put(("fatal", f"{type(exc).__name__}: {exc}"))


class ProcessEngine(EngineFrontend):
    def __init__(self, model: str, dtype: str | None = None, device: str = "cpu", config: EngineConfig | None = None,
                 log_config: dict | None = None):
        """``log_config``: a ``logging.config.dictConfig`` dict for the core process."""
        super().__init__(config or EngineConfig())
        self.tokenizer = load_tokenizer(model)
        ctx = mp.get_context("spawn")
        self._inbox = ctx.Queue()
        self._outbox = ctx.Queue()
        self._process = ctx.Process(target=_core_main, name="engine-core", daemon=True,
                                    args=(model, dtype, device, self.config, self._inbox, self._outbox,
                                          log_config))
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        """Starts the core process and blocks until its model is loaded and its graphs captured."""
        self._process.start()
        while True:
            try:
                message = self._outbox.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError(f"the engine process exited with code {self._process.exitcode}")
        if message[0] != "ready":
            raise RuntimeError(f"the engine process failed to start: {message[-1]}")
        self.info = message[1]
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()
        self.ready = True

    def _read(self) -> None:
        while True:
            try:
                message = self._outbox.get(timeout=1.0)
            except queue.Empty:
                if self._process.is_alive():
                    continue
                message = ("fatal", f"the engine process exited with code {self._process.exitcode}")
            kind = message[0]
            if kind == "events":
                self._publish(message[1], message[2])
            elif kind == "fatal":
                self.error, self.ready = message[1], False
                self._fail_streams(message[1])
                return
            elif kind == "stopped":
                return

    def shutdown(self) -> None:
        self.ready = False
        if self._process.is_alive():
            self._inbox.put(("stop", None))
            self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=5)
        for q in (self._inbox, self._outbox):
            q.close()
            q.join_thread()

    def _send(self, message) -> None:
        self._inbox.put(message)
