"""The one place a `Generation` is built (`GenerationFactory`): from where the orchestrator
started the request (`router.starts.Start`), with its text, its recovery when a worker fails
(`router.failover`), its metrics record (`router.request_record`), and tracked for live
migration (`router.live_migration`). Torch-free."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from router.request_record import NULL_RECORD, RequestRecord
from router.starts import Start
from router.streams import Generation, Parts, Recovery
from workers.contract.protocol import WorkerRequest

if TYPE_CHECKING:
    from router.metrics import RouterMetrics


class Tracker(Protocol):
    """Who keeps the running generations (`router.live_migration.LiveMigrations`)."""

    def track(self, gen: Generation) -> None:
        """A generation started (its first token arrived)."""


class GenerationFactory:
    """Builds every `Generation` whole: its text, its recovery, its record, and tracked for
    live migration. One per router."""

    def __init__(self, recovery: Recovery, *, metrics: RouterMetrics | None = None,
                 tracker: Tracker | None = None, migration_retries: int = 0,
                 tokenizer: object | None = None) -> None:
        """`metrics`: each generation's `RequestRecord` counts into it (None: not timed);
        `tokenizer`: makes the events' text here (None: the workers' text is kept)."""
        self.parts = Parts(recovery, migration_retries, tokenizer)
        self.metrics = metrics
        self.tracker = tracker

    def build(self, req: WorkerRequest, start: Start, started: float | None = None,
              frontend: str = "other") -> Generation:
        """The generation of `req` from where it started. `started`: when it reached the
        router (`time.monotonic()`; default now); `frontend` (http, grpc) labels its
        metrics."""
        metrics, arrived = self.metrics, time.monotonic() if started is None else started
        gen = Generation(req, start, self.parts, lambda g: NULL_RECORD if metrics is None
                         else RequestRecord(metrics, g, arrived, frontend))
        if self.tracker is not None:
            self.tracker.track(gen)
        return gen


__all__ = ["GenerationFactory", "Tracker"]
