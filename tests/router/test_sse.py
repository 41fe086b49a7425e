"""Server-sent events: the per-token text chunk from a template is the event `sse` writes for
the same payload, whatever the text; events stay on one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.openai.sse import TextChunks, sse
from workers.contract.protocol import FinishReason, TokenEvent, TokenLogprob

HEAD = {"id": "cmpl-0f", "created": 1700000000, "model": "m\u00e9", "object": "text_completion"}


def completion_chunk(index: int, text: str) -> dict:
    return {**HEAD, "choices": [{"index": index, "text": text, "logprobs": None,
                                 "finish_reason": None, "stop_reason": None}]}


@given(text=st.text(), index=st.integers(0, 3))
def test_a_text_chunk_is_the_event_sse_writes_for_its_payload(text, index):
    chunks = TextChunks(completion_chunk)
    event = chunks(index, text)
    assert event == sse(completion_chunk(index, text))
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert len(event[:-2].splitlines()) == 1  # U+0085, U+2028, U+2029 escaped too
    assert json.loads(event[6:])["choices"][0]["text"] == text
    assert chunks(index, text) == event  # the template, kept


def test_a_text_chunk_holding_what_the_template_marks_with_is_still_right():
    chunks = TextChunks(completion_chunk)
    text = "\x00cleave-text\x00 \"quoted\" \\ \u2028"
    assert chunks(0, text) == sse(completion_chunk(0, text))


def test_a_replaced_event_is_what_dataclasses_replace_makes():
    event = TokenEvent("r1", 0, [5, 6], "ab", [TokenLogprob(5, -0.5, {})], None, None, 7, 3)
    for changes in ({"text": "x"}, {"token_ids": [1], "finish_reason": FinishReason.STOP,
                                    "stop_reason": "\n"}, {}):
        replaced = event.replaced(**changes)
        assert replaced == dataclasses.replace(event, **changes)
        assert replaced is not event
    assert event.text == "ab"  # the original untouched
    with pytest.raises(TypeError, match="tex"):
        event.replaced(tex="x")
