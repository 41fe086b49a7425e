"""The asyncio face of the engine: `generate()` yields token events, `abort()` cancels.

The step loop runs on one worker thread, off the event loop. Adds and aborts are queued and
applied between steps, so the engine is only ever touched by one thread at a time.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, TypeVar

from workers.config import EngineConfig
from workers.engine import Engine, EngineStats
from workers.protocol import SamplingParams, TokenEvent

T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._streams: dict[str, asyncio.Queue[TokenEvent | BaseException]] = {}
        self._ops: list[Callable[[], None]] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="cleave-engine")
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(Engine(config))

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _submit(self, op: Callable[[], None]) -> None:
        self._ops.append(op)
        if self._wakeup is not None:
            self._wakeup.set()

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, *,
                       cache_salt: str | None = None) -> AsyncIterator[TokenEvent]:
        """Yield the request's token events until all its samples finish. Bad input raises
        `InvalidRequestError` before the first event. Leaving the loop early (break, cancel,
        client gone) aborts the request and frees its blocks."""
        self._ensure_running()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        stream: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        added: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def add() -> None:
            try:
                self.engine.add_request(rid, prompt, params, cache_salt=cache_salt)
            except Exception as exc:  # reported to the caller, nothing was queued
                added.set_exception(exc)
            else:
                self._streams[rid] = stream
                added.set_result(None)

        self._submit(add)
        await added
        num_finished = 0
        try:
            while num_finished < params.n:
                event = await stream.get()
                if isinstance(event, BaseException):
                    raise event
                if event.finish_reason is not None:
                    num_finished += 1
                yield event
        finally:
            self._streams.pop(rid, None)
            if num_finished < params.n:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Cancel a request (applied before the next step); unknown ids are ignored."""
        self._streams.pop(request_id, None)
        self._submit(lambda: self.engine.abort(request_id))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def run_between_steps(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the step thread, between two steps: it sees the engine at rest (the KV
        event log, the prefix cache) and no step runs until it returns."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None
        while True:
            if not self._ops and not self.engine.has_unfinished():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            ops, self._ops = self._ops, []
            for op in ops:
                op()
            if not self.engine.has_unfinished():
                continue
            try:
                events = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as exc:  # a broken step fails every request in flight
                for rid, stream in list(self._streams.items()):
                    stream.put_nowait(exc)
                    self.engine.abort(rid)
                continue
            for event in events:
                stream = self._streams.get(event.request_id)
                if stream is not None:
                    stream.put_nowait(event)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)
