"""Property-based fuzzing of every endpoint's body against a live server: whatever the body,
the answer is never a 5xx, a 200 stream never ends in an error event, and /health stays 200.

Runs on its own server (default generation length 2, short prompt limit) so that valid
bodies cost a few decode steps at most, and so that an engine crash it provokes is charged
to these tests alone.
"""

import collections
import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from tests.conftest import read_sse

pytestmark = pytest.mark.slow

# No shrinking: once a body has broken the server, every later request fails too.
FUZZ = settings(max_examples=40, deadline=None, database=None, report_multiple_bugs=False,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                      HealthCheck.data_too_large])

words = st.text(max_size=24)
# Lone surrogates too: JSON can carry them (as \ud800) though UTF-8 cannot.
any_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=24)
floats = st.one_of(st.floats(-3, 3), st.sampled_from([0.0, 1.0, math.nan, math.inf, -math.inf, 1e308]))
ints = st.one_of(st.integers(-3, 3), st.sampled_from([2**31, 2**63, 2**64, -(2**63), 10**9]))
junk = st.one_of(st.none(), st.booleans(), ints, floats, any_text, st.lists(ints, max_size=3),
                 st.dictionaries(any_text, ints, max_size=2))


def field(valid: st.SearchStrategy, *edges) -> tuple:
    """A field's plausible values, and values at or past its limits (tried by mutation)."""
    return valid, st.sampled_from(edges) if edges else junk


@st.composite
def body_of(draw, required: dict, optional: dict) -> dict:
    """A body of plausible values, then sometimes one mutation: a field set to an edge value
    or to junk, an unknown field added, or a required field dropped."""
    body = draw(st.fixed_dictionaries({k: v[0] for k, v in required.items()},
                                      optional={k: v[0] for k, v in optional.items()}))
    fields = {**required, **optional}
    mutation = draw(st.sampled_from(["none"] * 5 + ["edge", "edge", "junk", "extra", "drop"]))
    if mutation in ("edge", "junk"):
        name = draw(st.sampled_from(sorted(fields)))
        body[name] = draw(fields[name][1] if mutation == "edge" else junk)
    elif mutation == "extra":
        body[draw(any_text)] = draw(junk)
    elif mutation == "drop" and required:
        body.pop(draw(st.sampled_from(sorted(required))))
    return body


def nested(strategy: st.SearchStrategy) -> tuple:
    return strategy, junk


TEXT = field(words, "", "\ud800", "a\x00b", "\u00e9\U0001f600" * 8)
MESSAGE = body_of({"role": field(st.sampled_from(["system", "developer", "user", "assistant"]),
                                 "tool", "function", "", "USER"),
                   "content": field(st.one_of(words, st.lists(body_of(
                       {"type": field(st.just("text"), "image_url", ""), "text": TEXT}, {}), max_size=2)),
                       None, [], "\udfff", [{"type": "image_url", "image_url": {"url": "x"}}])},
                  {"name": TEXT})
MESSAGES = field(st.lists(MESSAGE, min_size=1, max_size=3), [], [{}], "hello", [None])
TOKENS = field(st.integers(1, 3), 0, -1, 2**31, 10**9, 1.5, "2")
TEMPERATURE = field(st.floats(0, 2), -1.0, 2.5, math.nan, math.inf, 101.0, "hot")
UNIT = field(st.floats(0.01, 1), 0.0, -0.1, 1.5, math.nan)
TOP_K = field(st.integers(0, 100), -1, 49151, 49152, 100_000, 2**63)
SEED = field(st.integers(0, 2**32), -1, 2**63 - 1, 2**63, 2**64, 1.5)
PENALTY = field(st.floats(0.5, 2), 0.0, -1.0, 10.0, 11.0, math.nan)
BOOL = field(st.booleans(), None, 0, "yes")
STOPS = field(st.lists(words.filter(bool), max_size=3), [""], ["x"] * 17, "\ud800", [None], ["a" * 300])

TGI_PARAMETERS = body_of({}, {
    "max_new_tokens": TOKENS, "do_sample": BOOL, "temperature": TEMPERATURE, "top_p": UNIT,
    "top_k": TOP_K, "repetition_penalty": PENALTY, "seed": SEED, "stop": STOPS, "details": BOOL,
    "return_full_text": BOOL, "truncate": field(st.integers(1, 64), 0, -1, 10**9),
    "ignore_eos": BOOL, "best_of": field(st.sampled_from([None, 1]), 2, 0),
    "typical_p": field(st.none(), 0.5), "watermark": field(st.just(False), True),
    "decoder_input_details": field(st.booleans(), None, "yes"),
    "top_n_tokens": field(st.sampled_from([None, 0, 3, 20]), 21, -1), "grammar": field(st.none(), {"type": "json"}),
    "frequency_penalty": field(st.sampled_from([None, 0.0, 0.5]), 2.5, math.nan), "adapter_id": field(st.none(), "x")})
TGI_BODY = st.one_of(
    body_of({"inputs": TEXT}, {"parameters": nested(TGI_PARAMETERS), "stream": BOOL}),
    body_of({"messages": MESSAGES}, {"parameters": nested(TGI_PARAMETERS), "stream": BOOL}))

