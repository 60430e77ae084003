"""The OpenAPI document tells the truth: schemathesis generates requests for every operation
from the document and checks each answer against it (status code, content type, body schema,
the events of text/event-stream answers included), in process against a scripted engine."""

import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (content_type_conformance, positive_data_acceptance,
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance)

from server.app import create_app
from server.settings import Settings

from .test_http_app import FakeEngine

# a short context keeps every generated request a few fake tokens long
APP = create_app(FakeEngine(max_model_len=64), Settings(max_body_bytes=8192))
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]
# A body the document accepts is never refused as invalid (422). It may still get a 400, for a rule
# the document cannot state because it depends on the model or on another field (the prompt's
# length in tokens, the vocabulary, min_tokens within the tokens to generate), or a 404 for a model
# name this server does not serve.
ACCEPTANCE = schemathesis.openapi.from_asgi("/openapi.json", APP, config=SchemathesisConfig.from_dict(
    {"checks": {"positive_data_acceptance": {"expected-statuses": ["2XX", "400", "404"]}}}))


@SCHEMA.parametrize()
@settings(max_examples=30, derandomize=True, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_every_operation_answers_as_its_openapi_document_says(case):
    case.call_and_validate(checks=CHECKS)


@ACCEPTANCE.include(method="POST").parametrize()
@settings(max_examples=60, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_what_the_document_accepts_the_server_accepts(case):
    case.call_and_validate(checks=[positive_data_acceptance, not_a_server_error])


def test_streaming_responses_document_their_events():
    schema = APP.openapi()
    for path in ("/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions"):
        content = schema["paths"][path]["post"]["responses"]["200"]["content"]
        event = content["text/event-stream"]["itemSchema"]
        assert event["required"] == ["data"], path
        refs = str(event["properties"]["data"])
        assert ("StreamResponse" in refs) == path.startswith("/generate"), path
        assert ("[DONE]" in refs) == path.startswith("/v1/"), path
    # /generate_stream sends nothing but events
    assert set(schema["paths"]["/generate_stream"]["post"]["responses"]["200"]["content"]) == {"text/event-stream"}
    for name in ("StreamResponse", "CompletionChunk", "ChatCompletionChunk", "ErrorResponse"):
        assert name in schema["components"]["schemas"]
