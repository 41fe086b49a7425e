"""What crosses worker boundaries about KV: the cache layout and the handoff record.

Both are frozen dataclasses that check themselves on construction, so a record decoded from the
wire (`Handoff.from_json`) is valid or raises `InvalidDescriptor` naming the bad field. Whether two
valid layouts can transfer is `check_transferable`, run by both sides before any byte moves.

The engine's per-layer cache tensor is `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 keys, 1 values), contiguous: `MemoryOrder.KV_BLOCK_TOKEN_HEAD_DIM`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from enum import Enum
from typing import Any, Sequence

import torch

from kvtransfer.errors import InvalidDescriptor, LayoutMismatch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "int8": torch.int8,
    "uint8": torch.uint8,
}


class MemoryOrder(str, Enum):
    KV_BLOCK_TOKEN_HEAD_DIM = "kv,block,token,head,dim"  # [2, num_blocks, block_size, H, D]


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise InvalidDescriptor(f"KV dtype {dtype} is not transferable; expected one of "
                            f"{sorted(DTYPES)}")


def _check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidDescriptor(f"{owner}.{name} = {value!r}; expected an int >= {minimum}")


@dataclass(frozen=True)
class KVLayout:
    """One worker rank's KV cache: which heads it holds and how its bytes are laid out."""

    num_layers: int
    num_kv_heads: int  # heads on this rank: total KV heads // tp_size
    head_dim: int  # elements per head
    block_size: int  # tokens per block
    dtype: str  # a key of DTYPES, e.g. "bfloat16"
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
        if self.dtype not in DTYPES:
            raise InvalidDescriptor(f"KVLayout.dtype = {self.dtype!r}; expected one of "
                                    f"{sorted(DTYPES)}")
        try:
            object.__setattr__(self, "memory_order", MemoryOrder(self.memory_order))
        except ValueError:
            raise InvalidDescriptor(f"KVLayout.memory_order = {self.memory_order!r}; expected "
                                    f"one of {[m.value for m in MemoryOrder]}") from None

    @classmethod
    def from_caches(cls, caches: Sequence[torch.Tensor], *, tp_rank: int = 0,
                    tp_size: int = 1) -> KVLayout:
        """The layout of per-layer tensors `[2, num_blocks, block_size, heads, head_dim]`."""
        if not caches:
            raise InvalidDescriptor("no KV cache tensors given; expected one per layer")
        two, _, block_size, heads, head_dim = _shape5(caches[0])
        return cls(len(caches), heads, head_dim, block_size, dtype_name(caches[0].dtype),
                   tp_rank, tp_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

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
        itemsize = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def check_caches(self, caches: Sequence[torch.Tensor]) -> int:
        """Raise `LayoutMismatch` unless `caches` hold this layout; returns their block count."""
        if len(caches) != self.num_layers:
            raise LayoutMismatch(f"{len(caches)} cache tensors; layout expects {self.num_layers}")
        first = _shape5(caches[0])
        for i, t in enumerate(caches):
            shape = _shape5(t)
            expected = (2, first[1], self.block_size, self.num_kv_heads, self.head_dim)
            if shape != expected or t.dtype != self.torch_dtype or not t.is_contiguous():
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


def _shape5(t: torch.Tensor) -> tuple[int, ...]:
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
