"""Several HTTP worker processes in front of one engine process (``--api-workers``)."""

import asyncio
import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from .conftest import metric_value, read_sse


async def stream(client: httpx.AsyncClient, url: str, new_tokens: int) -> list[dict]:
    events = []
    async with client.stream("POST", url + "/generate_stream",
                             json={"inputs": "Count slowly:", "parameters": {"max_new_tokens": new_tokens}}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    return events


def test_two_workers_share_one_engine_and_their_metrics(start_server):
    server = start_server("--api-workers", "2")
    requests, new_tokens = 8, 6

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(stream(client, server.url, new_tokens) for _ in range(requests)))

    results = asyncio.run(main())
    for events in results:
        assert [e["index"] for e in events] == list(range(1, new_tokens + 1))
        assert events[-1]["details"]["generated_tokens"] == new_tokens
        assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)
    deadline = time.monotonic() + 60            # the first 200 may come before the second worker is up
    while server.log_path.read_text(errors="replace").count("Application startup complete") < 2:
        assert time.monotonic() < deadline, server.log_path.read_text(errors="replace")[-4000:]
        time.sleep(0.1)
    # every worker's /metrics sums the counters of both
    for _ in range(4):
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert metric_value(text, "llm_requests_finished_total", 'reason="length"') == requests
        assert metric_value(text, "llm_generation_tokens_total") == requests * new_tokens
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_dead_engine_process_ends_every_open_stream_with_an_error(start_server):
    server = start_server("--api-workers", "2", "--max-batch", "8")
    body = {"inputs": "Count slowly:", "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}
    core_pid = int(re.search(r"engine process (\d+)", server.log_path.read_text()).group(1))
    streams = 4
    generating = threading.Barrier(streams + 1, timeout=60)

    def last_event() -> dict:
        with httpx.Client(timeout=60) as client, \
                client.stream("POST", server.url + "/generate_stream", json=body) as r:
            events = read_sse(r)
            assert "token" in next(events)[1]
            generating.wait()
            return [payload for _, payload in events][-1]

    with ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(last_event) for _ in range(streams)]
        generating.wait()                                  # every stream has its first token
        os.kill(core_pid, signal.SIGKILL)
        lasts = [f.result() for f in futures]
    for last in lasts:
        assert last["error_type"] == "generation" and "engine process" in last["error"]
    deadline = time.monotonic() + 30                       # the server exits, with an error code
    while server.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.process.returncode == 1
    assert "the engine process exited" in server.log_path.read_text()


def test_a_dead_api_worker_makes_the_server_drain_and_exit_with_an_error(start_server):
    server = start_server("--api-workers", "2")
    log = server.log_path.read_text()
    workers = [int(pid) for pid in re.search(r"API worker processes \[([\d, ]+)\]", log).group(1).split(", ")]
    os.kill(workers[0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while server.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.process.returncode == 1
    assert re.search(rf'"an API worker exited; the others drain".*"pid": {workers[0]}', server.log_path.read_text())
