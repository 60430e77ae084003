"""Request fields of structured output and tool calls: OpenAI's response_format, tools and
tool_choice, vLLM's structured_outputs (and its older guided_* fields). TGI's grammar is in
schemas.py with the rest of TGI's parameters."""

from typing import Any, Literal

from pydantic import Field, model_validator

from .schemas import Lenient, NonEmptyText, Strict, Text

FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_CHOICES = 256


class JsonSchemaFormat(Lenient):
    name: Text = Field(description="The schema's name (OpenAI requires one; it is not used).")
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema",
                                    description="A JSON schema; the generated text validates against it.")
    strict: bool | None = Field(None, description="Accepted; the output always follows the schema.")


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: unconstrained; json_object: any JSON object; json_schema: JSON valid under "
                    "json_schema.schema.")
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given exactly when type is 'json_schema'")
        return self


class StructuredOutputs(Lenient):
    """vLLM's structured_outputs: exactly one constraint (its other options are ignored and logged)."""
    json_: dict[str, Any] | Text | None = Field(None, alias="json", description="A JSON schema (object or its text).")
    regex: NonEmptyText | None = None
    choice: list[Text] | None = Field(None, min_length=1, max_length=MAX_CHOICES,
                                      description="The output is one of these strings.")
    grammar: NonEmptyText | None = Field(None, description="An EBNF grammar (xgrammar's dialect, GBNF-like).")
    json_object: bool | None = Field(None, description="true: any JSON object.")
    structural_tag: Text | None = Field(None, description="An xgrammar structural tag, as JSON text.")
    disable_any_whitespace: bool | None = Field(None, description="Accepted; JSON is always written "
                                                                  "without free whitespace.")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("json_", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object, structural_tag"
                             + (f" (got {', '.join(g.rstrip('_') for g in given)})" if given else ""))
        return self


class GuidedFields(Lenient):
    """The structured-output fields of both OpenAI routes (vLLM's spellings)."""
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | Text | None = Field(None, description="Older spelling of structured_outputs.json.")
    guided_regex: NonEmptyText | None = Field(None, description="Older spelling of structured_outputs.regex.")
    guided_choice: list[Text] | None = Field(None, min_length=1, max_length=MAX_CHOICES,
                                             description="Older spelling of structured_outputs.choice.")
    guided_grammar: NonEmptyText | None = Field(None, description="Older spelling of structured_outputs.grammar.")


class FunctionDefinition(Lenient):
    name: str = Field(pattern=FUNCTION_NAME)
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments.")
    strict: bool | None = None


class ToolDefinition(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(Lenient):
    name: Text
    arguments: Text = Field(description="The arguments as JSON text.")


class ToolCall(Lenient):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: CalledFunction
