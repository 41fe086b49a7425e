"""Tool calling with the `openai` client, for each tool-call format on a random-weight model of
its family (llama: llama3_json, qwen2: hermes, mistral: mistral): forced calls are valid calls
whose arguments validate, streamed deltas add up to exactly the non-streamed call, and a
conversation goes on after a tool's answer."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from cluster.local_server import LocalServeConfig, LocalServer
from router.config import TOOL_CALL_PARSERS
from router.openai.tool_parsers import PARSERS
from tests.router.conftest import API_KEY

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 12},
    "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {
    "zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"],
    "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
FAMILIES = {"llama": "llama3_json", "qwen2": "hermes", "mistral": "mistral"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def srv(request, tmp_path_factory):
    from workers.models.make_model import make_model

    model = make_model(tmp_path_factory.mktemp(f"tools-{request.param}"), arch=request.param,
                       preset="tiny")
    server = LocalServer(LocalServeConfig(
        str(model), num_workers=1, http_port=0, grpc_port=0,
        router={"api_keys": (API_KEY,)}, engine={"num_blocks": 96})).start()
    server.family = request.param
    yield server
    server.stop()


def client_of(srv: LocalServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key=API_KEY,
                         timeout=60, max_retries=0)


def ask(srv: LocalServer, tool_choice, stream: bool = False, prompt: str = "weather in Oslo?",
        max_tokens: int = 200):
    return client_of(srv).chat.completions.create(
        model=srv.router.model_name, messages=[{"role": "user", "content": prompt}],
        tools=TOOLS, tool_choice=tool_choice, max_tokens=max_tokens, temperature=0,
        stream=stream)


def streamed_calls(stream) -> tuple[list[dict], str | None]:
    """The calls a stream's deltas add up to (id, name, arguments), and its finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                if d.id:
                    assert call["id"] is None and not call["arguments"]  # id and name first
                    call["id"] = d.id
                    call["name"] = d.function.name
                call["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def test_the_template_names_its_format(srv):
    from router.openai.tool_calls import tool_call_format

    assert tool_call_format(None, srv.router.tokenizer).name == FAMILIES[srv.family]
    assert set(PARSERS) == set(TOOL_CALL_PARSERS)


@pytest.mark.parametrize("choice", ["required", "get_weather", "get_time"])
def test_a_forced_call_is_valid_and_streams_to_the_same_call(srv, choice):
    tool_choice = choice if choice == "required" else {"type": "function",
                                                       "function": {"name": choice}}
    for prompt in ("weather in Oslo?", "what time is it", "x"):
        out = ask(srv, tool_choice, prompt=prompt)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == choice if choice != "required" else \
            call.function.name in SCHEMAS
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        calls, finish = streamed_calls(ask(srv, tool_choice, stream=True, prompt=prompt))
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (call.function.name, call.function.arguments)]


def test_a_conversation_goes_on_after_a_tool_answer(srv):
    call = ask(srv, "required").choices[0].message.tool_calls[0]
    messages = [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
    ]
    out = client_of(srv).chat.completions.create(
        model=srv.router.model_name, messages=messages, tools=TOOLS, max_tokens=8,
        temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.usage.prompt_tokens > 0
    rendered = srv.router.tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m.get("content") or ""} | (
            {"tool_calls": [{"function": {"name": call.function.name,
                                          "arguments": json.loads(call.function.arguments)}}]}
            if m["role"] == "assistant" else {}) for m in messages],
        tools=[t for t in TOOLS])
    assert "sunny, 21 degrees" in rendered and call.function.name in rendered


def test_auto_reads_calls_only_when_the_model_writes_one(srv):
    out = ask(srv, "auto", max_tokens=12)
    message = out.choices[0].message
    if message.tool_calls:  # a random model may open a call; then it is read as one
        assert out.choices[0].finish_reason in ("tool_calls", "length")
    else:
        assert isinstance(message.content, str)


@pytest.mark.parametrize("kw,param,words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among the tools"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"not": {}}}}}}]},
     "tools", "'not'"),
    ({"tool_choice": "required", "tools": None}, "tool_choice", "no tools are given"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot constrain"),
])
def test_bad_tool_requests_are_400s_naming_the_field(srv, kw, param, words):
    args = dict(model=srv.router.model_name, messages=[{"role": "user", "content": "hi"}],
                tools=TOOLS, max_tokens=4)
    args.update({k: v for k, v in kw.items() if v is not None})
    if kw.get("tools", 1) is None:
        del args["tools"]
    with pytest.raises(openai.BadRequestError) as err:
        client_of(srv).chat.completions.create(**args)
    assert err.value.body["param"] == param and words in err.value.body["message"]
