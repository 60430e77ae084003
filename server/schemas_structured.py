"""Request fields of structured output and tool calls: OpenAI's response_format, tools and
tool_choice, vLLM's structured_outputs (and its older guided_* fields). TGI's grammar is in
schemas.py with the rest of TGI's parameters."""

from typing import Annotated, Any, Literal

from pydantic import Field

from .schemas import Lenient, NonEmptyText, Strict, Text

FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_CHOICES = 256


class JsonSchemaFormat(Lenient):
    name: Text = Field(description="The schema's name (OpenAI requires one; it is not used).")
    description: Text | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema",
                                    description="A JSON schema; the generated text validates against it.")
    strict: bool | None = Field(None, description="Accepted; the output always follows the schema.")


class TextFormat(Strict):
    type: Literal["text"] = Field(description="Unconstrained text.")


class JsonObjectFormat(Strict):
    type: Literal["json_object"] = Field(description="Any JSON object.")


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"] = Field(description="JSON valid under json_schema.schema.")
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


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

    def given(self) -> list[str]:
        """The constraints given (exactly one is served: a rule the document cannot state, the route
        answers 400)."""
        names = [k.rstrip("_") for k in ("json_", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, k) is not None]
        return names + (["json_object"] if self.json_object else [])


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
