"""Pulls from one source that start together go as one read (`PullBatcher`).

A burst of small pulls from one source rank (a decode worker taking several prefilled requests
at once; a drain's continuations each landing the few blocks its stream wrote since the export)
would each open a connection, pass the lease check and frame every layer on its own: about 4 ms
of event-loop time on each side per pull on 2 cores, however few blocks it moves, so 32 of them
land one by one over 100+ ms. Pulls asked for in the same turn of the event loop from the same
source go as one `ReadRequest` of several parts: one connection (or one turn of a cached
endpoint), one lease check pass, one frame per layer for all of them. A lone pull goes at the
next turn of the loop, as before.

A part the source rejects alone (its lease gone) fails alone: the read goes again without it.
A failure of the read itself (the peer gone, its timeout) fails every part in it. The caller of
a part cancelled while its read is in flight waits for that read to end (bounded by its
timeout): nothing writes into its blocks once it has returned.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from kvtransfer.errors import PeerGone, TransferError, TransferTimeout
from kvtransfer.handoff import Handoff, KVLayout
from kvtransfer.plan import ReadPlan
from kvtransfer.transport import LayerSink, TransferStats, Transport
from kvtransfer.wire import ReadPart, ReadRequest

_T = TypeVar("_T")


@dataclass(frozen=True)
class PartStats:
    num_bytes: int  # this part's bytes, all layers
    read: TransferStats  # the whole read it went in (its own and the parts sent with it)


@dataclass(eq=False)
class _Part:
    handoff: Handoff
    dst_ids: tuple[int, ...]
    on_landed: Callable[[int], None]
    timeout: float
    done: asyncio.Future


class PullBatcher:
    """The puller side of one agent: sends its pulls, merged per source. Event-loop thread."""

    def __init__(self, transport: Transport, layout: KVLayout,
                 caches: Sequence[torch.Tensor]) -> None:
        self._transport = transport
        self._layout = layout
        self._caches = caches
        self._pending: dict[tuple[str, KVLayout], list[_Part]] = {}
        self._reads: set[asyncio.Task] = set()
        self.num_reads = 0  # reads sent, each of one part or more

    def fetch(self, handoff: Handoff, dst_ids: Sequence[int], on_landed: Callable[[int], None],
              timeout: float) -> asyncio.Future[PartStats]:
        """Land `handoff`'s blocks of this rank's heads in `dst_ids`, with the other pulls
        from the same source asked for in this turn of the loop. `on_landed(layer)` runs once
        per layer, in order. The future fails with the part's `TransferError`."""
        loop = asyncio.get_running_loop()
        part = _Part(handoff, tuple(dst_ids), on_landed, timeout, loop.create_future())
        key = (handoff.address, handoff.layout)
        batch = self._pending.get(key)
        if batch is None:
            batch = self._pending[key] = []
            loop.call_soon(self._send, key)
        batch.append(part)
        return part.done

    def _send(self, key: tuple[str, KVLayout]) -> None:
        parts = self._pending.pop(key, [])
        if parts:
            task = asyncio.get_running_loop().create_task(self._read(key[0], parts))
            self._reads.add(task)
            task.add_done_callback(self._reads.discard)

    async def _read(self, address: str, parts: list[_Part]) -> None:
        """Read `parts` from `address`; again without the parts the source rejects alone."""
        while parts:
            self.num_reads += 1
            timeout = min(p.timeout for p in parts)
            try:
                read = await asyncio.wait_for(self._fetch(address, parts), timeout)
            except TimeoutError:
                _fail(parts, TransferTimeout(f"pull did not finish within {timeout} s (a read of "
                                             f"{len(parts)} part(s) from {address})"))
                return
            except TransferError as exc:
                rejected = [p for p in parts if p.handoff.lease_id in exc.lease_ids] or parts
                _fail(rejected, exc)
                parts = [p for p in parts if p not in rejected]
                continue
            except BaseException as exc:  # closed (cancelled), or a bug: no part waits forever
                _fail(parts, exc if isinstance(exc, Exception) else PeerGone("the agent closed"))
                raise
            total = sum(len(p.dst_ids) for p in parts)
            for p in parts:
                if not p.done.done():
                    p.done.set_result(PartStats(read.num_bytes * len(p.dst_ids) // total, read))
            return

    async def _fetch(self, address: str, parts: list[_Part]) -> TransferStats:
        src_layout = parts[0].handoff.layout
        src_ids = [b for p in parts for b in p.handoff.block_ids]
        dst_ids = [b for p in parts for b in p.dst_ids]
        plan = ReadPlan.build(src_layout, self._layout, src_ids, dst_ids)

        def landed(layer: int) -> None:
            for p in parts:
                p.on_landed(layer)

        sink = LayerSink(plan, self._caches, plan.bytes_per_layer(src_layout), landed)
        request = ReadRequest(self._layout, tuple(ReadPart(p.handoff.lease_id, p.dst_ids)
                                                  for p in parts))
        return await self._transport.fetch(address, request, sink)

    async def close(self) -> None:
        """Stop every read in flight (their parts fail with `PeerGone`)."""
        for parts in self._pending.values():
            _fail(parts, PeerGone("the agent closed before the pull was sent"))
        self._pending.clear()
        for task in list(self._reads):
            task.cancel()
        await asyncio.gather(*self._reads, return_exceptions=True)


def _fail(parts: list[_Part], exc: BaseException) -> None:
    for p in parts:
        if not p.done.done():
            p.done.set_exception(exc)


async def settled(futures: Sequence[asyncio.Future[_T]]) -> list[_T | BaseException]:
    """Each future's result or exception once every one is done. A cancellation of the caller
    waits for them too (their reads write into the caller's blocks) and is raised after."""
    cancelled = False
    while True:
        try:
            await asyncio.wait(futures)
            break
        except asyncio.CancelledError:
            cancelled = True
    results: list[_T | BaseException] = [f.exception() or f.result() for f in futures]
    if cancelled:
        raise asyncio.CancelledError
    return results
