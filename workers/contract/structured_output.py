"""What a structured-output request constrains its text to: a JSON schema, any JSON object, a
regular expression, one of a list of strings, an EBNF grammar, or a tool call (a JSON schema
between a fixed prefix and suffix, as a tool-call format writes one). Torch-free: the router builds
and checks these; the engine compiles them (`workers.engine.grammar`).

A JSON schema is checked here against the keywords the grammar compiler honours: a keyword it
would ignore (`not`, `uniqueItems`, `multipleOf`, ...) would let through text that fails the
schema, so it is refused with a message naming it and where it sits, before any work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from workers.contract.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_call")

# JSON-schema keywords the compiler enforces, or that constrain nothing (annotations)
_ENFORCED = frozenset({
    "type", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "minProperties", "maxProperties",
    "items", "prefixItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
})
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "strict",
})
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "prefixItems")  # [schema, ...]
_MAX_SPEC_CHARS = 1 << 20  # a grammar's source, as text


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's output text. `value` is compact text (a schema's JSON, its
    properties in the order given, which the output follows; the choices as a JSON list), so
    equal constraints are equal records and a compiled grammar is cached by the record.
    `param`: the request field it came from, named in errors.

    With a reasoning parser, the constraint starts after the reasoning: `reasoning_end`
    (e.g. "</think>") is the marker the reasoning ends with, free text before it, and
    `reasoning_start` (e.g. "<think>"), when set, makes the block optional: the output either
    opens with it (leading blanks aside) or is constrained from its first character."""

    kind: str
    value: str = ""
    param: str = "response_format"
    reasoning_start: str = ""
    reasoning_end: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                f"{self.param}: unknown constraint {self.kind!r}; expected one of {KINDS}",
                param=self.param)
        if len(self.value) > _MAX_SPEC_CHARS:
            raise InvalidRequestError(f"{self.param} is longer than {_MAX_SPEC_CHARS} characters",
                                      param=self.param)
        if self.reasoning_start and not self.reasoning_end:
            raise InvalidRequestError(f"{self.param}: reasoning_start "
                                      f"{self.reasoning_start!r} without a reasoning_end",
                                      param=self.param)
        if self.kind in ("regex", "grammar") and not self.value:
            raise InvalidRequestError(f"{self.param}: an empty {self.kind}", param=self.param)

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format") -> StructuredOutput:
        """A JSON schema (a dict, or its JSON text); raises `InvalidRequestError` for a
        schema that is not an object or uses a keyword the compiler would ignore."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(f"{param}: the schema is not JSON ({exc})",
                                          param=param) from None
        if schema is True or schema == {}:
            return cls("json_object", "", param)
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                f"{param}: a JSON schema must be an object, got {type(schema).__name__}",
                param=param)
        check_schema(schema, param)
        return cls("json", json.dumps(schema, separators=(",", ":")), param)

    @classmethod
    def choice(cls, choices: Any, param: str = "structured_outputs.choice") -> StructuredOutput:
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise InvalidRequestError(f"{param} must be a non-empty list of non-empty strings",
                                      param=param)
        return cls("choice", json.dumps(choices), param)

    @classmethod
    def tool_call(cls, prefix: str, schema: dict[str, Any], suffix: str,
                  param: str = "tool_choice") -> StructuredOutput:
        """`prefix`, then JSON matching `schema` (checked as `json_schema` checks), then
        `suffix`."""
        check_schema(schema, param)
        return cls("tool_call", json.dumps({"prefix": prefix, "schema": schema,
                                            "suffix": suffix}, separators=(",", ":")), param)

    @property
    def choices(self) -> list[str]:
        return json.loads(self.value)


def check_schema(schema: Any, param: str, where: str = "") -> None:
    """Refuse any keyword the compiler does not enforce, anywhere in the schema (a `$ref` must
    point inside the schema: `#/...`)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            f"{param}: the schema at {where or '/'} must be an object or a boolean, got "
            f"{type(schema).__name__}", param=param)
    for key, value in schema.items():
        at = f"{where}/{key}"
        if key not in _ENFORCED and key not in _ANNOTATIONS:
            raise InvalidRequestError(
                f"{param}: the JSON schema keyword {key!r} (at {at}) is not supported; "
                f"supported: {', '.join(sorted(_ENFORCED))}", param=param)
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise InvalidRequestError(
                f"{param}: $ref {value!r} (at {at}) must point inside the schema ('#/...')",
                param=param)
        if key in _SCHEMA_MAPS:
            if not isinstance(value, dict):
                raise InvalidRequestError(f"{param}: {at} must be an object", param=param)
            for name, sub in value.items():
                check_schema(sub, param, f"{at}/{name}")
        elif key in _SCHEMA_LISTS:
            if not isinstance(value, list) or not value:
                raise InvalidRequestError(f"{param}: {at} must be a non-empty list", param=param)
            for i, sub in enumerate(value):
                check_schema(sub, param, f"{at}/{i}")
        elif key in ("items", "additionalProperties"):
            check_schema(value, param, at)
