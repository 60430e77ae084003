"""Live-server fixtures: real ``python -m server`` processes on free ports.

``start_server(*extra_args)`` (session-scoped factory) starts ``python -m server --model <model>
--port <free port> *extra_args``, waits until GET /health answers 200 and returns a
``LiveServer``. Servers are shared by identical argument lists and stopped when the session
ends; a server found unhealthy when asked for again is replaced by a fresh one. ``live_server``
is the base URL of the server with no extra arguments.

Environment: LIVE_SERVER_MODEL (default "default"), LIVE_SERVER_START_TIMEOUT (seconds, 300).
"""

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
MODEL = os.environ.get("LIVE_SERVER_MODEL", "default")
START_TIMEOUT = float(os.environ.get("LIVE_SERVER_START_TIMEOUT", "300"))

GUARDED_API_KEY = "test-key"
# A server with every limit set: API key, one running and two waiting requests, small body and
# prompt limits.
GUARDED_ARGS = ("--api-key", GUARDED_API_KEY, "--max-batch", "1", "--max-waiting-requests", "2",
                "--max-body-bytes", "4096", "--max-prompt-tokens", "48")
# For fuzzing: short prompts and a tiny default generation length keep valid bodies cheap.
FUZZ_ARGS = ("--max-body-bytes", "4096", "--max-prompt-tokens", "96", "--default-max-new-tokens", "2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    port: int
    args: tuple[str, ...]
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])[-8000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class ServerPool:
    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.servers: dict[tuple[str, ...], LiveServer] = {}

    def start(self, *extra_args: str, env: dict[str, str] | None = None) -> LiveServer:
        key = tuple(extra_args)
        server = self.servers.get(key)
        if server is not None:
            if healthy(server):
                return server
            server.stop()       # a test broke it; later tests get a fresh one
        port = free_port()
        log_path = self.log_dir / f"server-{port}.log"
        cmd = [sys.executable, "-m", "server", "--model", MODEL, "--port", str(port), *extra_args]
        with open(log_path, "wb") as log:
            process = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        server = LiveServer(f"http://127.0.0.1:{port}", port, key, process, log_path)
        try:
            wait_healthy(server)
        except BaseException:
            server.stop()
            raise
        self.servers[key] = server
        return server

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


def healthy(server: LiveServer) -> bool:
    try:
        return server.process.poll() is None and \
            httpx.get(server.url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def wait_healthy(server: LiveServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            r = httpx.get(server.url + "/health", timeout=2)
            if r.status_code == 200:
                return
            if r.json().get("status") == "error":
                pytest.fail(f"server failed: {r.json()}\n{server.log_tail()}")
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    pytest.fail(f"server not healthy after {START_TIMEOUT:.0f} s:\n{server.log_tail()}")


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    pool = ServerPool(tmp_path_factory.mktemp("live-servers"))
    yield pool.start
    pool.stop_all()


@pytest.fixture(scope="module")
def live_server(start_server) -> str:
    # Per module, so that a module after one that broke the server gets a fresh one.
    return start_server().url


@pytest.fixture(scope="module")
def guarded_server(start_server) -> LiveServer:
    return start_server(*GUARDED_ARGS)


@pytest.fixture(scope="module")
def fuzz_server(start_server) -> LiveServer:
    return start_server(*FUZZ_ARGS)


@pytest.fixture(scope="module")
def model_name(live_server) -> str:
    return httpx.get(live_server + "/v1/models", timeout=10).json()["data"][0]["id"]


def read_sse(response: httpx.Response):
    """Yields (arrival time, payload) for each ``data:`` line of a streamed response; JSON
    payloads are decoded, ``[DONE]`` is yielded as the string."""
    for line in response.iter_lines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            yield time.monotonic(), payload if payload == "[DONE]" else json.loads(payload)


def metric_value(metrics_text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text, e.g. ('llm_requests_finished_total',
    'reason="abort"'); 0.0 if absent."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in metrics_text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
