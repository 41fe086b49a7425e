"""The order of the engine's waiting queue: first come first served, except that a request
with a deadline (its TTFT target, `Request.deadline`) goes ahead of every waiting request due
later or never: earliest deadline first among the requests that carry one, FIFO among equal
deadlines and among those without. A preempted request keeps its place at the front (it was
running; its blocks are being recomputed). Requests are refused at the router when no worker
is predicted to meet their deadline (`router.deadline`), so the ones queued here can be met,
and ordering them first is what lets them be under load (Mooncake's early rejection, with an
EDF queue as SGLang and vLLM's priority scheduling keep one)."""

from __future__ import annotations

from collections import deque

from workers.engine.request import Request


def due_position(waiting: deque[Request], req: Request) -> int:
    """Where `req` enters `waiting` (the index to insert it at)."""
    if req.deadline is None:
        return len(waiting)
    for i, other in enumerate(waiting):
        if other.num_preemptions == 0 and (other.deadline is None or other.deadline > req.deadline):
            return i
    return len(waiting)
