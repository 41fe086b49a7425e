"""`POST /v1/chat/completions`: messages through the model's chat template, then the same
generation path as completions, answered in the chat format (or as chat.completion.chunk
events)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from router.app import TOKENIZE_INLINE_CHARS, Router
from router.deadline import ttft_deadline_s
from router.errors import BadRequestError
from router.openai.common import (
    STREAMING,
    Streaming,
    TokenStrings,
    default_max_tokens,
    parse_body,
    respond,
    until_disconnected,
    usage,
)
from router.openai.protocol import ChatCompletionRequest, ChatMessage
from router.openai.reasoning import ReasoningFormat, ReasoningStream, answer_params, \
    reasoning_format
from router.openai.sse import SSE_DONE, TextChunks, sse, sse_error
from router.openai.tool_calls import ToolCallStream, message_with_calls, tool_call_format
from router.openai.tool_parsers import ToolCallFormat
from router.streams import Generation
from workers.contract.protocol import InvalidRequestError, SamplingParams, TokenEvent, TokenLogprob

logger = logging.getLogger(__name__)


@dataclass
class _Choice:
    content: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


def long_chat(body: ChatCompletionRequest) -> bool:
    """Whether the messages are long enough to template and tokenize off the event loop."""
    return sum(len(m.content) if isinstance(m.content, str) else 64 * len(m.content or ())
               for m in body.messages) >= TOKENIZE_INLINE_CHARS


class ChatBody(Protocol):
    """What `chat_prompt` reads of a request: a chat completion's, or a tokenize request's."""

    @property
    def messages(self) -> list[ChatMessage]: ...
    @property
    def add_generation_prompt(self) -> bool: ...


def chat_prompt(router: Router, body: ChatBody) -> list[int]:
    messages = [m.as_template_input() for m in body.messages]
    tools = body.template_tools() if isinstance(body, ChatCompletionRequest) else None
    try:
        ids = router.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, tokenize=True,
            tools=tools)
    except ValueError as exc:  # no template, or the template raised on these messages
        raise BadRequestError(f"the chat template could not format the messages: {exc}",
                              param="messages") from None
    return list(ids)


async def create_chat_completion(router: Router, tokens: TokenStrings,
                                 request: Request) -> Response:
    """Validate the body, then answer it (`_answer`), JSON or streamed."""
    body = await parse_body(request, ChatCompletionRequest)
    body.check()
    await router.adapters.resolve(body.model)
    router.check_n(body.n)
    return await respond(_answer(router, tokens, request, body))


async def _answer(router: Router, tokens: TokenStrings, request: Request,
                  body: ChatCompletionRequest) -> AsyncGenerator[Response | Streaming | str, None]:
    """A valid body's response: admitted, built, collected or streamed (holds its slot)."""
    deadline = ttft_deadline_s(request.headers)
    with router.admit():  # before the template and the tokenizer run
        ids = await asyncio.to_thread(chat_prompt, router, body) if long_chat(body) else \
            chat_prompt(router, body)
        router.check_prompt(ids, param="messages")
        params, tool_format = chat_sampling(router, body, len(ids))
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": body.model or router.model_name}
        fmt = _Logprobs(tokens, body.logprobs)
        if not body.stream:
            yield await until_disconnected(request, _collect(router, body, ids, params, fmt,
                                                             meta, tool_format, deadline))
            return
        gen = await router.generate(ids, params, body.cache_salt, frontend="http",
                                    ttft_deadline_s=deadline,
                                    lora_name=router.adapters.lora_of(body.model))
        yield STREAMING
        chunks = _Chunks(gen, body, fmt, meta, tool_format,
                         reasoning_format(router.config.reasoning_parser))
        try:
            yield chunks.opening()
            async for event in gen.events():
                yield chunks.of(event)
            if body.include_usage:
                yield chunks.usage()
        except Exception as exc:  # reported to the client in the stream
            logger.exception("a streamed request failed")
            yield sse_error(exc)
        finally:
            await gen.aclose()
        yield SSE_DONE


