"""Waiting on UCXX requests for the `ucx` transport: one endpoint speaking `wire` messages, a
pipeline that keeps several layers of messages posted, and a wait that does not spin.

Waiting on a request polls it (`unspun`): UCXX's own wait spins the event loop, and one spinning
thread per process left CMA a fraction of a core. With the loop idle between polls, a 1 GiB pull
on a 2-core host is one `process_vm_readv` thread at about 4.6 GB/s (0.40 to 0.47 of the two-thread
memcpy bound with 4 KiB pages; 6 to 6.6 GB/s, 0.57 to 0.6, when both caches are on huge pages,
whose pages CMA pins faster). A second reader thread would need a second UCX worker, which
UCXX's public API does not offer (one context and worker per process).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any
from collections.abc import Callable, Coroutine, Iterable

import numpy as np

from kvtransfer.errors import InvalidDescriptor, PeerGone
from kvtransfer.wire import HEADER, Message, decode, encode

LAYERS_IN_FLIGHT = 4  # layers whose messages are posted ahead of the oldest one not yet done
SPIN_POLLS = 32  # polls of a UCX request back to back before sleeping between polls
POLL_INTERVAL_S = 0.0005  # then this long between polls (the event loop rounds it up to 1 ms)


async def unspun(coro: Coroutine) -> Any:
    """Await `coro`, a UCXX send or receive, without letting it spin. With its notifier thread
    off (the default, and the only mode that works across event loops) UCXX waits for a request
    by `await asyncio.sleep(0)` in a loop: a busy core per process while any request is pending,
    an idle source waiting for the next pull included, and on a 2-core host the CMA reads got
    a third of a core. Each such bare yield is answered here by an immediate poll for the first
    `SPIN_POLLS`, then by a sleep of `POLL_INTERVAL_S`; a future it yields is waited for as a
    task would. Cancelling the caller throws into `coro`, as it would into a task's."""
    polls, error = 0, None
    try:
        while True:
            try:
                yielded = coro.throw(error) if error is not None else coro.send(None)
            except StopIteration as stop:
                return stop.value
            error = None
            try:
                if yielded is not None:  # `coro` reads the future's outcome itself
                    await asyncio.wait([yielded])
                    continue
                polls += 1
                await asyncio.sleep(0 if polls <= SPIN_POLLS else POLL_INTERVAL_S)
            except asyncio.CancelledError as e:
                if yielded is not None:
                    yielded.cancel()
                error = e
    finally:
        coro.close()


class Pipeline:
    """Posts each layer's messages while up to `LAYERS_IN_FLIGHT` earlier layers are still
    moving, so UCX always has the next rendezvous posted. Messages are posted in plan order (one
    endpoint, one tag: UCX matches them in that order)."""

    def __init__(self) -> None:
        self._posted: list[asyncio.Future] = []

    async def run(self, num_layers: int, post: Callable[[int], Iterable[Coroutine]],
                  done: Callable[[int], None]) -> int:
        """`post(layer)` gives the layer's send or receive coroutines; `done(layer)` runs in
        layer order once all of them completed. Returns the number of messages; raises the
        first message's error."""
        window: deque[tuple[int, list[asyncio.Future]]] = deque()
        messages = 0
        for layer in range(num_layers):
            ops: list[asyncio.Future] = [asyncio.ensure_future(op) for op in post(layer)]
            self._posted.extend(ops)
            window.append((layer, ops))
            while window and (len(window) > LAYERS_IN_FLIGHT or layer == num_layers - 1):
                oldest, ops = window.popleft()
                await asyncio.wait(ops)  # unlike gather, a cancelled pull leaves them to settle
                for op in ops:
                    op.result()
                messages += len(ops)
                done(oldest)
        return messages

    @property
    def idle(self) -> bool:
        """Whether every posted message has ended."""
        return all(op.done() for op in self._posted)

    async def settle(self) -> None:
        """Wait for every posted message to end; call after closing the endpoint, which makes
        UCX cancel those still in flight. Afterwards nothing reads or writes their buffers."""
        await asyncio.gather(*self._posted, return_exceptions=True)


class Endpoint:
    """A UCXX endpoint that speaks `wire` messages and raises `PeerGone` for UCX failures."""

    def __init__(self, ucxx: Any, ep: Any) -> None:
        self._errors = (ucxx.exceptions.UCXError,)
        self.ep = ep

    async def send(self, buf: Any) -> None:
        try:
            await unspun(self.ep.send(buf))
        except self._errors as e:
            raise PeerGone(f"UCX send failed: {e!r}") from None

    async def recv(self, buf: Any) -> None:
        try:
            await unspun(self.ep.recv(buf))
        except self._errors as e:
            raise PeerGone(f"UCX receive failed: {e!r}") from None

    async def send_message(self, msg: Message) -> None:
        kind, payload = encode(msg)
        await self.send(np.frombuffer(bytearray(HEADER.pack(kind, 0, len(payload))), np.uint8))
        await self.send(np.frombuffer(bytearray(payload), np.uint8))

    async def recv_message(self) -> Message:
        header = np.empty(HEADER.size, np.uint8)
        await self.recv(header)
        kind, _, length = HEADER.unpack(header.tobytes())
        if length > 1 << 24:
            raise InvalidDescriptor(f"control message of {length} bytes; expected < 16 MiB")
        body = np.empty(length, np.uint8)
        await self.recv(body)
        return decode(kind, body.tobytes())

    async def close(self) -> None:
        try:
            await self.ep.close()
        except self._errors:
            pass
