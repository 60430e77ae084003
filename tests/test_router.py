"""Two replicas behind the real SGLang Model Gateway (``sglang-router``) on loopback ports.

Affinity (cache_aware keeps a shared prefix on one replica; round_robin scatters it), failover (a
replica killed under load, then back) and drain (SIGTERM under load). The router runs with the
flags the Compose profile and the manifests use (load_tests.replicas.ROUTER_FLAGS).
"""

import json
import random
import signal
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from load_tests.replicas import replica, router_workers, start_router, wait_healthy
from tests.conftest import free_port, metric_value

pytestmark = pytest.mark.slow

MODEL = "random:tiny"
BLOCK = 16
SERVER_ARGS = ["--model", MODEL, "--block-size", str(BLOCK), "--shutdown-timeout", "30"]
START_TIMEOUT = 300.0
WORDS = ("river stone lantern orbit maple signal copper harbor meadow engine velvet quartz tundra "
         "falcon ember prism canyon willow beacon saddle thunder garnet marble pixel nectar").split()


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("router")


@pytest.fixture(scope="module")
def replicas(log_dir):
    started = [replica(i, free_port(), SERVER_ARGS, log_dir).start() for i in range(2)]
    try:
        for r in started:
            wait_healthy(r, START_TIMEOUT)
        yield started
    finally:
        for r in started:
            r.stop(timeout=40)


def restart(r) -> None:
    r.stop(timeout=40)
    r.start()
    wait_healthy(r, START_TIMEOUT)


@pytest.fixture()
def router(replicas, log_dir):
    """A factory: the router over both replicas with a policy; stopped after the test."""
    routers = []

    def start(policy: str):
        for r in replicas:
            if not r.alive():
                restart(r)
        routers.append(start_router([r.url for r in replicas], free_port(), log_dir, policy=policy,
                                    prometheus_port=free_port()))
        return routers[-1]
    yield start
    for rt in routers:
        rt.stop(timeout=10)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def complete(url: str, prompt: str, max_tokens: int = 1) -> dict:
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def finished(url: str) -> float:
    text = metrics(url)
    return sum(metric_value(text, "llm_requests_finished_total", f'reason="{r}"')
               for r in ("length", "stop", "eos", "abort", "error"))


# ---- affinity ---------------------------------------------------------------------------------

