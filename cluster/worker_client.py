"""The router's channel to an engine actor over Ray (`router.channel.WorkerChannel`).

The router calls the engine actor directly (no Serve hop): one Ray call asks the actor where it
serves its worker (`EngineActor.channel_address`), and from then on every call record and the
output channel's long poll go on that socket (`cluster.socket_calls`), one framed pickle each on
a long-lived connection, not a Ray call (whose submission and reply cost the router and the
actor each more than the message itself on a small model). Errors come back as the router
expects them: the worker's own exceptions (`InvalidRequestError`, `ValueError`, ...) are
re-raised as they were raised on the worker; a dead or unreachable actor, a lost connection or
an engine going away become `WorkerUnavailableError`, which makes the router retry, fall back or
migrate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from cluster.socket_calls import SocketCalls, SocketChannel
from router.channel import ChannelClient
from router.config import DEFAULT_DEADLINES, Deadlines
from router.errors import WorkerUnavailableError
from workers.contract.protocol import EngineShutDown

CALL_TIMEOUT_S = 10.0  # for the Ray call asking the address, and for connecting there
T = TypeVar("T")


class RayChannel(SocketChannel):
    """The channel to one `cluster.engine_actor.EngineActor` handle."""

    def __init__(self, worker_id: str, actor: Any) -> None:
        self.worker_id = worker_id
        self.actor = actor
        self._calls: SocketCalls | None = None  # the data channel, once connected
        self._connecting: asyncio.Lock | None = None

    async def _connection(self) -> SocketCalls:
        """The connection to the actor's socket; a new one when there is none or it was lost
        (the actor restarted, or its process went away: then the Ray call asking for the
        address fails, as any call to a dead actor)."""
        calls = self._calls
        if calls is not None and calls.lost is None:
            return calls
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._calls is None or self._calls.lost is not None:
                host, port, token = await self._wait(self.actor.channel_address.remote(),
                                                     "channel_address")
                self._calls = await SocketCalls.connect(self.worker_id, host, port, token,
                                                        CALL_TIMEOUT_S)
            return self._calls

    async def _wait(self, ref: Awaitable[T], what: str) -> T:
        try:
            return await asyncio.wait_for(ref, CALL_TIMEOUT_S)
        except RayTaskError as exc:
            raise _cause(exc, self.worker_id) from None
        except RayActorError as exc:
            raise WorkerUnavailableError(self.worker_id, f"the actor died: {exc}") from None
        except (TimeoutError, GetTimeoutError):
            raise WorkerUnavailableError(self.worker_id,
                                         f"{what} gave no answer in {CALL_TIMEOUT_S}s") from None

    async def close(self) -> None:
        """Only the connection: the actor belongs to its pool replica, not to this channel."""
        if self._calls is not None:
            self._calls.close()


def ray_worker_client(worker_id: str, actor: Any, subscriber: str,
                      deadlines: Deadlines = DEFAULT_DEADLINES) -> ChannelClient:
    """One router replica's client of one engine actor; `subscriber` names the router."""
    return ChannelClient(RayChannel(worker_id, actor), subscriber, deadlines)


def _cause(exc: RayTaskError, worker_id: str) -> BaseException:
    """The exception the actor raised, as it raised it; an engine stopping under the call
    (the worker is going away) as the worker being unavailable."""
    cause = exc.cause
    if isinstance(cause, EngineShutDown):
        return WorkerUnavailableError(worker_id, str(cause))
    return cause if isinstance(cause, BaseException) else exc
