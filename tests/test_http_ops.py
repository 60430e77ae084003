"""Operations against live servers: metrics, cancellation, overload, API key, limits."""

import concurrent.futures
import json
import time

import httpx
import pytest

from tests.conftest import GUARDED_API_KEY, metric_value, read_sse

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(live_server):
    with httpx.Client(base_url=live_server, timeout=60) as c:
        yield c


def metrics(client) -> str:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def wait_idle(client, timeout: float = 10.0) -> str:
    """Metrics text once nothing runs or waits and the KV cache holds no blocks."""
    deadline = time.monotonic() + timeout
    while True:
        text = metrics(client)
        if (metric_value(text, "llm_num_requests_running") == 0
                and metric_value(text, "llm_num_requests_waiting") == 0
                and metric_value(text, "llm_kv_cache_blocks_used") == 0):
            return text
        if time.monotonic() > deadline:
            pytest.fail(f"server not idle after {timeout} s:\n" + "\n".join(
                line for line in text.splitlines() if line.startswith("llm_num") or "kv_cache" in line))
        time.sleep(0.05)


def test_health_docs_and_request_id(client):
    r = client.get("/health", headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.headers["x-request-id"] == "trace-42"
    assert len(client.get("/health").headers["x-request-id"]) == 32
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions",
            "/v1/models", "/health", "/metrics"} <= set(paths)


