"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them: a prompt (or chat messages
through the model's template) to token ids, and token ids back to text. Both run on the
router's tokenizer and touch no worker."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, RootModel, StrictInt
from starlette.requests import Request
from starlette.responses import JSONResponse

from router.app import TOKENIZE_INLINE_CHARS, Router
from router.errors import BadRequestError
from router.openai.chat import chat_prompt
from router.openai.common import parse_body
from router.openai.protocol import ChatMessage


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes them
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[StrictInt]


class TokenizeRequest(RootModel[TokenizeCompletionRequest | TokenizeChatRequest]):
    """vLLM's two shapes: a prompt, or chat messages."""


async def tokenize(router: Router, request: Request) -> JSONResponse:
    body = (await parse_body(request, TokenizeRequest)).root
    await router.adapters.resolve(body.model)  # an adapter tokenizes as its base
    if isinstance(body, TokenizeChatRequest):
        ids = await asyncio.to_thread(chat_prompt, router, body)
    elif len(body.prompt) >= TOKENIZE_INLINE_CHARS:
        ids = await asyncio.to_thread(router.tokenizer.encode, body.prompt,
                                      body.add_special_tokens)
    else:
        ids = router.tokenizer.encode(body.prompt, body.add_special_tokens)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": router.max_model_len,
                           "tokens": ids, "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = router.tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(out)


async def detokenize(router: Router, request: Request) -> JSONResponse:
    body = await parse_body(request, DetokenizeRequest)
    await router.adapters.resolve(body.model)  # an adapter tokenizes as its base
    vocab = router.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise BadRequestError(f"tokens outside [0, {vocab}): {bad[:5]}", param="tokens")
    return JSONResponse({"prompt": router.tokenizer.decode(body.tokens)})
