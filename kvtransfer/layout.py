"""A worker rank's KV cache as the transfer layer sees it (`KVLayout`), and whether two can
transfer. Imports only the standard library.

The engine's per-layer cache tensor is `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 keys, 1 values), contiguous: `MemoryOrder.KV_BLOCK_TOKEN_HEAD_DIM`. A model with
multi-head latent attention (DeepSeek-V2/V3) caches one latent vector per token instead, which
serves as both key and value: `[1, num_blocks, block_size, 1, latent_dim]`, the layout kind
`latent`, replicated (not split) over tensor-parallel ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol
from collections.abc import Sequence

from kvtransfer.errors import InvalidDescriptor, LayoutMismatch

# bytes per element of each transferable KV dtype, by its torch name (`torch.<name>`)
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
    "uint8": 1,
}

# layout kinds, by planes - 1: keys and values, or one latent serving as both
LAYOUT_KINDS = ("latent", "kv")


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
    kind: str = "kv"  # "kv": keys and values, heads split over TP; "latent": see the module doc
    # how values are encoded beyond `dtype` ("": as stored; "hadamard": each head rotated before
    # quantization, workers.kernels.kv_quant): blocks of two encodings never mix
    encoding: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            _check_int("KVLayout", name, getattr(self, name), 1)
        _check_int("KVLayout", "tp_rank", self.tp_rank, 0)
        if self.tp_rank >= self.tp_size:
            raise InvalidDescriptor(f"KVLayout.tp_rank = {self.tp_rank}; expected < tp_size "
                                    f"{self.tp_size}")
        if self.kind not in LAYOUT_KINDS:
            raise InvalidDescriptor(f"KVLayout.kind = {self.kind!r}; expected one of "
                                    f"{list(LAYOUT_KINDS)}")
        if self.kind == "latent" and self.num_kv_heads != 1:
            raise InvalidDescriptor(f"KVLayout.num_kv_heads = {self.num_kv_heads} for a latent "
                                    "layout; expected 1 (one latent vector per token)")
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
                    tp_size: int = 1, encoding: str = "") -> KVLayout:
        """The layout of per-layer tensors `[2, num_blocks, block_size, heads, head_dim]`."""
        if not caches:
            raise InvalidDescriptor("no KV cache tensors given; expected one per layer")
        planes, _, block_size, heads, head_dim = _shape5(caches[0])
        return cls(len(caches), heads, head_dim, block_size, _dtype_name(caches[0].dtype),
                   tp_rank, tp_size, kind=LAYOUT_KINDS[planes - 1], encoding=encoding)

    @property
    def planes(self) -> int:
        """Tensors per block and layer: keys and values (2), or the latent (1)."""
        return LAYOUT_KINDS.index(self.kind) + 1

    @property
    def total_kv_heads(self) -> int:
        return self.num_kv_heads if self.kind == "latent" else self.num_kv_heads * self.tp_size

    @property
    def head_start(self) -> int:
        """The global index of this rank's first KV head (a latent is on every rank)."""
        return 0 if self.kind == "latent" else self.tp_rank * self.num_kv_heads

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of one layer, keys and values (or the latent)."""
        return (self.planes * self.block_size * self.num_kv_heads * self.head_dim
                * DTYPE_SIZES[self.dtype])

    def check_caches(self, caches: Sequence[CacheTensor]) -> int:
        """Raise `LayoutMismatch` unless `caches` hold this layout; returns their block count."""
        if len(caches) != self.num_layers:
            raise LayoutMismatch(f"{len(caches)} cache tensors; layout expects {self.num_layers}")
        first = _shape5(caches[0])
        for i, t in enumerate(caches):
            shape = _shape5(t)
            expected = (self.planes, first[1], self.block_size, self.num_kv_heads, self.head_dim)
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
    if t.dim() != 5 or t.shape[0] not in (1, 2):
        raise LayoutMismatch(f"KV cache tensor of shape {tuple(t.shape)}; expected "
                             "[2, num_blocks, block_size, num_kv_heads, head_dim] (or a latent "
                             "[1, num_blocks, block_size, 1, latent_dim])")
    return tuple(t.shape)


def check_transferable(src: KVLayout, dst: KVLayout) -> None:
    """Raise `LayoutMismatch` naming every field that differs, unless `src` blocks can land in
    `dst` blocks (tensor-parallel sizes may differ: heads are resharded)."""
    diffs = [f"{name} {getattr(src, name)!r} vs {getattr(dst, name)!r}"
             for name in ("kind", "num_layers", "head_dim", "block_size", "dtype",
                          "encoding", "total_kv_heads", "memory_order")
             if getattr(src, name) != getattr(dst, name)]
    if diffs:
        raise LayoutMismatch("source and destination KV layouts differ (source vs destination): "
                             + "; ".join(diffs))


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
