"""Tool calls: the request's tools rendered into the prompt, the grammar that holds the model to
the call syntax, and the generated calls parsed back into OpenAI's ``tool_calls``.

Two call syntaxes, picked from the model's chat template:

- hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, once per call (Qwen2.5,
  Qwen3, and the default);
- llama3_json: ``{"name": ..., "parameters": {...}}``, calls separated by ``; `` (Llama 3.1-3.3).

A template that renders tools itself (its ``tools`` argument) gets them so; one that does not
(SmolLM2's) gets a system message describing the tools and the hermes syntax (``DEFAULT_PROMPT``).
``tool_choice`` "required" and a named function are enforced by a grammar (an xgrammar structural
tag: the call's arguments follow the function's parameter schema); "auto" constrains a call once
its opening marker is written and leaves text before it free.
"""

import json
import re
import uuid
from dataclasses import dataclass

import xgrammar as xgr
from xgrammar.structural_tag import StructuralTag, TagsWithSeparatorFormat

from .engine.params import GrammarSpec

DEFAULT_PROMPT = """# Tools

You can call the functions described below, one JSON object per line inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with its name and a JSON object of arguments that follows its parameter \
schema, inside <tool_call></tool_call> tags, one call per tag:
<tool_call>
{{"name": "function name", "arguments": {{"argument": "value"}}}}
</tool_call>"""


@dataclass(frozen=True)
class ToolFormat:
    name: str                     # "hermes" or "llama3_json"
    xgrammar_model: str           # xgrammar's builtin structural tag of the syntax
    separator: str                # between parallel calls
    template_renders_tools: bool  # the chat template takes ``tools`` (else DEFAULT_PROMPT)


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_WHITESPACE = 1          # whitespace characters in a row inside a call's arguments (as JSON_OPTIONS)
PYTHON_TAG = "<|python_tag|>"


def tool_format(tokenizer) -> ToolFormat:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    renders = "tools" in template
    if PYTHON_TAG in template or "ipython" in template:
        return ToolFormat("llama3_json", "llama", "; ", renders)
    return ToolFormat("hermes", "qwen_3", "\n", renders)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------- the prompt


def _arguments_object(arguments: str):
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def _call_text(fmt: ToolFormat, name: str, arguments: str) -> str:
    """A call as the model writes it (for templates that do not render ``tool_calls``)."""
    if fmt.name == "llama3_json":
        return json.dumps({"name": name, "parameters": _arguments_object(arguments)}, ensure_ascii=False)
    body = json.dumps({"name": name, "arguments": _arguments_object(arguments)}, ensure_ascii=False)
    return f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"


def template_messages(messages, tools, fmt: ToolFormat) -> list[dict]:
    """OpenAI chat messages (``OpenAIChatMessage``) as the chat template takes them, with the
    tools described in a system message where the template does not render them."""
    out = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        text = m.text()
        message = {"role": role, "content": text}
        if m.tool_calls:
            if fmt.template_renders_tools:
                message["tool_calls"] = [{"id": c.id or new_call_id(), "type": "function",
                                          "function": {"name": c.function.name,
                                                       "arguments": _arguments_object(c.function.arguments)}}
                                         for c in m.tool_calls]
            else:
                calls = fmt.separator.join(_call_text(fmt, c.function.name, c.function.arguments)
                                           for c in m.tool_calls)
                message["content"] = f"{text}\n{calls}" if text else calls
        if role == "tool" and m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    if tools and not fmt.template_renders_tools:
        described = DEFAULT_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def template_tools(tools) -> list[dict] | None:
    """The request's tools (``ToolDefinition``) as plain dicts, for the template and the grammar."""
    if not tools:
        return None
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools]


# ---------------------------------------------------------------- the grammar


def tool_grammar(tools: list[dict] | None, tool_choice, parallel: bool, fmt: ToolFormat) -> GrammarSpec | None:
    """The structural tag that holds the output to ``tool_choice``; None for no tools or "none"."""
    if not tools or tool_choice == "none":
        return None
    choice = tool_choice.model_dump() if hasattr(tool_choice, "model_dump") else (tool_choice or "auto")
    tag = xgr.get_model_structural_tag(fmt.xgrammar_model, tools=tools, tool_choice=choice, reasoning="disabled",
                                       parallel_tool_calls=parallel, max_whitespace_cnt=ARGUMENT_WHITESPACE)
    if choice == "required":          # calls only, no free text around them
        tag = StructuralTag(format=TagsWithSeparatorFormat(tags=tag.format.tags, separator=fmt.separator,
                                                           at_least_one=True, stop_after_first=not parallel))
    return GrammarSpec("structural_tag", tag.model_dump_json(exclude_none=True))


