"""The engine core in a process of its own.

The server process keeps the tokenizer (it makes the text of the tokens) and the asyncio
streams; the core process owns the model and the GPU. Requests and aborts go down one queue; each
step's events and a state snapshot come back up a pipe, as one message per step.

Several HTTP worker processes can share one core (``python -m server --api-workers N``): they
all send down the one queue, each has a pipe of its own coming back, and a request's events go
to the worker whose number prefixes its id (``"2:..."``).

The core writes to the pipes from its step loop itself. A ``multiprocessing.Queue`` would hand
each message to a feeder thread, and those hand-offs cost the core more than the writes. A worker
that falls more than a pipe's buffer behind holds the core back instead of growing a backlog in
it. Only the core keeps a pipe's writing end open, so its end, however it comes, reaches every
reader at once as end-of-file; a reader waiting on an idle pipe also checks that the core lives.
"""

import cProfile
import fcntl
import logging
import logging.config
import multiprocessing as mp
import os
import signal
import threading
import time

import transformers

from models import load_model, load_tokenizer

from .config import EngineConfig
from .core import EngineCore, freeze_startup_heap
from .engine import EngineFrontend
from .params import TokenEvent

log = logging.getLogger(__name__)

STATS_REFRESH_S = 0.5      # a worker with no events of its own still gets the engine's state this often
PROFILE_ENV = "FLASHDECODE_CORE_PROFILE"   # a path: the core's main thread is profiled (cProfile) into it
CORE_CHECK_S = 1.0                         # how often an idle front end checks that the core is alive
PIPE_BUFFER_BYTES = 1 << 20                # about a hundred B=256 steps of events (Linux's unprivileged maximum)


def event_pipe(ctx):
    """(reader, writer) of a one-way pipe for the core's messages, its buffer enlarged where the
    system allows."""
    reader, writer = ctx.Pipe(duplex=False)
    try:
        fcntl.fcntl(writer.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BUFFER_BYTES)
    except (AttributeError, OSError):
        pass                                       # not Linux, or a lower limit: the default buffer
    return reader, writer


def _pack(pairs) -> list[tuple]:
    """A step's events for the pipe: token events as plain tuples, which pickle and unpickle
    several times faster than the dataclass."""
    return [(rid, e.token_id, e.logprob, e.special, e.time, e.last, e.cached_tokens) if type(e) is TokenEvent
            else (rid, e) for rid, e in pairs]


def _unpack(rows) -> list[tuple[str, object]]:
    return [(r[0], TokenEvent(r[1], "", r[2], r[3], r[4], r[5], r[6])) if len(r) == 7 else r for r in rows]


class _Router:
    """The core's publish callback: each worker gets its requests' events (one message per step)."""

    def __init__(self, outboxes):
        self.outboxes = outboxes
        self._last_sent = [0.0] * len(outboxes)
        self._gone: set[int] = set()

    def __call__(self, pairs, stats) -> None:
        if len(self.outboxes) == 1:
            self._send(0, ("events", _pack(pairs), stats))
            return
        if not pairs:                              # a state change worth telling everyone (idle)
            self.broadcast(("events", [], stats))
            return
        mine: list[list] = [[] for _ in self.outboxes]
        for request_id, event in pairs:
            mine[int(request_id.split(":", 1)[0])].append((request_id, event))
        now = time.monotonic()
        for worker, events in enumerate(mine):
            if events or now - self._last_sent[worker] >= STATS_REFRESH_S:
                self._send(worker, ("events", _pack(events), stats))
                self._last_sent[worker] = now

    def broadcast(self, message) -> None:
        for worker in range(len(self.outboxes)):
            self._send(worker, message)

    def _send(self, worker: int, message) -> None:
        if worker in self._gone:
            return
        try:
            self.outboxes[worker].send(message)
        except OSError:                            # that front end has exited; the others go on
            self._gone.add(worker)
            log.warning("front end %d is gone; its events are dropped", worker)


