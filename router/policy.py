"""Routing policies: pick the worker for a prompt from the prefix index and the workers' loads.

Policies are registered by name (`get_policy("prefix_aware", w_queue=0.5)`). Each takes the
prompt's chained block hashes, the candidates' loads (a `router.loads.LoadTable`, or any
sequence of `WorkerLoad`s) and the `PrefixIndex`, and returns a `Decision`; the work per
decision is a few array operations over the candidates, not a Python step per worker.
Unhealthy workers are never chosen; with none healthy, `NoHealthyWorker`. Decisions are
deterministic for the same inputs (round robin: for the same call history).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import numpy as np

from router.loads import LoadTable, NoHealthyWorker, WorkerLoad
from router.prefix_index import PrefixIndex


@dataclass(frozen=True)
class Decision:
    worker_id: str
    predicted_hit_blocks: int  # leading prompt blocks the index says the worker holds


class RoutingPolicy(ABC):
    """Chooses one worker per prompt. Does not modify the index."""

    name: str

    @abstractmethod
    def choose(self, block_hashes: Sequence[int], loads: Sequence[WorkerLoad],
               index: PrefixIndex) -> Decision:
        """The worker for a prompt whose full blocks hash to `block_hashes`."""


_P = TypeVar("_P", bound=type[RoutingPolicy])
_REGISTRY: dict[str, Callable[..., RoutingPolicy]] = {}


def register_policy(name: str) -> Callable[[_P], _P]:
    def register(cls: _P) -> _P:
        if name in _REGISTRY:
            raise ValueError(f"routing policy {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return register


def registered_policies() -> list[str]:
    return sorted(_REGISTRY)


def get_policy(name: str, **options: float) -> RoutingPolicy:
    """A new policy instance by registered name, with its options (see each policy's __init__)."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; registered: "
                         f"{', '.join(registered_policies())}")
    try:
        return factory(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for routing policy {name!r}: {exc}") from None


def healthy_loads(loads: Sequence[WorkerLoad]) -> list[WorkerLoad]:
    """The healthy candidates as records; raises on duplicate worker ids or when none is
    healthy."""
    table = LoadTable.of(loads)
    return [table.load(int(r)) for r in table.healthy_rows()]


@register_policy("prefix_aware")
class PrefixAwarePolicy(RoutingPolicy):
    """Score = w_hit * hit_fraction - w_queue * queue / max(mean queue, queue_scale)
    - w_kv * kv_usage; highest wins, ties go to the lighter worker, then the smaller id.

    hit_fraction is the share of the prompt's full blocks the worker holds as a leading run,
    a block in its host tier counting what it saves (1 - its `host_hit_cost`);
    queue is waiting + running requests, normalized by the mean over the healthy workers so the
    penalty grows without bound on an overloaded worker. `queue_scale` keeps small absolute
    differences between nearly idle workers from outweighing a prefix hit. With the defaults a
    worker holding the whole prompt keeps it until its queue exceeds an idle worker's by twice
    the mean queue (or by 16 requests, whichever is more).
    """

    def __init__(self, w_hit: float = 1.0, w_queue: float = 0.5, w_kv: float = 0.1,
                 queue_scale: float = 8.0) -> None:
        for option, value in (("w_hit", w_hit), ("w_queue", w_queue), ("w_kv", w_kv)):
            if not value >= 0.0:
                raise ValueError(f"{option} must be >= 0, got {value}")
        if not queue_scale > 0.0:
            raise ValueError(f"queue_scale must be > 0, got {queue_scale}")
        self.w_hit, self.w_queue, self.w_kv = w_hit, w_queue, w_kv
        self.queue_scale = queue_scale

    def choose(self, block_hashes: Sequence[int], loads: Sequence[WorkerLoad],
               index: PrefixIndex) -> Decision:
        table = LoadTable.of(loads)
        rows = table.healthy_rows()
        hits = index.match_tiers(block_hashes)
        depth = table.depth(rows)
        hit = np.zeros(len(rows))
        for wid, (blocks, in_host) in hits.items():
            at = table.position(rows, wid)
            if at is not None:  # recompute saved, in blocks: a host hit costs its copy
                hit[at] = blocks - in_host * index.host_hit_cost(wid) if in_host else blocks
        queue_weight = self.w_queue / max(float(depth.sum()) / len(rows), self.queue_scale)
        score = (self.w_hit / max(len(block_hashes), 1) * hit - queue_weight * depth
                 - self.w_kv * table.kv_usage[rows])
        best = rows[score == score.max()]
        row = int(best[0]) if len(best) == 1 else table.best_by_load(best)
        wid = table.ids[row] or ""
        return Decision(wid, hits.get(wid, (0, 0))[0])


@register_policy("least_loaded")
class LeastLoadedPolicy(RoutingPolicy):
    """The worker with the fewest waiting + running requests (then fewer waiting, lower KV
    usage, smaller id). Ignores the prefix cache when choosing."""

    def choose(self, block_hashes: Sequence[int], loads: Sequence[WorkerLoad],
               index: PrefixIndex) -> Decision:
        table = LoadTable.of(loads)
        wid = table.ids[table.best_by_load(table.healthy_rows())] or ""
        return Decision(wid, index.match(block_hashes).get(wid, 0))


@register_policy("round_robin")
class RoundRobinPolicy(RoutingPolicy):
    """Healthy workers in id order, one after another: the next id after the last one chosen
    (wrapping), so workers joining or leaving do not reset the cycle. Keeps that one id as state;
    not thread-safe."""

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, block_hashes: Sequence[int], loads: Sequence[WorkerLoad],
               index: PrefixIndex) -> Decision:
        table = LoadTable.of(loads)
        ids = sorted(table.ids[r] or "" for r in table.healthy_rows().tolist())
        chosen = ids[0]
        if self._last is not None:
            chosen = next((w for w in ids if w > self._last), ids[0])
        self._last = chosen
        return Decision(chosen, index.match(block_hashes).get(chosen, 0))


__all__ = ["Decision", "LoadTable", "NoHealthyWorker", "RoutingPolicy", "WorkerLoad",
           "get_policy", "healthy_loads", "register_policy", "registered_policies"]
