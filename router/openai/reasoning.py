"""Reasoning output: the thinking a reasoning model writes apart from its answer, returned
apart (chat: `reasoning_content`; Responses: a `reasoning` item). Registered by name
(`PARSERS`) and chosen by `router.reasoning_parser`, as vLLM's `--reasoning-parser`:

- `deepseek_r1` (DeepSeek-R1 and its distills): the output starts inside the thinking block
  (the chat template opened it; a leading `<think>` is dropped); everything before `</think>`
  is reasoning, and an output that never closes it is all reasoning;
- `qwen3` (Qwen3 with thinking): the output is reasoning only where it opens with `<think>`
  (leading blanks aside), up to `</think>` (or its end, unclosed); otherwise it is all answer;
- `gpt_oss` (gpt-oss's Harmony channels): the output is a run of messages,
  `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...
  <|return|>`; the `analysis` channel's text is reasoning, every other channel's (`final`,
  `commentary`) is answer, and the markers are dropped, but for a function call (a message
  to `functions.NAME`, not on `analysis`), which stays in the answer as Harmony markup for
  the `gpt_oss` tool-call parser. Its markers are special tokens, so requests read with it
  keep special tokens in their text (`keeps_special_tokens`). Text before any channel marker
  is answer.

The answer is the text after the reasoning as the model wrote it. Tool calls are read, and a
client's answer is shown, from the answer part only; structured output constrains only the
answer part (`ThinkTags.grammar_bounds`). A stream (`ReasoningStream`) holds back only text
that may still be a marker, so its pieces add up to exactly `split` of the whole.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from router.openai import harmony
from workers.contract.protocol import SamplingParams

START, END = "<think>", "</think>"


class ReasoningFormat(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def keeps_special_tokens(self) -> bool:
        """Its markers are special tokens: the text must keep them."""
        ...

    def split(self, text: str, final: bool = True) -> tuple[str, str, bool]:
        """(reasoning, answer, decided) of `text`. Not `final`: only what no later text can
        change (a marker still arriving is held back); `decided`: whether every later
        character is answer (a stream then passes them straight through)."""
        ...

    def grammar_bounds(self) -> tuple[str, str] | None:
        """(opening, end) markers a grammar lets the reasoning through by (`StructuredOutput.
        reasoning_start`/`reasoning_end`); None: the grammar constrains the whole output."""
        ...


@dataclass(frozen=True)
class ThinkTags:
    """`<think>...</think>` (deepseek_r1, qwen3)."""

    name: str
    starts_inside: bool  # the output begins inside the thinking block (deepseek_r1)
    keeps_special_tokens: bool = False

    def split(self, text: str, final: bool = True) -> tuple[str, str, bool]:
        head = text.lstrip()
        if not final and START.startswith(head):
            return "", "", False  # blanks or "<thi": a thinking block may be opening
        if head.startswith(START):
            body = head[len(START):]
        elif self.starts_inside:
            body = text
        else:
            return "", text, True
        at = body.find(END)
        if at >= 0:
            return body[:at], body[at + len(END):], True
        if final:
            return body, "", True
        return body[:len(body) - _overlap(body, (END,))], "", False

    def grammar_bounds(self) -> tuple[str, str] | None:
        """deepseek_r1: anything up to `</think>`; qwen3: an optional `<think>` block."""
        return ("" if self.starts_inside else START), END


@dataclass(frozen=True)
class HarmonyChannels:
    """gpt-oss's Harmony messages (`router.openai.harmony`): the `analysis` channel is
    reasoning, the others answer; a function call (a message to `functions.NAME` on another
    channel) stays in the answer as Harmony markup (`harmony.call_opening`, its arguments,
    `<|call|>`) for the `gpt_oss` tool-call parser to read (a request that reads no calls gets
    that markup in its content). Never `decided` (a later message
    may be analysis again): a stream re-reads its whole text at each piece, which costs a scan
    of the text per piece."""

    name: str
    keeps_special_tokens: bool = True

    def split(self, text: str, final: bool = True) -> tuple[str, str, bool]:
        end = len(text) if final else len(text) - _overlap(text, harmony.MARKERS)
        reasoning: list[str] = []
        answer: list[str] = []
        body = answer  # where the current message's text goes; before any marker: answer
        state, channel, role, header, pos = "body", "final", "", "", 0
        in_call = False
        for m in harmony.MARKER.finditer(text, 0, end):
            chunk = text[pos:m.start()]
            if state == "body":
                body.append(chunk)
            elif state == "role":
                role += chunk
            elif state == "header":
                header += chunk
            kind, pos = m.group(1), m.end()
            if kind == "start":
                state, role, header = "role", "", ""
            elif kind == "channel":
                state, header = "header", ""
            elif kind == "message":
                channel = (header.split() or [channel])[0] if state == "header" else channel
                called = harmony.function_called(f"{role} {header}")
                in_call = called is not None and channel != "analysis"
                if in_call:
                    answer.append(harmony.call_opening(called or ""))
                body = reasoning if channel == "analysis" and not in_call else answer
                state = "body"
            elif kind != "constrain":  # end, return, call: the message ends
                if state == "body" and in_call:
                    answer.append(harmony.CALL_END)
                state, in_call = "between", False
        if state == "body":
            body.append(text[pos:end])
        return "".join(reasoning), "".join(answer), False

    def grammar_bounds(self) -> tuple[str, str] | None:
        return None  # its markers are special tokens a grammar cannot write


def _overlap(text: str, markers: tuple[str, ...]) -> int:
    """How many of `text`'s last characters could begin one of `markers`."""
    return max((k for marker in markers for k in range(1, len(marker))
                if text.endswith(marker[:k])), default=0)


PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ThinkTags("deepseek_r1", starts_inside=True),
    "qwen3": ThinkTags("qwen3", starts_inside=False),
    "gpt_oss": HarmonyChannels("gpt_oss"),
}
def answer_params(thinking: ReasoningFormat | None, params: SamplingParams) -> SamplingParams:
    """`params` read with a reasoning parser: the grammar (if any) constrains the answer only,
    and the text keeps the special tokens the format's markers are."""
    if thinking is None:
        return params
    bounds = thinking.grammar_bounds()
    if params.structured is not None and bounds is not None:
        params = dataclasses.replace(params, structured=dataclasses.replace(
            params.structured, reasoning_start=bounds[0], reasoning_end=bounds[1]))
    if thinking.keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params


def reasoning_format(parser: str | None) -> ReasoningFormat | None:
    """The format a `reasoning_parser` setting reads reasoning in (None: all output is the
    answer)."""
    return None if parser is None else PARSERS[parser]


class ReasoningStream:
    """One streamed choice's text, split as it arrives: `feed` and `finish` return
    (reasoning, answer) pieces, which add up to `fmt.split(whole text)`."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self._reasoning_sent = 0
        self._answer_sent = 0
        self._decided = False  # the answer has begun: new text passes straight through

    def feed(self, new_text: str) -> tuple[str, str]:
        if self._decided:
            return "", new_text
        self.text += new_text
        return self._emit(final=False)

    def finish(self) -> tuple[str, str]:
        """What is left once the choice has finished."""
        if self._decided:
            return "", ""
        return self._emit(final=True)

    def _emit(self, final: bool) -> tuple[str, str]:
        reasoning, answer, decided = self.fmt.split(self.text, final)
        out = reasoning[self._reasoning_sent:], answer[self._answer_sent:]
        self._reasoning_sent, self._answer_sent = len(reasoning), len(answer)
        if decided:
            self._decided, self.text = True, ""
        return out
