"""The error every layer raises for a request it refuses; torch-free, imported by the records
(`workers.contract.protocol`, which re-exports it) and by the structured-output constraints."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class KVCacheFull(RuntimeError):
    """No free KV blocks now for KV arriving from another worker (nothing was allocated)."""


# Errors a request can end with on a worker (the channel's messages: `workers.contract.messages`).


class EngineShutDown(RuntimeError):
    """Raised into the requests in flight when their engine stops (the worker is going away:
    the router treats it as the worker failing)."""


class EngineOverloaded(RuntimeError):
    """A worker refused a request because its waiting queue is full (before its first event;
    nothing of it is held). The router tries another worker, or answers 429."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} refused: {reason}")
        self.request_id = request_id
        self.reason = reason

    def __reduce__(self) -> tuple:  # pickled across processes with its own arguments
        return type(self), (self.request_id, self.reason)


class KVPullFailed(RuntimeError):
    """A decode worker could not land a handoff's KV. Raised before the request's first event;
    the request left nothing behind. `kind` names the cause for metrics and fallbacks (a
    `kvtransfer` error class name such as "LeaseExpired", "KVCacheFull", or "BadHandoff")."""

    def __init__(self, request_id: str, kind: str, reason: str) -> None:
        super().__init__(f"KV pull for request {request_id!r} failed ({kind}): {reason}")
        self.request_id = request_id
        self.kind = kind
        self.reason = reason

    def __reduce__(self) -> tuple:  # pickled across processes with its own arguments
        return type(self), (self.request_id, self.kind, self.reason)