def core_main(model: str, dtype: str | None, device: str, config: EngineConfig, inbox, outboxes,
              log_config: dict | None):
    """The core process: loads the model, then steps until told to stop."""
    # Ctrl-C reaches the whole process group; the server drains its requests and then stops
    # the core with a message, so the core must not die of the interrupt before that.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log_config is not None:
        logging.config.dictConfig(log_config)
    transformers.utils.logging.disable_progress_bar()
    router = _Router(outboxes)
    try:
        loaded = load_model(model, dtype=dtype, device=device)
        core = EngineCore(loaded, config, router)
        freeze_startup_heap()
        router.broadcast(("ready", core.info))
        _run_profiled(core, inbox, os.environ.get(PROFILE_ENV))
        router.broadcast(("stopped",))
    except BaseException as exc:                 # tell the servers before the process ends
        log.exception("engine core failed")
        router.broadcast(("fatal", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None


def _run_profiled(core: EngineCore, inbox, path: str | None) -> None:
    if not path:
        core.run(inbox)
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        core.run(inbox)
    finally:
        profiler.disable()
        profiler.dump_stats(path)
        log.info("engine core profile written to %s", path)


class EngineChannel:
    """One worker's end of a shared core: the common inbox, the reading end of its own pipe, its
    number, and the core's process id."""

    def __init__(self, inbox, outbox, worker: int, core_pid: int):
        self.inbox, self.outbox, self.worker, self.core_pid = inbox, outbox, worker, core_pid


def start_shared_core(model: str, dtype: str | None, device: str, config: EngineConfig, workers: int,
                      log_config: dict | None = None):
    """Starts a core process for ``workers`` HTTP workers; returns it and one channel per worker.
    The caller hands each channel to its worker process and then closes its own copies of them
    (``EngineChannel.outbox.close()``), so that a worker's exit breaks its pipe."""
    ctx = mp.get_context("spawn")
    inbox = ctx.Queue()
    pipes = [event_pipe(ctx) for _ in range(workers)]
    process = ctx.Process(target=core_main, name="engine-core", daemon=True,
                          args=(model, dtype, device, config, inbox, [w for _, w in pipes], log_config))
    process.start()
    for _, writer in pipes:
        writer.close()
    return process, [EngineChannel(inbox, reader, i, process.pid) for i, (reader, _) in enumerate(pipes)]


def stop_core(process, inbox, timeout: float = 30.0) -> None:
    if process.is_alive():
        inbox.put(("stop", None))
        process.join(timeout=timeout)
    if process.is_alive():
        process.terminate()
        process.join(timeout=5)


class ProcessEngine(EngineFrontend):
    def __init__(self, model: str, dtype: str | None = None, device: str = "cpu", config: EngineConfig | None = None,
                 log_config: dict | None = None, *, channel: EngineChannel | None = None):
        """``log_config``: a ``logging.config.dictConfig`` dict for the core process. With
        ``channel`` this front end joins a core another process started (``start_shared_core``)
        and leaves starting and stopping it to that process."""
        super().__init__(config or EngineConfig(), load_tokenizer(model))
        if channel is None:
            ctx = mp.get_context("spawn")
            self._inbox = ctx.Queue()
            self._outbox, self._writer = event_pipe(ctx)
            self._process = ctx.Process(target=core_main, name="engine-core", daemon=True,
                                        args=(model, dtype, device, self.config, self._inbox, [self._writer],
                                              log_config))
        else:
            self._inbox, self._outbox, self._process = channel.inbox, channel.outbox, None
            self._core_pid = channel.core_pid
            self.id_prefix = f"{channel.worker}:"
        self._reader: threading.Thread | None = None

    def _receive(self):
        """The core's next message, or ("fatal", why) once the core is gone: its pipe ends, or,
        should a child of the core still hold the pipe open, the core is seen gone while idle."""
        try:
            while not self._outbox.poll(CORE_CHECK_S):
                gone = self._core_gone()
                if gone:
                    return ("fatal", gone)
            return self._outbox.recv()
        except Exception:                          # end of file, or a message cut off by the core's death
            return ("fatal", self._core_gone(wait=True) or "the engine process is gone")

    def _core_gone(self, wait: bool = False) -> str | None:
        if self._process is not None:
            if wait:
                self._process.join(timeout=5)
            if self._process.is_alive():
                return None
            return f"the engine process exited with code {self._process.exitcode}"
        try:
            os.kill(self._core_pid, 0)             # a dead core is reaped by the supervisor within 0.5 s
        except ProcessLookupError:
            return "the engine process is gone"
        return None

    def start(self) -> None:
        """Starts the core process (unless shared) and blocks until its model is loaded and its
        graphs captured."""
        if self._process is not None:
            self._process.start()
            self._writer.close()                   # the core's copy is now the only one
        message = self._receive()
        if message[0] != "ready":
            raise RuntimeError(f"the engine process failed to start: {message[-1]}")
        self.info = message[1]
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()
        self.ready = True

    def _read(self) -> None:
        while True:
            message = self._receive()
            kind = message[0]
            if kind == "events":
                self._publish(_unpack(message[1]), message[2])
            elif kind == "fatal":
                self.error, self.ready = message[1], False
                self._fail_streams(message[1])
                return
            elif kind == "stopped":
                return

    def shutdown(self) -> None:
        self.ready = False
        if self._process is None:
            return                                 # the shared core's owner stops it
        stop_core(self._process, self._inbox)
        if self._reader is not None:
            self._reader.join(timeout=5)           # it ends on "stopped" or at the pipe's end
        self._inbox.close()
        self._inbox.join_thread()
        self._outbox.close()

    def _send(self, message) -> None:
        self._inbox.put(message)
