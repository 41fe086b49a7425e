"""A response's output, built as its text arrives: the output items (a `reasoning` item, the
assistant `message`, `function_call` items, in that order) and the typed server-sent events
OpenAI streams for them (`response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, `response.reasoning_text.delta`, their `.done`
events...). A non-streamed response is built by the same `OutputStream`, its events dropped,
so a stream's items are exactly the non-streamed response's."""

from __future__ import annotations

import uuid
from typing import Any

from router.openai.reasoning import ReasoningFormat, ReasoningStream
from router.openai.tool_calls import ToolCallStream
from router.openai.tool_parsers import ToolCallFormat

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputStream:
    """One response's output items and their events. `feed` a generation's new text, then
    `finish` once; `items` are the output so far (all of it after `finish`). Events carry no
    `sequence_number` (the caller numbers the whole stream)."""

    def __init__(self, thinking: ReasoningFormat | None, calls: ToolCallFormat | None) -> None:
        self.items: list[dict[str, Any]] = []
        self.num_reasoning_tokens = 0  # tokens generated before the answer began
        self._answered = False
        self._thoughts = ReasoningStream(thinking) if thinking is not None else None
        self._calls = ToolCallStream(calls) if calls is not None else None
        self._open: dict[str, Any] | None = None  # the item whose text is arriving
        self._call_items: list[dict[str, Any]] = []

    def feed(self, text: str, num_tokens: int = 0) -> list[Event]:
        """The events of `text` (`num_tokens` generated it: counted as reasoning tokens while
        no answer has begun)."""
        reasoning, answer = self._thoughts.feed(text) if self._thoughts else ("", text)
        self._answered = self._answered or bool(answer)
        if self._thoughts and not self._answered:  # held-back text included
            self.num_reasoning_tokens += num_tokens
        return self._events(reasoning, answer, final=False)

    def finish(self) -> list[Event]:
        """The rest of the events, every item closed."""
        reasoning, answer = self._thoughts.finish() if self._thoughts else ("", "")
        events = self._events(reasoning, answer, final=True)
        return events + self._close()

    def _events(self, reasoning: str, answer: str, final: bool) -> list[Event]:
        events = self._reason(reasoning) if reasoning else []
        if self._calls is None:
            return events + (self._say(answer) if answer else [])
        deltas = self._calls.feed(answer) if answer else []
        if final:
            deltas += self._calls.finish()
        for delta in deltas:
            if "content" in delta:
                events += self._say(delta["content"])
            for call in delta.get("tool_calls", ()):
                events += self._call(call)
        return events

    def _start(self, item: dict[str, Any]) -> list[Event]:
        events = self._close()
        self.items.append(item)
        self._open = item
        return events + [{"type": "response.output_item.added",
                          "output_index": len(self.items) - 1, "item": _copy(item)}]

    def _place(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _reason(self, text: str) -> list[Event]:
        events = []
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}],
                    "status": "in_progress"}
            events = self._start(item)
        item["content"][0]["text"] += text
        return events + [{"type": "response.reasoning_text.delta", **self._place(item),
                          "content_index": 0, "delta": text}]

    def _say(self, text: str) -> list[Event]:
        events = []
        item = self._open
        if item is None or item["type"] != "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            events = self._start(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            events.append({"type": "response.content_part.added", **self._place(item),
                           "content_index": 0, "part": dict(part)})
        item["content"][0]["text"] += text
        return events + [{"type": "response.output_text.delta", **self._place(item),
                          "content_index": 0, "delta": text, "logprobs": []}]

    def _call(self, delta: dict[str, Any]) -> list[Event]:
        events = []
        if delta["index"] == len(self._call_items):  # a new call: its id and name
            item = {"id": new_id("fc"), "type": "function_call", "call_id": delta["id"],
                    "name": delta["function"]["name"], "arguments": "",
                    "status": "in_progress"}
            self._call_items.append(item)
            events = self._start(item)
        item = self._call_items[delta["index"]]
        piece = delta["function"].get("arguments", "")
        if piece:
            item["arguments"] += piece
            events.append({"type": "response.function_call_arguments.delta",
                           **self._place(item), "delta": piece})
        return events

    def _close(self) -> list[Event]:
        """The `.done` events of the open item, which is then complete."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        place = self._place(item)
        if item["type"] == "reasoning":
            events = [{"type": "response.reasoning_text.done", **place, "content_index": 0,
                       "text": item["content"][0]["text"]}]
        elif item["type"] == "message":
            part = item["content"][0]
            events = [{"type": "response.output_text.done", **place, "content_index": 0,
                       "text": part["text"], "logprobs": []},
                      {"type": "response.content_part.done", **place, "content_index": 0,
                       "part": dict(part)}]
        else:
            events = [{"type": "response.function_call_arguments.done", **place,
                       "name": item["name"], "arguments": item["arguments"]}]
        return events + [{"type": "response.output_item.done",
                          "output_index": place["output_index"], "item": _copy(item)}]


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it stands, its content parts copied (later text does not change it)."""
    return {**item, **({"content": [dict(p) for p in item["content"]]}
                       if "content" in item else {})}
