"""Coercing a call's arguments to its tool's schema, then validating them with jsonschema.

Models often quote numbers (`"7"`). Where the schema asks for an integer, number or boolean and
the value is a string that reads as one, it is converted; a string parameter keeps `"7"`.
Everything else is left to the validator, so an argument that cannot be read fails validation
with the validator's message. A number is read as JSON writes one (`"1_000"`, `"nan"` and
`"1e999"` are not numbers). An optional argument (`x: str | None`, which transformers' schema marks
`nullable`, an OpenAPI word JSON Schema does not know) takes `null`, as the function does.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

_INTEGER = re.compile(r"[+-]?[0-9]+")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _types(schema: dict[str, Any]) -> list[str]:
    declared = schema.get("type", [])
    found = [declared] if isinstance(declared, str) else list(declared)
    for option in schema.get("anyOf", []) + schema.get("oneOf", []):
        found += _types(option)
    return found


def _coerce_string(value: str, types: list[str]) -> Any:
    if "string" in types:
        return value
    text = value.strip()
    if "integer" in types and _INTEGER.fullmatch(text) and len(text) <= 1000:  # Python reads at most 4300 digits
        return int(text)
    if "number" in types and _NUMBER.fullmatch(text) and math.isfinite(float(text)):
        return float(text)
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if ("array" in types or "object" in types) and text[:1] in "[{":
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return value


def coerce(value: Any, schema: dict[str, Any]) -> Any:
    """`value` converted where the schema's type calls for it (recursing into objects and arrays)."""
    types = _types(schema)
    if isinstance(value, str):
        return _coerce_string(value, types)
    if isinstance(value, float) and "integer" in types and "number" not in types and value.is_integer():
        return int(value)
    if isinstance(value, dict) and isinstance(schema.get("properties"), dict):
        properties = schema["properties"]
        return {key: coerce(item, properties.get(key, {})) for key, item in value.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [coerce(item, schema["items"]) for item in value]
    return value


# Keywords whose value is a schema, a list of schemas, or a mapping of names to schemas (a property named
# ``nullable`` is no keyword); ``enum``, ``const`` and ``default`` hold values.
_SCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_SCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions")


def _nullable_as_json_schema(schema: Any) -> Any:
    """``schema`` with each OpenAPI ``nullable: true`` written as JSON Schema says it: ``null`` among its types and
    its enum's values."""
    if not isinstance(schema, dict):
        return schema
    out = {key: value for key, value in schema.items() if key != "nullable"}
    for key in _SCHEMA:
        if key in out:
            out[key] = _nullable_as_json_schema(out[key])
    for key in _SCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [_nullable_as_json_schema(item) for item in out[key]]
    for key in _NAMED_SCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _nullable_as_json_schema(item) for name, item in out[key].items()}
    if schema.get("nullable") is True:
        if isinstance(out.get("type"), (str, list)):
            out["type"] = list(dict.fromkeys([*([out["type"]] if isinstance(out["type"], str) else out["type"]), "null"]))
        if isinstance(out.get("enum"), list) and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
        for key in ("anyOf", "oneOf"):
            if isinstance(out.get(key), list) and "type" not in out:
                out[key] = [*out[key], {"type": "null"}]
    return out


def validated_arguments(arguments: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """Coerced arguments, or a ValueError listing every way they fail the schema."""
    import jsonschema  # here, not at the top: training without tools must not need it

    schema = _nullable_as_json_schema(schema)
    coerced = coerce(arguments, schema)
    validator = jsonschema.validators.validator_for(schema)(schema)
    problems = sorted(validator.iter_errors(coerced), key=lambda e: list(e.absolute_path))
    if problems:
        details = "; ".join(
            f"{'/'.join(str(p) for p in e.absolute_path) or 'arguments'}: {e.message}" for e in problems
        )
        raise ValueError(details)
    return coerced
