"""The connector's commands on the async engine: each `Connector` verb that starts, continues
or stops a request with a stream of events, applied between steps (`AsyncEngine.start`,
`AsyncEngine.apply`) with its events routed to the caller's sink. No torch at import."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from workers.engine.request import Continuation

if TYPE_CHECKING:
    from workers.contract.protocol import WorkerRequest
    from workers.engine.async_engine import AsyncEngine
    from workers.engine.outputs import Sink
    from workers.serving.connector import Connector, PausedHere


class AsyncConnector:
    """A worker's connector (`connector`, on the engine of `engine`) as async commands. Call
    on the event loop's thread."""

    def __init__(self, engine: AsyncEngine, connector: Connector) -> None:
        self.engine = engine
        self.connector = connector

    def prefill(self, req: WorkerRequest, sink: Sink) -> None:
        """Run the prompt to its first token and hold its blocks (`Connector.prefill`)."""
        self.engine.start(req.request_id, 1, lambda: self.connector.prefill(req), sink,
                          req.params)

    def resume(self, req: WorkerRequest, samples: Sequence[Continuation], sink: Sink) -> None:
        """Continue a request's samples after tokens other workers sent (`Connector.resume`)."""
        self.engine.start(req.request_id, len(samples),
                          lambda: self.connector.resume(req, samples), sink, req.params)

    async def decode_from_handoff(self, req: WorkerRequest, first_token_id: int,
                                  pull: Callable[[list[int]], Awaitable[None]],
                                  sink: Sink) -> None:
        """Allocate blocks, await `pull(block_ids)` to land the prompt's KV in them, then decode
        after `first_token_id` with events to `sink`. Raises what the allocation
        (`KVCacheFull`) or `pull` raises, with nothing left behind; cancelled, it aborts."""
        await self.continue_with_kv(
            req, [Continuation(0, [first_token_id], len(req.prompt_token_ids))],
            lambda to_fill: pull(to_fill[0]), sink)

    async def continue_with_kv(self, req: WorkerRequest, samples: Sequence[Continuation],
                               pull: Callable[[dict[int, list[int]]], Awaitable[None]],
                               sink: Sink) -> None:
        """`decode_from_handoff` for several samples after their sent tokens, each with the KV
        of its first `num_kv_tokens` tokens pulled (`Connector.continue_with_kv`: `pull` gets
        each sample's blocks to fill, by index), then the rest computed and decoded on with
        events to `sink`."""
        engine, rid = self.engine, req.request_id
        await engine.compile_queue.compile(req.params)
        try:
            to_fill = await engine.apply(lambda: self.connector.continue_with_kv(req, samples))
        except asyncio.CancelledError:
            engine.abort(rid)
            raise
        try:
            if any(to_fill.values()):
                await pull(to_fill)
        except BaseException:
            engine.abort(rid)
            raise
        engine.start(rid, len(samples), lambda: self.connector.kv_landed(rid), sink)

    async def pause(self, request_id: str, moved: BaseException) -> list[PausedHere]:
        """Stop a running request between steps, its blocks held (`Connector.pause`); its sink
        then gets `moved` as its failure, after every event it produced here. A caller gone
        before the answer (nobody offers the held blocks): they are freed, and the sink fails
        with an engine error instead, so the router continues the request elsewhere."""
        connector, routes = self.connector, self.engine.routes

        def let_go(paused: list[PausedHere]) -> None:
            for p in paused:
                connector.free_held(p.sample_id)
            routes.fail(request_id, RuntimeError(
                f"request {request_id!r} was paused for a live migration whose caller gave up"))

        result = await self.engine.apply(lambda: connector.pause(request_id), undo=let_go)
        routes.fail(request_id, moved)
        return result
