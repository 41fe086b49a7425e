"""The transfer agent: one per worker rank, both source (offer) and puller (pull).

    agent = TransferAgent(layout, engine.kv_caches, TransportConfig("tcp"), on_release=free)
    address = await agent.start()
    # prefill side: pin the request's blocks under a lease, hand the record to the router
    handoff = agent.offer(request_id, engine.block_ids(request_id), lease_s=30.0)
    # decode side: land the blocks in freshly allocated local ones, layer by layer
    result = await agent.pull(handoffs, local_block_ids, on_layer=..., timeout=10.0)

Pulls from one source asked for in the same turn of the event loop go as one read (`pulls`).

The source frees a lease's blocks by calling `on_release(block_ids)` exactly once, when all
its expected pulls end (a pull consumes its reader however it ends), on `release`/`cancel`, or
at expiry. The puller owns its destination blocks: when `pull` raises, the caller frees them.
Not thread-safe: use from one event loop; `offer`, `release` and `cancel` must be called on it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from collections.abc import Callable, Sequence

import torch

from kvtransfer import faults
from kvtransfer.errors import (
    InvalidDescriptor,
    LayoutMismatch,
    LeaseExpired,
    PeerGone,
    TransferError,
)
from kvtransfer.handoff import Handoff, KVLayout, check_transferable
from kvtransfer.leases import LeaseTable, ReleaseCallback
from kvtransfer.plan import ReadPlan, sources_for
from kvtransfer.pulls import PartStats, PullBatcher, settled
from kvtransfer.registry import make_transport
from kvtransfer.transport import SourceRead, Transport, TransportConfig
from kvtransfer.wire import ReadRequest


@dataclass(frozen=True)
class PullResult:
    num_bytes: int  # bytes landed, all layers and sources
    num_messages: int  # data messages of its reads, all layers and sources
    num_sources: int  # source ranks pulled from
    seconds: float
    read_bytes: int  # bytes of the reads it went in (with other pulls from the same sources)


class TransferAgent:
    def __init__(self, layout: KVLayout, caches: Sequence[torch.Tensor],
                 transport: Transport | TransportConfig | None = None, *,
                 on_release: ReleaseCallback | None = None, hub: object | None = None) -> None:
        """`caches`: per layer `[2, num_blocks, block_size, num_kv_heads, head_dim]`, checked
        against `layout`. `on_release(block_ids)` frees a lease's blocks on the source."""
        self.layout = layout
        self.num_blocks = layout.check_caches(caches)
        self.caches = list(caches)
        self._transport = (transport if isinstance(transport, Transport)
                           else make_transport(transport or TransportConfig(), hub=hub))
        self._leases = LeaseTable(on_release or (lambda block_ids: None))
        self._pulls = PullBatcher(self._transport, layout, self.caches)
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._address: str | None = None

    @property
    def address(self) -> str:
        if self._address is None:
            raise RuntimeError("the agent has no address until `await agent.start()`")
        return self._address

    @property
    def transport_name(self) -> str:
        return self._transport.name

    async def start(self) -> str:
        """Serve this rank's blocks; returns the address published in handoffs."""
        if self._address is None:
            self._address = await self._transport.start(self)
        return self._address

    async def close(self) -> None:
        """Stop serving and end every lease (their blocks are released)."""
        await self._pulls.close()
        await self._transport.close()
        self._leases.release_all()
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._address = None

    # ---- source side ---------------------------------------------------------------------

    def offer(self, request_id: str, block_ids: Sequence[int], *, lease_s: float = 30.0,
              readers: int = 1, lease_id: str | None = None) -> Handoff:
        """Pin `block_ids` (token order) under a lease for `readers` pulls (the number of
        destination ranks that need this rank's heads: max(1, d // p) from TP=p to TP=d).
        `lease_id`: the lease's id when the caller minted it (`remote.RemoteAgent`)."""
        self._check_blocks(block_ids, "offered", self.num_blocks)
        lease = self._leases.grant(request_id, block_ids, lease_s, readers, lease_id)
        loop = asyncio.get_running_loop()
        self._timers[lease.lease_id] = loop.call_later(lease_s, self._expire, lease.lease_id)
        return Handoff(request_id, self.address, self.layout, tuple(block_ids), lease.lease_id,
                       time.time() + lease_s)

    def release(self, lease_id: str) -> bool:
        """End a lease now; False (harmless) when it already ended."""
        released = self._leases.release(lease_id)
        self._forget_timers()
        return released

    def cancel(self, request_id: str) -> int:
        """The request is gone: end its leases now. Returns how many ended."""
        ended = self._leases.cancel(request_id)
        self._forget_timers()
        return ended

    @property
    def num_leases(self) -> int:
        return self._leases.num_leases

    def holds_lease(self, lease_id: str) -> bool:
        return self._leases.holds(lease_id)

    @property
    def num_reads(self) -> int:
        """Reads this agent sent as a puller (pulls from one source that start together go as
        one read)."""
        return self._pulls.num_reads

    @property
    def num_held_blocks(self) -> int:
        return self._leases.num_held_blocks

    def open_read(self, request: ReadRequest) -> SourceRead:
        """BlockSource: validate a pull (layouts first, then every part's lease) before any
        byte moves. A part whose lease is gone or whose block count differs fails the read
        naming it, and no other part's lease is used."""
        self._check_blocks(request.block_ids, "destination", None)
        check_transferable(self.layout, request.layout)  # before the leases: a bad pull keeps them
        lease_ids = [part.lease_id for part in request.parts]
        if len(set(lease_ids)) != len(lease_ids):
            raise InvalidDescriptor(f"a read names leases {lease_ids[:8]}... more than once; "
                                    "expected each lease at most once")
        leases, gone = [], []
        for part in request.parts:
            try:
                leases.append(self._leases.readable(part.lease_id))
            except LeaseExpired as exc:
                gone.append(exc)
        if gone:
            raise LeaseExpired("; ".join(map(str, gone[:3])) + (
                f" (and {len(gone) - 3} more)" if len(gone) > 3 else ""),
                tuple(i for exc in gone for i in exc.lease_ids))
        short = [(p.lease_id, len(le.block_ids), len(p.block_ids))
                 for p, le in zip(request.parts, leases) if len(le.block_ids) != len(p.block_ids)]
        for lease_id, _, _ in short:  # a bad part uses its reader up
            self._leases.begin_read(lease_id)
            self._leases.end_read(lease_id)
        if short:
            self._forget_timers()
            raise LayoutMismatch(f"{short[0][2]} destination blocks for lease {short[0][0]!r} of "
                                 f"{short[0][1]} blocks; expected one per source block",
                                 tuple(i for i, _, _ in short))
        for lease_id in lease_ids:
            self._leases.begin_read(lease_id)
        try:
            plan = ReadPlan.build(self.layout, request.layout,
                                  [b for le in leases for b in le.block_ids], request.block_ids)
        except TransferError:
            self._end_reads(lease_ids)  # a bad pull uses its readers up
            raise
        return SourceRead(tuple(lease_ids), plan, self.caches, plan.bytes_per_layer(self.layout))

    def close_read(self, read: SourceRead) -> None:
        self._end_reads(read.lease_ids)

    def _end_reads(self, lease_ids: Sequence[str]) -> None:
        for lease_id in lease_ids:
            self._leases.end_read(lease_id)
        self._forget_timers()

    def _expire(self, lease_id: str) -> None:
        self._timers.pop(lease_id, None)
        self._leases.expire(lease_id)

    def _forget_timers(self) -> None:
        for lease_id in [i for i in self._timers if not self._leases.holds(i)]:
            self._timers.pop(lease_id).cancel()

    @staticmethod
    def _check_blocks(block_ids: Sequence[int], what: str, limit: int | None) -> None:
        """Distinct non-negative ids, below `limit` when given (the peer's size is unknown)."""
        bad = [b for b in block_ids if not isinstance(b, int) or b < 0
               or (limit is not None and b >= limit)]
        if not block_ids or bad or len(set(block_ids)) != len(block_ids):
            raise InvalidDescriptor(
                f"{what} block ids {list(block_ids)[:8]}... (bad: {bad[:5]}); expected distinct "
                f"ids in [0, {limit if limit is not None else 'num_blocks'})")

    # ---- destination side -----------------------------------------------------------------

    async def pull(self, handoffs: Handoff | Sequence[Handoff], local_block_ids: Sequence[int],
                   *, on_layer: Callable[[int], None] | None = None,
                   timeout: float = 30.0) -> PullResult:
        """Land a request's KV in `local_block_ids` (token order), from the handoffs of every
        source TP rank whose heads this rank needs. Returns once every layer has landed;
        `on_layer(i)` runs as soon as layer i has landed from all sources. Raises
        `LayoutMismatch` before any byte moves when the layouts or block counts disagree, and
        `TransferTimeout`, `LeaseExpired` or `PeerGone`; the caller then frees its blocks."""
        records = [handoffs] if isinstance(handoffs, Handoff) else list(handoffs)
        needed = sources_for(self.layout, records)
        self._check_blocks(local_block_ids, "local", self.num_blocks)
        dst_ids = tuple(local_block_ids)
        for h in needed:
            scheme = h.address.partition("://")[0]
            if scheme != self._transport.name:
                raise InvalidDescriptor(f"handoff address {h.address!r} is for transport "
                                        f"{scheme!r}; this agent pulls with "
                                        f"{self._transport.name!r}")
            if h.num_blocks != len(dst_ids):
                raise LayoutMismatch(f"{len(dst_ids)} local blocks for a handoff of "
                                     f"{h.num_blocks} blocks; expected as many")
        remaining = [len(needed)] * self.layout.num_layers

        def landed(layer: int) -> None:
            remaining[layer] -= 1
            if remaining[layer] == 0 and on_layer is not None:
                on_layer(layer)

        for _ in needed:
            try:
                await faults.ahit("kv.pull")
            except faults.InjectedFault as exc:  # an injected failure is a lost peer
                raise PeerGone(str(exc)) from None
        start = time.perf_counter()
        results = await settled([self._pulls.fetch(h, dst_ids, landed, timeout)
                                 for h in needed])
        parts: list[PartStats] = []
        for r in results:
            if isinstance(r, BaseException):
                raise r
            parts.append(r)
        return PullResult(sum(p.num_bytes for p in parts),
                          sum(p.read.num_messages for p in parts), len(parts),
                          time.perf_counter() - start, sum(p.read.num_bytes for p in parts))
