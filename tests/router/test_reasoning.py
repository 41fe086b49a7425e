"""Reasoning parsers on scripted model outputs: the split of a whole output, and the same output
streamed in pieces cut at every position (the pieces add up to the whole split)."""

from __future__ import annotations

import pytest

from router.config import REASONING_PARSERS
from router.openai.reasoning import PARSERS, ReasoningStream, answer_params
from router.openai.response_events import OutputStream
from router.openai.tool_parsers import PARSERS as TOOL_PARSERS
from workers.contract.protocol import SamplingParams
from workers.contract.structured_output import StructuredOutput

OUTPUTS = {
    # text: (deepseek_r1's (reasoning, answer), qwen3's)
    "<think>Paris is in France.</think>\n\nParis.": (
        ("Paris is in France.", "\n\nParis."), ("Paris is in France.", "\n\nParis.")),
    "The template opened it.</think>Paris.": (
        ("The template opened it.", "Paris."), ("", "The template opened it.</think>Paris.")),
    "Paris.": (("Paris.", ""), ("", "Paris.")),
    "  <think>unclosed <thin": (("unclosed <thin", ""), ("unclosed <thin", "")),
    "\n<think>a < b</think>x</think>": (("a < b", "x</think>"), ("a < b", "x</think>")),
    "": (("", ""), ("", "")),
    "  ": (("  ", ""), ("", "  ")),
    "<thinker>": (("<thinker>", ""), ("", "<thinker>")),
}


def test_every_parser_is_a_setting_choice():
    assert set(PARSERS) == set(REASONING_PARSERS)


@pytest.mark.parametrize("name,which", [("deepseek_r1", 0), ("qwen3", 1)])
def test_split_of_a_whole_output(name, which):
    for text, expected in OUTPUTS.items():
        reasoning, answer, _ = PARSERS[name].split(text)
        assert (reasoning, answer) == expected[which], text


