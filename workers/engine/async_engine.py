"""The asyncio face of the engine: commands in, each step's outputs out to their sinks.

The step loop runs on one worker thread, off the event loop. Commands (`generate`, `abort`, and
whatever a caller `start`s or `apply`s, as the worker's connector does for the KV handoff and
live migration: `workers.serving.async_connector`) are queued and applied between steps, so the
engine is only ever touched by one thread at a time. Each request is routed
(`workers.engine.outputs.Routes`) to a `Sink` chosen by the caller: a router's output channel
(`workers.engine.outputs.Outbox`) or one request's own stream (`RequestStream`). After every
step the sinks that received something are flushed once, the engine's stats are published
(`stats`) and `on_publish` is told, with the step's KV events. A grammar not compiled yet is
compiled on a thread of its own first (`workers.engine.grammar.CompileQueue`). Once shut down,
a new request fails with `EngineShutDown` (its router retries it on another worker).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from kvtransfer import faults
from workers.engine.config import EngineConfig
from workers.engine.core import Engine
from workers.engine.grammar import CompileQueue
from workers.engine.outputs import RequestStream, Routes, Sink
from workers.engine.parallel.group import RankGroupError
from workers.contract.protocol import (EngineShutDown, EngineStats, SamplingParams, TokenEvent,
                                       WorkerRequest)
from workers.contract.prefix_cache import KVEvent
from workers.engine.step_thread import build_on_step_thread, step_thread as new_step_thread
from workers.engine.watchdog import StepWatchdog

if TYPE_CHECKING:
    from workers.engine.parallel.group import RankLauncher

__all__ = ["AsyncEngine", "EngineShutDown", "RequestStream", "Sink"]

T = TypeVar("T")
GONE = "the engine was shut down (its worker is going away)"


class AsyncEngine:
    def __init__(self, engine: Engine,
                 on_publish: Callable[[list[KVEvent]], None] | None = None,
                 step_timeout_s: float = 60.0,
                 step_thread: ThreadPoolExecutor | None = None) -> None:
        """`on_publish`: called on the event loop whenever `stats` is published (after each
        step, and after commands applied while idle), with the KV events since the last.
        `step_timeout_s`: the watchdog's bound (`workers.engine.watchdog`). `step_thread`: the
        one-thread executor steps run on (`from_config` builds the engine there too)."""
        self.engine = engine
        self.on_publish = on_publish
        self.watchdog = StepWatchdog(step_timeout_s)
        self._stats: EngineStats = engine.stats()  # published after each step
        self.routes = Routes()
        self._ops: list[Callable[[], object]] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._executor = step_thread or new_step_thread()
        self._stopping = False  # set by `shutdown`: the step thread stops after its step
        self.compile_queue = CompileQueue(engine.grammars)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig, rank_launcher: RankLauncher | None = None, *,
                    detokenize: bool = True) -> AsyncEngine:
        """`rank_launcher`: how a parallel engine starts its ranks (None: spawned processes);
        `detokenize`: see `Engine`. The engine is built on the thread its steps will run on
        (`workers.engine.step_thread` says why)."""
        engine, thread = build_on_step_thread(config, rank_launcher, detokenize=detokenize)
        return cls(engine, step_thread=thread)

    @property
    def stats(self) -> EngineStats:
        """The load as of the last step, and whether the engine is healthy now (the watchdog:
        read on a timer by the output channel's heartbeat, so a hung step shows)."""
        healthy = self.is_healthy
        return self._stats if healthy == self._stats.healthy else dataclasses.replace(
            self._stats, healthy=healthy)

    @property
    def num_queued(self) -> int:
        """Requests waiting: in the engine's queue, and commands not applied yet (a bound's
        count; read on the event loop while a step may run)."""
        return len(self.engine.scheduler.waiting) + len(self._ops)

    @property
    def is_healthy(self) -> bool:
        """False once the step loop has stopped (shut down, crashed), while a step runs past
        the watchdog's bound, and for good once a step failed for a lost rank."""
        return self.unhealthy_reason is None

    @property
    def unhealthy_reason(self) -> str | None:
        if self._task is not None and self._task.done():
            return "its step loop has stopped"
        return self.watchdog.problem

    # ---- commands (applied between steps; call from the event loop's thread) ----------------

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def apply_soon(self, op: Callable[[], object]) -> None:
        """Queue `op` to run on the event loop between two steps; fire and forget (its result
        is dropped); dropped once shut down (the engine is closed)."""
        if self._stopping:
            return
        self._ensure_running()
        self._ops.append(op)
        assert self._wakeup is not None
        self._wakeup.set()

    async def apply(self, fn: Callable[[], T], undo: Callable[[T], object] | None = None) -> T:
        """Run `fn` between two steps and return its result or raise its error: it sees the
        engine at rest (the KV event log, the prefix cache). If the caller is cancelled (a
        deadline, an abort, a lost connection), `fn` still runs and `undo(result)` after it,
        between steps: an `fn` that holds blocks for its caller to hand on needs one."""
        if self._stopping:
            raise EngineShutDown(GONE)
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        def op() -> None:
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 -- handed to the caller, who raises it
                if not done.done():
                    done.set_exception(exc)
                return
            if not done.done():
                done.set_result(result)
            elif undo is not None:  # the caller is gone: nobody takes the result
                undo(result)

        self.apply_soon(op)
        try:
            return await done
        except asyncio.CancelledError:
            ran = done.done() and not done.cancelled() and done.exception() is None
            if undo is not None and ran:  # cancelled once `fn` ran: its result is dropped
                self.apply_soon(functools.partial(undo, done.result()))
            raise

    def start(self, request_id: str, num_samples: int, add: Callable[[], object],
              sink: Sink, params: SamplingParams | None = None) -> None:
        """Between steps: `add` the request to the engine and route its events to `sink`; an
        error of `add` (a bad request) fails it there, leaving nothing behind. With `params`
        asking for a grammar not compiled yet, it is compiled first, off the step thread."""
        if self._stopping:
            sink.fail(request_id, EngineShutDown(GONE))
            sink.flush()
            return
        if params is not None and self.compile_queue.needed(params):
            def failed(exc: Exception) -> None:
                sink.fail(request_id, exc)
                sink.flush()

            self.compile_queue.start_after(request_id, params, failed, lambda: self.start(
                request_id, num_samples, add, sink))
            return

        def op() -> None:
            try:
                add()
            except Exception as exc:  # noqa: BLE001 -- a bad request fails only itself
                sink.fail(request_id, exc)
                sink.flush()
                return
            self.routes.add(request_id, sink, num_samples)

        self.apply_soon(op)

    def generate(self, req: WorkerRequest, sink: Sink) -> None:
        """Run the whole request here; its events go to `sink`."""
        self.start(req.request_id, req.params.n, lambda: self.engine.generate(req), sink,
                   req.params)

    def abort(self, request_id: str) -> None:
        """Cancel a request (applied before the next step); its sink hears nothing more.
        Unknown ids are ignored."""
        self.routes.drop(request_id)
        self.compile_queue.cancel(request_id)

        def op() -> None:  # after any queued start of the same request
            self.routes.drop(request_id)
            self.engine.abort(request_id)

        self.apply_soon(op)

    def stream(self, start: Callable[[Sink], None], request_id: str,
               num_samples: int = 1) -> RequestStream:
        """`start(sink)` with a new `RequestStream` as the sink, returned to iterate."""
        stream = RequestStream(request_id, num_samples, self.abort)
        start(stream)
        return stream

    async def generate_stream(self, prompt: str | list[int], params: SamplingParams,
                              request_id: str | None = None, *,
                              cache_salt: str | None = None) -> AsyncIterator[TokenEvent]:
        """Offline convenience: a request's events (a str prompt is tokenized here). Leaving
        the loop early aborts the request."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = WorkerRequest(rid, tuple(self.engine.tokenize(prompt)), params, cache_salt)
        stream = self.stream(lambda sink: self.generate(req, sink), rid, params.n)
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()

    # ---- the step loop -----------------------------------------------------------------------

    def _step(self) -> tuple[list[TokenEvent], EngineStats, list[KVEvent]]:
        """On the step thread: one step, then the stats and KV events it left."""
        faults.hit("engine.step")
        events = self.engine.step()
        kv_events = self.engine.drain_kv_events() if self.on_publish is not None else []
        return events, self.engine.stats(), kv_events

    async def _run(self) -> None:
        """Steps while there is work. Commands (`apply`, `apply_soon`) run on the loop, only
        while no step runs: the step thread steps on its own until a command waits or no work
        is left (`_steps`), handing each step's events to the loop as the step ends. It waits
        for the loop only when a command does: at one stream of the embedded model, a round
        trip to the loop between steps cost a third of each token's time."""
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
                self._publish_at_rest()
                continue
            try:
                await loop.run_in_executor(self._executor, self._steps, loop)
            except Exception as exc:  # noqa: BLE001 -- a broken step fails every request in flight
                if isinstance(exc, RankGroupError):  # a rank is gone: no step will work again
                    self.watchdog.broken(f"a rank of its group failed: {exc}")
                self._fail_all(exc)
                self._publish_at_rest()
            finally:
                self.watchdog.step_ended()

    def _steps(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the step thread: steps until a command waits, no work is left or `shutdown`
        began. Each step's outcome goes to the loop (`_stepped`) before this returns or raises,
        so the loop sees every event of the steps before the commands that follow them
        (a live migration's pause relies on it)."""
        while True:
            self.watchdog.step_began()
            outcome = self._step()
            self.watchdog.step_ended()
            loop.call_soon_threadsafe(self._stepped, outcome)
            if self._ops or self._stopping or not self.engine.has_unfinished():
                return

    def _stepped(self, outcome: tuple[list[TokenEvent], EngineStats, list[KVEvent]]) -> None:
        """On the loop: a step's events to their sinks, its stats and KV events published."""
        events, self._stats, kv_events = outcome
        self.routes.dispatch(events)
        if self.on_publish is not None:
            self.on_publish(kv_events)

    def _publish_at_rest(self) -> None:
        """No step follows to publish what ops or a failed step's aborts changed (blocks
        freed): the engine is at rest, so reading it here races with nothing."""
        self._stats = self.engine.stats()
        if self.on_publish is not None:
            self.on_publish(self.engine.drain_kv_events())

    def _fail_all(self, exc: BaseException) -> None:
        for rid in self.routes.fail_all(lambda rid: exc):
            self.engine.abort(rid)

    async def shutdown(self) -> None:
        """Stop the step loop; every request still routed fails with `EngineShutDown`."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.compile_queue.shutdown()
        self._executor.shutdown(wait=True)
        self.engine.close()  # a parallel engine's rank processes
        self.routes.fail_all(lambda rid: EngineShutDown(
            f"the engine was shut down while {rid!r} ran"))
