"""Graceful drain (``server/shutdown.py``): real servers on a tiny random model, signalled with
streams of both APIs in flight."""

import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from .conftest import REPO, free_port, metric_value
from .test_http_app import FakeEngine, client_for

pytestmark = pytest.mark.slow
MODEL = "random:tiny"


class Server:
    """``python -m server`` in a session (and so a process group) of its own."""

    def __init__(self, log_path, *args, device: str = "cpu"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.workers = int(args[args.index("--api-workers") + 1]) if "--api-workers" in args else 1
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "server", "--model", MODEL, "--device", device, "--port", str(self.port),
                 "--max-batch", "8", *args],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log()[-4000:]
            try:
                # every worker up (its signal handlers set): one still starting dies of a signal
                if (httpx.get(self.url + "/health", timeout=2).status_code == 200
                        and self.log().count("Application startup complete") >= self.workers):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.kill()
        pytest.fail("not healthy:\n" + self.log()[-4000:])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def signal(self, sig: int, target: str) -> None:
        """``sig`` to the server's parent process alone, or to every process of its group."""
        if target == "group":
            os.killpg(self.process.pid, sig)
        else:
            self.process.send_signal(sig)

    def wait_draining(self, workers: str, timeout: float = 30.0) -> None:
        """Until each of the ``workers`` API workers has logged that it drains (its /health and
        new requests answer 503 from then on): a signal reaches a worker through the parent's
        0.2 s loop and uvicorn's 0.1 s tick, longer on a busy host."""
        deadline = time.monotonic() + timeout
        while self.log().count("new requests get 503") < int(workers):
            assert time.monotonic() < deadline, "not every worker drains:\n" + self.log()[-4000:]
            time.sleep(0.05)

    def processes_left(self, timeout: float = 10.0) -> list[str]:
        """The command lines of the group's processes still alive (zombies not counted) once
        ``timeout`` has passed or none is."""
        deadline = time.monotonic() + timeout
        while True:
            left = []
            for stat in glob.glob("/proc/[0-9]*/stat"):
                try:
                    with open(stat) as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    if int(fields[2]) == self.process.pid and fields[0] != "Z":
                        with open(stat[:-4] + "cmdline", "rb") as f:
                            left.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
                except (OSError, IndexError, ValueError):
                    pass                   # gone meanwhile
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail("did not exit in time:\n" + self.log()[-4000:])


class Stream(threading.Thread):
    """One streamed request; ``events`` are its ``data:`` payloads, ``first`` is set at the first."""

    def __init__(self, url: str, path: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.events: list = []
        self.first = threading.Event()
        self.error: Exception | None = None
        self.complete = False          # the chunked body ended properly

    def run(self):
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body, timeout=120) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        payload = line[5:].strip()
                        self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                        self.first.set()
            self.complete = True
        except Exception as exc:       # a cut-off stream shows here
            self.error = exc
        finally:
            self.first.set()


def streams(url: str, new_tokens: int) -> tuple[Stream, Stream]:
    tgi = Stream(url, "/generate_stream", {"inputs": "Count:", "parameters": {"max_new_tokens": new_tokens,
                                                                              "ignore_eos": True}})
    openai = Stream(url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Count:"}], "max_tokens": new_tokens,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    for s in (tgi, openai):
        s.start()
    for s in (tgi, openai):
        assert s.first.wait(120) and s.error is None, s.error
    return tgi, openai


def check_refusing(server: Server) -> None:
    """While draining: /health 503, new requests 503 with Retry-After on both APIs."""
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 503 and r.json()["status"] == "draining"
    r = httpx.post(server.url + "/generate", json={"inputs": "x"}, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] and "shutting down" in r.json()["error"]
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10)
    assert r.status_code == 503 and r.headers["retry-after"] and "shutting down" in r.json()["error"]["message"]


