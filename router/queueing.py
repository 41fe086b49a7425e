"""Queueing arithmetic for the SLO planner (`router.planner`). Torch-free, pure."""

from __future__ import annotations

import math
from collections.abc import Callable


def queue_wait_s(rate: float, service_s: float, percentile: float, servers: int = 1) -> float:
    """The wait at `percentile` of an M/M/c queue of `servers` (Erlang C; inf when
    saturated). The router's least-loaded routing pools the workers' queues, so a pool of c
    workers waits as one queue of c servers, not as c queues of one."""
    a = rate * service_s  # offered load, in servers
    if a >= servers:
        return math.inf
    if a <= 0:
        return 0.0
    erlang_b = 1.0
    for k in range(1, servers + 1):
        erlang_b = a * erlang_b / (k + a * erlang_b)
    waits = erlang_b / (1 - a / servers * (1 - erlang_b))  # P(wait > 0), Erlang C
    if waits <= 1 - percentile:
        return 0.0
    return math.log(waits / (1 - percentile)) * service_s / (servers - a)


def fewest(lo: int, hi: int, meets: Callable[[int], bool]) -> int:
    """The least n in [lo, hi] with `meets(n)` (monotone: more workers never predict worse),
    by doubling then bisection (each prediction costs O(n)); `hi` when none meets it."""
    top = max(lo, 1)
    while top < hi and not meets(top):
        lo, top = top + 1, 2 * top
    hi = min(hi, top)
    while lo < hi:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


__all__ = ["fewest", "queue_wait_s"]
