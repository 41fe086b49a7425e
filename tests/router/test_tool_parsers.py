"""The tool-call formats on hand-written model output: whole texts, and the same texts streamed a
few characters at a time, which must add up to exactly the whole-text reading."""

from __future__ import annotations

import pytest

from router.openai.tool_calls import ToolCallStream, message_with_calls
from router.openai.tool_parsers import PARSERS

CASES = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"deep": {"a": [1, {"b": "}"}]}}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
        '"arguments": {}}\n</tool_call>',
        "Let me check.",
        [("get_weather", '{"city": "Oslo", "deep": {"a": [1, {"b": "}"}]}}'),
         ("get_time", "{}")]),
    "llama3_json": (
        '{"name": "get_weather", "parameters": {"city": "Oslo, \\"NO\\"", "n": 3}}; '
        '{"name": "get_time", "parameters": {"zone": -2}}',
        "",
        [("get_weather", '{"city": "Oslo, \\"NO\\"", "n": 3}'), ("get_time", '{"zone": -2}')]),
    "mistral": (
        'sure [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
        '{"name": "get_time", "arguments": {"zone": 1}}]',
        "sure ",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": 1}')]),
    # the answer part the gpt_oss reasoning parser leaves: the calls in Harmony markup, the
    # recipient in the channel (as the model writes it) or in the role (as templates render it)
    "gpt_oss": (
        ('Checking. <|start|>assistant<|channel|>commentary to=functions.get_weather '
         '<|constrain|>json<|message|>{"city": "Oslo", "q": "<|x"}<|call|><|start|>assistant '
         'to=functions.get_time<|channel|>commentary json<|message|>{"zone": 1}<|call|>'),
        "Checking.",
        [("get_weather", '{"city": "Oslo", "q": "<|x"}'), ("get_time", '{"zone": 1}')]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_texts_read_as_content_and_calls(name):
    text, content, calls = CASES[name]
    got_content, got = PARSERS[name].parse(text)
    assert got_content.strip() == content.strip()  # the message strips it
    assert [(c.name, c.arguments) for c in got] == calls
    message, finish = message_with_calls(PARSERS[name], text, "stop")
    assert finish == "tool_calls" and len(message["tool_calls"]) == len(calls)


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_pieces_add_up_to_the_whole_reading(name, step):
    text, content, calls = CASES[name]
    stream = ToolCallStream(PARSERS[name])
    deltas = []
    for i in range(0, len(text), step):
        deltas += stream.feed(text[i:i + step])
    deltas += stream.finish()
    got_content = "".join(d.get("content", "") for d in deltas)
    assert got_content.strip() == content.strip()
    assert calls_of(deltas) == calls


def calls_of(deltas: list[dict]) -> list[tuple[str, str]]:
    """The calls streamed tool-call deltas add up to, in index order: (name, arguments), the
    id and name coming first in each call's deltas."""
    got: dict[int, list[str]] = {}
    for d in deltas:
        for call in d.get("tool_calls", ()):
            entry = got.setdefault(call["index"], ["", ""])
            if "id" in call:
                assert entry == ["", ""]  # the id and name come first
                entry[0] = call["function"]["name"]
            entry[1] += call["function"]["arguments"]
    return [(got[i][0], got[i][1]) for i in sorted(got)]


def test_text_without_calls_is_all_content_even_when_it_looks_like_a_start():
    for name, text in (("hermes", "a <tool_ b"), ("mistral", "[TOOL_"), ("llama3_json", "{oops"),
                       ("gpt_oss", "a <|start|>assistant<|channel|>final<|message|>b <|sta")):
        stream = ToolCallStream(PARSERS[name])
        deltas = stream.feed(text) + stream.finish()
        assert "".join(d.get("content", "") for d in deltas) == text
        assert PARSERS[name].parse(text) == (text, [])


def test_a_harmony_call_cut_before_its_end_marker_is_a_call_once_its_arguments_are_whole():
    head = "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>"
    assert PARSERS["gpt_oss"].parse(head + '{"a": 1}')[1][0].arguments == '{"a": 1}'
    assert PARSERS["gpt_oss"].parse(head + '{"a": ') == (head + '{"a": ', [])


def test_a_harmony_call_cannot_be_forced():
    from router.errors import BadRequestError

    with pytest.raises(BadRequestError) as err:
        PARSERS["gpt_oss"].forced([{"name": "f", "parameters": None}])
    assert err.value.param == "tool_choice" and "gpt_oss" in str(err.value)
