"""What the completions and chat endpoints share: body parsing, the response a handler's
generator makes (`respond`), starting and merging generations, usage, and watching for a
client that went away (the events they stream: `router.openai.sse`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar, cast

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from router.app import Router
from router.errors import BadRequestError
from router.streams import Generation
from workers.contract.protocol import SamplingParams, TokenEvent

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

DISCONNECT_POLL_S = 0.25


async def parse_body(request: Request, model: type[M]) -> M:
    """The body as `model`; malformed JSON, bad UTF-8 or a bad field raise `BadRequestError`."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"the request body is not valid UTF-8: {exc}") from None
    except json.JSONDecodeError as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequestError(f"the request body must be a JSON object, got "
                              f"{type(data).__name__}")
    for key, value in data.items():
        if _has_lone_surrogate(value) or _has_lone_surrogate(key):
            raise BadRequestError(f"{key}: contains a lone UTF-16 surrogate (an unpaired "
                                  f"\\ud800-\\udfff escape), which is not text", param=key)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _has_lone_surrogate(value: object) -> bool:
    """True when a JSON value holds a string with an unpaired surrogate (JSON's "\\ud800"
    escapes decode to one; it is no text and cannot be tokenized)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    return False


def validation_error(exc: ValidationError) -> BadRequestError:
    first = exc.errors()[0]
    loc = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        return BadRequestError(f"{loc}: unknown field; see the OpenAI API reference for the "
                               f"fields this endpoint takes",
                               param=str(first["loc"][0]))
    return BadRequestError(f"{loc or 'body'}: {first['msg']} (got "
                           f"{_short(first.get('input'))}); {exc.error_count()} error(s) in all",
                           param=str(first["loc"][0]) if first["loc"] else None)


def _short(value: object) -> str:
    text = json.dumps(value, default=str) if value is not None else "null"
    return text if len(text) <= 80 else text[:77] + "..."


def default_max_tokens(router: Router, requested: int | None, prompt_len: int) -> int:
    """What the client asked for, or (as vLLM does) all the context the prompt leaves."""
    return requested if requested is not None else router.max_model_len - prompt_len


async def start_all(router: Router, prompts: Sequence[list[int]],
                    params: Sequence[SamplingParams],
                    cache_salt: str | None, ttft_deadline_s: float | None = None,
                    lora_name: str | None = None) -> list[Generation]:
    """Submit every prompt (each with the request's TTFT target, `router.deadline`, and its
    LoRA adapter, None: the base model); if any is refused, abort the others and raise its
    error."""
    results = await asyncio.gather(
        *(router.generate(ids, p, cache_salt, frontend="http", ttft_deadline_s=ttft_deadline_s,
                          lora_name=lora_name) for ids, p in zip(prompts, params)),
        return_exceptions=True)
    gens = [r for r in results if isinstance(r, Generation)]
    errors = [r for r in results if not isinstance(r, Generation)]
    if errors:
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
        raise errors[0]
    return gens


async def merge(gens: Sequence[Generation]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """(generation index, event) from all generations as events arrive; closing the iterator
    aborts every generation that has not finished."""
    if len(gens) == 1:  # the common case, without tasks
        async for event in gens[0].events():
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, TokenEvent] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for event in gen.events():
                queue.put_nowait((i, event))
            queue.put_nowait(None)
        except Exception as exc:  # noqa: BLE001 -- handed to the consumer, which re-raises it
            queue.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)


def usage(gens: Sequence[Generation], num_completion_tokens: int) -> dict[str, Any]:
    prompt = sum(len(g.prompt_token_ids) for g in gens)
    drafted = sum(g.speculated[0] for g in gens)
    accepted = sum(g.speculated[1] for g in gens)
    # Cleave's extension, with speculative decoding: drafted tokens verified, and accepted
    spec = ({"speculative_tokens": {"drafted": drafted, "accepted": accepted}}
            if drafted else {})
    return {
        **spec,
        "prompt_tokens": prompt,
        "completion_tokens": num_completion_tokens,
        "total_tokens": prompt + num_completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": sum(g.num_cached_tokens for g in gens),
            # Cleave's extension: what the router's prefix index predicted when routing
            "predicted_cached_tokens": sum(g.predicted_cached_tokens for g in gens),
        },
    }


class Streaming:
    """What a handler's response generator yields first when it streams (`respond`)."""


STREAMING = Streaming()


async def respond(parts: AsyncGenerator[Response | Streaming | str, None]) -> Response:
    """The response a handler's generator makes. The generator holds the request's
    admission for its whole life; its first item is the whole `Response` (the generator is
    then closed), or `STREAMING`, after which its items are the events of a text/event-stream
    response (closed when that ends). An error before its first item is raised here, as an
    HTTP error; it must not yield one after it began streaming (errors then go in the
    stream)."""
    first = await parts.__anext__()
    if isinstance(first, Response):
        await parts.aclose()
        return first
    if first is not STREAMING:
        await parts.aclose()
        raise TypeError(f"a response generator began with {first!r}, not a Response or "
                        f"STREAMING")
    return StreamingResponse(cast(AsyncIterator[str], parts), media_type="text/event-stream")


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its generations) if the client leaves."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise asyncio.CancelledError("the client disconnected")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


class TokenStrings:
    """The text of single tokens, as logprobs show them (vLLM: `decode([id])`), memoised."""

    def __init__(self, router: Router) -> None:
        self._tokenizer = router.tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode(
                [token_id], skip_special_tokens=False)
        return text
