"""The asyncio face of the engine: `generate()` yields token events, `abort()` cancels.

The step loop runs on one worker thread, off the event loop. Adds and aborts are queued and
applied between steps, so the engine is only ever touched by one thread at a time.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, TypeVar

from workers.config import EngineConfig
from workers.engine import Engine, EngineStats
from workers.protocol import EngineShutDown, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from workers.parallel.group import RankLauncher

__all__ = ["AsyncEngine", "EngineShutDown"]

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
    def from_config(cls, config: EngineConfig,
                    rank_launcher: RankLauncher | None = None) -> AsyncEngine:
        """`rank_launcher`: how a parallel engine starts its ranks (None: spawned processes)."""
        return cls(Engine(config, rank_launcher))

    @property
    def is_healthy(self) -> bool:
        """False once the step loop has stopped: shut down, or crashed."""
        return self._task is None or not self._task.done()

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _submit(self, op: Callable[[], None]) -> None:
        self._ops.append(op)
        if self._wakeup is not None:
            self._wakeup.set()

    def apply_soon(self, op: Callable[[], None]) -> None:
        """Queue `op` to run on the event loop between two steps (with the adds and aborts);
        fire and forget. Call from the event loop's thread."""
        self._ensure_running()
        self._submit(op)

    async def apply(self, fn: Callable[[], T]) -> T:
        """Run `fn` between two steps (queued like `apply_soon`) and return its result or raise
        its error. If the caller is cancelled, `fn` still runs."""
        self._ensure_running()
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        def op() -> None:
            try:
                result = fn()
            except Exception as exc:  # handed to the caller
                if not done.done():
                    done.set_exception(exc)
            else:
                if not done.done():
                    done.set_result(result)

        self._submit(op)
        return await done

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, *, cache_salt: str | None = None,
                       prefill_only: bool = False) -> AsyncIterator[TokenEvent]:
        """Yield the request's token events until all its samples finish. Bad input raises
        `InvalidRequestError` before the first event. Leaving the loop early (break, cancel,
        client gone) aborts the request and frees its blocks. `prefill_only`: sample the first
        token and hold the blocks for a KV handoff (`Engine.add_prefill`)."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        stream: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        add = self.engine.add_prefill if prefill_only else self.engine.add_request

        def add_and_listen() -> None:
            add(rid, prompt, params, cache_salt=cache_salt)
            self._streams[rid] = stream

        async for event in self._listen(rid, stream, params.n, add_and_listen):
            yield event

    async def generate_after_handoff(
            self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
            params: SamplingParams,
            pull: Callable[[list[int]], Awaitable[None]] | None) -> AsyncIterator[TokenEvent]:
        """Continue a request whose first token another worker sampled: the events after it.
        With `pull`, allocate blocks, await `pull(block_ids)` to land the prompt's KV in them,
        then decode; what `pull` raises is raised here (the blocks are freed). Without, compute
        the prompt's KV here first. Leaving early aborts, as in `generate`."""
        stream: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        e = self.engine

        def listen() -> None:
            self._streams[request_id] = stream

        if pull is None:
            async for event in self.generate_continuation(request_id, prompt_token_ids,
                                                          [first_token_id], params):
                yield event
            return
        try:
            block_ids = await self.apply(lambda: e.add_request_with_remote_kv(
                request_id, prompt_token_ids, first_token_id, params))
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        try:
            await pull(block_ids)
        except BaseException:
            self.abort(request_id)
            raise

        def commit_and_listen() -> None:
            e.commit_remote_kv(request_id)
            listen()

        async for event in self._listen(request_id, stream, 1, commit_and_listen):
            yield event

    async def generate_continuation(self, request_id: str, prompt_token_ids: list[int],
                                    sent_token_ids: list[int],
                                    params: SamplingParams) -> AsyncIterator[TokenEvent]:
        """Continue a request whose first output tokens, `sent_token_ids`, were sampled (and
        sent) elsewhere: compute the prompt's and their KV here, then yield the events after
        them (`Engine.add_continuation`; greedy output equals an uninterrupted run, seeded
        sampling may not). Bad input raises `InvalidRequestError` before the first event;
        leaving early aborts, as in `generate`."""
        stream: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()

        def add_and_listen() -> None:
            self.engine.add_continuation(request_id, prompt_token_ids, sent_token_ids, params)
            self._streams[request_id] = stream

        async for event in self._listen(request_id, stream, 1, add_and_listen):
            yield event

    async def _listen(self, rid: str, stream: asyncio.Queue[TokenEvent | BaseException],
                      num_samples: int, start: Callable[[], None]) -> AsyncIterator[TokenEvent]:
        """Run `start` between steps (it registers `stream`), then yield the stream's events
        until `num_samples` finish; abort the request if the caller leaves before."""
        try:
            await self.apply(start)  # an error here queued nothing
        except asyncio.CancelledError:
            self.abort(rid)  # `start` runs anyway: undo it
            raise
        num_finished = 0
        try:
            while num_finished < num_samples:
                event = await stream.get()
                if isinstance(event, BaseException):
                    raise event
                if event.finish_reason is not None:
                    num_finished += 1
                yield event
        finally:
            self._streams.pop(rid, None)
            if num_finished < num_samples:
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
        """Stop the step loop; every request still streaming gets `EngineShutDown`."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)
        self.engine.close()  # a parallel engine's rank processes
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            stream.put_nowait(EngineShutDown(f"the engine was shut down while {rid!r} ran"))
