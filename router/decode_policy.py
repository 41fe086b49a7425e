""""Which decode worker": the worker a disaggregated request's handoff goes to. Torch-free.

`RouterConfig.decode_policy` names a routing policy (`router.policy`: `least_loaded` by
default, `round_robin`, `prefix_aware`) that chooses over the decode pool, given the request's
LoRA adapter as the prefill pick is: `least_loaded` prefers a worker holding it among the least
loaded, `prefix_aware` charges the others `RouterConfig.lora_load_cost_blocks`. Each choice counts
as a request waiting on its worker from the moment it is made (`DecodePick`) until it is
released: when the handoff is sent there (from then on the worker set counts it, until the
worker reports it), or when it will not be (the prefill failed, the request ran elsewhere).
So the requests of a burst, all choosing before any prefill returns, spread over the pool
instead of all seeing the same idle worker.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.loads import LoadTable, WorkerLoad
from router.policy import RoutingPolicy, get_policy
from router.prefix_index import PrefixIndex


class DecodePick:
    """One request's decode worker, counted against it until `release()` (idempotent)."""

    def __init__(self, policy: DecodePolicy, worker_id: str) -> None:
        self.worker_id = worker_id
        self._policy: DecodePolicy | None = policy

    def release(self) -> None:
        if self._policy is not None:
            self._policy._release(self.worker_id)
            self._policy = None


class DecodePolicy:
    """A routing policy choosing decode workers, its picks counted until released. Event-loop
    thread only."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.policy = policy
        self._pending: dict[str, int] = {}  # worker id -> picks not yet released

    @property
    def name(self) -> str:
        return self.policy.name

    def pending(self, worker_id: str) -> int:
        """Picks of `worker_id` not yet released."""
        return self._pending.get(worker_id, 0)

    def pick(self, block_hashes: Sequence[int], loads: Sequence[WorkerLoad],
             index: PrefixIndex, lora_name: str | None = None) -> DecodePick:
        """The decode worker for a prompt run under adapter `lora_name`, chosen on `loads`
        plus the unreleased picks (as waiting requests), and counted from now. Raises
        `NoHealthyWorker`."""
        decision = self.policy.choose(block_hashes, self._counted(LoadTable.of(loads)), index,
                                      lora_name)
        wid = decision.worker_id
        self._pending[wid] = self._pending.get(wid, 0) + 1
        return DecodePick(self, wid)

    def _release(self, worker_id: str) -> None:
        left = self._pending.get(worker_id, 0) - 1
        if left > 0:
            self._pending[worker_id] = left
        else:
            self._pending.pop(worker_id, None)

    def _counted(self, table: LoadTable) -> LoadTable:
        """`table` with each unreleased pick a waiting request of its worker (a copy of the
        waiting column; the others are shared)."""
        if not self._pending:
            return table
        counted = table.select(table.rows)
        counted.waiting = table.waiting.copy()
        for wid, n in self._pending.items():
            counted.waiting[table.rows_of([wid])] += n
        return counted


def get_decode_policy(name: str, **options: float) -> DecodePolicy:
    """The decode policy choosing with the routing policy registered as `name`."""
    return DecodePolicy(get_policy(name, **options))


__all__ = ["DecodePick", "DecodePolicy", "get_decode_policy"]
