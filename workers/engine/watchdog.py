"""The step watchdog: whether an engine still makes progress (`AsyncEngine.is_healthy`).

An engine is unhealthy while a step runs past `timeout_s` (a hung kernel, a rank that stopped
answering), and for good once a step failed because a rank of its group was lost. The engine's
published stats carry the verdict (`EngineStats.healthy`), read on every output-channel
heartbeat, so routers stop routing there and move its streams within a poll.
"""

from __future__ import annotations

import time


class StepWatchdog:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._began: float | None = None  # monotonic time the running step began
        self._broken: str | None = None

    def step_began(self) -> None:
        self._began = time.monotonic()

    def step_ended(self) -> None:
        self._began = None

    def broken(self, reason: str) -> None:
        """No step will work again (a lost rank)."""
        self._broken = reason

    @property
    def problem(self) -> str | None:
        """Why the engine is unhealthy now, or None."""
        if self._broken is not None:
            return self._broken
        began = self._began
        if began is not None and (ran := time.monotonic() - began) > self.timeout_s:
            return f"its step has run for {ran:.1f} s (step_timeout_s {self.timeout_s})"
        return None
