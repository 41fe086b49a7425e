"""What crosses the control connection between an `AgentHost` (the process that holds a rank's
KV cache) and its `RemoteAgent` (the worker's driver): typed records, pickled, one per frame (a
4-byte big-endian length, then the pickle). The driver speaks first: its token as a raw frame
(nothing is unpickled before it matched), then `Hello`; a host refuses a `version` other than
`CONTROL_VERSION`.

Driver -> host: the token, `Hello`, then `Offer`, `Cancel`, `Pull`. Host -> driver: `Started` (or
`StartFailed`) once, then `Released` whenever a lease ends, `OfferFailed`, and one `Pulled` or
`PullFailed` per `Pull`.
"""

from __future__ import annotations

import asyncio
import pickle
from dataclasses import dataclass

from kvtransfer.agent import PullResult
from kvtransfer.handoff import Handoff, KVLayout
from kvtransfer.transport import TransportConfig

CONTROL_VERSION = 1  # bump when a record's fields change meaning
MAX_FRAME_BYTES = 64 << 20  # a frame holds records, never KV bytes


@dataclass(frozen=True)
class AgentHostAddress:
    """Where a rank's agent host listens for its driver (picklable: it crosses the rank's
    `Ready`)."""

    host: str
    port: int
    token: bytes  # the driver proves it started the rank (sent first, before any pickle)


@dataclass(frozen=True)
class Hello:
    transport: TransportConfig  # what the host's agent serves and pulls with
    version: int = CONTROL_VERSION


@dataclass(frozen=True)
class Started:
    address: str  # the agent's transport address, published in its handoffs
    layout: KVLayout  # the rank's shard of the cache
    num_blocks: int


@dataclass(frozen=True)
class StartFailed:
    kind: str | None  # an `ErrorKind` value; None: not a transfer error
    message: str


@dataclass(frozen=True)
class Offer:
    request_id: str
    block_ids: tuple[int, ...]  # token order
    lease_id: str  # minted by the driver, which returned the handoff at once
    lease_s: float
    readers: int


@dataclass(frozen=True)
class OfferFailed:
    lease_id: str
    message: str


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class Released:
    """A lease ended (pulled, cancelled, expired, or the host's agent closed)."""

    lease_id: str


@dataclass(frozen=True)
class Pull:
    pull_id: int  # the driver's, unique per connection
    handoffs: tuple[Handoff, ...]
    block_ids: tuple[int, ...]  # the host's local destination blocks, token order
    timeout_s: float


@dataclass(frozen=True)
class Pulled:
    pull_id: int
    result: PullResult


@dataclass(frozen=True)
class PullFailed:
    pull_id: int
    kind: str | None  # an `ErrorKind` value; None: not a transfer error
    message: str
    lease_ids: tuple[str, ...] = ()


async def send(writer: asyncio.StreamWriter, record: object) -> None:
    write(writer, record)
    await writer.drain()


def write(writer: asyncio.StreamWriter, record: object) -> None:
    """Queue one frame (sent in order with the frames queued before it)."""
    write_bytes(writer, pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL))


def write_bytes(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(len(data).to_bytes(4, "big") + data)


async def recv_bytes(reader: asyncio.StreamReader, limit: int = MAX_FRAME_BYTES) -> bytes:
    """The next frame's bytes; raises `asyncio.IncompleteReadError` when the peer has gone and
    `ValueError` for a frame over `limit` bytes."""
    size = int.from_bytes(await reader.readexactly(4), "big")
    if size > limit:
        raise ValueError(f"a control frame of {size} bytes; expected at most {limit}")
    return await reader.readexactly(size)


async def recv(reader: asyncio.StreamReader) -> object:
    """The next record (from a peer that proved its token)."""
    return pickle.loads(await recv_bytes(reader))
