"""Tool-call formats: how a model writes a function call, how to read it back (whole, or as
deltas while it streams), and the grammar that forces one when `tool_choice` is `required` or
names a function. Registered by name (`PARSERS`) and chosen by `router.tool_call_parser`, as
vLLM's `--tool-call-parser`; by default from the chat template's own wording.

- `llama3_json` (Llama 3.1-3.3): a bare JSON object `{"name": ..., "parameters": {...}}`;
- `hermes` (Hermes, Qwen2.5): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`;
- `gpt_oss` (gpt-oss's Harmony): a message to the function on the commentary channel,
  `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}
  <|call|>` (`router.openai.harmony`); read with the `gpt_oss` reasoning parser, which keeps
  the calls, and only the calls, of the answer part in this markup.

A call's `arguments` are the model's JSON text as written (not re-serialized), so the pieces a
stream sends add up to exactly the non-streamed call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from router.errors import BadRequestError
from router.openai import harmony
from workers.contract.structured_output import StructuredOutput

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text


class ToolCallFormat(Protocol):
    """How one model family writes its calls; `ToolCallStream` and `message_with_calls` read
    them through this."""

    @property
    def name(self) -> str: ...

    def forced(self, tools: list[dict[str, Any]]) -> StructuredOutput:
        """The constraint of one call to one of `tools` (OpenAI function specs: name,
        parameters): what a forced call must be. Raises `BadRequestError` where the format
        cannot be forced."""
        ...

    def opens(self, text: str) -> int:
        """Where the tool calls start in `text` (-1: not there, or not yet)."""
        ...

    def held_back(self, text: str) -> int:
        """How many of `text`'s last characters (no call open in it) may still begin the
        calls: a stream holds them back from the content."""
        ...

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content before the calls, the calls); no calls: (text, [])."""
        ...

    def read_calls(self, body: str, final: bool) -> tuple[list[tuple[str, str]] | None, bool]:
        """The calls written so far in `body` (from where `opens` found them), each (name,
        arguments text, possibly partial unless `final`), and whether the last is complete.
        None: `body` is not this format's calls."""
        ...


@dataclass(frozen=True)
class JsonCalls:
    """Calls written as JSON objects `{"name": ..., ARGS_KEY: {...}}` after a marker."""

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

    def held_back(self, text: str) -> int:
        if self.bare:  # blank so far: a call may still open with "{"
            return len(text) if not text.strip() else 0
        return _tail_overlap(text, self.start)

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


def _tail_overlap(text: str, marker: str) -> int:
    """How many of `text`'s last characters could begin `marker`."""
    return max((k for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)


@dataclass(frozen=True)
class HarmonyCalls:
    """gpt-oss's calls: Harmony messages to `functions.NAME`, each body the arguments' JSON
    text up to `<|call|>` (an output cut before it still makes a call once its arguments are
    whole JSON). Text after the calls that is no call is dropped, as the JSON formats do."""

    name: str = "gpt_oss"

    def forced(self, tools: list[dict[str, Any]]) -> StructuredOutput:
        raise BadRequestError(
            "tool_choice 'required' or a named function cannot be forced on gpt_oss tool calls "
            "(their markers are special tokens a grammar cannot write); use 'auto'",
            param="tool_choice")

    def opens(self, text: str) -> int:
        for head in harmony.HEADER.finditer(text):
            if self._called(head) is not None:
                return head.start()
        return -1

    def held_back(self, text: str) -> int:
        at = text.rfind("<|start|>")  # a header still arriving may be a call's
        if at >= 0 and "<|message|>" not in text[at:]:
            return len(text) - at
        return _tail_overlap(text, "<|start|>")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        at = self.opens(text)
        calls = None if at < 0 else self.read_calls(text[at:], final=True)[0]
        if not calls:
            return text, []
        return text[:at], [ToolCall(name, args) for name, args in calls]

    def read_calls(self, body: str, final: bool) -> tuple[list[tuple[str, str]] | None, bool]:
        calls: list[tuple[str, str]] = []
        pos = 0
        while True:
            head = harmony.HEADER.match(body, _skip(body, pos))
            name = None if head is None else self._called(head)
            if head is None or name is None:  # the next header not whole yet, or no call
                return (calls or None) if final else calls, True
            end = body.find(harmony.CALL_END, head.end())
            if end >= 0:
                calls.append((name, body[head.end():end]))
                pos = end + len(harmony.CALL_END)
                continue
            args = body[head.end():]
            if not final:  # what may be the closing marker still arriving is held back
                calls.append((name, args[:len(args) - _tail_overlap(args, harmony.CALL_END)]))
                return calls, False
            try:  # cut before <|call|> (a stop token the text left out): whole JSON only
                json.loads(args)
            except ValueError:
                return None, False
            calls.append((name, args))
            return calls, True

    @staticmethod
    def _called(head: Any) -> str | None:
        return harmony.function_called(f"{head.group(1)} {head.group(2)}")


PARSERS: dict[str, ToolCallFormat] = {
    "llama3_json": JsonCalls("llama3_json", "{", "parameters", "", "", bare=True),
    "hermes": JsonCalls("hermes", "<tool_call>", "arguments", "<tool_call>\n",
                        "\n</tool_call>", marker_per_call=True),
    "mistral": JsonCalls("mistral", "[TOOL_CALLS]", "arguments", "[TOOL_CALLS][", "]",
                         in_list=True),
    "gpt_oss": HarmonyCalls(),
}


def parser_for_template(template: str | None) -> str | None:
    """The format a chat template's wording asks for (None: it renders no tools)."""
    if not template:
        return None
    if "to=functions." in template:
        return "gpt_oss"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if '"parameters"' in template or "ipython" in template:
        return "llama3_json"
    return None
