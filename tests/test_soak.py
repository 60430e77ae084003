"""A bounded soak on the CPU with random:tiny: a mix of streamed and plain requests on both APIs,
clients that disconnect mid-answer or give up waiting, and bad inputs, from several clients at
once for SOAK_SECONDS (default 120, after a warm-up of a quarter of that); then a SIGTERM to the
server's whole process group with streams running.

Afterwards: no answer was 5xx before the drain, every KV block is back in the pool before the
drain, the server's memory (RSS of all its processes) is within 5 % of what it was after the
warm-up, and the drain ends every stream with its proper last event and exits 0. The numbers are
printed (``pytest -s``) for the record."""

import json
import os
import random
import signal
import threading
import time
from collections import Counter

import httpx
import psutil
import pytest

from .conftest import metric_value
from .test_http_shutdown import MODEL, Server, Stream

pytestmark = pytest.mark.slow

SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "120"))
CLIENTS = 6
RSS_TOLERANCE = 0.05
CHAT = [{"role": "user", "content": "Count to ten."}]

# Bodies a client gets wrong, and the status each must get.
BAD_INPUTS = [
    ("/generate", {"inputs": ""}, 422),
    ("/generate", {"inputs": "x", "parameters": {"max_new_tokens": "10"}}, 422),
    ("/generate", {"inputs": "x", "messages": CHAT}, 422),
    ("/generate", {"inputs": "word " * 5000}, 400),                                 # over the context
    ("/generate_stream", {"inputs": "x", "parameters": {"temperature": -1}}, 422),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": True}, 422),
    ("/v1/completions", {"model": "no-such-model" * 50, "prompt": "x"}, 404),
    ("/v1/completions", {"model": MODEL, "prompt": [10 ** 9]}, 400),                # outside the vocabulary
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "stream": "yes"}, 422),
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2, "min_tokens": 9}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 422),
]


def server_rss(pid: int) -> int:
    parent = psutil.Process(pid)
    processes = [parent, *parent.children(recursive=True)]
    total = 0
    for p in processes:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {name: metric_value(text, f"llm_{name}") for name in
            ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used", "kv_cache_blocks_total",
             "kv_cache_blocks_cached")}