SAMPLING = {
    "temperature": TEMPERATURE, "top_p": UNIT, "n": field(st.sampled_from([None, 1, 2, 3]), 17, 0, -1),
    "stream": BOOL, "stream_options": nested(body_of({}, {"include_usage": BOOL})),
    "stop": field(st.one_of(words.filter(bool), STOPS[0]), "", ["a"] * 17, "\ud800"),
    "seed": SEED, "presence_penalty": field(st.sampled_from([None, 0.0, 0.5, -2.0]), 2.5, math.nan),
    "frequency_penalty": field(st.sampled_from([None, 0.0, -0.5, 2.0]), -2.5), "user": TEXT,
    "logit_bias": field(st.sampled_from([{}, {"5": 10.0}, {"0": -100, "49151": 100}]), {"x": "y"}, {"5": 101},
                        {"49152": 1}, {"-1": 1}, {"5": math.inf}),
    "top_k": TOP_K, "repetition_penalty": PENALTY, "ignore_eos": BOOL}


def model_field(model: str) -> tuple:
    return field(st.just(model), "", "gpt-4", "\ud800", model + " ")


def completion_body(model: str) -> st.SearchStrategy:
    prompt = field(st.one_of(words.filter(bool), st.lists(st.integers(0, 49151), min_size=1, max_size=5),
                             st.lists(words.filter(bool), min_size=1, max_size=3),
                             st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=4), min_size=1, max_size=3)),
                   "", [], [-1], [49152], [2**63], [[]], ["a", ""], ["x"] * 257, "\ud800")
    return body_of({"model": model_field(model), "prompt": prompt},
                   {**SAMPLING, "max_tokens": TOKENS, "echo": BOOL,
                    "logprobs": field(st.sampled_from([None, 0, 1, 5, 20]), -1, 21),
                    "prompt_logprobs": field(st.sampled_from([None, 0, 2]), -1, 21),
                    "best_of": field(st.sampled_from([None, 1]), 2), "suffix": field(st.none(), "x")})


def chat_body(model: str) -> st.SearchStrategy:
    return body_of({"model": model_field(model), "messages": MESSAGES},
                   {**SAMPLING, "max_tokens": TOKENS, "max_completion_tokens": TOKENS,
                    "logprobs": BOOL, "top_logprobs": field(st.sampled_from([None, 0, 2, 20]), 21, -1),
                    "response_format": field(st.just({"type": "text"}), {"type": "json_object"}, {}),
                    "tools": field(st.sampled_from([None, []]), [{"type": "function"}]),
                    "tool_choice": field(st.sampled_from([None, "none"]), "auto", {"type": "function"}),
                    "parallel_tool_calls": BOOL})


@pytest.fixture(scope="module")
def client(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def served_model(client) -> str:
    r = client.get("/v1/models")
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["id"]


@pytest.fixture(scope="module")
def statuses() -> collections.Counter:
    """Status codes the fuzzing got, to check that valid bodies were among them."""
    return collections.Counter()


def post(client: httpx.Client, path: str, content: bytes, statuses: collections.Counter) -> None:
    with client.stream("POST", path, content=content,
                       headers={"content-type": "application/json"}) as r:
        statuses[r.status_code] += 1
        event(f"status {r.status_code}")
        if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
            payloads = [p for _, p in read_sse(r)]
            assert payloads, "empty stream"
            assert not (isinstance(payloads[-1], dict) and "error" in payloads[-1]), payloads[-1]
            return
        r.read()
        if r.status_code >= 500:    # hypothesis replays the body that failed first; name the cause
            health = client.get("/health").json()
            pytest.fail(f"{r.status_code} {r.text}; /health says {health}")
        assert r.headers["content-type"] == "application/json"
        assert (r.status_code == 200) != ("error" in r.json())


def encode(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


@FUZZ
@given(body=TGI_BODY, path=st.sampled_from(["/generate", "/generate_stream"]))
def test_fuzz_tgi(client, statuses, body, path):
    post(client, path, encode(body), statuses)


@FUZZ
@given(data=st.data())
def test_fuzz_completions(client, statuses, served_model, data):
    post(client, "/v1/completions", encode(data.draw(completion_body(served_model))), statuses)


@FUZZ
@given(data=st.data())
def test_fuzz_chat(client, statuses, served_model, data):
    post(client, "/v1/chat/completions", encode(data.draw(chat_body(served_model))), statuses)


json_values = st.recursive(st.one_of(st.none(), st.booleans(), ints, floats, any_text),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(any_text, inner, max_size=3)),
                           max_leaves=8)


@FUZZ
@given(path=st.sampled_from(["/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions"]),
       raw=st.one_of(st.binary(max_size=64), json_values.map(encode)))
def test_fuzz_raw_bodies(client, statuses, path, raw):
    post(client, path, raw, statuses)


def test_health_after_fuzzing(client, statuses):
    total = sum(statuses.values())
    if total >= 50:     # the fuzzing reached generation, not only validation, and the reverse
        assert statuses[200] >= total // 10 and statuses[422] >= total // 10, statuses
    assert client.get("/health").status_code == 200
    r = client.post("/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert r.status_code == 200
