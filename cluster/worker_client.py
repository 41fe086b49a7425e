"""The router's channel to an engine actor over Ray (`router.channel.WorkerChannel`).

The router calls the engine actor directly (no Serve hop), through the actor's named methods:
`submit` (batched commands), `next_outputs` (the long-poll that returns one message per engine
step) and `prefill` on the socket the actor serves for them (`EngineActor.channel_address`,
`cluster.socket_calls`), the rest (`stats`, `kv_snapshot`, `health`, `ready`, ...) as Ray calls.
Errors come back as the router expects them: the worker's own exceptions (`InvalidRequestError`,
`ValueError`, ...) are re-raised as they were raised on the worker; a dead or unreachable actor
becomes `WorkerUnavailableError`, which makes the router retry, fall back or migrate.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable, TypeVar

from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from cluster.socket_calls import SocketCalls
from router.channel import ChannelClient
from router.config import Deadlines
from router.errors import WorkerUnavailableError
from router.worker_client import WorkerChannel
from workers.contract.messages import Command, Paused, PrefillResult, PrefixFetch, WorkerOutputs
from workers.contract.protocol import (
    EngineShutDown,
    EngineStats,
    WorkerInfo,
    WorkerRequest,
)
from workers.contract.prefix_cache import HotPrefix, KVSnapshot

if TYPE_CHECKING:
    from kvtransfer.handoff import KVHandoff

CALL_TIMEOUT_S = 10.0  # for the short calls (stats, snapshot, health, submit)
T = TypeVar("T")


class RayChannel(WorkerChannel):
    """Calls on one `cluster.engine_actor.EngineActor` handle."""

    def __init__(self, worker_id: str, actor: Any) -> None:
        self.worker_id = worker_id
        self.actor = actor
        self._calls: SocketCalls | None = None  # the data channel, once connected
        self._connecting: asyncio.Lock | None = None

    async def _data_channel(self) -> SocketCalls:
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

    async def _over_socket(self, method: str, timeout_s: float | None, *args: object) -> Any:
        calls = await self._data_channel()
        try:
            async with asyncio.timeout(timeout_s):  # a deadline, not a task per call (wait_for)
                return await calls.call(method, *args)
        except TimeoutError:
            raise WorkerUnavailableError(self.worker_id,
                                         f"{method} gave no answer in {timeout_s}s") from None
        except EngineShutDown as exc:  # the worker is going away
            raise WorkerUnavailableError(self.worker_id, str(exc)) from None

    async def _wait(self, ref: Awaitable[T], what: str,
                    timeout_s: float | None = CALL_TIMEOUT_S) -> T:
        try:
            return await asyncio.wait_for(ref, timeout_s)
        except RayTaskError as exc:
            raise _cause(exc, self.worker_id) from None
        except RayActorError as exc:
            raise WorkerUnavailableError(self.worker_id, f"the actor died: {exc}") from None
        except (asyncio.TimeoutError, GetTimeoutError):
            raise WorkerUnavailableError(self.worker_id,
                                         f"{what} gave no answer in {timeout_s}s") from None

    async def info(self) -> WorkerInfo:
        return (await self._wait(self.actor.ready.remote(), "ready")).worker

    async def submit(self, subscriber: str, commands: list[Command]) -> None:
        await self._over_socket("submit", CALL_TIMEOUT_S, subscriber, commands)

    async def next_outputs(self, subscriber: str, timeout_s: float,
                           min_interval_s: float = 0.0) -> WorkerOutputs:
        return await self._over_socket("next_outputs", timeout_s + CALL_TIMEOUT_S, subscriber,
                                       timeout_s, min_interval_s)

    async def prefill(self, req: WorkerRequest, decode_tp_size: int,
                      prefix: PrefixFetch | None = None) -> PrefillResult:
        return await self._over_socket("prefill", None, req, decode_tp_size, prefix)

    async def export_prefix(self, request_id: str, block_hashes: tuple[int, ...],
                            reader_tp_size: int) -> KVHandoff | None:
        return await self._wait(self.actor.export_prefix.remote(request_id, block_hashes,
                                                                reader_tp_size),
                                "export_prefix", None)

    async def hot_prefixes(self, max_blocks: int) -> tuple[HotPrefix, ...]:
        return await self._wait(self.actor.hot_prefixes.remote(max_blocks), "hot_prefixes")

    async def land_prefix(self, request_id: str, fetch: PrefixFetch,
                          token_ids: tuple[int, ...]) -> int:
        return await self._wait(self.actor.land_prefix.remote(request_id, fetch, token_ids),
                                "land_prefix", None)

    async def export_running(self, request_id: str,
                             reader_tp_size: int) -> dict[int, KVHandoff]:
        return await self._wait(self.actor.export_running.remote(request_id, reader_tp_size),
                                "export_running", None)

    async def prepare_migration(self, request_id: str,
                                exported: dict[int, KVHandoff]) -> dict[int, int]:
        return await self._wait(self.actor.prepare_migration.remote(request_id, exported),
                                "prepare_migration", None)

    async def pause(self, request_id: str, reader_tp_size: int) -> Paused:
        return await self._wait(self.actor.pause.remote(request_id, reader_tp_size), "pause",
                                None)

    async def cancel_migration(self, request_id: str) -> None:
        await self._wait(self.actor.cancel_migration.remote(request_id), "cancel_migration",
                         None)

    async def stats(self) -> EngineStats:
        return await self._wait(self.actor.stats.remote(), "stats")

    async def kv_snapshot(self) -> KVSnapshot:
        return await self._wait(self.actor.kv_snapshot.remote(), "kv_snapshot")

    async def health(self) -> bool:
        return bool(await self._wait(self.actor.health.remote(), "health"))

    async def close(self) -> None:
        """Only the connection: the actor belongs to its pool replica, not to this channel."""
        if self._calls is not None:
            self._calls.close()


def ray_worker_client(worker_id: str, actor: Any, subscriber: str,
                      deadlines: Deadlines = Deadlines()) -> ChannelClient:
    """One router replica's client of one engine actor; `subscriber` names the router."""
    return ChannelClient(RayChannel(worker_id, actor), subscriber, deadlines)


def _cause(exc: RayTaskError, worker_id: str) -> BaseException:
    """The exception the worker raised, as it raised it; an engine stopping under the request
    (the worker is going away) as the worker being unavailable."""
    cause = exc.cause
    if isinstance(cause, EngineShutDown):
        return WorkerUnavailableError(worker_id, str(cause))
    return cause if isinstance(cause, BaseException) else exc