def check_named_choice(tools: list[dict] | None, tool_choice) -> str | None:
    """Why a named tool_choice cannot be served (it names no tool of the request), or None."""
    if hasattr(tool_choice, "function"):
        names = [t["function"]["name"] for t in tools or ()]
        if tool_choice.function.name not in names:
            return f"tool_choice names {tool_choice.function.name!r}, not one of the tools ({', '.join(names) or 'none'})"
    if tool_choice == "required" and not tools:
        return "tool_choice 'required' without tools"
    return None


# ---------------------------------------------------------------- parsing the output


def _call(name, arguments) -> dict | None:
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _hermes_call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    return _call(obj.get("name"), obj.get("arguments", obj.get("parameters")))


_HERMES = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.DOTALL)


def _llama_calls(text: str) -> list[dict] | None:
    """Every call of a text made only of llama3_json calls, or None if it is anything else."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):]
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \n\t;":
            at += 1
        if at == len(text):
            return calls or None
        try:
            obj, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments"))) if isinstance(obj, dict) else None
        if call is None:
            return None
        calls.append(call)


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str | None, list[dict]]:
    """(content, calls) of a whole output; content is None when only calls were written."""
    if fmt.name == "llama3_json":
        calls = _llama_calls(text)
        return (None, calls) if calls else (text, [])
    calls, kept, at = [], [], 0
    for match in _HERMES.finditer(text):
        call = _hermes_call(match.group(1))
        if call is None:
            continue
        kept.append(text[at:match.start()])
        at = match.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


class ToolCallStream:
    """Splits streamed text into content to send now and calls, each sent whole once complete."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self._held = ""
        self._in_call = False
        self._started = False            # llama3_json: some content was sent, so no call follows
        self._blank = ""                 # whitespace held back
        self.calls: list[dict] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._held += text
        if self.fmt.name == "llama3_json":
            return self._feed_llama()
        content, calls = [], []
        while True:
            if self._in_call:
                end = self._held.find(HERMES_CLOSE)
                if end < 0:
                    break
                body, self._held = self._held[:end], self._held[end + len(HERMES_CLOSE):]
                self._in_call = False
                call = _hermes_call(body)
                if call is None:                       # not a call after all: it is text
                    content.append(HERMES_OPEN + body + HERMES_CLOSE)
                else:
                    calls.append(call)
                continue
            start = self._held.find(HERMES_OPEN)
            if start >= 0:
                content.append(self._held[:start])
                self._held = self._held[start + len(HERMES_OPEN):]
                self._in_call = True
                continue
            keep = _partial_suffix(self._held, HERMES_OPEN)
            content.append(self._held[:len(self._held) - keep])
            self._held = self._held[len(self._held) - keep:]
            break
        self.calls += calls
        return self._content("".join(content)), calls

    def _content(self, text: str) -> str:
        """Text to send, whitespace held back until text follows it (none between calls)."""
        self._blank += text
        if not self._blank.strip():
            return ""
        text, self._blank = self._blank, ""
        self._started = True
        return text

    def _feed_llama(self) -> tuple[str, list[dict]]:
        if self._started:
            text, self._held = self._held, ""
            return text, []
        head = self._held.lstrip()
        if not head or head.startswith("{") or head.startswith(PYTHON_TAG) or PYTHON_TAG.startswith(head):
            return "", []                              # may be a call: decided at the end
        self._started = True
        text, self._held = self._held, ""
        return text, []

    def finish(self) -> tuple[str, list[dict]]:
        """What was held back, at the end of the output."""
        held, self._held = self._held, ""
        if self.fmt.name == "llama3_json" and not self._started:
            calls = _llama_calls(held)
            if calls:
                self.calls += calls
                return "", calls
            return held, []
        rest = HERMES_OPEN + held if self._in_call else held
        if not rest.strip() and self.calls:
            return "", []
        return self._blank + rest, []


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# ---------------------------------------------------------------- a chat request's plan


@dataclass(frozen=True)
class ChatTools:
    fmt: ToolFormat
    tools: list[dict] | None       # described in the prompt
    grammar: GrammarSpec | None    # holds the output to tool_choice

    @property
    def active(self) -> bool:
        """Whether the output is parsed for calls."""
        return bool(self.tools)


def plan_tools(body, tokenizer) -> ChatTools:
    """What a chat request's tools, tool_choice and parallel_tool_calls ask for. Raises ValueError
    naming a tool_choice that cannot be served."""
    fmt = tool_format(tokenizer)
    tools = template_tools(body.tools)
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    problem = check_named_choice(tools, choice)
    if problem is not None:
        raise ValueError(problem)
    if not tools or choice == "none":
        return ChatTools(fmt, None, None)
    return ChatTools(fmt, tools, tool_grammar(tools, choice, body.parallel_tool_calls is not False, fmt))
