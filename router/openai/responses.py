"""`/v1/responses`: OpenAI's Responses API over the chat completion path. `POST` creates a
response (JSON, or the typed server-sent events `response.created` ... `response.completed`),
`GET /v1/responses/{id}` and `DELETE` read this replica's store. The body becomes a chat body
(`response_items`), is templated and generated as a chat completion is, and its text becomes
output items (`response_events.OutputStream`): reasoning, the message, function calls."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from router.app import Router
from router.errors import INTERNAL_ERROR, APIError, BadRequestError
from router.openai.chat import chat_prompt, chat_sampling, long_chat
from router.openai.reasoning import reasoning_format
from router.openai.common import STREAMING, Streaming, parse_body, respond, until_disconnected
from router.openai.protocol import ChatCompletionRequest
from router.openai.response_events import OutputStream, new_id
from router.openai.response_items import (
    ResponseRequest,
    ResponseStore,
    StoredResponse,
    renamed,
)
from router.openai.sse import sse
from router.streams import Generation

logger = logging.getLogger(__name__)


async def create_response(router: Router, store: ResponseStore, request: Request) -> Response:
    """Validate the body, then answer it, JSON or streamed; a 400 names the body's field."""
    body = await parse_body(request, ResponseRequest)
    await router.adapters.resolve(body.model)
    earlier = [] if body.previous_response_id is None else \
        store.get(body.previous_response_id, "previous_response_id").messages
    chat = body.as_chat(earlier)
    made = _Made(router, store, body, earlier)
    try:
        return await respond(_answer(router, request, chat, made))
    except BadRequestError as exc:
        raise renamed(exc) from None


async def get_response(store: ResponseStore, response_id: str) -> Response:
    return JSONResponse(store.get(response_id).body)


async def delete_response(store: ResponseStore, response_id: str) -> Response:
    store.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


class _Made:
    """The response object of one request, in each state it is shown in, and its storing."""

    def __init__(self, router: Router, store: ResponseStore, body: ResponseRequest,
                 earlier: list[dict[str, Any]]) -> None:
        self.store, self.body, self.earlier = store, body, earlier
        self.id = new_id("resp")
        fmt = body.text.format if body.text is not None and body.text.format else \
            {"type": "text"}
        self.head = {
            "id": self.id, "object": "response", "created_at": int(time.time()),
            "model": body.model or router.model_name, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "temperature": body.temperature,
            "top_p": body.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": fmt}, "previous_response_id": body.previous_response_id,
            "store": body.store, "metadata": body.metadata or {}, "error": None,
            "incomplete_details": None, "reasoning": None, "truncation": "disabled",
            "user": body.user}

    def in_progress(self) -> dict[str, Any]:
        return {**self.head, "status": "in_progress", "output": [], "usage": None}

    def failed(self, exc: Exception, out: OutputStream) -> dict[str, Any]:
        """The response a stream ends with when its generation failed: `failed`, with the
        output so far and OpenAI's error object (`server_error` but for a refused request)."""
        if not isinstance(exc, APIError):
            exc = APIError(INTERNAL_ERROR)
        code = "invalid_prompt" if exc.status == 400 else \
            "rate_limit_exceeded" if exc.status == 429 else "server_error"
        return {**self.head, "status": "failed", "output": out.items, "usage": None,
                "error": {"code": code, "message": exc.message}}

    def final(self, out: OutputStream, gen: Generation, num_tokens: int,
              finish: str | None) -> dict[str, Any]:
        """The finished response (stored when the body asks): `incomplete` when it ran out of
        `max_output_tokens` (or of context)."""
        prompt = len(gen.prompt_token_ids)
        response = {**self.head, "status": "incomplete" if finish == "length" else "completed",
                    "output": out.items, "usage": {
                        "input_tokens": prompt,
                        "input_tokens_details": {"cached_tokens": gen.num_cached_tokens},
                        "output_tokens": num_tokens,
                        "output_tokens_details": {"reasoning_tokens":
                                                  out.num_reasoning_tokens},
                        "total_tokens": prompt + num_tokens}}
        if finish == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.body.store:
            conversation = [*self.earlier, *self.body.input_messages(), *_as_messages(out.items)]
            self.store.put(self.id, StoredResponse(json.loads(json.dumps(response)),
                                                   conversation))
        return response


def _as_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages that continue its conversation."""
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


async def _answer(router: Router, request: Request, chat: ChatCompletionRequest,
                  made: _Made) -> AsyncGenerator[Response | Streaming | str, None]:
    """The response, as `respond` reads it; holds the request's slot until its last event."""
    with router.admit():
        ids = await asyncio.to_thread(chat_prompt, router, chat) if long_chat(chat) else \
            chat_prompt(router, chat)
        router.check_prompt(ids, param="messages")
        params, tool_format = chat_sampling(router, chat, len(ids))
        out = OutputStream(reasoning_format(router.config.reasoning_parser), tool_format)
        lora = router.adapters.lora_of(made.body.model)
        if not chat.stream:
            gen = await router.generate(ids, params, None, frontend="http", lora_name=lora)
            yield await until_disconnected(request, _collect(gen, out, made))
            return
        gen = await router.generate(ids, params, None, frontend="http", lora_name=lora)
        yield STREAMING
        numbered = itertools.count()

        def sse_of(event: dict[str, Any]) -> str:
            return f"event: {event['type']}\n" + sse({**event, "sequence_number": next(numbered)})

        try:
            yield sse_of({"type": "response.created", "response": made.in_progress()})
            yield sse_of({"type": "response.in_progress", "response": made.in_progress()})
            num_tokens, finish = 0, None
            async for event in gen.events():
                num_tokens += len(event.token_ids)
                finish = event.finish_reason.value if event.finish_reason else finish
                events = out.feed(event.text, len(event.token_ids))
                if event.finish_reason is not None:
                    events += out.finish()
                if events:
                    yield "".join(sse_of(e) for e in events)
            response = made.final(out, gen, num_tokens, finish)
            yield sse_of({"type": f"response.{response['status']}", "response": response})
        except Exception as exc:  # reported to the client in the stream
            logger.exception("a streamed response failed")
            yield sse_of({"type": "response.failed", "response": made.failed(exc, out)})
        finally:
            await gen.aclose()


async def _collect(gen: Generation, out: OutputStream, made: _Made) -> JSONResponse:
    num_tokens, finish = 0, None
    try:
        async for event in gen.events():
            num_tokens += len(event.token_ids)
            out.feed(event.text, len(event.token_ids))
            if event.finish_reason is not None:
                finish = event.finish_reason.value
        out.finish()
    finally:
        await gen.aclose()
    return JSONResponse(made.final(out, gen, num_tokens, finish))