def check_clean_exit(server: Server, code: int) -> str:
    log = server.log()
    assert code == 0, log[-4000:]
    assert "Traceback" not in log and "leaked semaphore" not in log and "Exception in ASGI" not in log
    assert "client disconnected" not in log and "engine process exited" not in log
    drained = [json.loads(line) for line in log.splitlines() if '"msg": "drained"' in line]
    # every worker drained; the last to finish saw the engine hold no KV block
    assert drained and all(d["unfinished_streams"] == 0 for d in drained), drained
    assert drained[-1]["kv_blocks_used"] == 0, drained
    assert server.processes_left() == []
    return log


def cuda_devices() -> list:
    """``cpu``, and ``cuda`` as a GPU-marked case (skipped where CUDA is absent)."""
    import torch
    gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])]


@pytest.mark.parametrize("workers, target", [("1", "parent"), ("2", "group")])
def test_sigterm_lets_running_streams_finish_within_the_timeout(tmp_path, workers, target):
    # Enough tokens that the streams outlast the drain checks: 40 took under a second on the
    # int4 CPU path, and the server had finished and closed its socket before the last check.
    new_tokens = 200
    server = Server(tmp_path / "server.log", "--shutdown-timeout", "60", "--api-workers", workers)
    try:
        tgi, openai = streams(server.url, new_tokens=new_tokens)
        server.signal(signal.SIGTERM, target)
        server.wait_draining(workers)
        check_refusing(server)
        for s in (tgi, openai):
            s.join(120)
        code = server.wait(60)
    finally:
        server.kill()
    for s in (tgi, openai):
        assert s.complete and s.error is None, s.error
    last = tgi.events[-1]
    assert last["details"]["finish_reason"] == "length" and last["details"]["generated_tokens"] == new_tokens
    assert openai.events[-1] == "[DONE]"
    assert openai.events[-2]["usage"]["completion_tokens"] == new_tokens
    assert openai.events[-3]["choices"][0]["finish_reason"] == "length"
    log = check_clean_exit(server, code)
    assert "the server ends the requests still running" not in log


# (API workers, signal, to the parent or the whole group, times sent): a signal to the group
# (systemd's KillMode=control-group, `kill -- -PGID`, a terminal's Ctrl-C) drains as one to the
# parent does; a second SIGINT ends the running requests at once instead of at the timeout.
SIGNALS = [("1", signal.SIGTERM, "group", 1), ("2", signal.SIGTERM, "group", 1),
           ("2", signal.SIGINT, "group", 1), ("2", signal.SIGTERM, "group", 2), ("1", signal.SIGINT, "group", 2),
           ("2", signal.SIGINT, "parent", 2)]


@pytest.mark.parametrize("device", cuda_devices())
@pytest.mark.parametrize("workers, sig, target, times", SIGNALS,
                         ids=[f"{w}worker-{signal.Signals(s).name}-{t}-x{n}" for w, s, t, n in SIGNALS])
def test_streams_running_past_the_timeout_are_ended_with_a_proper_last_event(tmp_path, workers, sig, target, times,
                                                                             device):
    """The engine process must not die of a signal to the group before the workers have ended
    their streams."""
    hurried = sig == signal.SIGINT and times == 2
    timeout = 30 if hurried else 2
    server = Server(tmp_path / "server.log", "--shutdown-timeout", str(timeout), "--api-workers", workers,
                    device=device)
    plain: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: plain.append(httpx.post(
        server.url + "/generate", json={"inputs": "Count:", "parameters": {"max_new_tokens": 4000,
                                                                          "ignore_eos": True}}, timeout=120)))
    try:
        tgi, openai = streams(server.url, new_tokens=4000)
        waiting.start()
        deadline = time.monotonic() + 60       # all three decoding before the signal
        while metric_value(httpx.get(server.url + "/metrics", timeout=10).text, "llm_num_requests_running") < 3:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        signalled = time.monotonic()
        server.signal(sig, target)
        server.wait_draining(workers)
        check_refusing(server)
        if times == 2:
            server.signal(sig, target)
        for s in (tgi, openai, waiting):
            s.join(60)
        ended = time.monotonic() - signalled
        code = server.wait(60)
    finally:
        server.kill()
    if hurried:
        assert ended < min(10, timeout), "a second SIGINT ends the running requests at once"
    else:
        assert timeout <= ended < 20
    for s in (tgi, openai):
        assert s.complete and s.error is None, s.error
    assert tgi.events[-1]["error_type"] == "incomplete_generation"
    assert "shutting down" in tgi.events[-1]["error"]
    assert all("token" in e for e in tgi.events[:-1])
    assert openai.events[-1] == "[DONE]"
    usage = openai.events[-2]["usage"]
    assert openai.events[-2]["choices"] == [] and 0 < usage["completion_tokens"] < 4000
    assert openai.events[-3]["choices"][0]["finish_reason"] == "abort"
    # the non-streaming request: 503, to be retried elsewhere
    (r,) = plain
    assert r.status_code == 503 and r.headers["retry-after"] and "ended the request after" in r.json()["error"]
    log = check_clean_exit(server, code)
    assert log.count("the server ended the request (shutting down)") == 3
    assert ("second interrupt: the server ends the requests still running" in log) == hurried


