"""`POST /v1/completions`: prompts in, choices (or a stream of chunks) out, in OpenAI's legacy
completions format, with prompt echo and per-token logprobs as lm-eval's completions backend
uses them."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from router.app import Router
from router.deadline import ttft_deadline_s
from router.errors import BadRequestError
from router.openai.common import (
    STREAMING,
    Streaming,
    TokenStrings,
    default_max_tokens,
    merge,
    parse_body,
    respond,
    start_all,
    until_disconnected,
    usage,
)
from router.openai.protocol import CompletionRequest
from router.openai.sse import SSE_DONE, TextChunks, sse, sse_error
from router.streams import Generation
from workers.contract.protocol import SamplingParams, TokenEvent, TokenLogprob

logger = logging.getLogger(__name__)


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


async def prompt_token_lists(router: Router, prompt: Any) -> list[list[int]]:
    """The prompt(s) as token id lists, whichever of OpenAI's four shapes it came in (texts
    tokenized off the event loop when long)."""
    if isinstance(prompt, str):
        return [await router.tokenize_async(prompt)]
    if not prompt:
        raise BadRequestError("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], str):
        return [await router.tokenize_async(p) for p in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


async def create_completion(router: Router, tokens: TokenStrings, request: Request) -> Response:
    """Validate the body, then answer it (`_answer`), JSON or streamed."""
    body = await parse_body(request, CompletionRequest)
    body.check()
    await router.adapters.resolve(body.model)
    router.check_n(body.n)
    return await respond(_answer(router, tokens, request, body))


def num_prompts(prompt: Any) -> int:
    """How many prompts a body's `prompt` holds, by its shape alone."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


async def _answer(router: Router, tokens: TokenStrings, request: Request,
                  body: CompletionRequest) -> AsyncGenerator[Response | Streaming | str, None]:
    """A valid body's response, as `respond` reads it: admitted, built, then collected or
    streamed. Holds the request's slots (one per prompt) until its last event."""
    deadline = ttft_deadline_s(request.headers)
    with router.admit(num_prompts(body.prompt)):  # before any work on the prompts
        prompts = await prompt_token_lists(router, body.prompt)
        params = _sampling(router, body, prompts)
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": body.model or router.model_name}
        fmt = _Formatter(tokens, body, _echo_texts(router, body, prompts))
        if not body.stream:
            yield await until_disconnected(
                request, _collect(router, body, prompts, params, fmt, meta, deadline))
            return
        gens = await start_all(router, prompts, params, body.cache_salt, deadline,
                               router.adapters.lora_of(body.model))
        yield STREAMING
        chunks = _Chunks(gens, body, fmt, meta)
        try:
            async for i, event in merge(gens):
                yield chunks.of(i, event)
            if body.include_usage:
                yield chunks.usage()
        except Exception as exc:  # reported to the client in the stream
            logger.exception("a streamed request failed")
            yield sse_error(exc)
        finally:
            await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
        yield SSE_DONE


