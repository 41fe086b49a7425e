"""What crosses worker boundaries about KV: the handoff records, with the cache layout they
carry (`kvtransfer.layout`). Imports only the standard library, so the router can carry and size
a handoff without torch.

Every record is a frozen dataclass that checks itself on construction, so a record decoded from
the wire (`Handoff.from_json`) or unpickled is valid or raises `InvalidDescriptor` naming the bad
field. Whether two valid layouts can transfer is `check_transferable`, run by both sides before
any byte moves. `KVHandoff` is the whole prefill->decode payload: one `Handoff` per prefill TP
rank (one in all for a latent cache, which every rank holds whole), versioned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvtransfer.errors import InvalidDescriptor
from kvtransfer.layout import (  # noqa: F401 (re-exported: the records' one import)
    DTYPE_SIZES,
    LAYOUT_KINDS,
    CacheTensor,
    KVLayout,
    MemoryOrder,
    _check_int,
    _construct,
    check_transferable,
)

# the `KVHandoff` format this code writes and reads; bump when a field changes meaning
HANDOFF_VERSION = 1


@dataclass(frozen=True)
class Handoff:
    """Where one source rank holds a request's KV, under a lease, for a puller to fetch.

    A prefill worker at TP=p makes p of these (one per rank); a decode rank pulls from those
    whose heads it needs. `expires_at` is the source's wall clock (seconds since the epoch).
    """

    request_id: str
    address: str  # the source agent's transport address, e.g. "tcp://10.0.0.5:41000"
    layout: KVLayout
    block_ids: tuple[int, ...]  # source block ids in token order
    lease_id: str
    expires_at: float

    def __post_init__(self) -> None:
        for name in ("request_id", "address", "lease_id"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise InvalidDescriptor(f"Handoff.{name} = {getattr(self, name)!r}; expected a "
                                        "non-empty string")
        if isinstance(self.layout, dict):
            object.__setattr__(self, "layout", KVLayout.from_dict(self.layout))
        if not isinstance(self.layout, KVLayout):
            raise InvalidDescriptor(f"Handoff.layout = {self.layout!r}; expected a KVLayout")
        if not isinstance(self.block_ids, (list, tuple)) or not self.block_ids:
            raise InvalidDescriptor(f"Handoff.block_ids = {self.block_ids!r}; expected a "
                                    "non-empty sequence of block ids")
        object.__setattr__(self, "block_ids", tuple(self.block_ids))
        for b in self.block_ids:
            _check_int("Handoff", "block_ids[]", b, 0)
        if not isinstance(self.expires_at, (int, float)) or isinstance(self.expires_at, bool):
            raise InvalidDescriptor(f"Handoff.expires_at = {self.expires_at!r}; expected "
                                    "seconds since the epoch")

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def num_bytes(self) -> int:
        """Bytes this rank's lease holds: every layer, keys and values, this rank's heads."""
        return self.num_blocks * self.layout.num_layers * self.layout.bytes_per_block

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "address": self.address,
                "layout": self.layout.to_dict(), "block_ids": list(self.block_ids),
                "lease_id": self.lease_id, "expires_at": self.expires_at}

    @classmethod
    def from_dict(cls, d: Any) -> Handoff:
        return _construct(cls, d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Handoff:
        try:
            d = json.loads(text)
        except ValueError as e:
            raise InvalidDescriptor(f"handoff record is not JSON: {e}") from None
        return cls.from_dict(d)


@dataclass(frozen=True)
class KVHandoff:
    """A request's prefilled KV, offered for a decode worker to pull: one `Handoff` per prefill
    TP rank (ranks 0..tp_size-1, each once, same request, same block count; a latent cache: one
    `Handoff` in all). Crosses the router by pickle; a reader refuses a `version` other than
    `HANDOFF_VERSION`."""

    ranks: tuple[Handoff, ...]  # in any order; each holds its rank's heads of every block
    version: int = HANDOFF_VERSION

    def __post_init__(self) -> None:
        if self.version != HANDOFF_VERSION:
            raise InvalidDescriptor(
                f"KVHandoff.version = {self.version!r}: this worker reads only version "
                f"{HANDOFF_VERSION}; the prefill and decode workers run different Cleave versions")
        if not isinstance(self.ranks, (list, tuple)) or not self.ranks:
            raise InvalidDescriptor(f"KVHandoff.ranks = {self.ranks!r}; expected a non-empty "
                                    "sequence of Handoff, one per prefill TP rank")
        object.__setattr__(self, "ranks", tuple(self.ranks))
        for h in self.ranks:
            if not isinstance(h, Handoff):
                raise InvalidDescriptor(f"KVHandoff.ranks holds {type(h).__name__}; expected "
                                        "Handoff")
        self._check_ranks_agree()

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling checks the record too (pickle skips `__init__`), the version first."""
        self.__dict__.update(state)
        self.__post_init__()

    def _check_ranks_agree(self) -> None:
        ids = sorted({h.request_id for h in self.ranks})
        if len(ids) > 1:
            raise InvalidDescriptor(f"KVHandoff.ranks name request ids {ids}; expected one "
                                    "request")
        counts = sorted({h.num_blocks for h in self.ranks})
        if len(counts) > 1:
            raise InvalidDescriptor(f"KVHandoff.ranks hold block counts {counts}; expected the "
                                    "same blocks on every rank")
        tp_sizes = sorted({h.layout.tp_size for h in self.ranks})
        tp_ranks = sorted(h.layout.tp_rank for h in self.ranks)
        if all(h.layout.kind == "latent" for h in self.ranks):  # whole on any one rank
            if len(self.ranks) != 1:
                raise InvalidDescriptor(f"KVHandoff.ranks holds {len(self.ranks)} latent "
                                        "handoffs; expected one (every rank holds it whole)")
            return
        if len(tp_sizes) > 1 or tp_ranks != list(range(tp_sizes[0])):
            raise InvalidDescriptor(f"KVHandoff.ranks are tp_ranks {tp_ranks} of tp_sizes "
                                    f"{tp_sizes}; expected each rank of one TP group once")

    @property
    def request_id(self) -> str:
        return self.ranks[0].request_id

    @property
    def num_blocks(self) -> int:
        """Blocks of the request (every rank holds its heads of the same blocks)."""
        return self.ranks[0].num_blocks

    @property
    def num_bytes(self) -> int:
        """Bytes a pull moves: every rank's heads of every block, every layer, keys and values."""
        return sum(h.num_bytes for h in self.ranks)
