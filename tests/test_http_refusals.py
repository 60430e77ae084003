"""What the HTTP layer refuses and how it says so, against the scripted in-process engine: a body
not declared JSON, values of the wrong JSON type, an unknown model name of any length, methods a
route does not take; and that every such refusal is counted, /health answers HEAD, and /docs needs
nothing from the network."""

import json
import re

import jsonschema
import pytest

from tests.conftest import metric_value
from tests.test_http_app import FakeEngine, client_for

GOOD = {"/generate": {"inputs": "hi", "parameters": {"max_new_tokens": 2}},
        "/v1/completions": {"model": "fake-model", "prompt": "hi", "max_tokens": 2},
        "/v1/chat/completions": {"model": "fake-model", "max_tokens": 2,
                                 "messages": [{"role": "user", "content": "hi"}]}}


@pytest.fixture(scope="module")
def client():
    with client_for(FakeEngine(max_model_len=64)) as c:
        yield c


def rejected(client, reason: str) -> float:
    return metric_value(client.get("/metrics").text, "llm_requests_rejected_total", f'reason="{reason}"')


@pytest.mark.parametrize("path", list(GOOD))
@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_a_body_not_declared_json_is_415(client, path, content_type):
    headers = {"content-type": content_type} if content_type else {}
    r = client.post(path, content=json.dumps(GOOD[path]).encode(), headers=headers)
    assert r.status_code == 415, r.text
    message = r.json()["error"] if path == "/generate" else r.json()["error"]["message"]
    assert "Content-Type: application/json" in message
    assert (content_type or "none was given") in message
    if path == "/generate":
        assert r.json()["error_type"] == "validation"
    else:
        assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json"])
def test_json_media_types_are_accepted(client, content_type):
    for path, body in GOOD.items():
        r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": content_type})
        assert r.status_code == 200, (path, r.text)


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"max_tokens": "10"}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": False}, "max_completion_tokens"),
    ("/v1/chat/completions", {"stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"seed": "1"}, "seed"),
    ("/v1/chat/completions", {"temperature": "0.5"}, "temperature"),
    ("/generate", {"stream": "yes"}, "stream"),
    ("/generate", {"parameters": {"max_new_tokens": "10"}}, "parameters.max_new_tokens"),
    ("/generate", {"parameters": {"max_new_tokens": True}}, "parameters.max_new_tokens"),
    ("/generate", {"parameters": {"details": "true"}}, "parameters.details"),
    ("/generate", {"parameters": {"do_sample": 1}}, "parameters.do_sample"),
])
def test_values_of_the_wrong_json_type_are_refused(client, path, body, field):
    """As OpenAI's and vLLM's servers do: no string or boolean is taken for a number, nor a string
    or number for a boolean."""
    merged = {**GOOD[path], **body}
    if "parameters" in body:
        merged["parameters"] = {**GOOD[path]["parameters"], **body["parameters"]}
    r = client.post(path, json=merged)
    assert r.status_code == 422, r.text
    message = r.json()["error"] if path == "/generate" else r.json()["error"]["message"]
    assert message.startswith(f"{field}: Input should be a valid"), message


