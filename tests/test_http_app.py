"""The HTTP layer against a scripted in-process engine: fast, and able to produce the engine
failures (errors mid-stream, a full queue, a crash) that the real model never shows on cue."""

import asyncio
import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.engine.config import EngineConfig
from server.engine.core import ModelInfo
from server.engine.errors import QueueFullError
from server.engine.params import FinishEvent, SamplingParams, TokenEvent
from server.settings import Settings


class CharTokenizer:
    """One token per character; ids are code points + 10."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) + 10 for c in text]

    def decode(self, ids, **_) -> str:
        return "".join(chr(max(i - 10, 0)) for i in ids)

    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False) -> dict:
        out = {"input_ids": self.encode(text)}
        if return_offsets_mapping:
            out["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
        return out

    def convert_ids_to_tokens(self, ids):
        return [chr(max(i - 10, 0)) for i in ids] if isinstance(ids, list) else chr(max(ids - 10, 0))

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __len__(self) -> int:
        return 1000


class Stats:
    def __init__(self, running, waiting, total, used):
        self.running, self.waiting, self.kv_blocks_total, self.kv_blocks_used = running, waiting, total, used


class FakeStream:
    def __init__(self, request_id, prompt_tokens):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.queue.get()

    def has_ready_events(self) -> bool:
        return not self.queue.empty()


class FakeEngine:
    """Emits "w0 w1 ..." one word per token; ``mode`` scripts failures."""

    def __init__(self, max_model_len=64, mode="ok", token_delay=0.0):
        self.tokenizer = CharTokenizer()
        self.config = EngineConfig()
        self.max_model_len = max_model_len
        self.model_name = "fake-model"
        # as stats() counts: 100 blocks of 16 tokens
        self.info = ModelInfo(self.model_name, max_model_len, 1600, 16, 100, len(self.tokenizer))
        self.ready = False
        self.error = None
        self.mode = mode
        self.token_delay = token_delay
        self.requests: list[tuple[list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.active: dict[str, asyncio.Task] = {}
        self.started = self.stopped = False

    def start(self):
        self.started = self.ready = True

    def shutdown(self):
        self.stopped = True

    def stats(self):
        return Stats(len(self.active), 0, 100, 4 * len(self.active))

    def add_request(self, prompt_ids, params, request_id=None, follows=None):
        if self.mode == "full":
            raise QueueFullError("3 requests are waiting (limit 3)", retry_after=2.0)
        if self.mode == "crash":
            raise RuntimeError("secret internal detail")
        self.requests.append((prompt_ids, params))
        stream = FakeStream(request_id, len(prompt_ids))
        self.active[request_id] = asyncio.get_running_loop().create_task(self._produce(stream, params))
        return stream

    def abort(self, request_id):
        self.aborted.append(request_id)
        task = self.active.pop(request_id, None)
        if task:
            task.cancel()

    async def _produce(self, stream: FakeStream, params: SamplingParams):
        start = time.monotonic()
        text = ""
        for i in range(params.max_new_tokens):
            if self.mode == "error" and i == 2:
                stream.queue.put_nowait(FinishEvent("error", text, stream.prompt_tokens, i,
                                                    error="CUDA exploded"))
                self.active.pop(stream.request_id, None)
                return
            await asyncio.sleep(self.token_delay)
            piece = f"w{i} "
            text += piece
            last = i == params.max_new_tokens - 1
            stream.queue.put_nowait(TokenEvent(100 + i, piece, -0.25, False, time.monotonic(), last))
        stream.queue.put_nowait(FinishEvent("length", text, stream.prompt_tokens, params.max_new_tokens,
                                            timings={"queue": 0.001, "ttft": 0.002,
                                                     "total": time.monotonic() - start}))
        self.active.pop(stream.request_id, None)


def client_for(engine=None, **settings) -> TestClient:
    # Server errors must come back as responses, as a real client would see them.
    return TestClient(create_app(engine or FakeEngine(), Settings(**settings)),
                      raise_server_exceptions=False)


def sse_data(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_generate_json_and_greedy_when_do_sample_false():
    engine = FakeEngine()
    with client_for(engine) as client:
        r = client.post("/generate", json={"inputs": "hello", "parameters": {
            "max_new_tokens": 3, "do_sample": False, "temperature": 0.7, "details": True}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["generated_text"] == "w0 w1 w2 "
        assert body["details"]["finish_reason"] == "length"
        assert body["details"]["generated_tokens"] == 3
        assert [t["text"] for t in body["details"]["tokens"]] == ["w0 ", "w1 ", "w2 "]
        prompt_ids, params = engine.requests[-1]
        assert prompt_ids == CharTokenizer().encode("hello")
        assert params.temperature == 0.0 and params.max_new_tokens == 3


def test_sampling_reports_the_seed_it_used():
    engine = FakeEngine()
    with client_for(engine) as client:
        r = client.post("/generate", json={"inputs": "hi", "parameters": {
            "max_new_tokens": 1, "do_sample": True, "temperature": 0.5, "details": True}})
        seed = r.json()["details"]["seed"]
        assert isinstance(seed, int)
        assert engine.requests[-1][1].seed == seed and engine.requests[-1][1].temperature == 0.5


def test_tgi_stream_last_token_carries_text_and_details():
    with client_for() as client:
        r = client.post("/generate_stream", json={"inputs": "hello", "parameters": {"max_new_tokens": 4}})
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_data(r.text)
        assert [e["index"] for e in events] == [1, 2, 3, 4]
        assert all(e["generated_text"] is None for e in events[:-1])
        assert events[-1]["generated_text"] == "w0 w1 w2 w3 "
        assert events[-1]["details"]["finish_reason"] == "length"
        assert events[-1]["details"]["input_length"] == 5
        assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"]


def test_chat_messages_use_the_chat_template():
    engine = FakeEngine()
    with client_for(engine) as client:
        r = client.post("/generate", json={"messages": [{"role": "user", "content": "hi"}],
                                           "parameters": {"max_new_tokens": 1}})
        assert r.status_code == 200, r.text
        assert CharTokenizer().decode(engine.requests[-1][0]) == "<user>hi<assistant>"


@pytest.mark.parametrize("body, field", [
    ({"inputs": ""}, "inputs"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
    ({"inputs": "x", "parameters": {"max_new_tokens": "many"}}, "parameters.max_new_tokens"),
    ({"inputs": 5}, "inputs"),
    ({"inputs": "x", "parameters": {"temprature": 1}}, "parameters.temprature"),
    ({"inputs": "x", "messages": [{"role": "user", "content": "y"}]}, "exactly one"),
    ({"messages": [{"role": "robot", "content": "y"}]}, "messages.0.role"),
    ({"inputs": "x", "parameters": {"typical_p": 0.5}}, "typical_p"),
])
def test_invalid_tgi_bodies_answer_422_naming_the_field(body, field):
    with client_for() as client:
        r = client.post("/generate", json=body)
        assert r.status_code == 422, r.text
        assert field in r.json()["error"]
        assert r.json()["error_type"] == "validation"
        assert client.get("/health").status_code == 200


def test_openai_422_has_openai_shape():
    with client_for() as client:
        r = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": [],
                                                      "max_tokens": 1})
        assert r.status_code == 422
        assert r.json()["error"]["param"] == "messages"
        r = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404 and "nope" in r.json()["error"]["message"]


def test_malformed_json_answers_400():
    with client_for() as client:
        r = client.post("/generate", content=b'{"inputs": "x",', headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert "JSON" in r.json()["error"]


def test_a_number_of_too_many_digits_is_a_400_in_the_clients_terms():
    """Python's JSON parser refuses integers over 4300 digits with advice about its own settings."""
    with client_for() as client:
        for path in ("/generate", "/v1/completions"):
            r = client.post(path, content=b'{"max_tokens": ' + b"9" * 5000 + b"}",
                            headers={"content-type": "application/json"})
            assert r.status_code == 400
            message = r.json()["error"] if path == "/generate" else r.json()["error"]["message"]
            assert message == "malformed JSON body: a number of more than 4300 digits", message


