"""The traffic the SLO planner plans for: arrivals over a sliding window, as request classes.
Torch-free.

`TrafficWindow` keeps each arrival's time, prompt tokens (uncached as the router predicted them)
and output tokens (the request's `max_tokens`, an upper bound: the planner errs towards more
workers) for `window_s` seconds. `classes(now)` buckets them by prompt length at `edges` into
`planner.RequestClass`es; each class's forecast rate is the larger of its whole window's and
its last `burst_s` seconds' (a burst, or a class the mix moves to, is planned for as soon as it
shows; a lull only once the window has seen it). A burst counts from `min_burst` arrivals: a
rare class's few arrivals bunching in `burst_s` (three of a 0.2/s class in 5 s: 0.6/s) are
Poisson noise, not a burst.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence

from router.planner import RequestClass

DEFAULT_EDGES = (64, 128, 256, 512, 1024, 2048, 4096, 8192)  # prompt-token bucket bounds


class TrafficWindow:
    """Arrivals of the last `window_s` seconds. Times are the caller's clock (seconds)."""

    def __init__(self, window_s: float = 30.0, burst_s: float = 5.0,
                 edges: Sequence[int] = DEFAULT_EDGES, min_burst: int = 5) -> None:
        if not 0 < burst_s <= window_s:
            raise ValueError(f"need 0 < burst_s <= window_s, got {burst_s} and {window_s}")
        if min_burst < 1:
            raise ValueError(f"min_burst must be >= 1, got {min_burst}")
        self.min_burst = min_burst
        if list(edges) != sorted(set(edges)) or not edges:
            raise ValueError(f"edges must be ascending and distinct, got {edges}")
        self.window_s, self.burst_s, self.edges = window_s, burst_s, tuple(edges)
        self._arrivals: deque[tuple[float, int, int]] = deque()
        self._started: float | None = None

    def arrived(self, now: float, prompt_tokens: int, output_tokens: int) -> None:
        """One request arrived at `now` (not before the last one's time)."""
        if self._started is None:
            self._started = now
        self._arrivals.append((now, max(1, prompt_tokens), max(1, output_tokens)))

    def _trim(self, now: float) -> None:
        while self._arrivals and self._arrivals[0][0] < now - self.window_s:
            self._arrivals.popleft()

    def classes(self, now: float) -> tuple[RequestClass, ...]:
        """The window's mix by prompt bucket, each at its forecast rate (empty: none)."""
        self._trim(now)
        if not self._arrivals or self._started is None:
            return ()
        seen_s = min(self.window_s, max(now - self._started, 1e-9))
        burst_s = min(self.burst_s, seen_s)
        recent_from = now - burst_s
        acc: dict[int, list[float]] = {}  # bucket -> [count, recent count, prompt, output]
        for t, prompt, output in self._arrivals:
            a = acc.setdefault(bisect.bisect_left(self.edges, prompt), [0, 0, 0.0, 0.0])
            a[0] += 1
            a[1] += t >= recent_from
            a[2] += prompt
            a[3] += output
        return tuple(RequestClass(max(a[0] / seen_s,
                                      a[1] / burst_s if a[1] >= self.min_burst else 0.0),
                                  a[2] / a[0], a[3] / a[0])
                     for _, a in sorted(acc.items()))


__all__ = ["DEFAULT_EDGES", "TrafficWindow"]
