"""Leases: every path ends a lease exactly once and frees its blocks."""

from __future__ import annotations

import pytest

from kvtransfer import LeaseExpired
from kvtransfer.leases import LeaseTable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_table() -> tuple[LeaseTable, list[tuple[int, ...]], Clock]:
    freed: list[tuple[int, ...]] = []
    clock = Clock()
    return LeaseTable(lambda ids: freed.append(tuple(ids)), clock), freed, clock


def test_release_twice_is_harmless() -> None:
    table, freed, _ = make_table()
    lease = table.grant("r", [1, 2], lease_s=10)
    assert table.release(lease.lease_id) is True
    assert table.release(lease.lease_id) is False
    assert freed == [(1, 2)] and table.num_held_blocks == 0


def test_cancel_releases_every_lease_of_the_request_at_once() -> None:
    table, freed, _ = make_table()
    table.grant("r", [1], lease_s=10)
    table.grant("r", [2], lease_s=10)
    table.grant("other", [3], lease_s=10)
    assert table.cancel("r") == 2
    assert sorted(freed) == [(1,), (2,)] and table.num_leases == 1


def test_expiry_frees_unless_a_read_is_in_progress() -> None:
    table, freed, clock = make_table()
    idle = table.grant("a", [1], lease_s=1)
    busy = table.grant("b", [2], lease_s=1, readers=2)
    table.begin_read(busy.lease_id)
    clock.now = 2
    table.expire(idle.lease_id)
    table.expire(busy.lease_id)
    assert freed == [(1,)]  # the read in progress pins [2]
    table.end_read(busy.lease_id)
    assert freed == [(1,), (2,)]
    with pytest.raises(LeaseExpired):
        table.begin_read(idle.lease_id)


def test_a_lease_ends_when_every_reader_has_finished() -> None:
    table, freed, _ = make_table()
    lease = table.grant("r", [4, 5], lease_s=10, readers=2)
    for _ in range(2):
        table.begin_read(lease.lease_id)
        table.end_read(lease.lease_id)
    assert freed == [(4, 5)]
    table.end_read(lease.lease_id)  # a late duplicate end is harmless
    assert freed == [(4, 5)]


def test_a_read_after_the_deadline_is_refused_and_frees() -> None:
    table, freed, clock = make_table()
    lease = table.grant("r", [7], lease_s=1)
    clock.now = 5  # the timer has not fired yet
    with pytest.raises(LeaseExpired, match="expired"):
        table.begin_read(lease.lease_id)
    assert freed == [(7,)]


def test_bad_grants_are_refused() -> None:
    table, _, _ = make_table()
    with pytest.raises(ValueError, match="lease_s"):
        table.grant("r", [1], lease_s=0)
    with pytest.raises(ValueError, match="readers"):
        table.grant("r", [1], lease_s=1, readers=0)
