"""Tool-call formats: how a model writes a function call, how to read it back (whole, or as
deltas while it streams), and the grammar that forces one when `tool_choice` is `required` or
names a function. Registered by name (`PARSERS`) and chosen by `router.tool_call_parser`, as
vLLM's `--tool-call-parser`; by default from the chat template's own wording.

- `llama3_json` (Llama 3.1-3.3): a bare JSON object `{"name": ..., "parameters": {...}}`;
- `hermes` (Hermes, Qwen2.5): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`.

A call's `arguments` are the model's JSON text as written (not re-serialized), so the pieces a
stream sends add up to exactly the non-streamed call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from workers.contract.structured_output import StructuredOutput

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    start: str  # what opens the calls ("{" for llama3_json: the object itself)
    args_key: str  # "arguments" or "parameters"
    prefix: str  # before each forced call
    suffix: str  # after each forced call
    in_list: bool = False  # mistral: the calls are one JSON list
    bare: bool = False  # llama3_json: no marker, the call's own "{" opens it
    marker_per_call: bool = False  # hermes: every call opens with `start` again

    def forced(self, tools: list[dict[str, Any]]) -> StructuredOutput:
        """The constraint of one call to one of `tools` (OpenAI function specs: name,
        parameters), with this format's prefix and suffix: what a forced call must be."""
        calls = [{"type": "object", "properties": {
            "name": {"const": t["name"]},
            self.args_key: t.get("parameters") or {"type": "object", "properties": {}}},
            "required": ["name", self.args_key], "additionalProperties": False} for t in tools]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return StructuredOutput.tool_call(self.prefix, call, self.suffix, "tool_choice")

    def opens(self, text: str) -> int:
        """Where the tool calls start in `text` (-1: not there, or not yet)."""
        if self.bare:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped.startswith("{") else -1
        return text.find(self.start)

    def may_open(self, text: str) -> bool:
        """Whether `text`'s end could be the start of the opening marker still arriving."""
        if self.bare:
            return not text.strip()
        return any(text.endswith(self.start[:k]) for k in range(1, len(self.start)))

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content before the calls, the calls); no calls: (text, []). Calls that do not
        parse leave the whole text as content, as vLLM's parsers do."""
        at = self.opens(text)
        if at < 0:
            return text, []
        calls, _ = self.read_calls(text[at:], final=True)
        if calls is None:
            return text, []
        return text[:at], [ToolCall(name, args) for name, args in calls]

    def read_calls(self, body: str, final: bool) -> tuple[list[tuple[str, str]] | None, bool]:
        """The calls written so far in `body` (from the opening marker on), each (name,
        arguments text, possibly partial unless `final`), and whether the last is complete.
        None: `body` is not this format's calls."""
        calls: list[tuple[str, str]] = []
        pos = 0 if self.bare else len(self.start)
        if self.in_list:
            pos = _skip(body, pos)
            if pos < len(body) and body[pos] != "[":
                return None, False
            pos += 1
        while True:
            pos = _skip(body, pos)
            if pos >= len(body):
                return (calls if calls or not final else None), bool(calls)
            if body[pos] != "{":
                return (calls if calls else None), True
            head = _call_head(body, pos, self.args_key)
            if head is None:  # the name or the arguments key not written yet
                if final:
                    return None, False
                return calls, False
            name, args_at = head
            try:
                _, end = _DECODER.raw_decode(body, args_at)
            except ValueError:
                if final:
                    return None, False
                calls.append((name, _held_back(body[args_at:])))
                return calls, False
            calls.append((name, body[args_at:end]))
            close = _skip(body, end)
            if close >= len(body) or body[close] != "}":
                return (None if final else calls), False
            pos = _skip(body, close + 1)
            for sep in (self.suffix.strip(), ",", ";"):
                if sep and body.startswith(sep, pos):
                    pos += len(sep)
            pos = _skip(body, pos)
            if self.marker_per_call and body.startswith(self.start, pos):
                pos += len(self.start)


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _call_head(body: str, pos: int, args_key: str) -> tuple[str, int] | None:
    """(name, where the arguments' JSON starts) of the call object at `pos`, once both its
    "name" and its arguments key are written; None before."""
    key = f'"{args_key}"'
    name_at = body.find('"name"', pos)
    args_key_at = body.find(key, pos)
    if name_at < 0 or args_key_at < 0:
        return None
    colon = body.find(":", name_at + 6)
    try:
        name, _ = _DECODER.raw_decode(body, _skip(body, colon + 1))
    except ValueError:
        return None
    colon = body.find(":", args_key_at + len(key))
    if colon < 0:
        return None
    args_at = _skip(body, colon + 1)
    if args_at >= len(body) or not isinstance(name, str):
        return None
    return name, args_at


def _held_back(partial: str) -> str:
    """Partial arguments text minus what could still be the call's own closing: trailing
    braces and blanks (sent once more text shows they belong to the arguments)."""
    return partial.rstrip("} \t\r\n")


PARSERS: dict[str, ToolCallFormat] = {
    "llama3_json": ToolCallFormat("llama3_json", "{", "parameters", "", "", bare=True),
    "hermes": ToolCallFormat("hermes", "<tool_call>", "arguments", "<tool_call>\n",
                             "\n</tool_call>", marker_per_call=True),
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS]", "arguments", "[TOOL_CALLS][", "]",
                              in_list=True),
}


def parser_for_template(template: str | None) -> str | None:
    """The format a chat template's wording asks for (None: it renders no tools)."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if '"parameters"' in template or "ipython" in template:
        return "llama3_json"
    return None
