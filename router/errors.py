"""Errors the front ends answer with, in OpenAI's shape and with their HTTP and gRPC codes.

Every failure a client can cause or see is one `APIError`; the HTTP layer renders it as
`{"error": {"message", "type", "param", "code"}}` with `status`, the gRPC layer aborts the call
with `grpc_code` (a `grpc.StatusCode` name, so this module stays free of grpc).
"""

from __future__ import annotations

from typing import Any

# what a client is told of an unexpected error (the details go to the server log only)
INTERNAL_ERROR = "internal error; the server log has the details"


class APIError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None
    grpc_code: str = "INTERNAL"

    def __init__(self, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class BadRequestError(APIError):
    status, type, code, grpc_code = 400, "invalid_request_error", None, "INVALID_ARGUMENT"


class AuthenticationError(APIError):
    status, type, code, grpc_code = 401, "invalid_request_error", "invalid_api_key", \
        "UNAUTHENTICATED"


class NotFoundError(APIError):
    status, type, code, grpc_code = 404, "invalid_request_error", "model_not_found", "NOT_FOUND"


def refused(message: str, param: str | None) -> APIError:
    """A worker's refusal of a request (`InvalidRequestError`): 404 when it does not serve the
    model the request names (a LoRA adapter unloaded there), else 400."""
    return (NotFoundError if param == "model" else BadRequestError)(message, param=param)


class ResponseNotFoundError(NotFoundError):
    code = "response_not_found"


class RequestTooLargeError(APIError):
    status, type, code, grpc_code = 413, "invalid_request_error", "request_too_large", \
        "RESOURCE_EXHAUSTED"


class OverloadedError(APIError):
    status, type, code, grpc_code = 429, "rate_limit_error", "rate_limit_exceeded", \
        "RESOURCE_EXHAUSTED"


class NoHealthyWorkerError(APIError):
    status, type, code, grpc_code = 503, "service_unavailable_error", "no_healthy_worker", \
        "UNAVAILABLE"


class WorkerUnavailableError(RuntimeError):
    """A worker did not answer (dead, stopped, unreachable); the router marks it unhealthy."""

    def __init__(self, worker_id: str, reason: str) -> None:
        super().__init__(f"worker {worker_id!r} is unavailable: {reason}")
        self.worker_id = worker_id
        self.reason = reason

    def __reduce__(self) -> tuple:  # pickled across processes with its own arguments
        return type(self), (self.worker_id, self.reason)
