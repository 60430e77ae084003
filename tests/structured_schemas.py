"""JSON schemas for the structured-output tests: nested objects, bounded arrays, enums, anyOf,
required and optional properties, string formats and patterns, bounded numbers."""

import itertools

LEAVES = {
    "name": {"type": "string", "maxLength": 12},
    "word": {"type": "string", "pattern": "^[a-z]{2,8}$"},
    "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
    "email": {"type": "string", "format": "email"},
    "date": {"type": "string", "format": "date"},
    "time": {"type": "string", "format": "time"},
    "stamp": {"type": "string", "format": "date-time"},
    "uuid": {"type": "string", "format": "uuid"},
    "ipv4": {"type": "string", "format": "ipv4"},
    "short": {"type": "string", "minLength": 2, "maxLength": 5},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "delta": {"type": "integer", "minimum": -50, "maximum": 50},
    "ratio": {"type": "number", "minimum": 0, "maximum": 1},
    "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
    "count": {"type": "integer", "minimum": 1, "maximum": 9},
    "flag": {"type": "boolean"},
    "nothing": {"type": "null"},
    "color": {"enum": ["red", "green", "blue"]},
    "level": {"enum": [1, 2, 3, None]},
    "kind": {"const": "fixed"},
    "size": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"enum": ["small", "large"]}]},
    "maybe": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "pair": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2},
    "scores": {"type": "array", "items": {"type": "number", "minimum": -1, "maximum": 1}, "minItems": 1, "maxItems": 4},
    "names": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
}

NESTED = {
    "point": {"type": "object", "properties": {"x": LEAVES["delta"], "y": LEAVES["delta"]}, "required": ["x", "y"]},
    "person": {"type": "object", "properties": {"name": LEAVES["name"], "age": LEAVES["age"], "email": LEAVES["email"]},
               "required": ["name", "age"]},
    "address": {"type": "object", "properties": {
        "street": LEAVES["name"], "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "geo": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                 "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                "required": ["lat", "lon"]}}, "required": ["zip", "geo"]},
    "items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": LEAVES["code"], "qty": LEAVES["count"]}, "required": ["sku", "qty"]}},
    "shape": {"anyOf": [
        {"type": "object", "properties": {"circle": LEAVES["ratio"]}, "required": ["circle"]},
        {"type": "object", "properties": {"square": LEAVES["count"]}, "required": ["square"]}]},
}


def _object(names: list[str], required: list[str]) -> dict:
    pool = {**LEAVES, **NESTED}
    return {"type": "object", "properties": {n: pool[n] for n in names}, "required": required}


def schemas() -> list[dict]:
    """Sixty-six schemas: every leaf and nested shape alone (required), then mixes of three with
    some optional."""
    out = [_object([n], [n]) for n in LEAVES] + [_object([n], [n]) for n in NESTED]
    names = sorted({**LEAVES, **NESTED})
    for i, trio in enumerate(itertools.islice(itertools.combinations(names, 3), 0, 35 * 97, 97)):
        out.append(_object(list(trio), list(trio) if i % 2 else list(trio[:2])))
    out.append({"type": "array", "items": NESTED["point"], "minItems": 1, "maxItems": 3})
    out.append({"$defs": {"leaf": {"type": "object", "properties": {"v": LEAVES["count"]}, "required": ["v"]}},
                "type": "object", "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}},
                "required": ["left", "right"]})
    return out
