"""A worker: one engine behind an asyncio face, serving one role in the cluster.

Importing this module does not import torch; building a `Worker` does (it builds an engine). The
router reaches a worker through `router.worker_client.WorkerClient` over a channel (in process:
`cluster.inprocess_client`, in a process or a Ray actor of its own: `cluster.socket_calls`),
never by calling the engine. Each call record (`workers.contract.calls`) is answered through
the one table `workers.serving.dispatch`, by this class or one of its parts: the KV handoff
(`workers.serving.handoff`), prefix fetches (`workers.serving.prefix_fetch`), live migrations
(`workers.serving.migration`). `Submit` starts and aborts requests, whose events come back on
that subscriber's output channel (`next_outputs`, one message per step;
`workers.engine.outputs`). Each worker owns one transfer agent, started on first use with the
configured transport (`workers.serving.transfer`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from workers.contract.calls import Embeddings
from workers.contract.tracing import tracing
from workers.contract.messages import (
    Abort,
    Command,
    DecodeFromHandoff,
    Generate,
    PrefillResult,
    PrefixFetch,
    Resume,
    WorkerOutputs,
)
from workers.contract.protocol import (
    EngineOverloaded,
    EngineStats,
    KVPullFailed,
    WorkerInfo,
    WorkerRequest,
    WorkerRole,
)
from workers.engine.outputs import OutputHub
from workers.engine.request import Continuation
from workers.serving.adapters import WorkerAdapters
from workers.serving.async_connector import AsyncConnector
from workers.serving.connector import Connector
from workers.serving.handoff import Handoff
from workers.serving.migration import Migrations
from workers.serving.options import WorkerOptions
from workers.serving.prefix_fetch import PrefixFetcher
from workers.serving.roles import DECODE_ROLES, PREFILL_ROLES, ROLES, check_role_fits_engine
from workers.serving.transfer import WorkerTransfer

if TYPE_CHECKING:
    from kvtransfer import RemoteAgent, TransferAgent
    from kvtransfer.handoff import KVHandoff
    from workers.engine.async_engine import AsyncEngine
    from workers.engine.config import EngineConfig
    from workers.engine.outputs import RequestStream, Sink
    from workers.engine.parallel.group import RankLauncher

logger = logging.getLogger(__name__)


class Worker:
    """One engine serving requests for the router. Owns the engine: `shutdown()` stops it."""

    def __init__(self, worker_id: str, engine: AsyncEngine, role: str = "both", *,
                 transport: str = WorkerOptions.transport, host: str = "127.0.0.1",
                 lease_s: float = WorkerOptions.lease_s,
                 pull_timeout_s: float = WorkerOptions.pull_timeout_s,
                 step_timeout_s: float = WorkerOptions.step_timeout_s,
                 max_waiting_requests: int = WorkerOptions.max_waiting_requests) -> None:
        """`transport`: the KV transport's name (`kvtransfer.TRANSPORTS`), bound on `host`.
        `lease_s`: how long a prefilled request's blocks wait for their puller at most;
        `pull_timeout_s`: how long a decode waits for its KV to land; `step_timeout_s`: a
        step running longer makes the worker unhealthy (`AsyncEngine`'s watchdog);
        `max_waiting_requests`: requests queued here at most; more are refused with
        `EngineOverloaded` (the router tries another worker or answers 429)."""
        if role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {role!r}")
        check_role_fits_engine(role, engine.engine)
        self.worker_id = worker_id
        self.role = role
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1, got {max_waiting_requests}")
        self.max_waiting_requests = max_waiting_requests
        self.async_engine = engine
        engine.watchdog.timeout_s = step_timeout_s
        self.engine = engine.engine
        self.transfer = WorkerTransfer(worker_id, engine.engine, self._free_held,
                                       transport=transport, host=host, lease_s=lease_s,
                                       pull_timeout_s=pull_timeout_s)
        self.connector = Connector(engine.engine)  # the KV handoff's and migration's verbs
        self.async_connector = AsyncConnector(engine, self.connector)
        self.prefixes = PrefixFetcher(self.async_connector, self.transfer)
        self.migrations = Migrations(self.async_connector, self.transfer)
        self.handoff = Handoff(self.async_connector, self.transfer, worker_id)
        self.adapters = WorkerAdapters(engine)  # its LoRA adapters (load, unload)
        self._broken: str | None = None  # why health checks fail (`mark_broken`)
        self._pulls: dict[str, asyncio.Task[None]] = {}  # requests whose KV is being pulled
        self._prefills: dict[str, asyncio.Task[object]] = {}  # prefill() calls under way
        self.outputs = OutputHub(lambda: engine.stats, self.abort)
        engine.on_publish = self.outputs.publish

    @classmethod
    def from_config(cls, worker_id: str, config: EngineConfig, role: str = "both", *,
                    rank_launcher: RankLauncher | None = None, detokenize: bool = False,
                    **options: Any) -> Worker:
        """`options`: the keyword arguments of `Worker.__init__` (transport, lease_s, ...);
        `rank_launcher`: how a parallel engine starts its ranks (None: spawned processes).
        `detokenize` is off: a worker's events carry token ids, and the router makes their
        text and finds stop strings off the step thread (`router.streams`)."""
        from workers.engine.async_engine import AsyncEngine

        engine = AsyncEngine.from_config(config, rank_launcher, detokenize=detokenize)
        try:
            return cls(worker_id, engine, role, **options)
        except BaseException:
            engine.engine.close()  # a refused worker leaves no rank running
            raise

    @property
    def block_size(self) -> int:
        return self.engine.config.block_size

    @property
    def tp_size(self) -> int:
        return self.engine.config.tensor_parallel_size

    @property
    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(self.worker_id, WorkerRole(self.role), self.block_size,
                          e.max_model_len, e.model_config.vocab_size, e.kv.pool.num_blocks,
                          self.tp_size, e.kv_cache_spec.bytes_per_block)

    def submit(self, subscriber: str, commands: Sequence[Command]) -> None:
        """Start or abort requests, in order; the events of those started go to
        `subscriber`'s channel (`next_outputs`), where a refused one arrives as a failure.
        Call on the event loop's thread."""
        box = self.outputs.outbox(subscriber)
        for cmd in commands:
            if isinstance(cmd, Abort):
                self.abort(cmd.request_id)
                continue
            rid = cmd.req.request_id
            box.samples_left[rid] = cmd.num_samples
            try:
                self._check_room(rid)
                self.start(cmd, box)
            except (ValueError, KVPullFailed, EngineOverloaded) as exc:  # a role that cannot,
                # a bad handoff, a full queue
                box.fail(rid, exc)
                box.flush()

    def _check_room(self, request_id: str) -> None:  # `max_waiting_requests` queued: refused
        queued = self.async_engine.num_queued
        if queued >= self.max_waiting_requests:
            raise EngineOverloaded(request_id, f"worker {self.worker_id!r} has {queued} "
                                   f"requests waiting (max_waiting_requests)")

    def start(self, cmd: Generate | DecodeFromHandoff | Resume, sink: Sink) -> None:
        """Start one streaming command with its events to `sink` (a refusal is raised here when
        the role cannot run it, or given to `sink.fail` when the engine refuses it)."""
        e = self.async_engine
        if isinstance(cmd, Generate) and cmd.prefix is not None:
            self._track_pull(cmd.req.request_id, self.prefixes.generate(cmd, sink))
        elif isinstance(cmd, Generate):
            e.generate(cmd.req, sink)
        elif isinstance(cmd, Resume) and cmd.with_kv:
            self._check_role(DECODE_ROLES, "resume")
            self._track_pull(cmd.req.request_id, self.migrations.continue_(cmd, sink))
        elif isinstance(cmd, Resume):
            self._check_role(DECODE_ROLES, "resume")
            self.async_connector.resume(
                cmd.req, [Continuation(s.index, s.sent_token_ids) for s in cmd.samples], sink)
        elif cmd.handoff is None:  # the prefill's KV is not coming: compute it here
            self._check_role(DECODE_ROLES, "decode_from_handoff")
            self.async_connector.resume(cmd.req, [Continuation(0, (cmd.first_token_id,))], sink)
        else:
            self._check_role(DECODE_ROLES, "decode_from_handoff")
            self._track_pull(cmd.req.request_id, self.handoff.pull_and_decode(cmd, sink))

    def _track_pull(self, request_id: str, pull: Coroutine[object, object, None]) -> None:
        """Run a command that pulls KV first as a task an `abort` cancels."""
        task = asyncio.get_running_loop().create_task(pull)
        self._pulls[request_id] = task
        task.add_done_callback(lambda _: self._pulls.pop(request_id, None))

    async def prepare_migration(self, request_id: str,
                                exported: Mapping[int, KVHandoff]) -> dict[int, int]:
        """Pull a moving request's exported blocks ahead of its `Resume`; the blocks landed, by
        sample index."""
        self._check_role(DECODE_ROLES, "prepare_migration")
        return await self.migrations.prepare(request_id, exported, self.transfer.lease_s)

    def stream(self, cmd: Generate | DecodeFromHandoff | Resume) -> RequestStream:
        """One command's events as an async iterator (in-process callers, tests); closing it
        early aborts the request."""
        return self.async_engine.stream(lambda sink: self.start(cmd, sink), cmd.req.request_id,
                                        cmd.num_samples)

    async def next_outputs(self, subscriber: str, timeout_s: float,
                           min_interval_s: float = 0.0) -> WorkerOutputs:
        """`subscriber`'s next message (`workers.engine.outputs.OutputHub.next_outputs`)."""
        return await self.outputs.next_outputs(subscriber, timeout_s, min_interval_s)

    def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is here: running, pulling its KV, or prefilled and
        leased (the lease ends and its blocks are freed). Unknown ids are ignored.

        NOTE: a lease cancelled while a decode worker reads it frees the blocks under that read;
        only cancel when the decode side is being aborted too."""
        self.transfer.cancel(request_id)
        prefill = self._prefills.pop(request_id, None)
        if prefill is not None:  # the prefill() call ends, raising Cancelled
            prefill.cancel()
        pull = self._pulls.pop(request_id, None)
        if pull is not None:
            # its blocks are freed once its read has ended (by the task, and here after it): a
            # read it shares with other pulls goes on (`kvtransfer.pulls`), and blocks freed
            # now could be given to another request and written into
            pull.cancel()
            pull.add_done_callback(lambda _: self.async_engine.abort(request_id))
            return
        self.async_engine.abort(request_id)

    def _check_role(self, allowed: tuple[str, ...], what: str) -> None:
        if self.role not in allowed:
            raise ValueError(f"worker {self.worker_id!r} has role {self.role!r}; {what} needs "
                             f"one of {allowed}")

    async def agents(self) -> list[TransferAgent | RemoteAgent]:
        """This worker's transfer agents, started (`WorkerTransfer.agents`)."""
        return await self.transfer.agents()

    def _free_held(self, request_id: str) -> None:
        self.async_engine.apply_soon(lambda: self.connector.free_held(request_id))

    async def embed(self, token_ids: Sequence[Sequence[int]], pooling: str,
                    normalize: bool) -> Embeddings:
        """`Embed`, between two engine steps (`workers.serving.embed`; imports torch)."""
        from workers.serving.embed import embed
        return await self.async_engine.apply(
            lambda: embed(self.engine, token_ids, pooling, normalize))

    async def prefill(self, req: WorkerRequest, decode_tp_size: int = 1,
                      prefix: PrefixFetch | None = None) -> PrefillResult:
        """Run the prompt to its first token (sampled with its params) and offer its KV under
        a lease per TP rank, or return no handoff when the request ended at that token.
        `decode_tp_size`: the TP size of the worker that will pull it (each lease waits for
        the pulls that many ranks make: `WorkerTransfer.offer`). `prefix`: the prompt's
        leading blocks another worker offers (`export_prefix`), pulled first, not computed (a
        failed pull: computed). Raises `InvalidRequestError` for a bad request; nothing is
        held after any error or cancel; an `abort` of its id (the router's caller went away:
        its cancel cannot cross a process boundary) ends the call with `CancelledError`."""
        self._check_role(PREFILL_ROLES, "prefill")
        if decode_tp_size < 1:
            raise ValueError(f"decode_tp_size must be at least 1, got {decode_tp_size}")
        rid = req.request_id
        self._check_room(rid)
        task = asyncio.current_task()
        assert task is not None
        if rid in self._prefills:
            raise ValueError(f"request id {rid!r} is already being prefilled here")
        self._prefills[rid] = task
        try:
            with tracing().span("worker.prefill", req.traceparent, {"worker": self.worker_id}):
                if prefix is not None:
                    await self.prefixes.land(rid, prefix, req.prompt_token_ids,
                                             self.block_size)
                return await self.handoff.offer_first_token(req, decode_tp_size)
        finally:
            if self._prefills.get(rid) is task:
                del self._prefills[rid]

    def resources(self) -> dict[str, int]:
        """What this worker holds for requests: KV leases offered, blocks held for handoffs,
        pulls and prefill calls under way (all 0 when idle and nothing leaked)."""
        return {"leases": self.transfer.num_leases,
                "held_requests": self.engine.kv.ledger.num_held,
                "pulls": len(self._pulls), "prefills": len(self._prefills)}

    def stats(self) -> EngineStats:
        """The engine's load as of its last step (published by the step thread)."""
        return self.async_engine.stats

    def health(self) -> bool:
        """True while the engine steps and nobody marked this worker broken."""
        return self._broken is None and self.async_engine.is_healthy

    def mark_broken(self, reason: str) -> None:
        """Fail health checks from now on (a planned restart; tests: a broken engine)."""
        self._broken = reason

    async def shutdown(self) -> None:
        """Stop serving KV (every lease ends) and stop the engine."""
        await self.transfer.close()
        await self.async_engine.shutdown()
