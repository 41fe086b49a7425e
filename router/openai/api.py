"""The FastAPI app: OpenAI's routes over a `Router`, every error in OpenAI's shape.

Authentication and the body-size limit are checked in an ASGI middleware, before any handler
reads or parses the body. Handlers parse bodies themselves (`parse_body`), so FastAPI's default
`{"detail": ...}` errors never reach a client.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.app import Router
from router.errors import (
    INTERNAL_ERROR,
    APIError,
    BadRequestError,
    NoHealthyWorkerError,
    RequestTooLargeError,
)
from router.openai.chat import create_chat_completion
from router.openai.common import TokenStrings
from router.openai.completions import create_completion
from router.openai.embeddings import create_embeddings
from router.openai.lora import load_lora_adapter, model_list, unload_lora_adapter
from router.openai.response_items import ResponseStore
from router.openai.responses import create_response, delete_response, get_response
from router.openai.tokenize import detokenize, tokenize
from workers.contract.tracing import tracing

logger = logging.getLogger(__name__)

# requests counted in `cleave_requests_total` (the metrics of `router.metrics`)
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


# the one route open without a key: a bare liveness probe (it reads no worker)
OPEN_PATHS = frozenset({"/health"})


class GuardMiddleware:
    """API keys on every route but `OPEN_PATHS` (whatever prefix the app is mounted under:
    the path is taken after it), and the body-size limit (by Content-Length, and by counting
    the bytes of bodies sent without it), ahead of routing and parsing."""

    def __init__(self, app: ASGIApp, router: Router) -> None:
        self.app = app
        self.router = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.router.config.max_body_bytes
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
            if path not in OPEN_PATHS:
                self.router.authenticate(_bearer(headers.get("authorization")))
            length = headers.get("content-length", "")
            if length.isdigit() and int(length) > limit:
                raise RequestTooLargeError(_too_large(limit, int(length)))
        except APIError as exc:
            _count_error(self.router, scope["path"], exc)
            await error_response(exc)(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise RequestTooLargeError(_too_large(limit, received))
            return message

        with tracing().span(f"{scope['method']} {path}", headers.get("traceparent"),
                            {"http.route": path}):
            await self.app(scope, counting_receive, send)


def _bearer(value: str | None) -> str | None:
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _too_large(limit: int, size: int) -> str:
    return f"the request body has more than {limit} bytes (at least {size}); send less"


# NOTE: the endpoints find the router on `request.app.state`, not in a closure: FastAPI caches
# endpoint functions globally, and a closure would keep the router (and in-process engines)
# alive after the app is gone.


def _router(request: Request) -> Router:
    return request.app.state.router


def _count_error(router: Router, path: str, exc: APIError) -> None:
    """Count a generation request refused before it streamed (after that, its record counts)."""
    if path in GENERATION_PATHS:
        router.metrics.count_error("http", exc)


async def _on_api_error(request: Request, exc: APIError) -> Response:
    _count_error(_router(request), request.url.path, exc)
    return error_response(exc)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> Response:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = ".".join(str(p) for p in first["loc"])
    return error_response(BadRequestError(f"{loc}: {first['msg']}"))


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
    err = APIError(f"{request.method} {request.url.path}: {exc.detail}")
    err.status, err.type = exc.status_code, "invalid_request_error"
    return error_response(err)


async def _on_crash(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error serving %s", request.url.path)
    return error_response(APIError(INTERNAL_ERROR))


E = TypeVar("E", bound=Exception)


def _handle(app: FastAPI, kind: type[E],
            handler: Callable[[Request, E], Awaitable[Response]]) -> None:
    """Register `handler` for the errors of class `kind`, checking that it takes that class.
    Starlette's annotations want a handler of any Exception, though it passes only `kind`."""
    app.add_exception_handler(kind, handler)  # type: ignore[arg-type]  # it gets only `kind`


async def health(request: Request) -> Response:
    """Liveness, open without a key: the workers healthy as last reported (their heartbeats),
    asking none of them (a probe per second must not become a call per worker)."""
    healthy = _router(request).healthy_workers()
    if not healthy:
        return error_response(NoHealthyWorkerError("no healthy worker"))
    return JSONResponse({"status": "ok", "healthy_workers": healthy})


async def metrics(request: Request) -> Response:
    """Prometheus' text format; worker load as the workers last pushed it."""
    router = _router(request)
    return Response(router.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def version() -> dict[str, str]:
    return {"version": _version()}


async def models(request: Request) -> dict[str, Any]:
    return model_list(_router(request))


async def load_adapter(request: Request) -> Any:
    return await load_lora_adapter(_router(request), request)


async def unload_adapter(request: Request) -> Any:
    return await unload_lora_adapter(_router(request), request)


async def completions(request: Request) -> Any:
    return await create_completion(_router(request), request.app.state.tokens, request)


async def chat_completions(request: Request) -> Any:
    return await create_chat_completion(_router(request), request.app.state.tokens, request)


async def embeddings(request: Request) -> Any:
    return await create_embeddings(_router(request), request)


async def responses(request: Request) -> Any:
    return await create_response(_router(request), request.app.state.responses, request)


async def stored_response(request: Request, response_id: str) -> Any:
    return await get_response(request.app.state.responses, response_id)


async def drop_response(request: Request, response_id: str) -> Any:
    return await delete_response(request.app.state.responses, response_id)


async def tokenize_route(request: Request) -> Any:
    return await tokenize(_router(request), request)


async def detokenize_route(request: Request) -> Any:
    return await detokenize(_router(request), request)


def create_app(router: Router) -> FastAPI:
    """The HTTP app over `router`; the caller runs `router.start()` / `stop()` around it."""
    app = FastAPI(title="Cleave", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.router = router
    app.state.tokens = TokenStrings(router)
    app.state.responses = ResponseStore(router.config.response_store_size)
    _handle(app, APIError, _on_api_error)
    _handle(app, RequestValidationError, _on_validation_error)
    _handle(app, StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_crash)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/version", version, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/load_lora_adapter", load_adapter, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", unload_adapter, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/embeddings", embeddings, methods=["POST"])
    app.add_api_route("/v1/responses", responses, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", stored_response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", drop_response, methods=["DELETE"])
    app.add_api_route("/tokenize", tokenize_route, methods=["POST"])
    app.add_api_route("/detokenize", detokenize_route, methods=["POST"])
    app.add_middleware(GuardMiddleware, router=router)
    return app


def _version() -> str:
    try:
        return metadata.version("cleave")
    except metadata.PackageNotFoundError:
        return "0+unknown"
