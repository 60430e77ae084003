"""Structured output on the CPU: every output follows its JSON schema, regex or choice (checked
with the jsonschema library and Python's re, not with the grammar library that constrained it),
or was cut by its token limit and follows it with a larger one; the routes' fields; tool calls."""

import json
import re
import time

import jsonschema
import pytest
import torch
import xgrammar as xgr
from fastapi.testclient import TestClient

from models import load_model
from server import structured
from server.app import create_app
from server.engine import Engine, EngineConfig, SamplingParams
from server.engine.grammar import EXACT_FORMATS, TokenMasks, choice_ebnf
from server.engine.params import GrammarSpec
from server.settings import Settings

from .helpers import chat_ids, run_all
from .structured_schemas import schemas

# jsonschema checks "time" and "date-time" only with packages this project does not need: their
# RFC 3339 syntax is checked here; every other format by jsonschema itself.
FORMATS = jsonschema.FormatChecker()
_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
FORMATS.checks("time")(lambda v: not isinstance(v, str) or re.fullmatch(_TIME, v) is not None)
FORMATS.checks("date-time")(lambda v: not isinstance(v, str) or (
    re.fullmatch(rf"\d{{4}}-\d\d-\d\d[Tt ]{_TIME}", v) is not None and FORMATS.conforms(v[:10], "date")))


def validate(schema: dict, text: str) -> None:
    jsonschema.Draft202012Validator(schema, format_checker=FORMATS).validate(json.loads(text))


@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny", dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def engine(tiny):
    engine = Engine(tiny, EngineConfig(max_batch=64, cpu_kv_cache_tokens=64 * 600))
    engine.start()
    yield engine
    engine.shutdown()


def follow(engine, prompts, specs, limits=(64, 160), temperature=0.0) -> list[tuple[str, str]]:
    """(text, finish reason) of each spec's request, rerun with the larger limit where the smaller
    one cut it."""
    results = [None] * len(specs)
    todo = list(range(len(specs)))
    for limit in limits:
        done = run_all(engine, [(prompts[i % len(prompts)],
                                 SamplingParams(max_new_tokens=limit, temperature=temperature, seed=i, grammar=specs[i]))
                                for i in todo])
        for i, (_, text, finish) in zip(todo, done):
            results[i] = (text, finish.reason)
        todo = [i for i in todo if results[i][1] == "length"]
    return results


def json_spec(schema: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def allowed_start(engine, spec: GrammarSpec, text: str) -> bool:
    """Whether the grammar admits ``text`` as the start of an output."""
    return xgr.GrammarMatcher(engine.core.grammars.compile(spec).result()).accept_string(text)


def check_json_outputs(engine, results, all_schemas, cut_allowed: int) -> None:
    cut = 0
    for schema, (text, reason) in zip(all_schemas, results):
        if reason == "length":        # cut twice: what there is must still be a start the schema allows
            cut += 1
            assert allowed_start(engine, json_spec(schema), text), (schema, text)
            continue
        assert reason == "eos", (reason, text)
        validate(schema, text)
    assert cut <= cut_allowed, f"{cut} of {len(results)} outputs were cut twice"


def test_every_output_validates_against_its_json_schema(engine, tiny):
    all_schemas = schemas()
    assert len(all_schemas) >= 60
    prompts = [[7, 8, 9 + i] for i in range(5)]
    results = follow(engine, prompts, [json_spec(s) for s in all_schemas])
    # random weights, greedy, loop at times inside a string or a number ("4444..."): those outputs
    # are cut at any limit, and checked as starts the grammar allows
    check_json_outputs(engine, results, all_schemas, cut_allowed=len(all_schemas) // 4)
    assert engine.core.blocks.num_free == engine.core.blocks.num_blocks


def test_json_object_regex_and_choice(engine):
    regexes = [r"\d{3}-\d{4}", r"[a-z]+@[a-z]+\.(com|org)", r"(yes|no|maybe)", r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}",
               r"0x[0-9a-f]{8}", r"\(\d{1,2}, \d{1,2}\)"]
    choices = [["yes", "no"], ["Paris", "London", "New York"], ["α", "β \"quoted\"", "line\nbreak"]]
    specs = ([GrammarSpec("json_object")] * 4 + [GrammarSpec("regex", r) for r in regexes]
             + [GrammarSpec("ebnf", choice_ebnf(c)) for c in choices])
    results = follow(engine, [[5, 6, 7]], specs, limits=(48, 160), temperature=1.0)
    complete = 0
    for spec, (text, reason) in zip(specs, results):
        if reason == "length":         # random weights, an unbounded string: a start the grammar allows
            assert allowed_start(engine, spec, text) and spec.kind != "ebnf", (spec, text)
            continue
        assert reason == "eos", (spec, text)
        complete += 1
        if spec.kind == "json_object":
            assert isinstance(json.loads(text), dict)
        elif spec.kind == "regex":
            assert re.fullmatch(spec.text, text), (spec.text, text)
    for choice, (text, _) in zip(choices, results[-len(choices):]):
        assert text in choice
    assert complete >= 0.6 * len(specs)


def test_grammar_rows_mix_with_free_rows_and_greedy_matches_masked_argmax(engine, tiny):
    """Unconstrained requests beside constrained ones decode as they do alone; a greedy
    constrained request takes the best allowed token at every step."""
    prompt = [11, 12, 13, 14]
    free = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = run_all(engine, [(prompt, free)])[0][0]
    spec = json_spec({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
                      "required": ["n"]})
    mixed = run_all(engine, [(prompt, free), (prompt, SamplingParams(max_new_tokens=12, grammar=spec)), (prompt, free)])
    assert mixed[0][0] == alone and mixed[2][0] == alone
    constrained, _, finish = mixed[1]
    assert finish.reason in ("length", "eos") and finish.error is None, finish
    assert len(constrained) == 12 or finish.reason == "eos"
    # the reference: the full forward's logits, masked by a fresh matcher, argmax step by step
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        tiny.tokenizer, vocab_size=49152, stop_token_ids=sorted(tiny.eos_token_ids))).compile_json_schema(
        spec.text, any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled)
    masks = TokenMasks(1, 49152, tiny.device)
    ids = list(prompt)
    with torch.inference_mode():
        for token in constrained:
            logits = tiny.model(torch.tensor([ids])).logits[0, -1:].float()

            class Row:
                is_finished = False
            row = Row()
            row.matcher = matcher
            masks.apply(logits, masks.fill([row]))
            top = logits[0].topk(2)
            if top.values[0] - top.values[1] > 1e-3:         # not a near tie between two allowed tokens
                assert token == top.indices[0].item()
            assert matcher.accept_token(token)
            ids.append(token)