def prefix_series(url: str, seed: int, groups: int = 3, rounds: int = 4) -> list[tuple[int, int, int]]:
    """(group, prompt tokens, cached tokens) of requests sent one after another: ``groups`` long
    prefixes (about 20 blocks each), each asked ``rounds`` times with a new question, interleaved."""
    rng = random.Random(seed)
    prefixes = [f"Document {seed}-{g}: " + words(rng, 300) for g in range(groups)]
    out = []
    for k in range(rounds):
        for g, prefix in enumerate(prefixes):
            usage = complete(url, f"{prefix}\nQuestion {k}: {words(rng, 6)}?")["usage"]
            out.append((g, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
    return out


def cached_share(series) -> float:
    return sum(c for _, _, c in series) / sum(p for _, p, _ in series)


def test_the_router_lists_the_served_model(router, replicas):
    url = router("cache_aware").url
    listed = httpx.get(url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in listed] == [MODEL]         # the gateway's own list, from /server_info
    assert complete(url, "Hello there")["model"] == MODEL
    r = httpx.post(url + "/v1/completions", json={"model": "no-such-model", "prompt": "hi", "max_tokens": 1},
                   timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_cache_aware_keeps_a_shared_prefix_on_one_replica_round_robin_does_not(router, replicas):
    aware = prefix_series(router("cache_aware").url, seed=1)
    robin = prefix_series(router("round_robin").url, seed=2)
    print(f"\ncached-token share: cache_aware {cached_share(aware):.3f}, round_robin {cached_share(robin):.3f}")
    seen: set[int] = set()
    for g, prompt, cached in aware:
        if g in seen:       # from the second request of a prefix on, its blocks are found
            assert cached >= 0.8 * prompt and cached >= 10 * BLOCK, (g, prompt, cached, aware)
        seen.add(g)
    # Round robin sends a prefix's second request to the other replica, which has none of it.
    second = [cached for i, (g, _, cached) in enumerate(robin) if i // 3 == 1]
    assert second.count(0) >= 2, robin
    assert cached_share(robin) < cached_share(aware) - 0.1


# ---- failover and drain -----------------------------------------------------------------------

@dataclass
class Outcome:
    sent: float
    ended: float
    status: int | None = None
    tokens: int = 0
    done: bool = False
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.finish_reason == "length" and self.error is None


class Traffic:
    """Clients streaming completions through the router, each with a prompt of its own (so that
    cache_aware spreads them by load), until stopped."""

    def __init__(self, url: str, clients: int = 4, max_tokens: int = 16, seed: int = 0):
        self.url, self.max_tokens, self.seed = url, max_tokens, seed
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def wait_sent_after(self, moment: float, count: int, timeout: float = 180.0) -> None:
        """Until ``count`` requests sent after ``moment`` have ended."""
        deadline = time.monotonic() + timeout
        while sum(o.sent > moment for o in self.outcomes) < count:
            assert time.monotonic() < deadline, f"fewer than {count} requests ended in {timeout} s"
            time.sleep(0.1)

    def _client(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        with httpx.Client(timeout=httpx.Timeout(120, connect=10)) as client:
            while not self._stop.is_set():
                self.outcomes.append(self._one(client, f"{rng.random():.12f} {words(rng, 12)}"))

    def _one(self, client: httpx.Client, prompt: str) -> Outcome:
        out = Outcome(sent=time.monotonic(), ended=0.0)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True}
        try:
            with client.stream("POST", self.url + "/v1/completions", json=body) as r:
                out.status = r.status_code
                if r.status_code != 200:
                    out.error = r.read().decode(errors="replace")[:300]
                for line in r.iter_lines() if r.status_code == 200 else ():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        out.done = True
                        continue
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        out.error = json.dumps(chunk["error"])[:300]
                        continue
                    out.tokens += 1
                    out.finish_reason = chunk["choices"][0]["finish_reason"] or out.finish_reason
        except httpx.HTTPError as e:
            out.error = f"{type(e).__name__}: {e}"
        out.ended = time.monotonic()
        return out


def wait_running(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while metric_value(metrics(url), "llm_num_requests_running") < 1:
        assert time.monotonic() < deadline, "the replica never had a request running"
        time.sleep(0.05)


def test_failover_a_killed_replica_fails_only_its_own_streams_and_is_used_again(router, replicas):
    rt = router("cache_aware")
    survivor, victim = replicas
    with Traffic(rt.url) as traffic:
        wait_running(victim.url)
        victim.signal(signal.SIGKILL)
        killed = time.monotonic()
        victim.proc.wait(timeout=10)
        traffic.wait_sent_after(killed, 8)
    outcomes = traffic.outcomes
    after = [o for o in outcomes if o.sent > killed]
    failed = [o for o in outcomes if not o.ok]
    print(f"\n{len(outcomes)} requests, {len(after)} sent after the kill, {len(failed)} failed: "
          + "; ".join(f"{o.error} after {o.tokens} tokens" for o in failed))
    assert len(after) >= 8 and all(o.ok for o in after), [o for o in after if not o.ok]
    # Only streams that were running on the killed replica fail: sent before the kill, ended after
    # it, with the response started and then cut (no [DONE]), which the client sees as an error.
    assert 1 <= len(failed) <= 4, failed
    for o in failed:
        assert o.sent < killed < o.ended and o.status == 200 and not o.done, o
        assert "incomplete chunked read" in o.error or "peer closed" in o.error, o

    restart(victim)
    deadline = time.monotonic() + 30
    while not router_workers(rt.url)[victim.url]["is_healthy"]:
        assert time.monotonic() < deadline, "the router did not take the replica back"
        time.sleep(0.2)
    # cache_aware sends a prompt that matches no replica's history to the least loaded replica
    # (the first listed, when both are idle): under concurrent load the returned one gets some.
    back = time.monotonic()
    with Traffic(rt.url, seed=1) as traffic:
        traffic.wait_sent_after(back, 8)
    assert all(o.ok for o in traffic.outcomes), [o for o in traffic.outcomes if not o.ok]
    assert finished(victim.url) >= 1, "the router sent nothing to the replica that came back"


def test_drain_a_replica_told_to_stop_loses_no_request(router, replicas):
    rt = router("cache_aware")
    survivor, draining = replicas
    with Traffic(rt.url) as traffic:
        wait_running(draining.url)
        draining.signal(signal.SIGTERM)
        told = time.monotonic()
        assert draining.proc.wait(timeout=60) == 0, draining.log_tail()
        traffic.wait_sent_after(told, 8)
    outcomes = traffic.outcomes
    log = draining.log_path.read_text(errors="replace")
    drain = [json.loads(line) for line in log.splitlines() if '"msg": "draining: ' in line][0]
    drained = [json.loads(line) for line in log.splitlines() if '"msg": "drained"' in line][-1]
    after = [o for o in outcomes if o.sent > told]
    print(f"\n{len(outcomes)} requests, {len(after)} sent after SIGTERM, {drain['running_requests']} running "
          f"on the replica then; failed: {[o for o in outcomes if not o.ok]}")
    assert drain["running_requests"] >= 1 and drained["unfinished_streams"] == 0
    assert len(after) >= 8
    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok]
