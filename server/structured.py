"""From a request's structured-output fields to the engine's GrammarSpec, checked before admission
(a grammar the library cannot parse answers 400 naming the problem)."""

import dataclasses
import json

from starlette.concurrency import run_in_threadpool

from .engine.grammar import choice_ebnf, parse_grammar
from .engine.params import GrammarSpec, SamplingParams
from .http_errors import ApiError


def _schema_text(schema, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"the JSON schema is not JSON: {exc}", param=param) from None
    if not isinstance(schema, dict):
        raise ApiError(400, f"a JSON schema is an object, not {type(schema).__name__}", param=param)
    return json.dumps(schema, ensure_ascii=False)


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
        if so.json_ is not None:
            found.append((GrammarSpec("json_schema", _schema_text(so.json_, "structured_outputs.json")),
                          "structured_outputs.json"))
        elif so.regex is not None:
            found.append((GrammarSpec("regex", so.regex), "structured_outputs.regex"))
        elif so.choice is not None:
            found.append((GrammarSpec("ebnf", choice_ebnf(so.choice)), "structured_outputs.choice"))
        elif so.grammar is not None:
            found.append((GrammarSpec("ebnf", so.grammar), "structured_outputs.grammar"))
        elif so.structural_tag is not None:
            found.append((GrammarSpec("structural_tag", so.structural_tag), "structured_outputs.structural_tag"))
        else:
            found.append((GrammarSpec("json_object"), "structured_outputs.json_object"))
    if body.guided_json is not None:
        found.append((GrammarSpec("json_schema", _schema_text(body.guided_json, "guided_json")), "guided_json"))
    if body.guided_regex is not None:
        found.append((GrammarSpec("regex", body.guided_regex), "guided_regex"))
    if body.guided_choice is not None:
        found.append((GrammarSpec("ebnf", choice_ebnf(body.guided_choice)), "guided_choice"))
    if body.guided_grammar is not None:
        found.append((GrammarSpec("ebnf", body.guided_grammar), "guided_grammar"))
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
        await run_in_threadpool(parse_grammar, spec)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param) from None
    return dataclasses.replace(params, grammar=spec)