def chat_sampling(router: Router, body: ChatCompletionRequest,
              prompt_len: int) -> tuple[SamplingParams, ToolCallFormat | None]:
    """The request's sampling parameters, and the format its tool calls are read in."""
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = body.sampling_params(
        default_max_tokens(router, body.requested_max_tokens, prompt_len), logprobs, None)
    tool_format = _tool_format(router, body)
    if tool_format is not None:
        params = _force_call(body, tool_format, params)
    return answer_params(reasoning_format(router.config.reasoning_parser), params), tool_format


def _tool_format(router: Router, body: ChatCompletionRequest) -> ToolCallFormat | None:
    """The format this request's tool calls are read in (None: it reads none)."""
    if not body.reads_tool_calls:
        return None
    found = tool_call_format(router.config.tool_call_parser, router.tokenizer)
    if found is None:
        raise BadRequestError("this model's chat template renders no tools; serve it with a "
                              "tool_call_parser (router.tool_call_parser)", param="tools")
    return found


def _force_call(body: ChatCompletionRequest, tool_format: ToolCallFormat,
                params: SamplingParams) -> SamplingParams:
    """`params` with the grammar of the call `tool_choice` forces, if it forces one."""
    try:
        forced = body.forced(tool_format)
    except InvalidRequestError as exc:  # a function's parameters the grammar cannot enforce
        raise BadRequestError(exc.message, param="tools") from None
    if forced is None:
        return params
    if params.structured is not None:
        raise BadRequestError(f"tool_choice forces a call; {params.structured.param} cannot "
                              "constrain the same output", param="tool_choice")
    return dataclasses.replace(params, structured=forced)


async def _collect(router: Router, body: ChatCompletionRequest, ids: list[int],
                   params: SamplingParams, fmt: _Logprobs, meta: dict[str, Any],
                   tool_format: ToolCallFormat | None,
                   deadline: float | None = None) -> JSONResponse:
    gen = await router.generate(ids, params, body.cache_salt, frontend="http",
                                ttft_deadline_s=deadline,
                                lora_name=router.adapters.lora_of(body.model))
    choices = [_Choice() for _ in range(body.n)]
    try:
        async for event in gen.events():
            choice = choices[event.index]
            choice.content += event.text
            choice.num_tokens += len(event.token_ids)
            choice.logprobs.extend(event.logprobs or ())
            if event.finish_reason is not None:
                choice.finish_reason = event.finish_reason.value
                choice.stop_reason = event.stop_reason
    finally:
        await gen.aclose()
    out, thinking = [], reasoning_format(router.config.reasoning_parser)
    for k, c in enumerate(choices):
        reasoning, answer = ("", c.content) if thinking is None else \
            thinking.split(c.content)[:2]
        message: dict[str, Any] = {"role": "assistant", "content": answer}
        finish = c.finish_reason
        if tool_format is not None:  # calls are read from the answer only
            message, finish = message_with_calls(tool_format, answer, finish)
        if thinking is not None:
            message["reasoning_content"] = reasoning or None
        out.append({"index": k, "message": message, "logprobs": fmt(c.logprobs),
                    "finish_reason": finish, "stop_reason": c.stop_reason})
    return JSONResponse({**meta, "object": "chat.completion", "choices": out,
                         "usage": usage([gen], sum(c.num_tokens for c in choices))})


