"""Reasoning output: the thinking a reasoning model writes between `<think>` and `</think>`,
returned apart from its answer (chat: `reasoning_content`; Responses: a `reasoning` item).
Registered by name (`PARSERS`) and chosen by `router.reasoning_parser`, as vLLM's
`--reasoning-parser`:

- `deepseek_r1` (DeepSeek-R1 and its distills): the output starts inside the thinking block
  (the chat template opened it; a leading `<think>` is dropped); everything before `</think>`
  is reasoning, and an output that never closes it is all reasoning;
- `qwen3` (Qwen3 with thinking): the output is reasoning only where it opens with `<think>`
  (leading blanks aside), up to `</think>` (or its end, unclosed); otherwise it is all answer.

The answer is the text after `</think>` as the model wrote it. Tool calls are read, and a
client's answer is shown, from the answer part only. A stream (`ReasoningStream`) holds back
only text that may still be a marker, so its pieces add up to exactly `split` of the whole.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_inside: bool  # the output begins inside the thinking block (deepseek_r1)

    def split(self, text: str, final: bool = True) -> tuple[str, str, bool]:
        """(reasoning, answer, decided) of `text`. Not `final`: only what no later text can
        change (a marker still arriving is held back); `decided`: whether the answer has
        begun, so that every later character is answer."""
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
        return body[:len(body) - _overlap(body, END)], "", False


def _overlap(text: str, marker: str) -> int:
    """How many of `text`'s last characters could begin `marker`."""
    return max((k for k in range(1, len(marker)) if text.endswith(marker[:k])), default=0)


PARSERS: dict[str, ReasoningFormat] = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_inside=True),
    "qwen3": ReasoningFormat("qwen3", starts_inside=False),
}


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
