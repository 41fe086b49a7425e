"""`nccl` transport: torch.distributed point-to-point over a communicator made per pair at run
time, so pools can grow and shrink (no fixed world). NCCL for GPU caches; the same code runs on
gloo with CPU caches (what the CPU tests use).

The source hosts a store and a TCP control socket; its address is
`nccl://HOST:CONTROL_PORT/STORE_PORT`. torch's `TCPStore` listens on every interface whatever host
it is given, so on a loopback host (every peer on this machine) the store is a `FileStore` instead,
and the address `nccl://HOST:CONTROL_PORT/file:PATH`: nothing listens beyond the host. The first
pull from a source makes a two-rank process group (source rank 0, puller rank 1) under a fresh key
(`PrefixStore`); both sides cache it for later pulls, and drop it on any error. Control messages
(request, accept/reject, done) go over the control socket as in `tcp`; the bytes go as one send per
view (K and V of each coalesced segment, per layer). Pulls from one source are serialised on the
puller (NCCL matches sends and receives by order, not tag).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import logging
import os
import socket
import tempfile
import time
import uuid
import functools
from typing import Generic, Protocol, TypeVar, cast
from collections.abc import Callable

import torch
import torch.distributed as dist

from kvtransfer.errors import InvalidDescriptor, PeerGone, TransferError, TransportUnavailable
from kvtransfer.control import StreamServer, connect, open_read_or_reject, request_read
from kvtransfer.transport import (BlockSource, LayerSink, TransferStats, Transport,
                                  TransportConfig)
from kvtransfer.wire import (PairHello, ReadDone, ReadRequest, recv_message, send_message)

logger = logging.getLogger(__name__)

TAG = 7


def _parse(address: str) -> tuple[str, int, str]:
    """(host, control port, store: a TCPStore port or `file:PATH`)."""
    rest = address.removeprefix("nccl://")
    hostport, _, store = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    if (not address.startswith("nccl://") or not host or not port.isdigit()
            or not (store.isdigit() or store.startswith("file:/"))):
        raise InvalidDescriptor(f"address {address!r}; expected nccl://HOST:PORT/STORE_PORT "
                                f"or nccl://HOST:PORT/file:PATH")
    return host, int(port), store


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _open_store(host: str, store: str) -> dist.Store:
    """The puller's end of a source's store."""
    if store.startswith("file:"):
        return dist.FileStore(store.removeprefix("file:"), -1)
    return dist.TCPStore(host, int(store), None, False, datetime.timedelta(seconds=30))


class PairGroup(Protocol):
    """A pair's process group (torch's stubs give its gloo and NCCL backends no send/recv)."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> dist.Work: ...
    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work: ...


