"""A transfer agent in the process that holds the cache, driven from another: the rank of a
worker group serves and pulls its own shard (device memory on a GPU), while the worker's driver,
which schedules and leases, holds no cache at all.

    # in the rank process, once its caches exist
    host = AgentHost(caches, tp_rank=1, tp_size=2)
    address = host.start("127.0.0.1")  # reported to the driver
    # in the driver, on its event loop
    agent = await RemoteAgent.connect(address, TransportConfig("tcp"), on_release=free)
    handoff = agent.offer(request_id, block_ids, lease_s=30.0)  # no await: as TransferAgent's
    result = await agent.pull(handoffs, local_block_ids, timeout=10.0)

`RemoteAgent` has `TransferAgent`'s interface (offer, cancel, pull, num_leases, layout, address,
close). An offer returns at once: the driver mints the lease id and queues the `Offer` on the
control connection before the handoff leaves it, so the host has it before a puller can read
(the handoff crosses the router first). NOTE: that order is not enforced: a read that beat its
`Offer` would fail with `LeaseExpired` (the decode side then recomputes) and the lease would
end at its expiry. A host that refuses an offer answers `OfferFailed`, and the lease ends as if
released. The driver's `on_release(block_ids)` runs once
per lease, when the host reports it ended, or for every lease still held when the connection
is lost (the host's process died: nothing can read its blocks any more); pulls in flight then
fail with `PeerGone`.

The host (`agent_host.AgentHost`) runs its own event loop on a daemon thread; one driver at a
time; when it goes, every lease ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
import uuid
from collections.abc import Sequence

from kvtransfer import remote_messages as m
from kvtransfer.agent import PullResult
from kvtransfer.errors import ErrorKind, PeerGone, error_from_kind
from kvtransfer.handoff import Handoff, KVLayout
from kvtransfer.leases import ReleaseCallback
from kvtransfer.transport import TransportConfig

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0  # connecting and starting the host's agent (its self-check included)


class RemoteAgent:
    """The driver's handle on an `AgentHost`'s agent. Use from one event loop."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 started: m.Started, on_release: ReleaseCallback) -> None:
        self._reader, self._writer = reader, writer
        self.layout: KVLayout = started.layout
        self.address: str = started.address
        self.num_blocks = started.num_blocks
        self.transport_name = started.address.partition("://")[0]
        self._on_release = on_release
        self._leases: dict[str, tuple[str, tuple[int, ...]]] = {}  # id -> request, blocks
        self._pulls: dict[int, asyncio.Future] = {}
        self._pull_ids = itertools.count()
        self._events = asyncio.ensure_future(self._read_events())

    @classmethod
    async def connect(cls, host: m.AgentHostAddress, transport: TransportConfig,
                      on_release: ReleaseCallback,
                      timeout_s: float = CONNECT_TIMEOUT_S) -> RemoteAgent:
        """Connect to `host` and start its agent on `transport`; raises the host's
        `TransferError` (a failed self-check included) or `PeerGone`."""
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host.host, host.port), timeout_s)
        except (TimeoutError, OSError) as exc:
            raise PeerGone(f"cannot reach the KV agent host at {host.host}:{host.port}: "
                           f"{exc!r}") from None
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        m.write_bytes(writer, host.token)
        try:
            await m.send(writer, m.Hello(transport))
            reply = await asyncio.wait_for(m.recv(reader), timeout_s)
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            writer.close()
            raise PeerGone(f"the KV agent host at {host.host}:{host.port} did not start its "
                           f"agent: {exc!r}") from None
        if isinstance(reply, m.StartFailed):
            writer.close()
            if reply.kind is None:
                raise RuntimeError(reply.message)
            raise error_from_kind(ErrorKind(reply.kind), reply.message)
        if not isinstance(reply, m.Started):
            writer.close()
            raise PeerGone(f"the KV agent host at {host.host}:{host.port} replied "
                           f"{type(reply).__name__}; expected Started or StartFailed")
        return cls(reader, writer, reply, on_release)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def offer(self, request_id: str, block_ids: Sequence[int], *, lease_s: float = 30.0,
              readers: int = 1) -> Handoff:
        """As `TransferAgent.offer`; the host checks the blocks (a refusal ends the lease)."""
        if self._events.done():
            raise PeerGone(f"the KV agent at {self.address} is gone")
        lease_id = uuid.uuid4().hex
        blocks = tuple(block_ids)
        handoff = Handoff(request_id, self.address, self.layout, blocks, lease_id,
                          time.time() + lease_s)
        self._leases[lease_id] = (request_id, blocks)
        m.write(self._writer, m.Offer(request_id, blocks, lease_id, lease_s, readers))
        return handoff

    def cancel(self, request_id: str) -> int:
        """End the request's leases (their blocks are released when the host says so)."""
        if not self._events.done():
            m.write(self._writer, m.Cancel(request_id))
        return sum(1 for rid, _ in self._leases.values() if rid == request_id)

    async def pull(self, handoffs: Handoff | Sequence[Handoff], local_block_ids: Sequence[int],
                   *, timeout: float = 30.0) -> PullResult:
        """As `TransferAgent.pull` (no `on_layer`: the host lands every layer first)."""
        if self._events.done():
            raise PeerGone(f"the KV agent at {self.address} is gone")
        records = (handoffs,) if isinstance(handoffs, Handoff) else tuple(handoffs)
        pull_id = next(self._pull_ids)
        done = self._pulls[pull_id] = asyncio.get_running_loop().create_future()
        m.write(self._writer, m.Pull(pull_id, records, tuple(local_block_ids), timeout))
        try:
            return await done
        finally:
            self._pulls.pop(pull_id, None)

    async def _read_events(self) -> None:
        try:
            while True:
                self._event(await m.recv(self._reader))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self._lost()

    def _event(self, record: object) -> None:
        if isinstance(record, (m.Released, m.OfferFailed)):
            if isinstance(record, m.OfferFailed):
                logger.error("the KV agent at %s refused an offer: %s", self.address,
                             record.message)
            lease = self._leases.pop(record.lease_id, None)
            if lease is not None:
                self._on_release(lease[1])
        elif isinstance(record, (m.Pulled, m.PullFailed)):
            done = self._pulls.get(record.pull_id)
            if done is None or done.done():
                return
            if isinstance(record, m.Pulled):
                done.set_result(record.result)
            elif record.kind is None:
                done.set_exception(RuntimeError(record.message))
            else:
                done.set_exception(error_from_kind(ErrorKind(record.kind), record.message,
                                                   record.lease_ids))

    def _lost(self) -> None:
        """The connection ended: pulls in flight fail, every lease ends here."""
        for done in self._pulls.values():
            if not done.done():
                done.set_exception(PeerGone(f"the KV agent at {self.address} is gone"))
        leases, self._leases = self._leases, {}
        for _, blocks in leases.values():
            self._on_release(blocks)

    async def close(self) -> None:
        """Stop the host's agent: every lease ends (released here)."""
        self._writer.close()
        try:
            await self._events
        except asyncio.CancelledError:
            pass