class _Chunks:
    """The chat.completion.chunk events of one streamed generation, event by event."""

    def __init__(self, gen: Generation, body: ChatCompletionRequest, fmt: _Logprobs,
                 meta: dict[str, Any], tool_format: ToolCallFormat | None,
                 thinking: ReasoningFormat | None = None) -> None:
        self.gen, self.body, self.fmt = gen, body, fmt
        self.head = head = {**meta, "object": "chat.completion.chunk"}
        self.num_tokens = 0
        self.calls = [ToolCallStream(tool_format) for _ in range(body.n)] if tool_format \
            else None
        self.thoughts = [ReasoningStream(thinking) for _ in range(body.n)] if thinking \
            else None
        # a chunk of new content only (most of them) from a template
        self.plain = self.calls is None and self.thoughts is None and not (
            fmt.wanted or body.continuous_usage)
        self.text_chunk = TextChunks(lambda k, text: {**head, "choices": [{
            "index": k, "delta": {"content": text}, "logprobs": None, "finish_reason": None,
            "stop_reason": None}]})

    def _chunk(self, choices: list[dict[str, Any]]) -> str:
        payload = {**self.head, "choices": choices}
        if self.body.continuous_usage:
            payload["usage"] = usage([self.gen], self.num_tokens)
        return sse(payload)

    def opening(self) -> str:
        """The first chunk: each choice's assistant role."""
        return self._chunk([{"index": k, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}
                            for k in range(self.body.n)])

    def of(self, event: TokenEvent) -> str:
        """The event's chunks (several when it ends tool calls), as one string."""
        self.num_tokens += len(event.token_ids)
        finish = None if event.finish_reason is None else event.finish_reason.value
        if self.plain and finish is None:
            return self.text_chunk(event.index, event.text)
        if self.thoughts is None:
            return self._answer(event, finish)
        thoughts = self.thoughts[event.index]
        reasoning, answer = thoughts.feed(event.text)
        if finish is not None:
            more = thoughts.finish()
            reasoning, answer = reasoning + more[0], answer + more[1]
        head = self._chunk([{"index": event.index, "delta": {"reasoning_content": reasoning},
                             "logprobs": None, "finish_reason": None}]) if reasoning else ""
        if not answer and finish is None and not self.fmt.wanted:
            return head
        return head + self._answer(event.replaced(text=answer), finish)

    def _answer(self, event: TokenEvent, finish: str | None) -> str:
        """The chunks of an event's answer text (the reasoning taken out)."""
        if self.calls is None:
            delta = {"content": event.text} if event.text or finish is None else {}
            return self._chunk([{"index": event.index, "delta": delta,
                                 "logprobs": self.fmt(event.logprobs or []),
                                 "finish_reason": finish, "stop_reason": event.stop_reason}])
        return "".join(self._chunk([frame]) for frame in
                       _tool_frames(self.calls[event.index], event, finish, self.fmt))

    def usage(self) -> str:
        return sse({**self.head, "choices": [], "usage": usage([self.gen], self.num_tokens)})


def _tool_frames(calls: ToolCallStream, event: TokenEvent, finish: str | None,
                 fmt: _Logprobs) -> list[dict[str, Any]]:
    """One event's frames of a choice whose tool calls are read: content or call deltas (the
    event's logprobs ride on the first), the finish reason on the last."""
    deltas = calls.feed(event.text)
    if finish is not None:
        deltas += calls.finish()
        if calls.made_calls and finish == "stop":
            finish = "tool_calls"
    frames: list[dict[str, Any]] = [
        {"index": event.index, "delta": d, "logprobs": None, "finish_reason": None}
        for d in deltas] or [{"index": event.index, "delta": {}, "logprobs": None,
                              "finish_reason": None}]
    frames[0]["logprobs"] = fmt(event.logprobs or [])
    frames[-1].update(finish_reason=finish, stop_reason=event.stop_reason)
    return frames


class _Logprobs:
    """The chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""

    def __init__(self, tokens: TokenStrings, wanted: bool) -> None:
        self.tokens = tokens
        self.wanted = wanted

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.tokens(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def __call__(self, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.wanted:
            return None
        return {"content": [
            {**self._entry(lp.token_id, lp.logprob),
             "top_logprobs": [self._entry(t, v) for t, v in lp.top.items()]}
            for lp in logprobs]}
