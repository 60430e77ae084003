"""Clients written for vLLM: its extension fields are honoured, unknown fields ignored with one
warning, known fields with bad values still refused; error messages that say what is wrong."""

import json
import logging

import httpx
import pytest

from server.engine import Engine, SamplingParams
from server.engine.params import FinishEvent, TokenEvent

from .helpers import run_all
from .test_http_app import FakeEngine, client_for, sse_data

OPENAI = [("/v1/completions", {"model": "fake-model", "prompt": "hi"}),
          ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]})]


@pytest.mark.parametrize("path, base", OPENAI)
def test_extension_fields_reach_the_engine(path, base):
    engine = FakeEngine()
    with client_for(engine) as client:
        r = client.post(path, json={**base, "max_tokens": 5, "min_tokens": 3, "ignore_eos": True,
                                    "top_k": 7, "repetition_penalty": 1.3, "seed": 11,
                                    "stop_token_ids": [42, 43], "skip_special_tokens": True,
                                    "temperature": 0.5})
        assert r.status_code == 200, r.text
    params = engine.requests[-1][1]
    assert (params.max_new_tokens, params.min_tokens, params.ignore_eos, params.top_k,
            params.repetition_penalty, params.seed, params.stop_token_ids) == \
        (5, 3, True, 7, 1.3, 11, frozenset({42, 43}))


def test_vllm_top_k_minus_one_is_no_cut():
    engine = FakeEngine()
    with client_for(engine) as client:
        assert client.post("/v1/completions", json={**OPENAI[0][1], "top_k": -1}).status_code == 200
    assert engine.requests[-1][1].top_k == 0


@pytest.mark.parametrize("path, base", OPENAI)
def test_unknown_fields_are_ignored_with_one_warning_per_request(path, base, caplog):
    body = {**base, "max_tokens": 2, "min_p": 0.1, "use_beam_search": False,
            "stream_options": None, "spaces_between_special_tokens": True}
    if "messages" in base:
        body["messages"] = [{"role": "user", "content": "hi", "reasoning_content": ""}]
    with client_for() as client, caplog.at_level(logging.WARNING, logger="server.openai"):
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
    warnings = [rec for rec in caplog.records if rec.name == "server.openai" and rec.levelno == logging.WARNING]
    assert len(warnings) == 1
    ignored = warnings[0].fields["ignored_fields"]
    assert {"min_p", "use_beam_search", "spaces_between_special_tokens"} <= set(ignored)
    assert ("messages.0.reasoning_content" in ignored) == ("messages" in base)
    assert warnings[0].fields["request_id"] == r.headers["x-request-id"]