def _make_group(backend: str, store: dist.Store, key: str, rank: int, host: str,
                timeout_s: float) -> PairGroup:
    """A two-rank process group under `key` (blocks until both ranks have joined)."""
    prefixed = dist.PrefixStore(f"kvtransfer/{key}/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in the stubs
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        return cast(PairGroup, dist.ProcessGroupGloo(prefixed, rank, 2, opts))
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None or not torch.cuda.is_available():
        raise TransportUnavailable("the nccl backend needs a CUDA build of torch and a GPU; "
                                   "CPU caches use backend 'gloo'")
    opts = nccl.Options()
    opts._timeout = timeout
    return nccl(prefixed, rank, 2, opts)


MAX_PAIRS = 64  # process groups kept per side; the least recently used beyond it are shut down


def _shut(group: object) -> None:
    """Release a pair's process group (NCCL's communicators; gloo's go with the object)."""
    shutdown = getattr(group, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception as exc:  # noqa: BLE001 -- a broken group is dropped all the same
            logger.debug("shutting a process group down failed: %r", exc)


_V = TypeVar("_V")


class PairCache(dict[str, _V], Generic[_V]):
    """Pair key (or address) -> what its process group needs, at most `limit`, least recently
    used first out; every entry leaving (evicted, dropped, cleared) has its group shut down.
    Peers come and go with autoscaling: without a bound, every one ever seen kept a group."""

    def __init__(self, group_of: Callable[[_V], PairGroup], limit: int = MAX_PAIRS) -> None:
        super().__init__()
        self.group_of, self.limit = group_of, limit

    def use(self, key: str) -> _V | None:
        value = super().pop(key, None)
        if value is not None:
            super().__setitem__(key, value)  # now the most recent
        return value

    def put(self, key: str, value: _V) -> None:
        self.drop(key)
        super().__setitem__(key, value)
        while len(self) > self.limit:
            self.drop(next(iter(self)))

    def drop(self, key: str) -> None:
        value = super().pop(key, None)
        if value is not None:
            _shut(self.group_of(value))

    def drop_all(self) -> None:
        for key in list(self):
            self.drop(key)


async def _in_thread(fn: Callable[[], None]) -> None:
    """Run blocking communication off the loop; if cancelled, wait for it to stop first so that
    nothing writes into the caches after the caller returns (bounded by the op timeout)."""
    future = asyncio.get_running_loop().run_in_executor(None, fn)
    try:
        await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.gather(future, return_exceptions=True)
        raise


def _run_ops(ops: list[functools.partial[dist.Work]], timeout_s: float, cuda: bool) -> None:
    try:
        for op in ops:
            op().wait(datetime.timedelta(seconds=timeout_s))
        if cuda:
            torch.cuda.current_stream().synchronize()
    except RuntimeError as e:  # gloo/NCCL report a dead peer or a timeout this way
        raise PeerGone(f"collective transfer failed: {e}") from None


class CollectiveTransport(Transport):
    name = "nccl"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, backend: str = "auto",
                 op_timeout_s: float = 30.0) -> None:
        if backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"collective backend {backend!r}; expected auto, nccl or gloo")
        self._host, self._port, self._backend = host, port, backend
        self._op_timeout_s = op_timeout_s
        self._source: BlockSource | None = None
        self._server: StreamServer | None = None
        self._store: dist.Store | None = None
        self._store_file: str | None = None  # the FileStore's, on a loopback host
        self._served: PairCache[PairGroup] = PairCache(lambda group: group)  # key -> group (rank 0)
        # source address -> (its store, pair key, group)
        self._pulled: PairCache[tuple[dist.Store, str, PairGroup]] = PairCache(lambda e: e[2])
        self._locks: dict[str, asyncio.Lock] = {}

    @classmethod
    def from_config(cls, config: TransportConfig,
                    hub: object | None = None) -> CollectiveTransport:
        return cls(config.host, config.port, config.collective_backend)

    def _backend_for(self, device: torch.device) -> str:
        if self._backend != "auto":
            return self._backend
        return "nccl" if device.type == "cuda" else "gloo"

    async def start(self, source: BlockSource) -> str:
        self._source = source
        if _loopback(self._host):  # every peer is on this machine: nothing need listen
            self._store_file = os.path.join(tempfile.gettempdir(),
                                            f"cleave-kv-store-{uuid.uuid4().hex}")
            self._store = dist.FileStore(self._store_file, -1)
            where = f"file:{self._store_file}"
        else:
            tcp = await asyncio.to_thread(
                dist.TCPStore, self._host, 0, None, True, datetime.timedelta(seconds=30), False)
            self._store, where = tcp, str(tcp.port)
        self._server = StreamServer(self._host, self._port, self._serve)
        return f"nccl://{self._server.host}:{self._server.port}/{where}"

    async def _serve(self, conn: socket.socket) -> None:
        hello = await recv_message(conn)
        if not isinstance(hello, PairHello):
            raise InvalidDescriptor(f"expected PairHello, got {type(hello).__name__}")
        source = self._source
        if source is None:
            raise RuntimeError("the transport serves only after start()")
        read = await open_read_or_reject(conn, source)
        if read is None:
            return
        try:
            group = self._served.use(hello.pair_key)
            device = read.caches[0].device
            if group is None:
                store = self._store
                if store is None:
                    raise RuntimeError("the transport was closed")
                group = await asyncio.to_thread(
                    _make_group, self._backend_for(device), store, hello.pair_key, 0,
                    self._host, self._op_timeout_s)
                self._served.put(hello.pair_key, group)
            for layer in range(read.num_layers):
                views = [v.contiguous() for v in read.layer_views(layer)]
                ops = [functools.partial(group.send, [v], 1, TAG) for v in views]
                await _in_thread(functools.partial(_run_ops, ops, self._op_timeout_s,
                                                   device.type == "cuda"))
            if not isinstance(await recv_message(conn), ReadDone):
                raise InvalidDescriptor("expected ReadDone after the last layer")
        except (TransferError, asyncio.CancelledError):
            self._served.drop(hello.pair_key)
            raise
        finally:
            source.close_read(read)

    async def fetch(self, address: str, request: ReadRequest, sink: LayerSink) -> TransferStats:
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            try:
                return await self._fetch(address, request, sink)
            except (TransferError, asyncio.CancelledError):
                self._pulled.drop(address)
                raise

    async def _fetch(self, address: str, request: ReadRequest, sink: LayerSink) -> TransferStats:
        start = time.perf_counter()
        host, port, store_at = _parse(address)
        sock = await connect(host, port)
        try:
            cached = self._pulled.use(address)
            key = cached[1] if cached else uuid.uuid4().hex
            await send_message(sock, PairHello(key))
            await request_read(sock, request, sink)
            device = sink.caches[0].device
            if cached is None:
                store = await asyncio.to_thread(_open_store, host, store_at)
                group = await asyncio.to_thread(
                    _make_group, self._backend_for(device), store, key, 1, self._host,
                    self._op_timeout_s)
                cached = (store, key, group)
                self._pulled.put(address, cached)
            group = cached[2]
            messages = 0
            for layer in range(sink.num_layers):
                views = sink.layer_views(layer)
                staged = [v if v.is_contiguous() else torch.empty_like(v, memory_format=
                                                                       torch.contiguous_format)
                          for v in views]
                ops = [functools.partial(group.recv, [s], 0, TAG) for s in staged]
                await _in_thread(functools.partial(_run_ops, ops, self._op_timeout_s,
                                                   device.type == "cuda"))
                for v, s in zip(views, staged):
                    if s is not v:
                        v.copy_(s)
                messages += len(views)
                sink.landed(layer)
            await send_message(sock, ReadDone())
        finally:
            sock.close()
        return TransferStats(sink.bytes_per_layer * sink.num_layers, messages,
                             time.perf_counter() - start)

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()
            self._server = None
        self._served.drop_all()
        self._pulled.drop_all()
        self._store = None
        if self._store_file is not None:
            with contextlib.suppress(OSError):
                os.remove(self._store_file)
            self._store_file = None