def test_metrics_move_after_a_known_request(client, model_name):
    before = wait_idle(client)
    r = client.post("/v1/completions", json={"model": model_name, "prompt": "Count: one, two,",
                                             "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 4
    after = wait_idle(client)

    def delta(name, labels=""):
        return metric_value(after, name, labels) - metric_value(before, name, labels)

    assert delta("llm_prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("llm_generation_tokens_total") == 4
    assert delta("llm_sampled_tokens_total") == 4
    assert delta("llm_requests_finished_total", 'reason="length"') == 1
    assert delta("llm_requests_finished_total", 'reason="abort"') == 0
    assert delta("llm_time_to_first_token_seconds_count") == 1
    assert delta("llm_e2e_request_latency_seconds_count") == 1
    assert delta("llm_request_queue_time_seconds_count") == 1
    assert delta("llm_inter_token_latency_seconds_count") == 3
    assert delta("llm_inter_token_latency_seconds_sum") > 0
    assert delta("llm_http_requests_total", 'method="POST",route="/v1/completions",status="200"') == 1
    assert metric_value(after, "llm_kv_cache_blocks_total") > 0
    assert metric_value(after, "llm_kv_cache_usage_ratio") == 0


def test_kv_cache_is_in_use_while_generating(client):
    wait_idle(client)
    with client.stream("POST", "/generate_stream", json={
            "inputs": "Tell me a story.", "parameters": {"max_new_tokens": 12, "ignore_eos": True}}) as r:
        events = read_sse(r)
        next(events)
        during = metrics(client)
        assert metric_value(during, "llm_num_requests_running") == 1
        assert metric_value(during, "llm_kv_cache_usage_ratio") > 0
        list(events)
    wait_idle(client)


def test_disconnect_mid_stream_aborts_and_frees_the_kv_cache(client, live_server):
    before = wait_idle(client)
    with httpx.Client(base_url=live_server, timeout=60) as other:
        with other.stream("POST", "/generate_stream", json={
                "inputs": "Write a long poem about the sea.",
                "parameters": {"max_new_tokens": 400, "ignore_eos": True}}) as r:
            events = read_sse(r)
            next(events)
            next(events)
        # leaving the block closes the connection with the answer unfinished
    disconnected = time.monotonic()
    after = wait_idle(client, timeout=10)
    assert time.monotonic() - disconnected < 2.0    # a decode step is tens of ms; polling and slack
    assert metric_value(after, "llm_requests_finished_total", 'reason="abort"') == \
        metric_value(before, "llm_requests_finished_total", 'reason="abort"') + 1
    generated = (metric_value(after, "llm_generation_tokens_total")
                 - metric_value(before, "llm_generation_tokens_total"))
    assert 2 <= generated < 400


def test_cancelled_non_streaming_request_is_aborted(client, live_server):
    before = wait_idle(client)
    with httpx.Client(base_url=live_server, timeout=httpx.Timeout(60, read=1.0)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post("/generate", json={"inputs": "Write a long poem about the sea.",
                                              "parameters": {"max_new_tokens": 400, "ignore_eos": True}})
    gave_up = time.monotonic()
    after = wait_idle(client, timeout=10)
    assert time.monotonic() - gave_up < 2.0
    assert metric_value(after, "llm_requests_finished_total", 'reason="abort"') == \
        metric_value(before, "llm_requests_finished_total", 'reason="abort"') + 1
    assert (metric_value(after, "llm_generation_tokens_total")
            - metric_value(before, "llm_generation_tokens_total")) < 400
    assert client.get("/health").status_code == 200


def server_log(server) -> tuple[list[str], list[dict]]:
    lines = [line for line in server.log_path.read_text().splitlines() if line.strip()]
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    return lines, records


def test_logs_have_per_request_timings_and_no_prompt_text(client, start_server):
    marker = "zebra-quokka-4711"
    r = client.post("/generate", json={"inputs": f"Repeat: {marker}", "parameters": {"max_new_tokens": 2}},
                    headers={"X-Request-Id": "log-check-1"})
    assert r.status_code == 200
    deadline = time.monotonic() + 5
    while True:     # the access line is written once the response has gone out
        lines, records = server_log(start_server())
        mine = [rec for rec in records if rec.get("request_id") == "log-check-1"]
        if len(mine) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert marker not in "\n".join(lines)
    finished = next(rec for rec in mine if rec["msg"] == "request finished")
    assert {"queue_s", "ttft_s", "total_s", "prompt_tokens", "completion_tokens"} <= set(finished)
    access = next(rec for rec in mine if rec["msg"] == "request")
    assert access["status"] == 200 and access["duration_s"] > 0 and access["path"] == "/generate"


def test_every_log_line_is_json(client, start_server):
    lines, records = server_log(start_server())
    assert len(records) == len(lines), [line for line in lines if not line.startswith('{"ts"')][:5]


# ---------------------------------------------------------------- the guarded server

AUTH = {"Authorization": f"Bearer {GUARDED_API_KEY}"}


@pytest.fixture(scope="module")
def guarded(guarded_server):
    with httpx.Client(base_url=guarded_server.url, timeout=60, headers=AUTH) as c:
        yield c


def test_overload_gets_429_while_admitted_requests_complete(guarded):
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 6, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(lambda _: guarded.post("/generate", json=body), range(10)))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) >= 2      # the waiting queue holds two
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert "overloaded" in r.json()["error"]
    texts = {r.json()["generated_text"] for r in responses if r.status_code == 200}
    assert len(texts) == 1 and texts.pop()
    text = guarded.get("/metrics").text
    assert metric_value(text, "llm_requests_rejected_total", 'reason="queue_full"') >= statuses.count(429)
    assert guarded.get("/health").status_code == 200


def test_api_key_is_required_everywhere_but_health(guarded_server):
    url = guarded_server.url
    assert httpx.get(url + "/health").status_code == 200
    for method, path in (("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/docs"),
                         ("POST", "/generate"), ("POST", "/v1/chat/completions")):
        r = httpx.request(method, url + path, json={})
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(url + "/v1/completions", json={}, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_body_and_prompt_limits(guarded):
    r = guarded.post("/generate", json={"inputs": "x" * 5000})
    assert r.status_code == 413 and "4096" in r.json()["error"]
    r = guarded.post("/generate", json={"inputs": "word " * 200, "parameters": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "48" in r.json()["error"]
    r = guarded.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200
    assert guarded.get("/health").status_code == 200
