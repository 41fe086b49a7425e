"""`/v1/responses` with the `openai` client against a real server whose prompts are prefilled
on a prefill worker and decoded on a decode worker (the tiny model, greedy): a response says
what the same chat completion says, streams as the typed events the client parses, calls a
forced function, follows a JSON schema, continues a stored conversation, shows reasoning as its
own item, and refuses what a text model cannot do with a 400 naming the field."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import httpx
import jsonschema
import openai
import pytest

from cluster.local_server import LocalServeConfig, LocalServer
from router.errors import WorkerUnavailableError
from tests.router.conftest import API_KEY, NUM_BLOCKS

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 12},
    "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather now",
        "parameters": WEATHER}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
M = "tiny"


@pytest.fixture(scope="module")
def srv(tiny_model):
    server = LocalServer(LocalServeConfig(
        tiny_model, http_port=0, grpc_port=0, num_prefill_workers=1, num_decode_workers=1,
        router={"api_keys": (API_KEY,), "disagg_threshold_tokens": 8, "served_model_name": M,
                "response_store_size": 4},
        engine={"num_blocks": NUM_BLOCKS, "max_num_batched_tokens": 512})).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.http_port}/v1", api_key=API_KEY,
                         timeout=60, max_retries=0)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int = 8) -> str:
    out = client.chat.completions.create(model=M, messages=messages, max_tokens=max_tokens,
                                         temperature=0)
    return out.choices[0].message.content


def test_a_response_says_what_the_chat_completion_says_handed_off(srv, client):
    handed_off = srv.router.counters.num_disaggregated
    resp = client.responses.create(model=M, input="the weather in Oslo today",
                                   max_output_tokens=8, temperature=0)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == chat_text(client, [{"role": "user",
                                                   "content": "the weather in Oslo today"}])
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 8 and resp.usage.input_tokens > 8
    assert [item.type for item in resp.output] == ["message"]
    assert srv.router.counters.num_disaggregated == handed_off + 2
    with_instructions = client.responses.create(
        model=M, input=[{"role": "user",
                         "content": [{"type": "input_text", "text": "hello there"}]}],
        instructions="Answer in French.", max_output_tokens=6, temperature=0)
    assert with_instructions.output_text == chat_text(client, [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "hello there"}], 6)


def test_a_stream_is_the_typed_events_of_the_same_response(client):
    args = dict(model=M, input="a short story about a fox", max_output_tokens=10,
                temperature=0)
    whole = client.responses.create(**args)
    events = list(client.responses.create(stream=True, **args))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_a_forced_function_call_streams_to_the_same_call(client):
    args = dict(model=M, input="weather in Oslo?", tools=[TOOL], temperature=0,
                max_output_tokens=200,
                tool_choice={"type": "function", "name": "get_weather"})
    resp = client.responses.create(**args)
    assert resp.status == "completed"
    (call,) = [item for item in resp.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with client.responses.stream(**args) as stream:
        deltas = "".join(e.delta for e in stream
                         if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert deltas == streamed.arguments == call.arguments


def test_a_stream_that_fails_midway_ends_with_response_failed(srv, client, monkeypatch):
    """A generation lost after its first events: the stream says `response.failed`, with an
    error object and the output so far, instead of ending silently; the client parses it."""
    generate = srv.router.generate

    async def failing(*args, **kwargs):
        gen = await generate(*args, **kwargs)
        events = gen.events

        async def broken():
            num_events = 0
            async for event in events():
                yield event
                num_events += 1
                if num_events == 2:
                    raise WorkerUnavailableError("decode-0", "it was lost")
        gen.events = broken
        return gen

    monkeypatch.setattr(srv.router, "generate", failing)
    with client.responses.stream(model=M, input="a long story", max_output_tokens=30,
                                 temperature=0) as stream:
        events = list(stream)
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert failed.response.error.code == "server_error"
    assert "it was lost" not in failed.response.error.message  # the log has it
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert said and failed.response.output[0].content[0].text == said


def test_a_json_schema_format_gives_text_that_validates(client):
    resp = client.responses.create(
        model=M, input="is the sky blue?", temperature=0, max_output_tokens=50,
        text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER,
                         "strict": True}})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), ANSWER)


def test_previous_response_id_continues_the_stored_conversation(srv, client):
    first = client.responses.create(model=M, input="name a city", max_output_tokens=5,
                                    temperature=0)
    second = client.responses.create(model=M, input="and another one", max_output_tokens=5,
                                     previous_response_id=first.id, temperature=0)
    assert second.output_text == chat_text(client, [
        {"role": "user", "content": "name a city"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and another one"}], 5)
    assert second.usage.input_tokens > first.usage.total_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    unstored = client.responses.create(model=M, input="hi", max_output_tokens=2, store=False)
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.NotFoundError, match="not in this router replica's store"):
            client.responses.retrieve(missing)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=M, input="hi", previous_response_id="resp_nope")
    assert caught.value.body["param"] == "previous_response_id"
    for _ in range(4):  # the store keeps its 4 newest
        client.responses.create(model=M, input="hi", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


@contextlib.contextmanager
def reading(srv, parser: str):
    """The server's router reading reasoning with `parser` meanwhile (its setting is read per
    request)."""
    before = srv.router.config
    srv.router.config = dataclasses.replace(before, reasoning_parser=parser)
    try:
        yield
    finally:
        srv.router.config = before


def test_reasoning_comes_apart_from_the_answer(srv, client):
    """deepseek_r1 reads an output as starting inside the thinking block: the random model
    never closes it, so all it writes is reasoning, in chat, its stream and a response."""
    ask = dict(model=M, messages=[{"role": "user", "content": "think first"}], temperature=0,
               max_tokens=12)
    plain = client.chat.completions.create(**ask).choices[0].message.content
    assert plain and "</think>" not in plain
    with reading(srv, "deepseek_r1"):
        message = client.chat.completions.create(**ask).choices[0].message
        parts = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(stream=True, **ask):
            for key in parts:
                parts[key] += getattr(chunk.choices[0].delta, key, None) or "" \
                    if chunk.choices else ""
        resp = client.responses.create(model=M, input="think first", max_output_tokens=12,
                                       temperature=0)
    assert (message.reasoning_content, message.content) == (plain, "")
    assert parts == {"reasoning_content": plain, "content": ""}
    assert resp.output[0].type == "reasoning" and resp.output[0].content[0].text == plain
    assert resp.usage.output_tokens_details.reasoning_tokens == 12


@pytest.mark.parametrize("body,param,words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "input_image"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
    ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, "tools",
     "web_search_preview"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format", "xml"),
    ({"input": "hi", "temperature": 3}, "temperature", "temperature"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "no tools"),
    ({"input": "hi", "background": True}, "background", "unknown field"),
])
def test_bad_requests_are_400s_naming_the_field(srv, body, param, words):
    resp = httpx.post(f"http://127.0.0.1:{srv.http_port}/v1/responses",
                      json={"model": M, **body},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"
