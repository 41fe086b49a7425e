"""Routing policies: pick the worker for a prompt from the prefix index and the workers' loads.

Policies are registered by name (`get_policy("prefix_aware", w_queue=0.5)`). Each takes the
prompt's chained block hashes, the candidates' loads (a `router.loads.LoadTable`, or any
sequence of `WorkerLoad`s), the `PrefixIndex` and the LoRA adapter the request runs under
(None: the base model), and returns a `Decision`; the work per
decision is a few array operations over the candidates, not a Python step per worker.
Unhealthy workers are never chosen; with none healthy, `NoHealthyWorker`. Decisions are
deterministic for the same inputs (round robin: for the same call history).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from router.loads import LoadTable, NoHealthyWorker, WorkerLoad
from router.prefix_index import PrefixIndex
from router.registry import Registry

# `PrefixAwarePolicy.lora_load_blocks` by default (`RouterConfig.lora_load_cost_blocks`)
LORA_LOAD_BLOCKS = 16.0


@dataclass(frozen=True)
class Decision:
    worker_id: str
    predicted_hit_blocks: int  # leading prompt blocks the index says the worker holds
    # another worker whose device pool holds more of the prompt's leading blocks: the chosen
    # worker pulls the first `fetch_blocks` of them from it before computing the rest
    fetch_from: str | None = None
    fetch_blocks: int = 0


class RoutingPolicy(ABC):
    """Chooses one worker per prompt. Does not modify the index."""

    name: str
    # takes `lora_load_blocks` (`RouterConfig.lora_load_cost_blocks`): what loading an
    # adapter into a worker's slot costs in its score
    scores_adapter_loads: ClassVar[bool] = False

    @abstractmethod
    def choose(self, block_hashes: Sequence[int], loads: Sequence[WorkerLoad],
               index: PrefixIndex, lora_name: str | None = None) -> Decision:
        """The worker for a prompt whose full blocks hash to `block_hashes`, run under
        adapter `lora_name`."""


POLICY_CLASSES: Registry[type[RoutingPolicy]] = Registry("routing policy")
register_policy = POLICY_CLASSES.register


def registered_policies() -> list[str]:
    return POLICY_CLASSES.names()


def get_policy(name: str, **options: float) -> RoutingPolicy:
    """A new policy instance by registered name, with its options (see each policy's __init__)."""
    factory = POLICY_CLASSES.get(name)
    try:
        return factory(**options)
    except TypeError as exc:
        raise ValueError(f"bad options for routing policy {name!r}: {exc}") from None


def configured_policy(name: str, lora_load_blocks: float,
                      options: Sequence[tuple[str, float]] = ()) -> RoutingPolicy:
    """The policy registered as `name` with `options`, and `lora_load_blocks` when it scores
    adapter loads (`RoutingPolicy.scores_adapter_loads`)."""
    if POLICY_CLASSES.get(name).scores_adapter_loads:
        return get_policy(name, **{"lora_load_blocks": lora_load_blocks, **dict(options)})
    return get_policy(name, **dict(options))


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
    a block in its host tier counting what it saves (1 - its load's `host_hit_cost`), less
    `lora_load_blocks` on a worker that would have to load the request's LoRA adapter into a
    device slot (the adapter is not among its reported `lora_adapters` nor routed there since):
    the load is priced as that many blocks of prompt recomputed, like a fetch's fixed cost, and
    at most as the whole prompt (a full prefix hit's worth), so requests for an adapter go where
    it is held unless another worker is lighter by more than the load costs, and a holder keeps
    them no longer than a whole-prompt hit would keep them (a short prompt, whose own recompute
    is small, follows its adapter more strongly than a long one);
    queue is waiting + running requests, normalized by the mean over the healthy workers so the
    penalty grows without bound on an overloaded worker. `queue_scale` keeps small absolute
    differences between nearly idle workers from outweighing a prefix hit. With the defaults a
    worker holding the whole prompt keeps it until its queue exceeds an idle worker's by twice
    the mean queue (or by 16 requests, whichever is more).

    Prefix fetch: a worker that reports a `fetch_cost` (pulling a block from another worker as a
    fraction of recomputing it, below 1) is credited the blocks the longest device-pool holder
    has beyond its own, at 1 - that cost, when they are at least `min_fetch_blocks`; chosen so,
    the `Decision` names the holder to pull them from. So a lightly loaded worker can take a
    request without losing its prefix hit.
    """

    scores_adapter_loads = True

    def __init__(self, w_hit: float = 1.0, w_queue: float = 0.5, w_kv: float = 0.1,
                 queue_scale: float = 8.0, min_fetch_blocks: int = 4,
                 lora_load_blocks: float = LORA_LOAD_BLOCKS) -> None:
        for option, value in (("w_hit", w_hit), ("w_queue", w_queue), ("w_kv", w_kv),
                              ("lora_load_blocks", lora_load_blocks)):
            if not value >= 0.0:
                raise ValueError(f"{option} must be >= 0, got {value}")
        if not queue_scale > 0.0:
            raise ValueError(f"queue_scale must be > 0, got {queue_scale}")
        if not min_fetch_blocks >= 1:
            raise ValueError(f"min_fetch_blocks must be >= 1, got {min_fetch_blocks}")
        self.w_hit, self.w_queue, self.w_kv = w_hit, w_queue, w_kv
        self.queue_scale = queue_scale
        self.min_fetch_blocks = int(min_fetch_blocks)
        self.lora_load_blocks = lora_load_blocks

    def choose(self, block_hashes: Sequence[int], loads: Sequence[WorkerLoad],
               index: PrefixIndex, lora_name: str | None = None) -> Decision:
        table = LoadTable.of(loads)
        rows = table.healthy_rows()
        hits = index.match_tiers(block_hashes)
        depth = table.depth(rows)
        held = np.zeros(len(rows))  # leading blocks held, either tier
        in_host = np.zeros(len(rows))  # of them, in the host tier only
        for wid, (blocks, host_blocks) in hits.items():
            at = table.position(rows, wid)
            if at is not None:
                held[at], in_host[at] = blocks, host_blocks
        source, fetch = self._fetchable(block_hashes, index, table, rows, held)
        # recompute saved, in blocks: a host hit costs its copy, an adapter load its price (at
        # most the whole prompt's recompute, so a far lighter worker still wins)
        num_blocks = max(len(block_hashes), 1)
        hit = held - in_host * table.host_hit_cost[rows] + fetch
        if lora_name is not None:
            hit -= min(self.lora_load_blocks, num_blocks) * table.lacks(rows, lora_name)
        queue_weight = self.w_queue / max(float(depth.sum()) / len(rows), self.queue_scale)
        score = (self.w_hit / num_blocks * hit - queue_weight * depth
                 - self.w_kv * table.kv_usage[rows])
        best = rows[score == score.max()]
        row = int(best[0]) if len(best) == 1 else table.best_by_load(best)
        wid = table.ids[row] or ""
        own = hits.get(wid, (0, 0))[0]
        at = table.position(rows, wid)
        if source is not None and at is not None and fetch[at] > 0:
            return Decision(wid, own, source[0], source[1])
        return Decision(wid, own)

    def _fetchable(self, block_hashes: Sequence[int], index: PrefixIndex, table: LoadTable,
                   rows: np.ndarray, held: np.ndarray
                   ) -> tuple[tuple[str, int] | None, np.ndarray]:
        """The worker whose device pool holds the longest run of the prompt's leading blocks
        (and how many), and per candidate the recompute a pull from it saves, in blocks: the
        blocks it adds over the candidate's own, at 1 - the candidate's `fetch_cost`, less its
        fixed cost per fetch (0 where that is unknown, 1 or more, the gain under
        `min_fetch_blocks`, or the saving not positive)."""
        none = np.zeros(len(rows))
        costs = table.fetch_cost[rows]
        if np.isnan(costs).all():
            return None, none
        on_device = index.match_device(block_hashes)
        if not on_device:
            return None, none
        source = min(on_device.items(), key=lambda item: (-item[1], item[0]))
        extra = source[1] - held
        saved = extra * (1.0 - np.nan_to_num(costs, nan=1.0)) - table.fetch_fixed[rows]
        ok = (extra >= self.min_fetch_blocks) & (costs < 1.0) & (saved > 0)  # NaN: False
        return source, np.where(ok, saved, 0.0)


@register_policy("least_loaded")
class LeastLoadedPolicy(RoutingPolicy):
    """The worker with the fewest waiting + running requests (then one holding the request's
    LoRA adapter, fewer waiting, lower KV usage, smaller id). Ignores the prefix cache when
    choosing."""

    def choose(self, block_hashes: Sequence[int], loads: Sequence[WorkerLoad],
               index: PrefixIndex, lora_name: str | None = None) -> Decision:
        table = LoadTable.of(loads)
        rows = table.healthy_rows()
        if lora_name is not None:  # the least loaded, of them those holding the adapter
            depth = table.depth(rows)
            rows = rows[depth == depth.min()]
            holding = rows[~table.lacks(rows, lora_name)]
            rows = holding if len(holding) else rows
        wid = table.ids[table.best_by_load(rows)] or ""
        return Decision(wid, index.match(block_hashes).get(wid, 0))


@register_policy("round_robin")
class RoundRobinPolicy(RoutingPolicy):
    """Healthy workers in id order, one after another: the next id after the last one chosen
    (wrapping), so workers joining or leaving do not reset the cycle; blind to prefixes and
    adapters. Keeps that one id as state; not thread-safe."""

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, block_hashes: Sequence[int], loads: Sequence[WorkerLoad],
               index: PrefixIndex, lora_name: str | None = None) -> Decision:
        table = LoadTable.of(loads)
        ids = sorted(table.ids[r] or "" for r in table.healthy_rows().tolist())
        chosen = ids[0]
        if self._last is not None:
            chosen = next((w for w in ids if w > self._last), ids[0])
        self._last = chosen
        return Decision(chosen, index.match(block_hashes).get(chosen, 0))


__all__ = ["LORA_LOAD_BLOCKS", "Decision", "LoadTable", "NoHealthyWorker", "RoutingPolicy",
           "WorkerLoad", "configured_policy", "get_policy", "healthy_loads", "register_policy",
           "registered_policies"]
