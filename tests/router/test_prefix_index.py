"""The prefix index: what the router believes each worker caches, rebuilt from KV events."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.prefix_index import PrefixIndex
from tests.workers.factories import create_request, create_scheduler, fake_step
from workers.contract.prefix_cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVSnapshot,
    hash_prompt_blocks,
)
from workers.engine.scheduler import Scheduler


def stored(epoch: str, seq: int, *hashes: int) -> BlockStored:
    return BlockStored(epoch, seq, tuple(hashes), None, tuple(range(4 * len(hashes))), 4)


def removed(epoch: str, seq: int, *hashes: int) -> BlockRemoved:
    return BlockRemoved(epoch, seq, tuple(hashes))


def test_match_counts_leading_blocks_up_to_the_first_miss() -> None:
    index = PrefixIndex()
    index.apply("a", [stored("e", 0, 1, 2, 3, 5)])
    index.apply("b", [stored("f", 0, 1, 2)])
    index.apply("c", [stored("g", 0, 2, 3)])  # holds blocks but not the first one
    assert index.match([1, 2, 3, 4, 5]) == {"a": 3, "b": 2}
    assert index.match([1, 2]) == {"a": 2, "b": 2}
    assert index.match([9, 1, 2]) == {}
    assert index.match([]) == {}
    assert index.workers() == ["a", "b", "c"]


def test_removed_and_cleared_blocks_stop_hitting() -> None:
    index = PrefixIndex()
    index.apply("a", [stored("e", 0, 1, 2, 3), removed("e", 1, 2)])
    index.apply("b", [stored("f", 0, 1, 2, 3)])
    assert index.match([1, 2, 3]) == {"a": 1, "b": 3}
    index.apply("b", [AllBlocksCleared("f", 1)])
    assert index.match([1, 2, 3]) == {"a": 1}
    assert index.worker_blocks("a") == frozenset({1, 3})
    assert index.worker_blocks("b") == frozenset()
    index.apply("a", [removed("e", 2, 42)])  # removing an unknown hash is harmless
    assert index.worker_blocks("a") == frozenset({1, 3})


def test_duplicate_events_are_ignored() -> None:
    index = PrefixIndex()
    batch = [stored("e", 0, 1, 2), removed("e", 1, 2)]
    index.apply("a", batch)
    index.apply("a", batch)  # redelivered: would re-add 2 if applied again
    index.apply("a", [removed("e", 1, 2), stored("e", 2, 7)])
    assert index.worker_blocks("a") == frozenset({1, 7})
    assert not index.needs_resync("a")


def test_gap_marks_resync_and_a_snapshot_restores_the_stream() -> None:
    index = PrefixIndex()
    index.apply("a", [stored("e", 0, 1, 2)])
    index.apply("a", [stored("e", 2, 3), stored("e", 3, 4)])  # seq 1 went missing
    assert index.needs_resync("a")
    assert index.worker_blocks("a") == frozenset({1, 2})  # stale view kept until resync
    index.apply("a", [stored("e", 4, 5)])
    assert index.worker_blocks("a") == frozenset({1, 2})
    index.resync("a", KVSnapshot("e", 5, frozenset({1, 3, 4, 5})))
    assert not index.needs_resync("a")
    assert index.worker_blocks("a") == frozenset({1, 3, 4, 5})
    index.apply("a", [stored("e", 4, 99), removed("e", 5, 1), stored("e", 6, 6)])
    assert index.worker_blocks("a") == frozenset({3, 4, 5, 6})
    assert index.match([1, 3]) == {}


def test_new_epoch_drops_everything_known_for_the_worker() -> None:
    index = PrefixIndex()
    index.apply("a", [stored("e1", 0, 1, 2), stored("e1", 1, 3)])
    index.apply("b", [stored("f", 0, 1)])
    index.apply("a", [stored("e2", 0, 7)])
    assert index.worker_blocks("a") == frozenset({7})
    assert index.match([1]) == {"b": 1}
    index.apply("a", [stored("e1", 2, 4)])  # a late event from before the restart
    assert index.worker_blocks("a") == frozenset({7})
    assert index.needs_resync("a")  # epochs are unordered: a snapshot says which one is live
    index.resync("a", KVSnapshot("e2", 1, frozenset({7})))
    index.apply("a", [stored("e2", 1, 8)])
    assert index.worker_blocks("a") == frozenset({7, 8})


def test_new_epoch_not_starting_at_zero_needs_resync() -> None:
    index = PrefixIndex()
    index.apply("a", [stored("e1", 0, 1, 2)])
    index.apply("a", [stored("e2", 3, 5)])
    assert index.needs_resync("a")
    assert index.worker_blocks("a") == frozenset()
    index.resync("a", KVSnapshot("e2", 4, frozenset({4, 5})))
    assert index.worker_blocks("a") == frozenset({4, 5})
    # a worker first heard of mid-stream is out of sync too
    index.apply("z", [stored("q", 9, 1)])
    assert index.needs_resync("z") and index.worker_blocks("z") == frozenset()


def test_snapshot_of_a_new_epoch_replaces_the_old_one() -> None:
    index = PrefixIndex()
    index.apply("a", [stored("e1", 0, 1, 2)])
    index.resync("a", KVSnapshot("e2", 2, frozenset({8})))
    assert index.worker_blocks("a") == frozenset({8})
    index.apply("a", [stored("e2", 2, 9)])
    assert index.worker_blocks("a") == frozenset({8, 9})
    with pytest.raises(ValueError, match="next_seq"):
        index.resync("a", KVSnapshot("e2", -1, frozenset()))


def test_remove_worker_forgets_it_and_its_slot_is_reused_cleanly() -> None:
    index = PrefixIndex()
    index.apply("a", [stored("e", 0, 1, 2)])
    index.apply("b", [stored("f", 0, 1, 2)])
    index.remove_worker("a")
    index.remove_worker("a")  # idempotent
    assert index.workers() == ["b"]
    assert index.match([1, 2]) == {"b": 2}
    index.apply("c", [stored("g", 0, 5)])  # takes a's freed slot
    assert index.match([1, 2]) == {"b": 2}
    assert index.match([5]) == {"c": 1}
    assert index.worker_blocks("a") == frozenset()
    assert not index.needs_resync("a")


def test_a_block_moved_to_host_memory_still_hits_there_until_it_leaves() -> None:
    index = PrefixIndex()
    index.apply("w", [stored("e", 0, 1, 2, 3),
                      BlockStored("e", 1, (2, 3), None, (), 4, medium="host"),
                      removed("e", 2, 2, 3)])  # evicted from the device pool, saved to host
    assert index.match_tiers([1, 2, 3]) == {"w": (3, 2)}
    index.apply("w", [stored("e", 3, 2)])  # brought back: a device block again
    assert index.match_tiers([1, 2, 3]) == {"w": (3, 1)}
    index.apply("w", [BlockRemoved("e", 4, (3,), medium="host")])
    assert index.match_tiers([1, 2, 3]) == {"w": (2, 0)}
    index.apply("w", [AllBlocksCleared("e", 5)])
    assert index.match([1]) == {} and not index.worker_host_blocks("w")


def test_bad_inputs_name_what_was_expected() -> None:
    index = PrefixIndex()
    with pytest.raises(TypeError, match="BlockStored"):
        index.apply("a", [KVEvent("e", 0)])
    with pytest.raises(ValueError, match="worker_id"):
        index.apply("", [])
    with pytest.raises(ValueError, match="block_size"):
        hash_prompt_blocks([1, 2, 3], 0)


def test_importing_the_router_core_does_not_import_torch() -> None:
    code = ("import sys, router.prefix_index, router.policy; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---------------------------------------------------------------------------------------------
# Property: driven by real engine-side block pools, with lost events and restarts, the index
# ends up believing exactly what each worker's prefix cache holds.

WORKERS = ("w0", "w1", "w2")
PREFIXES = [list(range(100 * p, 100 * p + 12)) for p in range(3)]  # shared "system prompts"
OPS = st.lists(st.tuples(
    st.sampled_from(["add", "add", "add", "deliver", "deliver_lossy", "deliver_lossy", "resync",
                     "restart", "reset"]),
    st.sampled_from(WORKERS), st.integers(0, 2**16)), min_size=10, max_size=50)


def _snapshot(sched: Scheduler) -> KVSnapshot:
    events, host = sched.kv.events, sched.kv.host
    return KVSnapshot(events.epoch, events.next_seq, frozenset(sched.kv.pool.cached_hashes()),
                      frozenset(host.cached_hashes()) if host is not None else frozenset())


class _Cluster:
    """Three small engines whose event batches reach the index late, lossily or twice; with
    `host_blocks`, each keeps evicted blocks in a host tier of that size."""

    def __init__(self, host_blocks: int = 0) -> None:
        self.host_blocks = host_blocks
        self.scheds = {w: self._scheduler() for w in WORKERS}
        self.late: dict[str, list[KVEvent]] = {w: [] for w in WORKERS}
        self.index = PrefixIndex()
        self.num_requests = 0

    def add(self, worker: str, rng: random.Random) -> None:
        self.num_requests += 1
        prompt = PREFIXES[rng.randrange(3)] + [1000 + rng.randrange(8) for _ in range(
            rng.randrange(0, 9))]
        self.scheds[worker].add(create_request(f"r{self.num_requests}", prompt,
                                               max_tokens=rng.randint(1, 6)))

    def deliver(self, worker: str, rng: random.Random, lossy: bool) -> None:
        batch = self.late[worker] + self.scheds[worker].kv.events.drain()
        self.late[worker] = []
        if lossy and batch:
            del batch[rng.randrange(len(batch))]
        self.index.apply(worker, batch)
        if rng.random() < 0.3:
            self.index.apply(worker, batch)  # at-least-once delivery

    def restart(self, worker: str) -> None:
        self.late[worker] += self.scheds[worker].kv.events.drain()  # may arrive after new epoch
        self.scheds[worker] = self._scheduler()

    def _scheduler(self) -> Scheduler:
        return create_scheduler(num_blocks=12, host_blocks=self.host_blocks)

    def run(self, op: str, worker: str, rng: random.Random) -> None:
        sched = self.scheds[worker]
        if op == "add":
            self.add(worker, rng)
        elif op in ("deliver", "deliver_lossy"):
            self.deliver(worker, rng, op == "deliver_lossy")
        elif op == "resync" and self.index.needs_resync(worker):
            self.index.resync(worker, _snapshot(sched))
        elif op == "restart":
            self.restart(worker)
        elif op == "reset" and not sched.num_unfinished:
            sched.kv.reset_prefix_cache()
        for other in self.scheds.values():  # time passes: every engine takes a step
            fake_step(other)

    def settle(self) -> None:
        """Finish all work, then a probe request per worker so a lost tail shows up as a gap."""
        for worker, sched in self.scheds.items():
            while sched.num_unfinished:
                fake_step(sched)
            sched.add(create_request(f"probe-{worker}", [5000 + i for i in range(9)]))
            while sched.num_unfinished:
                fake_step(sched)
            self.index.apply(worker, self.late[worker] + sched.kv.events.drain())
            if self.index.needs_resync(worker):
                self.index.resync(worker, _snapshot(sched))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, host_blocks=st.sampled_from([0, 5]))
def test_index_matches_what_real_block_pools_hold(ops: list[tuple[str, str, int]],
                                                  host_blocks: int) -> None:
    cluster = _Cluster(host_blocks)
    for op, worker, seed in ops:
        cluster.run(op, worker, random.Random(seed))
    cluster.settle()
    index = cluster.index
    for worker, sched in cluster.scheds.items():
        assert index.worker_blocks(worker) == frozenset(sched.kv.pool.cached_hashes())
        assert index.worker_host_blocks(worker) == _snapshot(sched).host_block_hashes
        assert not index.needs_resync(worker)
    for prefix in PREFIXES:
        hashes = hash_prompt_blocks(prefix + [1000, 1001, 1002, 1003], 4)
        expected = {}
        for worker in WORKERS:
            device = index.worker_blocks(worker)
            held = device | index.worker_host_blocks(worker)
            depth = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
            if depth:
                expected[worker] = (depth, sum(1 for h in hashes[:depth] if h not in device))
        assert index.match_tiers(hashes) == expected
        assert index.match(hashes) == {w: depth for w, (depth, _) in expected.items()}