def test_greedy_constrained_rows_take_the_same_tokens_with_or_without_logprobs(engine):
    """Without log-probabilities a greedy step's constrained rows take their argmax in one launch
    (kernels.grammar_argmax); asking for them sends the step through xgrammar's masking and the
    sampler instead. Both must pick the same tokens, beside free rows."""
    prompt = [21, 22, 23]
    spec = json_spec({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 6})
    free = SamplingParams(max_new_tokens=16, ignore_eos=True)
    runs = [run_all(engine, [(prompt, free), (prompt, SamplingParams(max_new_tokens=16, grammar=spec, logprobs=asked))])
            for asked in (False, True)]
    assert runs[0][1][0] == runs[1][1][0] and runs[0][1][2].reason == runs[1][1][2].reason
    assert runs[0][0][0] == runs[1][0][0]


@pytest.mark.parametrize("max_batch", [1, 2, 5])
def test_warm_up_runs_at_every_batch_size(tiny, max_batch):
    # one bitmask row at --max-batch 1: the warm-up's logits must not ask for two
    TokenMasks(max_batch, 49152, tiny.device).warm_up()


@pytest.mark.parametrize("constrained", [3, 20])
def test_a_batch_fill_sets_exactly_each_matchers_own_mask(tiny, constrained):
    """Few rows fill on the calling thread, many on the fill thread: either way each constrained
    row gets its own matcher's mask (different grammars, at different points), the others none."""
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        tiny.tokenizer, vocab_size=49152, stop_token_ids=sorted(tiny.eos_token_ids)))

    class Row:
        def __init__(self, matcher=None):
            self.matcher, self.is_finished = matcher, False
    rows = []
    for i in range(constrained):
        matcher = xgr.GrammarMatcher(compiler.compile_regex(f"[a-z]{{{i % 5 + 1},9}}=(0|[1-9][0-9]*)" if i % 2 else
                                                            r"(yes|no|maybe)"))
        assert matcher.accept_string("ab"[: i % 3] if i % 2 else "m"[: i % 3])
        rows += [Row(matcher)] + ([Row()] if i % 4 == 0 else [])     # free rows between
    masks = TokenMasks(len(rows), 49152, tiny.device, fill_threads=2)
    masks._hosts[0].fill_(0x5A5A5A5A)                  # poison: a row left unfilled would keep it
    masks._hosts[1].fill_(0x5A5A5A5A)
    mask = masks.start_fill(rows).result()
    bitmask, indices = mask.bitmask, mask.indices
    constrained_rows = [i for i, r in enumerate(rows) if r.matcher is not None]
    assert (indices is None) == (len(constrained_rows) == len(rows))
    if indices is not None:
        assert indices.tolist() == constrained_rows
    expected = xgr.allocate_token_bitmask(1, 49152)
    for i in constrained_rows:
        rows[i].matcher.fill_next_token_bitmask(expected)
        assert torch.equal(bitmask[i], expected[0]), i


