"""Tool-call syntax: the format a chat template implies, parsing whole outputs and streamed pieces,
and the messages a template receives."""

import json
import random
from types import SimpleNamespace

import pytest

from server.schemas_openai import ChatCompletionRequest
from server.tools import ToolCallStream, parse_tool_calls, plan_tools, template_messages, tool_format

HERMES = tool_format(SimpleNamespace(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"))
LLAMA = tool_format(SimpleNamespace(chat_template="{% if tools %}Environment: ipython{% endif %}<|python_tag|>"))
QWEN = tool_format(SimpleNamespace(chat_template="{% if tools %}<tools>{{ tools }}</tools>{% endif %}<tool_call>"))


def test_formats_follow_the_template():
    assert (HERMES.name, HERMES.template_renders_tools) == ("hermes", False)
    assert (LLAMA.name, LLAMA.template_renders_tools) == ("llama3_json", True)
    assert (QWEN.name, QWEN.template_renders_tools) == ("hermes", True)


def hermes_text(calls, between="\n"):
    return between.join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)


CALLS = [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"zone": "CET", "nested": {"a": [1, 2]}})]


def test_hermes_calls_and_text_around_them():
    content, calls = parse_tool_calls("Let me check.\n" + hermes_text(CALLS), HERMES)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
    assert parse_tool_calls(hermes_text(CALLS[:1]), HERMES)[0] is None
    broken = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": </tool_call>"
    assert parse_tool_calls(broken, HERMES) == (broken, [])
    assert parse_tool_calls("no calls", HERMES) == ("no calls", [])


def test_llama_calls_only_when_the_whole_output_is_calls():
    text = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in CALLS)
    for prefix in ("", "<|python_tag|>"):
        content, calls = parse_tool_calls(prefix + text, LLAMA)
        assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    assert parse_tool_calls('The answer is {"name": "x"}', LLAMA) == ('The answer is {"name": "x"}', [])
    assert parse_tool_calls('{"a": 1}', LLAMA) == ('{"a": 1}', [])


@pytest.mark.parametrize("fmt, text", [
    (HERMES, "Sure.\n" + hermes_text(CALLS) + "\nDone."),
    (HERMES, "Plain text with a < sign and <tool but no call."),
    (LLAMA, "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in CALLS)),
    (LLAMA, "Just words, {not a call}."),
])
def test_streamed_pieces_give_the_same_calls_and_text(fmt, text):
    whole_content, whole_calls = parse_tool_calls(text, fmt)
    rng = random.Random(len(text))
    for _ in range(20):
        stream, content, calls, at = ToolCallStream(fmt), [], [], 0
        while at < len(text):
            step = rng.randint(1, 7)
            piece, made = stream.feed(text[at:at + step])
            content.append(piece)
            calls += made
            at += step
        piece, made = stream.finish()
        content.append(piece)
        calls += made
        strip = lambda c: [(x["function"]["name"], x["function"]["arguments"]) for x in c]
        assert strip(calls) == strip(whole_calls)
        assert "".join(content).strip() == (whole_content or "").strip()


def request(**fields):
    return ChatCompletionRequest(model="m", **fields)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_templates_without_tools_get_them_in_a_system_message_and_calls_as_text():
    body = request(tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'}])
    plan = plan_tools(body, SimpleNamespace(chat_template="{{ messages }}"))
    out = template_messages(body.messages, plan.tools, plan.fmt)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert out[3] == {"role": "tool", "content": '{"celsius": 21}', "tool_call_id": "call_1"}
    assert plan.grammar is not None and plan.grammar.kind == "structural_tag"


def test_templates_with_tools_get_structured_calls():
    body = request(tools=[WEATHER], tool_choice="none", messages=[
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "21"}])
    plan = plan_tools(body, SimpleNamespace(chat_template="{% if tools %}<tool_call>{% endif %}"))
    assert plan.grammar is None and plan.tools is None         # tool_choice none: no tools, free text
    out = template_messages(body.messages, [WEATHER], QWEN)
    assert out[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "P"}}


def test_message_validation():
    assert request(messages=[{"role": "user", "content": None}]).messages[0].lacks_content()
    assert not request(messages=[{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}]).messages[0].lacks_content()
    with pytest.raises(ValueError):
        request(messages=[{"role": "user", "content": "x"}], tool_choice="sometimes")
