"""`RequestStream`: one request's events as the router reads them from a worker's channel.
Torch-free."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from workers.contract.protocol import TokenEvent


class RequestStream:
    """One request's events, fed by the client's reader. Iterating ends after the last sample
    finished; a failure is raised as the worker raised it; `aclose()` before the end aborts.

    Events of one sample that are already here when the reader asks are merged into one (their
    tokens, text and logprobs in order): a router that falls behind the engine then does work per
    message, not per token, so it catches up instead of staying behind."""

    def __init__(self, request_id: str, num_samples: int,
                 on_finish: Callable[[str, bool], None]) -> None:
        """`on_finish(request_id, abort)`: called once, when the stream ends or is closed
        (`abort`: before its last sample finished)."""
        self._on_finish = on_finish
        self.request_id = request_id
        self._items: collections.deque[TokenEvent | BaseException] = collections.deque()
        self._ready = asyncio.Event()
        self._left = num_samples
        self._done = False

    def put(self, item: TokenEvent | BaseException) -> None:
        self._items.append(item)
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self._finish(abort=False)
            raise item
        while item.finish_reason is None and self._items:
            following = self._items[0]
            if not isinstance(following, TokenEvent) or following.index != item.index:
                break
            self._items.popleft()
            item = _merged(item, following)
        if item.finish_reason is not None:
            self._left -= 1
            if self._left == 0:
                self._finish(abort=False)
        return item

    def _finish(self, abort: bool) -> None:
        if not self._done:
            self._done = True
            self._on_finish(self.request_id, abort)

    async def aclose(self) -> None:
        self._finish(abort=True)


def _merged(a: TokenEvent, b: TokenEvent) -> TokenEvent:
    """`b` appended to `a` (consecutive events of one sample)."""
    logprobs = None if a.logprobs is None and b.logprobs is None else [
        *(a.logprobs or ()), *(b.logprobs or ())]
    return a.replaced(token_ids=[*a.token_ids, *b.token_ids], text=a.text + b.text,
                      logprobs=logprobs, finish_reason=b.finish_reason, stop_reason=b.stop_reason)
