"""The host side of a remote transfer agent (`kvtransfer.remote`): in the process that holds a
rank's KV cache, a `TransferAgent` over it on a daemon thread with its own event loop, driven by
one `RemoteAgent` at a time over a control connection (`remote_messages`).

The agent reads and writes the caches on that thread while the process's main thread computes:
a pull lands in blocks no step uses yet, and a lease holds blocks no step writes. When the
driver's connection ends, every lease ends.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import socket
import threading
from collections.abc import Sequence

import torch

from kvtransfer import remote_messages as m
from kvtransfer.agent import TransferAgent
from kvtransfer.errors import ErrorKind, InvalidDescriptor, TransferError
from kvtransfer.handoff import KVLayout


def _kind(exc: BaseException) -> str | None:
    return exc.kind.value if isinstance(exc, TransferError) else None


class AgentHost:
    """Serves one rank's caches to one driver at a time. Thread-safe `start`/`stop`."""

    def __init__(self, caches: Sequence[torch.Tensor], *, tp_rank: int, tp_size: int,
                 encoding: str = "") -> None:
        """`caches`: per layer `[planes, num_blocks, block_size, heads, head_dim]`, this
        rank's heads (a latent: whole); `encoding`: `KVLayout.encoding`."""
        self.caches = list(caches)
        self.layout = KVLayout.from_caches(self.caches, tp_rank=tp_rank, tp_size=tp_size,
                                           encoding=encoding)
        self.num_blocks = self.layout.check_caches(self.caches)
        self._token = secrets.token_bytes(16)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._driver: asyncio.Task | None = None
        self._server: asyncio.AbstractServer | None = None

    def start(self, host: str) -> m.AgentHostAddress:
        """Listen on `host` (a free port) on a new daemon thread; where the driver connects."""
        sock = socket.create_server((host, 0))
        port = sock.getsockname()[1]
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sock, ready),
                                        name="kv-agent-host", daemon=True)
        self._thread.start()
        ready.wait()
        return m.AgentHostAddress(host, port, self._token)

    def _run(self, sock: socket.socket, ready: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            self._server = loop.run_until_complete(asyncio.start_server(self._serve, sock=sock))
            ready.set()
            loop.run_forever()
        finally:
            ready.set()
            loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._driver is not None:
            self._driver.cancel()
            try:
                await self._driver
            except asyncio.CancelledError:
                pass
        asyncio.get_running_loop().stop()

    def stop(self) -> None:
        """Stop serving: the driver's connection closes, every lease ends (idempotent)."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
            thread.join(10.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            token = await asyncio.wait_for(m.recv_bytes(reader, len(self._token)), 5.0)
        except (TimeoutError, asyncio.IncompleteReadError, ValueError, OSError):
            token = b""
        if not hmac.compare_digest(token, self._token) or self._driver is not None:
            writer.close()  # not our driver, or a second one
            return
        self._driver = asyncio.current_task()
        try:
            await _HostSession(self, reader, writer).run()
        except asyncio.CancelledError:
            pass  # `stop`: the host is going (asyncio would log a cancelled connection task)
        finally:
            self._driver = None
            writer.close()


class _HostSession:
    """One driver's connection: its agent, started on `Hello`, closed when the driver goes."""

    def __init__(self, host: AgentHost, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.host, self.reader, self.writer = host, reader, writer
        self.agent: TransferAgent | None = None
        self.lease_ids: dict[tuple[int, ...], list[str]] = {}  # offered blocks -> leases
        self.pulls: set[asyncio.Task] = set()

    async def run(self) -> None:
        from kvtransfer.selfcheck import self_check

        try:
            hello = await m.recv(self.reader)
            if not isinstance(hello, m.Hello) or hello.version != m.CONTROL_VERSION:
                await m.send(self.writer, m.StartFailed(ErrorKind.INVALID_DESCRIPTOR.value, (
                    f"expected Hello of version {m.CONTROL_VERSION}, got {hello!r}")))
                return
            try:
                await self_check(hello.transport)
                self.agent = TransferAgent(self.host.layout, self.host.caches, hello.transport,
                                           on_release=self._released)
                address = await self.agent.start()
            except Exception as exc:  # noqa: BLE001 - the driver raises it
                await m.send(self.writer, m.StartFailed(_kind(exc), f"{type(exc).__name__}: "
                                                                    f"{exc}"))
                return
            await m.send(self.writer, m.Started(address, self.host.layout, self.host.num_blocks))
            while True:
                self._handle(await m.recv(self.reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the driver went: its leases end below
        finally:
            self.writer.close()  # the driver hears at once; then the pulls and leases end
            for task in list(self.pulls):
                task.cancel()
            await asyncio.gather(*self.pulls, return_exceptions=True)
            if self.agent is not None:
                await self.agent.close()

    def _handle(self, record: object) -> None:
        agent = self.agent
        assert agent is not None
        if isinstance(record, m.Offer):
            try:
                agent.offer(record.request_id, record.block_ids, lease_s=record.lease_s,
                            readers=record.readers, lease_id=record.lease_id)
            except (TransferError, ValueError) as exc:
                m.write(self.writer, m.OfferFailed(record.lease_id, str(exc)))
                return
            self.lease_ids.setdefault(tuple(record.block_ids), []).append(record.lease_id)
        elif isinstance(record, m.Cancel):
            agent.cancel(record.request_id)
        elif isinstance(record, m.Pull):
            task = asyncio.ensure_future(self._pull(agent, record))
            self.pulls.add(task)
            task.add_done_callback(self.pulls.discard)
        else:
            raise InvalidDescriptor(f"unexpected control record {type(record).__name__}")

    async def _pull(self, agent: TransferAgent, pull: m.Pull) -> None:
        try:
            result = await agent.pull(list(pull.handoffs), pull.block_ids,
                                      timeout=pull.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the driver raises it
            if self.writer.is_closing():
                return
            m.write(self.writer, m.PullFailed(pull.pull_id, _kind(exc), str(exc),
                                              getattr(exc, "lease_ids", ())))
            return
        if not self.writer.is_closing():
            m.write(self.writer, m.Pulled(pull.pull_id, result))

    def _released(self, block_ids: Sequence[int]) -> None:
        """The agent ended a lease on `block_ids`: tell the driver which (the one of those
        blocks the agent no longer holds)."""
        key = tuple(block_ids)
        leases = self.lease_ids.get(key, [])
        ended = [i for i in leases if self.agent is None or not self.agent.holds_lease(i)]
        if not ended:
            return
        lease_id = ended[0]
        leases.remove(lease_id)
        if not leases:
            del self.lease_ids[key]
        if not self.writer.is_closing():
            m.write(self.writer, m.Released(lease_id))
