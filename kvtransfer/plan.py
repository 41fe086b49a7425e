"""Which bytes move: coalesced block runs and the head slice between two ranks.

Both sides compute the same `ReadPlan` from the two layouts and the two block-id lists, so the
wire carries only the bytes, in plan order: for each layer, keys then values, each as the
segments in token order. A segment is a run of blocks contiguous on both sides, so a fresh
allocation usually moves as one segment per layer and K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence

import torch

from kvtransfer.handoff import Handoff, KVLayout, check_transferable
from kvtransfer.errors import LayoutMismatch


@dataclass(frozen=True)
class Segment:
    src_start: int  # first source block id
    dst_start: int  # first destination block id
    num_blocks: int


def coalesce(src_ids: Sequence[int], dst_ids: Sequence[int]) -> tuple[Segment, ...]:
    """Split paired block ids into maximal runs contiguous on both sides."""
    if len(src_ids) != len(dst_ids):
        raise LayoutMismatch(f"{len(dst_ids)} destination blocks for {len(src_ids)} source "
                             "blocks; expected one destination block per source block")
    segments: list[Segment] = []
    for s, d in zip(src_ids, dst_ids):
        last = segments[-1] if segments else None
        if last and s == last.src_start + last.num_blocks and d == last.dst_start + last.num_blocks:
            segments[-1] = Segment(last.src_start, last.dst_start, last.num_blocks + 1)
        else:
            segments.append(Segment(s, d, 1))
    return tuple(segments)


@dataclass(frozen=True)
class HeadSlice:
    """The KV heads one source rank gives one destination rank, in each side's local indices."""

    src_start: int
    dst_start: int
    num_heads: int


def head_slice(src: KVLayout, dst: KVLayout) -> HeadSlice | None:
    """The heads `src` holds that `dst` needs, or None when they share none."""
    lo = max(src.head_start, dst.head_start)
    hi = min(src.head_start + src.num_kv_heads, dst.head_start + dst.num_kv_heads)
    if lo >= hi:
        return None
    return HeadSlice(lo - src.head_start, lo - dst.head_start, hi - lo)


@dataclass(frozen=True)
class ReadPlan:
    segments: tuple[Segment, ...]
    heads: HeadSlice
    full_heads: bool  # the slice is every head on both sides (views are contiguous)

    @classmethod
    def build(cls, src: KVLayout, dst: KVLayout, src_ids: Sequence[int],
              dst_ids: Sequence[int]) -> ReadPlan:
        check_transferable(src, dst)
        heads = head_slice(src, dst)
        if heads is None:
            raise LayoutMismatch(f"source TP rank {src.tp_rank}/{src.tp_size} holds no KV head "
                                 f"of destination TP rank {dst.tp_rank}/{dst.tp_size}")
        full = heads.num_heads == src.num_kv_heads == dst.num_kv_heads
        return cls(coalesce(src_ids, dst_ids), heads, full)

    def src_views(self, cache: torch.Tensor) -> list[torch.Tensor]:
        """One layer's source views in wire order: `[n, block_size, heads, head_dim]` each,
        keys' segments then values' (or the latent's only)."""
        h = self.heads
        return [cache[kv, s.src_start:s.src_start + s.num_blocks, :,
                      h.src_start:h.src_start + h.num_heads]
                for kv in range(cache.shape[0]) for s in self.segments]

    def dst_views(self, cache: torch.Tensor) -> list[torch.Tensor]:
        h = self.heads
        return [cache[kv, s.dst_start:s.dst_start + s.num_blocks, :,
                      h.dst_start:h.dst_start + h.num_heads]
                for kv in range(cache.shape[0]) for s in self.segments]

    def bytes_per_layer(self, layout: KVLayout) -> int:
        blocks = sum(s.num_blocks for s in self.segments)
        return layout.bytes_per_block * blocks * self.heads.num_heads // layout.num_kv_heads


def sources_for(dst: KVLayout, handoffs: Sequence[Handoff]) -> list[Handoff]:
    """The handoffs (one per source TP rank) a destination rank must pull to get all its heads.

    Raises `LayoutMismatch` when the handoffs disagree with each other or miss some of the heads.
    """
    if not handoffs:
        raise LayoutMismatch("no handoff given; expected one per source tensor-parallel rank")
    first = handoffs[0]
    for h in handoffs:
        check_transferable(h.layout, dst)
        if h.num_blocks != first.num_blocks or h.layout.tp_size != first.layout.tp_size:
            raise LayoutMismatch(
                f"handoffs of one request disagree: {h.num_blocks} blocks at TP "
                f"{h.layout.tp_size} vs {first.num_blocks} blocks at TP {first.layout.tp_size}")
    slices = [(h, sl) for h in handoffs if (sl := head_slice(h.layout, dst)) is not None]
    if dst.kind == "latent":  # every source rank holds the whole latent: one is enough
        slices = slices[:1]
    needed = [h for h, _ in slices]
    covered = sum(sl.num_heads for _, sl in slices)
    ranks = sorted(h.layout.tp_rank for h in needed)
    if covered != dst.num_kv_heads or len(set(ranks)) != len(ranks):
        raise LayoutMismatch(
            f"handoffs from source TP ranks {ranks} cover {covered} of the {dst.num_kv_heads} "
            f"KV heads of destination TP rank {dst.tp_rank}/{dst.tp_size}; expected each head "
            "exactly once")
    return needed
