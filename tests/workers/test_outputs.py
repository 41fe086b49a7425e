"""A worker's output channel: every router reads every KV event once, one message carries a
step's events for all of a router's requests, fast steps are merged, and a router that went
away has its requests aborted."""

from __future__ import annotations

import asyncio
import time

from workers.engine.outputs import KVEventLog, OutputHub
from workers.contract.protocol import (
    EngineStats,
    FinishReason,
    InvalidRequestError,
    TokenEvent,
)
from workers.contract.prefix_cache import BlockRemoved, BlockStored

STATS = EngineStats(0, 1, 0.5, 10, 0, 20)


def _stored(seq: int) -> BlockStored:
    return BlockStored(epoch="e1", seq=seq, block_hashes=(seq,), parent_hash=None,
                       token_ids=(seq,), block_size=1)


def _event(rid: str, token: int, last: bool = False) -> TokenEvent:
    return TokenEvent(rid, 0, [token], "", finish_reason=FinishReason.LENGTH if last else None)


def test_every_router_replica_reads_every_kv_event_once():
    log = KVEventLog(size=4)
    log.extend([_stored(0), _stored(1)])
    assert [e.seq for e in log.read("router-a")] == [0, 1]
    log.extend([_stored(2)])
    assert [e.seq for e in log.read("router-a")] == [2]
    assert [e.seq for e in log.read("router-b")] == [0, 1, 2]  # a new reader starts at the oldest
    log.extend([_stored(3), BlockRemoved(epoch="e1", seq=4, block_hashes=(0,))])
    assert [e.seq for e in log.read("router-a")] == [3, 4]
    assert [e.seq for e in log.read("router-b")] == [3, 4]
    assert log.read("router-a") == ()


def test_a_router_that_falls_behind_the_log_sees_a_sequence_gap():
    """The gap makes its prefix index resync from the worker's snapshot."""
    log = KVEventLog(size=4)
    log.extend([_stored(0)])
    assert [e.seq for e in log.read("slow")] == [0]
    log.extend([_stored(seq) for seq in range(1, 8)])  # 7 more: only 4..7 are kept
    assert [e.seq for e in log.read("slow")] == [4, 5, 6, 7]


def test_one_message_carries_a_step_for_all_of_a_routers_requests():
    async def go():
        hub = OutputHub(lambda: STATS, lambda rid: None)
        a = hub.outbox("router-a")
        hub.outbox("router-b")  # another router: it reads the same KV events, none of a's
        a.put(_event("r1", 5))
        a.put(_event("r2", 6))
        a.fail("r3", InvalidRequestError("bad prompt", param="prompt"))
        a.flush()
        hub.publish([_stored(0)])
        out = await asyncio.wait_for(hub.next_outputs("router-a", 5.0), 1.0)
        assert [(e.request_id, e.token_ids) for e in out.events] == [("r1", [5]), ("r2", [6])]
        assert out.failures[0].to_exception().param == "prompt"
        assert [e.seq for e in out.kv_events] == [0] and out.stats == STATS
        out_b = await asyncio.wait_for(hub.next_outputs("router-b", 5.0), 1.0)
        assert out_b.events == () and [e.seq for e in out_b.kv_events] == [0]
        started = time.monotonic()  # nothing new: a heartbeat after the timeout
        beat = await hub.next_outputs("router-a", 0.05)
        assert beat.events == () and time.monotonic() - started >= 0.05

    asyncio.run(go())


def test_steps_faster_than_the_interval_are_merged_into_one_message():
    async def go():
        hub = OutputHub(lambda: STATS, lambda rid: None)
        box = hub.outbox("r")
        box.put(_event("x", 1))
        box.flush()
        await hub.next_outputs("r", 1.0, min_interval_s=0.05)

        async def steps() -> None:
            for token in range(2, 6):
                box.put(_event("x", token))
                box.flush()
                await asyncio.sleep(0.005)

        stepping = asyncio.ensure_future(steps())
        out = await hub.next_outputs("r", 1.0, min_interval_s=0.05)
        await stepping
        rest = await hub.next_outputs("r", 0.01)
        tokens = [t for e in out.events + rest.events for t in e.token_ids]
        assert tokens == [2, 3, 4, 5] and len(out.events) >= 3  # merged, none lost

    asyncio.run(go())


def test_a_router_that_stops_reading_has_its_requests_aborted():
    async def go():
        aborted: list[str] = []
        hub = OutputHub(lambda: STATS, aborted.append)
        gone = hub.outbox("gone")
        gone.samples_left.update({"a": 1, "b": 2})
        gone.put(_event("a", 1, last=True))  # finished: nothing to abort
        gone.last_read -= 60.0
        await hub.next_outputs("alive", 0.0)
        assert aborted == ["b"]

    asyncio.run(go())
