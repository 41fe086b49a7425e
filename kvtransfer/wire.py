"""The typed messages between a puller and a source, and their framing on a byte stream.

A frame is a 13-byte header `(kind: u8, layer: u32, length: u64)` then `length` bytes: JSON of
a message for control kinds, raw KV bytes for `MessageKind.LAYER`. One pull on a stream:

    puller -> source   READ_REQUEST (the puller's layout; per part a lease id and the puller's
                       block ids: several leases of one source may go as one read)
    source -> puller   READ_ACCEPTED | READ_REJECTED (an ErrorKind, and the leases at fault
                       when only some parts are; nothing was written, no other part used)
    source -> puller   LAYER x num_layers (a layer's views in ReadPlan order, one frame each)
    puller -> source   READ_DONE (every layer landed; the source may end the read)
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from dataclasses import dataclass
from enum import IntEnum

from kvtransfer.handoff import KVLayout
from kvtransfer.errors import (ErrorKind, InvalidDescriptor, PeerGone, TransferError,
                               error_from_kind)

HEADER = struct.Struct("!BIQ")
# a control message (a ReadRequest names a block id per block: 1 MiB is ~100k blocks) at most;
# a peer announcing more is refused before anything is allocated
MAX_CONTROL_BYTES = 1 << 20


class MessageKind(IntEnum):
    READ_REQUEST = 1
    READ_ACCEPTED = 2
    READ_REJECTED = 3
    READ_DONE = 4
    PAIR_HELLO = 5
    LAYER = 16


@dataclass(frozen=True)
class ReadPart:
    lease_id: str
    block_ids: tuple[int, ...]  # the puller's destination block ids, in token order


@dataclass(frozen=True)
class ReadRequest:
    """One read of one or more leases' blocks, sent in part order."""

    layout: KVLayout  # the puller's layout
    parts: tuple[ReadPart, ...]

    @classmethod
    def one(cls, lease_id: str, layout: KVLayout, block_ids: tuple[int, ...]) -> ReadRequest:
        return cls(layout, (ReadPart(lease_id, tuple(block_ids)),))

    @property
    def block_ids(self) -> tuple[int, ...]:
        """Every part's destination block ids, in wire order."""
        return tuple(b for part in self.parts for b in part.block_ids)


@dataclass(frozen=True)
class ReadAccepted:
    bytes_per_layer: int


@dataclass(frozen=True)
class ReadRejected:
    kind: ErrorKind
    message: str
    lease_ids: tuple[str, ...] = ()  # the parts at fault, when not the whole read

    @classmethod
    def of(cls, error: TransferError) -> ReadRejected:
        return cls(error.kind, str(error), error.lease_ids)

    def error(self) -> TransferError:
        """The rejection as the puller raises it."""
        return error_from_kind(self.kind, self.message, self.lease_ids)


@dataclass(frozen=True)
class ReadDone:
    pass


@dataclass(frozen=True)
class PairHello:
    pair_key: str  # names the puller's side of a per-pair communicator


Message = ReadRequest | ReadAccepted | ReadRejected | ReadDone | PairHello
_KINDS: dict[type, MessageKind] = {
    ReadRequest: MessageKind.READ_REQUEST, ReadAccepted: MessageKind.READ_ACCEPTED,
    ReadRejected: MessageKind.READ_REJECTED, ReadDone: MessageKind.READ_DONE,
    PairHello: MessageKind.PAIR_HELLO,
}


def encode(msg: Message) -> tuple[MessageKind, bytes]:
    if isinstance(msg, ReadRequest):
        body = {"layout": msg.layout.to_dict(),
                "parts": [[p.lease_id, list(p.block_ids)] for p in msg.parts]}
    elif isinstance(msg, ReadRejected):
        body = {"kind": msg.kind.value, "message": msg.message,
                "lease_ids": list(msg.lease_ids)}
    else:
        body = dict(msg.__dict__)
    return _KINDS[type(msg)], json.dumps(body, separators=(",", ":")).encode()


def decode(kind: int, payload: bytes) -> Message:
    try:
        body = json.loads(payload)
        if kind == MessageKind.READ_REQUEST:
            parts = tuple(ReadPart(str(lease_id), tuple(int(b) for b in block_ids))
                          for lease_id, block_ids in body["parts"])
            if not parts:
                raise ValueError("a read of no part")
            return ReadRequest(KVLayout.from_dict(body["layout"]), parts)
        if kind == MessageKind.READ_REJECTED:
            return ReadRejected(ErrorKind(body["kind"]), str(body["message"]),
                                tuple(str(i) for i in body.get("lease_ids", ())))
        cls = {v: k for k, v in _KINDS.items()}[MessageKind(kind)]
        return cls(**body)
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidDescriptor(f"malformed message of kind {kind}: {e!r}") from None


# ---- framing on a non-blocking socket driven by an asyncio loop -----------------------------

YIELD_BYTES = 1 << 20  # `recv_exact` lets the event loop run after this many bytes


async def recv_exact(sock: socket.socket, buf: memoryview) -> None:
    """Fill `buf` from `sock`; raises `PeerGone` on end of stream or a reset."""
    loop = asyncio.get_running_loop()
    got, n, since_yield = 0, len(buf), 0
    try:
        while got < n:
            k = await loop.sock_recv_into(sock, buf[got:])
            if k == 0:
                raise PeerGone(f"peer closed the connection after {got} of {n} bytes")
            got += k
            since_yield += k
            if since_yield >= YIELD_BYTES and got < n:
                # data already waiting is read without a turn of the loop: give the loop one
                # (the worker's streams, a router in the same process) now and then
                await asyncio.sleep(0)
                since_yield = 0
    except (ConnectionError, OSError) as e:
        raise PeerGone(f"connection lost after {got} of {n} bytes: {e}") from None


async def send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    try:
        await asyncio.get_running_loop().sock_sendall(sock, data)
    except (ConnectionError, OSError) as e:
        raise PeerGone(f"connection lost while sending: {e}") from None


async def send_header(sock: socket.socket, kind: MessageKind, layer: int, length: int) -> None:
    await send_all(sock, HEADER.pack(kind, layer, length))


async def recv_header(sock: socket.socket) -> tuple[int, int, int]:
    buf = bytearray(HEADER.size)
    await recv_exact(sock, memoryview(buf))
    return HEADER.unpack(buf)


async def send_message(sock: socket.socket, msg: Message) -> None:
    kind, payload = encode(msg)
    await send_all(sock, HEADER.pack(kind, 0, len(payload)) + payload)


async def recv_message(sock: socket.socket, max_bytes: int = MAX_CONTROL_BYTES) -> Message:
    kind, _, length = await recv_header(sock)
    if kind == MessageKind.LAYER or length > max_bytes:
        raise InvalidDescriptor(f"expected a control message, got kind {kind} of {length} bytes")
    buf = bytearray(length)
    await recv_exact(sock, memoryview(buf))
    return decode(kind, bytes(buf))