def test_two_quick_interrupts_to_the_parent_of_two_workers_end_the_streams_at_once(tmp_path):
    """`kill -INT PID; kill -INT PID`: the parent passes the first on as SIGTERM (within its 0.2 s
    loop) and the second at once as the hurry signal, which a worker may see first or together
    with the SIGTERM (it runs the lower-numbered signal's handler first); either order must drain
    and end the running requests now, not at the timeout."""
    server = Server(tmp_path / "server.log", "--shutdown-timeout", "30", "--api-workers", "2")
    try:
        tgi, openai = streams(server.url, new_tokens=4000)
        signalled = time.monotonic()
        server.signal(signal.SIGINT, "parent")
        time.sleep(0.05)       # two signals still pending together would merge into one
        server.signal(signal.SIGINT, "parent")
        for s in (tgi, openai):
            s.join(60)
        ended = time.monotonic() - signalled
        code = server.wait(60)
    finally:
        server.kill()
    assert ended < 10, "the second SIGINT was taken for the first: the streams ran to the timeout"
    for s in (tgi, openai):
        assert s.complete and s.error is None, s.error
    assert tgi.events[-1]["error_type"] == "incomplete_generation"
    assert openai.events[-1] == "[DONE]" and openai.events[-3]["choices"][0]["finish_reason"] == "abort"
    log = check_clean_exit(server, code)
    assert "second interrupt: the server ends the requests still running" in log


def test_draining_app_refuses_new_work_and_health_says_so():
    """The in-process view of the same: a draining app's routes answer 503 with Retry-After."""
    with client_for(FakeEngine()) as client:
        client.app.state.services.draining = True
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "draining"
        for path, body in [("/generate", {"inputs": "x"}),
                           ("/v1/completions", {"model": "fake-model", "prompt": "x"})]:
            r = client.post(path, json=body)
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert client.get("/metrics").status_code == 200


def test_the_drain_says_for_how_long_it_waits_and_what_is_left(caplog):
    """Ctrl-C under `make run` with a stream open: the log says at once that the server drains
    and for how long at most, then what is still running, until it ends the rest."""
    import asyncio
    import logging

    from server.metrics import Metrics
    from server.services import EngineSlot, Services
    from server.settings import Settings
    from server.shutdown import drain

    class Running:
        request_id = "r1"

        def __init__(self, running: set):
            self.running = running

        def end_by_server(self):
            self.running.discard(self)

    services = Services(settings=Settings(), slot=EngineSlot(), metrics=Metrics(lambda: None))
    services.generations.add(Running(services.generations))
    caplog.set_level(logging.INFO, logger="server.shutdown")
    started = time.monotonic()
    asyncio.run(drain(services, timeout=1.0, report_every=0.3))
    assert 1.0 <= time.monotonic() - started < 3
    messages = [r.getMessage() for r in caplog.records if r.name == "server.shutdown"]
    assert messages[0] == ("draining: new requests get 503; 1 request running may finish for up to 1 s "
                           "(--shutdown-timeout), then the server ends it")
    progress = [m for m in messages if "still running, ended in" in m]
    assert len(progress) >= 2 and progress[0].startswith("draining: 1 request still running"), messages
    assert any("the server ends the requests still running" in m for m in messages)
    assert not services.generations