def _streamed(name: str, pieces: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(PARSERS[name])
    reasoning = answer = ""
    for piece in pieces:
        r, a = stream.feed(piece)
        reasoning, answer = reasoning + r, answer + a
    r, a = stream.finish()
    return reasoning + r, answer + a


HARMONY = {
    # gpt-oss's output after the template's "<|start|>assistant": (reasoning, answer)
    "<|channel|>analysis<|message|>User asks: 2+2. Easy.<|end|><|start|>assistant"
    "<|channel|>final<|message|>4.<|return|>": ("User asks: 2+2. Easy.", "4."),
    "<|channel|>final<|message|>Just <|the> answer.": ("", "Just <|the> answer."),
    "<|channel|>analysis<|message|>cut short <|en": ("cut short <|en", ""),
    "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary "
    "to=functions.f <|constrain|>json<|message|>{}<|call|>": ("a", "{}"),
    "No channels at all.": ("", "No channels at all."),
    "": ("", ""),
}


def test_harmony_channels_split_into_reasoning_and_answer():
    for text, expected in HARMONY.items():
        assert PARSERS["gpt_oss"].split(text)[:2] == expected, text
        for cut in range(len(text) + 1):
            assert _streamed("gpt_oss", [text[:cut], text[cut:]]) == expected, (text, cut)
        for size in (1, 2, 3):
            pieces = [text[i:i + size] for i in range(0, len(text), size)]
            assert _streamed("gpt_oss", pieces) == expected, (text, size)


def test_harmony_holds_back_only_what_may_be_a_marker():
    stream = ReasoningStream(PARSERS["gpt_oss"])
    assert stream.feed("<|channel|>analysis<|mess") == ("", "")
    assert stream.feed("age|>think <|") == ("think ", "")
    assert stream.feed("end|><|start|>assistant<|channel|>final<|message|>ok") == ("", "ok")
    assert stream.finish() == ("", "")


@pytest.mark.parametrize("name,which", [("deepseek_r1", 0), ("qwen3", 1)])
def test_streamed_pieces_add_up_to_the_whole_split(name, which):
    for text, expected in OUTPUTS.items():
        for cut in range(len(text) + 1):  # two pieces, cut at every position
            assert _streamed(name, [text[:cut], text[cut:]]) == expected[which], (text, cut)
        for size in (1, 2, 3):  # a few characters at a time
            pieces = [text[i:i + size] for i in range(0, len(text), size)]
            assert _streamed(name, pieces) == expected[which], (text, size)


def test_no_marker_text_is_held_back_longer_than_it_may_be_one():
    stream = ReasoningStream(PARSERS["deepseek_r1"])
    assert stream.feed("<think>step one") == ("step one", "")
    assert stream.feed(" </thi") == (" ", "")  # "</thi" may be the end marker
    assert stream.feed("nk>ans") == ("", "ans")
    assert stream.feed("wer") == ("", "wer")  # decided: straight through
    assert stream.finish() == ("", "")
    qwen = ReasoningStream(PARSERS["qwen3"])
    assert qwen.feed("Hello") == ("", "Hello")  # no thinking block: an answer at once


def _items(pieces: list[str], calls: bool) -> tuple[list[dict], list[dict]]:
    out = OutputStream(PARSERS["deepseek_r1"], TOOL_PARSERS["hermes"] if calls else None)
    events = [e for piece in pieces for e in out.feed(piece)] + out.finish()
    for item in out.items:  # ids are made per response
        item.pop("id")
        item.pop("call_id", None)
    return out.items, events


SCRIPTED = ('<think>look it up</think>Checking.<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Oslo"}}\n</tool_call>')


@pytest.mark.parametrize("size", [1, 3, 7, len(SCRIPTED)])
def test_a_response_output_streams_to_the_same_items(size):
    whole, _ = _items([SCRIPTED], calls=True)
    assert [i["type"] for i in whole] == ["reasoning", "message", "function_call"]
    assert whole[0]["content"][0]["text"] == "look it up"
    assert whole[1]["content"][0]["text"] == "Checking."
    assert whole[2]["arguments"] == '{"city": "Oslo"}' and whole[2]["name"] == "get_weather"
    items, events = _items([SCRIPTED[i:i + size] for i in range(0, len(SCRIPTED), size)],
                           calls=True)
    assert items == whole
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [d["status"] for d in done] == ["completed"] * 3
    assert "".join(e["delta"] for e in events
                   if e["type"] == "response.reasoning_text.delta") == "look it up"
    assert "".join(e["delta"] for e in events
                   if e["type"] == "response.function_call_arguments.delta") == \
        '{"city": "Oslo"}'
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [0, 1, 2]


def test_a_tool_call_written_while_reasoning_is_not_read():
    text = ('<think>maybe <tool_call>\n{"name": "no", "arguments": {}}\n</tool_call></think>'
            'Sure.')
    items, _ = _items([text], calls=True)
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[1]["content"][0]["text"] == "Sure."


def test_a_grammar_read_with_a_reasoning_parser_starts_after_the_reasoning():
    json_only = SamplingParams(structured=StructuredOutput("json_object"))
    r1 = answer_params(PARSERS["deepseek_r1"], json_only).structured
    assert (r1.reasoning_start, r1.reasoning_end) == ("", "</think>")
    qwen = answer_params(PARSERS["qwen3"], json_only).structured
    assert (qwen.reasoning_start, qwen.reasoning_end) == ("<think>", "</think>")
    harmony = answer_params(PARSERS["gpt_oss"], json_only)  # markers a grammar cannot write
    assert harmony.structured == json_only.structured and not harmony.skip_special_tokens
    assert answer_params(None, json_only) is json_only


def test_a_harmony_reply_detokenized_as_the_engine_does_splits_by_channel(tmp_path):
    """gpt-oss's made checkpoint (Harmony template and special tokens): a scripted reply's
    tokens, detokenized one at a time as the engine does with the parser's params (special
    tokens kept), stream into the reasoning and the answer; skipping them would lose both."""
    from workers.models.make_model import make_model
    from workers.tokenizer import Tokenizer
    from workers.tokenizer.detokenizer import SampleText

    tokenizer = Tokenizer.from_pretrained(str(make_model(tmp_path, arch="gpt_oss")))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}],
                                           add_generation_prompt=True, tokenize=True)
    reply = tokenizer.encode("<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant"
                             "<|channel|>final<|message|>4.<|return|>", add_special_tokens=False)
    params = answer_params(PARSERS["gpt_oss"], SamplingParams())
    text, stream = SampleText(tokenizer, prompt, params), ReasoningStream(PARSERS["gpt_oss"])
    reasoning = answer = ""
    for k, token_id in enumerate(reply):
        text.add_token(token_id)
        r, a = stream.feed(text.take(finished=k == len(reply) - 1))
        reasoning, answer = reasoning + r, answer + a
    r, a = stream.finish()
    assert (reasoning + r, answer + a) == ("Add them.", "4.")
    skipped = tokenizer.decode(reply, skip_special_tokens=True)
    assert PARSERS["gpt_oss"].split(skipped)[:2] == ("", skipped)  # channels lost
