"""Log-probabilities, n, penalties, logit_bias and the tokenizer routes over HTTP, against a live
server with the embedded model, through the `openai` client where it speaks the field."""

import time

import httpx
import openai
import pytest

from .conftest import read_sse

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(live_server):
    with openai.OpenAI(base_url=live_server + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server, timeout=120) as c:
        yield c


def test_chat_top_logprobs_streamed_and_not_agree_and_carry_bytes(client, model_name):
    kw = dict(model=model_name, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5)
    whole = client.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    assert b"".join(bytes(t.bytes) for t in content) == whole.message.content.encode()
    for t in content:
        assert len(t.top_logprobs) == 5
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob    # greedy
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
    streamed = [c.choices[0].logprobs.content[0] for c in client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs]
    # the second request reads the prompt's blocks from the prefix cache: the CPU's quantized path
    # (bfloat16 activations) then differs in the last digits
    assert [(t.token, {x.token for x in t.top_logprobs}) for t in streamed] == \
        [(t.token, {x.token for x in t.top_logprobs}) for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=0.02)


def test_completions_of_several_token_prompts_times_n_with_echoed_logprobs(http, model_name):
    prompts = [[504, 3575, 282, 4649, 314], [19842, 314]]
    body = {"model": model_name, "prompt": prompts, "n": 2, "max_tokens": 1, "echo": True, "logprobs": 2,
            "temperature": 0}
    r = http.post("/v1/completions", json=body).json()
    choices = r["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c, prompt in zip(choices, [prompts[0]] * 2 + [prompts[1]] * 2):
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(len(top) in (2, 3) for top in lp["top_logprobs"][1:])     # the top 2 and the token itself
        assert lp["text_offset"] == sorted(lp["text_offset"])
    assert choices[0] == {**choices[1], "index": 0} and choices[2] == {**choices[3], "index": 2}
    assert r["usage"]["prompt_tokens"] == 7 and r["usage"]["completion_tokens"] == 4
    nothing = http.post("/v1/completions", json={**body, "max_tokens": 0, "n": 1}).json()
    assert nothing["usage"]["completion_tokens"] == 0
    for full, bare in zip(choices[::2], nothing["choices"]):
        assert bare["finish_reason"] == "length"
        assert bare["logprobs"]["token_logprobs"] == full["logprobs"]["token_logprobs"][:-1]
        assert full["text"].startswith(bare["text"])


def test_vllm_prompt_logprobs_rank_the_prompt_tokens(http, model_name):
    r = http.post("/v1/completions", json={"model": model_name, "prompt": "The capital of France is Paris",
                                           "max_tokens": 1, "prompt_logprobs": 3}).json()
    report = r["choices"][0]["prompt_logprobs"]
    assert report[0] is None and len(report) >= 5
    for position in report[1:]:
        ranked = sorted(position.values(), key=lambda v: v["rank"])
        assert [v["logprob"] for v in ranked] == sorted((v["logprob"] for v in ranked), reverse=True)


def test_n_streamed_by_index_seeded_and_reproducible(http, model_name):
    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 6, "n": 3, "temperature": 1.0,
            "seed": 7, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}

    def texts(payload):
        out, finished, usage = {}, [], None
        with http.stream("POST", "/v1/completions", json=payload) as response:
            for _, event in read_sse(response):
                if event == "[DONE]":
                    break
                for choice in event["choices"]:
                    out[choice["index"]] = out.get(choice["index"], "") + choice["text"]
                    if choice["finish_reason"]:
                        finished.append(choice["index"])
                usage = event.get("usage") or usage
        return out, sorted(finished), usage

    first, finished, usage = texts(body)
    assert finished == [0, 1, 2] and usage["completion_tokens"] == 18 and usage["prompt_tokens"] == 4
    assert len(set(first.values())) == 3
    assert texts(body)[0] == first
    alone, _, _ = texts({**body, "n": 1})
    assert alone[0] == first[0]


def test_logit_bias_forces_a_token_and_penalties_are_served(client, model_name):
    r = client.completions.create(model=model_name, prompt="Paris is", max_tokens=4, logit_bias={"28": 100},
                                  presence_penalty=1.5, frequency_penalty=0.5)
    assert r.choices[0].text == ",,,,"


@pytest.mark.parametrize("extra, field, words", [
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", ["21", "20"]),
    ({"n": 17}, "n", ["17", "16"]),
    ({"logit_bias": {"49152": 1}}, "logit_bias", ["49152", "49151"]),
    ({"logit_bias": {"5": -101}}, "logit_bias", ["-101", "-100..100"]),
])
def test_out_of_range_asks_answer_422_naming_field_value_and_limit(http, model_name, extra, field, words):
    r = http.post("/v1/chat/completions", json={"model": model_name, "messages": QUESTION, "max_tokens": 1, **extra})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == field and all(w in error["message"] for w in words)
    assert http.get("/health").status_code == 200


def test_best_of_is_refused_saying_vllm_dropped_it(http, model_name):
    r = http.post("/v1/completions", json={"model": model_name, "prompt": "x", "best_of": 2})
    assert r.status_code == 422 and "vLLM V1" in r.json()["error"]["message"]


def test_tokenize_and_detokenize_round_trip_in_vllms_and_tgis_shapes(http, model_name):
    text = "Grüße, world"
    vllm = http.post("/tokenize", json={"model": model_name, "prompt": text, "return_token_strs": True}).json()
    assert vllm["count"] == len(vllm["tokens"]) == len(vllm["token_strs"]) and vllm["max_model_len"] > 0
    assert http.post("/detokenize", json={"tokens": vllm["tokens"]}).json() == {"prompt": text}
    tgi = http.post("/tokenize", json={"inputs": text}).json()
    assert [t["id"] for t in tgi] == vllm["tokens"] and "".join(t["text"] for t in tgi) == text
    chat = http.post("/tokenize", json={"messages": QUESTION}).json()
    usage = http.post("/v1/chat/completions", json={"model": model_name, "messages": QUESTION,
                                                     "max_tokens": 1}).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]
    assert http.post("/detokenize", json={"tokens": [49152]}).status_code == 400
    assert http.post("/tokenize", json={"prompt": "a", "inputs": "b"}).status_code == 422


def test_tgi_details_carry_top_tokens_and_prefill_logprobs(http):
    r = http.post("/generate", json={"inputs": "Paris is", "parameters": {
        "max_new_tokens": 3, "details": True, "top_n_tokens": 2, "decoder_input_details": True}}).json()
    details = r["details"]
    assert len(details["top_tokens"]) == 3 and all(len(t) == 2 for t in details["top_tokens"])
    assert details["prefill"][0]["logprob"] is None and details["prefill"][1]["logprob"] < 0
    for token, top in zip(details["tokens"], details["top_tokens"]):          # greedy: the likeliest
        assert (token["id"], token["logprob"]) == (top[0]["id"], top[0]["logprob"])


def test_a_disconnected_n_stream_returns_every_block(http, model_name):
    body = {"model": model_name, "prompt": "Tell me a long story about a dragon. " * 8, "max_tokens": 200,
            "n": 4, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break                                    # one token in, the client goes away
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        used = [line for line in http.get("/metrics").text.splitlines() if line.startswith("llm_kv_cache_blocks_used")]
        if used and float(used[0].split()[-1]) == 0.0:
            return
        time.sleep(0.5)
    pytest.fail(f"KV blocks still in use a minute after the client left: {used}")
