"""The KV handoff's two ends on one worker. No torch at import.

A "prefill" (or "both") worker runs a prompt to its first token, holds the request's blocks and
offers them under a lease of its `TransferAgent` (`offer_first_token`); the lease's end
(pulled, cancelled, expired) frees them between steps. A "decode" (or "both") worker allocates
blocks, pulls the handoff into them, and decodes on (`pull_and_decode`). The `Worker` checks
roles and tracks these calls (`Worker.prefill`, `Worker.start`), so an `abort` ends them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from workers.contract.messages import DecodeFromHandoff, PrefillResult
from workers.contract.protocol import (
    FinishReason,
    InvalidRequestError,
    KVCacheFull,
    KVPullFailed,
    WorkerRequest,
)
from workers.contract.tracing import tracing
from workers.serving.traced_sink import traced

if TYPE_CHECKING:
    from kvtransfer.handoff import KVHandoff
    from workers.serving.async_connector import AsyncConnector
    from workers.engine.outputs import Sink
    from workers.serving.transfer import WorkerTransfer


def _kv_attributes(handoff: KVHandoff) -> dict[str, Any]:
    """A handoff's span attributes: its bytes, blocks and transport."""
    return {"kv.bytes": handoff.num_bytes, "kv.blocks": handoff.num_blocks,
            "kv.transport": handoff.ranks[0].address.partition(":")[0]}


class Handoff:
    """Both ends of the KV handoff for one worker's engine. Event-loop thread."""

    def __init__(self, connector: AsyncConnector, transfer: WorkerTransfer,
                 worker_id: str = "") -> None:
        self.connector = connector
        self.worker_id = worker_id  # named in its spans
        self.async_engine = connector.engine
        self.transfer = transfer

    async def offer_first_token(self, req: WorkerRequest,
                                decode_tp_size: int) -> PrefillResult:
        """Run `req`'s prompt to its first token and offer its KV for `decode_tp_size` ranks to
        pull (`WorkerTransfer.offer`); no handoff when the request ended at that token.
        Nothing is held after an error or a cancel."""
        await self.transfer.agents()
        rid, params = req.request_id, req.params
        first = None
        offered = False
        stream = self.async_engine.stream(lambda sink: self.connector.prefill(req, sink),
                                          rid)
        try:
            async for event in stream:
                first = event
            # finished: the blocks are held; no await from here to the offer
            if first is None:
                raise RuntimeError(f"prefill of {rid!r} ended without a token")
            if first.finish_reason is FinishReason.STOP or params.max_tokens == 1:
                return PrefillResult(first, None)  # the request is over (blocks freed below)
            with tracing().span("worker.kv_offer") as span:  # in worker.prefill
                handoff = self.transfer.offer(rid,
                                              self.connector.connector.held_block_ids(rid),
                                              decode_tp_size)
                offered = True
                if span is not None:
                    span.set_attributes(_kv_attributes(handoff))
            return PrefillResult(dataclasses.replace(first, finish_reason=None), handoff)
        finally:
            await stream.aclose()
            if not offered:  # queued after the abort of an unfinished request
                self.async_engine.apply_soon(lambda: self.connector.connector.free_held(rid))

    async def pull_and_decode(self, cmd: DecodeFromHandoff, sink: Sink) -> None:
        """Pull the handoff's KV into fresh blocks, then decode after the first token; a pull
        that fails (or no room to land it) fails the request with `KVPullFailed`, leaving
        nothing behind (the router then sends `DecodeFromHandoff` without a handoff)."""
        rid = cmd.req.request_id
        if cmd.handoff is None:
            raise ValueError(f"request {rid!r}: pull_and_decode needs a handoff, got None")
        handoff = cmd.handoff
        try:
            with tracing().span("worker.kv_pull", cmd.req.traceparent,
                                _kv_attributes(handoff)):
                pull = await self.transfer.puller(rid, handoff)
                await self.connector.decode_from_handoff(
                    cmd.req, cmd.first_token_id, pull,
                    traced(sink, cmd.req, self.worker_id))
        except KVCacheFull as exc:  # no room to land it now: the router prefills here instead,
            sink.fail(rid, KVPullFailed(rid, "KVCacheFull", str(exc)))  # queued for blocks
            sink.flush()
        except (KVPullFailed, InvalidRequestError) as exc:  # or refused here (an adapter
            sink.fail(rid, exc)  # not loaded): nothing held, the router is told
            sink.flush()
