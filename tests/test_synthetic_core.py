"""The HTTP server with a synthetic engine core (load_tests.synthetic_core): the real API workers,
pipes and detokenizer in front of a core that makes a token per step without a model."""

import json
import signal
import subprocess
import sys
import time

import httpx

from .conftest import REPO, free_port


def test_streams_one_token_per_step_through_two_api_workers():
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "load_tests.synthetic_core", "--step-ms", "2", "--port", str(port),
                               "--api-workers", "2"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            time.sleep(0.3)
        body = {"inputs": "Count slowly:", "parameters": {"max_new_tokens": 20}}
        started = time.monotonic()
        with httpx.stream("POST", url + "/generate_stream", json=body, timeout=60) as response:
            assert response.status_code == 200
            events = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]
        elapsed = time.monotonic() - started
        assert [e["index"] for e in events] == list(range(1, 21))
        assert events[-1]["details"]["finish_reason"] == "length"
        assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)
        assert elapsed >= 20 * 0.002                      # a step apart
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