def _echo_texts(router: Router, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
    """Each prompt's text as an echo shows it (none when the body asks no echo)."""
    if not body.echo:
        return []
    texts = body.prompt if isinstance(body.prompt, list) and body.prompt and \
        isinstance(body.prompt[0], str) else [body.prompt] * len(prompts)
    return [t if isinstance(t, str) else router.tokenizer.decode(ids)
            for t, ids in zip(texts, prompts)]


def _sampling(router: Router, body: CompletionRequest,
              prompts: list[list[int]]) -> list[SamplingParams]:
    """Each prompt's sampling parameters (checking the prompt)."""
    params = []
    for ids in prompts:
        router.check_prompt(ids)
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None \
            else body.prompt_logprobs
        params.append(body.sampling_params(default_max_tokens(router, body.max_tokens, len(ids)),
                                           body.logprobs, prompt_logprobs))
    return params


async def _collect(router: Router, body: CompletionRequest, prompts: list[list[int]],
                   params: list, fmt: _Formatter, meta: dict[str, Any],
                   deadline: float | None = None) -> JSONResponse:
    gens = await start_all(router, prompts, params, body.cache_salt, deadline,
                           router.adapters.lora_of(body.model))
    choices = [_Choice() for _ in range(len(gens) * body.n)]
    prompt_logprobs: list[list[TokenLogprob | None] | None] = [None] * len(gens)
    async for i, event in merge(gens):
        choice = choices[i * body.n + event.index]
        if event.prompt_logprobs is not None:
            prompt_logprobs[i] = event.prompt_logprobs
        choice.text += event.text
        choice.num_tokens += len(event.token_ids)
        choice.token_ids.extend(event.token_ids)
        choice.logprobs.extend(event.logprobs or ())
        if event.finish_reason is not None:
            choice.finish_reason = event.finish_reason.value
            choice.stop_reason = event.stop_reason
    out = []
    for k, choice in enumerate(choices):
        i = k // body.n
        echo = body.echo
        out.append({
            "index": k,
            "text": (fmt.echo_texts[i] if echo else "") + choice.text,
            "logprobs": fmt.logprobs(prompts[i] if echo else [], prompt_logprobs[i],
                                     choice.logprobs),
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        })
        if body.return_token_ids:
            out[-1] |= {"prompt_token_ids": list(prompts[i]), "token_ids": choice.token_ids}
    return JSONResponse({**meta, "object": "text_completion", "choices": out,
                         "usage": usage(gens, sum(c.num_tokens for c in choices))})


class _Chunks:
    """The text_completion chunks of streamed generations, event by event."""

    def __init__(self, gens: list[Generation], body: CompletionRequest, fmt: _Formatter,
                 meta: dict[str, Any]) -> None:
        self.gens, self.body, self.fmt = gens, body, fmt
        self.head = head = {**meta, "object": "text_completion"}
        self.num_tokens = 0
        self.echoed: set[int] = set()
        self.begun: set[int] = set()  # choices that sent a chunk (their prompt ids went with it)
        # a chunk of new text only (most of them) from a template
        self.plain = not (body.echo or fmt.wanted or body.return_token_ids
                          or body.continuous_usage)
        self.text_chunk = TextChunks(lambda k, text: {**head, "choices": [{
            "index": k, "text": text, "logprobs": None, "finish_reason": None,
            "stop_reason": None}]})

    def of(self, i: int, event: TokenEvent) -> str:
        """The chunk of generation `i`'s event."""
        body, gen = self.body, self.gens[i]
        k = i * body.n + event.index
        self.num_tokens += len(event.token_ids)
        if self.plain and event.finish_reason is None:
            return self.text_chunk(k, event.text)
        text, prompt_ids, prompt_lps = event.text, [], None
        if body.echo and k not in self.echoed:
            self.echoed.add(k)
            text = self.fmt.echo_texts[i] + text
            prompt_ids, prompt_lps = list(gen.prompt_token_ids), gen.first.prompt_logprobs
        choice = {
            "index": k, "text": text,
            "logprobs": self.fmt.logprobs(prompt_ids, prompt_lps, event.logprobs or []),
            "finish_reason": None if event.finish_reason is None else event.finish_reason.value,
            "stop_reason": event.stop_reason}
        if body.return_token_ids:
            if k not in self.begun:
                self.begun.add(k)
                choice["prompt_token_ids"] = list(gen.prompt_token_ids)
            choice["token_ids"] = list(event.token_ids)
        chunk: dict[str, Any] = {**self.head, "choices": [choice]}
        if body.continuous_usage:
            chunk["usage"] = usage(self.gens, self.num_tokens)
        return sse(chunk)

    def usage(self) -> str:
        return sse({**self.head, "choices": [], "usage": usage(self.gens, self.num_tokens)})


class _Formatter:
    """OpenAI's legacy logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, tokens: TokenStrings, body: CompletionRequest,
                 echo_texts: list[str]) -> None:
        self.tokens = tokens
        self.wanted = body.logprobs is not None
        self.echo_texts = echo_texts

    def logprobs(self, prompt_ids: list[int], prompt: list[TokenLogprob | None] | None,
                 output: list[TokenLogprob]) -> dict[str, list[Any]] | None:
        """Echoed prompt tokens (the first has no logprob: None) then the output tokens."""
        if not self.wanted:
            return None
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": []}
        prompt = prompt or []
        entries = [(t, prompt[j] if j < len(prompt) else None) for j, t in enumerate(prompt_ids)]
        entries += [(lp.token_id, lp) for lp in output]
        offset = 0
        for token_id, lp in entries:
            token = self.tokens(token_id)
            top = None
            if lp is not None:
                # ids whose text collides (partial UTF-8 decodes to U+FFFD) keep the best
                top = {token: lp.logprob}
                for t, v in lp.top.items():
                    text = self.tokens(t)
                    top[text] = max(v, top.get(text, v))
            out["tokens"].append(token)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(token)
        return out