def test_integral_numbers_and_integers_for_floats_are_accepted(client):
    """JSON Schema's integer includes 10.0; an integer is a number."""
    r = client.post("/v1/completions", json={**GOOD["/v1/completions"], "max_tokens": 3.0, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    r = client.post("/v1/completions", json={**GOOD["/v1/completions"], "max_tokens": 2.5})
    assert r.status_code == 422 and r.json()["error"]["param"] == "max_tokens"


def test_an_unknown_model_name_is_not_echoed_whole(client):
    name = "m" * 200_000
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(path, json={**GOOD[path], "model": name})
        assert r.status_code == 404
        assert len(r.content) < 1000, len(r.content)
        message = r.json()["error"]["message"]
        assert "m" * 100 + "... (200000 characters)" in message and "fake-model" in message
    r = client.post("/v1/completions", json={**GOOD["/v1/completions"], "model": "other"})
    assert "the model `other` does not exist" in r.json()["error"]["message"]


@pytest.mark.parametrize("key, says", [("\u00b2", "is not a token id"), ("\u0665", "is not a token id"),
                                       ("9" * 5000, "(5000 digits) is not a token id")])
def test_a_logit_bias_key_of_other_digits_or_too_many_is_a_422(client, key, says):
    """str.isdigit() takes a superscript or an Arabic-Indic digit, and int() refuses more than
    4300 digits: neither may reach int()."""
    for stream in (False, True):
        r = client.post("/v1/completions", json={**GOOD["/v1/completions"], "logit_bias": {key: 1.0}, "stream": stream})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == "logit_bias" and says in r.json()["error"]["message"]
        assert len(r.content) < 1000


def test_head_health_answers_like_get(client):
    r = client.head("/health")
    assert r.status_code == 200 and r.content == b""
    assert r.headers["content-type"] == "application/json"


@pytest.mark.parametrize("path, method", [("/generate", "GET"), ("/generate_stream", "PUT"), ("/info", "POST"),
                                          ("/v1/completions", "GET"), ("/v1/chat/completions", "DELETE")])
def test_a_method_a_route_does_not_take_is_a_405_of_the_client(client, path, method):
    r = client.request(method, path)
    assert r.status_code == 405
    assert "allow" in r.headers
    if path.startswith("/v1/"):
        assert r.json()["error"]["type"] == "invalid_request_error"
    else:
        assert r.json()["error_type"] == "validation"


def test_every_validation_refusal_is_counted(client):
    invalid, too_long = rejected(client, "invalid"), rejected(client, "too_long")
    refusals = [
        ("/generate", {"inputs": ""}, 422),                                            # schema
        ("/generate", {"inputs": "x", "messages": [{"role": "user", "content": "x"}]}, 422),
        ("/v1/completions", {"model": "fake-model", "prompt": "x", "max_tokens": "10"}, 422),
        ("/v1/completions", {"model": "fake-model", "prompt": [5000]}, 400),           # outside the vocabulary
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404),
        ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "x"}],
                                  "max_tokens": 3, "min_tokens": 5}, 400),
    ]
    for path, body, status in refusals:
        assert client.post(path, json=body).status_code == status, (path, body)
    assert client.post("/generate", content=b'{"inputs": ', headers={"content-type": "application/json"}).status_code == 400
    assert client.post("/generate", content=b'{"inputs": "x"}').status_code == 415
    assert rejected(client, "invalid") == invalid + len(refusals) + 2
    r = client.post("/generate", json={"inputs": "x" * 80})                           # over the context of 64
    assert r.status_code == 400
    assert rejected(client, "too_long") == too_long + 1
    assert rejected(client, "invalid") == invalid + len(refusals) + 2


def test_docs_are_served_without_the_network(client):
    page = client.get("/docs")
    assert page.status_code == 200 and "swagger" in page.text.lower()
    assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text)
    assets += re.findall(r"""url:\s*["']([^"']+)["']""", page.text)
    assert assets and not [a for a in assets if "//" in a], assets
    for asset in assets:
        r = client.get(asset)
        assert r.status_code == 200 and len(r.content) > 100, asset
    script = next(a for a in assets if a.endswith(".js"))
    # Swagger UI 5 or later renders OpenAPI 3.1, the version FastAPI writes
    assert "isOAS31" in client.get(script).text
    assert client.get("/openapi.json").json()["openapi"].startswith("3.1")


# Bodies the server refuses: the document must refuse them too (schemathesis's
# positive_data_acceptance found each one accepted by the document).
REFUSED = [
    ("/generate", {"inputs": "x", "messages": [{"role": "user", "content": "x"}]}),
    ("/generate", {"inputs": "x", "parameters": {"best_of": 0}}),
    ("/generate", {"inputs": "x", "parameters": {"typical_p": 0.5}}),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "n": 17}),
    ("/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 21}),
    ("/v1/completions", {"model": "fake-model", "prompt": ""}),
    ("/v1/completions", {"model": "fake-model", "prompt": ["a", ""]}),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "best_of": 0}),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "logit_bias": {"1": 101.0}}),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "logit_bias": {"a": 1.0}}),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "logit_bias": {"9" * 13: 1.0}}),
    ("/v1/completions", {"model": "fake-model", "prompt": "x", "stop": ["s"] * 17}),
]


def request_validator(document: dict, path: str) -> jsonschema.Validator:
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**body, "components": document["components"]})


@pytest.mark.parametrize("path, body", REFUSED)
def test_the_document_refuses_what_the_server_refuses(client, path, body):
    assert client.post(path, json=body).status_code == 422
    validator = request_validator(client.get("/openapi.json").json(), path)
    assert not validator.is_valid(body), body


def test_the_document_accepts_what_the_server_accepts(client):
    document = client.get("/openapi.json").json()
    for path, body in GOOD.items():
        request_validator(document, path).validate(body)
        assert client.post(path, json=body).status_code == 200
    chat = {**GOOD["/v1/chat/completions"], "tools": [], "n": 1, "logit_bias": {}, "max_tokens": 2.0}
    request_validator(document, "/v1/chat/completions").validate(chat)
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
