"""Coercing a call's arguments to its tool's schema, then validating them with jsonschema.

Models often quote numbers (`"7"`). Where the schema asks for an integer, number or boolean and
the value is a string that reads as one, it is converted; a string parameter keeps `"7"`.
Everything else is left to the validator, so an argument that cannot be read fails validation
with the validator's message.
"""

from __future__ import annotations

import json
from typing import Any


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
    if "integer" in types:
        try:
            return int(text)
        except ValueError:
            pass
    if "number" in types:
        try:
            return float(text)
        except ValueError:
            pass
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


def validated_arguments(arguments: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """Coerced arguments, or a ValueError listing every way they fail the schema."""
    import jsonschema  # here, not at the top: training without tools must not need it

    coerced = coerce(arguments, schema)
    validator = jsonschema.validators.validator_for(schema)(schema)
    problems = sorted(validator.iter_errors(coerced), key=lambda e: list(e.absolute_path))
    if problems:
        details = "; ".join(
            f"{'/'.join(str(p) for p in e.absolute_path) or 'arguments'}: {e.message}" for e in problems
        )
        raise ValueError(details)
    return coerced