def test_context_overflow_names_both_numbers():
    with client_for(FakeEngine(max_model_len=64)) as client:
        r = client.post("/generate", json={"inputs": "a" * 10, "parameters": {"max_new_tokens": 60}})
        assert r.status_code == 400
        message = r.json()["error"]
        assert "10" in message and "60" in message and "64" in message
        r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "a" * 70})
        assert r.status_code == 400 and "70" in r.json()["error"]["message"]


def test_prompt_token_limit():
    with client_for(FakeEngine(max_model_len=64), max_prompt_tokens=8) as client:
        r = client.post("/generate", json={"inputs": "a" * 9, "parameters": {"max_new_tokens": 1}})
        assert r.status_code == 400 and "9" in r.json()["error"] and "8" in r.json()["error"]


def test_a_prompt_over_the_limit_is_named_by_the_field_that_sent_it():
    with client_for(FakeEngine(max_model_len=64), max_prompt_tokens=8) as client:
        long = "a" * 9
        for path, body, field in [
                ("/generate", {"inputs": long}, "inputs"),
                ("/generate", {"messages": [{"role": "user", "content": long}]}, "messages"),
                ("/v1/completions", {"model": "fake-model", "prompt": long}, "prompt"),
                ("/v1/completions", {"model": "fake-model", "prompt": ["a", long]}, "prompt.1"),
                ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": long}]},
                 "messages")]:
            r = client.post(path, json=body)
            assert r.status_code == 400, r.text
            if path == "/generate":
                assert "over the limit of 8" in r.json()["error"]
            else:
                assert r.json()["error"]["param"] == field, (body, r.text)


