"""The parent's connection balancer (server/balancer.py), with fake workers: each worker end is
read here as a worker process would, without uvicorn."""

import asyncio
import socket
import time

import pytest

from server.balancer import CLOSED, READY, Balancer, HandedConnections


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class FakeWorker:
    def __init__(self, end: socket.socket):
        self.end = end
        self.connections: list[socket.socket] = []

    def ready(self):
        self.end.send(READY)

    def take(self, expected: int, timeout=5.0) -> None:
        """Receives connections until it holds ``expected``."""
        self.end.settimeout(timeout)
        while len(self.connections) < expected:
            _, fds, _, _ = socket.recv_fds(self.end, 16, 16)
            self.connections += [socket.socket(fileno=fd) for fd in fds]

    def close_one(self):
        self.connections.pop().close()
        self.end.send(CLOSED)


@pytest.fixture
def balanced():
    """A balancer on a fresh listening socket with ``n`` fake workers; closes it all afterwards."""
    made = []

    def make(n: int):
        listener = socket.create_server(("127.0.0.1", 0))
        balancer = Balancer(listener, n)
        workers = [FakeWorker(end) for end in balancer.worker_ends]
        clients = []

        def connect(count: int) -> list[socket.socket]:
            new = [socket.create_connection(listener.getsockname()) for _ in range(count)]
            clients.extend(new)
            return new

        made.append((balancer, listener, clients))
        balancer.start()
        return balancer, workers, connect

    yield make
    for balancer, listener, clients in made:
        balancer.stop()
        listener.close()
        for client in clients:
            client.close()


def test_a_burst_of_connections_is_spread_evenly_and_each_client_reaches_its_worker(balanced):
    balancer, workers, connect = balanced(4)
    for worker in workers:
        worker.ready()
    wait_until(lambda: all(balancer.ready))
    clients = connect(16)
    for worker in workers:
        worker.take(4)
    wait_until(lambda: balancer.open == [4, 4, 4, 4])   # counted after the hand-over
    # the handed sockets are the server sides of the 16 clients' connections, one each
    for number, client in enumerate(clients):
        client.sendall(bytes([number]))
    received = []
    for worker in workers:
        for connection in worker.connections:
            connection.settimeout(5)
            received.append(connection.recv(1)[0])
    assert sorted(received) == list(range(16))


def test_a_worker_whose_connections_closed_gets_the_next_ones(balanced):
    balancer, workers, connect = balanced(2)
    for worker in workers:
        worker.ready()
    wait_until(lambda: all(balancer.ready))
    connect(4)
    workers[0].take(2)
    workers[1].take(2)
    workers[0].close_one()
    workers[0].close_one()
    wait_until(lambda: balancer.open == [0, 2])
    connect(2)
    workers[0].take(2)
    wait_until(lambda: balancer.open == [2, 2])
    assert len(workers[1].connections) == 2


def test_connections_wait_until_a_worker_is_ready_and_skip_the_unready(balanced):
    balancer, workers, connect = balanced(2)
    connect(3)
    time.sleep(0.2)
    assert balancer.open == [0, 0]                 # nobody ready: they wait in the backlog
    workers[1].ready()
    workers[1].take(3)
    wait_until(lambda: balancer.open == [0, 3])


def test_a_worker_that_exited_gets_no_more_connections(balanced):
    balancer, workers, connect = balanced(2)
    for worker in workers:
        worker.ready()
    wait_until(lambda: all(balancer.ready))
    workers[0].end.close()
    wait_until(lambda: balancer.gone[0])
    connect(3)
    workers[1].take(3)
    wait_until(lambda: balancer.open == [0, 3])


def test_the_balancer_needs_a_worker():
    with socket.create_server(("127.0.0.1", 0)) as listener, pytest.raises(ValueError, match="at least 1, not 0"):
        Balancer(listener, 0)


def test_a_worker_serves_handed_connections_and_reports_each_close():
    """HandedConnections in an event loop: says it is ready, serves a handed connection with the
    given protocol, and reports its close."""
    parent, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener = socket.create_server(("127.0.0.1", 0))

    class Echo(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            self.transport.write(data.upper())
            self.transport.close()

    async def main():
        handed = HandedConnections(worker_end)
        handed.serve(Echo)
        loop = asyncio.get_running_loop()
        assert await loop.sock_recv(parent, 16) == READY
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        socket.send_fds(parent, [b"f"], [accepted.fileno()])
        accepted.close()
        client.setblocking(False)
        await loop.sock_sendall(client, b"ping")
        assert await asyncio.wait_for(loop.sock_recv(client, 16), 5) == b"PING"
        assert await asyncio.wait_for(loop.sock_recv(parent, 16), 5) == CLOSED
        client.close()
        handed.close()

    parent.setblocking(False)
    try:
        asyncio.run(main())
    finally:
        for s in (parent, worker_end, listener):
            s.close()
