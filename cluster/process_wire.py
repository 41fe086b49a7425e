"""The wire between the router's process and a worker process (`cluster.process_worker`):
each message is a 4-byte little-endian length and a pickle."""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct
from typing import Any

_HEADER = struct.Struct("<I")


def frame(msg: object) -> bytes:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def no_delay(sock: socket.socket) -> None:
    """Nagle off, on both ends. asyncio turns it off only for sockets made with proto
    IPPROTO_TCP, which an accepted one is not: with it on, a call written while another was
    unanswered (a submit behind a long-polling next_outputs) waited ~40 ms for a delayed ACK."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def send(sock: socket.socket, msg: object) -> None:
    sock.sendall(frame(msg))


def recv(sock: socket.socket) -> Any:
    """The next message, as the peer sent it: its shape (a tuple, by convention) is the
    caller's protocol, which pickle does not type."""
    (size,) = _HEADER.unpack(recv_exact(sock, _HEADER.size))
    return pickle.loads(recv_exact(sock, size))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


async def read(reader: asyncio.StreamReader) -> Any:
    """`recv` on a stream: the next message, as the peer sent it (untyped, as pickle gives
    it)."""
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return pickle.loads(await reader.readexactly(size))