def test_full_queue_answers_429_with_retry_after():
    with client_for(FakeEngine(mode="full")) as client:
        r = client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 1}})
        assert r.status_code == 429
        assert r.headers["retry-after"] == "2"
        r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "x", "stream": True})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        metrics = client.get("/metrics").text
        assert 'llm_requests_rejected_total{reason="queue_full"} 2.0' in metrics


def test_more_choices_than_the_queue_ever_admits_are_a_400_not_a_429():
    """A 429 asks the client to retry; prompts times n past the queue's bound never fit."""
    engine = FakeEngine()
    engine.config = EngineConfig(max_waiting_requests=5, max_waiting_tokens=100)
    with client_for(engine) as client:
        body = {"model": "fake-model", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "n" and "6 requests" in error["message"] and "--max-waiting-requests" in error["message"]
        r = client.post("/v1/completions", json={**body, "prompt": "abc", "n": 5, "max_tokens": 20})
        assert r.status_code == 400 and "115 tokens" in r.json()["error"]["message"], r.text
        assert not engine.requests
        assert client.post("/v1/completions", json={**body, "prompt": ["a"], "n": 5}).status_code == 200


def test_unexpected_exception_answers_500_without_traceback():
    with client_for(FakeEngine(mode="crash")) as client:
        r = client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 1}},
                        headers={"X-Request-Id": "boom-1"})
        assert r.status_code == 500 and r.headers["x-request-id"] == "boom-1"
        assert r.json() == {"error": "internal server error", "error_type": "internal"}
        assert "secret" not in r.text and "Traceback" not in r.text
        assert client.get("/health").status_code == 200


def test_engine_error_mid_stream_ends_with_an_error_event():
    with client_for(FakeEngine(mode="error")) as client:
        r = client.post("/generate", json={"inputs": "x", "stream": True,
                                           "parameters": {"max_new_tokens": 5}})
        events = sse_data(r.text)
        assert [e["token"]["text"] for e in events[:-1]] == ["w0 ", "w1 "]
        assert events[-1] == {"error": "generation failed: CUDA exploded", "error_type": "generation"}

        r = client.post("/v1/chat/completions", json={
            "model": "fake-model", "stream": True, "max_tokens": 5,
            "messages": [{"role": "user", "content": "x"}]})
        events = sse_data(r.text)
        assert events[-1]["error"]["message"] == "generation failed: CUDA exploded"
        assert "[DONE]" not in events

        r = client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 5}})
        assert r.status_code == 500 and "CUDA exploded" in r.json()["error"]
        assert 'llm_requests_finished_total{reason="error"} 3.0' in client.get("/metrics").text


def test_openai_stream_shapes_and_usage_chunk():
    with client_for() as client:
        r = client.post("/v1/chat/completions", json={
            "model": "fake-model", "stream": True, "max_tokens": 2,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "x"}]})
        events = sse_data(r.text)
        assert events[-1] == "[DONE]"
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [e["choices"][0]["delta"]["content"] for e in events[1:3]] == ["w0 ", "w1 "]
        assert events[3]["choices"][0]["finish_reason"] == "length"
        assert events[4]["choices"] == [] and events[4]["usage"]["completion_tokens"] == 2
        assert len({e["id"] for e in events[:-1]}) == 1