@pytest.mark.parametrize("extra, field", [
    ({"min_tokens": -1}, "min_tokens"),
    ({"top_k": -2}, "top_k"),
    ({"stop_token_ids": [-5]}, "stop_token_ids"),
    ({"stop_token_ids": "7"}, "stop_token_ids"),
    ({"skip_special_tokens": "sometimes"}, "skip_special_tokens"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": "sometimes"}}, "stream_options.continuous_usage_stats"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"best_of": 2}, "best_of"),
])
def test_known_fields_with_bad_values_are_still_refused(extra, field):
    with client_for() as client:
        r = client.post("/v1/completions", json={**OPENAI[0][1], **extra})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"].startswith(field)


def test_min_tokens_over_the_limit_and_stop_token_ids_outside_the_vocabulary_answer_400():
    with client_for() as client:
        r = client.post("/v1/completions", json={**OPENAI[0][1], "max_tokens": 3, "min_tokens": 4})
        assert r.status_code == 400 and "min_tokens (4)" in r.json()["error"]["message"] \
            and "(3)" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json={**OPENAI[0][1], "stop_token_ids": [5000]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"


def test_chat_top_logprobs_without_logprobs_answers_400_as_vllm_does():
    """Else the client asks for the top tokens and silently gets none."""
    engine = FakeEngine()
    with client_for(engine) as client:
        for logprobs in (False, None):
            body = {**OPENAI[1][1], "top_logprobs": 5, **({"logprobs": logprobs} if logprobs is not None else {})}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "top_logprobs" and "logprobs" in r.json()["error"]["message"]
        assert not engine.requests
        assert client.post("/v1/chat/completions", json={**OPENAI[1][1], "top_logprobs": 0}).status_code == 200
        assert client.post("/v1/chat/completions",
                           json={**OPENAI[1][1], "top_logprobs": 5, "logprobs": True}).status_code == 200


@pytest.mark.parametrize("path, base", OPENAI)
def test_continuous_usage_stats_put_usage_on_every_chunk(path, base):
    with client_for(FakeEngine()) as client:
        r = client.post(path, json={**base, "max_tokens": 4, "stream": True,
                                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        events = sse_data(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["usage"] is not None for c in chunks)
    completion = [c["usage"]["completion_tokens"] for c in chunks]
    assert completion == sorted(completion) and completion[-1] == 4
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + c["usage"]["completion_tokens"]
               for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-2]["choices"][0]["finish_reason"] == "length"
    # without continuous_usage_stats only the last chunk counts
    with client_for(FakeEngine()) as client:
        r = client.post(path, json={**base, "max_tokens": 4, "stream": True,
                                    "stream_options": {"include_usage": True}})
        chunks = sse_data(r.text)[:-1]
    assert [c["usage"] is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


@pytest.mark.parametrize("path, body, field, value", [
    ("/generate", {"inputs": "x", "parameters": {"temperature": "@"}}, "parameters.temperature", "NaN"),
    ("/generate", {"inputs": "x", "parameters": {"top_p": "@"}}, "parameters.top_p", "Infinity"),
    ("/generate", {"inputs": "x", "parameters": {"repetition_penalty": "@"}}, "parameters.repetition_penalty",
     "-Infinity"),
    ("/v1/completions", {**OPENAI[0][1], "temperature": "@"}, "temperature", "NaN"),
    ("/v1/chat/completions", {**OPENAI[1][1], "top_p": "@"}, "top_p", "NaN"),
    ("/v1/completions", {**OPENAI[0][1], "repetition_penalty": "@"}, "repetition_penalty", "Infinity"),
])
def test_non_finite_numbers_say_they_must_be_finite(path, body, field, value):
    raw = json.dumps(body).replace('"@"', value)       # JSON's NaN / Infinity tokens, as Python writes them
    with client_for() as client:
        r = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert f"{field}: Input should be a finite number" in r.text
        assert "<=" not in r.text and ">=" not in r.text


def test_a_string_is_no_number_even_one_that_reads_as_one():
    """Types are strict, as OpenAI's and vLLM's: "NaN" or "0.5" is a string, not a number."""
    with client_for() as client:
        for value in ("NaN", "0.5"):
            r = client.post("/v1/completions", json={**OPENAI[0][1], "temperature": value})
            assert r.status_code == 422 and "temperature: Input should be a valid number" in r.text, r.text


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_malformed_bodies_name_the_problem_and_its_position(path):
    def message(r):
        body = r.json()
        return body["error"]["message"] if path.startswith("/v1/") else body["error"]

    with client_for() as client:
        headers = {"content-type": "application/json"}
        r = client.post(path, content=b'{"inputs": "caf\xe9"}', headers=headers)
        assert r.status_code == 400 and "not valid UTF-8" in message(r) and "position 15" in message(r)
        r = client.post(path, content=b"[" * 10000 + b"]" * 10000, headers=headers)
        assert r.status_code == 400 and "nested too deeply" in message(r)
        r = client.post(path, content=b'{"inputs": "x",}', headers=headers)
        assert r.status_code == 400 and "position 15" in message(r) and "malformed JSON" in message(r)
        assert client.get("/health").status_code == 200


# ---------------------------------------------------------------- the real engine


@pytest.fixture(scope="module")
def engine():
    from models import load_model

    engine = Engine(load_model("random:tiny", dtype="float32", device="cpu"))
    engine.start()
    yield engine
    engine.shutdown()


def greedy_tokens(engine, prompt, **params) -> tuple[list[int], FinishEvent]:
    (tokens, _, finish), = run_all(engine, [(prompt, SamplingParams(temperature=0.0, **params))])
    return tokens, finish


def test_stop_token_ids_end_the_request_and_min_tokens_holds_them_off(engine):
    prompt = [5, 6, 7, 8]
    free, _ = greedy_tokens(engine, prompt, max_new_tokens=12, ignore_eos=True)
    stop_at = free[4]
    first = free.index(stop_at)                    # the first time that token comes
    tokens, finish = greedy_tokens(engine, prompt, max_new_tokens=12, ignore_eos=True,
                                   stop_token_ids=frozenset({stop_at}))
    assert finish.reason == "stop" and tokens == free[:first + 1]
    # min_tokens: a stop token before it is generated past; the first one after it ends the request
    later = next((i for i in range(first + 1, 12) if free[i] == stop_at), None)
    tokens, finish = greedy_tokens(engine, prompt, max_new_tokens=12, ignore_eos=True, min_tokens=first + 1,
                                   stop_token_ids=frozenset({stop_at}))
    if later is None:
        assert finish.reason == "length" and tokens == free
    else:
        assert finish.reason == "stop" and tokens == free[:later + 1]


def test_min_tokens_holds_off_the_end_of_sequence_token_and_stop_token_ids(engine):
    eos = next(iter(engine.core.eos_ids))
    prompt = [5, 6, 7, 8]
    free, _ = greedy_tokens(engine, prompt, max_new_tokens=6, ignore_eos=True)
    # the first generated token counted as EOS: without min_tokens it ends the request at once
    tokens, finish = greedy_tokens(engine, prompt, max_new_tokens=6, stop_token_ids=frozenset({free[0]}))
    assert finish.reason == "stop" and tokens == free[:1]
    tokens, finish = greedy_tokens(engine, prompt, max_new_tokens=6, min_tokens=6,
                                   stop_token_ids=frozenset({free[0], eos}))
    assert finish.reason == "length" and tokens == free


# ---------------------------------------------------------------- load generators' bodies


def guidellm_bodies(model: str) -> list[tuple[str, dict]]:
    """What guidellm's OpenAI HTTP backend sends for a fixed output length, streaming."""
    stream = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    return [
        ("/v1/completions", {"model": model, **stream, "max_tokens": 8, "stop": None, "ignore_eos": True,
                             "prompt": "Once upon a time"}),
        ("/v1/chat/completions", {"model": model, **stream, "max_completion_tokens": 8, "stop": None,
                                  "ignore_eos": True,
                                  "messages": [{"role": "user", "content": [{"type": "text",
                                                                             "text": "Once upon a time"}]}]}),
    ]


def aiperf_bodies(model: str) -> list[tuple[str, dict]]:
    """What aiperf sends: chat with max_completion_tokens and include_usage on streams, its
    --extra-inputs merged into the body (here min_tokens and ignore_eos, as its docs suggest for a
    fixed output length), and plain completions."""
    return [
        ("/v1/chat/completions", {"messages": [{"role": "user", "name": "text", "content": "Tell me a story"}],
                                  "model": model, "stream": True, "max_completion_tokens": 8,
                                  "min_tokens": 8, "ignore_eos": True,
                                  "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a story"}],
                                  "model": model, "stream": False, "max_completion_tokens": 8,
                                  "min_tokens": 8, "ignore_eos": True}),
        ("/v1/completions", {"prompt": "Tell me a story", "model": model, "stream": True, "max_tokens": 8,
                             "stream_options": {"include_usage": True}, "ignore_eos": True}),
    ]


@pytest.mark.slow
def test_guidellm_and_aiperf_bodies_are_served(live_server, model_name):
    for path, body in guidellm_bodies(model_name) + aiperf_bodies(model_name):
        with httpx.Client(timeout=120) as client:
            r = client.post(live_server + path, json=body)
        assert r.status_code == 200, (path, body, r.text)
        if not body["stream"]:
            assert r.json()["usage"]["completion_tokens"] == 8
            continue
        events = sse_data(r.text)
        assert events[-1] == "[DONE]", r.text
        chunks = events[:-1]
        assert chunks[-1]["usage"]["completion_tokens"] == 8
        continuous = body["stream_options"].get("continuous_usage_stats", False)
        assert all(c.get("usage") is not None for c in chunks) == continuous
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finish[-1] == "length"


class SpecialTokenEngine(FakeEngine):
    """Emits "a", a special token (id 7, no text of its own), "b", then EOS (special, last)."""

    def __init__(self):
        super().__init__()
        self.tokenizer.convert_ids_to_tokens = lambda token_id: f"<special-{token_id}>"

    async def _produce(self, stream, params):
        events = [TokenEvent(ord("a") + 10, "a", -0.1), TokenEvent(7, "", -0.1, True),
                  TokenEvent(ord("b") + 10, "b", -0.1), TokenEvent(2, "", -0.1, True, last=True)]
        for event in events:
            stream.queue.put_nowait(event)
        stream.queue.put_nowait(FinishEvent("eos", "ab", stream.prompt_tokens, len(events)))
        self.active.pop(stream.request_id, None)


@pytest.mark.parametrize("path, base", OPENAI)
@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_false_shows_them_but_not_the_one_that_ended_the_request(path, base, stream):
    def text(r) -> str:
        if not stream:
            choice = r.json()["choices"][0]
            return choice["text"] if "text" in choice else choice["message"]["content"]
        chunks = [c for c in sse_data(r.text)[:-1] if c["choices"]]
        return "".join(c["choices"][0]["text"] if "text" in c["choices"][0]
                       else c["choices"][0]["delta"].get("content", "") for c in chunks)

    with client_for(SpecialTokenEngine()) as client:
        shown = client.post(path, json={**base, "stream": stream, "skip_special_tokens": False})
        skipped = client.post(path, json={**base, "stream": stream})
    assert text(shown) == "a<special-7>b"
    assert text(skipped) == "ab"
