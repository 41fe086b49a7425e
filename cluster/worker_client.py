"""`WorkerClient` over a Ray actor handle to a worker's `cluster.engine_actor.EngineActor`.

The router calls the engine actor directly (no Serve hop). Errors come back as the router
expects them: the worker's own exceptions (`InvalidRequestError`, `KVPullFailed`, ...) are
re-raised as they were raised on the worker; a dead or unreachable actor becomes
`WorkerUnavailableError`, which makes the router retry, fall back or migrate.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from router.errors import WorkerUnavailableError
from router.worker_client import (
    HandoffWorkerClient,
    WorkerInfo,
    WorkerRequest,
    WorkerRole,
    EngineStats,
)
from workers.protocol import EngineShutDown, KVEvent, KVSnapshot, PrefillResult, TokenEvent

CALL_TIMEOUT_S = 10.0  # for the short calls (stats, events, health); streams are unbounded


class RayWorkerClient(HandoffWorkerClient):
    """One router replica's client of one engine actor. `subscriber` names this router to
    the actor's KV-event log, so every router replica reads every event once."""

    def __init__(self, worker_id: str, actor: Any, subscriber: str) -> None:
        self._worker_id = worker_id
        self.actor = actor
        self.subscriber = subscriber
        self._closed = False

    @property
    def worker_id(self) -> str:
        return self._worker_id

    async def _call(self, method: str, *args: Any, timeout_s: float | None = CALL_TIMEOUT_S
                    ) -> Any:
        if self._closed:
            raise WorkerUnavailableError(self._worker_id, "the client is closed")
        ref = getattr(self.actor, method).remote(*args)
        try:
            return await asyncio.wait_for(ref, timeout_s)
        except RayTaskError as exc:
            raise _cause(exc, self._worker_id) from None
        except RayActorError as exc:
            raise WorkerUnavailableError(self._worker_id, f"the actor died: {exc}") from None
        except (asyncio.TimeoutError, GetTimeoutError):
            raise WorkerUnavailableError(self._worker_id,
                                         f"{method} gave no answer in {timeout_s}s") from None

    async def _stream(self, method: str, request_id: str, *args: Any
                      ) -> AsyncIterator[TokenEvent]:
        """The events of a streaming actor method; leaving early cancels it and aborts the
        request on the worker."""
        if self._closed:
            raise WorkerUnavailableError(self._worker_id, "the client is closed")
        refs = getattr(self.actor, method).remote(request_id, *args)
        finished = False
        try:
            async for ref in refs:
                try:
                    event = await ref
                except RayTaskError as exc:
                    raise _cause(exc, self._worker_id) from None
                yield event
            finished = True
        except RayActorError as exc:
            raise WorkerUnavailableError(self._worker_id, f"the actor died: {exc}") from None
        finally:
            if not finished:
                ray.cancel(refs)
                try:
                    self.actor.abort.remote(request_id)
                except RayActorError:
                    pass

    async def info(self) -> WorkerInfo:
        d = await self._call("ready")
        return WorkerInfo(d["worker_id"], WorkerRole(d["role"]), d["block_size"],
                          d["max_model_len"], d["vocab_size"], d["num_blocks"], d["tp_size"])

    def generate(self, req: WorkerRequest) -> AsyncIterator[TokenEvent]:
        return self._stream("generate", req.request_id, list(req.prompt_token_ids), req.params,
                            req.cache_salt)

    async def prefill(self, req: WorkerRequest, kv_readers: int = 1) -> PrefillResult:
        try:
            return await self._call("prefill", req.request_id, list(req.prompt_token_ids),
                                    req.params, req.cache_salt, kv_readers, timeout_s=None)
        except asyncio.CancelledError:
            self.actor.abort.remote(req.request_id)
            raise

    def decode(self, req: WorkerRequest, first_token_id: int,
               handoff_json: str | None) -> AsyncIterator[TokenEvent]:
        return self._stream("decode", req.request_id, list(req.prompt_token_ids),
                            first_token_id, req.params, handoff_json)

    def resume(self, req: WorkerRequest,
               sent_token_ids: Sequence[int]) -> AsyncIterator[TokenEvent]:
        return self._stream("resume", req.request_id, list(req.prompt_token_ids),
                            list(sent_token_ids), req.params)

    async def abort(self, request_id: str) -> None:
        try:
            await self._call("abort", request_id)
        except WorkerUnavailableError:
            pass  # gone: nothing is held there any more

    async def stats(self) -> EngineStats:
        return await self._call("stats")

    async def kv_events(self) -> list[KVEvent]:
        return await self._call("kv_events", self.subscriber)

    async def kv_snapshot(self) -> KVSnapshot:
        return await self._call("kv_snapshot")

    async def health(self) -> bool:
        return bool(await self._call("health"))

    async def close(self) -> None:
        self._closed = True  # the actor belongs to its pool replica, not to this client


def _cause(exc: RayTaskError, worker_id: str) -> BaseException:
    """The exception the worker raised, as it raised it; an engine stopping under the request
    (the worker is going away) as the worker being unavailable."""
    cause = exc.cause
    if isinstance(cause, EngineShutDown):
        return WorkerUnavailableError(worker_id, str(cause))
    return cause if isinstance(cause, BaseException) else exc
