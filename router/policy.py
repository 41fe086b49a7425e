"""Routing policies: pick the worker for a prompt from the prefix index and the workers' loads.

Policies are registered by name (`get_policy("prefix_aware", w_queue=0.5)`). Each takes the
prompt's chained block hashes, one `WorkerLoad` per candidate worker and the `PrefixIndex`, and
returns a `Decision`. Unhealthy workers are never chosen; with none healthy, `NoHealthyWorker`.
Decisions are deterministic for the same inputs (round robin: for the same call history).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from router.prefix_index import PrefixIndex


class NoHealthyWorker(ValueError):
    """No candidate worker is healthy (or none was given)."""


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load as last reported. `kv_usage` is the fraction of KV blocks in use, 0..1."""

    worker_id: str
    num_waiting: int  # requests queued, not yet scheduled
    num_running: int  # requests in the running batch
    kv_usage: float
    healthy: bool = True
    num_pending_prompt_tokens: int = 0  # prompt tokens queued or mid-prefill there

    def __post_init__(self) -> None:
        if self.num_waiting < 0 or self.num_running < 0:
            raise ValueError(f"worker {self.worker_id!r}: num_waiting and num_running must be "
                             f">= 0, got {self.num_waiting} and {self.num_running}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"worker {self.worker_id!r}: kv_usage must be in [0, 1], "
                             f"got {self.kv_usage}")

    @property
    def queue_depth(self) -> int:
        return self.num_waiting + self.num_running


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
    """The healthy candidates; raises on duplicate worker ids or when none is healthy."""
    seen: set[str] = set()
    for load in loads:
        if load.worker_id in seen:
            raise ValueError(f"worker {load.worker_id!r} appears twice in loads; "
                             f"expected one WorkerLoad per worker")
        seen.add(load.worker_id)
    healthy = [load for load in loads if load.healthy]
    if not healthy:
        raise NoHealthyWorker(f"no healthy worker among {sorted(seen) or 'no workers'}")
    return healthy


def _load_key(load: WorkerLoad) -> tuple[int, int, float, str]:
    return (load.queue_depth, load.num_waiting, load.kv_usage, load.worker_id)


@register_policy("prefix_aware")
class PrefixAwarePolicy(RoutingPolicy):
    """Score = w_hit * hit_fraction - w_queue * queue / max(mean queue, queue_scale)
    - w_kv * kv_usage; highest wins, ties go to the lighter worker, then the smaller id.

    hit_fraction is the share of the prompt's full blocks the worker holds as a leading run;
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
        healthy = healthy_loads(loads)
        hits = index.match(block_hashes)
        hit_weight = self.w_hit / max(len(block_hashes), 1)
        depths = [load.num_waiting + load.num_running for load in healthy]
        queue_weight = self.w_queue / max(sum(depths) / len(depths), self.queue_scale)
        best, best_key = healthy[0], None
        for load, depth in zip(healthy, depths):
            score = (hit_weight * hits.get(load.worker_id, 0) - queue_weight * depth
                     - self.w_kv * load.kv_usage)
            key = (-score, depth, load.num_waiting, load.kv_usage, load.worker_id)
            if best_key is None or key < best_key:
                best, best_key = load, key
        return Decision(best.worker_id, hits.get(best.worker_id, 0))


@register_policy("least_loaded")
class LeastLoadedPolicy(RoutingPolicy):
    """The worker with the fewest waiting + running requests (then fewer waiting, lower KV
    usage, smaller id). Ignores the prefix cache when choosing."""

    def choose(self, block_hashes: Sequence[int], loads: Sequence[WorkerLoad],
               index: PrefixIndex) -> Decision:
        best = min(healthy_loads(loads), key=_load_key)
        return Decision(best.worker_id, index.match(block_hashes).get(best.worker_id, 0))


@register_policy("round_robin")
class RoundRobinPolicy(RoutingPolicy):
    """Healthy workers in id order, one after another: the next id after the last one chosen
    (wrapping), so workers joining or leaving do not reset the cycle. Keeps that one id as state;
    not thread-safe."""

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, block_hashes: Sequence[int], loads: Sequence[WorkerLoad],
               index: PrefixIndex) -> Decision:
        ids = sorted(load.worker_id for load in healthy_loads(loads))
        chosen = ids[0]
        if self._last is not None:
            chosen = next((w for w in ids if w > self._last), ids[0])
        self._last = chosen
        return Decision(chosen, index.match(block_hashes).get(chosen, 0))
