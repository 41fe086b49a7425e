"""The KV event stream: what entered and left the prefix cache, in order, without gaps."""

from __future__ import annotations

import uuid

from workers.contract.prefix_cache import (
    DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)


class KVEventLog:
    """Numbers events 0, 1, 2, ... under an epoch that is new for every engine start.

    Events accumulate until `drain()`; a consumer that sees a gap in `seq` or a new epoch must
    rebuild its view of this worker from scratch.
    """

    def __init__(self, block_size: int, enabled: bool = True) -> None:
        self.epoch = uuid.uuid4().hex
        self.block_size = block_size
        self.enabled = enabled
        self._next_seq = 0
        self._pending: list[KVEvent] = []

    def _seq(self) -> int:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        return seq

    def stored(self, hashes: list[int], parent: int | None, token_ids: list[int],
               medium: str = DEVICE) -> None:
        if self.enabled and hashes:
            self._pending.append(BlockStored(self.epoch, self._seq(), tuple(hashes), parent,
                                             tuple(token_ids), self.block_size, medium))

    def removed(self, hashes: list[int], medium: str = DEVICE) -> None:
        if self.enabled and hashes:
            self._pending.append(BlockRemoved(self.epoch, self._seq(), tuple(hashes), medium))

    def cleared(self) -> None:
        if self.enabled:
            self._pending.append(AllBlocksCleared(self.epoch, self._seq()))

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def drain(self) -> list[KVEvent]:
        events, self._pending = self._pending, []
        return events
