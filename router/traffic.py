"""The traffic the SLO planner plans for: arrivals over a sliding window, as request classes.
Torch-free.

`TrafficWindow` keeps each arrival's time, prompt tokens (uncached as the router predicted them)
and output tokens (the request's `max_tokens`, an upper bound: the planner errs towards more
workers) for `window_s` seconds. `classes(now)` buckets them by prompt length at `edges` into
`planner.RequestClass`es; the forecast rate is the larger of the whole window's and the last
`burst_s` seconds' (a burst is planned for as soon as it shows; a lull only once the window
has seen it), applied to the window's mix.
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
                 edges: Sequence[int] = DEFAULT_EDGES) -> None:
        if not 0 < burst_s <= window_s:
            raise ValueError(f"need 0 < burst_s <= window_s, got {burst_s} and {window_s}")
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
        """The window's mix by prompt bucket, at the forecast rate (empty: no arrivals)."""
        self._trim(now)
        if not self._arrivals or self._started is None:
            return ()
        seen_s = min(self.window_s, max(now - self._started, 1e-9))
        burst_s = min(self.burst_s, seen_s)
        recent = len(self._arrivals) - bisect.bisect_left(self._arrivals, (now - burst_s,))
        scale = max(1.0, (recent / burst_s) / (len(self._arrivals) / seen_s))
        buckets: dict[int, list[int]] = {}
        sums: dict[int, list[float]] = {}
        for _, prompt, output in self._arrivals:
            b = bisect.bisect_left(self.edges, prompt)
            count = buckets.setdefault(b, [0])
            count[0] += 1
            acc = sums.setdefault(b, [0.0, 0.0])
            acc[0] += prompt
            acc[1] += output
        out = []
        for b in sorted(buckets):
            n = buckets[b][0]
            out.append(RequestClass(n / seen_s * scale, sums[b][0] / n, sums[b][1] / n))
        return tuple(out)


__all__ = ["DEFAULT_EDGES", "TrafficWindow"]
