"""A live migration's prepared blocks on the target expire only while no continuation took
them: a request moved to the same worker twice within the hold time keeps the second move's
blocks when the first prepare's timer fires during the second continuation (they are held
under the same ids). On fakes: the engine, the KV ledger and the transfer are scripted."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from workers.serving.migration import Migrations, hold_id


class Ledger:
    """Blocks held by id; what was freed, and what a continuation adopted."""

    def __init__(self) -> None:
        self.held: dict[str, list[int]] = {}
        self.freed: list[str] = []
        self.adopted: list[str] = []

    def reserve_prefix(self, hid: str, num_blocks: int) -> list[int]:
        self.held[hid] = list(range(num_blocks))
        return self.held[hid]

    def free_held(self, hid: str) -> None:
        if self.held.pop(hid, None) is not None:
            self.freed.append(hid)


class Engine:
    async def apply(self, fn):
        return fn()

    def apply_soon(self, fn) -> None:
        fn()


class Connector:
    """The async connector: a continuation adopts its held blocks after `adopt_after_s`."""

    def __init__(self, ledger: Ledger, adopt_after_s: float) -> None:
        self.engine, self.connector, self.ledger = Engine(), ledger, ledger
        self.adopt_after_s = adopt_after_s

    async def continue_with_kv(self, req, samples, pull, sink) -> None:
        await asyncio.sleep(self.adopt_after_s)  # the step that adopts is still to come
        for s in samples:
            assert s.hold_id in self.ledger.held, f"{s.hold_id} was freed before adoption"
            self.ledger.adopted.append(s.hold_id)
            del self.ledger.held[s.hold_id]


class Transfer:
    async def puller(self, hid, handoff):
        async def pull(block_ids) -> None:
            return None
        return pull


def handoff(num_blocks: int = 2):
    return SimpleNamespace(ranks=[SimpleNamespace(block_ids=list(range(num_blocks)))])


def resume(rid: str):
    kv = SimpleNamespace(handoff=handoff(), num_kv_tokens=32, num_landed_blocks=2)
    return SimpleNamespace(req=SimpleNamespace(request_id=rid),
                           samples=[SimpleNamespace(index=0, sent_token_ids=(1,), kv=kv)])


def test_an_earlier_prepares_timer_does_not_free_a_later_moves_blocks():
    async def main() -> Ledger:
        ledger = Ledger()
        moves = Migrations(Connector(ledger, adopt_after_s=0.3), Transfer())
        await moves.prepare("r1", {0: handoff()}, hold_s=0.2)  # first move: its timer at 0.2 s
        await moves.continue_(resume("r1"), sink=None)  # taken at 0.3 s
        await moves.prepare("r1", {0: handoff()}, hold_s=10.0)  # moved here again
        await moves.continue_(resume("r1"), sink=None)  # the first timer fires meanwhile
        return ledger

    ledger = asyncio.run(asyncio.wait_for(main(), 10))
    assert ledger.freed == [] and ledger.adopted == [hold_id("r1", 0)] * 2


def test_prepared_blocks_no_continuation_takes_are_freed_when_the_hold_ends():
    async def main() -> Ledger:
        ledger = Ledger()
        moves = Migrations(Connector(ledger, adopt_after_s=0.0), Transfer())
        await moves.prepare("r2", {0: handoff()}, hold_s=0.05)
        await asyncio.sleep(0.2)
        return ledger

    assert asyncio.run(main()).freed == [hold_id("r2", 0)]


def test_a_pause_that_fails_ends_the_first_steps_offers_and_forgets_them():
    """Step 1 offered the running request's blocks; its pause then fails (the request ended,
    or the caller gave up): the offers' leases end at once and nothing of it is kept."""
    class Running(Ledger):
        engine = SimpleNamespace(config=SimpleNamespace(block_size=16))

        def export_running(self, rid, hold):
            return {0: self.reserve_prefix(hold(0), 2)}

    class Source(Connector):
        async def pause(self, rid, reason):
            raise asyncio.CancelledError

    class Offers(Transfer):
        cancelled: list[str] = []

        async def agents(self) -> None:
            return None

        def offer(self, hid, block_ids, reader_tp_size):
            return SimpleNamespace(hid=hid)

        def cancel(self, hid) -> None:
            self.cancelled.append(hid)

    class UndoEngine(Engine):
        async def apply(self, fn, undo=None):
            return fn()

    async def main() -> tuple[Migrations, Offers]:
        source = Source(Running(), adopt_after_s=0.0)
        source.engine = UndoEngine()
        offers = Offers()
        moves = Migrations(source, offers)
        moves.commands = source
        await moves.export("r3", reader_tp_size=1)
        try:
            await moves.pause("r3", reader_tp_size=1)
        except asyncio.CancelledError:
            pass
        return moves, offers

    moves, offers = asyncio.run(main())
    assert offers.cancelled == [hold_id("r3", 0)] and moves._exported == {}
