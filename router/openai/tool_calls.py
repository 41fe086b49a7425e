"""Tool calling on `/v1/chat/completions`: the `tools` and `tool_choice` fields, earlier calls
and tool results in the conversation, and the calls read out of the model's text (whole, or as
OpenAI's streamed deltas: each call's id and name first, then its arguments in pieces).

`tool_choice`: `none` (tools are shown to the template, no call is read), `auto` (calls are read
when the model writes them), `required` or a named function (the grammar forces one call, to any
of the tools or to that one). The format is the router's tool-call parser
(`tool_parsers.PARSERS`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.errors import BadRequestError
from router.openai.tool_parsers import PARSERS, ToolCallFormat, parser_for_template
from workers.contract.structured_output import StructuredOutput


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class _FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: _FunctionName


class _FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """A call an assistant message made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: _FunctionCall

    def as_template_input(self) -> dict[str, Any]:
        """As chat templates read it (transformers' convention): arguments as a dict."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


class ToolFields(BaseModel):
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # a forced choice makes one call either way

    def check_tools(self) -> None:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise BadRequestError(f"tools: function names must be unique, got {names}",
                                  param="tools")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise BadRequestError("tool_choice asks for a call, but no tools are given",
                                  param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise BadRequestError(
                f"tool_choice names function {choice.function.name!r}, which is not among "
                f"the tools ({', '.join(names)})", param="tool_choice")

    @property
    def reads_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def forced(self, fmt: ToolCallFormat) -> StructuredOutput | None:
        """The grammar of the call `tool_choice` forces (None: nothing forced)."""
        choice = self.tool_choice
        if choice == "required":
            chosen = self.tools or []
        elif isinstance(choice, NamedToolChoice):
            chosen = [t for t in self.tools or () if t.function.name == choice.function.name]
        else:
            return None
        return fmt.forced([{"name": t.function.name, "parameters": t.function.parameters}
                           for t in chosen])


def tool_call_format(configured: str | None, tokenizer: Any) -> ToolCallFormat | None:
    """The format calls are read in: `router.tool_call_parser`, else the one the chat
    template's wording shows (None: the template renders no tools)."""
    name = configured or parser_for_template(tokenizer.chat_template_source(tools=True))
    return None if name is None else PARSERS[name]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_with_calls(fmt: ToolCallFormat, text: str, finish_reason: str | None
                       ) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a finished choice, its calls read out of `text`, and the
    finish reason ("tool_calls" when it made any)."""
    content, calls = fmt.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": content.strip() or None, "tool_calls": [
        {"id": _call_id(), "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}, \
        "tool_calls" if finish_reason == "stop" else finish_reason


class ToolCallStream:
    """One streamed choice's deltas: content until the calls open (text that may begin the
    opening marker is held back), then each call's id and name, then its arguments' new text."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self._content_sent = 0
        self._calls_at = -1  # where the calls start in `text`
        self._ids: list[str] = []
        self._args_sent: list[int] = []

    @property
    def made_calls(self) -> bool:
        return bool(self._ids)

    def feed(self, new_text: str) -> list[dict[str, Any]]:
        self.text += new_text
        if self._calls_at < 0:
            at = self.fmt.opens(self.text)
            if at < 0:
                return self._content(len(self.text) - self.fmt.held_back(self.text))
            self._calls_at = at
            deltas = self._content(at)
        else:
            deltas = []
        calls, _ = self.fmt.read_calls(self.text[self._calls_at:], final=False)
        return deltas + self._call_deltas(calls or [])

    def finish(self) -> list[dict[str, Any]]:
        """The rest, once the choice has finished: calls as the whole text reads them."""
        _, calls = self.fmt.parse(self.text)
        if not calls:
            if self._calls_at >= 0 and not self._ids:  # it looked like calls, but was not
                self._calls_at = -1
            return self._content(len(self.text)) if not self._ids else []
        return self._call_deltas([(c.name, c.arguments) for c in calls])

    def _content(self, end: int) -> list[dict[str, Any]]:
        if end <= self._content_sent:
            return []
        piece = self.text[self._content_sent:end]
        self._content_sent = end
        return [{"content": piece}]

    def _call_deltas(self, calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
        deltas = []
        for i, (name, args) in enumerate(calls):
            if i == len(self._ids):
                self._ids.append(_call_id())
                self._args_sent.append(0)
                deltas.append({"tool_calls": [{"index": i, "id": self._ids[i],
                                               "type": "function",
                                               "function": {"name": name, "arguments": ""}}]})
            if len(args) > self._args_sent[i]:
                deltas.append({"tool_calls": [{"index": i, "function": {
                    "arguments": args[self._args_sent[i]:]}}]})
                self._args_sent[i] = len(args)
        return deltas

