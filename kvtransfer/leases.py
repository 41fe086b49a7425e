"""Leases on a source's blocks: pinned from `grant` until released, cancelled or expired.

A lease ends exactly once, and ending calls the worker's `on_release(block_ids)` so it frees
them. It ends when:
- every expected reader has finished a pull (completed, failed or abandoned: a pull consumes its
  reader however it ends, so a crashed puller never strands blocks);
- `release(lease_id)` or `cancel(request_id)` is called (idempotent);
- its deadline passes with no read in progress (a read in progress holds it until the read
  ends, so blocks are never freed under a transfer). Expiry is the backstop, not the normal path.

Not thread-safe: call from the agent's event loop. The table holds no timers itself; the agent
schedules `expire(lease_id)` at the deadline.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence

from kvtransfer.errors import LeaseExpired

logger = logging.getLogger(__name__)

ReleaseCallback = Callable[[Sequence[int]], None]


@dataclass
class Lease:
    lease_id: str
    request_id: str
    block_ids: tuple[int, ...]
    deadline: float  # time.monotonic() seconds
    readers_left: int  # pulls still expected
    active_reads: int = 0
    expired: bool = field(default=False)


class LeaseTable:
    def __init__(self, on_release: ReleaseCallback,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._on_release = on_release
        self._clock = clock
        self._leases: dict[str, Lease] = {}

    def grant(self, request_id: str, block_ids: Sequence[int], lease_s: float,
              readers: int = 1, lease_id: str | None = None) -> Lease:
        """A new lease; `lease_id` (default: a fresh one) when the caller minted it (a remote
        driver that returned the handoff before the host granted it)."""
        if not lease_s > 0:
            raise ValueError(f"lease_s = {lease_s!r}; expected seconds > 0")
        if readers < 1:
            raise ValueError(f"readers = {readers!r}; expected at least one puller")
        if lease_id is not None and (not lease_id or lease_id in self._leases):
            raise ValueError(f"lease id {lease_id!r} is empty or already held; expected a new "
                             "one")
        lease = Lease(lease_id or uuid.uuid4().hex, request_id, tuple(block_ids),
                      self._clock() + lease_s, readers)
        self._leases[lease.lease_id] = lease
        return lease

    def readable(self, lease_id: str) -> Lease:
        """The lease, if a pull may begin on it now; raises `LeaseExpired` (naming it) if it is
        gone or past its deadline (ending it then). Pins nothing."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseExpired(f"lease {lease_id!r} is not held: released, cancelled, expired "
                               "or never granted by this source", (lease_id,))
        if lease.expired or self._clock() > lease.deadline:
            self._end(lease, "expired")
            raise LeaseExpired(f"lease {lease_id!r} of request {lease.request_id!r} expired",
                               (lease_id,))
        return lease

    def begin_read(self, lease_id: str) -> Lease:
        """Pin a lease for one pull; raises `LeaseExpired` if it is gone or past its deadline."""
        lease = self.readable(lease_id)
        lease.active_reads += 1
        return lease

    def end_read(self, lease_id: str) -> None:
        """One pull is over, however it ended: it no longer pins the lease and uses a reader."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return
        lease.active_reads -= 1
        lease.readers_left -= 1
        if lease.readers_left <= 0:
            self._end(lease, "read")
        elif lease.active_reads == 0 and (lease.expired or self._clock() > lease.deadline):
            self._end(lease, "expired")

    def release(self, lease_id: str) -> bool:
        """End a lease now. False (and harmless) when it already ended."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        self._end(lease, "released")
        return True

    def cancel(self, request_id: str) -> int:
        """End every lease of a request (the client went away); returns how many ended."""
        leases = [le for le in self._leases.values() if le.request_id == request_id]
        for lease in leases:
            self._end(lease, "cancelled")
        return len(leases)

    def expire(self, lease_id: str) -> None:
        """The deadline timer fired: end the lease unless a read is in progress."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return
        lease.expired = True
        if lease.active_reads == 0:
            self._end(lease, "expired")

    def release_all(self) -> None:
        for lease in list(self._leases.values()):
            self._end(lease, "closed")

    def holds(self, lease_id: str) -> bool:
        return lease_id in self._leases

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(le.block_ids) for le in self._leases.values())

    def _end(self, lease: Lease, why: str) -> None:
        if self._leases.pop(lease.lease_id, None) is None:
            return
        logger.debug("lease %s of %s ended (%s): %d blocks", lease.lease_id, lease.request_id,
                     why, len(lease.block_ids))
        try:
            self._on_release(lease.block_ids)
        except Exception:  # the worker's bug must not leave the table inconsistent
            logger.exception("on_release failed for lease %s", lease.lease_id)
