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
from collections.abc import Iterable

from workers.engine.request import Request
from workers.engine.scheduler_records import prompt_left


def due_position(waiting: deque[Request], req: Request) -> int:
    """Where `req` enters `waiting` (the index to insert it at)."""
    if req.deadline is None:
        return len(waiting)
    for i, other in enumerate(waiting):
        if other.num_preemptions == 0 and (other.deadline is None or other.deadline > req.deadline):
            return i
    return len(waiting)


def prompt_tokens_before_due(running: Iterable[Request], waiting: deque[Request]) -> int:
    """The prompt tokens a request with a deadline arriving now waits behind, under this order:
    those of the running requests still to compute and of the waiting queue's front that goes
    ahead of it (preempted requests and those with a deadline, all of them: an upper bound
    when some are due after it), not those of the requests without a deadline behind them.
    What the router's deadline admission predicts from (`EngineStats.num_due_prompt_tokens`).
    O(running + the queued requests with a deadline)."""
    total = sum(prompt_left(r, r.num_computed_tokens) for r in running)
    for req in waiting:
        if req.deadline is None and req.num_preemptions == 0:
            break
        total += prompt_left(req, req.num_computed_tokens)
    return total
