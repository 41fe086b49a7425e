"""A worker's prefix cache as the router sees it: the chained block hashes both sides compute,
the KV events a worker emits as blocks enter and leave its cache (the router rebuilds each
worker's cache from them), the snapshot it resyncs from, and the hot prefixes a leaving worker
hands on. No torch here.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass


def adapter_salt(cache_salt: str | None, lora_name: str | None) -> str | None:
    """The salt a request's block hashes start from: its cache salt, and its LoRA adapter's
    name when it has one (KV computed under one adapter is never another's, nor the base
    model's). The engine's cache and the router's prefix index both hash with it."""
    if lora_name is None:
        return cache_salt
    return f"lora:{lora_name}\x00{cache_salt or ''}"


def hash_block(parent_hash: int | None, token_ids: Sequence[int], salt: str | None = None) -> int:
    """Chained hash of one full KV block: the same prefix gives the same hash in every process.

    64-bit, from sha256 over (parent hash, salt, tokens), so the router computes it without torch.
    """
    h = hashlib.sha256()
    h.update(struct.pack("<q", -1 if parent_hash is None else parent_hash))
    if salt is not None:
        h.update(b"salt:" + salt.encode())
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return struct.unpack("<q", h.digest()[:8])[0]


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int,
                       salt: str | None = None) -> list[int]:
    """Hashes of every full block of `token_ids`, in order (the salt enters the first block).

    Equal to chaining `hash_block` block by block, but packs the tokens once: the router calls
    this on every request, so it is on the hot path.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    num_tokens = len(token_ids) // block_size * block_size
    if num_tokens == 0:
        return []
    data = struct.pack(f"<{num_tokens}q", *token_ids[:num_tokens])
    stride = 8 * block_size
    sha256 = hashlib.sha256
    parent = struct.pack("<q", -1) + (b"salt:" + salt.encode() if salt is not None else b"")
    digests: list[bytes] = []
    for start in range(0, 8 * num_tokens, stride):
        parent = sha256(parent + data[start:start + stride]).digest()[:8]
        digests.append(parent)
    return [h for (h,) in struct.iter_unpack("<q", b"".join(digests))]


@dataclass(frozen=True)
class KVEvent:
    """Base of the KV events. `epoch` is new at every engine start; `seq` counts from 0, no gaps."""

    epoch: str
    seq: int


# The tiers a worker's prefix cache keeps blocks in (`medium` of the events): the primary pool
# the model reads (GPU memory, or on a CPU worker its cache tensors), and the host-memory tier
# evicted blocks are saved to and copied back from (`workers.engine.kv_cache.host_tier`).
DEVICE = "device"
HOST = "host"
MEDIA = (DEVICE, HOST)


@dataclass(frozen=True)
class BlockStored(KVEvent):
    """Full blocks entered the prefix cache's tier `medium`, each chained to the previous (first
    to `parent_hash`). Blocks saved to the host tier carry no tokens and no parent."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None
    token_ids: tuple[int, ...]  # the tokens of all the stored blocks, concatenated
    block_size: int
    medium: str = DEVICE


@dataclass(frozen=True)
class BlockRemoved(KVEvent):
    """Blocks left the prefix cache's tier `medium` (evicted): they no longer hit there."""

    block_hashes: tuple[int, ...]
    medium: str = DEVICE


@dataclass(frozen=True)
class AllBlocksCleared(KVEvent):
    """The prefix cache was emptied (reset)."""


@dataclass(frozen=True)
class HotPrefix:
    """A cached prefix requests hit lately (`Worker.hot_prefixes`): what a worker leaving the
    pool hands to the survivors (`Worker.land_prefix` pulls it)."""

    block_hashes: tuple[int, ...]  # its leading blocks' chained hashes, from the first
    token_ids: tuple[int, ...]  # the tokens of those blocks
    worth: float  # blocks its hits saved lately, decayed


@dataclass(frozen=True)
class KVSnapshot:
    """Every hash in a worker's prefix cache as of event `next_seq` (exclusive) of `epoch`:
    what a router rebuilds its view from after a gap or a restart."""

    epoch: str
    next_seq: int
    block_hashes: frozenset[int]
    host_block_hashes: frozenset[int] = frozenset()  # in the host tier (some also above)
