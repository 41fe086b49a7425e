"""The router's `router.stream` span of one generation: from its first token to its end, with
the tokens streamed, the workers that streamed them (more than one after a migration) and how
it ended; recorded once it ended, as the child of the front end's span. A record wrapper
(`router.request_record`), put on a generation only while tracing is on. Also the
`router.route` span's attributes, split or whole (`routed`, `routed_whole`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from router.request_record import NullRecord
from workers.contract.protocol import TokenEvent
from workers.contract.tracing import tracing

if TYPE_CHECKING:
    from router.decode_policy import DecodePick
    from router.streams import Generation


class StreamSpan(NullRecord):
    """`inner` (the generation's metrics record), timing the stream as a span."""

    def __init__(self, inner: NullRecord, gen: Generation, traceparent: str | None) -> None:
        self._inner, self._gen, self._traceparent = inner, gen, traceparent
        self._started_ns = time.time_ns()
        self._num_tokens = len(gen.first.token_ids)
        self._done = False

    def on_event(self, event: TokenEvent) -> None:
        self._num_tokens += len(event.token_ids)
        self._inner.on_event(event)

    def finish(self, status: str, reason: str = "") -> None:
        self._inner.finish(status, reason)
        if self._done:
            return
        self._done = True
        tracing().record("router.stream", self._traceparent, self._started_ns, time.time_ns(), {
            "tokens": self._num_tokens, "status": status, "error": reason,
            "streamed_by": ",".join(self._gen.streamed_by)})


def routed(prefill_id: str, cached: int, reason: str | None,
            decode: DecodePick | None) -> dict[str, str | int]:
    """A routing span's attributes: the workers chosen, the prefix hit, why it runs here."""
    return {"prefill_worker": prefill_id, "prefix_hit_tokens": cached,
            "decode_worker": decode.worker_id if decode is not None else "",
            "run_here": reason or "", "aggregated": False}


def routed_whole(worker_id: str, cached: int, reason: str | None) -> dict[str, str | int]:
    """An aggregated routing span's attributes: the one worker chosen for the whole request
    (prefill and decode), the prefix hit, why it runs whole in a disaggregated deployment."""
    return {"prefill_worker": worker_id, "decode_worker": worker_id,
            "prefix_hit_tokens": cached, "run_here": reason or "", "aggregated": True}