class Mix:
    """One client's loop of random requests; ``kinds`` and ``statuses`` count what it did."""

    def __init__(self, url: str, seed: int, stop: threading.Event):
        self.url, self.rng, self.stop = url, random.Random(seed), stop
        self.kinds: Counter = Counter()
        self.statuses: Counter = Counter()
        self.failures: list[str] = []

    def run(self) -> None:
        actions = [self.tgi_json, self.tgi_stream, self.openai_json, self.openai_stream, self.disconnect_stream,
                   self.give_up_waiting, self.bad_input]
        weights = [3, 3, 3, 3, 2, 1, 2]
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                action = self.rng.choices(actions, weights)[0]
                try:
                    action(client)
                except Exception as exc:            # noqa: BLE001 - every surprise is a finding
                    self.failures.append(f"{action.__name__}: {type(exc).__name__}: {exc}")

    def record(self, kind: str, status: int) -> None:
        self.kinds[kind] += 1
        self.statuses[status] += 1

    def sampling(self) -> dict:
        if self.rng.random() < 0.5:
            return {}
        return {"temperature": self.rng.choice([0.5, 1.0]), "top_p": 0.9, "seed": self.rng.randrange(1000)}

    def tgi_body(self) -> dict:
        body = {"parameters": {"max_new_tokens": self.rng.randint(1, 48), **self.sampling()}}
        if self.rng.random() < 0.5:
            body["messages"] = CHAT
        else:
            body["inputs"] = "The quick brown fox " * self.rng.randint(1, 40)
        return body

    def openai_body(self, chat: bool) -> dict:
        body = {"model": MODEL, "max_tokens": self.rng.randint(1, 48), **self.sampling()}
        if chat:
            body["messages"] = CHAT
        else:
            body["prompt"] = "Once upon a time " * self.rng.randint(1, 40)
        return body

    def tgi_json(self, client: httpx.Client) -> None:
        r = client.post("/generate", json=self.tgi_body())
        self.record("tgi_json", r.status_code)
        if r.status_code == 200:
            assert "generated_text" in r.json()

    def tgi_stream(self, client: httpx.Client) -> None:
        with client.stream("POST", "/generate_stream", json=self.tgi_body()) as r:
            self.record("tgi_stream", r.status_code)
            events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        if r.status_code == 200:
            assert events and "details" in events[-1] and events[-1]["details"]["finish_reason"] in (
                "length", "eos_token"), events[-1]

    def openai_json(self, client: httpx.Client) -> None:
        chat = self.rng.random() < 0.5
        r = client.post("/v1/chat/completions" if chat else "/v1/completions", json=self.openai_body(chat))
        self.record("openai_json", r.status_code)
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")

    def openai_stream(self, client: httpx.Client) -> None:
        chat = self.rng.random() < 0.5
        body = {**self.openai_body(chat), "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as r:
            self.record("openai_stream", r.status_code)
            events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        if r.status_code == 200:
            assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] >= 1

    def disconnect_stream(self, client: httpx.Client) -> None:
        """A client that reads a few events of a long stream and hangs up."""
        tgi = self.rng.random() < 0.5
        path = "/generate_stream" if tgi else "/v1/chat/completions"
        body = ({"messages": CHAT, "parameters": {"max_new_tokens": 2000, "ignore_eos": True}} if tgi else
                {"model": MODEL, "messages": CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True})
        with client.stream("POST", path, json=body) as r:
            self.record("disconnect_stream", r.status_code)
            wanted = self.rng.randint(1, 20)
            for i, _ in enumerate(r.iter_lines()):
                if i >= wanted:
                    break

    def give_up_waiting(self, client: httpx.Client) -> None:
        """A plain request whose client stops waiting before the answer (an abort by disconnect)."""
        body = {"inputs": "x", "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}
        try:
            r = client.post("/generate", json=body, timeout=self.rng.uniform(0.3, 1.5))
            self.record("give_up_waiting", r.status_code)     # the server was faster than the client
        except httpx.TimeoutException:
            self.record("give_up_waiting", 0)

    def bad_input(self, client: httpx.Client) -> None:
        choice = self.rng.randrange(len(BAD_INPUTS) + 3)
        if choice < len(BAD_INPUTS):
            path, body, expected = BAD_INPUTS[choice]
            r = client.post(path, json=body)
        elif choice == len(BAD_INPUTS):
            r, expected = client.post("/generate", content=b'{"inputs": "x"', headers={"content-type": "application/json"}), 400
        elif choice == len(BAD_INPUTS) + 1:
            r, expected = client.post("/v1/completions", content=b'{"model": "x", "prompt": "x"}'), 415
        else:
            r, expected = client.get("/generate"), 405
        self.record("bad_input", r.status_code)
        assert r.status_code == expected, (choice, r.status_code, r.text[:300])


def run_mix(url: str, seconds: float, seed: int) -> list[Mix]:
    stop = threading.Event()
    mixes = [Mix(url, seed * 100 + i, stop) for i in range(CLIENTS)]
    threads = [threading.Thread(target=m.run, daemon=True) for m in mixes]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(180)
        assert not t.is_alive(), "a client hung"
    return mixes


def wait_idle(url: str, timeout: float = 60) -> dict[str, float]:
    """Once every request the clients left has ended: the gauges."""
    deadline = time.monotonic() + timeout
    while True:
        g = gauges(url)
        if (g["num_requests_running"] == g["num_requests_waiting"] == g["kv_cache_blocks_used"] == 0
                or time.monotonic() > deadline):
            return g
        time.sleep(0.2)


def test_soak_then_group_sigterm(tmp_path):
    server = Server(tmp_path / "server.log", "--shutdown-timeout", "3")
    try:
        warm = run_mix(server.url, SOAK_SECONDS / 4, seed=1)
        warm_gauges = wait_idle(server.url)
        rss_start = server_rss(server.process.pid)
        started = time.monotonic()
        mixes = run_mix(server.url, SOAK_SECONDS, seed=2)
        soak_s = time.monotonic() - started
        idle = wait_idle(server.url)
        rss_end = server_rss(server.process.pid)

        # the drain: streams of both APIs running, SIGTERM to every process of the server
        tgi = Stream(server.url, "/generate_stream", {"inputs": "Count:", "parameters": {
            "max_new_tokens": 4000, "ignore_eos": True}})
        openai = Stream(server.url, "/v1/chat/completions", {
            "model": MODEL, "messages": CHAT, "max_tokens": 4000, "ignore_eos": True, "stream": True})
        for s in (tgi, openai):
            s.start()
        for s in (tgi, openai):
            assert s.first.wait(120) and s.error is None, s.error
        os.killpg(server.process.pid, signal.SIGTERM)
        for s in (tgi, openai):
            s.join(60)
        code = server.wait(60)
    finally:
        server.kill()

    kinds = sum((m.kinds for m in mixes), Counter())
    statuses = sum((m.statuses for m in mixes), Counter())
    failures = [f for m in warm + mixes for f in m.failures]
    print(f"\nsoak: {soak_s:.0f} s, {CLIENTS} clients, {sum(kinds.values())} requests "
          f"({sum(kinds.values()) / soak_s:.1f}/s) after a warm-up of "
          f"{sum(sum(m.kinds.values()) for m in warm)}")
    print("requests by kind:", dict(sorted(kinds.items())))
    print("statuses:", dict(sorted(statuses.items())), "(0: the client gave up waiting)")
    print(f"KV blocks after the warm-up: {warm_gauges['kv_cache_blocks_used']:.0f} used of "
          f"{warm_gauges['kv_cache_blocks_total']:.0f}; after the soak: {idle['kv_cache_blocks_used']:.0f} used, "
          f"{idle['kv_cache_blocks_cached']:.0f} holding cached prefixes, running {idle['num_requests_running']:.0f}, "
          f"waiting {idle['num_requests_waiting']:.0f}")
    print(f"RSS of the server's processes: {rss_start / 2**20:.1f} MiB after the warm-up, "
          f"{rss_end / 2**20:.1f} MiB after the soak ({(rss_end / rss_start - 1) * 100:+.2f} %)")
    print(f"drain: exit {code}; TGI stream's last event {tgi.events[-1] if tgi.events else None}; "
          f"OpenAI stream's last two {openai.events[-2:]}")

    assert not failures, failures[:10]
    assert all(status < 500 for status in statuses), statuses
    assert set(kinds) == {"tgi_json", "tgi_stream", "openai_json", "openai_stream", "disconnect_stream",
                          "give_up_waiting", "bad_input"}, kinds
    assert idle["kv_cache_blocks_used"] == 0 and idle["num_requests_running"] == 0, idle
    assert abs(rss_end / rss_start - 1) <= RSS_TOLERANCE, (rss_start, rss_end)

    # the group SIGTERM drained as a SIGTERM to the parent does
    for s in (tgi, openai):
        assert s.complete and s.error is None, s.error
    assert tgi.events[-1].get("error_type") == "incomplete_generation", tgi.events[-1]
    assert openai.events[-1] == "[DONE]"
    assert openai.events[-2]["choices"][0]["finish_reason"] == "abort", openai.events[-2]
    log = server.log()
    assert code == 0, log[-4000:]
    assert "Traceback" not in log and "leaked semaphore" not in log and "Exception in ASGI" not in log
    drained = [json.loads(line) for line in log.splitlines() if '"msg": "drained"' in line]
    assert drained and drained[-1]["unfinished_streams"] == 0 and drained[-1]["kv_blocks_used"] == 0, drained