def test_completion_logprobs_and_echo():
    with client_for() as client:
        r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "ab", "max_tokens": 2,
                                                 "echo": True, "logprobs": 1})
        choice = r.json()["choices"][0]
        assert choice["text"] == "abw0 w1 "
        assert choice["logprobs"]["tokens"] == ["w0 ", "w1 "]
        assert choice["logprobs"]["text_offset"] == [2, 5]
        assert r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                                     "prompt_tokens_details": {"cached_tokens": 0}}


def test_token_id_prompts_are_checked_against_the_vocabulary():
    with client_for() as client:
        r = client.post("/v1/completions", json={"model": "fake-model", "prompt": [5, 99999]})
        assert r.status_code == 400 and "99999" in r.json()["error"]["message"]


def test_api_key_guards_everything_but_health():
    with client_for(api_key="s3cret") as client:
        assert client.get("/health").status_code == 200
        for path in ("/metrics", "/v1/models", "/docs", "/openapi.json"):
            r = client.get(path)
            assert r.status_code == 401, path
            assert r.headers["www-authenticate"] == "Bearer"
        assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=ok).json()["data"][0]["id"] == "fake-model"
        schema = client.get("/openapi.json", headers=ok).json()
        assert schema["paths"]["/generate"]["post"]["security"] == [{"bearer": []}]
        assert "security" not in schema["paths"]["/health"]["get"]


def test_body_size_limit():
    with client_for(max_body_bytes=100) as client:
        r = client.post("/generate", json={"inputs": "x" * 200})
        assert r.status_code == 413 and "100" in r.json()["error"]

        def chunks():
            yield b'{"inputs": "'
            yield b"x" * 200
            yield b'"}'
        r = client.post("/generate", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413


def test_request_id_is_echoed_or_generated():
    with client_for() as client:
        assert client.get("/health", headers={"X-Request-Id": "abc-123"}).headers["x-request-id"] == "abc-123"
        generated = client.get("/health", headers={"X-Request-Id": "bad id; <script>"}).headers["x-request-id"]
        assert generated != "bad id; <script>" and len(generated) == 32
        r = client.post("/generate", json={"inputs": 1}, headers={"X-Request-Id": "err-1"})
        assert r.headers["x-request-id"] == "err-1"


def test_health_is_503_while_loading_and_after_a_failed_load():
    release = threading.Event()

    def slow_loader():
        release.wait(10)
        return FakeEngine()

    with TestClient(create_app(settings=Settings(), loader=slow_loader)) as client:
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert client.post("/generate", json={"inputs": "x"}).status_code == 503
        release.set()
        deadline = time.monotonic() + 5
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.get("/health").json() == {"status": "ok", "model": "fake-model"}

    def broken_loader():
        raise FileNotFoundError("no such model")

    reported = []
    app = create_app(settings=Settings(), loader=broken_loader, on_load_error=reported.append)
    with TestClient(app) as client:
        deadline = time.monotonic() + 5
        while client.get("/health").json()["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.02)
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "error"
        assert reported == ["FileNotFoundError: no such model"]


def test_a_worker_whose_shared_core_has_loaded_waits_to_hear_so_rather_than_answer_loading():
    # Another worker has answered 200 (the core's flag is set) while this one's loader still runs:
    # requests here wait for it instead of getting "still loading"; before the flag, they do not wait.
    release, core_loaded = threading.Event(), threading.Event()

    def slow_loader():
        release.wait(10)
        return FakeEngine()

    app = create_app(settings=Settings(), loader=slow_loader, core_loaded=core_loaded.is_set)
    with TestClient(app) as client:
        started = time.monotonic()
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        assert client.post("/generate", json={"inputs": "x"}).status_code == 503
        assert time.monotonic() - started < 1.0
        core_loaded.set()
        threading.Timer(0.3, release.set).start()
        started = time.monotonic()
        r = client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        assert time.monotonic() - started >= 0.25
        assert client.get("/health").json() == {"status": "ok", "model": "fake-model"}


def test_engine_fatal_error_turns_health_503():
    engine = FakeEngine()
    with client_for(engine) as client:
        engine.error = "RuntimeError: step failed"
        assert client.get("/health").status_code == 503
        assert client.post("/generate", json={"inputs": "x"}).status_code == 503
    assert engine.stopped


def test_metrics_count_a_known_request():
    with client_for() as client:
        client.post("/v1/completions", json={"model": "fake-model", "prompt": "abc", "max_tokens": 4})
        text = client.get("/metrics").text
        for line in ('llm_prompt_tokens_total 3.0', 'llm_generation_tokens_total 4.0',
                     'llm_requests_finished_total{reason="length"} 1.0',
                     'llm_time_to_first_token_seconds_count 1.0',
                     'llm_inter_token_latency_seconds_count 3.0',
                     'llm_e2e_request_latency_seconds_count 1.0',
                     'llm_request_queue_time_seconds_count 1.0',
                     'llm_inter_token_latency_seconds_bucket{le="0.0001"}'):
            assert line in text, line


def test_openapi_documents_the_accepted_bodies():
    with client_for() as client:
        schema = client.get("/openapi.json").json()
        for path in ("/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions",
                     "/v1/models", "/health", "/metrics"):
            assert path in schema["paths"], path
        params = schema["components"]["schemas"]["GenerateParameters"]["properties"]
        assert {"max_new_tokens", "temperature", "top_p", "top_k", "do_sample", "seed", "stop",
                "repetition_penalty", "details"} <= set(params)
        assert client.get("/docs").status_code == 200


@pytest.mark.parametrize("path, body, field", [
    ("/generate", {"inputs": "a\ud800"}, "inputs"),
    ("/v1/completions", {"model": "fake-model", "prompt": "\udfff"}, "prompt"),
    ("/v1/completions", {"model": "\ud800", "prompt": "x"}, "model"),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "\ud800"}]},
     "messages.0.content"),
    ("/generate", {"inputs": "x", "\ud800": 1}, "body"),
])
def test_lone_surrogates_answer_422(path, body, field):
    with client_for() as client:
        r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert field in r.text


