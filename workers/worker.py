"""A worker: one engine behind an asyncio face, serving one role in the cluster.

Importing this module does not import torch; building a `Worker` does (it builds an engine). The
router reaches a worker through `router.worker_client.WorkerClient` (in process:
`cluster.inprocess_client.InProcessWorkerClient`), never by calling the engine.

The KV handoff: a "prefill" (or "both") worker runs a prompt to its first token with
`prefill()`, which holds the request's blocks and offers them under a lease of its
`TransferAgent`; the lease's end (pulled, cancelled, expired) frees them between steps. A
"decode" (or "both") worker's `decode()` allocates blocks, pulls the handoff into them, and
decodes on. Each worker owns one agent, started on first use with the configured transport.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Sequence

from workers.protocol import (
    FinishReason,
    KVCacheFull,
    KVEvent,
    KVPullFailed,
    KVSnapshot,
    PrefillResult,
    SamplingParams,
    TokenEvent,
)

if TYPE_CHECKING:
    from kvtransfer import TransferAgent
    from workers.async_engine import AsyncEngine
    from workers.config import EngineConfig
    from workers.engine import Engine, EngineStats
    from workers.parallel.group import RankLauncher

logger = logging.getLogger(__name__)

# "both": prefill and decode here (aggregated; may also act as either side of a handoff).
# "prefill": prompts to their first token, then hands the KV off. "decode": continues handoffs.
ROLES = ("both", "prefill", "decode")
PREFILL_ROLES = ("both", "prefill")
DECODE_ROLES = ("both", "decode")


def check_role_fits_engine(role: str, engine: Engine) -> None:
    """Refuses a role that hands KV off ("prefill", "decode") to an engine whose KV cache this
    process cannot reach (a GPU tensor/pipeline-parallel group keeps it on its ranks); such an
    engine serves aggregated, as "both"."""
    if role == "both":
        return
    from workers.parallel.executor import KVCacheNotShared

    try:
        engine.kv_caches_by_rank()
    except KVCacheNotShared as exc:
        raise ValueError(f"a worker of role {role!r} hands KV off, but {exc}") from None


class Worker:
    """One engine serving requests for the router. Owns the engine: `shutdown()` stops it."""

    def __init__(self, worker_id: str, engine: AsyncEngine, role: str = "both", *,
                 transport: str = "tcp", host: str = "127.0.0.1", lease_s: float = 30.0,
                 pull_timeout_s: float = 10.0) -> None:
        """`transport`: the KV transport's name (`kvtransfer.TRANSPORTS`), bound on `host`.
        `lease_s`: how long a prefilled request's blocks wait for their puller at most;
        `pull_timeout_s`: how long a decode waits for its KV to land."""
        if role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {role!r}")
        for name, value in (("lease_s", lease_s), ("pull_timeout_s", pull_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
        check_role_fits_engine(role, engine.engine)
        self.worker_id = worker_id
        self.role = role
        self.async_engine = engine
        self.engine = engine.engine
        self.transport = transport
        self.host = host
        self.lease_s = lease_s
        self.pull_timeout_s = pull_timeout_s
        self._agents: list[TransferAgent] | None = None  # one per tensor-parallel rank
        self._agent_lock = asyncio.Lock()
        # offered blocks -> [request id, leases not yet ended] of the held requests they belong
        # to (one tuple may be held twice); a request holds one lease per TP rank
        self._leased: dict[tuple[int, ...], list[list]] = {}

    @classmethod
    def from_config(cls, worker_id: str, config: EngineConfig, role: str = "both", *,
                    rank_launcher: RankLauncher | None = None, **options: object) -> Worker:
        """`options`: the keyword arguments of `Worker.__init__` (transport, lease_s, ...);
        `rank_launcher`: how a parallel engine starts its ranks (None: spawned processes)."""
        from workers.async_engine import AsyncEngine

        engine = AsyncEngine.from_config(config, rank_launcher)
        try:
            return cls(worker_id, engine, role, **options)  # type: ignore[arg-type]
        except BaseException:
            engine.engine.close()  # a refused worker leaves no rank running
            raise

    @property
    def block_size(self) -> int:
        return self.engine.config.block_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def tp_size(self) -> int:
        return self.engine.config.tensor_parallel_size

    @property
    def num_blocks(self) -> int:
        return self.engine.kv.pool.num_blocks

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 cache_salt: str | None = None) -> AsyncIterator[TokenEvent]:
        """Token events of the request; leaving the iteration early aborts it (see AsyncEngine)."""
        return self.async_engine.generate(prompt_token_ids, params, request_id,
                                          cache_salt=cache_salt)

    def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is here: running, or prefilled and leased (the lease
        ends and its blocks are freed). Unknown ids are ignored.

        NOTE: a lease cancelled while a decode worker reads it frees the blocks under that read;
        only cancel when the decode side is being aborted too."""
        for agent in self._agents or ():
            agent.cancel(request_id)
        self.async_engine.abort(request_id)

    # ---- the KV handoff ----------------------------------------------------------------------

    def _check_role(self, allowed: tuple[str, ...], what: str) -> None:
        if self.role not in allowed:
            raise ValueError(f"worker {self.worker_id!r} has role {self.role!r}; {what} needs "
                             f"one of {allowed}")

    async def agents(self) -> list[TransferAgent]:
        """This worker's transfer agents, one per tensor-parallel rank's shard of the cache
        (each serves and pulls that rank's heads), started (listening) on first use."""
        async with self._agent_lock:
            if self._agents is None:
                from kvtransfer import TransferAgent, TransportConfig, self_check

                # the transport moves a test pattern to itself first: a broken path is an
                # error here, at start, not a slow or failed first handoff
                await self_check(TransportConfig(self.transport, self.host))
                agents = [TransferAgent(layout, caches,
                                        TransportConfig(self.transport, self.host),
                                        on_release=self._on_release)
                          for layout, caches in zip(self.engine.kv_layouts(),
                                                    self.engine.kv_caches_by_rank())]
                for agent in agents:
                    await agent.start()
                self._agents = agents
            return self._agents

    async def prefill(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, cache_salt: str | None = None,
                      kv_readers: int = 1) -> PrefillResult:
        """Run the prompt to its first token (sampled with `params`) and offer its KV under a
        lease per TP rank, or return no handoff when the request ended at that token. The
        handoff is a JSON list of `kvtransfer.Handoff` records, one per rank; `kv_readers`:
        the pulls each rank's lease waits for (decode TP size / this TP size when larger).
        Raises `InvalidRequestError` for a bad request; nothing is held after any error or
        cancel."""
        self._check_role(PREFILL_ROLES, "prefill")
        if kv_readers < 1:
            raise ValueError(f"kv_readers must be at least 1, got {kv_readers}")
        agents = await self.agents()
        first: TokenEvent | None = None
        offered = False
        try:
            async for event in self.async_engine.generate(prompt_token_ids, params, request_id,
                                                          cache_salt=cache_salt,
                                                          prefill_only=True):
                first = event
            # finished: the blocks are held; no await from here to the offer
            if first is None:
                raise RuntimeError(f"prefill of {request_id!r} ended without a token")
            if first.finish_reason is FinishReason.STOP or params.max_tokens == 1:
                return PrefillResult(first, None)  # the request is over (blocks freed below)
            block_ids = self.engine.held_block_ids(request_id)
            handoffs = [agent.offer(request_id, block_ids, lease_s=self.lease_s,
                                    readers=kv_readers) for agent in agents]
            self._leased.setdefault(tuple(block_ids), []).append([request_id, len(agents)])
            offered = True
            return PrefillResult(dataclasses.replace(first, finish_reason=None),
                                 json.dumps([h.to_dict() for h in handoffs],
                                            separators=(",", ":")))
        finally:
            if not offered:  # queued after the abort of an unfinished request
                self.async_engine.apply_soon(lambda: self.engine.free_held(request_id))

    def _on_release(self, block_ids: Sequence[int]) -> None:
        """A lease ended (on the event loop): once every rank's lease of the request ended,
        free its held blocks between steps."""
        key = tuple(block_ids)
        owners = self._leased.get(key)
        if not owners:
            logger.error("worker %s: a lease ended on blocks %s it never offered",
                         self.worker_id, list(key)[:8])
            return
        owners[0][1] -= 1
        if owners[0][1] > 0:
            return
        request_id = owners.pop(0)[0]
        if not owners:
            del self._leased[key]
        self.async_engine.apply_soon(lambda: self.engine.free_held(request_id))

    async def decode(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                     params: SamplingParams,
                     handoff_json: str | None) -> AsyncIterator[TokenEvent]:
        """The events after `first_token_id` (sampled and sent by a prefill worker). With a
        handoff, pull the prompt's KV into fresh blocks first (`KVPullFailed` before any event
        when that fails; nothing is left behind); without, compute the prompt's KV here."""
        self._check_role(DECODE_ROLES, "decode")
        pull = None
        if handoff_json is not None:
            pull = await self._puller(request_id, handoff_json)
        stream = self.async_engine.generate_after_handoff(request_id, list(prompt_token_ids),
                                                          first_token_id, params, pull)
        try:
            async for event in stream:
                yield event
        except KVCacheFull as exc:  # no room to land it now: the router prefills here instead,
            raise KVPullFailed(request_id, str(exc)) from None  # queued until blocks free up
        finally:
            await stream.aclose()

    async def resume(self, request_id: str, prompt_token_ids: list[int],
                     sent_token_ids: list[int],
                     params: SamplingParams) -> AsyncIterator[TokenEvent]:
        """The events after `sent_token_ids`, the request's first output tokens, sampled and
        sent to the client by other workers (one that failed mid-stream): the prompt's and
        their KV are computed here. Greedy output equals an uninterrupted run; seeded sampling
        may differ from here on. Leaving early aborts, as `generate`."""
        self._check_role(DECODE_ROLES, "resume")
        stream = self.async_engine.generate_continuation(request_id, list(prompt_token_ids),
                                                         list(sent_token_ids), params)
        try:
            async for event in stream:
                yield event
        finally:
            await stream.aclose()

    async def _puller(self, request_id: str,
                      handoff_json: str) -> Callable[[list[int]], Awaitable[None]]:
        """The pull of a handoff (one record per prefill TP rank) into given blocks: every
        local rank's agent pulls its heads from the records that hold them. Raises
        `KVPullFailed`."""
        from kvtransfer import Handoff, TransferError

        try:
            records = json.loads(handoff_json)
            records = [records] if isinstance(records, dict) else records
            handoffs = [Handoff.from_dict(d) for d in records]
        except (ValueError, TypeError, TransferError) as exc:
            raise KVPullFailed(request_id, f"{type(exc).__name__}: bad handoff: {exc}") from None
        agents = await self.agents()

        async def pull(block_ids: list[int]) -> None:
            # every rank's pull ends (landed or failed) before the blocks may be reused
            results = await asyncio.gather(*(agent.pull(handoffs, block_ids,
                                                        timeout=self.pull_timeout_s)
                                             for agent in agents), return_exceptions=True)
            for exc in results:
                if isinstance(exc, TransferError):
                    raise KVPullFailed(request_id, f"{type(exc).__name__}: {exc}") from None
                if isinstance(exc, BaseException):
                    raise exc

        return pull

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def drain_kv_events(self) -> list[KVEvent]:
        return await self.async_engine.run_between_steps(self.engine.drain_kv_events)

    async def kv_snapshot(self) -> KVSnapshot:
        return await self.async_engine.run_between_steps(self.engine.kv_snapshot)

    async def shutdown(self) -> None:
        """Stop serving KV (every lease ends) and stop the engine."""
        for agent in self._agents or ():
            await agent.close()
        self._agents = None
        await self.async_engine.shutdown()
