"""Live KV migration, both workers' halves (issue 23): a running request moves from worker A to
worker B with its KV, nothing recomputed, no token repeated or lost. No torch at import.

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
import logging
from typing import TYPE_CHECKING

from workers.messages import Paused, RequestMoved
from workers.protocol import KVCacheFull, KVPullFailed

if TYPE_CHECKING:
    from kvtransfer.handoff import KVHandoff
    from workers.async_engine import AsyncEngine
    from workers.messages import Resume
    from workers.outputs import Sink
    from workers.transfer import WorkerTransfer

logger = logging.getLogger(__name__)


def hold_id(request_id: str) -> str:
    """The id the blocks of a migration's first pull are held under, on either worker."""
    return f"{request_id}#migrate"


class Migrations:
    """Both halves of live migrations for one worker. Event-loop thread."""

    def __init__(self, engine: AsyncEngine, transfer: WorkerTransfer) -> None:
        self.engine = engine
        self.transfer = transfer
        self._exported: dict[str, int] = {}  # request id -> blocks offered in step 1 (source)
        self.num_moved_out = 0
        self.num_moved_in = 0
        self.num_recomputed = 0  # continuations whose second pull failed

    # ---- the source ----------------------------------------------------------------------------

    async def export(self, request_id: str, reader_tp_size: int) -> KVHandoff | None:
        """Step 1: offer the request's full computed blocks; None when it has none yet."""
        await self.transfer.agents()
        hid = hold_id(request_id)
        block_ids = await self.engine.apply(
            lambda: self.engine.engine.export_running(request_id, hid))
        if not block_ids:
            return None
        self._exported[request_id] = len(block_ids)
        return self.transfer.offer(hid, block_ids, reader_tp_size)

    async def pause(self, request_id: str, reader_tp_size: int) -> Paused:
        """Step 3: stop the request here and offer the blocks written since step 1."""
        await self.transfer.agents()
        engine = self.engine.engine
        tokens, num_kv, block_ids = await self.engine.pause(
            request_id, RequestMoved(f"request {request_id!r} moved to another worker"))
        exported = self._exported.pop(request_id, 0)
        rest = block_ids[exported:-(-num_kv // engine.config.block_size)]
        self.num_moved_out += 1
        if not rest:
            self.engine.apply_soon(lambda: engine.free_held(request_id))
            return Paused(tuple(tokens), num_kv, None)
        return Paused(tuple(tokens), num_kv,
                      self.transfer.offer(request_id, rest, reader_tp_size))

    # ---- the target ----------------------------------------------------------------------------

    async def prepare(self, request_id: str, handoff: KVHandoff, hold_s: float) -> int:
        """Step 2: reserve blocks and pull the exported ones; the blocks landed. They are freed
        if no continuation takes them within `hold_s`. Raises `KVPullFailed` or
        `KVCacheFull`, nothing held."""
        hid = hold_id(request_id)
        engine = self.engine.engine
        num_blocks = len(handoff.ranks[0].block_ids)
        pull = await self.transfer.puller(hid, handoff)
        block_ids = await self.engine.apply(lambda: engine.reserve_prefix(hid, num_blocks))
        try:
            await pull(block_ids)
        except BaseException:
            self.engine.apply_soon(lambda: engine.free_held(hid))
            raise
        asyncio.get_running_loop().call_later(
            hold_s, lambda: self.engine.apply_soon(lambda: engine.free_held(hid)))
        return num_blocks

    async def continue_(self, cmd: Resume, sink: Sink) -> None:
        """Step 4: take the prepared blocks, pull the rest, decode on after the sent tokens;
        a failed pull (or no room) computes the KV instead."""
        kv = cmd.kv
        assert kv is not None
        rid = cmd.req.request_id
        hid = hold_id(rid) if kv.num_landed_blocks else None
        handoff = kv.handoff

        async def pull(block_ids: list[int]) -> None:
            if handoff is None:
                raise KVPullFailed(rid, "NoHandoff", f"{len(block_ids)} blocks have no source")
            await (await self.transfer.puller(rid, handoff))(block_ids)

        try:
            await self.engine.continue_with_kv(cmd.req, cmd.sent_token_ids, kv.num_kv_tokens,
                                               pull, sink, hid)
        except (KVPullFailed, KVCacheFull) as exc:
            logger.warning("migration of %s: %s; computing its KV here", rid, exc)
            self.num_recomputed += 1
            await self.engine.apply(lambda: None)  # after the abort of what was allocated
            self.engine.resume(cmd.req, cmd.sent_token_ids, sink)
            return
        except Exception as exc:  # noqa: BLE001 -- refused (a bad continuation): the stream says it
            sink.fail(rid, exc)
            sink.flush()
            return
        self.num_moved_in += 1
