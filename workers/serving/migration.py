"""Live KV migration, both workers' halves (issue 23): a running request moves from worker A to
worker B with its KV, nothing recomputed, no token repeated or lost. No torch at import.

Each step is per request, over every sample it still runs (n > 1 moves whole; each sample's KV is
offered and pulled on its own, the prompt's shared blocks once per sample):

1. A `export`s the full blocks of the request's computed tokens (it never writes them again)
   under a lease per rank; A keeps decoding.
2. B `prepare`s: reserves blocks and pulls them (held, freed if no continuation comes within
   the lease time).
3. A `pause`s the request between two steps: no further event; its stream there ends with
   `RequestMoved`, after every token it produced; its blocks are held and the ones written
   since step 1 offered under a lease. The answer (`Paused`) carries the output so far.
4. B `continue_`s (`Resume` with `MigratedKV`): it takes the prepared blocks first, pulls the
   rest into fresh ones, and decodes on after that output. A pull that fails here makes B
   compute the KV instead (a resume), so the stream still goes on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Iterable, Mapping
from typing import TYPE_CHECKING

from workers.contract.messages import Paused, PausedSample, RequestMoved
from workers.contract.protocol import KVCacheFull, KVPullFailed
from workers.engine.request import Continuation

if TYPE_CHECKING:
    from kvtransfer.handoff import KVHandoff
    from workers.contract.messages import Resume
    from workers.engine.outputs import Sink
    from workers.serving.async_connector import AsyncConnector
    from workers.serving.transfer import WorkerTransfer

logger = logging.getLogger(__name__)


def hold_id(request_id: str, index: int) -> str:
    """The id a sample's blocks of a migration's first pull are held under, on either
    worker."""
    return f"{request_id}#migrate/{index}"


class Migrations:
    """Both halves of live migrations for one worker, a request with all its running samples
    (each sample's KV is offered and pulled on its own). Event-loop thread."""

    def __init__(self, connector: AsyncConnector, transfer: WorkerTransfer) -> None:
        self.engine = connector.engine  # the async engine
        self.connector = connector.connector
        self.commands = connector
        self.transfer = transfer
        # request id -> blocks offered in step 1, by sample index (source)
        self._exported: dict[str, dict[int, int]] = {}
        self._prepared: dict[str, list[int]] = {}  # request id -> sample indexes held (target)
        self.num_moved_out = 0
        self.num_moved_in = 0
        self.num_recomputed = 0  # continuations whose second pull failed

    # ---- the source ----------------------------------------------------------------------------

    async def export(self, request_id: str, reader_tp_size: int) -> dict[int, KVHandoff]:
        """Step 1: offer each running sample's full computed blocks, by sample index (a sample
        with none yet is left out)."""
        await self.transfer.agents()
        connector = self.connector

        def let_go(held: dict[int, list[int]]) -> None:  # the caller gone before the offer
            for index in held:
                connector.free_held(hold_id(request_id, index))

        block_ids = await self.engine.apply(lambda: connector.export_running(
            request_id, lambda index: hold_id(request_id, index)), undo=let_go)
        self._exported[request_id] = {i: len(ids) for i, ids in block_ids.items()}
        return {i: self.transfer.offer(hold_id(request_id, i), ids, reader_tp_size)
                for i, ids in block_ids.items() if ids}

    async def pause(self, request_id: str, reader_tp_size: int) -> Paused:
        """Step 3: stop the request here and offer each sample's blocks written since step
        1."""
        await self.transfer.agents()
        connector, block_size = self.connector, self.connector.engine.config.block_size
        try:
            paused = await self.commands.pause(
                request_id, RequestMoved(f"request {request_id!r} moved to another worker"))
        except BaseException:  # not paused (gone, or the caller gave up): step 1's offers end
            for index in self._exported.pop(request_id, {}):
                self.transfer.cancel(hold_id(request_id, index))
            raise
        exported = self._exported.pop(request_id, {})
        samples = []
        for p in paused:
            rest = p.block_ids[exported.get(p.index, 0):-(-p.num_kv_tokens // block_size)]
            handoff = None
            if rest:
                handoff = self.transfer.offer(p.sample_id, rest, reader_tp_size)
            else:
                self.engine.apply_soon(functools.partial(connector.free_held, p.sample_id))
            samples.append(PausedSample(p.index, tuple(p.output_token_ids), p.num_kv_tokens,
                                        handoff))
        self.num_moved_out += 1
        return Paused(tuple(samples))

    async def cancel(self, request_id: str) -> None:
        """Either side of a migration that will not happen: end the leases of what step 1
        offered (the source: freed when they end) and free what step 2 landed (the
        target)."""
        exported = self._exported.pop(request_id, {})
        for index in exported:
            self.transfer.cancel(hold_id(request_id, index))
        prepared = self._prepared.pop(request_id, [])
        connector = self.connector
        if prepared:
            await self.engine.apply(lambda: [connector.free_held(hold_id(request_id, i))
                                             for i in prepared])

    # ---- the target ----------------------------------------------------------------------------

    async def prepare(self, request_id: str, exported: Mapping[int, KVHandoff],
                      hold_s: float) -> dict[int, int]:
        """Step 2: reserve blocks and pull each sample's exported ones; the blocks landed, by
        sample index. They are freed if no continuation takes them within `hold_s`. Raises
        `KVPullFailed` or `KVCacheFull`, nothing held."""
        connector = self.connector
        holds = {i: hold_id(request_id, i) for i in exported}

        def free_all() -> None:
            for hid in holds.values():
                connector.free_held(hid)

        try:
            pulls = {i: await self.transfer.puller(holds[i], h) for i, h in exported.items()}
            block_ids = await self.engine.apply(lambda: {
                i: connector.reserve_prefix(holds[i], len(h.ranks[0].block_ids))
                for i, h in exported.items()})
            await _all(pulls[i](block_ids[i]) for i in exported)
        except BaseException:
            self.engine.apply_soon(free_all)
            raise
        mine = self._prepared[request_id] = list(holds)

        def expire() -> None:  # only if still waiting: not taken by a continuation (whose
            # blocks a later prepare's continuation may still be adopting under the same ids)
            if self._prepared.get(request_id) is mine:
                self._prepared.pop(request_id, None)
                self.engine.apply_soon(free_all)

        asyncio.get_running_loop().call_later(hold_s, expire)
        return {i: len(ids) for i, ids in block_ids.items()}

    async def continue_(self, cmd: Resume, sink: Sink) -> None:
        """Step 4: take each sample's prepared blocks, pull the rest, decode on after the sent
        tokens; a failed pull (or no room) computes the KV instead."""
        rid = cmd.req.request_id
        migrated = [(s, s.kv) for s in cmd.samples if s.kv is not None]
        if len(migrated) < len(cmd.samples):  # refused: what was prepared expires
            raise ValueError(f"resume of {rid!r}: each sample of a live migration carries its KV")
        self._prepared.pop(rid, None)  # taken (or freed) by the continuation
        handoffs = {s.index: kv.handoff for s, kv in migrated}
        samples = [Continuation(s.index, s.sent_token_ids, kv.num_kv_tokens,
                                hold_id(rid, s.index) if kv.num_landed_blocks else None)
                   for s, kv in migrated]

        async def pull(to_fill: dict[int, list[int]]) -> None:
            async def one(index: int, block_ids: list[int]) -> None:
                handoff = handoffs[index]
                if handoff is None:
                    raise KVPullFailed(rid, "NoHandoff",
                                       f"{len(block_ids)} blocks have no source")
                await (await self.transfer.puller(rid, handoff))(block_ids)

            await _all(one(i, ids) for i, ids in to_fill.items() if ids)

        try:
            await self.commands.continue_with_kv(cmd.req, samples, pull, sink)
        except (KVPullFailed, KVCacheFull) as exc:
            logger.warning("migration of %s: %s; computing its KV here", rid, exc)
            self.num_recomputed += 1
            await self.engine.apply(lambda: None)  # after the abort of what was allocated
            self.commands.resume(cmd.req, [Continuation(s.index, s.sent_token_ids)
                                           for s in cmd.samples], sink)
            return
        except Exception as exc:  # noqa: BLE001 -- refused (a bad continuation): the stream says it
            sink.fail(rid, exc)
            sink.flush()
            return
        self.num_moved_in += 1


async def _all(pulls: Iterable[Awaitable[None]]) -> None:
    """Await every pull to its end (landed or failed: none writes into blocks freed after),
    then raise the first failure."""
    for result in await asyncio.gather(*pulls, return_exceptions=True):
        if isinstance(result, BaseException):
            raise result