def test_degenerate_sampling_values_are_made_plain():
    engine = FakeEngine()
    with client_for(engine) as client:
        r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "x", "max_tokens": 1,
                                                 "temperature": 1e-300, "top_k": 10**6})
        assert r.status_code == 200
        params = engine.requests[-1][1]
        assert params.temperature == 0.0 and params.top_k == 0
        r = client.post("/generate", json={"inputs": "x", "parameters": {
            "max_new_tokens": 1, "do_sample": True, "temperature": 0.7, "top_k": 999, "details": True}})
        params = engine.requests[-1][1]
        assert params.temperature == 0.7 and params.top_k == 999
        assert params.seed is not None and r.json()["details"]["seed"] == params.seed


@pytest.mark.parametrize("log_prompts", [False, True])
def test_generation_log_has_timings_and_prompt_only_in_debug(caplog, log_prompts):
    caplog.set_level("INFO", logger="server.generation")
    with client_for(log_prompts=log_prompts) as client:
        client.post("/generate", json={"inputs": "secret prompt", "parameters": {"max_new_tokens": 2}},
                    headers={"X-Request-Id": "log-1"})
    [record] = [r for r in caplog.records if r.name == "server.generation"]
    fields = record.fields
    assert fields["request_id"] == "log-1" and fields["finish_reason"] == "length"
    assert {"queue_s", "ttft_s", "total_s", "tokenize_s", "prompt_tokens", "completion_tokens"} <= set(fields)
    assert ("prompt" in fields) == log_prompts
    assert ("secret prompt" in json.dumps(fields)) == log_prompts
    assert "request_to_tokenize_s" not in fields


@pytest.mark.parametrize("header, logged", [("t={}", True), ("{}", True), ("t=soon", False), ("t=nan", False)])
def test_x_request_start_times_the_way_in(caplog, header, logged):
    caplog.set_level("INFO", logger="server.generation")
    sent = time.time() - 0.25
    with client_for() as client:
        client.post("/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 1}},
                    headers={"X-Request-Start": header.format(sent)})
    [record] = [r for r in caplog.records if r.name == "server.generation"]
    way_in = record.fields.get("request_to_tokenize_s")
    assert (way_in is not None) == logged
    assert way_in is None or 0.25 <= way_in < 5
    assert record.fields.get("request_start") == (pytest.approx(sent) if logged else None)


def test_json_log_lines():
    from server.logging_config import JsonFormatter
    import logging
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello %s", ("world",), None)
    record.fields = {"request_id": "r1", "duration_s": 0.5}
    line = json.loads(JsonFormatter().format(record))
    assert line["msg"] == "hello world" and line["request_id"] == "r1" and line["level"] == "info"
