"""The official openai client against a live server on the real model."""

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(live_server):
    with openai.OpenAI(base_url=live_server + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def test_models_lists_the_served_model(client, model_name):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert client.models.retrieve(model_name).id == model_name


def test_completion_streamed_and_not_agree(client, model_name):
    kwargs = dict(model=model_name, prompt="The capital of France is", max_tokens=6, temperature=0)
    full = client.completions.create(**kwargs)
    choice = full.choices[0]
    assert choice.finish_reason in ("length", "stop") and choice.text
    assert full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_streamed_and_not_agree(client, model_name):
    kwargs = dict(model=model_name, messages=QUESTION, max_tokens=16, temperature=0)
    full = client.chat.completions.create(**kwargs)
    answer = full.choices[0].message
    assert answer.role == "assistant" and "Paris" in answer.content
    assert full.choices[0].finish_reason == "stop"

    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.content
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks)


@pytest.mark.parametrize("include, expected", [(False, "The capital of France"),
                                               (True, "The capital of France is")])
def test_a_stop_string_ends_the_text_before_it_or_with_vllms_extension_after_it(client, model_name, include,
                                                                               expected):
    kwargs = dict(model=model_name, messages=QUESTION, max_tokens=16, temperature=0, stop=[" is"],
                  extra_body={"include_stop_str_in_output": include})
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.content == expected and full.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def test_chat_stream_with_usage_and_logprobs(client, model_name):
    chunks = list(client.chat.completions.create(
        model=model_name, messages=QUESTION, max_completion_tokens=3, temperature=0, stream=True,
        logprobs=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 3
    scored = [c for c in chunks if c.choices and c.choices[0].logprobs]
    assert scored and all(c.choices[0].logprobs.content[0].logprob <= 0 for c in scored)


def test_client_errors_map_to_openai_exceptions(client, model_name):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt="hi", max_tokens=10_000_000)
    assert "10000000" in err.value.message
    with pytest.raises(openai.UnprocessableEntityError) as err:
        client.chat.completions.create(model=model_name, messages=[], max_tokens=2)
    assert "messages" in err.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)


def test_done_marker_ends_the_raw_stream(live_server, model_name):
    with httpx.Client(base_url=live_server, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={
                "model": model_name, "prompt": "Hello", "max_tokens": 2, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