def test_abort_and_finish_drop_the_tokens_in_flight(engine):
    spec = json_spec({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 500})
    done = run_all(engine, [([3, 4, 5], SamplingParams(max_new_tokens=200, temperature=1.0, seed=i, grammar=spec), 3 + i)
                            for i in range(8)] + [([3, 4, 5], SamplingParams(max_new_tokens=30, grammar=spec))])
    for tokens, _, finish in done[:8]:
        assert finish.reason in ("abort", "eos") and finish.completion_tokens == len(tokens)
    assert engine.core.blocks.num_free == engine.core.blocks.num_blocks
    assert not engine.core.compiling and engine.core.constrained == 0


def test_compile_failure_in_the_engine_fails_only_that_request(engine):
    bad = GrammarSpec("regex", "a(b")
    done = run_all(engine, [([5, 6], SamplingParams(max_new_tokens=8, grammar=bad)),
                            ([5, 6], SamplingParams(max_new_tokens=8, ignore_eos=True))])
    assert done[0][2].reason == "error" and "regex cannot be compiled" in done[0][2].error
    assert done[1][2].reason == "length"


def test_exact_formats_admit_exactly_the_valid_dates_and_addresses():
    import datetime
    import ipaddress
    import random
    rng = random.Random(7)
    dates = ["0000-02-29", "0400-02-29", "1900-02-29", "2000-02-29", "2023-02-29", "2024-02-29", "2024-04-31"]
    dates += [f"{rng.randrange(10000):04d}-{rng.randrange(14):02d}-{rng.randrange(33):02d}" for _ in range(20000)]
    for text in dates:
        try:
            valid = datetime.date.fromisoformat(text) is not None
        except ValueError:
            valid = False
        assert valid == bool(re.fullmatch(EXACT_FORMATS["date"], text)), text
    parts = ["0", "00", "01", "9", "10", "99", "100", "199", "249", "250", "255", "256", "300"]
    for _ in range(5000):
        text = ".".join(rng.choice(parts) for _ in range(4))
        try:
            valid = ipaddress.IPv4Address(text) is not None
        except ValueError:
            valid = False
        assert valid == bool(re.fullmatch(EXACT_FORMATS["ipv4"], text)), text


# ---------------------------------------------------------------- HTTP


@pytest.fixture(scope="module")
def client(tiny):
    engine = Engine(tiny, EngineConfig(max_batch=16, cpu_kv_cache_tokens=16 * 1024))
    with TestClient(create_app(engine, Settings()), raise_server_exceptions=False) as c:
        c.model_name = c.get("/v1/models").json()["data"][0]["id"]
        yield c


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


def chat(client, **fields) -> dict:
    body = {"model": client.model_name, "messages": [{"role": "user", "content": "Who?"}], "max_tokens": 200,
            "seed": 1, **fields}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
    {"structured_outputs": {"json": PERSON}},
    {"guided_json": json.dumps(PERSON)},
])
def test_chat_json_schema_fields(client, fields):
    choice = chat(client, **fields)
    assert choice["finish_reason"] == "stop"
    validate(PERSON, choice["message"]["content"])


def test_chat_json_object_and_completions_fields(client):
    assert isinstance(json.loads(chat(client, response_format={"type": "json_object"})["message"]["content"]), dict)
    for fields, check in [({"guided_regex": r"[a-z]{4}\d"}, lambda t: re.fullmatch(r"[a-z]{4}\d", t)),
                          ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
                          ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
                          ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]'}},
                           lambda t: re.fullmatch(r"x\d\d", t))]:
        r = client.post("/v1/completions", json={"model": client.model_name, "prompt": "hi", "max_tokens": 50, **fields})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and check(choice["text"]), (fields, choice)


def test_tgi_grammar(client):
    for grammar, check in [({"type": "json", "value": PERSON}, lambda t: validate(PERSON, t) is None),
                           ({"type": "regex", "value": r"\d{2}:\d{2}"}, lambda t: re.fullmatch(r"\d{2}:\d{2}", t))]:
        r = client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 200, "grammar": grammar,
                                                                          "details": True}})
        assert r.status_code == 200, r.text
        assert r.json()["details"]["finish_reason"] == "eos_token" and check(r.json()["generated_text"])


