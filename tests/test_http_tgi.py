"""TGI-shaped requests with httpx against a live server on the real model."""

import time

import httpx
import pytest

from tests.conftest import read_sse

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(live_server):
    with httpx.Client(base_url=live_server, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def streamed_answer(client):
    """The streamed answer to the question, as (arrival time, payload) events."""
    with client.stream("POST", "/generate", json={
            "messages": QUESTION, "stream": True,
            "parameters": {"max_new_tokens": 16, "do_sample": False}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return list(read_sse(r))


def test_streamed_generate_answers_paris_with_a_final_event(streamed_answer):
    payloads = [p for _, p in streamed_answer]
    final = payloads[-1]
    assert "Paris" in final["generated_text"]
    assert final["details"]["finish_reason"] in ("eos_token", "length")
    assert all(p["generated_text"] is None for p in payloads[:-1])
    assert "".join(p["token"]["text"] for p in payloads) == final["generated_text"]
    assert final["details"]["generated_tokens"] == len(payloads)


def test_events_arrive_while_tokens_are_still_being_produced(client):
    sent = time.monotonic()
    with client.stream("POST", "/generate_stream", json={
            "inputs": "Once upon a time", "parameters": {"max_new_tokens": 48, "ignore_eos": True}}) as r:
        arrivals = [t for t, _ in read_sse(r)]
    assert len(arrivals) == 48
    # Streamed, 47 of the 48 decode steps lie between the first event and the last; buffered, all
    # events would arrive together at the end. The short prompt keeps prefill a small share.
    assert arrivals[-1] - arrivals[0] > 0.5 * (arrivals[-1] - sent)
    assert len({round(t, 3) for t in arrivals}) > len(arrivals) // 2


def test_non_streamed_text_equals_streamed_text(client, streamed_answer):
    r = client.post("/generate", json={"messages": QUESTION,
                                       "parameters": {"max_new_tokens": 16, "do_sample": False}})
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.json()["generated_text"] == streamed_answer[-1][1]["generated_text"]


def test_generate_stream_events_are_shaped_like_tgi(client):
    with client.stream("POST", "/generate_stream", json={
            "inputs": "Once upon a time", "parameters": {"max_new_tokens": 5, "ignore_eos": True}}) as r:
        payloads = [p for _, p in read_sse(r)]
    assert [p["index"] for p in payloads] == [1, 2, 3, 4, 5]
    for p in payloads:
        token = p["token"]
        assert set(token) == {"id", "text", "logprob", "special"}
        assert isinstance(token["id"], int) and isinstance(token["text"], str)
        assert token["logprob"] <= 0 and token["special"] is False
    details = payloads[-1]["details"]
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 5
    assert details["input_length"] > 0 and "seed" in details


def test_details_and_stop_sequences(client):
    r = client.post("/generate", json={"messages": QUESTION, "parameters": {
        "max_new_tokens": 16, "details": True, "stop": [" is"]}})
    body = r.json()
    assert body["generated_text"] == "The capital of France is"      # TGI keeps the stop sequence
    assert body["details"]["finish_reason"] == "stop_sequence"
    assert body["details"]["generated_tokens"] == len(body["details"]["tokens"])


def test_seeded_sampling_is_reproducible(client):
    body = {"inputs": "My favourite colour is", "parameters": {
        "max_new_tokens": 4, "do_sample": True, "temperature": 1.2, "seed": 1234, "details": True}}
    first, second = client.post("/generate", json=body).json(), client.post("/generate", json=body).json()
    assert first["generated_text"] == second["generated_text"]
    assert first["details"]["seed"] == 1234


@pytest.mark.parametrize("body, status, words", [
    ({"inputs": ""}, 422, ["inputs"]),
    ({"inputs": "hi", "parameters": {"max_new_tokens": 0}}, 422, ["max_new_tokens"]),
    ({"inputs": "hi", "parameters": {"max_new_tokens": -3}}, 422, ["max_new_tokens"]),
    ({"inputs": "hi", "parameters": {"max_new_tokens": 10_000_000}}, 400,
     ["max_new_tokens", "10000000", "context"]),
    ({"inputs": "hi", "parameters": {"max_new_tokens": "ten"}}, 422, ["max_new_tokens"]),
    ({"inputs": ["hi"]}, 422, ["inputs"]),
    ({"inputs": "hi", "parameters": {"temperature": "hot"}}, 422, ["temperature"]),
    ({"inputs": "hi", "stream": "maybe"}, 422, ["stream"]),
    ({"parameters": {"max_new_tokens": 2}}, 422, ["inputs", "messages"]),
    ({"messages": "hello"}, 422, ["messages"]),
])
def test_bad_input_answers_4xx_naming_the_problem(client, body, status, words):
    r = client.post("/generate", json=body)
    assert r.status_code == status, r.text
    message = r.json()["error"]
    for word in words:
        assert word in message, (word, message)
    assert "Traceback" not in r.text


def test_malformed_json_answers_400_and_the_server_keeps_serving(client):
    r = client.post("/generate", content=b'{"inputs": "hi", "parameters": {', 
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    r = client.post("/generate", json={"inputs": "The sky is", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["generated_text"]
    assert client.get("/health").status_code == 200


def test_over_context_names_both_numbers(client):
    context = client.get("/info").json()["max_total_tokens"]
    r = client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": context}})
    assert r.status_code == 400
    message = r.json()["error"]
    assert str(context) in message and "prompt (" in message


def test_every_sampling_option_is_served(client):
    r = client.post("/generate", json={"inputs": "Write a list of fruits:", "parameters": {
        "max_new_tokens": 3, "do_sample": True, "temperature": 0.8, "top_k": 20, "top_p": 0.9,
        "repetition_penalty": 1.3, "seed": 7}})
    assert r.status_code == 200, r.text
    assert client.get("/health").status_code == 200
