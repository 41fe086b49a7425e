"""Reasoning parsers on scripted model outputs: the split of a whole output, and the same output
streamed in pieces cut at every position (the pieces add up to the whole split)."""

from __future__ import annotations

import pytest

from router.config import REASONING_PARSERS
from router.openai.reasoning import PARSERS, ReasoningStream, answer_params
from router.openai.response_events import OutputStream
from router.openai.tool_parsers import PARSERS as TOOL_PARSERS
from tests.router.test_tool_parsers import calls_of
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


CALL_F = "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>"
HARMONY = {
    # gpt-oss's output after the template's "<|start|>assistant": (reasoning, answer)
    "<|channel|>analysis<|message|>User asks: 2+2. Easy.<|end|><|start|>assistant"
    "<|channel|>final<|message|>4.<|return|>": ("User asks: 2+2. Easy.", "4."),
    "<|channel|>final<|message|>Just <|the> answer.": ("", "Just <|the> answer."),
    "<|channel|>analysis<|message|>cut short <|en": ("cut short <|en", ""),
    # a function call stays in the answer as Harmony markup, for the gpt_oss tool-call parser
    "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary "
    "to=functions.f <|constrain|>json<|message|>{}<|call|>": ("a", CALL_F + "{}<|call|>"),
    "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\":": (
        "", CALL_F + '{"a":'),
    # ... only off the analysis channel; the recipient may be in the role
    "<|channel|>analysis to=functions.f<|message|>{}<|end|><|start|>assistant to=functions.f"
    "<|channel|>commentary json<|message|>{}<|call|>": ("{}", CALL_F + "{}<|call|>"),
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


GPT_OSS_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
    "commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo <|x"}<|call|>')
GPT_OSS_MESSAGE = ("Need the weather.", "Checking.", [("get_weather", '{"city": "Oslo <|x"}')])


def _chat_stream(pieces: list[str]) -> tuple[str, str, list[tuple[str, str]], bool]:
    """What a streamed chat choice read with gpt_oss's parsers sends, as chat.py composes them
    (the reasoning split first, its answer pieces into the tool-call stream): reasoning,
    content, calls (name and arguments from their deltas), whether the choice made calls."""
    from router.openai.tool_calls import ToolCallStream

    thoughts, calls = ReasoningStream(PARSERS["gpt_oss"]), ToolCallStream(TOOL_PARSERS["gpt_oss"])
    reasoning, deltas = "", []
    for piece in pieces:
        r, a = thoughts.feed(piece)
        reasoning += r
        deltas += calls.feed(a)
    r, a = thoughts.finish()
    deltas += calls.feed(a) + calls.finish()
    return (reasoning + r, "".join(d.get("content", "") for d in deltas), calls_of(deltas),
            calls.made_calls)


@pytest.mark.parametrize("size", [1, 2, 3, 5, len(GPT_OSS_CALL)])
def test_a_harmony_tool_call_is_a_tool_call_streamed_or_whole(size):
    from router.openai.tool_calls import message_with_calls

    reasoning, answer, _ = PARSERS["gpt_oss"].split(GPT_OSS_CALL)  # as _collect reads it
    message, finish = message_with_calls(TOOL_PARSERS["gpt_oss"], answer, "stop")
    assert finish == "tool_calls" and reasoning == GPT_OSS_MESSAGE[0]
    assert message["content"] == GPT_OSS_MESSAGE[1]
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in message["tool_calls"]] == GPT_OSS_MESSAGE[2]
    pieces = [GPT_OSS_CALL[i:i + size] for i in range(0, len(GPT_OSS_CALL), size)]
    reasoning, content, calls, made = _chat_stream(pieces)
    assert (reasoning, content.strip(), calls) == GPT_OSS_MESSAGE and made


@pytest.mark.parametrize("size", [1, 4, len(GPT_OSS_CALL)])
def test_a_harmony_tool_call_is_a_responses_function_call_item(size):
    out = OutputStream(PARSERS["gpt_oss"], TOOL_PARSERS["gpt_oss"])
    pieces = [GPT_OSS_CALL[i:i + size] for i in range(0, len(GPT_OSS_CALL), size)]
    events = [e for piece in pieces for e in out.feed(piece)] + out.finish()
    assert [i["type"] for i in out.items] == ["reasoning", "message", "function_call"]
    assert out.items[0]["content"][0]["text"] == "Need the weather."
    assert out.items[1]["content"][0]["text"].strip() == "Checking."
    assert (out.items[2]["name"], out.items[2]["arguments"]) == GPT_OSS_MESSAGE[2][0]
    assert "".join(e["delta"] for e in events
                   if e["type"] == "response.function_call_arguments.delta") == \
        GPT_OSS_MESSAGE[2][0][1]


def test_a_harmony_call_on_the_analysis_channel_is_reasoning_not_a_call():
    text = ("<|channel|>analysis to=functions.f <|constrain|>json<|message|>{}<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Done.<|return|>")
    assert _chat_stream([text]) == ("{}", "Done.", [], False)


@pytest.fixture(scope="module")
def gpt_oss_tokenizer(tmp_path_factory):
    """gpt-oss's made checkpoint's tokenizer: Harmony template and special tokens."""
    from workers.models.make_model import make_model
    from workers.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(str(make_model(tmp_path_factory.mktemp("gpt-oss"),
                                                    arch="gpt_oss")))


