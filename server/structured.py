"""From a request's structured-output fields to the engine's GrammarSpec, checked before admission
(a grammar the library cannot parse answers 400 naming the problem)."""

import dataclasses
import json

import anyio

from .engine.grammar import choice_ebnf, parse_grammar
from .engine.params import GrammarSpec, SamplingParams
from .http_errors import ApiError

# A grammar that parses longer would compile about as long on the engine's one compile thread, holding
# up every other request with a grammar.
GRAMMAR_PARSE_S = 10.0

def _schema_text(schema, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"the JSON schema is not JSON: {exc}", param=param) from None
    if not isinstance(schema, dict):
        raise ApiError(400, f"a JSON schema is an object, not {type(schema).__name__}", param=param)
    return json.dumps(schema, ensure_ascii=False)


def _field_spec(field: str, value, param: str) -> GrammarSpec:
    """The grammar of one of vLLM's structured-output fields (json, regex, choice, grammar,
    structural_tag) holding ``value``."""
    if field == "json":
        return GrammarSpec("json_schema", _schema_text(value, param))
    if field == "choice":
        return GrammarSpec("ebnf", choice_ebnf(value))
    if field == "grammar":
        return GrammarSpec("ebnf", value)
    return GrammarSpec(field, value)                                  # regex, structural_tag


def openai_grammar(body) -> tuple[GrammarSpec, str] | None:
    """The constraint an OpenAI request asks for and the field that asked, or None; 400 when it
    asks for several."""
    found: list[tuple[GrammarSpec, str]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None and rf.type == "json_object":
        found.append((GrammarSpec("json_object"), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        found.append((GrammarSpec("json_schema", _schema_text(rf.json_schema.schema_, "response_format.json_schema")),
                      "response_format.json_schema"))
    so = body.structured_outputs
    if so is not None and len(so.given()) != 1:
        raise ApiError(400, "give exactly one of json, regex, choice, grammar, json_object, structural_tag in "
                            f"structured_outputs (got {', '.join(so.given()) or 'none'})", param="structured_outputs")
    if so is not None:
        given = so.given()[0]
        param = f"structured_outputs.{given}"
        if given == "json_object":
            found.append((GrammarSpec("json_object"), param))
        else:
            found.append((_field_spec(given, getattr(so, "json_" if given == "json" else given), param), param))
    for field in ("json", "regex", "choice", "grammar"):            # vLLM's older guided_* spellings
        value = getattr(body, f"guided_{field}")
        if value is not None:
            found.append((_field_spec(field, value, f"guided_{field}"), f"guided_{field}"))
    if len(found) > 1:
        raise ApiError(400, "give one structured-output constraint, not several: "
                            + ", ".join(param for _, param in found), param=found[1][1])
    return found[0] if found else None


def tgi_grammar(grammar) -> tuple[GrammarSpec, str] | None:
    if grammar is None:
        return None
    if grammar.type == "json":
        return GrammarSpec("json_schema", _schema_text(grammar.value, "parameters.grammar.value")), "parameters.grammar"
    return GrammarSpec("regex", grammar.value), "parameters.grammar"


async def constrain(params: SamplingParams, found: tuple[GrammarSpec, str] | None) -> SamplingParams:
    """``params`` with the grammar, once the library has parsed it (off the event loop)."""
    if found is None:
        return params
    spec, param = found
    if params.ignore_eos:
        raise ApiError(400, f"ignore_eos true and {param}: a grammar ends the text where it is complete",
                       param="ignore_eos")
    try:
        with anyio.fail_after(GRAMMAR_PARSE_S):
            # abandoned at the deadline: the library cannot be stopped, but the client is answered
            await anyio.to_thread.run_sync(parse_grammar, spec, abandon_on_cancel=True)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param) from None
    except TimeoutError:
        raise ApiError(400, f"the {param} takes over {GRAMMAR_PARSE_S:g} s to parse (xgrammar spells out "
                            "repetitions such as a pattern's {m,n}); bound it more tightly", param=param) from None
    return dataclasses.replace(params, grammar=spec)
