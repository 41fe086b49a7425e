"""What crosses worker boundaries about KV: the cache layout and the handoff records. Imports
only the standard library, so the router can carry and size a handoff without torch.

Every record is a frozen dataclass that checks itself on construction, so a record decoded from
the wire (`Handoff.from_json`) or unpickled is valid or raises `InvalidDescriptor` naming the bad
field. Whether two valid layouts can transfer is `check_transferable`, run by both sides before
any byte moves.

The engine's per-layer cache tensor is `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 keys, 1 values), contiguous: `MemoryOrder.KV_BLOCK_TOKEN_HEAD_DIM`. `KVHandoff` is the
whole prefill->decode payload: one `Handoff` per prefill TP rank, versioned.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, Sequence

from kvtransfer.errors import InvalidDescriptor, LayoutMismatch

# bytes per element of each transferable KV dtype, by its torch name (`torch.<name>`)
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
    "uint8": 1,
}

# the `KVHandoff` format this code writes and reads; bump when a field changes meaning
HANDOFF_VERSION = 1


class MemoryOrder(str, Enum):
    KV_BLOCK_TOKEN_HEAD_DIM = "kv,block,token,head,dim"  # [2, num_blocks, block_size, H, D]


class CacheTensor(Protocol):
    """What the layout checks read of a cache tensor (a `torch.Tensor`, without importing torch)."""

    shape: Any
    dtype: Any

    def dim(self) -> int: ...

    def is_contiguous(self) -> bool: ...


def _check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidDescriptor(f"{owner}.{name} = {value!r}; expected an int >= {minimum}")


def _dtype_name(dtype: Any) -> str:
    """`torch.bfloat16` -> "bfloat16", if transferable."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise InvalidDescriptor(f"KV dtype {dtype} is not transferable; expected one of "
                                f"{sorted(DTYPE_SIZES)}")
    return name


@dataclass(frozen=True)
class KVLayout:
    """One worker rank's KV cache: which heads it holds and how its bytes are laid out."""

    num_layers: int
    num_kv_heads: int  # heads on this rank: total KV heads // tp_size
    head_dim: int  # elements per head
    block_size: int  # tokens per block
    dtype: str  # a key of DTYPE_SIZES, e.g. "bfloat16"
    tp_rank: int = 0
    tp_size: int = 1
    memory_order: MemoryOrder = MemoryOrder.KV_BLOCK_TOKEN_HEAD_DIM

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            _check_int("KVLayout", name, getattr(self, name), 1)
        _check_int("KVLayout", "tp_rank", self.tp_rank, 0)
        if self.tp_rank >= self.tp_size:
            raise InvalidDescriptor(f"KVLayout.tp_rank = {self.tp_rank}; expected < tp_size "
                                    f"{self.tp_size}")
        if self.dtype not in DTYPE_SIZES:
            raise InvalidDescriptor(f"KVLayout.dtype = {self.dtype!r}; expected one of "
                                    f"{sorted(DTYPE_SIZES)}")
        try:
            object.__setattr__(self, "memory_order", MemoryOrder(self.memory_order))
        except ValueError:
            raise InvalidDescriptor(f"KVLayout.memory_order = {self.memory_order!r}; expected "
                                    f"one of {[m.value for m in MemoryOrder]}") from None

    @classmethod
    def from_caches(cls, caches: Sequence[CacheTensor], *, tp_rank: int = 0,
                    tp_size: int = 1) -> KVLayout:
        """The layout of per-layer tensors `[2, num_blocks, block_size, heads, head_dim]`."""
        if not caches:
            raise InvalidDescriptor("no KV cache tensors given; expected one per layer")
        two, _, block_size, heads, head_dim = _shape5(caches[0])
        return cls(len(caches), heads, head_dim, block_size, _dtype_name(caches[0].dtype),
                   tp_rank, tp_size)

    @property
    def total_kv_heads(self) -> int:
        return self.num_kv_heads * self.tp_size

    @property
    def head_start(self) -> int:
        """The global index of this rank's first KV head."""
        return self.tp_rank * self.num_kv_heads

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of one layer, keys and values."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]

    def check_caches(self, caches: Sequence[CacheTensor]) -> int:
        """Raise `LayoutMismatch` unless `caches` hold this layout; returns their block count."""
        if len(caches) != self.num_layers:
            raise LayoutMismatch(f"{len(caches)} cache tensors; layout expects {self.num_layers}")
        first = _shape5(caches[0])
        for i, t in enumerate(caches):
            shape = _shape5(t)
            expected = (2, first[1], self.block_size, self.num_kv_heads, self.head_dim)
            same_dtype = str(t.dtype) == f"torch.{self.dtype}"
            if shape != expected or not same_dtype or not t.is_contiguous():
                raise LayoutMismatch(
                    f"layer {i} cache is {tuple(t.shape)} {t.dtype} (contiguous="
                    f"{t.is_contiguous()}); layout expects contiguous {expected} {self.dtype}")
        return first[1]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["memory_order"] = self.memory_order.value
        return d

    @classmethod
    def from_dict(cls, d: Any) -> KVLayout:
        return _construct(cls, d)


def _shape5(t: CacheTensor) -> tuple[int, ...]:
    if t.dim() != 5 or t.shape[0] != 2:
        raise LayoutMismatch(f"KV cache tensor of shape {tuple(t.shape)}; expected "
                             "[2, num_blocks, block_size, num_kv_heads, head_dim]")
    return tuple(t.shape)


def check_transferable(src: KVLayout, dst: KVLayout) -> None:
    """Raise `LayoutMismatch` naming every field that differs, unless `src` blocks can land in
    `dst` blocks (tensor-parallel sizes may differ: heads are resharded)."""
    diffs = [f"{name} {getattr(src, name)!r} vs {getattr(dst, name)!r}"
             for name in ("num_layers", "head_dim", "block_size", "dtype", "total_kv_heads",
                          "memory_order") if getattr(src, name) != getattr(dst, name)]
    if diffs:
        raise LayoutMismatch("source and destination KV layouts differ (source vs destination): "
                             + "; ".join(diffs))


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
    TP rank (ranks 0..tp_size-1, each once, same request, same block count). Crosses the router
    by pickle; a reader refuses a `version` other than `HANDOFF_VERSION`."""

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


def _construct(cls: type, d: Any) -> Any:
    """Build a descriptor from a decoded dict, naming missing and unknown fields."""
    if not isinstance(d, dict):
        raise InvalidDescriptor(f"{cls.__name__} record is {type(d).__name__}; expected an object")
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing, unknown = required - d.keys(), d.keys() - names
    if missing or unknown:
        raise InvalidDescriptor(f"{cls.__name__} record has missing fields {sorted(missing)} and "
                                f"unknown fields {sorted(unknown)}; expected {sorted(names)}")
    return cls(**d)
