"""Connections to the API worker with the fewest open: one acceptor, several worker processes.

Worker processes that share one listening socket take each connection as the kernel wakes them,
which spreads a burst of keep-alive connections unevenly (7, 3, 4 and 2 of 16 over four workers
was seen), and a crowded worker then slows its streams for as long as their connections live.
Here the parent process accepts every connection and hands it over a Unix socket pair
(SCM_RIGHTS) to the worker with the fewest open connections, nginx's ``least_conn``. A worker
tells the parent when it is ready and when each of its connections closes.
"""

import asyncio
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from .shutdown import DrainingServer

log = logging.getLogger("server.balancer")

READY, CLOSED, CONNECTION = b"r", b"c", b"f"


class Balancer:
    """The parent's side: a thread that accepts on ``listener`` and hands each connection to one
    of ``workers`` worker ends (``worker_ends[i]``, to be given to worker ``i``), the ready one
    with the fewest open connections, the one handed fewest so far among equals. It accepts only
    while some worker is ready; until then connections wait in the listen backlog."""

    def __init__(self, listener: socket.socket, workers: int):
        if workers < 1:
            raise ValueError(f"workers must be at least 1, not {workers}")
        self.listener = listener
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(workers)]
        self._ends = [ours for ours, _ in pairs]
        self.worker_ends = [theirs for _, theirs in pairs]
        self.open = [0] * workers          # connections handed to each worker and not yet closed
        self.handed = [0] * workers        # connections handed to each worker in all
        self.ready = [False] * workers
        self.gone = [False] * workers      # the worker's end closed: it exited
        self._wake, self._waker = socket.socketpair()
        self._thread: threading.Thread | None = None

    def start(self, backlog: int = 2048) -> None:
        self.listener.listen(backlog)
        self.listener.setblocking(False)
        for end in self._ends:
            end.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="connection-balancer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops accepting; connections already handed over stay with their workers."""
        if self._thread is not None:
            self._waker.send(b"x")
            self._thread.join()
        for end in self._ends + self.worker_ends + [self._wake, self._waker]:
            end.close()

    def _run(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._wake, selectors.EVENT_READ, "stop")
            for worker, end in enumerate(self._ends):
                selector.register(end, selectors.EVENT_READ, worker)
            accepting = False
            while True:
                if accepting != self._some_ready():
                    accepting = not accepting
                    if accepting:
                        selector.register(self.listener, selectors.EVENT_READ, "accept")
                    else:
                        selector.unregister(self.listener)
                for key, _ in selector.select():
                    if key.data == "stop":
                        return
                    if key.data == "accept":
                        self._accept_waiting()
                    else:
                        self._read_notices(key.data, selector)

    def _some_ready(self) -> bool:
        return any(ready and not gone for ready, gone in zip(self.ready, self.gone))

    def _accept_waiting(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:                     # e.g. out of file descriptors: try again shortly
                log.warning("accept failed", extra={"fields": {"error": str(e)}})
                time.sleep(0.1)
                return
            with connection:
                self._hand_over(connection)

    def _hand_over(self, connection: socket.socket) -> None:
        candidates = [w for w in range(len(self._ends)) if self.ready[w] and not self.gone[w]]
        for worker in sorted(candidates, key=lambda w: (self.open[w], self.handed[w])):
            try:
                socket.send_fds(self._ends[worker], [CONNECTION], [connection.fileno()])
            except BlockingIOError:                  # the worker is not reading: try another
                continue
            except OSError:                          # the worker exited
                self.gone[worker] = True
                continue
            self.open[worker] += 1
            self.handed[worker] += 1
            return
        log.warning("no API worker could take a connection: closed", extra={"fields": {
            "open_connections": self.open, "ready": self.ready, "exited": self.gone}})

    def _read_notices(self, worker: int, selector: selectors.BaseSelector) -> None:
        while True:
            try:
                notice = self._ends[worker].recv(16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                notice = b""
            if notice == READY:
                self.ready[worker] = True
            elif notice == CLOSED:
                self.open[worker] -= 1
            elif not notice:
                self.gone[worker] = True
                selector.unregister(self._ends[worker])
                return


class HandedConnections:
    """A worker's side: serves each connection the parent hands over with ``protocol_factory``'s
    protocol and tells the parent when it closes. In uvicorn's list of servers it stands where an
    asyncio server listening on a socket would."""

    def __init__(self, end: socket.socket):
        self._end = end
        self._loop: asyncio.AbstractEventLoop | None = None
        self._protocol_factory: Callable[[], asyncio.Protocol] | None = None

    def serve(self, protocol_factory: Callable[[], asyncio.Protocol]) -> None:
        self._loop = asyncio.get_running_loop()
        self._protocol_factory = protocol_factory
        self._end.setblocking(False)
        self._loop.add_reader(self._end.fileno(), self._receive)
        self._notify(READY)

    def close(self) -> None:
        """Takes no more connections; the end stays open to report those still open closing."""
        if self._loop is not None:
            self._loop.remove_reader(self._end.fileno())

    async def wait_closed(self) -> None:
        return None

    def _receive(self) -> None:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self._end, 16, 16)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                message, fds = b"", []
            if not message:                          # the parent is gone
                self.close()
                return
            for fd in fds:
                self._loop.create_task(self._connect(socket.socket(fileno=fd)))

    async def _connect(self, connection: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._counted_protocol, connection)
        except OSError:                              # the client left before it was served
            connection.close()
            self._notify(CLOSED)

    def _counted_protocol(self) -> asyncio.Protocol:
        protocol = self._protocol_factory()
        connection_lost = protocol.connection_lost

        def lost_and_counted(exc: Exception | None) -> None:
            connection_lost(exc)
            self._notify(CLOSED)

        protocol.connection_lost = lost_and_counted
        return protocol

    def _notify(self, notice: bytes) -> None:
        try:
            self._end.send(notice)
        except OSError:                              # the parent is gone or not reading
            pass


class WorkerServer(DrainingServer):
    """A draining uvicorn server whose connections come from the parent's ``Balancer`` instead
    of a listening socket of its own."""

    def __init__(self, config: uvicorn.Config, drain, end: socket.socket):
        super().__init__(config, drain)
        self._connections = HandedConnections(end)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await self.lifespan.startup()
        if self.lifespan.should_exit:
            raise SystemExit(STARTUP_FAILURE)
        config = self.config

        def create_protocol() -> asyncio.Protocol:
            return config.http_protocol_class(config=config, server_state=self.server_state,
                                              app_state=self.lifespan.state)

        self._connections.serve(create_protocol)
        self.servers = [self._connections]
        self.started = True
