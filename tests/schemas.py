"""Seeded random JSON schemas for the structured-output tests: nested objects, arrays with
bounds, enums, integers and numbers with ranges, strings with bounded lengths, required and
optional fields, `anyOf` and local `$ref`s. Every string, array and number is bounded, so a
random-weight model under the constraint ends within a few hundred tokens."""

from __future__ import annotations

import random
from typing import Any

_WORDS = ("alpha", "beta", "gamma", "delta", "red", "green", "blue", "x", "y", "zed")


def random_schema(seed: int, max_depth: int = 3) -> dict[str, Any]:
    """An object schema drawn from `seed` (the same seed, the same schema)."""
    rng = random.Random(seed)
    schema = _object(rng, max_depth)
    if rng.random() < 0.3:  # a local definition, used by reference
        schema["$defs"] = {"point": {"type": "object", "properties": {
            "x": {"type": "integer", "minimum": -9, "maximum": 9},
            "y": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x", "y"], "additionalProperties": False}}
        schema["properties"]["where"] = {"$ref": "#/$defs/point"}
        schema["required"].append("where")
    return schema


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(_WORDS, rng.randint(1, 4))
    properties = {name: _value(rng, depth - 1) for name in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum", "null"]
    if depth > 0:
        kinds += ["object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 8)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        low = rng.randint(-10, 10)
        return {"type": "number", "minimum": low, "maximum": low + rng.randint(1, 50)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        return {"enum": rng.sample(["on", "off", "auto", 1, 2.5, True, None], rng.randint(1, 4))}
    if kind == "object":
        return _object(rng, depth)
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": _value(rng, depth - 1), "minItems": low,
                "maxItems": low + rng.randint(0, 3)}
    return {"anyOf": [_value(rng, depth - 1), _value(rng, depth - 1)]}
