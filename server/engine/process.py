"""The engine core in a process of its own.

The server process keeps the tokenizer (it makes the text of the tokens) and the asyncio
streams; the core process owns the model and the GPU. Requests and aborts go down a pipe; each
step's events and a state snapshot come back up another, as one message per step.

Several HTTP worker processes can share one core (``python -m server --api-workers N``): each
has a pipe of its own each way, and a request's events go to the worker whose number prefixes
its id (``"2:..."``). The process that starts the core keeps one more pipe down, to stop it.

A front end writes a request into its pipe from the thread that sends it (the event loop's), not
from a ``multiprocessing.Queue``'s feeder thread: while the event loop is busy streaming tokens,
a thread of the same process waits milliseconds for the GIL (docs/log.md). What the pipe does
not take at once goes, in order, through a writer thread, so the event loop never waits for the
core.

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
import pickle
import queue
import selectors
import signal
import struct
import threading
import time
from collections import deque

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
    system allows. The front ends' request pipes are made the same way."""
    reader, writer = ctx.Pipe(duplex=False)
    try:
        fcntl.fcntl(writer.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BUFFER_BYTES)
    except (AttributeError, OSError):
        pass                                       # not Linux, or a lower limit: the default buffer
    return reader, writer


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def start_core(process) -> None:
    """Starts the core ``process`` with the stop signals blocked: one sent to the whole process
    group while the core starts, before ``core_main`` ignores them, waits and is then dropped
    instead of killing it (as multiprocessing starts its resource tracker). Its OpenMP threads
    sleep when idle unless the environment says otherwise (``OMP_WAIT_POLICY``, read when the
    new process loads OpenMP; see ``server/__main__.py``)."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = policy or "PASSIVE"            # what the new process inherits
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if policy is None:                                         # this process's OpenMP has read it already
            del os.environ["OMP_WAIT_POLICY"]
        else:
            os.environ["OMP_WAIT_POLICY"] = policy


FRAME = struct.Struct("!I")                 # a request message: its length, then its pickle


class RequestPipe:
    """A front end's end of its request pipe (``send``, from any thread). The sending thread
    writes what the pipe takes at once; what it does not take, and every message after it, a
    writer thread writes in order as the core reads. A core that has gone takes nothing: its
    front end learns of it from the events pipe."""

    def __init__(self, writer):
        self._writer = writer                      # a Connection, for its descriptor (it travels to spawned processes)
        self._fd = writer.fileno()
        os.set_blocking(self._fd, False)
        self._lock = threading.Condition()
        self._backlog: deque[memoryview] = deque()
        self._thread: threading.Thread | None = None
        self._gone = False

    def send(self, message) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        frame = memoryview(FRAME.pack(len(data)) + data)
        with self._lock:
            if self._gone:
                return
            if not self._backlog:
                frame = self._write(frame)
                if not frame:
                    return
            self._backlog.append(frame)
            if self._thread is None:
                self._thread = threading.Thread(target=self._write_backlog, name="request-writer", daemon=True)
                self._thread.start()
            self._lock.notify()

    def close(self) -> None:
        """Nothing is written after this (the descriptor's number may be reused)."""
        with self._lock:
            self._gone = True
            self._backlog.clear()
            self._writer.close()

    def _write(self, frame: memoryview) -> memoryview:
        """What of ``frame`` the pipe did not take now (empty: all of it, or the core has gone)."""
        try:
            return frame[os.write(self._fd, frame):]
        except BlockingIOError:
            return frame
        except OSError:                            # the core has gone
            self._gone = True
            self._backlog.clear()
            return frame[:0]

    def _write_backlog(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._fd, selectors.EVENT_WRITE)
            while True:
                with self._lock:
                    while not self._backlog:
                        self._lock.wait()
                    left = self._write(self._backlog[0])    # the backlog is empty once gone or closed
                    if self._gone:
                        continue
                    if left:
                        self._backlog[0] = left
                    else:
                        self._backlog.popleft()
                if left:
                    selector.select()              # until the core has read some


class RequestInbox:
    """The core's ends of the request pipes, read as one queue: ``get(timeout)`` and
    ``get_nowait()`` raise ``queue.Empty`` when no whole message has come. A pipe whose front end
    has gone is dropped; once none is left, ``("stop", None)`` is what comes."""

    READ_BYTES = 1 << 16

    def __init__(self, readers):
        self._selector = selectors.DefaultSelector()   # kept: the core looks at its inbox every step
        for reader in readers:                          # a Connection, kept open by the registration
            self._selector.register(reader.fileno(), selectors.EVENT_READ, (reader, bytearray()))
        self._ready: deque = deque()

    def get(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._read(left)
            if not self._ready and left == 0.0:
                raise queue.Empty
        return self._ready.popleft()

    def get_nowait(self):
        return self.get(0)

    def _read(self, timeout: float | None) -> None:
        if not self._selector.get_map():
            self._ready.append(("stop", None))
            return
        for key, _ in self._selector.select(timeout):
            data = os.read(key.fd, self.READ_BYTES)
            if not data:                                # that front end has gone
                self._selector.unregister(key.fd)
                continue
            pending = key.data[1]
            pending += data
            while len(pending) >= FRAME.size:
                (size,) = FRAME.unpack_from(pending)
                if len(pending) < FRAME.size + size:
                    break
                self._ready.append(pickle.loads(pending[FRAME.size:FRAME.size + size]))
                del pending[:FRAME.size + size]


def _pack(pairs) -> list[tuple]:
    """A step's events for the pipe: token events as plain tuples, which pickle and unpickle
    several times faster than the dataclass."""
    return [(rid, e.token_id, e.logprob, e.special, e.time, e.last, e.cached_tokens, e.top_logprobs,
             e.prompt_logprobs) if type(e) is TokenEvent
            else (rid, e) for rid, e in pairs]


def _unpack(rows) -> list[tuple[str, object]]:
    return [(r[0], TokenEvent(r[1], "", *r[2:])) if len(r) == 9 else r for r in rows]


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


def core_main(model: str, dtype: str | None, device: str, config: EngineConfig, request_readers, outboxes,
              log_config: dict | None, loaded_flag=None):
    """The core process: loads the model, sets ``loaded_flag`` (an event its workers share) and
    tells them so, then steps until told to stop (or until every request pipe's writer has gone)."""
    # Ctrl-C, a terminal closing, systemd's control-group stop and container runtimes signal
    # every process of the server; the server drains its requests and then stops the core with
    # a message, so the core must not die of the signal before that. A core whose server has
    # gone stops by itself: its request pipes end.
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)     # blocked since start_core
    if log_config is not None:
        logging.config.dictConfig(log_config)
    transformers.utils.logging.disable_progress_bar()
    router = _Router(outboxes)
    try:
        loaded = load_model(model, dtype=dtype, device=device)
        core = EngineCore(loaded, config, router)
        freeze_startup_heap()
        if loaded_flag is not None:
            loaded_flag.set()
        router.broadcast(("ready", core.info))
        _run_profiled(core, RequestInbox(request_readers), os.environ.get(PROFILE_ENV))
        router.broadcast(("stopped",))
    except BaseException as exc:                 # tell the servers before the process ends
        log.exception("engine core failed")
        router.broadcast(("fatal", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None


def _run_profiled(core: EngineCore, inbox: "RequestInbox", path: str | None) -> None:
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
    """One worker's end of a shared core: the writing end of its request pipe, the reading end of
    its events pipe, its number, the core's process id, and the event the core sets once its
    model is loaded (set before any worker hears "ready": ``core_loaded()``)."""

    def __init__(self, requests, outbox, worker: int, core_pid: int, loaded_flag):
        self.requests, self.outbox, self.worker, self.core_pid = requests, outbox, worker, core_pid
        self.loaded_flag = loaded_flag

    def core_loaded(self) -> bool:
        return self.loaded_flag.is_set()

    def close(self) -> None:
        """The starting process's copies, once the worker process holds its own."""
        self.requests.close()
        self.outbox.close()


def start_shared_core(model: str, dtype: str | None, device: str, config: EngineConfig, workers: int,
                      log_config: dict | None = None):
    """Starts a core process for ``workers`` HTTP workers; returns it, one channel per worker and
    the caller's own request pipe (to stop the core: ``stop_core``). The caller hands each channel
    to its worker process and then closes its own copies of them (``EngineChannel.close()``), so
    that a worker's exit breaks its pipes."""
    ctx = mp.get_context("spawn")
    requests = [event_pipe(ctx) for _ in range(workers + 1)]
    events = [event_pipe(ctx) for _ in range(workers)]
    loaded_flag = ctx.Event()
    process = ctx.Process(target=core_main, name="engine-core", daemon=True,
                          args=(model, dtype, device, config, [r for r, _ in requests], [w for _, w in events],
                                log_config, loaded_flag))
    start_core(process)
    for (reader, _), (_, writer) in zip(requests, events):
        reader.close()
        writer.close()
    requests[-1][0].close()
    channels = [EngineChannel(requests[i][1], events[i][0], i, process.pid, loaded_flag) for i in range(workers)]
    return process, channels, RequestPipe(requests[-1][1])


def stop_core(process, requests: RequestPipe, timeout: float = 30.0) -> None:
    if process.is_alive():
        requests.send(("stop", None))
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
            self._request_reader, requests = event_pipe(ctx)
            self._outbox, self._writer = event_pipe(ctx)
            self._requests = RequestPipe(requests)
            self._process = ctx.Process(target=core_main, name="engine-core", daemon=True,
                                        args=(model, dtype, device, self.config, [self._request_reader],
                                              [self._writer], log_config))
        else:
            self._requests, self._outbox, self._process = RequestPipe(channel.requests), channel.outbox, None
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
            start_core(self._process)
            self._writer.close()                   # the core's copies are now the only ones
            self._request_reader.close()
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
        stop_core(self._process, self._requests)
        if self._reader is not None:
            self._reader.join(timeout=5)           # it ends on "stopped" or at the pipe's end
        self._requests.close()
        self._outbox.close()

    def _send(self, message) -> None:
        self._requests.send(message)
