"""The structured-output fields of the OpenAI bodies: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` names, turned into one `StructuredOutput`.

A bad constraint (a schema that is not an object, a keyword the compiler would ignore, two
constraints at once) is a 400 naming the field here; one that does not compile (a regex that
does not parse, a schema the compiler refuses) is refused by the worker before it allocates
anything, as a 400 naming the same field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.errors import BadRequestError
from workers.contract.protocol import InvalidRequestError
from workers.contract.structured_output import StructuredOutput


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (one constraint of the five)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """The body fields that constrain the output's text."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's names before `structured_outputs`
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["auto", "xgrammar"] | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint the body asks for (None: free text); raises `BadRequestError`
        naming the field when it is malformed or when two fields ask for one."""
        found: list[StructuredOutput] = []
        try:
            self._collect(found)
        except InvalidRequestError as exc:
            raise BadRequestError(exc.message, param=exc.param) from None
        if len(found) > 1:
            names = ", ".join(s.param for s in found)
            raise BadRequestError(f"at most one output constraint per request, got {names}",
                                  param=found[1].param)
        return found[0] if found else None

    def _collect(self, found: list[StructuredOutput]) -> None:
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(StructuredOutput("json_object", param="response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise BadRequestError("response_format of type json_schema needs "
                                      "json_schema.schema", param="response_format")
            found.append(StructuredOutput.json_schema(fmt.json_schema.schema_,
                                                      "response_format"))
        so = self.structured_outputs
        if so is not None:
            _from_fields(found, "structured_outputs.", so.json_, so.regex, so.choice,
                         so.grammar, bool(so.json_object))
        _from_fields(found, "guided_", self.guided_json, self.guided_regex, self.guided_choice,
                     self.guided_grammar, False)


def _from_fields(found: list[StructuredOutput], prefix: str, schema: Any, regex: str | None,
                 choice: list[str] | None, grammar: str | None, json_object: bool) -> None:
    if schema is not None:
        found.append(StructuredOutput.json_schema(schema, f"{prefix}json"))
    if regex is not None:
        found.append(StructuredOutput("regex", regex, f"{prefix}regex"))
    if choice is not None:
        found.append(StructuredOutput.choice(choice, f"{prefix}choice"))
    if grammar is not None:
        found.append(StructuredOutput("grammar", grammar, f"{prefix}grammar"))
    if json_object:
        found.append(StructuredOutput("json_object", param=f"{prefix}json_object"))