def _detokenized(tokenizer, prompt: list[int], reply: str) -> list[str]:
    """`reply`'s tokens detokenized one at a time as the engine does with the gpt_oss
    parser's params (special tokens kept): the pieces a stream gets."""
    from workers.tokenizer.detokenizer import SampleText

    ids = tokenizer.encode(reply, add_special_tokens=False)
    text = SampleText(tokenizer, prompt, answer_params(PARSERS["gpt_oss"], SamplingParams()))
    pieces = []
    for k, token_id in enumerate(ids):
        text.add_token(token_id)
        pieces.append(text.take(finished=k == len(ids) - 1))
    return pieces


def test_a_harmony_reply_detokenized_as_the_engine_does_splits_by_channel(gpt_oss_tokenizer):
    """gpt-oss's made checkpoint: a scripted reply's tokens stream into the reasoning and the
    answer; skipping special tokens would lose both."""
    tokenizer = gpt_oss_tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}],
                                           add_generation_prompt=True, tokenize=True)
    reply = ("<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>final"
             "<|message|>4.<|return|>")
    assert _streamed("gpt_oss", _detokenized(tokenizer, prompt, reply)) == ("Add them.", "4.")
    skipped = tokenizer.decode(tokenizer.encode(reply, add_special_tokens=False),
                               skip_special_tokens=True)
    assert PARSERS["gpt_oss"].split(skipped)[:2] == ("", skipped)  # channels lost


def test_a_harmony_tool_call_detokenized_as_the_engine_does_is_a_call(gpt_oss_tokenizer):
    """The template renders the tools (so its wording names the gpt_oss format); a scripted
    call's tokens, detokenized as the engine does, stream to the same call as the whole."""
    from router.openai.tool_calls import tool_call_format

    tokenizer = gpt_oss_tokenizer
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Oslo?"}],
                                           tools=tools, add_generation_prompt=True,
                                           tokenize=True)
    assert "type get_weather = (_: {\ncity: string,\n}) => any;" in tokenizer.decode(prompt)
    assert tool_call_format(None, tokenizer) is TOOL_PARSERS["gpt_oss"]
    assert _chat_stream(_detokenized(tokenizer, prompt, GPT_OSS_CALL))[1:] == (
        *GPT_OSS_MESSAGE[1:], True)


class _Scripted:
    """A generation that writes `text` a few characters per event (what `Router.generate`
    returns, as far as the front ends read it)."""

    def __init__(self, prompt: list[int], text: str, size: int = 3) -> None:
        self.prompt_token_ids, self.text, self.size = prompt, text, size
        self.speculated, self.num_cached_tokens, self.predicted_cached_tokens = (0, 0), 0, 0

    async def events(self):
        from workers.contract.protocol import FinishReason, TokenEvent

        pieces = [self.text[i:i + self.size] for i in range(0, len(self.text), self.size)]
        for k, piece in enumerate(pieces):
            yield TokenEvent("r", 0, [k], piece, finish_reason=(
                FinishReason.STOP if k == len(pieces) - 1 else None))

    async def aclose(self) -> None:
        pass


def test_a_harmony_tool_call_through_the_server(tmp_path):
    """A gpt-oss checkpoint served with the gpt_oss reasoning parser, its output scripted: the
    `openai` client gets the call as chat `tool_calls` (whole, and from streamed deltas) and
    as a Responses `function_call` item, the reasoning apart, the preamble as content."""
    import openai

    from cluster.local_server import LocalServeConfig, LocalServer
    from tests.router.conftest import API_KEY
    from workers.models.make_model import make_model

    srv = LocalServer(LocalServeConfig(
        str(make_model(tmp_path, arch="gpt_oss")), num_workers=1, http_port=0, grpc_port=0,
        router={"api_keys": (API_KEY,), "reasoning_parser": "gpt_oss"},
        engine={"num_blocks": 32})).start()
    try:
        asked = []

        async def scripted(ids, params, *args, **kwargs):
            asked.append(params)
            return _Scripted(ids, GPT_OSS_CALL)

        srv.router.generate = scripted
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1",
                               api_key=API_KEY, max_retries=0, timeout=60)
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]
        ask = dict(model=srv.router.model_name, tools=tools, max_tokens=32,
                   messages=[{"role": "user", "content": "Weather in Oslo?"}])
        choice = client.chat.completions.create(**ask).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert (choice.message.reasoning_content, choice.message.content) == \
            GPT_OSS_MESSAGE[:2]
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
            GPT_OSS_MESSAGE[2]
        reasoning = content = arguments = ""
        finish = None
        for chunk in client.chat.completions.create(stream=True, **ask):
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            arguments += "".join(c.function.arguments or "" for c in delta.tool_calls or ())
            finish = chunk.choices[0].finish_reason or finish
        assert (reasoning, content, arguments, finish) == (
            *GPT_OSS_MESSAGE[:2], GPT_OSS_MESSAGE[2][0][1], "tool_calls")
        resp = client.responses.create(model=srv.router.model_name, input="Weather in Oslo?",
                                       tools=[{"type": "function", **tools[0]["function"]}])
        assert [item.type for item in resp.output] == ["reasoning", "message", "function_call"]
        assert (resp.output[2].name, resp.output[2].arguments) == GPT_OSS_MESSAGE[2][0]
        assert not any(p.skip_special_tokens for p in asked)  # the markers stay in the text
    finally:
        srv.stop()
