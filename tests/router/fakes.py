"""Scripted fake workers for the router's tests: the `WorkerClient` contract with no engine.

A fake's tokens are a pure function of the prompt and the position, so a stream that moved
between workers must still give exactly the uninterrupted sequence. Each fake is scripted to
fail in a chosen way (refuse, fail before the first token, fail mid-stream, fail the KV pull,
hang) and records what the router asked of it (prefills, streams opened, aborts).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Sequence

from kvtransfer.handoff import Handoff, KVHandoff, KVLayout
from router.config import RouterConfig
from router.counters import RouterCounters
from router.errors import WorkerUnavailableError
from router.failover import Failover
from router.generations import GenerationFactory
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.policies import Policies
from router.worker_client import TokenStream, WorkerClient, WorkerListener
from router.workers import WorkerSet
from workers.contract.calls import Call
from workers.contract.messages import (
    Abort,
    Paused,
    PrefillResult,
    PrefixFetch,
    ResumedSample,
    StreamCommand,
)
from workers.contract.protocol import (
    EngineStats,
    FinishReason,
    InvalidRequestError,
    KVPullFailed,
    TokenEvent,
    WorkerInfo,
    WorkerRequest,
    WorkerRole,
)
from workers.contract.prefix_cache import HotPrefix, KVSnapshot

BLOCK_SIZE = 16
VOCAB = 1000


def token_at(req: WorkerRequest, position: int) -> int:
    """The token every fake samples at output `position` of `req` (deterministic)."""
    return (sum(req.prompt_token_ids) * 31 + position * 7) % VOCAB


def fake_handoff(req: WorkerRequest, worker_id: str) -> KVHandoff:
    """A real, valid handoff record naming blocks nobody will pull (2 layers, 2 heads of 8
    float32 values, one block per 16 prompt tokens or part of it)."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BLOCK_SIZE,
                      dtype="float32")
    blocks = tuple(range(-(-len(req.prompt_token_ids) // BLOCK_SIZE)))
    return KVHandoff((Handoff(req.request_id, f"tcp://{worker_id}:1", layout, blocks,
                              f"lease-{req.request_id}", time.time() + 30.0),))


def expected_tokens(req: WorkerRequest) -> list[int]:
    return [token_at(req, i) for i in range(req.params.max_tokens)]


@dataclass
class Script:
    """How a fake misbehaves. Errors are raised at the scripted point of every stream (or
    prefill) it serves, until `times` streams have failed (None: always)."""

    refuse: bool = False  # InvalidRequestError before the first event / from prefill
    prefill_error: Exception | None = None  # raised by prefill
    stream_error: Exception | None = None  # raised by a stream after `error_after` events
    error_after: int = 0
    fail_pull: bool = False  # decode_from_handoff with a handoff raises KVPullFailed first
    hang_after: int | None = None  # a stream stops yielding (not ending) after this many
    hang_prefill: bool = False
    prefill_s: float = 0.0  # a prefill takes this long (the requests of a burst overlap)
    times: int | None = None


@dataclass
class Calls:
    prefills: list[str] = field(default_factory=list)
    streams: list[tuple[str, str]] = field(default_factory=list)  # (verb, request id)
    aborts: list[str] = field(default_factory=list)
    handoffs: list[object] = field(default_factory=list)  # what decode_from_handoff got
    exports: list[tuple[str, int]] = field(default_factory=list)  # (request id, blocks asked)
    prefixes: list[object] = field(default_factory=list)  # what generate got as `prefix`
    lands: list[tuple[str, int]] = field(default_factory=list)  # (hold id, blocks landed)


class FakeStream:
    """Events of output positions [start, max_tokens), following the worker's script."""

    def __init__(self, worker: FakeWorker, req: WorkerRequest, start: int,
                 first_error: Exception | None = None) -> None:
        self._worker = worker
        self._req = req
        self._pos = start
        self._sent = 0
        self._first_error = first_error
        self._closed = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> TokenEvent:
        await asyncio.sleep(0)  # a real stream always yields to the loop
        s = self._worker.script
        if self._closed or self._pos >= self._req.params.max_tokens:
            raise StopAsyncIteration
        if self._first_error is not None:
            exc, self._first_error = self._first_error, None
            self._closed = True
            raise exc
        if s.refuse and self._sent == 0:
            self._closed = True
            raise InvalidRequestError("the fake refuses it", param="prompt")
        if s.stream_error is not None and self._sent == s.error_after and self._worker.take_failure():
            self._closed = True
            raise s.stream_error
        if s.hang_after is not None and self._sent >= s.hang_after:
            await asyncio.Event().wait()  # until cancelled
        pos, self._pos = self._pos, self._pos + 1
        self._sent += 1
        last = self._pos >= self._req.params.max_tokens
        return TokenEvent(self._req.request_id, 0, [token_at(self._req, pos)], f"<{pos}>",
                          finish_reason=FinishReason.LENGTH if last else None,
                          num_prompt_tokens=len(self._req.prompt_token_ids))

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            if self._pos < self._req.params.max_tokens:
                self._worker.calls.aborts.append(self._req.request_id)


class FakeWorker(WorkerClient):
    def __init__(self, worker_id: str, role: WorkerRole = WorkerRole.BOTH,
                 script: Script | None = None, tp_size: int = 1) -> None:
        self._id = worker_id
        self.role = role
        self.script = script or Script()
        self.calls = Calls()
        self.tp_size = tp_size
        self.listener: WorkerListener | None = None
        self.closed = False
        self._failures = 0
        self.hot: tuple[HotPrefix, ...] = ()  # what `hot_prefixes` answers

    def take_failure(self) -> bool:
        """Whether this scripted failure still happens (counts it)."""
        if self.script.times is not None and self._failures >= self.script.times:
            return False
        self._failures += 1
        return True

    @property
    def worker_id(self) -> str:
        return self._id

    async def info(self) -> WorkerInfo:
        return WorkerInfo(self._id, self.role, BLOCK_SIZE, 4096, VOCAB, 256, self.tp_size)

    def attach(self, listener: WorkerListener) -> None:
        self.listener = listener
        listener.on_outputs(self._id, (), self._stats())

    def _stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 256, 0, 256)

    # a fake is scripted by operation (the methods below), not through the primitives
    def open(self, cmd: StreamCommand) -> TokenStream:
        raise AssertionError(f"a fake worker streams through its named methods, not {cmd}")

    def send(self, cmd: Abort) -> None:
        raise AssertionError(f"a fake worker aborts through `abort`, not {cmd}")

    async def call(self, call: Call[object]) -> object:
        raise AssertionError(f"a fake worker answers its named methods, not {call}")

    def _open(self, verb: str, req: WorkerRequest, start: int) -> TokenStream:
        self.calls.streams.append((verb, req.request_id))
        if self.closed:
            return FakeStream(self, req, start, WorkerUnavailableError(self._id, "closed"))
        return FakeStream(self, req, start)

    def generate(self, req: WorkerRequest, prefix: PrefixFetch | None = None) -> TokenStream:
        self.calls.prefixes.append(prefix)
        return self._open("generate", req, 0)

    async def export_prefix(self, request_id: str, block_hashes: Sequence[int],
                            reader_tp_size: int = 1) -> KVHandoff | None:
        """A handoff of every block asked for (a fake holds what its index says)."""
        self.calls.exports.append((request_id, len(block_hashes)))
        if self.script.refuse or not block_hashes:
            return None
        layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=BLOCK_SIZE,
                          dtype="float32")
        return KVHandoff((Handoff(request_id, f"tcp://{self._id}:1", layout,
                                  tuple(range(len(block_hashes))), f"lease-{request_id}",
                                  time.time() + 30.0),))

    async def prefill(self, req: WorkerRequest, decode_tp_size: int = 1,
                      prefix: PrefixFetch | None = None) -> PrefillResult:
        self.calls.prefills.append(req.request_id)
        self.calls.prefixes.append(prefix)
        s = self.script
        if s.prefill_s:
            await asyncio.sleep(s.prefill_s)
        if s.hang_prefill:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.calls.aborts.append(req.request_id)
                raise
        if s.refuse:
            raise InvalidRequestError("the fake refuses it", param="prompt")
        if s.prefill_error is not None and self.take_failure():
            raise s.prefill_error
        first = TokenEvent(req.request_id, 0, [token_at(req, 0)], "<0>",
                           num_prompt_tokens=len(req.prompt_token_ids))
        if req.params.max_tokens == 1:
            return PrefillResult(first, None)
        return PrefillResult(first, fake_handoff(req, self._id))

    def decode_from_handoff(self, req: WorkerRequest, first_token_id: int,
                            handoff: object) -> TokenStream:
        self.calls.handoffs.append(handoff)
        if handoff is not None and self.script.fail_pull:
            self.calls.streams.append(("decode_from_handoff", req.request_id))
            return FakeStream(self, req, 1, KVPullFailed(req.request_id, "LeaseExpired",
                                                         "the lease ended"))
        return self._open("decode_from_handoff", req, 1)

    def resume(self, req: WorkerRequest, samples: Sequence[ResumedSample]) -> TokenStream:
        (sample,) = samples  # a fake streams one sample
        sent = list(sample.sent_token_ids)
        assert sent == expected_tokens(req)[:len(sent)], \
            "resumed with tokens the client was never sent"
        return self._open("resume", req, len(sent))

    # a fake's streams hold no KV: it refuses to move them, as a worker refuses a request it
    # does not run (the router then leaves the stream where it is)
    async def export_running(self, request_id: str, reader_tp_size: int = 1) -> KVHandoff | None:
        raise InvalidRequestError(f"request {request_id!r} is not running here as one sample",
                                  param="request_id")

    async def hot_prefixes(self, max_blocks: int) -> tuple[HotPrefix, ...]:
        return self.hot

    async def land_prefix(self, request_id: str, fetch: PrefixFetch,
                          token_ids: Sequence[int]) -> int:
        """Lands every block offered (a fake has room for all)."""
        self.calls.lands.append((request_id, len(fetch.block_hashes)))
        return len(fetch.block_hashes)

    async def prepare_migration(self, request_id: str, handoff: KVHandoff) -> int:
        raise KVPullFailed(request_id, "NoKV", "a fake worker holds no KV to pull")

    async def pause(self, request_id: str, reader_tp_size: int = 1) -> Paused:
        raise InvalidRequestError(f"request {request_id!r} is not running here as one sample",
                                  param="request_id")

    async def cancel_migration(self, request_id: str) -> None:
        pass  # a fake never holds a migration's blocks

    async def abort(self, request_id: str) -> None:
        self.calls.aborts.append(request_id)

    async def stats(self) -> EngineStats:
        return self._stats()

    async def kv_snapshot(self) -> KVSnapshot:
        return KVSnapshot(f"epoch-{self._id}", 0, frozenset())

    async def health(self) -> bool:
        return not self.closed

    async def close(self) -> None:
        self.closed = True


async def orchestrator(*workers: FakeWorker, **config: object) -> Orchestrator:
    """An orchestrator over a started worker set of `workers` (no router, no tokenizer); its
    metrics are `o.generations.metrics`."""
    ws = WorkerSet(list(workers))
    await ws.start()
    counters = RouterCounters()
    cfg = RouterConfig("fake-model", **{"disagg_threshold_tokens": 8, **config})  # type: ignore[arg-type]
    metrics = RouterMetrics(ws, counters, lambda: 0)
    policies = Policies.from_config(cfg)
    generations = GenerationFactory(Failover(ws, policies.route, counters, metrics, cfg),
                                    metrics=metrics, migration_retries=cfg.migration_retries)
    return Orchestrator(ws, cfg, policies, counters, generations)