@pytest.mark.parametrize("path, fields, param, words", [
    ("/v1/completions", {"guided_regex": "[a-"}, "guided_regex", "regex cannot be compiled"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}},
     "response_format.json_schema", "json_schema cannot be compiled"),
    ("/v1/chat/completions", {"structured_outputs": {"grammar": 'root ::= "a" | undefined_rule'}},
     "structured_outputs.grammar", "undefined_rule"),
    ("/generate", {"parameters": {"grammar": {"type": "json", "value": {"type": "strin"}}}}, "parameters.grammar", "strin"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json", "not JSON"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "not several"),
    ("/v1/completions", {"guided_regex": "a", "ignore_eos": True}, "ignore_eos", "ignore_eos"),
])
def test_bad_grammars_answer_400_naming_the_problem_quickly(client, path, fields, param, words):
    base = ({"inputs": "hi"} if path == "/generate" else
            {"model": client.model_name, "prompt": "hi"} if path == "/v1/completions" else
            {"model": client.model_name, "messages": [{"role": "user", "content": "hi"}]})
    started = time.monotonic()
    r = client.post(path, json={**base, **fields})
    assert time.monotonic() - started < 1.0
    assert r.status_code == 400, r.text
    if path != "/generate":
        assert r.json()["error"]["param"] == param
    assert words in r.text
    assert client.get("/health").status_code == 200


def test_a_grammar_slow_to_parse_answers_400_at_the_deadline(client, monkeypatch):
    """xgrammar spells out a schema pattern's repetitions: [a-z]{1,50000} parses for minutes."""
    monkeypatch.setattr(structured, "GRAMMAR_PARSE_S", 0.01, raising=False)
    schema = {"type": "string", "pattern": "[a-z]{1,3000}"}      # about 0.3 s or more
    r = client.post("/v1/completions", json={"model": client.model_name, "prompt": "hi", "guided_json": schema})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "guided_json" and "0.01 s to parse" in r.json()["error"]["message"]
    assert client.get("/health").status_code == 200


def test_openai_parse_with_a_pydantic_model(client):
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=12)
        population: int = Field(ge=0, le=10**8)
        capital: bool

    oa = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    completion = oa.chat.completions.parse(model=client.model_name, response_format=City, max_tokens=200, seed=3,
                                           messages=[{"role": "user", "content": "Describe Paris."}])
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and 0 <= parsed.population <= 10**8


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                                       "required": ["zone"]}}}


def test_tool_calls_round_trip_through_the_openai_client(client):
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = oa.chat.completions.create(model=client.model_name, messages=messages, tools=[WEATHER, TIME],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=200, seed=5)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    second = oa.chat.completions.create(model=client.model_name, messages=messages, tools=[WEATHER, TIME],
                                        tool_choice="none", max_tokens=8, seed=5)
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason in ("stop", "length")


def test_required_tool_calls_stream_by_index(client):
    openai = pytest.importorskip("openai")
    oa = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    calls: dict[int, dict] = {}
    finish = None
    for seed in range(6):
        calls, finish = {}, None
        stream = oa.chat.completions.create(model=client.model_name, tools=[WEATHER, TIME], tool_choice="required",
                                            messages=[{"role": "user", "content": "Weather and time in Tokyo?"}],
                                            max_tokens=300, seed=seed, stream=True)
        for chunk in stream:
            choice = chunk.choices[0]
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = entry["id"] or delta.id
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
        if finish == "tool_calls":
            break
    assert finish == "tool_calls" and calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    assert sorted(calls) == list(range(len(calls)))
    for entry in calls.values():
        jsonschema.validate(json.loads(entry["arguments"]), schemas[entry["name"]])


@pytest.mark.parametrize("fields, words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not one of the tools"),
    ({"tool_choice": "required"}, "without tools"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "together"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool"}]}, "messages[1] has no content"),
])
def test_tool_choice_that_cannot_be_served_answers_400(client, fields, words):
    r = client.post("/v1/chat/completions", json={"model": client.model_name, "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "hi"}], **fields})
    assert r.status_code == 400
    assert r.status_code == 400 and words in r.text, r.text


# ---------------------------------------------------------------- the embedded model


@pytest.mark.slow
def test_embedded_model_follows_every_schema():
    loaded = load_model("default", dtype="float32", device="cpu")
    engine = Engine(loaded, EngineConfig(max_batch=64, cpu_kv_cache_tokens=64 * 700))
    engine.start()
    try:
        all_schemas = schemas()
        prompts = [chat_ids(loaded.tokenizer, "Give an example of this data as JSON: " + json.dumps(s))
                   for s in all_schemas]
        results = []
        for i in range(0, len(all_schemas), 64):
            results += follow(engine, prompts[i:i + 64], [json_spec(s) for s in all_schemas[i:i + 64]],
                              limits=(128, 400))
        check_json_outputs(engine, results, all_schemas, cut_allowed=0)
    finally:
        engine.shutdown()


def test_every_choice_of_n_follows_the_schema(client):
    r = client.post("/v1/chat/completions", json={
        "model": client.model_name, "messages": [{"role": "user", "content": "Who?"}], "max_tokens": 200, "n": 3,
        "seed": 2, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for choice in choices:
        assert choice["finish_reason"] == "stop"
        validate(PERSON, choice["message"]["content"])
