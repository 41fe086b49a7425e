"""A worker in a process of its own, on one machine, without Ray: `cleave serve --in-process
--process-per-worker`.

Each worker runs in a spawned child process (pinned to cores of its own when its pool has a
`cpu_affinity`), serving its channel (call records and the output channel's long poll) over a
socket on 127.0.0.1 to the router's process, which talks to it through the same
`router.channel.ChannelClient` as over Ray: one long-polled output channel, batched commands,
no per-token call. So a layout measured this way has each worker on its own cores, as on
separate GPUs, with no Ray in between.

The wire: each message is a 4-byte length and a pickle. The child connects to the parent's
listening socket and proves itself with a random token, then reports ("ready", info) or
("failed", traceback). Then the calls go as `cluster.socket_calls` frames them (the Ray path's
data channel speaks the same), with one more of this channel's own, "shutdown". The child ends
when its connection closes (the parent died or closed it) or after "shutdown" has stopped the
worker.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import multiprocessing as mp
import os
import secrets
import socket
import traceback
from dataclasses import dataclass
from typing import Any

from cluster import event_loop
from cluster import process_wire as wire
from cluster.socket_calls import SocketCalls, SocketChannel, serve_calls, serve_channel
from router.errors import WorkerUnavailableError

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # the child loads its model meanwhile
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ProcessWorkerSpec:
    """What the child builds: `Worker.from_config(worker_id, engine, role, host=host,
    **options)`, pinned to `cores_per_rank` of `cpu_affinity` (None: unpinned, with
    `torch_threads` torch threads: `share_of_cores`)."""

    worker_id: str
    engine: Any  # workers.engine.config.EngineConfig
    role: str
    host: str
    options: dict[str, Any]
    cpu_affinity: tuple[int, ...] | None = None
    cores_per_rank: int = 1
    torch_threads: int = 1  # unpinned only (pinned: one per claimed core)


def share_of_cores(num_workers: int, cores: int | None = None) -> int:
    """Torch threads for each of `num_workers` unpinned worker processes on this machine's
    `cores` (default: the cores this process may run on): an equal share, at least one. (One
    thread each, as before, left a lone worker process half of a 2-core machine: int4 `small`
    preset at 8 streams 383-397 tokens/s against the one-process server's 733-815.)"""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return max(1, cores // max(1, num_workers))


# ---- the child ---------------------------------------------------------------------------------


def child_main(spec: ProcessWorkerSpec, port: int, token: bytes) -> None:
    """The worker process: pin, build the worker, connect, serve until the connection ends."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=START_TIMEOUT_S)
    wire.no_delay(sock)
    sock.sendall(token)
    try:
        import torch

        torch.set_num_threads(spec.torch_threads)
        if spec.cpu_affinity is not None:
            from cluster.cpu_affinity import claim_and_pin

            claim_and_pin(spec.cpu_affinity, spec.cores_per_rank)
        event_loop.run(_serve(spec, sock))
    except BaseException:  # noqa: BLE001 - reported to the parent while it can hear
        try:
            wire.send(sock, ("failed", traceback.format_exc()))
        except OSError:
            pass
        raise SystemExit(1) from None


async def _serve(spec: ProcessWorkerSpec, sock: socket.socket) -> None:
    from cluster.inprocess_client import InProcessChannel
    from workers.serving.worker import Worker

    worker = Worker.from_config(spec.worker_id, spec.engine, spec.role, host=spec.host,
                                **spec.options)
    channel = InProcessChannel(worker)
    if worker.role != "both":
        await worker.agents()  # the transport's self-check, before saying ready
    sock.settimeout(None)
    wire.send(sock, ("ready", worker.info))
    reader, writer = await asyncio.open_connection(sock=sock)

    serve = serve_channel(channel)

    async def handle(method: str, args: tuple) -> object:
        if method == "shutdown":
            await channel.close()
            return None
        return await serve(method, args)

    try:
        await serve_calls(reader, writer, handle, last=frozenset({"shutdown"}))
    finally:
        await channel.close()


# ---- the parent --------------------------------------------------------------------------------


class ProcessChannel(SocketChannel):
    """The router's wire to one worker process. `start()` spawns it and waits until its model
    is loaded (blocking); the calls run on the router's event loop."""

    def __init__(self, spec: ProcessWorkerSpec) -> None:
        self.spec = spec
        self.worker_id = spec.worker_id
        self.process: mp.process.BaseProcess | None = None
        self._sock: socket.socket | None = None
        self._calls: SocketCalls | None = None  # once the first call connected
        self._lost: str | None = None  # why the worker can no longer be called

    def start(self, timeout_s: float = START_TIMEOUT_S) -> ProcessChannel:
        server = socket.create_server(("127.0.0.1", 0))
        token = secrets.token_bytes(32)
        try:
            self.process = mp.get_context("spawn").Process(
                target=child_main, args=(self.spec, server.getsockname()[1], token),
                name=f"cleave-{self.worker_id}", daemon=True)
            self.process.start()
            server.settimeout(timeout_s)
            sock, _ = server.accept()
        finally:
            server.close()
        sock.settimeout(timeout_s)
        wire.no_delay(sock)
        if not hmac.compare_digest(wire.recv_exact(sock, len(token)), token):
            sock.close()
            raise RuntimeError(f"worker {self.worker_id}: a process that is not the child "
                               f"connected")
        kind, value = wire.recv(sock)
        if kind != "ready":
            sock.close()
            self.process.join(10)
            raise RuntimeError(f"worker {self.worker_id} failed to start:\n{value}")
        self._sock = sock
        return self

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    async def _connection(self) -> SocketCalls:
        if self._calls is None:
            if self._lost is not None or self._sock is None:
                raise WorkerUnavailableError(self.worker_id,
                                             self._lost or "the worker process is not running")
            self._sock.settimeout(None)
            reader, writer = await asyncio.open_connection(sock=self._sock)
            self._calls = SocketCalls(self.worker_id, reader, writer)
        return self._calls

    async def close(self) -> None:
        """Stop the worker (its engine and KV serving), then its process."""
        if self._lost is None and self._sock is not None:
            try:
                calls = await self._connection()
                await asyncio.wait_for(calls.call("shutdown"), STOP_TIMEOUT_S)
            except (TimeoutError, WorkerUnavailableError):
                pass
        self._lost = self._lost or "the worker was shut down"
        if self._calls is not None:
            self._calls.close(self._lost)
        elif self._sock is not None:
            self._sock.close()
        if self.process is not None:
            await asyncio.to_thread(self.process.join, STOP_TIMEOUT_S)
            if self.process.is_alive():
                self.process.kill()
                await asyncio.to_thread(self.process.join, STOP_TIMEOUT_S)
