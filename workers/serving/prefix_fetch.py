"""A prompt prefix's KV pulled from the worker that has it, instead of recomputed (issue 23).

Also how a worker leaving the pool hands its hottest prefixes (`hot`) to the survivors, which
`land` them with no request to run (`router.hand_off`).

Source side (`export`): the leading blocks of the prompt found in this worker's device pool are
held under a lease per TP rank (`WorkerTransfer.offer`), as a prefilled request's are; the
lease's end frees them. Destination side (`land`): fresh blocks are reserved, the handoff is
pulled into them, and they join the prefix cache under the prompt's block hashes just before
the request is queued, which then finds them as prefix hits. A pull that fails, or no room for
it, leaves nothing held: the request computes its prompt as it would have. No torch at import.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from workers.contract.protocol import KVCacheFull, KVPullFailed
from workers.contract.prefix_cache import HotPrefix

if TYPE_CHECKING:
    from kvtransfer.handoff import KVHandoff
    from workers.contract.messages import Generate, PrefixFetch
    from workers.engine.outputs import Sink
    from workers.serving.async_connector import AsyncConnector
    from workers.serving.transfer import WorkerTransfer

logger = logging.getLogger(__name__)

FIXED_COST_WEIGHT = 0.3  # of each new fetch in the moving average of the fixed cost


def hold_id(request_id: str) -> str:
    """The id a request's prefix is held under on either worker (apart from the request's own
    blocks, so neither side's bookkeeping meets the other's)."""
    return f"{request_id}#prefix"


class PrefixFetcher:
    """Both sides of a prefix fetch for one worker. Event-loop thread."""

    def __init__(self, connector: AsyncConnector, transfer: WorkerTransfer) -> None:
        self.engine = connector.engine  # the async engine
        self.connector = connector.connector
        self.transfer = transfer
        # since start, for tests and metrics
        self.num_exported = 0
        self.num_landed_blocks = 0
        self.num_failed = 0

    async def export(self, request_id: str, block_hashes: Sequence[int],
                     reader_tp_size: int) -> KVHandoff | None:
        """Hold and offer the leading `block_hashes` this worker caches (up to the first miss)
        for a worker of `reader_tp_size` ranks to pull; None when it has none of them."""
        if reader_tp_size < 1:
            raise ValueError(f"reader_tp_size must be at least 1, got {reader_tp_size}")
        await self.transfer.agents()
        hid = hold_id(request_id)
        connector = self.connector
        # a caller gone before the offer (no lease ends the hold then): let go at once
        block_ids = await self.engine.apply(
            lambda: connector.export_prefix(hid, list(block_hashes)),
            undo=lambda _: connector.free_held(hid))
        if not block_ids:
            return None
        # no await from the hold to the offer: a lease is what frees the blocks
        handoff = self.transfer.offer(hid, block_ids, reader_tp_size)
        self.num_exported += 1
        return handoff

    async def hot(self, max_blocks: int) -> tuple[HotPrefix, ...]:
        """The prefixes hit here lately, most worth first (`Connector.hot_prefixes`)."""
        if max_blocks < 0:
            raise ValueError(f"max_blocks must be at least 0, got {max_blocks}")
        return tuple(await self.engine.apply(lambda: self.connector.hot_prefixes(max_blocks)))

    async def generate(self, cmd: Generate, sink: Sink) -> None:
        """Land the command's prefix, then run the request (which computes whatever did not
        land)."""
        assert cmd.prefix is not None
        await self.land(cmd.req.request_id, cmd.prefix, cmd.req.prompt_token_ids,
                        self.engine.engine.config.block_size)
        self.engine.generate(cmd.req, sink)

    async def land(self, request_id: str, fetch: PrefixFetch,
                   prompt_token_ids: Sequence[int], block_size: int) -> int:
        """Pull `fetch` into fresh blocks and cache them under its hashes; the blocks landed
        (0 when the pull failed or found no room: the prompt is computed instead)."""
        hid = hold_id(request_id)
        num_blocks = len(fetch.block_hashes)
        connector = self.connector
        start = time.perf_counter()
        try:
            pull = await self.transfer.puller(hid, fetch.handoff)
            block_ids = await self.engine.apply(  # a caller gone before the pull: let go
                lambda: connector.reserve_prefix(hid, num_blocks),
                undo=lambda _: connector.free_held(hid))
        except (KVPullFailed, KVCacheFull) as exc:
            self._failed(request_id, exc)
            return 0
        try:
            await pull(block_ids)
        except BaseException as exc:
            self.engine.apply_soon(lambda: connector.free_held(hid))
            if not isinstance(exc, KVPullFailed):
                raise
            self._failed(request_id, exc)
            return 0
        tokens = list(prompt_token_ids[:num_blocks * block_size])
        await self.engine.apply(lambda: connector.land_prefix(hid, fetch.block_hashes, tokens))
        self.num_landed_blocks += num_blocks
        self._measured(time.perf_counter() - start, fetch.handoff.num_bytes)
        return num_blocks

    def _measured(self, seconds: float, num_bytes: int) -> None:
        """A landed fetch's time beyond its bytes at the measured pull rate, into the engine's
        moving average (`EngineStats.kv_fetch_fixed_s`: the router's cost model adds it to
        every fetch, so a small one that does not pay is not made)."""
        engine = self.engine.engine
        rate = engine.kv_pull_bytes_per_s
        fixed = max(seconds - (num_bytes / rate if rate else 0.0), 0.0)
        old = engine.kv_fetch_fixed_s
        engine.kv_fetch_fixed_s = fixed if not old else old + FIXED_COST_WEIGHT * (fixed - old)

    def _failed(self, request_id: str, exc: Exception) -> None:
        self.num_failed += 1
        logger.warning("prefix fetch for %s failed, computing it instead: %s", request_id, exc)
